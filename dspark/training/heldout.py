"""Held-out acceptance of a drafter in training: the learning curve's y axis.

On a fixed set of held-out answers (records of split `heldout`, never trained on) and fixed anchor
blocks, the drafter drafts teacher-forced (every block position sees the true earlier tokens, as
in training) and we measure, per block position k = 1..gamma:
- at T=1: the exact acceptance probability of the rejection
  sampler, c*_k = 1 - 0.5 ||p^d_k - p^t_k||_1, and tau = 1 + sum_j prod_{i<=j} c*_i per block;
- greedy: whether the drafter's most likely token is the target's (acceptance 1 or 0), and tau
  from the same running product.
Both are means over the blocks, so they are comparable from one evaluation to the next: the same
examples, the same anchors, the teacher's outputs computed once and kept.
"""

from __future__ import annotations

import torch

from dspark.sampling import argmax_first
from dspark.training.batches import Example, block_labels, make_batch, sample_anchors


class HeldoutEvaluator:
    """Teacher-forced acceptance on fixed held-out blocks (see the module docstring)."""

    def __init__(self, examples: list[Example], teacher, gamma: int, num_anchors: int,
                 max_seq_len: int, draft_ids: torch.Tensor | None, device: torch.device,
                 batch_size: int = 4, seed: int = 1234) -> None:
        if not examples:
            raise ValueError("held-out evaluation needs records of split 'heldout'")
        self.teacher, self.gamma = teacher, gamma
        self.draft_ids = None if draft_ids is None else draft_ids.to(device)
        self.device = device
        generator = torch.Generator().manual_seed(seed)
        self.batches = []  # (input_ids, features, final_hidden, anchors, labels, valid)
        for i in range(0, len(examples), batch_size):
            batch = make_batch(examples[i: i + batch_size], max_seq_len)
            input_ids = batch.input_ids.to(device)
            features, final_hidden = teacher.run(input_ids, batch.attention_mask.to(device))
            anchors, keep = sample_anchors(batch.answer_mask, num_anchors, generator)
            anchors, keep = anchors.to(device), keep.to(device)
            labels, valid = block_labels(input_ids, anchors, batch.answer_mask.to(device), gamma)
            self.batches.append((input_ids, features.to(torch.bfloat16), final_hidden, anchors,
                                 labels, valid & keep.unsqueeze(-1)))

    @torch.no_grad()
    def evaluate(self, model) -> dict:
        """-> {"tau_t1", "accept_t1": [gamma], "tau_greedy", "accept_greedy": [gamma], "blocks"}."""
        was_training = model.training
        model.eval()
        sums = {"t1": torch.zeros(self.gamma), "greedy": torch.zeros(self.gamma)}
        tau_sums = {"t1": 0.0, "greedy": 0.0}
        counts = torch.zeros(self.gamma)
        blocks = 0
        for input_ids, features, final_hidden, anchors, labels, valid in self.batches:
            B, N = anchors.shape
            pos = (anchors.unsqueeze(-1) + torch.arange(self.gamma, device=self.device)).clamp(
                max=input_ids.shape[1] - 1)  # [B, N, gamma]
            rows = final_hidden.gather(1, pos.view(B, -1, 1).expand(-1, -1, final_hidden.shape[-1]))
            p_t = self.teacher.probs(rows.view(B, N, self.gamma, -1), 1.0)  # [B, N, gamma, V]
            target_argmax = argmax_first(p_t)  # [B, N, gamma]: the target's greedy token
            outside = 0.0
            if self.draft_ids is not None:
                p_t = p_t[..., self.draft_ids]
                outside = (1.0 - p_t.sum(-1)).clamp_min(0.0)
            logits = model.forward_train(input_ids, features.float(), anchors, labels).draft_logits
            p_d = torch.softmax(logits.float(), dim=-1)  # [B, N, gamma, V_d]
            accept_t1 = (1.0 - 0.5 * ((p_d - p_t).abs().sum(-1) + outside)).clamp(0.0, 1.0)
            draft_argmax = argmax_first(p_d)
            if self.draft_ids is not None:
                draft_argmax = self.draft_ids[draft_argmax]
            accept_greedy = (draft_argmax == target_argmax).float()
            v = valid.float()
            starts = v[..., 0] > 0  # blocks with a supervised first position
            counts += v.sum(dim=(0, 1)).cpu()
            blocks += int(starts.sum())
            for name, accept in (("t1", accept_t1), ("greedy", accept_greedy)):
                sums[name] += (accept * v).sum(dim=(0, 1)).cpu()
                tau = 1.0 + torch.cumprod(accept * v, dim=-1).sum(-1)  # [B, N]
                tau_sums[name] += float(tau[starts].sum())
        model.train(was_training)
        out = {"blocks": blocks}
        for name in ("t1", "greedy"):
            out[f"tau_{name}"] = round(tau_sums[name] / max(blocks, 1), 4)
            out[f"accept_{name}"] = [round(float(a), 4) for a in sums[name] / counts.clamp_min(1)]
        return out
