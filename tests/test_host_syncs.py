"""Host-device synchronisations per round, counted on the CPU (tests/pretend_device.py: reading
a device tensor's values on the host, or an op whose output shape depends on them), with the
engine's runner and drafter on a pretend CUDA device. DSPARK_SYNC_STACKS=1 prints the stack of
each one.

A steady round makes at most 3 at 1 and at 64 requests, greedy, T=1, and T=1 with top_p=0.9,
top_k=50 or the penalties, under `fixed:3` and `async_topk`, and at T=1 (plain, top_p, top_k)
under the block and the drafter-invariant rules too: it makes 2, the drafted blocks' tokens and
confidences to the host in one copy (dspark/drafts_to_host.py: the admission reads the
confidences, the target's forward the tokens) and the verification's results (accepted counts, tokens, the check that every draft
has probability > 0) in one copy (VerifyResult.to_host). The verifier's part (the target
forward, draft-probability packing, sampling, rejection and its copy) makes at most 1 of them.
Counted the same way before (base 8bab729 with the device fixes), whole rounds made 27 / 67 at
1 request (greedy / T=1) and 153 / 193 at 64; before the drafter sampled with the kinds of its
rows known on the host and kept its context's bounds on the host, 5 / 20 and 68 / 83. Before
the block rule's sampled path took its rows and widths from the host, its verification alone
made 22 at T=1 (1 and 64 requests); the drafter-invariant rule's rounds made 13 at T=1 and 8
greedy.
"""

from __future__ import annotations

import pytest
import torch

from dspark.cost_table import CostTable
from dspark.drafting_gate import RoundMode
from dspark.engine import Engine, EngineConfig
from dspark.models.runner import ForwardItem, RunnerConfig, TargetRunner
from dspark.models.transformer import AttentionImpl
from dspark.rejection import VerificationRule
from dspark.sampling import SamplingParams
from dspark.verifier import TargetVerifier
from loadtest.tiny_models import LAYER_IDS

from .conftest import tiny_dspark
from .pretend_device import PretendDevice

VERIFIER_BOUND = 1
ROUND_BOUND = 3
# A flat table, a round's cost nearly independent of its tokens: under it every draft pays, so
# async_topk drafts and verifies every request's block in the counted round, greedy or sampled.
TABLE = {b: 1.0 + 1e-6 * b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)}
PENALTIES = dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3)


def count_round(folder, requests: int, temperature: float, policy: str = "fixed:3",
                rule: VerificationRule = VerificationRule.TOKEN,
                **sampling) -> tuple[int, int, dict]:
    """(whole round, verifier.verify) syncs of the 4th round, and the round's calls by name.
    The round drafts every request and verifies drafts (else it would count too little)."""
    device = PretendDevice()
    runner = TargetRunner(folder, RunnerConfig(hidden_layer_ids=LAYER_IDS, kv_cache_tokens=16384,
                                               cpu_packed_weights=False))
    drafter = tiny_dspark(0, runner)
    device.place_runner(runner)
    device.place(drafter)
    engine = Engine(TargetVerifier(runner, rule=rule), drafter, CostTable.from_step_seconds(TABLE),
                    EngineConfig().with_values(policy=policy, max_running=requests,
                                                update_cost_table=False))
    verify = engine.verifier.verify
    in_verify = []

    def counted(*args, **kwargs):
        before = device.syncs
        out = verify(*args, **kwargs)
        in_verify.append(device.syncs - before)
        return out

    engine.verifier.verify = counted
    for i in range(requests):
        engine.add_request([3 + i % 50, 9, 27, 17],
                           SamplingParams(temperature=temperature, seed=i, **sampling),
                           max_tokens=40)
    with device:
        for _ in range(3):  # prompts read, then steady rounds
            engine.step()
        device.reset_counts()
        in_verify.clear()
        stats = engine.step().stats
    assert stats.mode is RoundMode.DRAFT and stats.drafts_admitted >= requests, stats
    return device.syncs, sum(in_verify), dict(device.sync_calls)


@pytest.mark.parametrize("policy", ["fixed:3", "async_topk"])
@pytest.mark.parametrize("requests", [1, 64])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_round_syncs_at_most_the_bound(tiny_target, requests, temperature, policy):
    folder, _ = tiny_target
    whole, in_verify, calls = count_round(folder, requests, temperature, policy)
    assert in_verify <= VERIFIER_BOUND, calls
    assert whole <= ROUND_BOUND, calls


@pytest.mark.parametrize("policy", ["fixed:3", "async_topk"])
@pytest.mark.parametrize("requests", [1, 64])
@pytest.mark.parametrize("filters", [dict(top_p=0.9), dict(top_k=50), PENALTIES],
                         ids=["top_p", "top_k", "penalties"])
def test_a_filtered_round_syncs_at_most_the_bound(tiny_target, requests, filters, policy):
    """The nucleus search (top_p < 1) and the top-k cut, in the drafter's sampling and the
    target's, and the penalties (dspark.logits_processing, every column off the CPU) read
    nothing on the host either."""
    folder, _ = tiny_target
    whole, in_verify, calls = count_round(folder, requests, 1.0, policy, **filters)
    assert in_verify <= VERIFIER_BOUND, calls
    assert whole <= ROUND_BOUND, calls


@pytest.mark.parametrize("policy", ["fixed:3", "async_topk"])
@pytest.mark.parametrize("requests", [1, 64])
@pytest.mark.parametrize("rule", [VerificationRule.BLOCK, VerificationRule.DRAFTER_INVARIANT])
@pytest.mark.parametrize("filters", [{}, dict(top_p=0.9), dict(top_k=50)],
                         ids=["plain", "top_p", "top_k"])
def test_the_other_rules_round_syncs_at_most_the_bound(tiny_target, requests, filters, policy,
                                                       rule):
    """The block rule's sampled path (dspark.block_verification through
    rejection._verify_sampled_blocks: the acceptance weights, residual masses, accepted lengths
    and the residual at tau) and the drafter-invariant rule's target samples
    (dspark.gumbel_verification) read nothing on the host either: their branches and row
    selections come from the host's draft lengths and sampling params."""
    folder, _ = tiny_target
    whole, in_verify, calls = count_round(folder, requests, 1.0, policy, rule, **filters)
    assert in_verify <= VERIFIER_BOUND, calls
    assert whole <= ROUND_BOUND, calls


@pytest.mark.parametrize("attention", [AttentionImpl.PADDED, AttentionImpl.PER_REQUEST,
                                       AttentionImpl.BLOCK_DIAGONAL])
def test_a_pass_uploads_its_metadata_in_one_copy(tiny_target, attention):
    """Token ids, positions, cache slots, block tables, lengths and the rows that need logits
    of one pass cross to the device in one copy (dspark/models/pass_upload.py), and the runner
    reads nothing back: a prompt forward of two passes, then a verification-like forward.
    BLOCK_DIAGONAL builds its mask from host lists in further copies, and reads nothing back
    either (its unused rows are a mask, not a `nonzero`)."""
    folder, _ = tiny_target
    device = PretendDevice()
    runner = TargetRunner(folder, RunnerConfig(hidden_layer_ids=LAYER_IDS, kv_cache_tokens=4096,
                                               cpu_packed_weights=False, max_tokens_per_pass=16,
                                               attention=attention))
    device.place_runner(runner)
    for rid in range(3):
        runner.add_request(rid)
    prompts = [ForwardItem(0, list(range(3, 23))), ForwardItem(1, [5, 6, 7, 8, 9]),
               ForwardItem(2, [4, 4, 4])]
    verify_like = [ForwardItem(rid, [7, 8, 9, 10], logits_from=0) for rid in range(3)]
    with device:
        for items, passes in ((prompts, 2), (verify_like, 1)):
            assert len(runner._plan(items)) == passes
            device.reset_counts()
            out = runner.forward(items)
            assert device.syncs == 0, dict(device.sync_calls)
            if attention is not AttentionImpl.BLOCK_DIAGONAL:
                assert device.uploads == passes
    assert out.logits.shape[0] == 12 and device.is_on_device(out.logits)
