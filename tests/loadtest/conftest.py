"""`loadtest/` is a folder of the repository, not an installed package: make it importable
however pytest is started (the services and dspark packages are installed, it is not)."""

import sys
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[2])
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
