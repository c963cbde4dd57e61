"""`dspark calibrate`: fit STS on the held-out split and store it beside the drafter (issue 4 part 5).

The drafter generates answers to the held-out prompts of the training data file (records with
`split == "heldout"`, never trained on) with full-block verification (`fixed:gamma`); every full
round gives the raw confidences c_1..c_gamma and the observed prefix survival. Sequential
Temperature Scaling (DESIGN.md section 4, `dspark.calibration.fit_sts`) is fitted on them and
written to `calibration.json` in the checkpoint folder, where `load_method_drafter(...,
apply_calibration=True)` (and so inference) picks it up. stdout: the before/after table; a
reliability diagram `reliability.png` is written beside the checkpoint.

    dspark calibrate --checkpoint checkpoints/dspark-markov --data data/smollm2_answers.jsonl.gz
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

HELDOUT_SPLIT = "heldout"


def _log(message: str) -> None:
    print(f"[dspark calibrate] {message}", file=sys.stderr, flush=True)


def heldout_prompts(path: Path, limit: int | None = None) -> list[list[int]]:
    """prompt_ids of the held-out records of a generated data file (in file order)."""
    from dspark.training.data import read_records

    if not Path(path).is_file():
        raise FileNotFoundError(f"no data file at {path}")
    prompts = []
    for r in read_records(path):
        if r.get("split") == HELDOUT_SPLIT:
            prompts.append([int(t) for t in r["prompt_ids"]])
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path}: no records with split == {HELDOUT_SPLIT!r}")
    return prompts


def _without_nan(x):
    """JSON-safe copy: NaN / infinite floats (an AUC with one class present) become null."""
    if isinstance(x, dict):
        return {k: _without_nan(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_without_nan(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="drafter folder (config.json + model.safetensors); calibration.json "
                             "is written here")
    parser.add_argument("--data", type=Path, required=True,
                        help="data file of `dspark data generate` (.jsonl or .jsonl.gz); its "
                             "held-out split is used")
    parser.add_argument("--limit", type=int, default=None, help="first N held-out prompts only")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature of the calibration runs (0 = greedy)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens generated per prompt")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="target model folder (default: the prepared SmolLM2)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="reliability PNG (default: CHECKPOINT/reliability.png)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-running", type=int, default=8, help="prompts generated together")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", action="store_true",
                        help="end stdout with the report as one JSON line")


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark.calibration import CALIBRATION_FILENAME, calibration_report, fit_sts, plot_reliability
    from dspark.evaluation.acceptance import CollectConfig, collect_records
    from dspark.evaluation.eval_cli import stop_token_ids
    from dspark.evaluation.loading import (has_confidence_head, is_checkpoint, load_method_drafter,
                                           load_target, resolve_device)
    from dspark.models.drafter_config import DrafterConfig
    from dspark.verifier import TargetVerifier

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.checkpoint
    if not is_checkpoint(folder):
        print(f"dspark calibrate: no drafter checkpoint at {folder} (config.json + "
              f"model.safetensors)", file=sys.stderr)
        return 2
    try:
        prompts = heldout_prompts(args.data, args.limit)
    except (FileNotFoundError, ValueError) as e:
        print(f"dspark calibrate: {e}", file=sys.stderr)
        return 2
    model_dir = args.model_dir
    if model_dir is None:
        from dspark.fetch import ensure_model
        model_dir = ensure_model()

    config = DrafterConfig.load(folder)
    kv_tokens = args.max_running * (max(map(len, prompts)) + args.max_tokens
                                    + 2 * config.block_size + 16)
    runner = load_target(model_dir, tuple(config.target_layer_ids), kv_cache_tokens=kv_tokens,
                         device=resolve_device(args.device), dtype=args.dtype)
    try:
        drafter = load_method_drafter(folder, runner)  # raw confidences: no STS applied
    except ValueError as e:
        print(f"dspark calibrate: {e}", file=sys.stderr)
        return 2
    if not has_confidence_head(drafter):
        print(f"dspark calibrate: the drafter in {folder} has no confidence head; nothing to "
              f"calibrate", file=sys.stderr)
        return 2

    from transformers import AutoTokenizer
    stops = stop_token_ids(AutoTokenizer.from_pretrained(model_dir))
    cfg = CollectConfig(verify_len=drafter.gamma, temperature=args.temperature,
                        max_tokens=args.max_tokens, max_running=args.max_running, seed=args.seed,
                        stop_token_ids=stops)
    start = time.perf_counter()
    out = collect_records(TargetVerifier(runner), drafter, prompts, cfg,
                          progress=lambda done, total: _log(f"{done}/{total} prompts")
                          if done == total or done % 10 == 0 else None)
    full = out.records.full_rounds()
    _log(f"{len(prompts)} held-out prompts, {full.num_rounds} full rounds "
         f"({time.perf_counter() - start:.1f}s)")
    if full.num_rounds == 0:
        print("dspark calibrate: no full verification rounds to fit on (raise --max-tokens)",
              file=sys.stderr)
        return 2
    survived = full.survival()  # [num_rounds, gamma]
    sts = fit_sts(full.confidences, survived)
    sts.save(folder / CALIBRATION_FILENAME)
    report = calibration_report(full.confidences, survived, sts)
    plot_path = args.plot if args.plot is not None else folder / "reliability.png"
    plot_reliability(plot_path, full.confidences, survived, sts,
                     title=f"{folder.name}: held-out split, temperature {args.temperature:g}")
    print(report.format_table())
    _log(f"wrote {folder / CALIBRATION_FILENAME} and {plot_path}")
    if args.json:
        print(json.dumps(_without_nan(report.to_dict()), allow_nan=False))
    return 0
