"""What the drafter's draft vocabulary covers of the target's answers, and copies of the drafter with
a wider one.

A draft token comes from the draft vocabulary (`dspark train --draft-vocab`; the shipped DSpark
drafter keeps 8,192 of 49,152 ids), so an answer token outside it is a rejection wherever the
target emits it. For each answer file this prints the share of answer tokens inside the drafter's
vocabulary and inside a widened one of each `--sizes` N: the drafter's own ids plus the most
frequent answer tokens outside them (ranked over the same files, so the widened shares are what
a vocabulary chosen on this data would cover). With `--widened-out DIR` it also writes, for each
N, a copy of the drafter whose vocabulary is the widened one (DIR/v<N>/<checkpoint name>): the
added rows get the target's frozen LM-head rows as every draft id does, and a zero Markov bias,
so `bench/eval_suite.py --checkpoints DIR/v<N>` measures what widening buys without training.
Prints a markdown table and one JSON line. Usage:

    .venv/bin/python bench/draft_vocab_coverage.py [--answers data/answers/greedy.jsonl.gz,data/answers/t1.jsonl.gz]
        [--checkpoint checkpoints/dspark-markov] [--sizes 16384] [--limit 20000] [--widened-out DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark.models.drafter_io import draft_token_ids_from, read_checkpoint
from dspark.paths import DEFAULT_DRAFTER

MARKOV_W2 = "markov_head.markov_w2.weight"


def answer_token_counts(path: Path, limit: int) -> Counter:
    """Counts of answer token ids over the first `limit` records of a `dspark data generate` file."""
    counts: Counter = Counter()
    with gzip.open(path, "rt") as fh:
        for i, line in enumerate(fh):
            if i >= limit:
                break
            counts.update(json.loads(line)["answer_ids"])
    return counts


def widened_ids(draft_ids: torch.Tensor, counts: Counter, size: int) -> torch.Tensor:
    """The drafter's ids [V_d] plus the most frequent answer tokens outside them, `size` in all
    (ascending; ids that never occur fill up by id when the answers run out)."""
    inside = set(draft_ids.tolist())
    extra = [t for t, _ in counts.most_common() if t not in inside]
    extra += [t for t in range(max(counts, default=0) + 1) if t not in inside and t not in counts]
    ids = sorted(inside | set(extra[: size - len(inside)]))
    if len(ids) != size:
        raise ValueError(f"cannot widen {len(inside)} ids to {size}")
    return torch.tensor(ids, dtype=torch.int64)


def write_widened(checkpoint: Path, out: Path, ids: torch.Tensor) -> None:
    """A copy of the checkpoint folder whose draft vocabulary is `ids` [N] (a superset of its own):
    the Markov head's W2 gains zero rows for the added ids, d2t / t2d / config.json follow."""
    config, tensors = read_checkpoint(checkpoint)
    old_ids = draft_token_ids_from(tensors, config)
    if old_ids is None:
        raise ValueError(f"{checkpoint} drafts from the full vocabulary already")
    out.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    tensors = dict(tensors)
    if MARKOV_W2 in tensors:
        old_w2 = tensors[MARKOV_W2]  # [V_d, r]
        w2 = old_w2.new_zeros(ids.numel(), old_w2.shape[1])  # [N, r]
        w2[torch.searchsorted(ids, old_ids)] = old_w2
        tensors[MARKOV_W2] = w2
    tensors["d2t"] = ids - torch.arange(ids.numel())
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"))
    config_dict = json.loads((checkpoint / "config.json").read_text())
    config_dict["draft_vocab_size"] = int(ids.numel())
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", default="data/answers/greedy.jsonl.gz,data/answers/t1.jsonl.gz",
                        help="comma-separated answer files (dspark data generate's format)")
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--sizes", default="16384", help="widened vocabulary sizes N")
    parser.add_argument("--limit", type=int, default=20000, help="records read from each file")
    parser.add_argument("--widened-out", type=Path, default=None,
                        help="write a widened copy of the drafter for each N under this folder")
    args = parser.parse_args()
    config, tensors = read_checkpoint(args.checkpoint)
    draft_ids = draft_token_ids_from(tensors, config)
    if draft_ids is None:
        raise SystemExit(f"{args.checkpoint} drafts from the full vocabulary: nothing to cover")
    files = [Path(p) for p in args.answers.split(",")]
    per_file = {f: answer_token_counts(f, args.limit) for f in files}
    total: Counter = Counter()
    for counts in per_file.values():
        total.update(counts)
    sizes = [int(s) for s in args.sizes.split(",")]
    vocabularies = {config.draft_vocab_size: draft_ids}
    vocabularies.update({n: widened_ids(draft_ids, total, n) for n in sizes})
    print(f"| answers | tokens | " + " | ".join(f"inside {n:,}" for n in vocabularies) + " |")
    print("|---|---:|" + "---:|" * len(vocabularies))
    rows = []
    for f, counts in per_file.items():
        tokens = sum(counts.values())
        shares = {n: sum(counts[t] for t in ids.tolist()) / tokens for n, ids in vocabularies.items()}
        print(f"| {f} | {tokens:,} | " + " | ".join(f"{s:.2%}" for s in shares.values()) + " |")
        rows.append({"answers": str(f), "tokens": tokens, "inside": {str(n): round(s, 5) for n, s in shares.items()}})
    written = []
    if args.widened_out is not None:
        for n in sizes:
            out = args.widened_out / f"v{n}" / args.checkpoint.name
            write_widened(args.checkpoint, out, vocabularies[n])
            written.append(str(out))
            print(f"wrote {out}")
    print(json.dumps({"bench": "draft_vocab_coverage", "checkpoint": str(args.checkpoint),
                      "limit": args.limit, "rows": rows, "widened": written}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
