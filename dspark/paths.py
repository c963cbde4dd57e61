"""Where the project's files are: the repository root, the shipped drafter, and the shared data.

The package runs from its checkout (`pip install -e .`), so these are paths inside it; services,
the CLI and the benchmarks take them as defaults that a flag can override.

The shared folder (`data/eval`, `data/train`) is not part of the repository: it
stands beside the checkout as `../shared`, or wherever the environment variable
`DSPARK_SHARED_DIR` says (a checkout placed elsewhere, e.g. a clone under /tmp).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS_DIR = REPO_ROOT / "checkpoints"
DEFAULT_DRAFTER = CHECKPOINTS_DIR / "dspark-markov"
"""The shipped DSpark drafter (Markov head) that `dspark generate`, `dspark up` and the services
serve unless told otherwise."""

SHARED_DIR_ENV = "DSPARK_SHARED_DIR"
SHARED_DIR = (Path(os.environ[SHARED_DIR_ENV]).expanduser().resolve()
              if os.environ.get(SHARED_DIR_ENV) else REPO_ROOT.parent / "shared")
"""The shared data folder: `$DSPARK_SHARED_DIR` when that variable is set (and not empty), else
`shared/` beside the repository root. Read once, at import."""
EVAL_PROMPTS_DIR = SHARED_DIR / "data" / "eval"
"""The eval sets, `<name>.jsonl` with one `{"turns": [...]}` per line (gsm8k, humaneval, ...)."""
TRAIN_PROMPTS_DIR = SHARED_DIR / "data" / "train"
"""The training prompt files (`*.jsonl`: id, source, domain, prompt) of `dspark data generate`."""


def require_folder(path: Path, what: str) -> Path:
    """`path` when it is a folder; else FileNotFoundError naming it, the shared folder and
    DSPARK_SHARED_DIR, so that a checkout without `../shared` beside it says how to find the data."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{what} not found: {path} is not a folder (the shared folder is {SHARED_DIR}; set "
            f"{SHARED_DIR_ENV} to the folder that holds data/eval and data/train)")
    return path
