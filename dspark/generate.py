"""`dspark generate`: stream one generation from the embedded engine (docs/design.md section 10).

Only the generated text goes to stdout (streamed as it is produced); logs and `--stats` go to
stderr. The target is the prepared SmolLM2 unless `--model-dir` says otherwise (prepared on first
use, like `dspark fetch-model`); the drafter is the shipped DSpark checkpoint when there is one,
else the engine decodes with the target alone (still exact, just not faster). The cost table
SPS(B) is read from `--cost-table`, or measured at start-up and cached under DSPARK_HOME.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from dspark.admission import AdmissionPolicy
from dspark.devices import add_device_argument, resolve_device
from dspark.drafter_choice import drafter_dir_or_shipped
from dspark.paths import DEFAULT_DRAFTER
from dspark.sampling import SamplingParams
from dspark.stop_tokens import stop_token_ids


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (with --chat: one user message)")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--policy", default="async_topk",
                        help="async_topk | sync_greedy | none | fixed:N | threshold:H")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stats", action="store_true", help="acceptance figures to stderr")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="target folder (default: the prepared SmolLM2)")
    parser.add_argument("--drafter", type=Path, default=None,
                        help=f"drafter checkpoint folder (default: {DEFAULT_DRAFTER} if present; "
                             "none = target only)")
    parser.add_argument("--cost-table", type=Path, default=None,
                        help="SPS(B) table JSON (default: measured at start-up, cached in DSPARK_HOME)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--weights", default=None, choices=["q4", "dense"],
                        help="q4: the model folder's GGUF blocks (float32 math); dense: --dtype tensors "
                             "(default: q4 where it applies)")
    parser.add_argument("--drafter-weights", default=None, choices=["q8", "dense"],
                        help="q8: Q8_0 blocks of the drafter's float32 weights (float32 math); dense (default): "
                             "its dtype tensors")
    parser.add_argument("--verification", default="token",
                        choices=["token", "block", "drafter-invariant"],
                        help="how sampled drafts are accepted: token by token, or the whole block "
                             "at once (both exact; greedy is the same under both)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_device_argument(parser)


def resolved_weights(model_dir: Path, dtype: str, weights: str | None) -> str:
    """RunnerConfig.weights as the runner will resolve it (the cost table is keyed by it)."""
    from dspark.models.runner import RunnerConfig, choose_weights

    config = RunnerConfig(dtype=dtype, weights=weights)
    return choose_weights(config, model_dir, torch.device(config.device), config.torch_dtype)


def run(args: argparse.Namespace) -> int:
    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed)
        policy = AdmissionPolicy.parse(args.policy)
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        device = resolve_device(args.device)
    except ValueError as e:
        log(f"dspark generate: {e}")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from dspark.cost_table import default_cost_table_path
    from dspark.fetch import dspark_home, ensure_model
    from dspark.loading import load_engine

    model_dir = args.model_dir or ensure_model()
    drafter_dir = drafter_dir_or_shipped(args.drafter)
    if args.drafter is None and drafter_dir is None and policy.drafts:
        log(f"no drafter checkpoint (looked for {DEFAULT_DRAFTER}): decoding with the target only")
    weights = resolved_weights(Path(model_dir), args.dtype, args.weights)
    cost_table = args.cost_table or default_cost_table_path(dspark_home(), Path(model_dir).name,
                                                            args.dtype, device, weights)
    engine, tokenizer = load_engine(Path(model_dir), drafter_dir, args.policy, args.dtype,
                                    cost_table, verification=args.verification, device=device,
                                    weights=weights, drafter_weights=args.drafter_weights)

    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                             tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer(args.prompt)["input_ids"]
    stops = stop_token_ids(tokenizer)
    request = engine.request(engine.add_request(prompt_ids, sampling, args.max_tokens, stops))

    start = time.perf_counter()
    first_token_at = None
    printed = ""
    for out in engine.stream():
        if first_token_at is None:
            first_token_at = time.perf_counter()
        ids = [t for t in request.output_ids if t not in stops]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        # Print only the stable part: a partial UTF-8 character decodes to U+FFFD until complete.
        if not out.finished and text.endswith("\ufffd"):
            continue
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text
    sys.stdout.write("\n")
    sys.stdout.flush()
    elapsed = time.perf_counter() - start
    if args.stats:
        m = request.metrics
        n = len(request.output_ids)
        after_first = elapsed - ((first_token_at or start) - start)
        per_pos = [f"{a / v:.2f}" if v else "-" for a, v in
                   zip(m.accepted_per_position, m.verified_per_position)]
        log(f"[stats] tokens={n} rounds={m.rounds} tau={m.tau:.2f} "
            f"drafts_verified={m.drafts_verified} drafts_accepted={m.drafts_accepted} "
            f"accept_per_position=[{', '.join(per_pos)}] finish={request.finish_reason} "
            f"seconds={elapsed:.2f} tokens_per_s={max(n - 1, 0) / max(after_first, 1e-9):.1f} "
            f"policy={args.policy} drafter={drafter_dir or 'none'}")
    return 0
