"""`dspark eval`: acceptance figures per method on a prompt file (docs/design.md sections 9-10).

Every method drafts and the target verifies a fixed number of drafts per round (the full block,
or one draft for the MTP-1-like baseline): raw draft quality, with no scheduler, as in the paper's
Table 1. Per method: `tau` (accepted + 1 per round), per-position conditional acceptance, and for
drafters with a confidence head the per-position ECE of the cumulative confidences before (raw)
and after STS (the fit in the checkpoint's `calibration.json` for the nearest sampling temperature;
without one, after = before) and the AUC.

stdout: markdown tables (Table 1 layout: rows are methods, columns tau and per-position
acceptance; then calibration). With `--json` the last stdout line is one JSON object keyed by
method. Progress and notes go to stderr.

    dspark eval --dataset ../shared/data/eval/gsm8k.jsonl --limit 20 --temperature 1.0 --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from dspark.devices import add_device_argument
from dspark.methods import METHODS, VerifyLength, checkpoint_folder, parse_methods
from dspark.loading import is_checkpoint
from dspark.paths import CHECKPOINTS_DIR
from dspark.stop_tokens import stop_token_ids



def _log(message: str) -> None:
    print(f"[dspark eval] {message}", file=sys.stderr, flush=True)


def default_checkpoints() -> Path:
    """`checkpoints/` of the working directory if it exists, else the repository's."""
    local = Path("checkpoints")
    return local if local.is_dir() else CHECKPOINTS_DIR


def read_eval_prompts(path: Path, limit: int | None = None) -> list[str]:
    """First user turn of each `{"turns": [...]}` line (an eval set of paths.EVAL_PROMPTS_DIR)."""
    prompts = []
    with open(path, encoding="utf-8") as f:  # not splitlines(): prompts may hold U+2028
        for line in f:
            if not line.strip():
                continue
            turns = json.loads(line).get("turns")
            if not turns or not isinstance(turns[0], str):
                raise ValueError(f"{path}: a line without a first turn: {line[:80]!r}")
            prompts.append(turns[0])
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", type=Path, required=True,
                        help='prompt file, one {"turns": [...]} per line (first turn is used)')
    parser.add_argument("--limit", type=int, default=None, help="first N prompts only")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated, from {','.join(METHODS)} (default: all; a missing "
                             f"checkpoint is then skipped, while a requested one is an error)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--json", action="store_true",
                        help="end stdout with one JSON line keyed by method")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens generated per prompt")
    parser.add_argument("--checkpoints", type=Path, default=None,
                        help="folder with dspark-markov/, dspark-rnn/, dflash/, eagle/ "
                             "(default: ./checkpoints, else the repository's)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="target model folder (default: the prepared SmolLM2)")
    parser.add_argument("--plots", type=Path, default=None,
                        help="write acceptance.png and reliability_<method>.png here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verification", default="token",
                        choices=["token", "block", "drafter-invariant"],
                        help="how sampled drafts are accepted: token (the paper's protocol, which "
                             "the confidences are calibrated to) or block "
                             "(dspark.block_verification)")
    parser.add_argument("--max-running", type=int, default=8, help="prompts generated together")
    add_device_argument(parser)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="target and drafter dtype (default: float32 on CPU, bf16 on CUDA)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--drafter-weights", default=None, choices=["q8", "dense"],
                        help="q8: Q8_0 blocks of the drafter's float32 weights (float32 math); dense (default): "
                             "its dtype tensors")
    parser.add_argument("--drafter-dtype", default=None, choices=["float32", "bfloat16"],
                        help="dense drafter weights in this dtype (default: dspark.loading.drafter_dtype)")


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def format_acceptance_table(results: dict, missing: dict[str, Path], title: str) -> str:
    """Markdown, the paper's Table 1 layout: a row per method, tau then acceptance per position."""
    gamma = max([len(r.accept_per_position) for r in results.values()] or [1])
    lines = [f"**{title}**", "",
             "| Method | tau | " + " | ".join(f"k={k}" for k in range(1, gamma + 1)) + " | rounds |",
             "|---|---:|" + "---:|" * gamma + "---:|"]
    for name in METHODS:
        if name in results:
            s = results[name]
            acc = [_fmt(a) for a in s.accept_per_position] + [""] * (gamma - len(s.accept_per_position))
            lines.append(f"| {METHODS[name].label} | {_fmt(s.tau, 2)} | " + " | ".join(acc)
                         + f" | {s.rounds} |")
        elif name in missing:
            lines.append(f"| {METHODS[name].label} | missing | " + " | ".join([""] * gamma)
                         + f" | no checkpoint at {missing[name]} |")
    return "\n".join(lines)


def format_calibration_table(results: dict, calibrated: dict[str, bool]) -> str | None:
    """Markdown: per-position ECE raw / after STS and conditional AUC, per method with a head.

    "ECE floor" is the ECE a perfectly calibrated predictor would show with the same calibrated
    predictions on this many rounds (`dspark.calibration.metrics.ece_noise_floor`)."""
    rows = {n: s for n, s in results.items() if s.calibration is not None}
    if not rows:
        return None
    gamma = max(len(s.calibration.positions) for s in rows.values())
    lines = ["**Calibration (ECE of the cumulative confidence a_k, 15 bins; AUC of c_k)**", "",
             "| Method | metric | " + " | ".join(f"k={k}" for k in range(1, gamma + 1)) + " | mean |",
             "|---|---|" + "---:|" * gamma + "---:|"]
    for name, s in rows.items():
        pos = s.calibration.positions
        sts = "STS" if calibrated.get(name) else "STS (none fitted)"
        for metric, values in (("ECE raw", [100 * p.ece_before for p in pos]),
                               (f"ECE {sts}", [100 * p.ece_after for p in pos]),
                               ("ECE floor", [100 * p.ece_floor_after for p in pos]),
                               ("AUC", [p.auc_conditional for p in pos])):
            pct = metric.startswith("ECE")
            cells = [_fmt(v, 2 if pct else 3) + ("%" if pct else "") for v in values]
            finite = [v for v in values if math.isfinite(v)]
            mean = _fmt(float(np.mean(finite)) if finite else None, 2 if pct else 3) + (
                "%" if pct and finite else "")
            lines.append(f"| {METHODS[name].label} | {metric} | " + " | ".join(cells)
                         + f" | {mean} |")
    return "\n".join(lines)


def plot_acceptance(path: Path, results: dict, title: str) -> Path:
    """Per-position conditional acceptance per method (the paper's Figure 2 style)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, s in results.items():
        ks = np.arange(1, len(s.accept_per_position) + 1)
        ax.plot(ks, s.accept_per_position, "o-", markersize=4,
                label=f"{METHODS[name].label} (tau {_fmt(s.tau, 2)})")
    gamma = max(len(s.accept_per_position) for s in results.values())
    ax.set_xticks(range(1, gamma + 1))
    ax.set_xlim(0.5, gamma + 0.5)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("conditional acceptance")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from dspark.calibration.report import plot_reliability
    from dspark.evaluation.acceptance import CollectConfig, collect_records, summarize
    from dspark.loading import (has_confidence_head, load_calibration, load_method_drafter,
                                load_target, resolve_device)
    from dspark.models.drafter_config import DrafterConfig
    from dspark.rejection import VerificationRule
    from dspark.training.data import encode_chat
    from dspark.verifier import TargetVerifier

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        methods = parse_methods(args.methods) if args.methods is not None else list(METHODS)
    except ValueError as e:
        print(f"dspark eval: {e}", file=sys.stderr)
        return 2
    checkpoints = args.checkpoints if args.checkpoints is not None else default_checkpoints()
    available = [m for m in methods if is_checkpoint(checkpoint_folder(checkpoints, m))]
    missing = {m: checkpoint_folder(checkpoints, m) for m in methods if m not in available}
    if args.methods is not None and missing:
        for m, folder in missing.items():
            print(f"dspark eval: method {m!r} needs a drafter checkpoint at {folder} "
                  f"(config.json + model.safetensors); none found", file=sys.stderr)
        return 2
    for m, folder in missing.items():
        _log(f"{m}: missing (no drafter checkpoint at {folder}); skipped")
    if not available:
        print(f"dspark eval: no drafter checkpoints under {checkpoints}", file=sys.stderr)
        return 2

    model_dir = args.model_dir
    if model_dir is None:
        from dspark.fetch import ensure_model
        model_dir = ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = read_eval_prompts(args.dataset, args.limit)
    prompts = [encode_chat(tokenizer, t) for t in texts]
    stops = stop_token_ids(tokenizer)
    device = resolve_device(args.device)

    results, records, calibrations = {}, {}, {}
    runner, drafters = None, {}
    for name in available:
        spec = METHODS[name]
        folder = checkpoint_folder(checkpoints, name)
        config = DrafterConfig.load(folder)
        layer_ids = tuple(int(i) for i in config.target_layer_ids)
        if runner is None or tuple(runner.config.hidden_layer_ids) != layer_ids:
            drafters.clear()  # drafters share the runner's embedding; rebuild with the new one
            runner = None
            kv_tokens = args.max_running * (max(map(len, prompts)) + args.max_tokens
                                            + 2 * config.block_size + 16)
            runner = load_target(model_dir, layer_ids, kv_cache_tokens=kv_tokens, device=device,
                                 dtype=args.dtype)
        try:
            if folder not in drafters:
                drafters[folder] = load_method_drafter(
                    folder, runner, weights=args.drafter_weights,
                    dtype=getattr(torch, args.drafter_dtype) if args.drafter_dtype else None)
        except ValueError as e:
            print(f"dspark eval: {name}: {e}", file=sys.stderr)
            return 2
        drafter = drafters[folder]
        with_head = has_confidence_head(drafter)
        verify_len = drafter.gamma if spec.verify is VerifyLength.FULL_BLOCK else 1
        cfg = CollectConfig(verify_len=verify_len, temperature=args.temperature,
                            max_tokens=args.max_tokens, max_running=args.max_running,
                            seed=args.seed, stop_token_ids=stops)
        start = time.perf_counter()
        out = collect_records(TargetVerifier(runner, VerificationRule(args.verification)),
                              drafter, prompts, cfg,
                              has_confidences=with_head)
        seconds = time.perf_counter() - start
        calibration = load_calibration(folder, args.temperature) if with_head else None
        calibrations[name] = calibration is not None
        summary = summarize(out.records, calibration,
                            with_calibration=with_head and spec.verify is VerifyLength.FULL_BLOCK)
        results[name], records[name] = summary, out.records
        _log(f"{name}: tau {_fmt(summary.tau, 3)} over {summary.rounds} rounds "
             f"({len(prompts)} prompts, {sum(map(len, out.output_ids))} tokens, {seconds:.1f}s)")

    title = (f"Acceptance on {args.dataset.name} ({len(prompts)} prompts, temperature "
             f"{args.temperature:g}, max {args.max_tokens} tokens, fixed verification length)")
    print(format_acceptance_table(results, missing, title))
    cal_table = format_calibration_table(results, calibrations)
    if cal_table:
        print()
        print(cal_table)

    if args.plots is not None:
        args.plots.mkdir(parents=True, exist_ok=True)
        written = [plot_acceptance(args.plots / "acceptance.png", results,
                                   f"{args.dataset.name}, temperature {args.temperature:g}")]
        for name, s in results.items():
            if s.calibration is None:
                continue
            full = records[name].full_rounds()
            sts = load_calibration(checkpoint_folder(checkpoints, name), args.temperature)
            written.append(Path(plot_reliability(
                args.plots / f"reliability_{name}.png", full.confidences, full.survival(), sts,
                title=f"{METHODS[name].label} on {args.dataset.name}")))
        _log("plots: " + ", ".join(str(p) for p in written))

    if args.json:
        payload = {}
        for name, s in results.items():
            payload[name] = s.to_dict()
            payload[name]["checkpoint"] = str(checkpoint_folder(checkpoints, name))
            if s.calibration is not None:
                payload[name]["sts_fitted"] = calibrations[name]
        print(json.dumps(payload, allow_nan=False))
    return 0
