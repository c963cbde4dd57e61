"""Where does a drafter's first block position look in the context? An attention probe.

For held-out answers and sampled anchors, records the drafter's attention weights (teacher-forced
`forward_train`) and reports, for the block's first slot (the query that predicts x_{a+1}) in each
drafter layer: the normalised entropy of its attention over the context (1 = uniform), the weight
on the last context token and on the last 4 (renormalised over the context), and the share of
attention that goes to the context rather than the block. `--qk-scales` also tries the checkpoint
with its attention logits multiplied (q/k norm weights scaled by sqrt(s) each): does sharpening move
weight to the recent tokens? Usage:
    .venv/bin/python bench/drafter_attention_probe.py [--checkpoint checkpoints/dspark-markov] [--qk-scales 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile

import torch
import torch.nn.functional as F

import dspark.models.drafter_layers as drafter_layers
from dspark.devices import add_device_argument
from dspark.fetch import ensure_model
from dspark.models.drafter_config import DrafterConfig
from dspark.models.drafter_io import load_drafter
from dspark.training.batches import block_labels, sample_anchors
from dspark.methods import DrafterKind
from dspark.training.trainer import TrainConfig, Trainer


def attention_recorder(records: list[torch.Tensor]):
    """An SDPA with the same output that also appends its weights [B, heads, Q, K] to `records`."""
    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, enable_gqa=False, **kwargs):
        keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        records.append(torch.softmax(scores.masked_fill(~attn_mask, float("-inf")), dim=-1))
        return sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa, **kwargs)

    return recorded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="checkpoints/dspark-markov")
    parser.add_argument("--model-dir", default=None, help="the target's folder (default: dspark fetch-model's)")
    parser.add_argument("--data", default="data/smollm2_answers.jsonl.gz")
    parser.add_argument("--qk-scales", default="1,2,4")
    parser.add_argument("--threads", type=int, default=2)
    add_device_argument(parser, help_suffix=" (the teacher and the drafter)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dcfg = DrafterConfig.load(args.checkpoint)
    gamma = dcfg.block_size
    cfg = TrainConfig(device=args.device, data_path=args.data, target_dir=str(args.model_dir or ensure_model()), out_dir=tempfile.mkdtemp(),
                      method=DrafterKind.MARKOV, num_layers=dcfg.num_hidden_layers, gamma=gamma,
                      markov_rank=dcfg.markov_rank, draft_vocab_size=dcfg.draft_vocab_size,
                      target_layer_ids=list(dcfg.target_layer_ids), split="heldout",
                      steps=1, batch_size=2, num_anchors=8, teacher_cache=False)
    trainer = Trainer(cfg)
    batch = trainer._next_batch()
    features, _ = trainer.teacher_outputs(batch)
    anchors, keep = sample_anchors(batch.answer_mask, 8, torch.Generator().manual_seed(1))
    labels, _ = block_labels(batch.input_ids, anchors, batch.answer_mask, gamma)
    T = batch.input_ids.shape[1]
    records: list[torch.Tensor] = []
    sdpa = drafter_layers.F.scaled_dot_product_attention
    drafter_layers.F.scaled_dot_product_attention = attention_recorder(records)
    print(f"{args.checkpoint}: slot-0 attention over the context, {int(keep.sum())} blocks\n")
    print("| qk scale | layer | normalised entropy | weight on last token | on last 4 | context share |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = []
    try:
        for scale in (float(s) for s in args.qk_scales.split(",")):
            model = load_drafter(args.checkpoint, trainer.teacher.embed_weight,
                                 trainer.teacher.lm_head_weight).float().eval()
            records.clear()
            with torch.no_grad():
                for layer in model.layers:
                    layer.self_attn.q_norm.weight.mul_(math.sqrt(scale))
                    layer.self_attn.k_norm.weight.mul_(math.sqrt(scale))
                model.forward_train(batch.input_ids, features, anchors, labels)
            for i, weights in enumerate(records):  # [B, heads, N * gamma, T + N * gamma]
                entropy, last, last4 = [], [], []
                for b, n in keep.nonzero().tolist():
                    a = int(anchors[b, n])
                    w = weights[b, :, n * gamma, :a]  # [heads, a]: slot 0 over context positions < a
                    p = w / w.sum(-1, keepdim=True).clamp_min(1e-9)
                    entropy.append((-(p * p.clamp_min(1e-12).log()).sum(-1) / math.log(max(a, 2))).mean())
                    last.append(p[:, -1].mean())
                    last4.append(p[:, -4:].sum(-1).mean())
                share = float(weights[..., :T].sum(-1).mean())
                row = {"qk_scale": scale, "layer": i, "entropy": float(torch.stack(entropy).mean()),
                       "last": float(torch.stack(last).mean()),
                       "last4": float(torch.stack(last4).mean()), "context_share": share}
                rows.append(row)
                print(f"| {scale:g} | {i} | {row['entropy']:.3f} | {row['last']:.3f} "
                      f"| {row['last4']:.3f} | {share:.3f} |")
    finally:
        drafter_layers.F.scaled_dot_product_attention = sdpa
    print(json.dumps({"bench": "drafter_attention_probe", "checkpoint": args.checkpoint,
                      "blocks": int(keep.sum()), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
