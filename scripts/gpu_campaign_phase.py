"""One phase of the drafter campaign on a GPU, bounded in wall-clock time.

scripts/drafter_campaign.sh continues the shipped DSpark drafter on the CPU, 512 anchor blocks a
step at about 4 s a step. This script runs the same phase on a GPU: the same `dspark train` flags
(so the same recipe, answers, held-out answers and losses, bf16 teacher, bf16 student autocast),
with batches that fill the device, continuing the drafter given by --init-from-drafter:

1. target: as in scripts/gpu_drafters.py, the GGUF dequantised by transformers, its weights'
   sha256 compared with the CPU machine's (--expect-digest);
2. sizing: --timing-steps steps of the phase are timed (after 3 untimed ones), and the cosine
   schedule's length is set so that the phase ends inside --budget-s, less --reserve-s and the
   held-out evaluations' time (the schedule reads the step count when it computes a rate, so
   fixing it after the timed steps changes nothing before them);
3. training, with the held-out acceptance (greedy and T=1, heldout_log.jsonl: the learning curve)
   logged --evals times, evenly spread;
4. after each evaluation, the drafter (bf16) with train_config.json, train_log.jsonl and
   heldout_log.jsonl is packed into --out as drafter.tar, split into 15 MiB parts: a run cut short
   still hands back its latest drafter. `cat drafter.tar.part* | tar -x` gives the folder that
   `RUN=<folder> bash scripts/ship_campaign_drafter.sh` ships.

--smoke runs every stage with a random target of the real shape (a cheap first call that shows
the real run will work and what a step costs).

    python scripts/gpu_campaign_phase.py --gguf G --tokenizer-dir D --data a.jsonl.gz,b.jsonl.gz \\
        --init-from-drafter checkpoints/dspark-markov --work W --out O --budget-s 480
    (tests/training/test_gpu_campaign_phase_script.py runs it on the CPU at tiny sizes)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_drafters import add_target_arguments, log, start_run, sync, tar_in_parts  # noqa: E402
from dspark.models.drafter_io import save_drafter  # noqa: E402
from dspark.training.train_cli import config_from_args, configure  # noqa: E402
from dspark.training.trainer import Trainer  # noqa: E402

RUN_FILES = ("train_config.json", "train_log.jsonl", "heldout_log.jsonl")


def campaign_flags(args: argparse.Namespace, target: Path, run: Path) -> list[str]:
    """scripts/drafter_campaign.sh's `dspark train` flags, with this run's batch and schedule."""
    return ["--data", args.data, "--target", str(target), "--out", str(run),
            "--method", "markov", "--layers", "2", "--markov-rank", "64", "--gamma", "7",
            "--draft-vocab", "8192", "--inject-last-context", "--output-norm-lr-scale", "30",
            "--init-from-drafter", args.init_from_drafter,
            "--steps", str(args.max_steps), "--warmup", str(args.warmup), "--lr", str(args.lr),
            "--batch", str(args.batch), "--anchors", str(args.anchors),
            "--target-dtype", "bfloat16", "--student-dtype", "bfloat16",
            "--eval-every", "1", "--eval-examples", "64", "--eval-anchors", "64",
            "--seed", str(args.seed), "--device", args.device, "--no-progress", "--no-resume"]


def pack_drafter(trainer: Trainer, out: Path, work: Path) -> int:
    """The drafter in bf16 with the run's logs -> out/drafter.tar.partNN; returns the bytes."""
    folder = work / "dspark-markov"
    save_drafter(trainer.model, folder, dtype=torch.bfloat16)
    for name in RUN_FILES:
        if (trainer.out_dir / name).exists():
            shutil.copyfile(trainer.out_dir / name, folder / name)
    return tar_in_parts(work, folder.name, out, "drafter")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_arguments(p)
    p.add_argument("--data", required=True, help="comma-separated answer files, in the campaign's order")
    p.add_argument("--init-from-drafter", required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, required=True, help="the whole run's wall-clock time")
    p.add_argument("--reserve-s", type=float, default=40,
                   help="kept for the last evaluation and packing")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--evals", type=int, default=8, help="held-out evaluations after the start's")
    p.add_argument("--timing-steps", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--min-steps", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if not args.smoke and args.gguf is None and args.target_dir is None:
        p.error("give --gguf or --target-dir (or --smoke)")

    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    target = start_run(args)

    run = args.work / "run"
    parser = argparse.ArgumentParser()
    configure(parser)
    cfg = config_from_args(parser.parse_args(campaign_flags(args, target, run)))
    trainer = Trainer(cfg)
    run.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES[1:]:
        (run / name).unlink(missing_ok=True)
    log(f"trainer ready: {len(trainer.examples)} training answers, "
        f"{trainer.parameter_count() / 1e6:.1f}M parameters ({time.perf_counter() - t0:.0f} s)")

    t = time.perf_counter()
    first = trainer.log_heldout()
    eval_s = time.perf_counter() - t
    log(f"held-out at the start: tau greedy {first.get('tau_greedy')}, T=1 {first.get('tau_t1')} "
        f"({eval_s:.1f} s)")

    start = time.perf_counter()
    for _ in range(3):
        trainer.train_step()
    sync()
    t = time.perf_counter()
    for _ in range(args.timing_steps):
        trainer.train_step()
    sync()
    step_s = (time.perf_counter() - t) / args.timing_steps
    pack_s = 5.0
    left = deadline - time.perf_counter() - args.reserve_s - args.evals * (eval_s + pack_s)
    cfg.steps = min(args.max_steps, max(args.min_steps, trainer.step + int(left / step_s)))
    blocks = args.batch * args.anchors
    log(f"{step_s * 1000:.0f} ms a step ({blocks / step_s:.0f} anchor blocks/s); "
        f"the phase runs {cfg.steps} steps, {cfg.steps * blocks / 1e6:.2f}M anchor blocks")
    cfg.eval_every = max(1, round(cfg.steps / args.evals))  # as recorded; evaluations follow eval_at
    (run / "train_config.json").write_text(
        json.dumps(cfg.to_json_dict(), indent=2, sort_keys=True) + "\n")

    first_step = trainer.step  # the timed steps are the phase's first ones
    eval_at = {first_step + round((cfg.steps - first_step) * (i + 1) / args.evals)
               for i in range(args.evals)}
    while trainer.step < cfg.steps:
        terms, grad_norm = trainer.train_step()
        if trainer.step % cfg.log_every == 0 or trainer.step == cfg.steps:
            trainer.log_step(terms, grad_norm, start)
        late = time.perf_counter() > deadline - args.reserve_s
        if trainer.step in eval_at or late:
            record = trainer.log_heldout()
            size = pack_drafter(trainer, args.out, args.work)
            log(f"step {trainer.step}: held-out tau greedy {record.get('tau_greedy')}, "
                f"T=1 {record.get('tau_t1')}; packed {size / 2**20:.1f} MiB")
        if late:
            log(f"stopped at step {trainer.step} of {cfg.steps}: the budget ran out")
            break
    summary = {"steps": trainer.step, "planned_steps": cfg.steps, "step_ms": round(step_s * 1000, 1),
               "anchor_blocks_per_s": round(blocks / step_s), "batch": args.batch,
               "anchors": args.anchors, "lr": args.lr, "warmup": args.warmup, "seed": args.seed,
               "smoke": args.smoke, "elapsed_s": round(time.perf_counter() - t0, 1),
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"done: {json.dumps(summary)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
