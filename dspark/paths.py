"""Where the project's own files are: the repository root and the shipped drafter.

The package runs from its checkout (`pip install -e .`), so these are paths inside it; services,
the CLI and the benchmarks take them as defaults that a flag can override.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS_DIR = REPO_ROOT / "checkpoints"
DEFAULT_DRAFTER = CHECKPOINTS_DIR / "dspark-markov"
"""The shipped DSpark drafter (Markov head) that `dspark generate`, `dspark up` and the services
serve unless told otherwise."""
