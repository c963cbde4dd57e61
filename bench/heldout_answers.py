"""Re-answer a data file's held-out prompts with other sampling settings (for the train/serve gap).

The shipped drafters were trained on answers sampled at T 0.7 / top-p 0.8 / top-k 20, and are
evaluated on the target's own T=1 text. To see how much of the acceptance gap is the contexts,
this writes the same held-out prompts answered at another setting, in the format of
`dspark data generate`, so `bench/drafter_context_ablation.py --data OUT` can measure the
teacher-forced acceptance on them. Usage:

    .venv/bin/python bench/heldout_answers.py --out runs/heldout_t1.jsonl.gz --temperature 1.0 \
        [--top-p 1.0] [--top-k 0] [--data data/smollm2_answers.jsonl.gz] [--max-new-tokens 256]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import torch

from dspark.devices import add_device_argument, resolve_device


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/smollm2_answers.jsonl.gz"))
    parser.add_argument("--model-dir", default=None, help="the target's folder (default: dspark fetch-model's)")
    parser.add_argument("--out", type=Path, required=True, help=".jsonl.gz to write (replaced)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from dspark.evaluation.eval_cli import stop_token_ids
    from dspark.fetch import ensure_model
    from dspark.models.runner import RunnerConfig, TargetRunner
    from dspark.sampling import SamplingParams
    from dspark.training.data import generate_answers, read_records

    records = [r for r in read_records(args.data) if r.get("split") == "heldout"]
    if not records:
        print(f"{args.data}: no held-out records", file=sys.stderr)
        return 2
    model_dir = args.model_dir or ensure_model()
    eos = set(stop_token_ids(AutoTokenizer.from_pretrained(model_dir)))
    runner = TargetRunner(model_dir, RunnerConfig(kv_cache_tokens=args.batch_size * 2048,
                                                  device=resolve_device(args.device)))
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    by_id = {r["id"]: r for r in records}
    start, tokens = time.perf_counter(), 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        for key, answer, finished in generate_answers(
                runner, [(r["id"], r["prompt_ids"]) for r in records],
                max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, sampling=sampling,
                eos_token_ids=eos, generator=torch.Generator().manual_seed(args.seed)):
            r = by_id[key]
            f.write(json.dumps({"id": key, "source": r.get("source"), "split": "heldout",
                                "prompt_ids": r["prompt_ids"], "answer_ids": answer,
                                "finished": finished}) + "\n")
            tokens += len(answer)
    print(json.dumps({"bench": "heldout_answers", "answers": len(records), "answer_tokens": tokens,
                      "seconds": round(time.perf_counter() - start, 1), "temperature": args.temperature,
                      "top_p": args.top_p, "top_k": args.top_k, "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
