"""Plain greedy decoding: our TargetRunner against transformers `generate` on the same weights.

1 stream and 16 concurrent streams, fp32 and bf16, chat prompts from ../shared/data/eval
(first turn of each record, chat template). Both sides produce exactly `--new-tokens` tokens per
stream (transformers with min_new_tokens, ours without stop tokens), including the prefill, and
run alternately `--repeats` times; the table reports median tokens/s and the ratio ours/HF
measured in the same run (DESIGN.md section 9: compare as ratios). The "same" column says whether
the greedy tokens of every stream agree (transformers pads the 16-stream batch on the left, which
changes its float rounding, so only the 1-stream case is expected to be exact).

Prints a markdown table and ends with one JSON line. Usage:
    .venv/bin/python bench/target_decode.py [--model-dir DIR] [--new-tokens 64] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.fetch import ensure_model
from dspark.models.runner import RunnerConfig, TargetRunner, generate_greedy

EVAL_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "eval"
GOALS = {1: 1.0, 16: 2.0}  # ours/HF tokens-per-second ratio to reach (DESIGN.md section 10)


def chat_prompts(tokenizer, count: int, eval_dir: Path = EVAL_DIR) -> list[list[int]]:
    """First turns of the eval files, round-robin over files, as chat-templated token ids."""
    per_file = [[json.loads(line)["turns"][0] for line in f.read_text().splitlines() if line.strip()]
                for f in sorted(eval_dir.glob("*.jsonl"))]
    texts = [rows[i] for i in range(count) for rows in per_file][:count]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]) for t in texts]


def hf_generate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers greedy generate of exactly `new_tokens` tokens per prompt (left-padded batch)."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad)
    return out[:, width:].tolist()


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: dspark fetch-model's folder")
    parser.add_argument("--eval-dir", type=Path, default=EVAL_DIR, help="prompts: the first turns of *.jsonl")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both sides (default: torch's; 1 is steadier on a "
                             "machine shared with other jobs)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(args.model_dir) if args.model_dir else ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    streams_list = [int(s) for s in args.streams.split(",")]
    all_prompts = chat_prompts(tokenizer, max(streams_list), args.eval_dir)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        runner = TargetRunner(model_dir, RunnerConfig(dtype=dtype_name))
        for streams in streams_list:
            prompts = all_prompts[:streams]
            with torch.inference_mode():
                hf_generate(hf, tokenizer, prompts, 4)  # warm-up both
                generate_greedy(runner, prompts, 4)
                hf_times, our_times = [], []
                for _ in range(args.repeats):
                    t, hf_tokens = timed(lambda: hf_generate(hf, tokenizer, prompts, args.new_tokens))
                    hf_times.append(t)
                    t, our_tokens = timed(lambda: generate_greedy(runner, prompts, args.new_tokens))
                    our_times.append(t)
            total = streams * args.new_tokens
            print(f"{dtype_name} x{streams}: HF {hf_times} s, ours {our_times} s", file=sys.stderr)
            hf_tps = total / statistics.median(hf_times)
            our_tps = total / statistics.median(our_times)
            rows.append({
                "dtype": dtype_name, "streams": streams, "hf_tok_s": round(hf_tps, 1),
                "ours_tok_s": round(our_tps, 1), "ratio": round(our_tps / hf_tps, 2),
                "goal": GOALS.get(streams), "same_tokens": hf_tokens == our_tokens,
                "prompt_tokens": [len(p) for p in prompts],
            })
        del hf, runner

    print(f"| dtype | streams | transformers tok/s | ours tok/s | ours/HF | goal | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['streams']} | {r['hf_tok_s']} | {r['ours_tok_s']} | "
              f"{r['ratio']}x | {r['goal'] or '-'}x | {'yes' if r['same_tokens'] else 'no'} |")
    print(json.dumps({
        "bench": "target_decode", "new_tokens": args.new_tokens, "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "machine": platform.machine(), "load_avg_1m": os.getloadavg()[0], "rows": rows,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
