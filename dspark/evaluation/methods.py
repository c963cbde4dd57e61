"""The evaluated methods (DESIGN.md section 8): which checkpoint subfolder each loads and how
many of its drafts the target verifies.

Glossary
- method: one row of the evaluation table: `dspark` (DSpark, Markov head), `dspark-rnn`, `dflash`
  (no sequential head), `eagle` (Eagle-style autoregressive drafter) and `mtp1` (the
  DSpark-markov drafter with exactly one draft token verified per round, the paper's MTP-1-like
  production baseline).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path


class VerifyLength(enum.Enum):
    """How many drafts of each round the target verifies during evaluation."""

    FULL_BLOCK = "full"
    """All gamma drafts (`fixed:gamma`): raw draft quality, no scheduler (the paper's Table 1)."""
    ONE = "one"
    """Exactly one draft (`fixed:1`): the MTP-1-like baseline."""


@dataclass(frozen=True)
class MethodSpec:
    """One evaluated method: which checkpoint subfolder it loads and how it is verified."""

    name: str
    """Key in `--methods` and in the JSON output."""
    folder: str
    """Subfolder of the checkpoints folder holding its drafter."""
    verify: VerifyLength
    label: str
    """Row label of the markdown table."""


METHODS: dict[str, MethodSpec] = {
    "dspark": MethodSpec("dspark", "dspark-markov", VerifyLength.FULL_BLOCK, "DSpark (markov)"),
    "dspark-rnn": MethodSpec("dspark-rnn", "dspark-rnn", VerifyLength.FULL_BLOCK, "DSpark (rnn)"),
    "dflash": MethodSpec("dflash", "dflash", VerifyLength.FULL_BLOCK, "DFlash"),
    "eagle": MethodSpec("eagle", "eagle", VerifyLength.FULL_BLOCK, "Eagle-style"),
    "mtp1": MethodSpec("mtp1", "dspark-markov", VerifyLength.ONE, "MTP-1-like"),
}
ALIASES = {"dspark-markov": "dspark", "markov": "dspark", "rnn": "dspark-rnn", "mtp-1": "mtp1"}


def parse_methods(text: str) -> list[str]:
    """Comma-separated method names (aliases allowed) -> canonical names, in the given order."""
    names: list[str] = []
    for raw in text.split(","):
        raw = raw.strip().lower()
        if not raw:
            continue
        name = ALIASES.get(raw, raw)
        if name not in METHODS:
            raise ValueError(f"unknown method {raw!r}; known: {', '.join(METHODS)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("no methods given")
    return names


def checkpoint_folder(checkpoints: Path, method: str) -> Path:
    return Path(checkpoints) / METHODS[method].folder
