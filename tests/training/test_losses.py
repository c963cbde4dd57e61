"""The three drafter losses (docs/design.md section 4) against a slow, loop-by-loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.training.losses import LossConfig, drafter_losses, position_weights


def reference(draft_logits, target_probs, target_ids, valid, conf_logits, cfg, outside=None):
    """Python loops over blocks and positions, floats only."""
    *lead, gamma, vocab = draft_logits.shape
    blocks = draft_logits.reshape(-1, gamma, vocab).tolist()
    pt_all = target_probs.reshape(-1, gamma, vocab).tolist()
    ids_all = target_ids.reshape(-1, gamma).tolist()
    valid_all = valid.reshape(-1, gamma).tolist()
    conf_all = None if conf_logits is None else conf_logits.reshape(-1, gamma).tolist()
    out_all = None if outside is None else outside.reshape(-1, gamma).tolist()
    decay = gamma if cfg.decay is None else cfg.decay
    ce_num = ce_den = tv_num = conf_num = den = 0.0
    accept_sum, accept_count, taus = [0.0] * gamma, [0] * gamma, []
    for b, logits_b in enumerate(blocks):
        survival, tau, any_valid = 1.0, 1.0, False
        for k in range(gamma):
            if not valid_all[b][k]:
                survival = 0.0
                continue
            any_valid = True
            w = math.exp(-k / decay)
            m = max(logits_b[k])
            z = sum(math.exp(x - m) for x in logits_b[k])
            pd = [math.exp(x - m) / z for x in logits_b[k]]
            tv = sum(abs(p - q) for p, q in zip(pd, pt_all[b][k]))
            if out_all is not None:
                tv += out_all[b][k]
            c_star = min(1.0, max(0.0, 1 - 0.5 * tv))
            if ids_all[b][k] >= 0:
                ce_num += w * -math.log(pd[ids_all[b][k]])
                ce_den += w
            tv_num += w * tv
            den += w
            if conf_all is not None:
                c = 1 / (1 + math.exp(-conf_all[b][k]))
                conf_num += w * -(c_star * math.log(c) + (1 - c_star) * math.log(1 - c))
            accept_sum[k] += c_star
            accept_count[k] += 1
            survival *= c_star
            tau += survival
        if any_valid:
            taus.append(tau)
    ce, tv, conf = ce_num / ce_den, tv_num / den, conf_num / den
    total = cfg.ce_weight * ce + cfg.tv_weight * tv + cfg.conf_weight * conf
    accept = [s / max(c, 1) for s, c in zip(accept_sum, accept_count)]
    return total, ce, tv, conf, accept, sum(taus) / len(taus)


def random_case(seed, shape=(3, 2), gamma=5, vocab=11, reduced=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, gamma, vocab, generator=g) * 2
    pt = torch.softmax(torch.randn(*shape, gamma, vocab, generator=g) * 2, -1)
    outside = None
    if reduced:  # p^t on the draft vocabulary only: part of its mass lies outside
        outside = torch.rand(*shape, gamma, generator=g) * 0.3
        pt = pt * (1 - outside).unsqueeze(-1)
    ids = torch.randint(0, vocab, (*shape, gamma), generator=g)
    ids[torch.rand(ids.shape, generator=g) < 0.2] = -1 if reduced else 0
    valid = torch.rand(*shape, gamma, generator=g) < 0.85
    valid = valid.int().cumprod(-1).bool()
    valid[0, 0, :2] = True
    conf = torch.randn(*shape, gamma, generator=g)
    return logits, pt, ids, valid, conf, outside


def test_position_weights():
    assert torch.allclose(position_weights(7), torch.exp(-torch.arange(7.0) / 7))
    assert torch.allclose(position_weights(4, decay=4.0), torch.tensor(
        [1.0, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)]))


@pytest.mark.parametrize("seed,reduced,cfg", [
    (0, False, LossConfig()),
    (1, True, LossConfig()),
    (2, False, LossConfig(ce_weight=0.5, tv_weight=0.2, conf_weight=2.0, decay=4.0)),
])
def test_losses_match_the_reference(seed, reduced, cfg):
    logits, pt, ids, valid, conf, outside = random_case(seed, reduced=reduced)
    terms = drafter_losses(logits, pt, ids, valid, conf, cfg, outside)
    total, ce, tv, conf_loss, accept, tau = reference(logits, pt, ids, valid, conf, cfg, outside)
    assert float(terms.total) == pytest.approx(total, rel=1e-5)
    assert float(terms.ce) == pytest.approx(ce, rel=1e-5)
    assert float(terms.tv) == pytest.approx(tv, rel=1e-5)
    assert float(terms.conf) == pytest.approx(conf_loss, rel=1e-5)
    assert terms.accept_per_position.tolist() == pytest.approx(accept, rel=1e-5)
    assert terms.expected_tau == pytest.approx(tau, rel=1e-5)
    assert terms.num_positions == int(valid.sum())


def test_without_confidence_head_and_perfect_draft():
    logits, _, ids, _, _, _ = random_case(3)
    valid = torch.ones(ids.shape, dtype=torch.bool)
    pt = torch.softmax(logits, -1)
    terms = drafter_losses(logits, pt, ids.clamp_min(0), valid, None)
    assert float(terms.tv) == pytest.approx(0.0, abs=1e-6)
    assert float(terms.conf) == 0.0
    assert terms.accept_per_position.tolist() == pytest.approx([1.0] * 5)
    assert terms.expected_tau == pytest.approx(6.0)  # 1 + gamma when every draft is accepted


def test_soft_label_is_detached():
    """L_conf trains the confidence head only: its gradient w.r.t. the draft logits is zero."""
    logits, pt, ids, valid, conf, _ = random_case(4)
    logits.requires_grad_(True)
    conf.requires_grad_(True)
    only_conf = LossConfig(ce_weight=0.0, tv_weight=0.0, conf_weight=1.0)
    drafter_losses(logits, pt, ids, valid, conf, only_conf).total.backward()
    assert float(logits.grad.abs().max()) == 0.0
    assert float(conf.grad.abs().max()) > 0.0
    # Invalid positions get no gradient at all.
    logits.grad = None
    conf.grad = None
    drafter_losses(logits, pt, ids, valid, conf).total.backward()
    assert float(logits.grad[~valid].abs().max()) == 0.0 and float(conf.grad[~valid].abs().max()) == 0.0
