"""Two cohorts (two engine loops over the same services, one drafting while the other verifies):
every request's greedy output is still the embedded engine's, and both cohorts really serve."""

from __future__ import annotations

import json
import threading

from dspark.serving.grpc_runtime import channel
from dspark.serving.local_stack import wait_http
from dspark.serving.protos import pb, rpc

PROMPTS = [[3, 9, 27, 17], [5, 6], [11, 12, 13, 14, 15, 16, 2], [40], [8, 8, 8, 8, 8], [33, 21, 7]]


def test_two_cohorts_are_exact_and_both_serve(launcher, stack, embedded_greedy):
    scheduler, http_port, grpc_port = launcher.scheduler(
        stack.verifier_address, stack.drafter_address, name="scheduler_cohorts",
        extra=("--cohorts", "2"))
    try:
        wait_http(scheduler, http_port)
        stub = rpc.generation.GenerationStub(channel(f"127.0.0.1:{grpc_port}"))
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            request = pb.generation.GenerateRequest(
                model="tiny", prompt_token_ids=PROMPTS[i], max_tokens=32,
                sampling=pb.common.SamplingParams(temperature=0.0))
            results[i] = [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, prompt in enumerate(PROMPTS):
            assert results[i] == embedded_greedy(prompt, 32), i
    finally:
        scheduler.stop()
    spans = [json.loads(line) for line in
             (stack.models.work / "trace_scheduler_cohorts.jsonl").read_text().splitlines()]
    cohorts = {s["attributes"].get("dspark.cohort") for s in spans if s["name"] == "scheduler.round"}
    assert cohorts == {0, 1}
