"""`dspark train`: train a drafter with the frozen target as an online teacher (docs/design.md s. 4).

Example (the shipped DSpark drafter's recipe is in docs once trained):

    dspark train --data data/train_answers.jsonl --target ~/.cache/dspark/models/smollm2-135m-instruct \
        --out checkpoints/dspark-markov --method markov --layers 2 --gamma 7 --steps 1500
"""

from __future__ import annotations

import argparse
import json
import sys

from dspark.methods import DrafterKind
from dspark.training.trainer import TrainConfig


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def configure(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig.__dataclass_fields__
    parser.add_argument("--data", required=True,
                        help="jsonl(.gz) with prompt_ids and answer_ids per line (`dspark data generate`)")
    parser.add_argument("--split", default="train",
                        help="train on records of this split ('all' = every record)")
    parser.add_argument("--target", required=True, help="target model folder (transformers format)")
    parser.add_argument("--out", required=True, help="output folder (drafter, checkpoint, log)")
    parser.add_argument("--method", choices=[m.value for m in DrafterKind], default=DrafterKind.MARKOV.value,
                        help="DSpark head (markov|rnn), DFlash (none) or the Eagle-style drafter")
    parser.add_argument("--layers", type=int, default=d["num_layers"].default,
                        help="drafter depth (Eagle-style: always 1)")
    parser.add_argument("--target-layers", type=_int_list, default=None,
                        help="comma-separated target layer ids to fuse (default: spread over depth)")
    parser.add_argument("--num-target-layers", type=int, default=d["num_context_layers"].default,
                        help="how many target layers to spread over depth when --target-layers is unset")
    parser.add_argument("--intermediate-size", type=int, default=None,
                        help="MLP width of the drafter's layers (default: the target's)")
    parser.add_argument("--gamma", type=int, default=d["gamma"].default, help="block size")
    parser.add_argument("--markov-rank", type=int, default=d["markov_rank"].default)
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="reduced draft vocabulary size (most frequent answer tokens)")
    parser.add_argument("--mask-token-id", type=int, default=None)
    parser.add_argument("--no-confidence-head", action="store_true")
    parser.add_argument("--markov-init", choices=["zero", "bigram"], default=d["markov_init"].default,
                        help="Markov head start: zero (pure parallel drafter) or the answers' "
                             "bigram statistics")
    parser.add_argument("--inject-last-context", action="store_true",
                        help="DSpark/DFlash: add the last context token's fused target state to "
                             "every block input (a direct path to the most recent features)")
    parser.add_argument("--init-from-target-layers", type=_int_list, default=None,
                        help="comma-separated target layer ids: warm-start drafter layer i from "
                             "the i-th (default: random init)")
    parser.add_argument("--init-from-drafter", default=None,
                        help="continue from a saved drafter folder (fresh optimizer and schedule)")
    parser.add_argument("--steps", type=int, default=d["steps"].default)
    parser.add_argument("--batch", type=int, default=d["batch_size"].default, help="sequences per step")
    parser.add_argument("--anchors", type=int, default=d["num_anchors"].default,
                        help="anchor blocks per sequence")
    parser.add_argument("--max-seq-len", type=int, default=d["max_seq_len"].default)
    parser.add_argument("--lr", type=float, default=d["lr"].default)
    parser.add_argument("--output-norm-lr-scale", type=float,
                        default=d["output_norm_lr_scale"].default,
                        help="learning-rate multiplier of the final-norm weight (the scale of the "
                             "backbone's logits)")
    parser.add_argument("--min-lr-ratio", type=float, default=d["min_lr_ratio"].default)
    parser.add_argument("--warmup", type=int, default=d["warmup_steps"].default)
    parser.add_argument("--weight-decay", type=float, default=d["weight_decay"].default)
    parser.add_argument("--grad-clip", type=float, default=d["grad_clip"].default)
    parser.add_argument("--ce-weight", type=float, default=d["ce_weight"].default)
    parser.add_argument("--tv-weight", type=float, default=d["tv_weight"].default)
    parser.add_argument("--conf-weight", type=float, default=d["conf_weight"].default)
    parser.add_argument("--loss-decay", type=float, default=None,
                        help="position-weight decay (default: gamma)")
    parser.add_argument("--target-temperature", type=float, default=d["target_temperature"].default)
    parser.add_argument("--seed", type=int, default=d["seed"].default)
    parser.add_argument("--device", default=d["device"].default, help="auto, cpu, cuda, cuda:1 ...")
    parser.add_argument("--target-dtype", choices=["float32", "bfloat16", "float16"],
                        default=d["target_dtype"].default)
    parser.add_argument("--student-dtype", choices=["float32", "bfloat16"],
                        default=d["student_dtype"].default,
                        help="the drafter's forward/backward: bfloat16 = autocast (float32 weights)")
    parser.add_argument("--save-dtype", choices=["float32", "bfloat16", "float16"],
                        default=d["save_dtype"].default)
    parser.add_argument("--log-every", type=int, default=d["log_every"].default)
    parser.add_argument("--save-every", type=int, default=d["save_every"].default)
    parser.add_argument("--eval-every", type=int, default=d["eval_every"].default,
                        help="held-out acceptance (greedy and T=1) every this many steps into "
                             "heldout_log.jsonl: the learning curve (0 = off)")
    parser.add_argument("--eval-examples", type=int, default=d["eval_examples"].default,
                        help="held-out answers the evaluation uses")
    parser.add_argument("--eval-anchors", type=int, default=d["eval_anchors"].default,
                        help="anchor blocks per held-out answer")
    parser.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint")
    parser.add_argument("--teacher-cache", action="store_true",
                        help="keep each example's teacher features in memory (bf16) after first use")
    parser.add_argument("--teacher-cache-gb", type=float, default=d["teacher_cache_gb"].default)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        data_path=args.data, target_dir=args.target, out_dir=args.out, method=DrafterKind(args.method),
        num_layers=args.layers, target_layer_ids=args.target_layers,
        num_context_layers=args.num_target_layers, intermediate_size=args.intermediate_size,
        gamma=args.gamma, markov_rank=args.markov_rank,
        draft_vocab_size=args.draft_vocab, mask_token_id=args.mask_token_id,
        enable_confidence_head=not args.no_confidence_head,
        init_layers_from=args.init_from_target_layers, markov_init=args.markov_init,
        inject_last_context=args.inject_last_context, init_from_drafter=args.init_from_drafter,
        steps=args.steps,
        batch_size=args.batch, num_anchors=args.anchors, max_seq_len=args.max_seq_len, lr=args.lr,
        min_lr_ratio=args.min_lr_ratio, output_norm_lr_scale=args.output_norm_lr_scale,
        warmup_steps=args.warmup, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, ce_weight=args.ce_weight, tv_weight=args.tv_weight,
        conf_weight=args.conf_weight, loss_decay=args.loss_decay,
        target_temperature=args.target_temperature, seed=args.seed, device=args.device,
        target_dtype=args.target_dtype, student_dtype=args.student_dtype, save_dtype=args.save_dtype, log_every=args.log_every,
        save_every=args.save_every, eval_every=args.eval_every,
        eval_examples=args.eval_examples, eval_anchors=args.eval_anchors, resume=not args.no_resume, progress=not args.no_progress,
        teacher_cache=args.teacher_cache, teacher_cache_gb=args.teacher_cache_gb,
        split=None if args.split == "all" else args.split)


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark.training.trainer import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config_from_args(args)
    trainer = Trainer(cfg)
    print(f"[dspark train] {cfg.method.value}: {trainer.parameter_count() / 1e6:.2f}M trainable "
          f"parameters, {len(trainer.examples)} sequences, device {trainer.device}, "
          f"starting at step {trainer.step}", file=sys.stderr)
    out = trainer.run()
    print(json.dumps({"out_dir": str(out), "steps": trainer.step}))
    return 0
