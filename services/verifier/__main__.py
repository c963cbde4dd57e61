import sys

from services.verifier.main import main

sys.exit(main())
