"""Greedy reference outputs for deploy/compose_check.py, from the embedded engine (target only,
no services): run inside the services image against the prepared model, fed on stdin:

    docker run --rm -i --network none -v <data volume>:/data/dspark:ro --entrypoint python \
        dspark-serve:latest - '<json: [{"messages": [...], "max_tokens": N}, ...]>' < this file

Prints one JSON list: for each case, the prompt token ids (the chat template applied as the
scheduler applies it) and the output token ids (stopping on the same stop tokens)."""

from __future__ import annotations

import json
import sys

import torch

from dspark.fetch import ensure_model
from dspark.loading import load_engine
from dspark.stop_tokens import stop_token_ids
from dspark.sampling import SamplingParams


def main() -> None:
    cases = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    engine, tokenizer = load_engine(ensure_model(), None, "none", "float32", None)
    stops = stop_token_ids(tokenizer)
    prompts = []
    for case in cases:
        text = tokenizer.apply_chat_template(case["messages"], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    # One request at a time: a request's greedy output does not depend on what else is batched,
    # but the reference should not rely on that.
    results = []
    for case, prompt_ids in zip(cases, prompts):
        done = engine.generate([prompt_ids], SamplingParams(temperature=0), case["max_tokens"],
                               stops)
        results.append({"prompt_ids": prompt_ids, "output_ids": list(done[0].output_ids)})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
