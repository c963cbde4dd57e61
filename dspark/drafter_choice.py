"""Which drafter, and which target layers, a command line asks for: the flags' text parsed once
into typed values.

Glossary
- drafter flag (`--drafter`, `--drafter-dir`): a checkpoint folder; `none` = no drafter (the
  target decodes alone: still exact, just not faster); empty = the command's default, which
  for `dspark generate`, `dspark up`, the verifier and the benchmarks is the shipped
  checkpoint when it is there.
- hidden layer ids (`--hidden-layer-ids` of the verifier): the target layers whose hidden states
  the verifier returns for the drafter; `none` = no features; empty = the drafter checkpoint's
  `target_layer_ids`.
"""

from __future__ import annotations

import os
from pathlib import Path

from dspark.paths import DEFAULT_DRAFTER

NONE = "none"
"""What a drafter flag or `--hidden-layer-ids` says for "no drafter" / "no features"."""


def parse_drafter_dir(text: str | os.PathLike | None) -> Path | None:
    """The drafter folder a flag names, or None for no drafter (`""`, `none` or no flag)."""
    text = "" if text is None else os.fspath(text)
    return None if text in ("", NONE) else Path(text)


def drafter_dir_or_shipped(text: str | os.PathLike | None) -> Path | None:
    """As `parse_drafter_dir`, except that an empty flag (or none given) means the shipped
    drafter (`dspark.paths.DEFAULT_DRAFTER`), or no drafter when it is not there."""
    if text is None or os.fspath(text) == "":
        return DEFAULT_DRAFTER if DEFAULT_DRAFTER.is_dir() else None
    return parse_drafter_dir(text)


def parse_hidden_layer_ids(text: str) -> tuple[int, ...] | None:
    """`--hidden-layer-ids`: `"3,7"` -> (3, 7); `none` -> () (no features); `""` -> None (the
    drafter checkpoint decides). A layer that is not an integer is a ValueError."""
    text = text.strip()
    if not text:
        return None
    if text == NONE:
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"hidden layer ids must be comma-separated integers or {NONE!r}, "
                         f"got {text!r}") from None
