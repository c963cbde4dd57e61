"""Where a drafter training step's time goes, and anchor-blocks per second, for several training
set-ups side by side in one run (same data, same drafter, same machine).

Each set-up builds a `Trainer` (DSpark, Markov head, the shipped recipe's drafter: 2 layers from
the target's layers 28-29, rank 64, gamma 7, 8k draft vocabulary), runs `--warmup` steps, then
times `--steps` steps with torch.profiler and sums the trainer's own labels: `train::teacher`
(the target's forward; paid once per example when the teacher cache is on), `train::target_probs`
(p^t: the vocabulary-sized product), `train::drafter_forward`, `train::losses`,
`train::backward`, `train::optimizer`. Reports ms per step for each, anchor-blocks per second
of wall time and of process CPU time (steadier on a shared machine), with the CPU model and
flags. The set-ups (`--setups`, comma-separated):
  recipe        float32 teacher, 4 sequences x 32 anchors (the shipped drafters' recipe)
  bf16          bfloat16 teacher, 4 x 32
  bf16-a128     bfloat16 teacher, 4 x 128 anchors (more blocks per teacher pass)
  bf16-b8-a128  bfloat16 teacher, 8 x 128
  bf16-a128-student  bfloat16 teacher and bfloat16 autocast of the drafter, 4 x 128
Usage:
    .venv/bin/python bench/train_step.py [--data FILE] [--steps 4] [--warmup 1] [--threads 2]
        [--teacher-cache] [--setups recipe,bf16,bf16-a128] [--init-layers 28,29]
        [--target-layers IDS] [--draft-vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dspark.cpu_info import cpu_description
from dspark.fetch import ensure_model
from dspark.methods import DrafterKind
from dspark.training.trainer import TrainConfig, Trainer

REPO = Path(__file__).resolve().parent.parent
SETUPS = {
    "recipe": dict(target_dtype="float32", batch_size=4, num_anchors=32),
    "bf16": dict(target_dtype="bfloat16", batch_size=4, num_anchors=32),
    "bf16-a128": dict(target_dtype="bfloat16", batch_size=4, num_anchors=128),
    "bf16-b8-a128": dict(target_dtype="bfloat16", batch_size=8, num_anchors=128),
    "bf16-a128-student": dict(target_dtype="bfloat16", student_dtype="bfloat16", batch_size=4,
                              num_anchors=128),
}
LABELS = ("train::teacher", "train::target_probs", "train::drafter_forward", "train::losses",
          "train::backward", "train::optimizer")


def make_config(setup: dict, args: argparse.Namespace, target: str, out: str) -> TrainConfig:
    init_layers = [int(i) for i in args.init_layers.split(",")]
    target_layers = [int(i) for i in args.target_layers.split(",")] if args.target_layers else None
    return TrainConfig(
        data_path=args.data, target_dir=target, out_dir=out, method=DrafterKind.MARKOV,
        num_layers=len(init_layers), target_layer_ids=target_layers, gamma=7, markov_rank=64,
        draft_vocab_size=args.draft_vocab, init_layers_from=init_layers, markov_init="zero",
        inject_last_context=True, output_norm_lr_scale=30.0, steps=10_000, lr=1e-3,
        warmup_steps=30, teacher_cache=args.teacher_cache, progress=False, log_every=10_000,
        save_every=10_000, device="cpu", **setup)


def time_setup(cfg: TrainConfig, steps: int, warmup: int) -> dict:
    trainer = Trainer(cfg)
    for _ in range(warmup):
        trainer.train_step()
    if cfg.teacher_cache:  # fill the cache with the timed steps' examples, then revisit them
        epoch, index = trainer.epoch, trainer.index_in_epoch
        for _ in range(steps):
            trainer.train_step()
        trainer.epoch, trainer.index_in_epoch = epoch, index
    label_ms: dict[str, float] = defaultdict(float)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            trainer.train_step()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    for event in prof.key_averages():
        if event.key in LABELS:
            label_ms[event.key] += event.cpu_time_total / 1000.0
    blocks = steps * cfg.batch_size * cfg.num_anchors
    return {"ms_per_step": {k.split("::")[1]: round(label_ms[k] / steps, 1) for k in LABELS},
            "wall_ms_per_step": round(1000 * wall / steps, 1),
            "anchor_blocks_per_s": round(blocks / wall, 1),
            "anchor_blocks_per_cpu_s": round(blocks / cpu, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(REPO / "data" / "smollm2_answers_t1.jsonl.gz"))
    parser.add_argument("--model-dir", default=None, help="default: dspark fetch-model's folder")
    parser.add_argument("--setups", default="recipe,bf16,bf16-a128,bf16-b8-a128")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--init-layers", default="28,29",
                        help="target layers the drafter's layers start from (their count is its depth)")
    parser.add_argument("--target-layers", default=None,
                        help="target layers whose features the drafter reads (default: spread)")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--teacher-cache", action="store_true",
                        help="time steps whose examples are all in the teacher cache (the cost "
                             "after the first epoch)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = str(Path(args.model_dir) if args.model_dir else ensure_model())
    results = {}
    for name in args.setups.split(","):
        with tempfile.TemporaryDirectory() as out:
            cfg = make_config(SETUPS[name], args, target, out)
            results[name] = time_setup(cfg, args.steps, args.warmup)
        r = results[name]
        print(f"{name:14s} {r['wall_ms_per_step']:8.0f} ms/step  {r['anchor_blocks_per_s']:7.1f} "
              f"blocks/s  {r['anchor_blocks_per_cpu_s']:7.1f} blocks/cpu-s  {r['ms_per_step']}",
              flush=True)
    base = results.get("recipe")
    summary = {"bench": "train_step", "machine": cpu_description(), "threads": args.threads, "steps": args.steps,
               "teacher_cache": args.teacher_cache, "results": results}
    if base:
        summary["blocks_per_cpu_s_vs_recipe"] = {
            k: round(v["anchor_blocks_per_cpu_s"] / base["anchor_blocks_per_cpu_s"], 2)
            for k, v in results.items()}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
