"""A seeded T = 1 request through the services (verifier, drafter and scheduler processes,
async_topk) gives the same tokens every time, alone or beside 7 unseeded requests, and the
tokens of the embedded engine with the same models and seed (dspark.random_draws,
dspark.seeded_admission)."""

from __future__ import annotations

import random
import threading

import pytest

from loadtest.tiny_models import LAYER_IDS

from .test_sampling_through_services import generate

PROMPT = [5, 6, 7]
SEED = 4321
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def embedded_seeded(tiny_models) -> list[int]:
    from dspark.cost_table import CostTable
    from dspark.engine import Engine, EngineConfig
    from dspark.loading import load_method_drafter, load_target
    from dspark.sampling import SamplingParams
    from dspark.verifier import TargetVerifier

    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=4096)
    drafter = load_method_drafter(tiny_models.drafter_dir, runner, apply_calibration=True)
    engine = Engine(TargetVerifier(runner), drafter, CostTable.load(tiny_models.cost_table),
                    EngineConfig().with_values(policy="async_topk", update_cost_table=False))
    done = engine.generate([PROMPT], SamplingParams(temperature=1.0, seed=SEED), MAX_TOKENS)
    return done[0].output_ids


def seeded_beside_others(stack, others: int, repeat: int) -> list[int]:
    rng = random.Random(repeat)
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        if i == 0:
            results[0] = generate(stack, PROMPT, MAX_TOKENS, 1.0, SEED)
        else:
            prompt = [rng.randrange(3, 60) for _ in range(rng.randrange(1, 10))]
            results[i] = generate(stack, prompt, rng.randrange(5, 60), rng.random() * 1.5)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1 + others)]
    for t in threads[1:]:  # the others first, so the seeded request joins a running batch
        t.start()
    threads[0].start()
    for t in threads:
        t.join()
    return results[0]


def test_a_seeded_request_repeats_through_the_services(stack, embedded_seeded):
    outputs = [seeded_beside_others(stack, others, repeat)
               for repeat in range(5) for others in (0, 7)]
    assert len(outputs[0]) == MAX_TOKENS
    assert all(o == outputs[0] for o in outputs), [o[:10] for o in outputs]
    assert outputs[0] == embedded_seeded
