"""Put the checkout on sys.path, so `loadtest/` (a folder of the repository) imports from it
however pytest is started."""

import sys

from dspark.paths import REPO_ROOT

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
