import sys

from services.drafter.main import main

sys.exit(main())
