"""`dspark calibrate`: fit STS on the held-out split and store it beside the drafter (docs/design.md section 4).

The drafter generates answers to the held-out prompts of the training data file (records with
`split == "heldout"`, never trained on) with full-block verification (`fixed:gamma`); every full
round gives the raw confidences c_1..c_gamma and the observed prefix survival. Sequential
Temperature Scaling (docs/design.md section 4, `dspark.calibration.fit.fit_sts`) is fitted on them
and written to `calibration.json` in the checkpoint folder, where `load_method_drafter(...,
apply_calibration=True)` (and so inference) picks it up. stdout: the before/after table; a
reliability diagram `reliability.png` is written beside the checkpoint.

    dspark calibrate --checkpoint checkpoints/dspark-markov --data data/smollm2_answers.jsonl.gz

Acceptance depends on the sampling temperature, so each temperature of `--temperature` (default
`0,1`) gets its own fit; inference uses the fit nearest a request's temperature.
`--shift` (the default) fits a per-position shift with each temperature
(``sigmoid(logit(c_k) / T_k + b_k)``, `dspark.calibration`); `--no-shift` is the paper's STS.
`--save-records FILE.npz` keeps the rounds' raw confidences and outcomes, and `--records
FILE.npz` refits from such a file without loading a model or generating anything.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from dspark.devices import add_device_argument

HELDOUT_SPLIT = "heldout"


def _log(message: str) -> None:
    print(f"[dspark calibrate] {message}", file=sys.stderr, flush=True)


def heldout_prompts(paths: Path | list[Path], limit: int | None = None) -> list[list[int]]:
    """prompt_ids of the held-out records of one or more generated data files.

    Several files are interleaved (the first held-out prompt of each, then the second of each,
    ...) so that `limit` draws from every file; a prompt held out in two files comes once.
    """
    from dspark.training.data import read_records

    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    per_file = []
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"no data file at {path}")
        held = [[int(t) for t in r["prompt_ids"]] for r in read_records(path)
                if r.get("split") == HELDOUT_SPLIT]
        if not held:
            raise ValueError(f"{path}: no records with split == {HELDOUT_SPLIT!r}")
        per_file.append(held)
    prompts, seen = [], set()
    for i in range(max(map(len, per_file))):
        for held in per_file:
            if i < len(held) and tuple(held[i]) not in seen:
                seen.add(tuple(held[i]))
                prompts.append(held[i])
    return prompts if limit is None else prompts[:limit]


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
    parser.add_argument("--data", type=_paths, required=True,
                        help="data file(s) of `dspark data generate` (.jsonl or .jsonl.gz), "
                             "comma-separated; their held-out splits are used, interleaved")
    parser.add_argument("--limit", type=int, default=None, help="first N held-out prompts only")
    parser.add_argument("--temperature", default="0,1",
                        help="sampling temperatures of the calibration runs, comma-separated "
                             "(0 = greedy); each gets its own fit (default 0,1)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens generated per prompt")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="target model folder (default: the prepared SmolLM2)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="reliability PNG (default: CHECKPOINT/reliability.png; with several "
                             "temperatures, _t<T> is added before .png)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-running", type=int, default=8, help="prompts generated together")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", action="store_true",
                        help="end stdout with the report as one JSON line")
    parser.add_argument("--shift", action=argparse.BooleanOptionalAction, default=True,
                        help="fit a per-position shift b_k with each temperature T_k, by log-loss "
                             "(default); --no-shift: temperatures only by ECE, the paper's STS")
    parser.add_argument("--crossfit-folds", type=int, default=2,
                        help="also report the ECE of fits on the rounds they were not fitted on "
                             "(the rounds cut into this many parts; 0: not reported)")
    parser.add_argument("--save-records", type=Path, default=None,
                        help="also write the full rounds' raw confidences and prefix survival "
                             "to this .npz")
    parser.add_argument("--records", type=Path, default=None,
                        help="fit on a .npz written by --save-records instead of generating "
                             "(--data is then not read and no model is loaded)")


def _paths(text: str) -> list[Path]:
    """'a.jsonl.gz,b.jsonl.gz' -> [Path('a.jsonl.gz'), Path('b.jsonl.gz')]."""
    paths = [Path(p.strip()) for p in str(text).split(",") if p.strip()]
    if not paths:
        raise argparse.ArgumentTypeError("--data needs at least one file")
    return paths


def parse_temperatures(text: str) -> list[float]:
    """'0,1' -> [0.0, 1.0]: distinct, finite, >= 0, in the order given."""
    try:
        temps = [float(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--temperature must be comma-separated numbers, got {text!r}")
    if not temps or any(not math.isfinite(t) or t < 0 for t in temps):
        raise ValueError(f"--temperature needs one or more finite values >= 0, got {text!r}")
    if len(set(temps)) != len(temps):
        raise ValueError(f"--temperature lists a value twice: {text!r}")
    return temps


Rounds = tuple  # (sampling temperature, confidences [num_rounds, gamma], survived [num_rounds, gamma])


def save_records(path: Path, rounds: list[Rounds]) -> None:
    """Each temperature's full rounds -> one .npz (confidences_i, survived_i, temperatures)."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"sampling_temperatures": np.asarray([t for t, _, _ in rounds], dtype=np.float64)}
    for i, (_, confidences, survived) in enumerate(rounds):
        arrays[f"confidences_{i}"] = np.asarray(confidences, dtype=np.float64)
        arrays[f"survived_{i}"] = np.asarray(survived, dtype=np.bool_)
    np.savez_compressed(path, **arrays)


def load_records(path: Path) -> list[Rounds]:
    """The rounds of a .npz written by save_records, per sampling temperature."""
    import numpy as np

    if not Path(path).is_file():
        raise FileNotFoundError(f"no records file at {path}")
    try:
        with np.load(path) as data:
            temps = [float(t) for t in data["sampling_temperatures"]]
            rounds = [(t, data[f"confidences_{i}"], data[f"survived_{i}"])
                      for i, t in enumerate(temps)]
    except (KeyError, ValueError, OSError) as e:
        raise ValueError(f"{path}: not a records file of `dspark calibrate --save-records` ({e})")
    for t, confidences, survived in rounds:
        if confidences.ndim != 2 or confidences.shape != survived.shape or confidences.shape[0] == 0:
            raise ValueError(f"{path}: confidences {confidences.shape} and survived "
                             f"{survived.shape} at temperature {t:g} must be the same non-empty "
                             f"[num_rounds, gamma]")
    return [(t, c.astype(np.float64), s.astype(np.bool_)) for t, c, s in rounds]


def run(args: argparse.Namespace) -> int:
    folder = args.checkpoint
    from dspark.loading import is_checkpoint

    if not is_checkpoint(folder):
        print(f"dspark calibrate: no drafter checkpoint at {folder} (config.json + "
              f"model.safetensors)", file=sys.stderr)
        return 2
    if args.crossfit_folds < 0 or args.crossfit_folds == 1:
        print(f"dspark calibrate: --crossfit-folds must be 0 or at least 2, got "
              f"{args.crossfit_folds}", file=sys.stderr)
        return 2
    if args.records is not None:
        try:
            rounds = load_records(args.records)
        except (FileNotFoundError, ValueError) as e:
            print(f"dspark calibrate: {e}", file=sys.stderr)
            return 2
        from dspark.models.drafter_config import DrafterConfig
        gamma = DrafterConfig.load(folder).block_size
        if any(c.shape[1] != gamma for _, c, _ in rounds):
            print(f"dspark calibrate: {args.records} holds {rounds[0][1].shape[1]} positions, "
                  f"the drafter in {folder} drafts {gamma}", file=sys.stderr)
            return 2
        source = args.records.name
    else:
        try:
            temperatures = parse_temperatures(args.temperature)
        except ValueError as e:
            print(f"dspark calibrate: {e}", file=sys.stderr)
            return 2
        collected = _collect(args, temperatures)
        if isinstance(collected, int):
            return collected
        rounds = collected
        if args.save_records is not None:
            save_records(args.save_records, rounds)
            _log(f"wrote {args.save_records}")
        source = "held-out split"
    return _fit_and_write(args, rounds, source)


def _fit_and_write(args: argparse.Namespace, rounds: list[Rounds], source: str) -> int:
    """Fit (shifted) STS per temperature, write calibration.json and one reliability PNG per
    temperature, print the reports (and with --json one JSON line keyed by temperature)."""
    import dataclasses

    from dspark.calibration.fit import fit_sts
    from dspark.calibration.report import calibration_report, plot_reliability
    from dspark.calibration.sts_map import CALIBRATION_FILENAME, CalibrationSet

    folder = args.checkpoint
    kind = "shifted STS" if args.shift else "STS"
    fits, reports, plots = [], {}, []
    for t, confidences, survived in rounds:
        sts = dataclasses.replace(fit_sts(confidences, survived, shift=args.shift),
                                  sampling_temperature=t)
        fits.append(sts)
        folds = args.crossfit_folds if len(confidences) >= 2 * args.crossfit_folds else 0
        if args.crossfit_folds and not folds:
            _log(f"temperature {t:g}: {len(confidences)} rounds are too few to cross-fit over "
                 f"{args.crossfit_folds} parts; no cross-fitted ECE")
        report = calibration_report(confidences, survived, sts, crossfit_folds=folds)
        reports[f"{t:g}"] = report.to_dict()
        plot = _plot_path(args, folder, t, len(rounds))
        plot_reliability(plot, confidences, survived, sts,
                         title=f"{folder.name}: {kind}, {source}, temperature {t:g}")
        plots.append(str(plot))
        print(f"sampling temperature {t:g}:")
        print(report.format_table())
    CalibrationSet(fits).save(folder / CALIBRATION_FILENAME)
    _log(f"wrote {folder / CALIBRATION_FILENAME} and {', '.join(plots)}")
    if args.json:
        print(json.dumps(_without_nan(reports), allow_nan=False))
    return 0


def _plot_path(args: argparse.Namespace, folder: Path, temperature: float, num: int) -> Path:
    """--plot (or CHECKPOINT/reliability.png), with _t<T> before the suffix when several."""
    path = args.plot if args.plot is not None else folder / "reliability.png"
    return path if num == 1 else path.with_name(f"{path.stem}_t{temperature:g}{path.suffix}")


def _collect(args: argparse.Namespace, temperatures: list[float]):
    """Generate the held-out answers with full-block verification at each temperature: a list
    of (temperature, confidences, survived) of the full rounds, or an exit code after printing
    the reason."""
    import torch

    from dspark.evaluation.acceptance import CollectConfig, collect_records
    from dspark.evaluation.eval_cli import stop_token_ids
    from dspark.loading import has_confidence_head, load_method_drafter, load_target, resolve_device
    from dspark.models.drafter_config import DrafterConfig
    from dspark.rejection import VerificationRule
    from dspark.verifier import TargetVerifier

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.checkpoint
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
    rounds = []
    for temperature in temperatures:
        cfg = CollectConfig(verify_len=drafter.gamma, temperature=temperature,
                            max_tokens=args.max_tokens, max_running=args.max_running,
                            seed=args.seed, stop_token_ids=stops)
        start = time.perf_counter()
        # The token rule: the confidence head and STS model c*_k, its acceptance probability.
        out = collect_records(TargetVerifier(runner, VerificationRule.TOKEN), drafter, prompts,
                              cfg,
                              progress=lambda done, total: _log(f"T={temperature:g}: {done}/{total} "
                                                                f"prompts")
                              if done == total or done % 10 == 0 else None)
        full = out.records.full_rounds()
        _log(f"temperature {temperature:g}: {len(prompts)} held-out prompts, {full.num_rounds} "
             f"full rounds ({time.perf_counter() - start:.1f}s)")
        if full.num_rounds == 0:
            print("dspark calibrate: no full verification rounds to fit on (raise --max-tokens)",
                  file=sys.stderr)
            return 2
        rounds.append((temperature, full.confidences, full.survival()))  # [num_rounds, gamma]
    return rounds
