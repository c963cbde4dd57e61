"""Does a trained drafter use the target's context features? An ablation on training batches.

Teacher-forced per-position acceptance (1 - TV(p^d_k, p^t_k), the trainer's `accept`) of a drafter
checkpoint on the same batches and anchors, with the context features:
- as they are;
- shuffled along the sequence (same bag of features, order destroyed);
- zeroed;
- as they are, but with the backbone's logits switched off (final-norm weight 0: the sequential
  head alone, i.e. the bigram-like Markov model).
A drafter that reads its context should lose most on "shuffled"; one that treats the context as a
bag of features loses nothing there. Prints a markdown table and one JSON line. Usage:
    .venv/bin/python bench/drafter_context_ablation.py [--checkpoint checkpoints/dspark-markov]
        [--data data/smollm2_answers.jsonl.gz] [--batches 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from dspark.devices import add_device_argument
from dspark.fetch import ensure_model
from dspark.models.drafter_config import DrafterConfig
from dspark.models.drafter_io import load_drafter
from dspark.methods import DrafterKind
from dspark.training.trainer import TrainConfig, Trainer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="checkpoints/dspark-markov")
    parser.add_argument("--model-dir", default=None, help="the target's folder (default: dspark fetch-model's)")
    parser.add_argument("--data", default="data/smollm2_answers.jsonl.gz")
    parser.add_argument("--split", default="heldout")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    add_device_argument(parser, help_suffix=" (the teacher and the drafter)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dcfg = DrafterConfig.load(args.checkpoint)
    cfg = TrainConfig(device=args.device, data_path=args.data, target_dir=str(args.model_dir or ensure_model()), out_dir=tempfile.mkdtemp(),
                      method=DrafterKind(dcfg.markov_head_type.value), num_layers=dcfg.num_hidden_layers,
                      gamma=dcfg.block_size, markov_rank=dcfg.markov_rank,
                      draft_vocab_size=dcfg.draft_vocab_size,
                      target_layer_ids=list(dcfg.target_layer_ids), split=args.split,
                      steps=1, batch_size=4, num_anchors=32, teacher_cache=False)
    trainer = Trainer(cfg)  # the teacher, the data and the draft vocabulary of that data
    trainer.model = load_drafter(args.checkpoint, trainer.teacher.embed_weight,
                                 trainer.teacher.lm_head_weight).float().eval()
    if dcfg.draft_vocab_size is not None:  # p^t must be sliced with the checkpoint's draft vocabulary
        trainer.draft_ids = trainer.model.draft_to_target.clone()
    batches = [trainer._next_batch() for _ in range(args.batches)]
    teacher = trainer.teacher_outputs
    gen = torch.Generator().manual_seed(0)

    def shuffled(batch):
        features, final = teacher(batch)
        return features[:, torch.randperm(features.shape[1], generator=gen)], final

    def zeroed(batch):
        features, final = teacher(batch)
        return torch.zeros_like(features), final

    variants = {"context as is": teacher, "context shuffled in time": shuffled,
                "context zeroed": zeroed, "backbone logits off": teacher}
    results = {}
    for name, outputs in variants.items():
        trainer.teacher_outputs = outputs
        if name == "backbone logits off":
            with torch.no_grad():
                trainer.model.norm.weight.zero_()
        accept = []
        for batch in batches:
            trainer.anchor_rng = torch.Generator().manual_seed(1)  # the same anchors every time
            with torch.no_grad():
                accept.append(trainer.compute_losses(batch).accept_per_position)
        results[name] = [round(float(a), 3) for a in torch.stack(accept).mean(0)]
    gamma = len(next(iter(results.values())))
    print(f"{args.checkpoint}, {args.batches} batches of 4 {args.split} answers, 32 anchors each\n")
    print("| context | " + " | ".join(f"pos {k + 1}" for k in range(gamma)) + " |")
    print("|---|" + "---:|" * gamma)
    for name, accept in results.items():
        print(f"| {name} | " + " | ".join(f"{a:.3f}" for a in accept) + " |")
    print(json.dumps({"bench": "drafter_context_ablation", "checkpoint": args.checkpoint,
                      "accept_per_position": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
