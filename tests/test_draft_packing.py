"""dspark.draft_packing against a brute-force dense reference: whichever representation the
packing picks (dense rows, one shared support, supports padded to the widest, mixed written out
dense), every reader gives the distributions the blocks hold."""

from __future__ import annotations

import pytest
import torch

from dspark.draft_packing import (
    SparseDraftProbs,
    dense_draft_rows,
    draft_prob_of_tokens,
    draft_support,
    pack_draft_probs,
)
from dspark.models.draft_types import DraftBlock

V = 11
GAMMA = 4
CPU = torch.device("cpu")


def dense_reference(blocks: list[DraftBlock], num_drafts: list[int]) -> torch.Tensor:
    """[sum num_drafts, V] float64: each kept row's probability mass added entry by entry."""
    rows = []
    for block, n in zip(blocks, num_drafts):
        for k in range(n):
            row = torch.zeros(V, dtype=torch.float64)
            columns = (block.indices[k].tolist() if block.indices is not None
                       else list(range(V)))
            for column, p in zip(columns, block.probs[k].tolist()):
                row[column] += p
            rows.append(row)
    return torch.stack(rows) if rows else torch.zeros(0, V, dtype=torch.float64)


def shared_support_blocks(count: int, k: int, seed: int) -> list[DraftBlock]:
    """Blocks over one reduced vocabulary: every block's ids a stride-0 view of one row."""
    g = torch.Generator().manual_seed(seed)
    support = torch.randperm(V, generator=g)[:k]  # [k]
    blocks = []
    for _ in range(count):
        probs = torch.softmax(torch.randn(GAMMA, k, generator=g), dim=1)  # [gamma, k]
        pick = torch.multinomial(probs, 1, generator=g).squeeze(1)
        blocks.append(DraftBlock(support[pick], probs, torch.rand(GAMMA, generator=g),
                                 support.expand(GAMMA, -1)))
    return blocks


def dummies(spec: list[int | None], seed: int) -> list[DraftBlock]:
    """One DraftBlock.dummy per entry: None dense, k sparse with k ids per row."""
    g = torch.Generator().manual_seed(seed)
    return [DraftBlock.dummy(GAMMA, V, sparse_k=k, generator=g) for k in spec]


CASES = {
    "dense": (lambda: dummies([None, None, None], 0), torch.Tensor),
    "shared support": (lambda: shared_support_blocks(3, 5, 1), SparseDraftProbs),
    "sparse, one width": (lambda: dummies([3, 3, 3], 2), SparseDraftProbs),
    "sparse, widths padded": (lambda: dummies([1, 4, 2], 3), SparseDraftProbs),
    "mixed sparse and dense": (lambda: dummies([1, None, 3], 4), torch.Tensor),
    "shared support beside another sparse block": (
        lambda: shared_support_blocks(2, 5, 5) + dummies([2], 6), SparseDraftProbs),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_drafts", [[GAMMA, GAMMA, GAMMA], [1, 3, 2]])
def test_every_reader_gives_the_blocks_distributions(case, num_drafts):
    make, representation = CASES[case]
    blocks = make()
    packed = pack_draft_probs(blocks, num_drafts, V, CPU)
    reference = dense_reference(blocks, num_drafts)  # [N, V]
    n = reference.shape[0]
    assert isinstance(packed, representation)
    every = torch.arange(n)
    torch.testing.assert_close(dense_draft_rows(packed, every, V).double(), reference)
    tokens = torch.cat([b.tokens[:k] for b, k in zip(blocks, num_drafts)])  # [N]
    torch.testing.assert_close(draft_prob_of_tokens(packed, tokens).double(),
                               reference[every, tokens])
    some = torch.tensor([0, n - 1, n // 2])  # a selection of rows, out of order
    torch.testing.assert_close(dense_draft_rows(packed, some, V).double(), reference[some])
    for rows in (every, some):
        ids, probs = draft_support(packed, rows, V)  # [len(rows), k]
        assert ids.shape == probs.shape and ids.shape[0] == rows.shape[0]
        scattered = torch.zeros(rows.shape[0], V, dtype=torch.float64)
        scattered.scatter_add_(1, ids, probs.double())
        torch.testing.assert_close(scattered, reference[rows])


def test_one_shared_support_stays_one_expanded_row():
    blocks = shared_support_blocks(3, 5, 7)
    packed = pack_draft_probs(blocks, [2, 4, 1], V, CPU)
    assert isinstance(packed, SparseDraftProbs)
    assert packed.indices.shape == (7, 5) and packed.indices.stride(0) == 0
    torch.testing.assert_close(packed.shared_support, blocks[0].indices[0])


def test_supports_of_different_widths_pad_to_the_widest_with_zero_probability():
    blocks = dummies([1, 4, 2], 8)
    packed = pack_draft_probs(blocks, [GAMMA] * 3, V, CPU)
    assert packed.indices.shape == (3 * GAMMA, 4)
    assert packed.probs[:GAMMA, 1:].abs().sum() == 0  # the k = 1 block's padding
    assert packed.shared_support is None


def test_no_drafts_pack_to_an_empty_dense_batch():
    packed = pack_draft_probs([], [], V, CPU)
    assert isinstance(packed, torch.Tensor) and packed.shape == (0, V)
