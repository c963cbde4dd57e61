"""The rows of `dspark bench`'s tables (`--methods`): what each runs (our engine with a drafter
and policy, or a transformers peer) and how its name is read."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dspark.cost_table import ThetaObjective
from dspark.methods import parse_names


class RowKind(enum.Enum):
    ENGINE = "engine"
    """Our embedded engine (target runner + optional drafter + admission policy)."""
    HF_GENERATE = "hf_generate"
    """transformers `generate`, batched with left padding."""
    HF_PROMPT_LOOKUP = "hf_prompt_lookup"
    """transformers prompt-lookup decoding, batch 1."""


FULL_BLOCK = "fixed:gamma"
"""Policy placeholder resolved to `fixed:<the drafter's gamma>` once the drafter is loaded."""


@dataclass(frozen=True)
class RowSpec:
    """One row of the tables."""

    name: str
    """Key in `--methods` and in the JSON."""
    label: str
    kind: RowKind
    method: str | None = None
    """`dspark.methods.METHODS` key naming the drafter's checkpoint folder."""
    policy: str = "none"
    """Admission policy of engine rows."""
    objective: ThetaObjective | None = None
    """What engine rows' admission maximises (AdmissionConfig.objective; None: its default, the
    one served; only async_topk and sync_greedy read it)."""
    drafter_dtype: str | None = None
    """The drafter's dtype (dense weights); None: `dspark.loading.drafter_dtype`'s choice, as served."""
    drafter_weights: str | None = None
    """The drafter's weights ("q8" | "dense", `dspark.loading.choose_drafter_weights`); None:
    `--drafter-weights`, else the choice served (a drafter_dtype asks for dense)."""
    verification: str | None = None
    """How engine rows verify sampled drafts (`VerificationRule`); None: `--verification`."""


ROWS: dict[str, RowSpec] = {r.name: r for r in (
    RowSpec("target", "target only (our engine)", RowKind.ENGINE),
    RowSpec("mtp1", "MTP-1-like (fixed:1)", RowKind.ENGINE, "mtp1", "fixed:1"),
    RowSpec("dflash", "DFlash (full block)", RowKind.ENGINE, "dflash", FULL_BLOCK),
    RowSpec("dspark", "DSpark (async_topk)", RowKind.ENGINE, "dspark", "async_topk"),
    RowSpec("dspark-paper", "DSpark (async_topk, drafting taken as free)", RowKind.ENGINE, "dspark",
            "async_topk", ThetaObjective.PAPER),
    RowSpec("dspark-fp32-drafter", "DSpark (async_topk, float32 drafter)", RowKind.ENGINE,
            "dspark", "async_topk", drafter_dtype="float32"),
    RowSpec("dspark-q8-drafter", "DSpark (async_topk, Q8_0 drafter)", RowKind.ENGINE, "dspark",
            "async_topk", drafter_weights="q8"),
    RowSpec("dspark-block", "DSpark (async_topk, block verification)", RowKind.ENGINE, "dspark",
            "async_topk", verification="block"),
    RowSpec("dspark-sync", "DSpark (sync_greedy)", RowKind.ENGINE, "dspark", "sync_greedy"),
    RowSpec("dspark-full", "DSpark (full block)", RowKind.ENGINE, "dspark", FULL_BLOCK),
    *(RowSpec(f"dspark-fixed{n}", f"DSpark (fixed:{n})", RowKind.ENGINE, "dspark", f"fixed:{n}")
      for n in (2, 3)),
    RowSpec("hf-generate", "transformers generate", RowKind.HF_GENERATE),
    RowSpec("hf-prompt-lookup", "transformers prompt lookup", RowKind.HF_PROMPT_LOOKUP),
)}
ROW_ALIASES = {"none": "target", "target-only": "target", "mtp-1": "mtp1", "hf": "hf-generate",
               "sync_greedy": "dspark-sync", "dspark-sync-greedy": "dspark-sync",
               "pld": "hf-prompt-lookup", "prompt-lookup": "hf-prompt-lookup"}


def parse_rows(text: str) -> list[str]:
    """Comma-separated row names (aliases allowed) -> canonical names in table order."""
    chosen = parse_names(text, ROWS, ROW_ALIASES)
    return [name for name in ROWS if name in chosen]
