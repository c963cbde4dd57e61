"""Would a sharper or flatter draft distribution be accepted more at T=1? Held-out, teacher-forced.

Speculative sampling stays exact with any draft distribution q, as long as the drafts are drawn
from q and verified against it, so a drafter could sample at T=1 from q_s = softmax(logits / s)
instead of its own softmax (s = 1). The acceptance of one position is 1 - TV(q_s, p^t). This bench
measures it on the learning curve's held-out blocks (`dspark.training.heldout`: 64 held-out
answers, 64 anchor blocks each, teacher-forced) for each scale in `--scales`, with the shipped
drafter. The drafter is trained with a TV term (`dspark.training.losses`), so s = 1 is expected
to be about the best. It builds the campaign's trainer only for its teacher and held-out blocks;
nothing is trained. Prints a markdown table and one JSON line. Usage:
    .venv/bin/python bench/draft_temperature.py [--scales 0.7,0.8,0.9,1.0,1.1] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from dspark.fetch import ensure_model
from dspark.paths import SHARED_DIR
from dspark.training import train_cli
from dspark.training.trainer import Trainer

ANSWER_FILES = (f"{SHARED_DIR}/data/answers/smollm2_greedy_fp32.jsonl.gz", "data/smollm2_answers_t1.jsonl.gz",
                "data/smollm2_answers.jsonl.gz", "data/answers/greedy.jsonl.gz",
                "data/answers/t1.jsonl.gz", "data/answers/chat_t1.jsonl.gz",
                "data/answers/greedy_t1_prompts.jsonl.gz")
"""The campaign's answer files in its order (scripts/drafter_campaign.sh): the held-out blocks
are the first held-out answers of that list, those of the learning curve."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="checkpoints/dspark-markov")
    parser.add_argument("--model-dir", default=None, help="the target's folder (default: dspark fetch-model's)")
    parser.add_argument("--data", default=",".join(ANSWER_FILES))
    parser.add_argument("--scales", default="0.7,0.8,0.9,1.0,1.1")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scales = [float(s) for s in args.scales.split(",")]
    train_parser = argparse.ArgumentParser()
    train_cli.configure(train_parser)
    train_args = train_parser.parse_args([  # the campaign's drafter shape and held-out set
        "--data", args.data, "--target", str(args.model_dir or ensure_model()),
        "--out", tempfile.mkdtemp(), "--method", "markov", "--layers", "2", "--markov-rank", "64",
        "--gamma", "7", "--draft-vocab", "8192", "--inject-last-context",
        "--init-from-drafter", args.checkpoint, "--steps", "1", "--batch", "4",
        "--target-dtype", "bfloat16", "--student-dtype", "bfloat16", "--eval-every", "1",
        "--eval-examples", "64", "--eval-anchors", "64", "--no-progress", "--no-resume"])
    trainer = Trainer(train_cli.config_from_args(train_args))
    model, forward_train = trainer.model, trainer.model.forward_train
    rows = []
    for scale in scales:
        def scaled(*a, scale=scale, **k):
            out = forward_train(*a, **k)
            out.draft_logits = out.draft_logits / scale  # q_s = softmax(logits / s)
            return out

        model.forward_train = scaled
        result = trainer.heldout.evaluate(model)
        rows.append({"scale": scale, "tau_t1": result["tau_t1"], "accept_t1": result["accept_t1"],
                     "blocks": result["blocks"]})
    print(f"{args.checkpoint}: held-out blocks {rows[0]['blocks']}, teacher-forced, T=1\n")
    gamma = len(rows[0]["accept_t1"])
    print("| scale s | tau at T=1 | " + " | ".join(f"k={k + 1}" for k in range(gamma)) + " |")
    print("|---:|---:|" + "---:|" * gamma)
    for r in rows:
        print(f"| {r['scale']} | {r['tau_t1']:.4f} | " + " | ".join(f"{a:.4f}" for a in r["accept_t1"]) + " |")
    print(json.dumps({"bench": "draft_temperature", "checkpoint": args.checkpoint, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
