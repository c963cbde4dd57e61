"""Plain greedy decoding at 1-256 streams: our TargetRunner against transformers on the same weights.

For each dtype and stream count, in one run and taken in turns:
- **generate**: every stream greedy-decodes exactly `--new-tokens` tokens, the prefill included,
  with our runner (its default attention), our runner with per-request SDPA (`--baseline-attention`,
  the path before the block-table kernel), and transformers `generate` (left-padded batch);
- **decode**: the streams' prompts prefilled, then `--decode-steps` steps of one token per stream,
  timed alone: decode tokens/s and the achieved GFLOP/s of the weight products;
- **prefill**: the same prompts in one chunked forward: the ceiling, since a batch of one-token
  steps does the same products as a prefill of as many tokens;
- **verify**: a mixed verification batch, each stream appending 1-9 tokens (anchor + 0-8 drafts)
  at its prompt's end, logits for all of them.

GFLOP/s counts 2 x (decoder weights + LM head weights) per token that needs logits (attention's
own products are left out, so the figure is what the weight products achieve). Ratios are measured
in the same run (docs/design.md section 9); the CPU model and its vector flags are printed beside them.

Prints markdown tables and ends with one JSON line. Usage:
    .venv/bin/python bench/target_decode.py [--streams 1,16,64,256] [--dtypes float32,bfloat16]
        [--new-tokens 32] [--decode-steps 8] [--repeats 1] [--threads N] [--no-hf]
        [--weights q4,float32,bfloat16]
`--weights` replaces `--dtypes` with weight modes: q4 = float32 activations on the GGUF's own
blocks (RunnerConfig.weights "q4"), float32 / bfloat16 = dense weights of that dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.cpu_info import cpu_description, cpu_line
from dspark.fetch import ensure_model
from dspark.models.runner import ForwardItem, RunnerConfig, TargetRunner, generate_greedy
from dspark.models.transformer import AttentionImpl
from dspark.paths import EVAL_PROMPTS_DIR, require_folder


def chat_prompts(tokenizer, count: int, eval_dir: Path = EVAL_PROMPTS_DIR) -> list[list[int]]:
    """First turns of the eval files, round-robin over files (repeating them past their size), as
    chat-templated token ids."""
    per_file = [[json.loads(line)["turns"][0] for line in f.read_text().splitlines() if line.strip()]
                for f in sorted(require_folder(eval_dir, "eval prompts").glob("*.jsonl"))]
    texts = [rows[i % len(rows)] for i in range(count) for rows in per_file][:count]
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


def weight_flops_per_token(runner: TargetRunner) -> tuple[float, float]:
    """(decoder layers, LM head) FLOPs of the weight products for one token."""
    mc = runner.model_config
    h, i = mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    layer = 2 * (h * (q + 2 * kv) + q * h + h * 2 * i + i * h)
    return layer * mc.num_hidden_layers, 2 * h * mc.vocab_size


def phases(runner: TargetRunner, prompts: list[list[int]], decode_steps: int,
           rng: random.Random) -> dict:
    """Seconds of a prefill of all prompts, then `decode_steps` one-token steps, then one mixed
    verification forward (1-9 new tokens per stream, logits for all)."""
    ids = [("bench", i) for i in range(len(prompts))]
    for rid in ids:
        runner.add_request(rid)
    try:
        prefill_s, out = timed(lambda: runner.forward([ForwardItem(r, p) for r, p in zip(ids, prompts)]))
        tokens = out.logits.argmax(-1).tolist()
        decode_s = 0.0
        for _ in range(decode_steps):
            t, out = timed(lambda: runner.forward([ForwardItem(r, [t]) for r, t in zip(ids, tokens)]))
            decode_s += t
            tokens = out.logits.argmax(-1).tolist()
        lens = [rng.randint(1, 9) for _ in ids]
        verify_items = [ForwardItem(r, [tok] * n, logits_from=0) for r, tok, n in zip(ids, tokens, lens)]
        verify_s, _ = timed(lambda: runner.forward(verify_items))
    finally:
        for rid in ids:
            runner.free(rid)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "verify_s": verify_s,
            "verify_tokens": sum(lens)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="default: dspark fetch-model's folder")
    parser.add_argument("--eval-dir", type=Path, default=EVAL_PROMPTS_DIR)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--streams", default="1,16,64,256")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--weights", default=None,
                        help="comma list of q4|float32|bfloat16 (instead of --dtypes): q4 = the GGUF blocks")
    parser.add_argument("--baseline-attention", default=AttentionImpl.PER_REQUEST.value,
                        choices=[a.value for a in AttentionImpl])
    parser.add_argument("--no-hf", action="store_true", help="skip transformers (faster)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every side (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(args.model_dir) if args.model_dir else ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    streams_list = [int(s) for s in args.streams.split(",")]
    all_prompts = chat_prompts(tokenizer, max(streams_list), args.eval_dir)
    rng = random.Random(0)
    rows = []
    modes = args.weights.split(",") if args.weights else args.dtypes.split(",")
    for mode in modes:
        dtype_name = "float32" if mode == "q4" else mode
        weights = "q4" if mode == "q4" else "dense"
        dtype = getattr(torch, dtype_name)
        hf = None if args.no_hf else AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        kv_tokens = max(streams_list) * (max(len(p) for p in all_prompts) + args.new_tokens + 64)
        ours = TargetRunner(model_dir, RunnerConfig(dtype=dtype_name, weights=weights, kv_cache_tokens=kv_tokens))
        base = TargetRunner(model_dir, RunnerConfig(
            dtype=dtype_name, weights=weights, kv_cache_tokens=kv_tokens,
            attention=AttentionImpl(args.baseline_attention)))
        layer_flops, head_flops = weight_flops_per_token(ours)
        for streams in streams_list:
            prompts = all_prompts[:streams]
            times: dict[str, list[float]] = {"hf": [], "ours": [], "base": []}
            ph: dict[str, list[dict]] = {"ours": [], "base": []}
            with torch.inference_mode():
                generate_greedy(ours, prompts[:1], 2)  # warm-up
                generate_greedy(base, prompts[:1], 2)
                for _ in range(args.repeats):
                    if hf is not None:
                        t, hf_tokens = timed(lambda: hf_generate(hf, tokenizer, prompts, args.new_tokens))
                        times["hf"].append(t)
                    t, our_tokens = timed(lambda: generate_greedy(ours, prompts, args.new_tokens))
                    times["ours"].append(t)
                    t, base_tokens = timed(lambda: generate_greedy(base, prompts, args.new_tokens))
                    times["base"].append(t)
                    for name, runner in (("ours", ours), ("base", base)):
                        ph[name].append(phases(runner, prompts, args.decode_steps, rng))
            total = streams * args.new_tokens
            prompt_tokens = sum(len(p) for p in prompts)
            med = {k: statistics.median(v) for k, v in times.items() if v}
            row = {"dtype": mode, "streams": streams, "new_tokens": args.new_tokens,
                   "prompt_tokens": prompt_tokens}
            for name in ("ours", "base"):
                p = {k: statistics.median(d[k] for d in ph[name]) for k in ph[name][0]}
                decode_tps = streams * args.decode_steps / p["decode_s"]
                row[f"{name}_gen_tok_s"] = round(total / med[name], 1)
                row[f"{name}_decode_tok_s"] = round(decode_tps, 1)
                row[f"{name}_decode_gflops"] = round(decode_tps * (layer_flops + head_flops) / 1e9, 1)
                row[f"{name}_prefill_tok_s"] = round(prompt_tokens / p["prefill_s"], 1)
                row[f"{name}_verify_tok_s"] = round(p["verify_tokens"] / p["verify_s"], 1)
            row["ours_decode_over_prefill"] = round(row["ours_decode_tok_s"] / row["ours_prefill_tok_s"], 2)
            row["ours_over_base_gen"] = round(med["base"] / med["ours"], 2)
            row["same_tokens_as_base"] = our_tokens == base_tokens
            if "hf" in med:
                row["hf_gen_tok_s"] = round(total / med["hf"], 1)
                row["ours_over_hf_gen"] = round(med["hf"] / med["ours"], 2)
                row["same_tokens_as_hf"] = our_tokens == hf_tokens
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
        del hf, ours, base

    cpu = cpu_description()
    print(f"CPU: {cpu_line(cpu)}; "
          f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}\n")
    print("| dtype | streams | gen tok/s: transformers | base | ours | ours/HF | ours/base | "
          "decode tok/s (GFLOP/s) | prefill tok/s | decode/prefill | verify tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['streams']} | {r.get('hf_gen_tok_s', '-')} | {r['base_gen_tok_s']} | "
              f"{r['ours_gen_tok_s']} | {r.get('ours_over_hf_gen', '-')} | {r['ours_over_base_gen']} | "
              f"{r['ours_decode_tok_s']} ({r['ours_decode_gflops']}) | {r['ours_prefill_tok_s']} | "
              f"{r['ours_decode_over_prefill']} | {r['ours_verify_tok_s']} |")
    print(json.dumps({"bench": "target_decode", "repeats": args.repeats, "decode_steps": args.decode_steps,
                      "baseline_attention": args.baseline_attention,
                      "torch_threads": torch.get_num_threads(), **cpu,
                      "load_avg_1m": os.getloadavg()[0], "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
