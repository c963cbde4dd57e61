"""A pass's metadata to the device in one copy (docs/design.md section 7).

The runner builds each pass's integer metadata (token ids, positions, cache slots, block tables,
query starts, context lengths, the rows that need logits) on the host. `upload` lays the pieces
out in one int64 host buffer, pinned when the device is an accelerator, and moves it with one
non-blocking copy; the pieces come back as views of the device copy. The host does not wait for
the device (a copy from pinned memory is queued behind the work already on the stream), and the
caching host allocator keeps the buffer until the copy is done. On a CPU the "copy" is the
buffer itself.
"""

from __future__ import annotations

from typing import Sequence

import torch


def pins_memory(device: torch.device) -> bool:
    """Whether a host buffer bound for `device` is pinned: an accelerator that is there."""
    return device.type != "cpu" and torch.accelerator.is_available()


def upload(pieces: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """int64 host tensors (any shapes) -> the same on `device`, views of one device tensor,
    moved in one non-blocking copy from one (pinned) host buffer."""
    sizes = [p.numel() for p in pieces]
    buffer = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=pins_memory(device))
    torch.cat([p.reshape(-1) for p in pieces], out=buffer)
    moved = buffer.to(device, non_blocking=True)  # [sum sizes]: the one copy
    out, start = [], 0
    for piece, size in zip(pieces, sizes):
        out.append(moved[start:start + size].view(piece.shape))
        start += size
    return out
