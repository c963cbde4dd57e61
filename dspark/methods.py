"""The drafting methods, in one registry: what kind of drafter each trains (`DrafterKind`, the
`--method` of `dspark train`) and the evaluated methods (`METHODS`, the `--methods` of
`dspark eval` and the engine rows of `dspark bench`): which checkpoint folder each loads, which
kind of drafter that folder holds, and how many of its drafts the target verifies (docs/design.md
section 8).

Glossary
- drafter kind: the architecture `dspark train` builds: the DSpark drafter with a Markov or RNN
  sequential head, the same backbone without one (DFlash), or the Eagle-style autoregressive
  drafter.
- method: one row of the evaluation table: `dspark` (DSpark, Markov head), `dspark-rnn`, `dflash`
  (no sequential head), `eagle` (Eagle-style autoregressive drafter) and `mtp1` (the
  DSpark-markov drafter with exactly one draft token verified per round, the paper's MTP-1-like
  production baseline).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dspark.models.drafter_config import SequentialHead


class DrafterKind(str, enum.Enum):
    """The drafter `dspark train --method` builds; the values are the flag's."""

    MARKOV = "markov"
    """DSpark: parallel backbone plus the low-rank Markov head."""
    RNN = "rnn"
    """DSpark with the gated recurrent head."""
    DFLASH = "none"
    """The parallel backbone alone (no sequential head): the DFlash baseline."""
    EAGLE = "eagle"
    """The Eagle-style autoregressive drafter (one layer, its own architecture)."""

    @property
    def sequential_head(self) -> SequentialHead | None:
        """The DSpark drafter's head for this kind; None for the Eagle-style drafter."""
        return None if self is DrafterKind.EAGLE else SequentialHead(self.value)


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
    kind: DrafterKind
    """What kind of drafter that folder holds."""
    verify: VerifyLength
    label: str
    """Row label of the markdown table."""


METHODS: dict[str, MethodSpec] = {
    "dspark": MethodSpec("dspark", "dspark-markov", DrafterKind.MARKOV, VerifyLength.FULL_BLOCK,
                         "DSpark (markov)"),
    "dspark-rnn": MethodSpec("dspark-rnn", "dspark-rnn", DrafterKind.RNN, VerifyLength.FULL_BLOCK,
                             "DSpark (rnn)"),
    "dflash": MethodSpec("dflash", "dflash", DrafterKind.DFLASH, VerifyLength.FULL_BLOCK, "DFlash"),
    "eagle": MethodSpec("eagle", "eagle", DrafterKind.EAGLE, VerifyLength.FULL_BLOCK, "Eagle-style"),
    "mtp1": MethodSpec("mtp1", "dspark-markov", DrafterKind.MARKOV, VerifyLength.ONE, "MTP-1-like"),
}
ALIASES = {"dspark-markov": "dspark", "markov": "dspark", "rnn": "dspark-rnn", "mtp-1": "mtp1"}


def parse_names(text: str, known: Iterable[str], aliases: Mapping[str, str]) -> list[str]:
    """Comma-separated names (case-insensitive, aliases allowed) -> canonical names in the given
    order, each once; ValueError naming the known ones on an unknown name or on none at all."""
    known = list(known)
    names: list[str] = []
    for raw in text.split(","):
        raw = raw.strip().lower()
        if not raw:
            continue
        name = aliases.get(raw, raw)
        if name not in known:
            raise ValueError(f"unknown method {raw!r}; known: {', '.join(known)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("no methods given")
    return names


def parse_methods(text: str) -> list[str]:
    """`--methods` of `dspark eval` -> METHODS keys, in the given order."""
    return parse_names(text, METHODS, ALIASES)


def checkpoint_folder(checkpoints: Path, method: str) -> Path:
    return Path(checkpoints) / METHODS[method].folder
