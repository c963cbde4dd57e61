"""Does the served drafter accept what training measures? Engine rounds against teacher forcing.

The trainer's learning curve is teacher-forced (`dspark/training/heldout.py`): the drafter sees
the target's features of the true context, computed by transformers, and its block is scored
against the target's argmax. Serving computes the features with our runner, incrementally, one
round at a time. A mismatch between the two (a feature layer off by one, an anchor shifted by a
token, a context cut) would make every training gain vanish at serving time without failing
any test of either side alone.

This script generates greedy answers to held-out prompts with the engine verifying the whole
block every round (`fixed:gamma`), then replays every round teacher-forced: the same drafter,
the prompt plus the engine's own output as context (greedy, so the target's answer), the same
anchors, transformers' float32 features. For each round it compares the accepted drafts. Rounds
whose block or bonus token would pass the end of the output (capped by max tokens or EOS) are
left out. Prints the counts and one JSON line. Usage:
    .venv/bin/python bench/served_vs_teacher_forced.py [--checkpoint checkpoints/dspark-markov]
        [--data data/answers/greedy.jsonl.gz] [--prompts 8] [--max-tokens 96] [--threads 1]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from dspark.devices import add_device_argument, resolve_device
from dspark.evaluation.acceptance import CollectConfig, collect_records
from dspark.fetch import ensure_model
from dspark.loading import load_method_drafter, load_target
from dspark.models.drafter_config import DrafterConfig
from dspark.models.drafter_io import load_drafter
from dspark.training.data import read_records
from dspark.training.trainer import TargetTeacher
from dspark.verifier import TargetVerifier


def heldout_prompts(path: str, split: str, count: int) -> list[list[int]]:
    prompts = [r["prompt_ids"] for r in read_records(path) if r.get("split") == split]
    if not prompts:
        raise SystemExit(f"{path}: no records of split {split!r}")
    return prompts[:count]


def teacher_forced_accepted(model, teacher: TargetTeacher, prompt: list[int], output: list[int],
                            anchors: list[int], gamma: int) -> list[int]:
    """Leading drafts of each block (anchor = index into `output`) whose drafter argmax is the
    target's argmax, teacher-forced on prompt + output."""
    ids = torch.tensor([prompt + output])  # [1, T]
    features, final_hidden = teacher.run(ids, torch.ones_like(ids))
    at = torch.tensor([anchors]) + len(prompt)  # [1, N] positions of the anchor tokens
    steps = torch.arange(gamma)
    labels = ids[0][at[0].unsqueeze(-1) + 1 + steps].unsqueeze(0)  # [1, N, gamma]
    with torch.no_grad():
        logits = model.forward_train(ids, features, at, labels).draft_logits[0]  # [N, gamma, V_d]
    drafted = logits.argmax(-1)
    if model.draft_to_target.numel():
        drafted = model.draft_to_target[drafted]
    target = teacher.probs(final_hidden[0], 0.0).argmax(-1)  # [T]
    match = (drafted == target[at[0].unsqueeze(-1) + steps]).long()  # [N, gamma]
    return torch.cumprod(match, dim=-1).sum(-1).tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument("--checkpoint", default="checkpoints/dspark-markov")
    parser.add_argument("--model-dir", default=None, help="the target's folder (default: dspark fetch-model's)")
    parser.add_argument("--data", default="data/answers/greedy.jsonl.gz", help="prompts of this answers file")
    parser.add_argument("--split", default="heldout")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = args.model_dir or str(ensure_model())
    prompts = heldout_prompts(args.data, args.split, args.prompts)
    layer_ids = tuple(DrafterConfig.load(args.checkpoint).target_layer_ids)

    runner = load_target(target_dir, layer_ids, kv_cache_tokens=16 * 1024, dtype="float32", device=resolve_device(args.device))
    served = load_method_drafter(args.checkpoint, runner)
    gamma = served.gamma
    result = collect_records(TargetVerifier(runner), served, prompts,
                             CollectConfig(verify_len=gamma, max_tokens=args.max_tokens,
                                           temperature=0.0, max_running=4))
    records = result.records

    teacher = TargetTeacher(TargetTeacher.load(target_dir, torch.device("cpu"), torch.float32),
                            list(layer_ids))
    model = load_drafter(args.checkpoint, teacher.embed_weight, teacher.lm_head_weight).eval()
    engine, forced, cut = [], [], 0
    for i, (prompt, output) in enumerate(zip(prompts, result.output_ids)):
        rows = [j for j, rid in enumerate(records.request_ids) if rid == i]
        anchors, kept, at = [], [], 0  # anchor: index in `output` of the round's first input token
        for j in rows:
            if at + gamma + 1 < len(output):
                anchors.append(at)
                kept.append(j)
            else:
                cut += 1
            at += int(records.accepted[j]) + 1
        if anchors:
            forced += teacher_forced_accepted(model, teacher, list(prompt), output, anchors, gamma)
            engine += [int(records.accepted[j]) for j in kept]
    engine_a, forced_a = np.array(engine), np.array(forced)
    summary = {
        "bench": "served_vs_teacher_forced", "checkpoint": args.checkpoint, "prompts": len(prompts),
        "rounds_compared": len(engine), "rounds_cut_by_the_end": cut,
        "rounds_equal": int(np.sum(engine_a == forced_a)),
        "accepted_mean_served": round(float(engine_a.mean()), 4) if engine else None,
        "accepted_mean_teacher_forced": round(float(forced_a.mean()), 4) if engine else None,
        "first_draft_served": round(float(np.mean(engine_a >= 1)), 4) if engine else None,
        "first_draft_teacher_forced": round(float(np.mean(forced_a >= 1)), 4) if engine else None,
    }
    print(f"{summary['rounds_equal']} of {len(engine)} rounds accept the same drafts served and "
          f"teacher-forced ({cut} rounds at the end of an output left out); mean accepted "
          f"{summary['accepted_mean_served']} served, {summary['accepted_mean_teacher_forced']} "
          "teacher-forced")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
