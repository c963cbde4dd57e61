"""A seeded T = 1 request on the real target and the shipped drafter, alone and beside other
(unseeded) requests: are its tokens the same? The embedded engine, float32 on the CPU (where
oneDNN may round differently at different batch sizes), the request seeded 42 on the first
mt-bench prompt, the others the next prompts. Prints each run's first tokens and one JSON line.
Usage:
    .venv/bin/python bench/seeded_repeat.py [--policy async_topk] [--max-tokens 48]
        [--others 0,7,3] [--threads 2] [--device auto|cpu|cuda[:N]]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dspark.cost_table import CostTable
from dspark.cpu_info import cpu_line
from dspark.devices import add_device_argument, resolve_device
from dspark.engine import Engine, EngineConfig
from dspark.evaluation.eval_cli import read_eval_prompts
from dspark.fetch import ensure_model
from dspark.loading import load_method_drafter, load_target
from dspark.models.drafter_config import DrafterConfig
from dspark.paths import DEFAULT_DRAFTER, EVAL_PROMPTS_DIR
from dspark.sampling import SamplingParams
from dspark.training.data import encode_chat
from dspark.verifier import TargetVerifier

# A smooth cost table: under async_topk the unseeded requests' drafts depend on it, the seeded
# request's do not (dspark.seeded_admission).
TABLE = CostTable.from_step_seconds({b: 0.03 + 0.002 * b for b in (1, 2, 4, 8, 16, 32, 64)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="async_topk")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--others", default="0,7,3")
    parser.add_argument("--threads", type=int, default=2)
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = DrafterConfig.load(DEFAULT_DRAFTER)
    runner = load_target(model_dir, tuple(config.target_layer_ids), kv_cache_tokens=8 * 4096,
                         dtype="float32", device=resolve_device(args.device))
    drafter = load_method_drafter(DEFAULT_DRAFTER, runner, apply_calibration=True)
    counts = [int(n) for n in args.others.split(",")]
    prompts = [encode_chat(tokenizer, t) for t in
               read_eval_prompts(EVAL_PROMPTS_DIR / "mt-bench.jsonl", 1 + max(counts))]
    print(f"# {cpu_line()}; {args.threads} threads, float32, {args.policy}", flush=True)
    outputs = []
    for others in counts:
        engine = Engine(TargetVerifier(runner), drafter, TABLE,
                        EngineConfig().with_values(
                            policy=args.policy, max_running=8, update_cost_table=False))
        rid = engine.add_request(prompts[0], SamplingParams(temperature=1.0, seed=42),
                                 args.max_tokens)
        for p in prompts[1:1 + others]:
            engine.add_request(p, SamplingParams(temperature=1.0), args.max_tokens + 16)
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step().outputs:
                if out.request_id == rid:
                    tokens += out.new_token_ids
        outputs.append(tokens)
        print(f"beside {others}: {tokens[:16]}", flush=True)
    identical = all(o == outputs[0] for o in outputs)
    print(json.dumps({"bench": "seeded_repeat", "cpu": cpu_line(), "policy": args.policy,
                      "others": counts, "max_tokens": args.max_tokens, "identical": identical}))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
