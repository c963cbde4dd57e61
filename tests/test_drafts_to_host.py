"""The round's drafted tokens and confidences on the host in one copy (dspark/drafts_to_host.py),
and the drafter context's latest visible state found without reading the device
(RequestContext.last_hidden), each against a plain reference."""

from __future__ import annotations

import pytest
import torch

from dspark.drafts_to_host import drafts_to_host
from dspark.models.context_kv_cache import RequestContext
from dspark.models.draft_types import DraftBlock

from .pretend_device import PretendDevice


def test_tokens_and_confidences_cross_in_one_copy_exactly():
    g = torch.Generator().manual_seed(0)
    blocks = [DraftBlock.dummy(3, 50, sparse_k=4, generator=g) for _ in range(5)]
    blocks[1].tokens[:] = torch.tensor([2**40 + 7, 49151, 0])  # large ids survive float64
    blocks[2].confidences[1] = float("nan")  # a drafter without a confidence head
    expect_tokens = [b.tokens.clone() for b in blocks]
    expect_conf = torch.stack([b.confidences for b in blocks])
    device = PretendDevice()
    device.place(*[t for b in blocks for t in (b.tokens, b.probs, b.confidences, b.indices)])
    with device:
        host_blocks, confidences = drafts_to_host(blocks)
        assert device.syncs == 1, dict(device.sync_calls)
        assert not any(device.is_on_device(b.tokens) for b in host_blocks)
        assert all(device.is_on_device(b.probs) for b in host_blocks)  # left where they are
    assert not device.is_on_device(confidences) and confidences.dtype == torch.float32
    torch.testing.assert_close(confidences, expect_conf, equal_nan=True, rtol=0, atol=0)
    for b, t in zip(host_blocks, expect_tokens):
        assert b.tokens.dtype == torch.int64 and torch.equal(b.tokens, t)


def test_blocks_on_the_host_make_no_copy():
    blocks = [DraftBlock.dummy(2, 10, generator=torch.Generator().manual_seed(1))]
    host_blocks, confidences = drafts_to_host(blocks)
    assert host_blocks[0].tokens is blocks[0].tokens or torch.equal(host_blocks[0].tokens,
                                                                    blocks[0].tokens)
    assert torch.equal(confidences, blocks[0].confidences[None])


def _last_hidden_reference(positions: list[int], anchor: int) -> int | None:
    """The slot of the latest appended position among the largest ones below the anchor."""
    visible = [p for p in positions if p < anchor]
    if not visible:
        return None
    best = max(visible)
    return max(i for i, p in enumerate(positions) if p == best)


@pytest.mark.parametrize("pieces", [[[0, 1, 2], [3, 4], [5]],  # in order: the last slot
                                    [[0, 1, 2], [3, 4], [2, 3], [9], [5, 6]]])  # out of order
def test_last_hidden_matches_the_reference_without_reading_the_device(pieces):
    ctx = RequestContext(1, 1, 4, torch.float32, torch.device("cpu"), capacity=2, hidden_size=3)
    flat: list[int] = []
    for piece in pieces:
        n = len(piece)
        host = torch.tensor(piece)
        ctx.append(torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4), host,
                   torch.arange(len(flat), len(flat) + n, dtype=torch.float32)[:, None]
                   .expand(n, 3).clone(), host_positions=host)
        flat += piece
    device = PretendDevice()
    device.place(ctx)  # its buffers as on the device, its position bounds on the host
    found = {}
    with device:
        for anchor in range(12):
            found[anchor] = ctx.last_hidden(anchor)
    assert device.syncs == 0, dict(device.sync_calls)
    for anchor, got in found.items():
        slot = _last_hidden_reference(flat, anchor)
        if slot is None:
            assert got is None, anchor
        else:
            assert torch.equal(got, torch.full((3,), float(slot))), (anchor, got, slot)
