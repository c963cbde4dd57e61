"""Training examples and batches: reading answer files, right-padded batches, the epoch order,
the draft vocabulary and mask token a data set selects, anchor positions, and the labels of the
blocks drafted at them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.training.data import read_records


@dataclass
class Example:
    prompt_ids: list[int]
    answer_ids: list[int]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded
    attention_mask: torch.Tensor  # [B, T] int64
    answer_mask: torch.Tensor  # [B, T] bool
    example_ids: list[int] = field(default_factory=list)  # [B] indices into the data set

    @property
    def lengths(self) -> list[int]:
        return self.attention_mask.sum(dim=1).tolist()


def read_examples(path: str | Path, split: str | None = "train") -> list[Example]:
    """Examples with a non-empty answer from a (gzipped) jsonl, keeping only `split` (None = all);
    a file cut off by a killed writer is read up to the cut (`read_records`).
    `path` may name several files separated by commas: their examples in that order."""
    if "," in str(path):
        return [ex for part in str(path).split(",") if part.strip()
                for ex in read_examples(part.strip(), split)]
    if not Path(path).exists():
        raise FileNotFoundError(path)
    examples = []
    for line_no, obj in enumerate(read_records(Path(path)), 1):
        if "prompt_ids" not in obj or "answer_ids" not in obj:
            raise ValueError(f"{path}:{line_no}: needs prompt_ids and answer_ids")
        if split is not None and obj.get("split", "train") != split:
            continue
        if obj["answer_ids"]:
            examples.append(Example([int(t) for t in obj["prompt_ids"]],
                                    [int(t) for t in obj["answer_ids"]]))
    if not examples:
        raise ValueError(f"{path}: no examples with a non-empty answer in split {split!r}")
    return examples


def make_batch(examples: list[Example], max_seq_len: int, pad_id: int = 0,
               example_ids: list[int] | None = None) -> Batch:
    """Concatenate prompt + answer; when too long keep the answer (and the prompt's tail), then
    cut the answer's end."""
    seqs, answer_starts = [], []
    for ex in examples:
        keep_prompt = max(1, max_seq_len // 2, max_seq_len - len(ex.answer_ids))
        prompt = ex.prompt_ids[-keep_prompt:] if ex.prompt_ids else []
        seq = (prompt + ex.answer_ids)[:max_seq_len]
        seqs.append(seq)
        answer_starts.append(len(prompt))
    T = max(len(s) for s in seqs)
    B = len(seqs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros(B, T, dtype=torch.int64)
    answer_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (seq, start) in enumerate(zip(seqs, answer_starts)):
        input_ids[b, : len(seq)] = torch.tensor(seq)
        attention_mask[b, : len(seq)] = 1
        answer_mask[b, start: len(seq)] = True
    return Batch(input_ids, attention_mask, answer_mask, list(example_ids or []))


def epoch_order(num_examples: int, seed: int, epoch: int) -> list[int]:
    """A deterministic shuffle per (seed, epoch): resuming needs only (epoch, index)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_examples, generator=g).tolist()


def token_counts(examples: list[Example], vocab_size: int, answers_only: bool = True) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ex in examples:
        ids = ex.answer_ids if answers_only else ex.prompt_ids + ex.answer_ids
        counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    return counts


def select_draft_vocab(examples: list[Example], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens (ties: lower id first), ascending ids [size]."""
    counts = token_counts(examples, vocab_size)
    # Stable sort by count descending keeps lower ids first among equal counts.
    order = torch.sort(-counts, stable=True).indices[:size]
    return torch.sort(order).values


def pick_mask_token(examples: list[Example], vocab_size: int) -> int:
    """The highest token id that never occurs in the data (prompt or answer)."""
    counts = token_counts(examples, vocab_size, answers_only=False)
    unused = torch.nonzero(counts == 0).flatten()
    return int(unused[-1]) if unused.numel() else vocab_size - 1


def sample_anchors(answer_mask: torch.Tensor, num_anchors: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchor positions: answer_mask [B, T] -> anchors [B, N], keep [B, N] bool.

    An anchor a needs a and a+1 to be answer tokens; up to N distinct anchors per sequence,
    sorted; missing ones are padded (keep False, position of the first candidate or 0).
    """
    B, T = answer_mask.shape
    valid = answer_mask[:, :-1] & answer_mask[:, 1:]  # [B, T-1]
    scores = torch.rand(B, T - 1, generator=generator)
    scores = torch.where(valid, scores, torch.full_like(scores, 2.0))
    n = min(num_anchors, T - 1)
    chosen = torch.sort(scores, dim=1).indices[:, :n]  # [B, n]
    keep = valid.gather(1, chosen)
    anchors = torch.where(keep, chosen, torch.zeros_like(chosen))
    anchors, order = torch.sort(torch.where(keep, anchors, torch.full_like(anchors, T)), dim=1)
    keep = keep.gather(1, order)
    anchors = torch.where(keep, anchors, torch.zeros_like(anchors))
    if n < num_anchors:
        pad = num_anchors - n
        anchors = torch.cat([anchors, anchors.new_zeros(B, pad)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(B, pad)], dim=1)
    return anchors, keep


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, answer_mask: torch.Tensor,
                 gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels of N blocks per sequence and which are supervised.

    input_ids [B, T]; anchors [B, N]; answer_mask [B, T] bool (positions whose token is a
    target-generated answer token). Returns labels [B, N, gamma] = x*_{a+k} (clamped where out of
    range) and valid [B, N, gamma] bool: a contiguous prefix of in-range answer positions.
    """
    B, T = input_ids.shape
    idx = anchors.unsqueeze(-1) + torch.arange(1, gamma + 1, device=anchors.device)  # [B, N, gamma]
    in_range = idx < T
    safe = idx.clamp(max=T - 1)
    flat = safe.view(B, -1)
    labels = input_ids.gather(1, flat).view_as(safe)
    valid = in_range & answer_mask.gather(1, flat).view_as(safe)
    valid = valid.to(torch.int32).cumprod(dim=-1).bool()
    return labels, valid
