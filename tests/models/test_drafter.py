"""The DSpark drafter (docs/design.md section 3): masks, incremental context, heads, exact sampling."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dspark.calibration.sts_map import CalibrationSet, STSCalibration
from dspark.models.draft_types import DraftBlock, DraftRequest
from dspark.models.drafter import ContextAttention, DSparkDrafter, training_mask
from dspark.models.drafter_config import DrafterConfig, SequentialHead
from dspark.random_draws import CounterGenerator
from dspark.sampling import SamplingParams
from dspark.training.batches import block_labels

VOCAB, HIDDEN, GAMMA, M = 40, 32, 4, 2
TARGET = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
              model_type="llama")


def make_drafter(head: str = "markov", seed: int = 0, draft_ids: torch.Tensor | None = None,
                 bias_std: float = 0.5, inject: bool = False) -> DSparkDrafter:
    cfg = DrafterConfig.from_target_config(
        TARGET, num_hidden_layers=2, block_size=GAMMA, mask_token_id=3, target_layer_ids=[1, 3],
        markov_head_type=head, markov_rank=0 if head == "none" else 8,
        draft_vocab_size=None if draft_ids is None else draft_ids.numel(),
        inject_last_context=inject)
    g = torch.Generator().manual_seed(seed)
    model = DSparkDrafter(cfg)
    with torch.no_grad():
        for p in model.parameters():  # non-trivial weights everywhere (W2 too, unless told)
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1) + (p.dim() == 1))
        if model.markov_head is not None:
            model.markov_head.markov_w2.weight.normal_(0, bias_std, generator=g)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=g) * 0.3
    model.set_target_weights(embed, lm_head, draft_ids)
    return model.eval()


def sequence(T: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, T), generator=g), torch.randn(1, T, M * HIDDEN, generator=g)


def teacher_forced(model: DSparkDrafter, ids: torch.Tensor, feats: torch.Tensor, anchor: int,
                   drafted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full recompute: logits [gamma, V_d] and confidence logits [gamma] of one block whose
    sequential head sees `drafted` (target ids) as its previous tokens."""
    with torch.no_grad():
        out = model.forward_train(ids, feats, torch.tensor([[anchor]]), drafted.view(1, 1, -1))
    conf = None if out.confidence_logits is None else out.confidence_logits[0, 0]
    return out.draft_logits[0, 0], conf


@pytest.mark.parametrize("head", ["markov", "rnn", "none"])
def test_shapes(head):
    model = make_drafter(head)
    ids, feats = sequence()
    anchors = torch.tensor([[4, 9, 12]])
    labels, valid = block_labels(ids, anchors, torch.ones_like(ids, dtype=torch.bool), GAMMA)
    out = model.forward_train(ids, feats, anchors, labels)
    assert out.draft_logits.shape == (1, 3, GAMMA, VOCAB)
    assert out.confidence_logits.shape == (1, 3, GAMMA)
    assert valid[0, 2].tolist() == [True, True, True, False]  # 12 + 4 runs past T = 16
    model.append_context("r", feats[0, :6], torch.arange(6))
    blocks = model.draft([DraftRequest("r", int(ids[0, 6]), 6, SamplingParams(1.0)),
                          DraftRequest("r", int(ids[0, 6]), 6, SamplingParams(0.0)),
                          DraftRequest("new", 5, 0, SamplingParams(0.8, top_k=5))])
    assert blocks[0].tokens.shape == (GAMMA,) and blocks[0].probs.shape == (GAMMA, VOCAB)
    assert not blocks[0].is_sparse and blocks[1].indices.shape == (GAMMA, 1)
    assert blocks[2].indices.shape == (GAMMA, 5)
    for b in blocks:
        assert torch.allclose(b.dense(VOCAB).sum(1), torch.ones(GAMMA))
        assert bool((b.token_probs() > 0).all())
        assert bool(((b.confidences > 0) & (b.confidences < 1)).all())


@pytest.mark.parametrize("inject", [False, True])
def test_block_sees_only_context_before_anchor_and_is_bidirectional(inject):
    model = make_drafter(inject=inject)
    ids, feats = sequence()
    anchors = torch.tensor([[5, 10]])
    labels, _ = block_labels(ids, anchors, torch.ones_like(ids, dtype=torch.bool), GAMMA)
    with torch.no_grad():
        base = model.forward_train(ids, feats, anchors, labels).draft_logits
        future = feats.clone()
        future[0, 5:] += 3.0  # the anchor's own features and everything after it
        out = model.forward_train(ids, future, anchors, labels).draft_logits
        assert torch.allclose(out[0, 0], base[0, 0], atol=1e-5)  # block at anchor 5: untouched
        assert not torch.allclose(out[0, 1], base[0, 1], atol=1e-3)  # anchor 10 sees 5..9
        past = feats.clone()
        past[0, 4] += 3.0
        assert not torch.allclose(model.forward_train(ids, past, anchors, labels).draft_logits[0, 0],
                                  base[0, 0], atol=1e-3)
        # Blocks do not see each other: another anchor token changes only its own block.
        ids2 = ids.clone()
        ids2[0, 10] = (ids[0, 10] + 1) % VOCAB
        out2 = model.forward_train(ids2, feats, anchors, labels).draft_logits
        assert torch.allclose(out2[0, 0], base[0, 0], atol=1e-5)
        assert not torch.allclose(out2[0, 1], base[0, 1], atol=1e-3)

        # Inside a block attention is bidirectional: position 1 sees position 3's input.
        T = ids.shape[1]
        ctx_k, ctx_v = model.context_kv(feats, torch.arange(T).unsqueeze(0))
        mask = training_mask(torch.tensor([[5]]), T, GAMMA)
        assert mask[0, 0, T + GAMMA - 1] and not mask[0, 0, 5] and mask[0, 0, 4]
        embeds = torch.randn(1, GAMMA, HIDDEN)
        pos = torch.arange(5, 5 + GAMMA).unsqueeze(0)
        h = model.backbone(embeds, pos, ctx_k, ctx_v, mask)
        embeds2 = embeds.clone()
        embeds2[0, 3] += 1.0
        assert not torch.allclose(model.backbone(embeds2, pos, ctx_k, ctx_v, mask)[0, 0], h[0, 0],
                                  atol=1e-4)


@pytest.mark.parametrize("head,inject", [("markov", False), ("rnn", False), ("none", False),
                                         ("markov", True), ("none", True)])
def test_incremental_context_equals_full_recompute(head, inject):
    model = make_drafter(head, inject=inject)
    ids, feats = sequence(T=20)
    gen = CounterGenerator(7)
    length = 0
    for chunk in (5, 3, 1, 6):  # rounds: context grows by each round's accepted tokens
        model.append_context("r", feats[0, length: length + chunk],
                             torch.arange(length, length + chunk))
        length += chunk
        assert model.context_length("r") == length
        # Another request in the same call exercises the padded batch path.
        model.append_context(f"other{length}", feats[0, :2], torch.arange(2))
        blocks = model.draft([
            DraftRequest(f"other{length}", 7, 2, SamplingParams(1.0), gen),
            DraftRequest("r", int(ids[0, length]), length, SamplingParams(1.0), gen)])
        block = blocks[1]
        logits, conf = teacher_forced(model, ids, feats, length, block.tokens)
        assert torch.allclose(block.probs, torch.softmax(logits, -1), atol=1e-5)
        assert torch.allclose(block.confidences, torch.sigmoid(conf), atol=1e-5)
    # Context beyond the anchor is ignored at draft time (positions >= anchor are masked).
    ref = model.draft([DraftRequest("r", int(ids[0, 10]), 10, SamplingParams(0.0))])[0]
    logits, _ = teacher_forced(model, ids, feats, 10, ref.tokens)
    assert torch.equal(ref.tokens, logits.argmax(-1))
    model.release("r")
    assert model.context_length("r") == 0


@pytest.mark.parametrize("head,inject", [("markov", False), ("rnn", True), ("none", False)])
@pytest.mark.parametrize("batch", [1, 5])
def test_batched_context_attention_equals_the_per_request_reference(head, inject, batch):
    """ContextAttention.BATCHED (one SDPA a layer over padded contexts) drafts what PER_REQUEST
    (one SDPA a request and layer, each context in place) does: the same greedy and seeded
    tokens, probabilities and confidences to float rounding. The batch mixes context lengths,
    a request with no context, one whose anchor hides part of its context, and a duplicate."""
    models = [make_drafter(head, inject=inject) for _ in range(2)]
    models[0].context_attention = ContextAttention.BATCHED
    models[1].context_attention = ContextAttention.PER_REQUEST
    ids, feats = sequence(T=20)
    lengths = {"a": 3, "b": 17, "c": 9, "d": 0}
    anchors = {"a": 3, "b": 17, "c": 5, "d": 0}  # c: context positions 5..8 masked
    for model in models:
        for rid, n in lengths.items():
            model.append_context(rid, feats[0, :n], torch.arange(n))
    order = ["a", "b", "c", "d", "b"][:batch]
    blocks = []
    for model in models:
        requests = [DraftRequest(rid, int(ids[0, anchors[rid]]), anchors[rid],
                                 SamplingParams(0.0 if i % 2 else 1.0), CounterGenerator(11 + i))
                    for i, rid in enumerate(order)]
        blocks.append(model.draft(requests))
    for batched, reference in zip(*blocks):
        assert torch.equal(batched.tokens, reference.tokens)
        torch.testing.assert_close(batched.dense(VOCAB), reference.dense(VOCAB), rtol=0, atol=1e-5)
        torch.testing.assert_close(batched.confidences, reference.confidences, rtol=0, atol=1e-5)
    # Drafting wrote only scratch slots: the contexts still draft the same blocks.
    again = [m.draft([DraftRequest("c", int(ids[0, 5]), 5, SamplingParams(0.0))])[0].tokens
             for m in models]
    assert torch.equal(*again)


@pytest.mark.parametrize("inject", [False, True])
def test_pending_context_is_absorbed_at_draft_time(inject):
    """Context appended in several pieces for several requests, never read before drafting, is
    projected in one batch by the draft call: the blocks equal the teacher-forced reference."""
    model = make_drafter("markov", inject=inject)
    ids, feats = sequence(T=20)
    gen = CounterGenerator(8)
    anchors = {}
    for rid, pieces in (("a", (4, 3, 2)), ("b", (6, 5)), ("c", (1,))):
        start = 0
        for n in pieces:
            model.append_context(rid, feats[0, start:start + n], torch.arange(start, start + n))
            start += n
        anchors[rid] = start
    model.release("c")  # its pending tokens go with it
    blocks = model.draft([DraftRequest(rid, int(ids[0, anchors[rid]]), anchors[rid],
                                       SamplingParams(1.0), gen) for rid in ("a", "b")])
    for rid, block in zip(("a", "b"), blocks):
        logits, conf = teacher_forced(model, ids, feats, anchors[rid], block.tokens)
        assert torch.allclose(block.probs, torch.softmax(logits, -1), atol=1e-5)
        assert torch.allclose(block.confidences, torch.sigmoid(conf), atol=1e-5)
        assert model.context_length(rid) == anchors[rid]
    assert model.context_length("c") == 0


@pytest.mark.parametrize("head,inject", [("markov", False), ("rnn", False), ("none", True)])
def test_first_positions_are_those_of_the_whole_block(head, inject):
    """draft(num_positions=n) returns exactly the first n positions of the whole block (the
    same keyed uniforms), greedy, dense-sampled and sparse alike."""
    model = make_drafter(head, inject=inject)
    ids, feats = sequence(T=16)
    for rid in ("g", "s"):
        model.append_context(rid, feats[0, :10], torch.arange(10))

    def requests():
        return [DraftRequest("g", int(ids[0, 10]), 10, SamplingParams(0.0)),
                DraftRequest("s", int(ids[0, 10]), 10, SamplingParams(1.0),
                             CounterGenerator(5))]

    for sparse_top_k in (None, 6):
        whole = model.draft(requests(), sparse_top_k=sparse_top_k)
        for n in (1, 2, GAMMA):
            reqs = requests()
            part = model.draft(reqs, sparse_top_k=sparse_top_k, num_positions=n)
            for w, p in zip(whole, part):
                assert p.gamma == n and torch.equal(p.tokens, w.tokens[:n])
                assert torch.allclose(p.probs, w.probs[:n], atol=1e-6)
                assert torch.allclose(p.confidences, w.confidences[:n], atol=1e-6, equal_nan=True)
                assert (p.indices is None) == (w.indices is None)
                if p.indices is not None:
                    assert torch.equal(p.indices, w.indices[:n])
    for bad in (0, GAMMA + 1):
        with pytest.raises(ValueError, match="num_positions"):
            model.draft(requests(), num_positions=bad)


def test_markov_head_with_zero_w2_is_the_parallel_drafter():
    markov = make_drafter("markov")
    parallel = make_drafter("none", seed=5)
    shared = {k: v for k, v in markov.state_dict().items()
              if not k.startswith(("markov_head", "confidence_head"))}
    parallel.load_state_dict(shared, strict=False)
    parallel.set_target_weights(markov.embed_weight, markov.lm_head_weight)
    ids, feats = sequence()
    anchors = torch.tensor([[3, 8]])
    labels, _ = block_labels(ids, anchors, torch.ones_like(ids, dtype=torch.bool), GAMMA)
    with torch.no_grad():
        biased = markov.forward_train(ids, feats, anchors, labels).draft_logits
        assert not torch.allclose(biased, parallel.forward_train(ids, feats, anchors, labels).draft_logits)
        markov.markov_head.markov_w2.weight.zero_()
        assert torch.allclose(markov.forward_train(ids, feats, anchors, labels).draft_logits,
                              parallel.forward_train(ids, feats, anchors, labels).draft_logits, atol=1e-5)
    for model in (markov, parallel):
        model.append_context("r", feats[0, :8], torch.arange(8))
    reqs = lambda: [DraftRequest("r", int(ids[0, 8]), 8, SamplingParams(1.0),
                                 CounterGenerator(3))]
    a, b = markov.draft(reqs())[0], parallel.draft(reqs())[0]
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.probs, b.probs, atol=1e-5)


def test_fresh_markov_head_starts_from_zero_bias():
    cfg = DrafterConfig.from_target_config(TARGET, block_size=GAMMA, target_layer_ids=[1, 3],
                                           markov_rank=8)
    model = DSparkDrafter(cfg)
    assert float(model.markov_head.markov_w2.weight.detach().abs().max()) == 0.0
    assert float(model.markov_head.markov_w1.weight.detach().abs().max()) > 0.0


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_confidence_of_position_k_ignores_x_k(head):
    model = make_drafter(head)
    ids, feats = sequence()
    labels = torch.tensor([11, 12, 13, 14])
    _, conf = teacher_forced(model, ids, feats, 6, labels)
    for k in range(GAMMA - 1):  # change x_{k+1} (1-based): c_1..c_{k+1} stay, c_{k+2} moves
        changed = labels.clone()
        changed[k] = 30
        _, conf2 = teacher_forced(model, ids, feats, 6, changed)
        assert torch.allclose(conf2[: k + 1], conf[: k + 1], atol=1e-6)
        assert abs(float(conf2[k + 1] - conf[k + 1])) > 1e-4


def test_greedy_is_argmax_of_the_biased_logits():
    model = make_drafter("markov", bias_std=3.0)
    ids, feats = sequence()
    model.append_context("r", feats[0, :9], torch.arange(9))
    block = model.draft([DraftRequest("r", int(ids[0, 9]), 9, SamplingParams(0.0))])[0]
    logits, _ = teacher_forced(model, ids, feats, 9, block.tokens)
    assert torch.equal(block.tokens, logits.argmax(-1))
    assert block.is_sparse and torch.equal(block.indices[:, 0], block.tokens)
    assert torch.equal(block.probs, torch.ones(GAMMA, 1))
    # The sequential head matters: without its bias the argmax path differs somewhere.
    with torch.no_grad():
        base = model.forward_train(ids, feats, torch.tensor([[9]]), block.tokens.view(1, 1, -1))
        model.markov_head.markov_w2.weight.zero_()
        plain = model.forward_train(ids, feats, torch.tensor([[9]]), block.tokens.view(1, 1, -1))
    assert not torch.equal(base.draft_logits.argmax(-1), plain.draft_logits.argmax(-1))


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "sampled a token of probability zero"
    expected = probs[keep].double() * counts.sum()
    big = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs = torch.cat([counts[keep][big].double(), counts[keep][~big].double().sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if float(exp[-1]) < 5:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("sampling,sparse", [
    (SamplingParams(1.0), None),
    (SamplingParams(0.7, top_p=0.8), None),
    (SamplingParams(1.3, top_k=6), None),
    (SamplingParams(1.0), 5),  # drafter-side truncation, shipped sparse
])
def test_tokens_are_distributed_as_the_returned_probs(sampling, sparse):
    """Positions 1 and 2 (conditionally on x_1) against the returned p^d, by chi-square."""
    model = make_drafter("markov", bias_std=1.0)
    ids, feats = sequence()
    model.append_context("r", feats[0, :8], torch.arange(8))
    n = 4000
    blocks = model.draft([DraftRequest("r", int(ids[0, 8]), 8, sampling, CounterGenerator(11 + i))
                          for i in range(n)], sparse_top_k=sparse)
    dense = torch.stack([b.dense(VOCAB) for b in blocks])  # [n, gamma, V]
    tokens = torch.stack([b.tokens for b in blocks])  # [n, gamma]
    # Position 1 has one distribution for every sample.
    assert torch.allclose(dense[:, 0], dense[0, 0].expand(n, -1))
    p1 = _chi2_pvalue(torch.bincount(tokens[:, 0], minlength=VOCAB), dense[0, 0])
    assert p1 > 1e-3, p1
    # Position 2 depends on x_1 (Markov bias): test it within the most frequent x_1 groups.
    values, counts = torch.unique(tokens[:, 0], return_counts=True)
    tested = 0
    for x1 in values[counts.argsort(descending=True)][:2]:
        rows = tokens[:, 0] == x1
        if int(rows.sum()) < 400:
            continue
        group = dense[rows, 1]
        assert torch.allclose(group, group[0].expand_as(group))
        p2 = _chi2_pvalue(torch.bincount(tokens[rows, 1], minlength=VOCAB), group[0])
        assert p2 > 1e-3, p2
        tested += 1
    assert tested >= 1
    # Power: the same counts are far from the distribution without the sequential bias.
    if sparse is None and sampling.top_k == 0 and sampling.top_p == 1.0:
        rows = tokens[:, 0] == values[counts.argmax()]  # the most frequent x_1's samples
        first = tokens[rows][0]
        logits, _ = teacher_forced(model, ids, feats, 8, first)
        wrong = torch.softmax((logits[1] - model.markov_head.markov_w2.weight
                               @ model.markov_head.markov_w1.weight[first[0]]) / sampling.temperature, -1)
        assert _chi2_pvalue(torch.bincount(tokens[rows, 1], minlength=VOCAB), wrong.detach()) < 1e-6


def test_sparse_top_k_is_the_renormalised_truncation():
    model = make_drafter("markov")
    ids, feats = sequence()
    model.append_context("r", feats[0, :8], torch.arange(8))
    block = model.draft([DraftRequest("r", int(ids[0, 8]), 8, SamplingParams(0.9),
                                      CounterGenerator(0))], sparse_top_k=3)[0]
    logits, _ = teacher_forced(model, ids, feats, 8, block.tokens)
    for k in range(GAMMA):
        values, indices = torch.topk(logits[k], 3)
        assert torch.equal(block.indices[k], indices)
        assert torch.allclose(block.probs[k], torch.softmax(values / 0.9, -1), atol=1e-6)
        assert int(block.tokens[k]) in indices.tolist()


def test_reduced_draft_vocabulary_keeps_the_distribution_exact():
    draft_ids = torch.tensor([0, 2, 3, 5, 8, 13, 21, 22, 30, 34, 39])
    model = make_drafter("markov", draft_ids=draft_ids)
    assert model.lm_head_weight.shape == (draft_ids.numel(), HIDDEN)
    assert model.markov_head.markov_w1.weight.shape == (VOCAB, 8)  # indexed by target ids
    assert model.markov_head.markov_w2.weight.shape == (draft_ids.numel(), 8)
    ids, feats = sequence()
    model.append_context("r", feats[0, :8], torch.arange(8))
    gen = CounterGenerator(2)
    blocks = model.draft([DraftRequest("r", int(ids[0, 8]), 8, SamplingParams(1.0), gen),
                          DraftRequest("r", int(ids[0, 8]), 8, SamplingParams(0.8, top_k=4), gen)])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[draft_ids] = False
    for block in blocks:
        assert bool(torch.isin(block.tokens, draft_ids).all())
        dense = block.dense(VOCAB)
        assert float(dense[:, outside].abs().max()) == 0.0
        assert torch.allclose(dense.sum(1), torch.ones(GAMMA))
    # The plain-sampled block is returned over the draft vocabulary as its support, and p^d
    # equals softmax over the draft vocabulary of the teacher-forced logits.
    assert torch.equal(blocks[0].indices, draft_ids.expand(GAMMA, -1))
    logits, _ = teacher_forced(model, ids, feats, 8, blocks[0].tokens)
    assert logits.shape == (GAMMA, draft_ids.numel())
    assert torch.allclose(blocks[0].probs, torch.softmax(logits, -1), atol=1e-6)
    assert torch.allclose(blocks[0].dense(VOCAB)[:, draft_ids], torch.softmax(logits, -1), atol=1e-6)
    assert bool(torch.isin(blocks[1].indices, draft_ids).all())


def test_calibration_temperatures_apply_to_the_confidence_logit():
    model = make_drafter("markov")
    ids, feats = sequence()
    model.append_context("r", feats[0, :8], torch.arange(8))
    req = [DraftRequest("r", int(ids[0, 8]), 8, SamplingParams(0.0))]
    raw = model.draft(req)[0]
    temps = torch.tensor([1.0, 2.0, 0.5, 3.0])
    model.set_confidence_temperatures(temps)
    scaled = model.draft(req)[0]
    logit = torch.log(raw.confidences) - torch.log1p(-raw.confidences)
    assert torch.allclose(scaled.confidences, torch.sigmoid(logit / temps), atol=1e-5)
    biases = torch.tensor([-0.5, 0.0, 1.0, -2.0])
    model.set_confidence_temperatures(temps, biases)
    shifted = model.draft(req)[0]
    assert torch.allclose(shifted.confidences, torch.sigmoid(logit / temps + biases), atol=1e-5)


def test_each_request_gets_the_calibration_of_its_sampling_temperature():
    model = make_drafter("markov")
    ids, feats = sequence()
    model.append_context("g", feats[0, :8], torch.arange(8))
    model.append_context("s", feats[0, :8], torch.arange(8))
    def reqs():  # the sampled request draws the same tokens each call (confidences k >= 2 see them)
        return [DraftRequest("g", int(ids[0, 8]), 8, SamplingParams(0.0)),
                DraftRequest("s", int(ids[0, 8]), 8, SamplingParams(0.9),
                             generator=CounterGenerator(3))]

    raw = model.draft(reqs())
    greedy_fit = STSCalibration([1.0, 2.0, 0.5, 3.0], [0.5, 0.0, -1.0, 0.2], sampling_temperature=0.0)
    t1_fit = STSCalibration([2.0, 1.0, 1.5, 0.7], [-0.3, 1.0, 0.0, 0.0], sampling_temperature=1.0)
    model.set_confidence_calibration(CalibrationSet([t1_fit, greedy_fit]))
    calibrated = model.draft(reqs())
    for block, raw_block, fit in zip(calibrated, raw, (greedy_fit, t1_fit)):
        assert torch.equal(block.tokens, raw_block.tokens)
        expected = torch.as_tensor(fit.apply(raw_block.confidences.double().numpy()), dtype=torch.float32)
        assert torch.allclose(block.confidences, expected, atol=1e-5)
    with pytest.raises(ValueError, match="gamma"):
        model.set_confidence_calibration(CalibrationSet([STSCalibration([1.0])]))


def test_draft_block_helpers():
    g = torch.Generator().manual_seed(0)
    dense = DraftBlock.dummy(5, 12, generator=g)
    sparse = DraftBlock.dummy(5, 12, sparse_k=4, generator=g)
    for block in (dense, sparse):
        full = block.dense(12)
        assert torch.allclose(full.sum(1), torch.ones(5))
        assert torch.allclose(block.token_probs(), full.gather(1, block.tokens.view(-1, 1)).squeeze(1))
    with pytest.raises(AssertionError):
        DraftBlock(torch.zeros(3, dtype=torch.int64), torch.ones(2, 4), torch.zeros(3))


def test_config_validation():
    with pytest.raises(ValueError):
        DrafterConfig.from_target_config(TARGET, target_layer_ids=[3, 1])
    with pytest.raises(ValueError):
        DrafterConfig.from_target_config(TARGET, target_layer_ids=[1], markov_head_type="none",
                                         markov_rank=4)
    with pytest.raises(ValueError):
        DrafterConfig.from_target_config(TARGET, target_layer_ids=[9])
    cfg = DrafterConfig.from_target_config(TARGET, target_layer_ids=[1], markov_head_type="none")
    assert cfg.markov_head_type == SequentialHead.NONE and cfg.confidence_input_size == HIDDEN


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN")
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_packed_for_inference_drafts_the_same_blocks(head):
    """pack_for_inference (oneDNN products, float32 CPU) changes rounding only: same greedy
    tokens, the same sampled tokens from the same seed, probabilities and confidences to 1e-5."""
    draft_ids = torch.tensor([0, 2, 3, 5, 8, 13, 21, 22, 30, 34, 39])
    models = [make_drafter(head, draft_ids=draft_ids, bias_std=3.0) for _ in range(2)]
    models[1].pack_for_inference()
    assert models[1].packed_lm_head is not None
    for layer in models[1].layers:  # q/k/v and gate/up as one product each
        assert layer.self_attn.qkv_packed is not None and layer.mlp.gate_up_packed is not None
    if head == "markov":  # each position's bias added by one float32 addmm
        assert models[1].markov_head.w2_t is not None and models[0].markov_head.w2_t is None
    ids, feats = sequence()
    blocks = []
    for model in models:
        model.append_context("r", feats[0, :9], torch.arange(9))
        requests = [DraftRequest("r", int(ids[0, 9]), 9, SamplingParams(0.0)),
                    DraftRequest("r", int(ids[0, 9]), 9, SamplingParams(1.0),
                                 CounterGenerator(5))]
        with torch.inference_mode():
            blocks.append(model.draft(requests))
    for plain, packed in zip(*blocks):
        assert torch.equal(plain.tokens, packed.tokens)
        torch.testing.assert_close(plain.dense(VOCAB), packed.dense(VOCAB), rtol=0, atol=1e-5)
        torch.testing.assert_close(plain.confidences, packed.confidences, rtol=0, atol=1e-5)


def test_last_context_injection_adds_the_fused_state_at_anchor_minus_one():
    """inject_last_context: the block input is embed(block) + H_ctx[a - 1] (recomputed by hand
    here); the flag changes the outputs of the same weights, and round-trips through config.json
    (absent = DeepSpec's backbone)."""
    plain, injected = make_drafter("none"), make_drafter("none", inject=True)
    injected.load_state_dict(plain.state_dict())  # the same weights: the flag is the difference
    ids, feats = sequence()
    T, anchor = ids.shape[1], 8
    anchors = torch.tensor([[anchor]])
    labels, _ = block_labels(ids, anchors, torch.ones_like(ids, dtype=torch.bool), GAMMA)
    with torch.no_grad():
        out = injected.forward_train(ids, feats, anchors, labels).draft_logits[0, 0]  # [gamma, V]
        out_plain = plain.forward_train(ids, feats, anchors, labels).draft_logits[0, 0]
        block_ids = torch.tensor([[int(ids[0, anchor])] + [3] * (GAMMA - 1)])
        h_ctx = injected.fuse_context(feats)  # [1, T, hidden]
        embeds = torch.nn.functional.embedding(block_ids, injected.embed_weight)
        hn = injected.backbone(embeds + h_ctx[:, anchor - 1: anchor],
                               torch.arange(anchor, anchor + GAMMA).unsqueeze(0),
                               *injected.context_kv(feats, torch.arange(T).unsqueeze(0)),
                               training_mask(anchors, T, GAMMA))
        assert torch.allclose(out, injected.base_logits(hn)[0], atol=1e-5)
        assert not torch.allclose(out, out_plain, atol=1e-3)
    assert DrafterConfig.from_json_dict(injected.config.to_json_dict()).inject_last_context
    assert "inject_last_context" not in plain.config.to_json_dict()
    assert not DrafterConfig.from_json_dict(plain.config.to_json_dict()).inject_last_context
