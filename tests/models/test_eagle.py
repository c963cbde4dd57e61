"""The Eagle-style autoregressive baseline: its token-by-token drafting with a KV cache equals the
training-time-test forward, sees only context before the anchor, and samples exactly."""

from __future__ import annotations

import pytest
import torch

from dspark.models.draft_types import DraftRequest
from dspark.models.drafter_io import load_drafter, save_drafter
from dspark.models.eagle import EagleDrafter, eagle_config
from dspark.random_draws import CounterGenerator
from dspark.sampling import SamplingParams

VOCAB, HIDDEN, GAMMA, M = 40, 32, 4, 2
TARGET = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
              model_type="llama")


def make_eagle(seed: int = 0, draft_ids: torch.Tensor | None = None) -> EagleDrafter:
    cfg = eagle_config(TARGET, target_layer_ids=[1, 3], block_size=GAMMA,
                       draft_vocab_size=None if draft_ids is None else draft_ids.numel())
    g = torch.Generator().manual_seed(seed)
    model = EagleDrafter(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1) + (p.dim() == 1))
    model.set_target_weights(torch.randn(VOCAB, HIDDEN, generator=g),
                             torch.randn(VOCAB, HIDDEN, generator=g) * 0.3, draft_ids)
    return model.eval()


def sequence(T: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, T), generator=g), torch.randn(1, T, M * HIDDEN, generator=g)


def teacher_forced(model, ids, feats, anchor, drafted):
    with torch.no_grad():
        return model.forward_train(ids, feats, torch.tensor([[anchor]]),
                                   drafted.view(1, 1, -1)).draft_logits[0, 0]


def test_shapes_and_state_dict_names():
    model = make_eagle()
    names = set(model.state_dict())
    assert {"fc.weight", "norm.weight", "midlayer.self_attn.q_proj.weight",
            "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.mlp.down_proj.weight"} <= names
    assert model.state_dict()["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * HIDDEN
    ids, feats = sequence()
    labels = torch.randint(0, VOCAB, (1, 3, GAMMA))
    out = model.forward_train(ids, feats, torch.tensor([[2, 6, 11]]), labels)
    assert out.draft_logits.shape == (1, 3, GAMMA, VOCAB) and out.confidence_logits is None


def test_token_by_token_drafting_equals_the_ttt_forward():
    model = make_eagle()
    ids, feats = sequence(T=20)
    gen = CounterGenerator(3)
    length = 0
    for chunk in (4, 2, 1, 5):  # rounds: the context grows by each round's accepted tokens
        model.append_context("r", feats[0, length: length + chunk],
                             torch.arange(length, length + chunk), ids[0, length: length + chunk])
        length += chunk
        model.append_context(f"o{length}", feats[0, :3], torch.arange(3), ids[0, :3])
        blocks = model.draft([DraftRequest("r", int(ids[0, length]), length, SamplingParams(1.0), gen),
                              DraftRequest(f"o{length}", 9, 3, SamplingParams(1.0), gen)])
        logits = teacher_forced(model, ids, feats, length, blocks[0].tokens)
        assert torch.allclose(blocks[0].probs, torch.softmax(logits, -1), atol=1e-5)
        assert torch.allclose(blocks[0].confidences, torch.softmax(logits, -1).max(-1).values,
                              atol=1e-5)
    assert model.context_length("r") == length


def test_first_positions_are_those_of_the_whole_block():
    model = make_eagle()
    ids, feats = sequence(T=16)
    model.append_context("r", feats[0, :9], torch.arange(9), ids[0, :9])

    def request():
        return [DraftRequest("r", int(ids[0, 9]), 9, SamplingParams(1.0), CounterGenerator(2))]

    whole = model.draft(request())[0]
    for n in (1, 3):
        part = model.draft(request(), num_positions=n)[0]
        assert part.gamma == n and torch.equal(part.tokens, whole.tokens[:n])
        assert torch.allclose(part.probs, whole.probs[:n], atol=1e-6)
        assert torch.allclose(part.confidences, whole.confidences[:n], atol=1e-6)


def test_only_context_before_the_anchor_matters():
    model = make_eagle()
    ids, feats = sequence()
    drafted = torch.tensor([1, 2, 3, 4])
    base = teacher_forced(model, ids, feats, 7, drafted)
    changed = feats.clone()
    changed[0, 7:] += 5.0  # features of the anchor position and later are not known yet
    ids2 = ids.clone()
    ids2[0, 8:] = (ids[0, 8:] + 1) % VOCAB  # nor tokens after the anchor
    assert torch.allclose(teacher_forced(model, ids2, changed, 7, drafted), base, atol=1e-5)
    earlier = feats.clone()
    earlier[0, 6] += 1.0  # g_{a-1} is the anchor element's hidden input
    assert not torch.allclose(teacher_forced(model, ids, earlier, 7, drafted), base, atol=1e-3)


def test_greedy_and_sparse_drafts_are_exact():
    model = make_eagle()
    ids, feats = sequence()
    model.append_context("r", feats[0, :8], torch.arange(8), ids[0, :8])
    greedy = model.draft([DraftRequest("r", int(ids[0, 8]), 8, SamplingParams(0.0))])[0]
    assert torch.equal(greedy.tokens, teacher_forced(model, ids, feats, 8, greedy.tokens).argmax(-1))
    sparse = model.draft([DraftRequest("r", int(ids[0, 8]), 8, SamplingParams(0.8),
                                       CounterGenerator(0))], sparse_top_k=4)[0]
    logits = teacher_forced(model, ids, feats, 8, sparse.tokens)
    values, indices = torch.topk(logits, 4, dim=-1)
    assert torch.equal(sparse.indices, indices)
    assert torch.allclose(sparse.probs, torch.softmax(values / 0.8, -1), atol=1e-6)


def test_context_must_come_with_tokens_in_order():
    model = make_eagle()
    ids, feats = sequence()
    with pytest.raises(ValueError):
        model.append_context("r", feats[0, :3], torch.arange(3))
    model.append_context("r", feats[0, :3], torch.arange(3), ids[0, :3])
    with pytest.raises(ValueError):
        model.append_context("r", feats[0, 4:6], torch.arange(4, 6), ids[0, 4:6])
    with pytest.raises(ValueError):  # the anchor must follow the context directly
        model.draft([DraftRequest("r", 5, 4, SamplingParams(0.0))])
    model.release("r")
    assert model.context_length("r") == 0


def test_reduced_vocabulary_and_checkpoint_round_trip(tmp_path):
    draft_ids = torch.tensor([0, 1, 5, 9, 12, 20, 33, 39])
    model = make_eagle(draft_ids=draft_ids)
    ids, feats = sequence()
    full_lm_head = torch.zeros(VOCAB, HIDDEN)
    full_lm_head[draft_ids] = model.lm_head_weight
    save_drafter(model, tmp_path)
    loaded = load_drafter(tmp_path, model.embed_weight, full_lm_head)
    assert isinstance(loaded, EagleDrafter)
    for m in (model, loaded):
        m.append_context("r", feats[0, :8], torch.arange(8), ids[0, :8])
    req = lambda: [DraftRequest("r", int(ids[0, 8]), 8, SamplingParams(1.0),
                                CounterGenerator(5))]
    a, b = model.draft(req())[0], loaded.draft(req())[0]
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.probs, b.probs)
    assert bool(torch.isin(a.tokens, draft_ids).all())
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[draft_ids] = False
    assert torch.equal(a.indices, draft_ids.expand(a.gamma, -1))  # the draft vocabulary
    assert float(a.dense(VOCAB)[:, outside].abs().max()) == 0.0
    assert torch.allclose(a.dense(VOCAB).sum(1), torch.ones(a.gamma))
