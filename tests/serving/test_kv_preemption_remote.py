"""Preemption against a verifier process: its KV cache (48 tokens, 3 blocks) holds any one
request but not two, so Verify calls are refused with RESOURCE_EXHAUSTED (nothing changed
there); the engine preempts the newest request and recomputes it later, and every output equals
the request's greedy output generated alone. Requests with penalties and min_tokens keep their
counts through the recomputation (the re-read output counts as output again), and a resumed
request counts its earlier output."""

from __future__ import annotations

from dspark.cost_table import CostTable
from dspark.engine import AdmissionConfig, Engine, EngineConfig
from dspark.loading import load_method_drafter, load_target
from dspark.sampling import SamplingParams
from dspark.serving.local_stack import wait_grpc
from dspark.serving.remote_verifier import RemoteVerifier
from loadtest.tiny_models import LAYER_IDS
from dspark.verifier import TargetVerifier

PROMPTS = [[3, 9, 27, 17], [5, 6], [11, 12, 13, 14, 15, 16, 2]]
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0)


def engine_on(verifier, models, runner) -> Engine:
    drafter = load_method_drafter(models.drafter_dir, runner, apply_calibration=True)
    return Engine(verifier, drafter, CostTable.load(models.cost_table),
                  EngineConfig(AdmissionConfig(policy="async_topk"), update_cost_table=False))


def test_an_engine_preempts_when_the_verifier_process_is_full(launcher, tiny_models):
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=4096)
    solo = [engine_on(TargetVerifier(runner), tiny_models, runner).generate(
        [p], GREEDY, MAX_TOKENS)[0].output_ids for p in PROMPTS]
    verifier, address = launcher.verifier("verifier_small_cache", kv_cache_tokens=48)
    remote = RemoteVerifier(address, wait_seconds=60)
    try:
        wait_grpc(verifier, address)
        engine = engine_on(remote, tiny_models, runner)
        requests = engine.generate(PROMPTS, GREEDY, MAX_TOKENS)
        assert [r.output_ids for r in requests] == solo
        assert {r.finish_reason for r in requests} == {"length"}
        assert engine.stats.preemptions > 0
        assert remote.kv_cache_usage == 0.0
    finally:
        remote.close()
        verifier.stop()


def test_penalties_and_min_tokens_survive_preemption_in_the_verifier_process(launcher,
                                                                            tiny_models):
    """Each prompt's stop tokens are its plain greedy output's first two tokens, held back by
    min_tokens 8; penalties and a logit bias on top. The remote engine, preempting, produces
    what the in-process engine with room for all does."""
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=4096)
    local = engine_on(TargetVerifier(runner), tiny_models, runner)
    stops = [tuple(local.generate([p], GREEDY, 2)[0].output_ids) for p in PROMPTS]
    params = SamplingParams(temperature=0, min_tokens=8, repetition_penalty=1.5,
                            frequency_penalty=0.4, presence_penalty=0.3, logit_bias={7: 1.0})

    def run(engine, earlier: list[list[int]] | None = None) -> list[list[int]]:
        """`earlier`: each request resumes after these output tokens (Engine.add_request's
        earlier_output: given back as the end of the prompt, counted as output)."""
        earlier = earlier or [[] for _ in PROMPTS]
        ids = [engine.add_request(p + e, params, MAX_TOKENS - len(e), s, earlier_output=e)
               for p, s, e in zip(PROMPTS, stops, earlier)]
        out: dict = {i: [] for i in ids}
        for o in engine.stream():
            out[o.request_id] += o.new_token_ids
        return [out[i] for i in ids]

    expected = run(engine_on(TargetVerifier(runner), tiny_models, runner))
    assert all(len(e) >= 8 and not set(e[:8]) & set(s) for e, s in zip(expected, stops))
    verifier, address = launcher.verifier("verifier_small_cache_params", kv_cache_tokens=48)
    remote = RemoteVerifier(address, wait_seconds=60)
    try:
        wait_grpc(verifier, address)
        engine = engine_on(remote, tiny_models, runner)
        assert run(engine) == expected
        assert engine.stats.preemptions > 0
        # Resumed after 5 tokens (the gateway's resume): the verifier process counts them as
        # output (PrefillItem.prompt_length), so the rest is the uninterrupted output's.
        resumed = engine_on(remote, tiny_models, runner)
        assert run(resumed, [e[:5] for e in expected]) == [e[5:] for e in expected]
    finally:
        remote.close()
        verifier.stop()
