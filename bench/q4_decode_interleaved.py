"""Decode steps of the target with weights=q4 and with dense float32, interleaved step by step.

On a shared, contended machine a run of one mode then the other measures the neighbours as much
as the modes; here both runners hold the same streams (prompts prefilled once each) and take
turns one decode step at a time, so each pair of steps sees about the same contention. Reports
the median step time per mode and stream count, and the median of the per-pair ratios. Also one
8-row verification forward per stream count, interleaved the same way.

    .venv/bin/python bench/q4_decode_interleaved.py [--streams 1,16] [--steps 24] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from dspark.cpu_info import cpu_description, cpu_line
from dspark.fetch import ensure_gguf
from dspark.models.runner import ForwardItem, RunnerConfig, TargetRunner

from target_decode import chat_prompts  # bench/ is on sys.path when run as a script


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = ensure_gguf().parent
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    streams_list = [int(s) for s in args.streams.split(",")]
    prompts = chat_prompts(tokenizer, max(streams_list))
    kv = max(streams_list) * (max(len(p) for p in prompts) + args.steps + 64)
    runners = {w: TargetRunner(model_dir, RunnerConfig(dtype="float32", weights=w, kv_cache_tokens=kv))
               for w in ("q4", "dense")}
    rows = []
    with torch.inference_mode():
        for streams in streams_list:
            state = {}
            for w, r in runners.items():
                ids = [(w, streams, i) for i in range(streams)]
                for rid in ids:
                    r.add_request(rid)
                out = r.forward([ForwardItem(rid, p) for rid, p in zip(ids, prompts[:streams])])
                state[w] = (ids, out.logits.argmax(-1).tolist())
            times = {w: [] for w in runners}
            same = True
            for _ in range(args.steps):
                for w, r in runners.items():
                    ids, tokens = state[w]
                    t0 = time.perf_counter()
                    out = r.forward([ForwardItem(rid, [t]) for rid, t in zip(ids, tokens)])
                    times[w].append(time.perf_counter() - t0)
                    state[w] = (ids, out.logits.argmax(-1).tolist())
                same &= state["q4"][1] == state["dense"][1]
            verify = {w: [] for w in runners}
            for _ in range(3):
                for w, r in runners.items():
                    ids, tokens = state[w]
                    t0 = time.perf_counter()
                    r.forward([ForwardItem(rid, [t] * 8, logits_from=0) for rid, t in zip(ids, tokens)])
                    verify[w].append(time.perf_counter() - t0)
                    for rid in ids:
                        r.truncate(rid, r.length(rid) - 8)
            for w, r in runners.items():
                for rid in state[w][0]:
                    r.free(rid)
            ratio = statistics.median(d / q for q, d in zip(times["q4"], times["dense"]))
            row = {"streams": streams, "steps": args.steps,
                   "q4_decode_tok_s": round(streams / statistics.median(times["q4"]), 1),
                   "float32_decode_tok_s": round(streams / statistics.median(times["dense"]), 1),
                   "q4_over_float32_paired": round(ratio, 2),
                   "q4_verify8_ms": round(1e3 * statistics.median(verify["q4"]), 1),
                   "float32_verify8_ms": round(1e3 * statistics.median(verify["dense"]), 1),
                   "same_greedy_tokens": same}
            print(json.dumps(row), flush=True)
            rows.append(row)
    cpu = cpu_description()
    print(f"\nCPU: {cpu_line(cpu)}; torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}\n")
    print("| streams | q4 decode tok/s | float32 decode tok/s | q4 / float32 (paired steps) | "
          "verify 8 rows/stream q4 ms | float32 ms | same greedy tokens |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['streams']} | {r['q4_decode_tok_s']} | {r['float32_decode_tok_s']} | "
              f"{r['q4_over_float32_paired']} | {r['q4_verify8_ms']} | {r['float32_verify8_ms']} | "
              f"{r['same_greedy_tokens']} |")
    print(json.dumps({"bench": "q4_decode_interleaved", "threads": args.threads, **cpu,
                      "load_avg_1m": os.getloadavg()[0], "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
