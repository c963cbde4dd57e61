"""A round's drafted blocks read on the host in one device-to-host copy (docs/design.md section 6).

Before verification the host needs two things from the drafter's blocks: the confidences, from
which the admission decides how many drafts of each request the target verifies, and the draft
tokens, which the target's forward reads as its input ids. Both cross in one copy, so that
drafting and admission wait for the device once a round; the blocks' distributions stay on the
device, where the verifier reads them.

Tokens and confidences travel as one float64 tensor: a token id (< 2^53) and a float32 value
are both exact in float64.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from dspark.models.draft_types import DraftBlock


def drafts_to_host(blocks: Sequence[DraftBlock]) -> tuple[list[DraftBlock], torch.Tensor]:
    """(the blocks with their tokens [n] on the host, confidences [S, n] float32 on the host),
    for S blocks of n positions each, in one device-to-host copy (none when every block is on
    the host already, as a remote drafter's are)."""
    if not blocks:
        return [], torch.zeros(0, 0)
    tokens = torch.stack([b.tokens for b in blocks])  # [S, n] int64
    confidences = torch.stack([b.confidences for b in blocks]).float()  # [S, n]
    if tokens.device.type != "cpu" or confidences.device.type != "cpu":
        packed = torch.cat([tokens.to(confidences.device, torch.float64),
                            confidences.double()], dim=1).cpu()  # [S, 2n]: the one copy
        n = tokens.shape[1]
        tokens = packed[:, :n].to(torch.int64)
        confidences = packed[:, n:].float()
    return ([dataclasses.replace(b, tokens=t) for b, t in zip(blocks, tokens)],
            confidences)
