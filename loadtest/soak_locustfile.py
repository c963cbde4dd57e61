"""Locust users of the soak test (loadtest/soak.py): greedy streamed completions, each outcome
appended as one JSON line to DSPARK_SOAK_RESULTS for the soak driver to judge.

Each line: prompt index, HTTP status, the streamed token ids, finish reason, an error event's
message (a failure reported mid-stream), seconds taken, and whether the client gave up at its
timeout. Settings by environment: DSPARK_SOAK_PROMPTS (JSON list of token-id prompts),
DSPARK_SOAK_MAX_TOKENS, DSPARK_SOAK_API_KEY, DSPARK_SOAK_TIMEOUT_SECONDS.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, constant, task

PROMPTS = json.loads(os.environ.get("DSPARK_SOAK_PROMPTS", "[[3, 9, 27, 17]]"))
MAX_TOKENS = int(os.environ.get("DSPARK_SOAK_MAX_TOKENS", "24"))
API_KEY = os.environ.get("DSPARK_SOAK_API_KEY", "")
TIMEOUT_SECONDS = float(os.environ.get("DSPARK_SOAK_TIMEOUT_SECONDS", "120"))
RESULTS = os.environ.get("DSPARK_SOAK_RESULTS", "soak_results.jsonl")


class GreedyStreamUser(HttpUser):
    """Sends the next request as soon as the last one ended; after a refusal, waits the
    Retry-After it was given (a well-behaved client)."""

    wait_time = constant(0)

    @task
    def complete(self) -> None:
        index = random.randrange(len(PROMPTS))
        outcome = {"prompt": index, "status": None, "tokens": [], "finish_reason": None,
                   "error": None, "timed_out": False}
        start = time.monotonic()
        retry_after = 0.0
        try:
            with self.client.post(
                    "/v1/completions", name="soak", stream=True, catch_response=True,
                    timeout=TIMEOUT_SECONDS,
                    headers={"Authorization": f"Bearer {API_KEY}"},
                    json={"model": "tiny", "prompt": PROMPTS[index], "max_tokens": MAX_TOKENS,
                          "temperature": 0, "stream": True}) as response:
                outcome["status"] = response.status_code
                retry_after = float(response.headers.get("Retry-After", 0) or 0)
                if response.status_code == 200:
                    for line in response.iter_lines():
                        if not line.startswith(b"data: {"):
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            outcome["error"] = event["error"]["message"]
                            continue
                        outcome["tokens"] += event["dspark"]["token_ids"]
                        outcome["finish_reason"] = (event["choices"][0]["finish_reason"]
                                                    or outcome["finish_reason"])
                response.success()  # judged by the soak driver, not by Locust
        except Exception as e:  # a timeout or a dropped connection: recorded, judged later
            outcome["error"] = f"{type(e).__name__}: {e}"
            outcome["timed_out"] = "timeout" in str(e).lower() or "Timeout" in type(e).__name__
        outcome["seconds"] = round(time.monotonic() - start, 3)
        with open(RESULTS, "a") as f:
            f.write(json.dumps(outcome) + "\n")
        if outcome["status"] in (429, 503):
            time.sleep(retry_after if outcome["status"] == 429 else 1.0)
