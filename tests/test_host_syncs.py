"""Host-device synchronisations per round, counted on the CPU (tests/pretend_device.py: reading
a device tensor's values on the host, or an op whose output shape depends on them), with the
engine's runner and drafter on a pretend CUDA device.

The verifier's part of a round (the target forward, draft-probability packing, sampling,
rejection and the one copy of the results) makes at most 3 at 1 and at 64 requests, greedy
and T=1: the admitted draft tokens to the host for the forward's items, the check that every
draft has probability > 0, and the results (accepted counts, tokens) in one copy. Counted the
same way before (base 8bab729 with the device fixes), the verifier's part made 25 at 1 greedy
request and 88 at 64 (a copy per drafted block, branches read from the device, a nonzero per
layer in the padded attention); whole rounds made 27 / 67 at 1 request (greedy / T=1) and
153 / 193 at 64.

The whole round is bounded at what it makes now (ROUND_BOUNDS); the rest is the drafter's (its
sampling per position, one context-cache read per request) and the admission's one copy of the
confidences: those files belong to the drafter and the admission, whose syncs the issue's goal
of <= 3 per round also counts.
"""

from __future__ import annotations

import pytest
import torch

from dspark.cost_table import CostTable
from dspark.engine import Engine, EngineConfig
from dspark.models.runner import RunnerConfig, TargetRunner
from dspark.sampling import SamplingParams
from dspark.verifier import TargetVerifier
from loadtest.tiny_models import LAYER_IDS

from .conftest import tiny_dspark
from .pretend_device import PretendDevice

VERIFIER_BOUND = 3
ROUND_BOUNDS = {(1, 0.0): 5, (1, 1.0): 20, (64, 0.0): 68, (64, 1.0): 83}
"""(requests, temperature) -> syncs of a whole steady round (fixed:3), as measured."""
TABLE = {b: 0.01 + 0.001 * b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)}


def count_round(folder, requests: int, temperature: float) -> tuple[int, int, dict]:
    """(whole round, verifier.verify) syncs of the 4th round, and the round's calls by name."""
    device = PretendDevice()
    runner = TargetRunner(folder, RunnerConfig(hidden_layer_ids=LAYER_IDS, kv_cache_tokens=16384,
                                               cpu_packed_weights=False))
    drafter = tiny_dspark(0, runner)
    device.place_runner(runner)
    device.place(drafter)
    engine = Engine(TargetVerifier(runner), drafter, CostTable.from_step_seconds(TABLE),
                    EngineConfig().with_values(policy="fixed:3", max_running=requests,
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
        engine.add_request([3 + i % 50, 9, 27, 17], SamplingParams(temperature=temperature, seed=i),
                           max_tokens=40)
    with device:
        for _ in range(3):  # prompts read, then steady rounds
            engine.step()
        device.reset_counts()
        in_verify.clear()
        engine.step()
    return device.syncs, sum(in_verify), dict(device.sync_calls)


@pytest.mark.parametrize("requests", [1, 64])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_round_syncs_at_most_the_bound(tiny_target, requests, temperature):
    folder, _ = tiny_target
    whole, in_verify, calls = count_round(folder, requests, temperature)
    assert in_verify <= VERIFIER_BOUND, calls
    assert whole <= ROUND_BOUNDS[requests, temperature], calls
