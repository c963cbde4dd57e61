"""The embedded engine end to end on a tiny random target and an untrained drafter.

Greedy: every policy, 1 and several concurrent requests, gives exactly the tokens of plain greedy
decoding with the same target (our runner, and transformers' generate). Sampling: the joint
distribution of the first tokens equals the target's exact distribution.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dspark.cost_table import CostTable, ThetaObjective
from dspark.drafting_gate import DraftingGateConfig, RoundMode
from dspark.engine import Engine, EngineConfig, Request
from dspark.models.runner import RunnerConfig, TargetRunner
from dspark.rejection import VerificationRule
from dspark.sampling import SamplingParams
from dspark.step_result import RoundRecord
from loadtest.tiny_models import GAMMA, LAYER_IDS, VOCAB
from dspark.verifier import PrefillChunk, TargetVerifier

from .conftest import tiny_dspark


def make_engine(folder, policy: str, with_drafter: bool = True, max_running: int = 8,
                sparse_top_k: int | None = None, seed: int = 0, table: CostTable | None = None,
                probe_interval: int = 8, kv_cache_tokens: int = 8192,
                rule: VerificationRule = VerificationRule.TOKEN, **config) -> Engine:
    runner = TargetRunner(folder, RunnerConfig(hidden_layer_ids=LAYER_IDS,
                                               kv_cache_tokens=kv_cache_tokens))
    drafter = tiny_dspark(seed, runner) if with_drafter else None
    # A smooth cost table: verifying more tokens costs a little more.
    if table is None:
        table = CostTable.from_step_seconds({b: 0.01 + 0.001 * b for b in (1, 2, 4, 8, 16, 32, 64)})
    return Engine(TargetVerifier(runner, rule), drafter, table, EngineConfig().with_values(
        policy=policy, max_running=max_running, sparse_top_k=sparse_top_k,
        probe_interval=probe_interval, **{"update_cost_table": False, **config}))


PROMPTS = [[3, 9, 27, 17], [5, 6], [11, 12, 13, 14, 15, 16, 2], [40], [8, 8, 8, 8, 8], [33, 21, 7]]


def generate_recording(engine: Engine, prompts, sampling: SamplingParams, max_tokens: int
                       ) -> tuple[list[Request], list[RoundRecord]]:
    """`Engine.generate`, also returning each drafting round's record (`RoundStats.drafted`)."""
    done = [engine.request(engine.add_request(p, sampling, max_tokens)) for p in prompts]
    records = [result.stats.drafted for result in engine.steps() if result.stats.drafted]
    return done, records


@pytest.fixture(scope="module")
def reference_greedy(tiny_target):
    _, model = tiny_target
    out = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             pad_token_id=0, eos_token_id=None)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("policy", ["none", "fixed:1", f"fixed:{GAMMA}", "threshold:0.3",
                                    "sync_greedy", "async_topk"])
@pytest.mark.parametrize("max_running", [1, 8])
@pytest.mark.parametrize("chunk", [256, 3, 0])  # prefill_chunk_tokens: fused, chunked, separate
def test_greedy_is_token_identical_to_transformers(tiny_target, reference_greedy, policy,
                                                   max_running, chunk):
    engine = make_engine(tiny_target[0], policy, max_running=max_running, prefill_chunk_tokens=chunk)
    done = engine.generate(PROMPTS, SamplingParams(temperature=0), max_tokens=24)
    assert [r.output_ids for r in done] == reference_greedy
    if policy != "none":
        verified = sum(r.metrics.drafts_verified for r in done)
        assert verified > 0 or policy in ("sync_greedy",)  # sync_greedy may verify nothing
    assert not engine.running and not engine.waiting and not engine.prefilling
    assert engine.verifier.runner.cache.manager.num_free_blocks == \
        engine.verifier.runner.cache.manager.num_blocks  # everything released


def test_stop_tokens_and_max_tokens(tiny_target, reference_greedy):
    engine = make_engine(tiny_target[0], f"fixed:{GAMMA}")
    ref = reference_greedy[0]
    stop = ref[5]
    first_stop = ref.index(stop)
    done = engine.generate([PROMPTS[0]], SamplingParams(temperature=0), max_tokens=24,
                           stop_token_ids=[stop])
    assert done[0].output_ids == ref[:first_stop + 1] and done[0].finish_reason == "stop"
    done = engine.generate([PROMPTS[1]], SamplingParams(temperature=0), max_tokens=3)
    assert done[0].output_ids == reference_greedy[1][:3] and done[0].finish_reason == "length"


def test_async_topk_skips_drafting_when_capacity_is_zero(tiny_target, reference_greedy):
    """A cost table where every extra verified token doubles the step time makes K = 0 after the
    warm-up: those rounds skip the drafter, one round in `probe_interval` drafts anyway, and the
    output is still the target's greedy output."""
    steep = CostTable.from_step_seconds({b: 0.01 * b for b in (1, 2, 4, 8, 16, 32, 64)})
    engine = make_engine(tiny_target[0], "async_topk", max_running=1, table=steep, probe_interval=4,
                         max_probe_interval=4)  # no backoff here: see the next test
    done, drafted = generate_recording(engine, [PROMPTS[0]], SamplingParams(temperature=0), 24)
    assert done[0].output_ids == reference_greedy[0]
    rounds, skipped = engine.stats.rounds, engine.stats.skipped_draft_rounds
    assert len(drafted) + skipped == rounds
    assert skipped >= rounds // 2  # most rounds skip the drafter ...
    assert len(drafted) >= rounds // 4  # ... but a probe drafts at least every 4th round
    # With probing off (probe_interval = 0) every round drafts.
    engine = make_engine(tiny_target[0], "async_topk", max_running=1, table=steep, probe_interval=0)
    done = engine.generate([PROMPTS[0]], SamplingParams(temperature=0), max_tokens=24)
    assert done[0].output_ids == reference_greedy[0] and engine.stats.skipped_draft_rounds == 0


def test_async_topk_probes_back_off_and_a_join_does_not_reset_them(tiny_target, reference_greedy):
    """Under a cost table where no draft pays, every drafting round that verifies nothing doubles
    the gap to the next probe (2 -> 4 -> 8, capped at 8). The two warm-up rounds (K from the
    prior, 0 here) are such rounds, so the probes come every 8 rounds after them. A request
    joining (a heavier load, where drafts pay even less) leaves the gap at 8. Output stays exact."""
    steep = CostTable.from_step_seconds({b: 0.01 * b for b in (1, 2, 4, 8, 16, 32, 64)})
    # (prompts read in a forward of their own: a prompt chunk in a round would make drafts pay)
    engine = make_engine(tiny_target[0], "async_topk", max_running=2, table=steep, probe_interval=2,
                         max_probe_interval=8, prefill_chunk_tokens=0)
    drafted_at = []  # the rounds (1-based) that drafted
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0), max_tokens=25, request_id="a")
    requests = {"a": engine.request("a")}
    while engine.stats.rounds < 18:
        if engine.step().stats.drafted:
            drafted_at.append(engine.stats.rounds)
    assert drafted_at == [1, 2, 10, 18]
    engine.add_request(PROMPTS[1], SamplingParams(temperature=0), max_tokens=20, request_id="b")
    requests["b"] = engine.request("b")
    for result in engine.steps():
        if result.stats.drafted:
            drafted_at.append(engine.stats.rounds)
    assert drafted_at == [1, 2, 10, 18, 26, 34]  # "b" joined in round 19: still every 8th
    assert max(engine.stats.capacity) == 0  # no round could verify a draft
    assert requests["a"].output_ids == reference_greedy[0] + requests["a"].output_ids[24:]
    assert requests["b"].output_ids == reference_greedy[1][:20]


@pytest.mark.parametrize("check_gain", [100.0, 1.0])
def test_async_topk_plain_checks_break_long_runs_of_verifying_rounds(tiny_target, reference_greedy,
                                                                     check_gain):
    """Verifying is nearly free here (a flat cost table), so K > 0 in every round. After 3
    verifying rounds in a row, a round with a close decision (every one, at check_gain 100)
    drafts nothing, so the cost table would see a round without drafts; at check_gain 1.0 no
    decision is close enough and every round verifies. The output is the target's either way."""
    flat = CostTable.from_step_seconds({b: 0.01 for b in (1, 2, 4, 8, 16, 32, 64)})
    engine = make_engine(tiny_target[0], "async_topk", max_running=1, table=flat,
                         plain_check_interval=3, plain_check_gain=check_gain, min_gain=1.0,
                         prefill_chunk_tokens=0)
    done = engine.generate([PROMPTS[0]], SamplingParams(temperature=0), max_tokens=40)
    assert done[0].output_ids == reference_greedy[0] + done[0].output_ids[24:]
    capacity = engine.stats.capacity  # K of every round, 0 for a round without drafts
    runs = [len(run) for run in "".join("v" if k else "." for k in capacity).split(".") if run]
    if check_gain == 1.0:
        assert engine.stats.plain_check_rounds == 0 and 0 not in capacity[2:]
    else:
        assert engine.stats.plain_check_rounds >= 3
        assert max(runs) == 3 and capacity.count(0) == engine.stats.plain_check_rounds
    assert engine.stats.skipped_draft_rounds == 0


def test_async_topk_probes_soon_again_when_the_load_falls(tiny_target, reference_greedy):
    """Two requests, no draft pays: the probes back off to every 8th round. When one request
    finishes, fewer requests run than at any fruitless probe, so the next probe comes within
    `probe_interval` (2) rounds, and the backoff starts again from there. An engine left empty
    resets it as well."""
    steep = CostTable.from_step_seconds({b: 0.01 * b for b in (1, 2, 4, 8, 16, 32, 64)})
    engine = make_engine(tiny_target[0], "async_topk", max_running=2, table=steep, probe_interval=2,
                         max_probe_interval=8, prefill_chunk_tokens=0)
    drafted = []  # (round, running requests) of each drafting round
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0), max_tokens=36, request_id="a")
    engine.add_request(PROMPTS[1], SamplingParams(temperature=0), max_tokens=19, request_id="b")
    requests = {r.request_id: r for r in engine.waiting}
    for result in engine.steps():
        if result.stats.drafted:
            drafted.append((engine.stats.rounds, len(result.stats.drafted.request_ids)))
    # "b" emits its 19th token in round 18 (the prefill forward gave its first), so from round
    # 19 on one request is left: the probe due at round 26 comes at round 20 instead, and the
    # gaps double again after it (4, 8).
    assert drafted == [(1, 2), (2, 2), (10, 2), (18, 2), (20, 1), (24, 1), (32, 1)]
    assert max(engine.stats.capacity) == 0
    assert len(requests["a"].output_ids) == 36
    assert requests["a"].output_ids[:24] == reference_greedy[0]  # the reference's 24 tokens
    assert requests["b"].output_ids == reference_greedy[1][:19]
    # "a" ended in round 35 with the gap at 8 (next probe due at round 40). An engine left
    # empty is the lightest load, so the next request is drafted in its first round (36) and
    # the gaps double from 2 again (next: 40, then 48, past its 11 rounds).
    done = [engine.request(engine.add_request(PROMPTS[2], SamplingParams(temperature=0), 12))]
    for result in engine.steps():
        if result.stats.drafted:
            drafted.append((engine.stats.rounds, len(result.stats.drafted.request_ids)))
    assert done[0].output_ids == reference_greedy[2][:12]
    assert drafted[7:] == [(36, 1), (40, 1)]


def test_async_topk_probes_stay_backed_off_when_the_load_dips_a_little(tiny_target,
                                                                      reference_greedy):
    """Four requests, no draft pays. A fall in load resets the probe backoff only at half the
    lightest load of a fruitless probe since: 4 -> 3 and 3 -> 2 requests do not (the probes stay
    8 rounds apart), 2 -> 1 does. Under steady load a round often starts between one request's
    end and the next one's arrival, and a reset there kept the probes from backing off."""
    steep = CostTable.from_step_seconds({b: 0.01 * b for b in (1, 2, 4, 8, 16, 32, 64)})
    engine = make_engine(tiny_target[0], "async_topk", max_running=4, table=steep, probe_interval=2,
                         max_probe_interval=8, prefill_chunk_tokens=0, probe_requests=0)
    drafted = []  # (round, running requests) of each drafting round
    max_tokens = dict(zip("abcd", (36, 30, 9, 17)))
    for prompt, rid in zip(PROMPTS, "abcd"):
        engine.add_request(prompt, SamplingParams(temperature=0), max_tokens=max_tokens[rid],
                           request_id=rid)
    requests = {r.request_id: r for r in engine.waiting}
    for result in engine.steps():
        if result.stats.drafted:
            drafted.append((engine.stats.rounds, len(result.stats.drafted.request_ids)))
    # Warm-up rounds 1-2 (each fruitless: the gap doubles to 8). "c" ends in round 8 and "d" in
    # round 16: 3 and then 2 requests, against the lightest fruitless load of 4 and then 3, are
    # no reset, so the probes come at 10, 18, 26. "b" ends in round 29: 1 request is half the
    # lightest fruitless load (2, at round 18), so the probe comes at once (30), then 4 later.
    assert drafted == [(1, 4), (2, 4), (10, 3), (18, 2), (26, 2), (30, 1), (34, 1)]
    assert max(engine.stats.capacity) == 0
    for rid, i in zip("abcd", range(4)):
        n = min(max_tokens[rid], 24)
        assert requests[rid].output_ids[:n] == reference_greedy[i][:n]


def test_async_topk_probes_keep_their_sample_and_fill_it_with_the_newest(tiny_target,
                                                                           reference_greedy):
    """With K known to be 0, a probe drafts only `probe_requests` of the running requests: those
    the last probe drafted that still run, then the newest joiners (so a probe's requests bring
    little unseen context). The two warm-up rounds (K unknown) draft the whole batch. The
    admission hands on K from the sample, nothing is verified, and the output stays the
    target's."""
    steep = CostTable.from_step_seconds({b: 0.01 * b for b in (1, 2, 4, 8, 16, 32, 64)})
    engine = make_engine(tiny_target[0], "async_topk", max_running=5, table=steep, probe_interval=2,
                         max_probe_interval=2, probe_requests=2)
    drafted, running_then = [], []  # per drafting call: the drafted ids, the running ids
    inner = engine.drafter

    class Recording:
        gamma = inner.gamma
        append_context = inner.append_context
        release = inner.release

        def draft(self, requests, sparse_top_k=None, num_positions=None):
            drafted.append([r.request_id for r in requests])
            running_then.append([r.request_id for r in engine.running])
            return inner.draft(requests, sparse_top_k=sparse_top_k, num_positions=num_positions)

    engine.drafter = Recording()
    max_tokens = [6, 24, 12, 24, 18]  # the newest ones finish first, so the sample moves
    ids = [engine.add_request(p, SamplingParams(temperature=0), max_tokens=n)
           for p, n in zip(PROMPTS[:5], max_tokens)]
    requests = {r.request_id: r for r in engine.waiting}
    while engine.has_unfinished():
        engine.step()
    assert drafted[:2] == [ids, ids]  # warm-up: K unknown, the whole batch
    members: list = []
    probes = 0
    for sample, running in zip(drafted[2:], running_then[2:]):
        if len(running) <= 2:  # the whole batch fits a sample: no sampled probe
            assert sample == running
            continue
        kept = [rid for rid in running if rid in members]
        expected = kept + [rid for rid in reversed(running) if rid not in kept]
        expected = [rid for rid in running if rid in expected[:2]]  # in batch order
        assert sample == expected
        members, probes = sample, probes + 1
    assert probes >= 3 and engine.stats.sampled_probe_rounds == probes
    assert len({tuple(p) for p in drafted[2:]}) >= 2  # the sample changed as requests finished
    assert max(engine.stats.capacity) == 0
    for rid, n, reference in zip(ids, max_tokens, reference_greedy[:5]):
        assert requests[rid].output_ids == reference[:n]


def record_draft_calls(engine: Engine) -> list[tuple[int | None, int | None]]:
    """Wrap the engine's drafter: each draft call appends (the admitter's planned K, the
    positions asked for) to the returned list."""
    inner, asked = engine.drafter, []

    class Recording:
        gamma = inner.gamma
        append_context = inner.append_context
        release = inner.release

        def draft(self, requests, sparse_top_k=None, num_positions=None):
            asked.append((engine.admitter.planned_capacity(), num_positions))
            return inner.draft(requests, sparse_top_k=sparse_top_k, num_positions=num_positions)

    engine.drafter = Recording()
    return asked


def test_async_topk_drafts_only_the_positions_it_can_verify(tiny_target, reference_greedy):
    """With K known (decided two rounds before), no draft past position K can be admitted, so
    the drafter is asked for K + 1 positions (the whole block while K is unknown); greedy output
    stays the target's."""
    steep = CostTable.from_step_seconds({b: 0.01 * b for b in (1, 2, 4, 8, 16, 32, 64)})
    engine = make_engine(tiny_target[0], "async_topk", max_running=2, table=steep, probe_interval=3)
    asked = record_draft_calls(engine)
    done = engine.generate(PROMPTS[:2], SamplingParams(temperature=0), max_tokens=24)
    assert [r.output_ids for r in done] == reference_greedy[:2]
    assert asked and all(n == (GAMMA if k is None else min(GAMMA, k + 1)) for k, n in asked)
    assert asked[0][1] == GAMMA and any(n < GAMMA for _, n in asked)


def test_fixed_policy_drafts_only_the_positions_it_verifies(tiny_target, reference_greedy):
    """fixed:2 verifies two drafts a round, so the drafter is asked for two positions, and the
    greedy output stays the target's."""
    engine = make_engine(tiny_target[0], "fixed:2", max_running=2)
    asked = record_draft_calls(engine)
    done = engine.generate(PROMPTS[:2], SamplingParams(temperature=0), max_tokens=24)
    assert [r.output_ids for r in done] == reference_greedy[:2]
    assert asked and {n for _, n in asked} == {2}


def test_drafting_cost_decides_under_the_shared_device_objective(tiny_target, reference_greedy):
    """Drafting that costs more than any draft can save: the shared-device objective (the
    default) stops verifying drafts and so skips the drafter, the paper's objective (drafting
    free) keeps verifying. Both stay exact. With updates on, the engine measures drafting."""
    def table(draft_seconds: float) -> CostTable:
        return CostTable.from_step_seconds({b: 0.01 + 0.001 * b for b in (1, 2, 4, 8, 16, 32, 64)},
                                           draft_seconds=draft_seconds)

    skipped = {}
    for objective in (ThetaObjective.SHARED_DEVICE, ThetaObjective.PAPER):
        engine = make_engine(tiny_target[0], "async_topk", max_running=1, table=table(1.0),
                             objective=objective)
        done = engine.generate([PROMPTS[0]], SamplingParams(temperature=0), max_tokens=24)
        assert done[0].output_ids == reference_greedy[0]
        skipped[objective] = engine.stats.skipped_draft_rounds / engine.stats.rounds
    assert skipped[ThetaObjective.SHARED_DEVICE] >= 0.5 and skipped[ThetaObjective.PAPER] == 0.0

    engine = make_engine(tiny_target[0], "async_topk", max_running=1, table=table(0.0),
                         update_cost_table=True)
    engine.generate([PROMPTS[0]], SamplingParams(temperature=0), max_tokens=8)
    assert engine.config.admission.objective is ThetaObjective.SHARED_DEVICE
    # drafting is measured per request count (here one request a round)
    assert 0.0 < engine.cost_table.draft_time(1) <= engine.stats.draft_seconds
    assert set(engine.cost_table.draft_seconds_by_requests) == {1}
    assert set(engine.cost_table.request_fits) == {1}


def test_greedy_and_sampled_requests_share_rounds(tiny_target, reference_greedy):
    """Greedy blocks come sparse (k = 1) and plain sampled ones dense: one round verifies both."""
    engine = make_engine(tiny_target[0], "fixed:4")
    greedy = engine.add_request(PROMPTS[0], SamplingParams(temperature=0), max_tokens=24)
    engine.add_request(PROMPTS[1], SamplingParams(temperature=1.0, seed=7), max_tokens=24)
    by_id = {r.request_id: r for r in engine.waiting}
    while engine.has_unfinished():
        engine.step()
    assert by_id[greedy].output_ids == reference_greedy[0]
    assert all(r.metrics.drafts_verified > 0 for r in by_id.values())


def test_chunked_prefill_reads_a_long_prompt_while_others_decode(tiny_target, reference_greedy):
    """With 3 prompt tokens a round, a 7-token prompt joining a running request is read over
    three rounds, each riding in the running request's verification forward; the running
    request gets its tokens every round meanwhile, and both outputs are the target's."""
    engine = make_engine(tiny_target[0], "fixed:2", max_running=2, prefill_chunk_tokens=3)
    first = engine.add_request(PROMPTS[0], SamplingParams(temperature=0), max_tokens=24)
    requests = {first: engine.request(first)}
    engine.step()  # a 4-token prompt, nothing running: read in two steps, no round
    assert engine.stats.rounds == 0 and engine.prefilling
    engine.step()
    assert requests[first].output_ids == reference_greedy[0][:1] and not engine.prefilling
    second = engine.add_request(PROMPTS[2], SamplingParams(temperature=0), max_tokens=24)
    requests[second] = engine.request(second)
    for expected_read in (3, 6, 7):
        produced = len(requests[first].output_ids)
        outputs = engine.step().outputs
        assert requests[second].prefilled == expected_read
        assert len(requests[first].output_ids) > produced  # it kept decoding
        assert [o.request_id for o in outputs if o.request_id == second] == (
            [second] if expected_read == 7 else [])
    assert engine.stats.rounds == 3  # one verification forward per step, none for prompts alone
    while engine.has_unfinished():
        engine.step()
    assert [requests[i].output_ids for i in (first, second)] == [reference_greedy[0],
                                                                 reference_greedy[2]]


def test_abort_while_prefilling_frees_the_partial_prompt(tiny_target, reference_greedy):
    """A request aborted between two chunks of its prompt leaves no KV cache or drafter context
    behind, and the request that was running goes on unchanged."""
    engine = make_engine(tiny_target[0], "async_topk", max_running=2, prefill_chunk_tokens=3)
    kept = engine.add_request(PROMPTS[0], SamplingParams(temperature=0), max_tokens=24)
    requests = {kept: engine.request(kept)}
    engine.step()
    engine.step()
    gone = engine.add_request(PROMPTS[2], SamplingParams(temperature=0), max_tokens=24)
    engine.step()  # 3 of its 7 prompt tokens read
    assert engine.prefilling and engine.verifier.runner.length(gone) == 3
    engine.abort(gone)
    assert not engine.prefilling and not engine.verifier.runner.has_request(gone)
    assert gone not in engine.drafter._pending
    while engine.has_unfinished():
        engine.step()
    assert requests[kept].output_ids == reference_greedy[0]


def test_chunked_prefill_keeps_seeded_outputs(tiny_target):
    """The first token's random draw comes with the prompt's last chunk, so a seeded request
    samples the same tokens whatever the chunk size (under a policy whose admissions do not
    depend on the prompt tokens in the round, unlike async_topk's)."""
    params = SamplingParams(temperature=1.0, seed=99)
    outs = [make_engine(tiny_target[0], "fixed:3", prefill_chunk_tokens=chunk).generate(
        PROMPTS[:3], params, max_tokens=20) for chunk in (0, 2, 256)]
    assert [r.output_ids for r in outs[0]] == [r.output_ids for r in outs[1]] == \
        [r.output_ids for r in outs[2]]


def test_prefill_chunks_need_the_right_request_state(tiny_target):
    """A first chunk must name a new request, a continued one a request the cache holds; a
    refused call leaves no request behind."""
    engine = make_engine(tiny_target[0], "none")
    verifier = engine.verifier
    greedy = SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="unknown"):
        verifier.verify([], [PrefillChunk("x", [3, 4], True, greedy, continued=True)])
    out = verifier.verify([], [PrefillChunk("x", [3, 9], False, greedy)])
    assert out.prefill.first_tokens == [None] and out.prefill_tokens == 2
    with pytest.raises(ValueError, match="already held"):
        verifier.verify([], [PrefillChunk("x", [27], True, greedy)])
    with pytest.raises(ValueError, match="unknown"):
        verifier.verify([], [PrefillChunk("y", [5], True, greedy),
                             PrefillChunk("z", [5], True, greedy, continued=True)])
    assert not verifier.runner.has_request("y")
    whole = make_engine(tiny_target[0], "none").verifier.prefill(["w"], [[3, 9, 27]], [greedy], [None])
    out = verifier.verify([], [PrefillChunk("x", [27], True, greedy, continued=True)])
    assert out.prefill.first_tokens == whole.first_tokens


@pytest.mark.parametrize("policy", ["none", f"fixed:{GAMMA}", "async_topk"])
@pytest.mark.parametrize("chunk", [256, 3, 0])
def test_a_full_kv_cache_preempts_the_newest_and_keeps_every_output(tiny_target, reference_greedy,
                                                                   policy, chunk):
    """64 KV tokens (4 blocks of 16) hold any one request (at most 7 prompt + 24 output + a
    4-draft block = 3 blocks) but not six: rounds that do not fit preempt the newest request,
    which is recomputed later; every output is still the reference, and the cache ends empty."""
    engine = make_engine(tiny_target[0], policy, kv_cache_tokens=64, prefill_chunk_tokens=chunk)
    requests = engine.generate(PROMPTS, SamplingParams(temperature=0), max_tokens=24)
    assert [r.output_ids for r in requests] == reference_greedy
    assert {r.finish_reason for r in requests} == {"length"}
    assert engine.stats.preemptions > 0
    manager = engine.verifier.runner.cache.manager
    assert manager.num_free_blocks == manager.num_blocks == 4


@pytest.mark.parametrize("chunk", [256, 0])
def test_a_preempted_seeded_request_samples_what_it_would_have(tiny_target, chunk):
    """Recomputation re-reads the tokens a request has and samples nothing, so its seeded random
    stream goes on where it stopped: the outputs equal those of a cache with room for all."""
    params = SamplingParams(temperature=1.0, seed=7)
    roomy = make_engine(tiny_target[0], "none", prefill_chunk_tokens=chunk)
    tight = make_engine(tiny_target[0], "none", kv_cache_tokens=64, prefill_chunk_tokens=chunk)
    expected = [r.output_ids for r in roomy.generate(PROMPTS, params, max_tokens=24)]
    assert [r.output_ids for r in tight.generate(PROMPTS, params, max_tokens=24)] == expected
    assert tight.stats.preemptions > 0 and roomy.stats.preemptions == 0


@pytest.mark.parametrize("long_first", [True, False])
@pytest.mark.parametrize("chunk", [256, 16, 0])
def test_a_request_the_kv_cache_cannot_hold_alone_ends_alone(tiny_target, reference_greedy,
                                                            long_first, chunk):
    """A 40-token prompt in a 32-token cache ends with an error naming the cache; the request
    beside it runs to its reference output."""
    engine = make_engine(tiny_target[0], "none", kv_cache_tokens=32, prefill_chunk_tokens=chunk)
    greedy = SamplingParams(temperature=0)
    add_long = lambda: engine.add_request(list(range(3, 43)), greedy, 8)  # noqa: E731
    add_short = lambda: engine.add_request(PROMPTS[1], greedy, 24)  # noqa: E731
    long_id, short_id = (add_long(), add_short()) if long_first else (add_short(), add_long())[::-1]
    tokens, last = {long_id: [], short_id: []}, {}
    for out in engine.stream():
        tokens[out.request_id] += out.new_token_ids
        if out.finished:
            last[out.request_id] = out
    assert last[long_id].finish_reason == "error" and "KV cache" in last[long_id].error
    assert tokens[long_id] == []
    assert last[short_id].finish_reason == "length" and last[short_id].error is None
    assert tokens[short_id] == reference_greedy[1]
    assert engine.verifier.runner.cache.manager.num_free_blocks == 2


def test_same_seed_same_output(tiny_target):
    params = SamplingParams(temperature=1.0, seed=1234)
    a = make_engine(tiny_target[0], "fixed:3").generate([PROMPTS[2]], params, max_tokens=20)
    b = make_engine(tiny_target[0], "fixed:3").generate([PROMPTS[2]], params, max_tokens=20)
    assert a[0].output_ids == b[0].output_ids


def exact_first_tokens(model, prompt: list[int], n: int, temperature: float) -> torch.Tensor:
    """P(y1..yn) of the target by enumeration over the vocabulary: [VOCAB] * n, float64."""
    joint = torch.zeros([VOCAB] * n, dtype=torch.float64)
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / temperature, 0)
        ctx = torch.tensor([prompt + [v] for v in range(VOCAB)])
        p2 = torch.softmax(model(ctx).logits[:, -1].double() / temperature, 1)  # [V, V]
    assert n == 2
    return p1[:, None] * p2


@pytest.mark.parametrize("policy, rule", [
    ("async_topk", VerificationRule.TOKEN), ("sync_greedy", VerificationRule.TOKEN),
    (f"fixed:{GAMMA}", VerificationRule.TOKEN), (f"fixed:{GAMMA}", VerificationRule.BLOCK),
    ("async_topk", VerificationRule.BLOCK)])
def test_sampled_joint_distribution_is_the_targets(tiny_target, policy, rule):
    folder, model = tiny_target
    prompt = [3, 9, 27]
    temperature = 1.0
    expected = exact_first_tokens(model, prompt, 2, temperature).reshape(-1)
    num = 3000
    engine = make_engine(folder, policy, max_running=64, sparse_top_k=8, rule=rule)
    outputs = {}
    for i in range(num):
        engine.add_request(prompt, SamplingParams(temperature=temperature), max_tokens=2,
                           request_id=i)
    for out in engine.stream():
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    codes = torch.tensor([o[0] * VOCAB + o[1] for o in outputs.values()])
    observed = torch.bincount(codes, minlength=VOCAB * VOCAB).double()
    # Pool cells with small expected counts so the chi-square approximation holds.
    exp_counts = expected * num
    big = exp_counts >= 5
    obs = torch.cat([observed[big], observed[~big].sum(0, keepdim=True)])
    exp = torch.cat([exp_counts[big], exp_counts[~big].sum(0, keepdim=True)])
    exp = exp / exp.sum() * obs.sum()
    assert float(chisquare(obs.numpy(), exp.numpy()).pvalue) > 1e-3


def test_engine_config_rejects_a_probe_cap_below_the_interval():
    with pytest.raises(ValueError, match="max_probe_interval"):
        EngineConfig().with_values(probe_interval=8, max_probe_interval=4)
    assert EngineConfig().with_values(probe_interval=0, max_probe_interval=0).gate == (
        DraftingGateConfig(probe_interval=0, max_probe_interval=0))


@pytest.mark.parametrize("slope", [0.01, 0.002])  # K stays 0 (probes only) / K > 0 at times
def test_held_features_give_the_drafter_the_same_context(tiny_target, slope):
    """With `hold_features`, requests not drafted in a round leave their features with the
    verifier until they are next drafted: the drafter must see the same context in the same
    order, so every round's confidences and every output token equal a run that hands the
    drafter every round's features at once (sampled, chunked prefill, probes of a sample)."""
    table = CostTable.from_step_seconds({b: 0.01 + slope * b for b in (1, 2, 4, 8, 16, 32, 64)})
    runs = []
    for hold in (False, True):
        engine = make_engine(tiny_target[0], "async_topk", max_running=4, table=table,
                             probe_interval=2, max_probe_interval=4, probe_requests=2,
                             prefill_chunk_tokens=3, hold_features=hold)
        taken = []
        take = engine.verifier.take_features

        def recording_take(ids, take=take, taken=taken):
            taken.append(list(ids))
            return take(ids)

        engine.verifier.take_features = recording_take
        # Unseeded (a seeded request would have the drafting gate bypassed: no probes, no
        # skips, dspark.seeded_admission), with the same fresh seeds in both runs.
        torch.manual_seed(7)
        done, records = generate_recording(engine, PROMPTS, SamplingParams(temperature=1.0), 20)
        runs.append(([r.output_ids for r in done], records, taken, engine))
    (plain_out, plain_records, plain_taken, _), (held_out, held_records, taken, engine) = runs
    assert held_out == plain_out
    assert len(held_records) == len(plain_records)
    for a, b in zip(plain_records, held_records):
        assert a.request_ids == b.request_ids and a.num_admitted == b.num_admitted
        assert torch.equal(a.confidences, b.confidences)
    assert not plain_taken and taken  # only the holding run asked for held features
    stats = engine.stats
    assert stats.sampled_probe_rounds and stats.skipped_draft_rounds
    assert (max(stats.capacity) > 0) == (slope < 0.01)
    assert not engine._held and not engine.verifier.stash._pieces  # all taken or released


@pytest.mark.parametrize("policy", ["fixed:3", "async_topk"])
def test_step_results_add_up_to_the_requests(tiny_target, policy):
    """Each step says what it did: summed over the steps, the drafts admitted and accepted are
    the requests' own counts, every prompt token is read once, each round's forward holds its
    requests' anchors and admitted drafts, and the engine's totals are the sums of the steps."""
    engine = make_engine(tiny_target[0], policy, max_running=3, prefill_chunk_tokens=5)
    done = [engine.request(engine.add_request(p, SamplingParams(temperature=1.0, seed=i), 12))
            for i, p in enumerate(PROMPTS)]
    results = list(engine.steps())
    stats = [r.stats for r in results]
    assert sum(s.drafts_admitted for s in stats) == sum(r.metrics.drafts_verified for r in done)
    assert sum(s.drafts_accepted for s in stats) == sum(r.metrics.drafts_accepted for r in done)
    assert sum(s.drafts_accepted for s in stats) > 0
    assert sum(s.prompt_tokens for s in stats) == sum(len(p) for p in PROMPTS)
    assert sum(r.new_tokens for r in results) == sum(len(r.output_ids) for r in done)
    assert [o.request_id for r in results for o in r.finished] != []
    for s in stats:
        assert s.drafts_accepted <= s.drafts_admitted <= s.drafts_proposed or not s.drafted
        if s.verified and not s.prompt_tokens:
            assert s.batch_tokens == s.batch_size + s.drafts_admitted
        if s.drafted is not None and s.mode is RoundMode.DRAFT:
            assert sum(s.drafted.num_admitted) == s.drafts_admitted
    assert engine.stats.rounds == sum(s.verified for s in stats)
    assert engine.stats.draft_seconds == pytest.approx(sum(s.seconds.draft for s in stats))
    assert engine.stats.batch_tokens == [s.batch_tokens for s in stats if s.verified]
