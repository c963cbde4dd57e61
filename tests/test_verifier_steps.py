"""The verifier's pure steps without a model (dspark.verifier): `pack_round` lays out the forward
and the drafts, `verify_round` decides on given logits exactly as the per-request reference does
on the same blocks and keyed draws, and reads each final chunk's first token from its own row."""

from __future__ import annotations

import pytest
import torch

from dspark.models.draft_types import DraftBlock
from dspark.random_draws import CounterGenerator, draw_uniforms
from dspark.rejection import VerificationRule, VerifyBatch, sample_first_tokens, verify_reference
from dspark.sampling import SamplingParams, SamplingTensors
from dspark.verifier import PrefillChunk, VerifyRequest, pack_round, verify_round

V = 9
GAMMA = 4
CPU = torch.device("cpu")
ANCHORS = [5, 9, 2, 7]
CHUNK_STARTS = [0, 3]


def round_inputs(seed: int) -> tuple[list[VerifyRequest], list[PrefillChunk]]:
    """A dense sampled block, a sparse greedy one (k = 1), a plain step, a sparse sampled block
    (k = 3); a continued chunk that ends its prompt and a new one that does not."""
    g = torch.Generator().manual_seed(seed)
    sampled, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0)
    requests = [
        VerifyRequest("a", 1, DraftBlock.dummy(GAMMA, V, generator=g), 3, sampled,
                      CounterGenerator(seed + 1)),
        VerifyRequest("b", 2, DraftBlock.dummy(GAMMA, V, sparse_k=1, generator=g), 2, greedy,
                      CounterGenerator(seed + 2)),
        VerifyRequest("c", 3, None, 0, sampled, CounterGenerator(seed + 3)),
        VerifyRequest("d", 4, DraftBlock.dummy(GAMMA, V, sparse_k=3, generator=g), 4, sampled,
                      CounterGenerator(seed + 4)),
    ]
    chunks = [PrefillChunk("e", [6, 7], True, sampled, CounterGenerator(seed + 5), continued=True),
              PrefillChunk("f", [8, 1, 2], False, sampled, CounterGenerator(seed + 6))]
    return requests, chunks


def test_pack_lays_out_the_forward_and_the_drafts():
    requests, chunks = round_inputs(0)
    packed = pack_round(requests, chunks, ANCHORS, CHUNK_STARTS, V, CPU)
    lens = [3, 2, 0, 4]
    assert packed.draft_lens.tolist() == lens
    assert packed.drafts == [r.block.tokens[:n].tolist() if n else []
                             for r, n in zip(requests, lens)]
    assert [list(i.token_ids) for i in packed.items] == (
        [[r.anchor_token] + d for r, d in zip(requests, packed.drafts)] + [[6, 7], [8, 1, 2]])
    assert [i.logits_from for i in packed.items] == [0, 0, 0, 0, None, 3]
    assert packed.num_verify_rows == sum(lens) + len(requests)
    assert packed.draft_tokens.tolist() == [t for d in packed.drafts for t in d]


@pytest.mark.parametrize("rule", [VerificationRule.TOKEN, VerificationRule.BLOCK])
@pytest.mark.parametrize("seed", range(4))
def test_verify_round_matches_the_reference_on_the_same_draws(rule, seed):
    requests, chunks = round_inputs(seed)
    packed = pack_round(requests, chunks, ANCHORS, CHUNK_STARTS, V, CPU)
    logits = 3 * torch.randn(packed.num_verify_rows + 1, V,
                             generator=torch.Generator().manual_seed(100 + seed))
    verdict = verify_round(packed, logits, rule)

    lens = [r.num_drafts if r.block is not None else 0 for r in requests]
    admitted = [(r.block, n) for r, n in zip(requests, lens) if n]
    batch = VerifyBatch(  # the drafts written out dense, independently of the packing
        draft_tokens=torch.cat([b.tokens[:n] for b, n in admitted]),
        draft_lens=torch.tensor(lens), draft_probs=torch.cat([b.dense(V)[:n] for b, n in admitted]),
        target_logits=logits[:packed.num_verify_rows], sampling=[r.sampling for r in requests])
    draws = draw_uniforms(batch.draft_lens, [r.generator for r in requests], ANCHORS)
    expected = verify_reference(batch, draws, rule)
    assert verdict.num_accepted == expected.num_accepted.tolist()
    assert verdict.output_tokens == expected.output_tokens(batch)

    final = chunks[0]
    first = sample_first_tokens(logits[-1:], SamplingTensors.from_params([final.sampling]),
                                [final.generator], [CHUNK_STARTS[0] + len(final.token_ids)], rule)
    assert verdict.first_tokens.tolist() == first.tolist()


def test_verify_round_with_chunks_only_verifies_nothing():
    _, chunks = round_inputs(0)
    packed = pack_round([], chunks, [], CHUNK_STARTS, V, CPU)
    verdict = verify_round(packed, torch.randn(1, V))
    assert verdict.batch is None and verdict.num_accepted == [] and verdict.output_tokens == []
    assert verdict.first_tokens.shape == (1,)
