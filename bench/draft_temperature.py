"""Would a sharper or flatter draft distribution be accepted more at T=1? Held-out, teacher-forced.

Speculative sampling stays exact with any draft distribution q, as long as the drafts are drawn
from q and verified against it, so a drafter could sample at T=1 from q_s = softmax(logits / s)
instead of its own softmax (s = 1). The acceptance of one position is 1 - TV(q_s, p^t). This bench
measures it on the learning curve's held-out blocks (`dspark.training.heldout`: 64 held-out
answers, 64 anchor blocks each, teacher-forced) for each scale in `--scales`, with the shipped
drafter. The drafter is trained with a TV term (`dspark.training.losses`), so s = 1 is expected
to be about the best. A trainer is built only for its teacher; nothing is trained. Prints a
markdown table and one JSON line. Usage:
    .venv/bin/python bench/draft_temperature.py [--scales 0.7,0.8,0.9,1.0,1.1] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from dspark.devices import add_device_argument
from dspark.fetch import ensure_model
from dspark.methods import DrafterKind
from dspark.models.drafter_config import DrafterConfig
from dspark.models.drafter_io import load_drafter
from dspark.paths import SHARED_DIR
from dspark.training.batches import read_examples
from dspark.training.heldout import HeldoutEvaluator
from dspark.training.trainer import TrainConfig, Trainer

ANSWER_FILES = (f"{SHARED_DIR}/data/answers/smollm2_greedy_fp32.jsonl.gz",
                "data/smollm2_answers_t1.jsonl.gz", "data/smollm2_answers.jsonl.gz",
                "data/answers/greedy.jsonl.gz",
                "data/answers/t1.jsonl.gz", "data/answers/chat_t1.jsonl.gz",
                "data/answers/greedy_t1_prompts.jsonl.gz", "data/answers/chat_t07.jsonl.gz",
                "data/answers/t1_greedy_prompts.jsonl.gz")
"""The campaign's answer files in its order (scripts/drafter_campaign.sh): the held-out blocks
are the first held-out answers of that list, those of the learning curve."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="checkpoints/dspark-markov")
    parser.add_argument("--model-dir", default=None,
                        help="the target's folder (default: dspark fetch-model's)")
    parser.add_argument("--data", default=",".join(ANSWER_FILES))
    parser.add_argument("--scales", default="0.7,0.8,0.9,1.0,1.1")
    parser.add_argument("--examples", type=int, default=64,
                        help="held-out answers (the curve's 64)")
    parser.add_argument("--anchors", type=int, default=64,
                        help="anchor blocks per answer (the curve's 64)")
    parser.add_argument("--target-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                        help="the teacher's dtype (the campaign's: bfloat16)")
    parser.add_argument("--threads", type=int, default=2)
    add_device_argument(parser, help_suffix=" (the teacher and the drafter)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scales = [float(s) for s in args.scales.split(",")]
    dcfg = DrafterConfig.load(args.checkpoint)
    cfg = TrainConfig(device=args.device, data_path=args.data, target_dir=str(args.model_dir or ensure_model()),
                      out_dir=tempfile.mkdtemp(), method=DrafterKind(dcfg.markov_head_type.value),
                      num_layers=dcfg.num_hidden_layers, gamma=dcfg.block_size,
                      markov_rank=dcfg.markov_rank, draft_vocab_size=dcfg.draft_vocab_size,
                      target_layer_ids=list(dcfg.target_layer_ids), target_dtype=args.target_dtype,
                      steps=1, batch_size=4, teacher_cache=False)
    trainer = Trainer(cfg)  # only for its teacher
    model = load_drafter(args.checkpoint, trainer.teacher.embed_weight,
                         trainer.teacher.lm_head_weight).float().eval()
    reduced = dcfg.draft_vocab_size is not None
    heldout = HeldoutEvaluator(read_examples(args.data, "heldout")[:args.examples], trainer.teacher,
                               dcfg.block_size, args.anchors, cfg.max_seq_len,
                               model.draft_to_target.clone() if reduced else None, trainer.device)
    forward_train = model.forward_train
    rows = []
    for scale in scales:
        def scaled(*a, scale=scale, **k):
            out = forward_train(*a, **k)
            out.draft_logits = out.draft_logits / scale  # q_s = softmax(logits / s)
            return out

        model.forward_train = scaled
        result = heldout.evaluate(model)
        rows.append({"scale": scale, "tau_t1": result["tau_t1"], "accept_t1": result["accept_t1"],
                     "blocks": result["blocks"]})
    print(f"{args.checkpoint}: held-out blocks {rows[0]['blocks']}, teacher-forced, T=1\n")
    gamma = len(rows[0]["accept_t1"])
    print("| scale s | tau at T=1 | " + " | ".join(f"k={k + 1}" for k in range(gamma)) + " |")
    print("|---:|---:|" + "---:|" * gamma)
    for r in rows:
        cells = " | ".join(f"{a:.4f}" for a in r["accept_t1"])
        print(f"| {r['scale']} | {r['tau_t1']:.4f} | {cells} |")
    print(json.dumps({"bench": "draft_temperature", "checkpoint": args.checkpoint, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
