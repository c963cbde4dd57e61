"""The drafter's training losses (docs/design.md section 4, the paper's eqs. 8-12).

Glossary
- block position k = 1..gamma of a training block; its draft distribution p^d_k comes from the
  teacher-forced logits (the sequential head sees the true x*_{k-1}); p^t_k is the frozen target's
  distribution for the same position (at the configured sampling temperature).
- position weight w_k = exp(-(k-1) / decay), decay = gamma by default (DeepSpec's code uses 4).
- L_ce   = -sum_k w_k log p^d_k(x*_k)
- L_tv   =  sum_k w_k ||p^d_k - p^t_k||_1
- L_conf = -sum_k w_k [c*_k log c_k + (1 - c*_k) log(1 - c_k)],  c*_k = 1 - 0.5 ||p^d_k - p^t_k||_1
  (detached: the rejection sampler's exact acceptance probability of position k)
- L = 0.1 L_ce + 0.9 L_tv + 1.0 L_conf (weights configurable).
As in DeepSpec, each term is averaged over the supervised positions of the batch with the position
weights: sum over blocks and k of w_k * term / sum of w_k over the same positions (a constant
rescaling of the per-block sums above). Positions outside `valid` are not supervised.

Reduced draft vocabulary: p^d lives on V_d target tokens and is 0 elsewhere, so
||p^d - p^t||_1 = sum_{v in V_d} |p^d(v) - p^t(v)| + (target mass outside V_d); the caller passes
p^t restricted to V_d and that outside mass. L_ce skips positions whose true token is outside V_d
(log p^d = -inf there; the TV term still pushes mass correctly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossConfig:
    """Weights of the three loss terms and of the block positions."""

    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    decay: float | None = None
    """w_k = exp(-(k-1)/decay); None = gamma (the paper); DeepSpec's code uses 4."""

    def __post_init__(self) -> None:
        for name in ("ce_weight", "tv_weight", "conf_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.decay is not None and not self.decay > 0:
            raise ValueError("decay must be > 0")


def position_weights(gamma: int, decay: float | None = None,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for k = 1..gamma: [gamma] float32."""
    decay = float(gamma if decay is None else decay)
    return torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / decay)


@dataclass
class LossTerms:
    """The total loss (with gradient) and its parts and statistics (detached)."""

    total: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    conf: torch.Tensor
    accept_per_position: torch.Tensor
    """[gamma] mean c*_k over supervised positions (the expected acceptance rate of position k)."""
    expected_tau: float
    """Mean over supervised blocks of 1 + sum_j prod_{i<=j} c*_i (tokens per round, full block)."""
    num_positions: int

    def as_dict(self) -> dict[str, float | list[float]]:
        return {"loss": float(self.total.detach()), "ce": float(self.ce), "tv": float(self.tv),
                "conf": float(self.conf), "tau": self.expected_tau,
                "accept": [round(float(a), 4) for a in self.accept_per_position]}


def drafter_losses(draft_logits: torch.Tensor, target_probs: torch.Tensor, target_ids: torch.Tensor,
                   valid: torch.Tensor, confidence_logits: torch.Tensor | None,
                   config: LossConfig = LossConfig(),
                   target_outside_mass: torch.Tensor | None = None) -> LossTerms:
    """All three losses for a batch of blocks.

    draft_logits [..., gamma, V_d] (teacher forced); target_probs [..., gamma, V_d] (p^t on the
    draft vocabulary); target_ids [..., gamma] x*_k as draft-vocabulary ids, -1 where outside it;
    valid [..., gamma] bool; confidence_logits [..., gamma] or None;
    target_outside_mass [..., gamma] p^t mass outside the draft vocabulary (None = 0).
    """
    gamma = draft_logits.shape[-2]
    lead = draft_logits.shape[:-1]
    assert target_probs.shape == draft_logits.shape, (target_probs.shape, draft_logits.shape)
    assert target_ids.shape == lead and valid.shape == lead, (target_ids.shape, valid.shape, lead)
    w = position_weights(gamma, config.decay, draft_logits.device)  # [gamma]
    weight = w * valid.float()  # [..., gamma]
    den = weight.sum().clamp_min(1e-6)

    log_pd = torch.log_softmax(draft_logits.float(), dim=-1)  # [..., gamma, V_d]
    pd = log_pd.exp()
    tv = (pd - target_probs.float()).abs().sum(dim=-1)  # [..., gamma]
    if target_outside_mass is not None:
        assert target_outside_mass.shape == lead, target_outside_mass.shape
        tv = tv + target_outside_mass.float()
    accept = (1.0 - 0.5 * tv).clamp(0.0, 1.0).detach()  # c*_k

    in_vocab = target_ids >= 0
    ce_weight = weight * in_vocab.float()
    nll = -log_pd.gather(-1, target_ids.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # [..., gamma]
    ce = (nll * ce_weight).sum() / ce_weight.sum().clamp_min(1e-6)
    tv_loss = (tv * weight).sum() / den
    if confidence_logits is not None:
        assert confidence_logits.shape == lead, confidence_logits.shape
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept, reduction="none")
        conf = (bce * weight).sum() / den
    else:
        conf = tv_loss.new_zeros(())
    total = config.ce_weight * ce + config.tv_weight * tv_loss + config.conf_weight * conf

    with torch.no_grad():
        valid_f = valid.float()
        flat_valid = valid_f.reshape(-1, gamma)
        flat_accept = accept.reshape(-1, gamma)
        counts = flat_valid.sum(dim=0)
        accept_per_position = (flat_accept * flat_valid).sum(dim=0) / counts.clamp_min(1.0)
        blocks = flat_valid[:, 0] > 0
        survival = torch.cumprod(flat_accept * flat_valid, dim=1)  # [num_blocks, gamma]
        taus = 1.0 + survival.sum(dim=1)
        expected_tau = float(taus[blocks].mean()) if bool(blocks.any()) else math.nan
    return LossTerms(total, ce.detach(), tv_loss.detach(), conf.detach(), accept_per_position,
                     expected_tau, int(valid.sum()))
