"""Drafter checkpoints in DeepSpec's format: round trip, and a hand-written checkpoint that loads
and computes what DeepSpec's Qwen3DSparkModel computes (checked by an independent reference)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dspark.models.draft_types import DraftRequest
from dspark.models.drafter import DSparkDrafter
from dspark.models.drafter_config import DrafterConfig, SequentialHead
from dspark.models.drafter_io import load_drafter, read_checkpoint, save_drafter
from dspark.random_draws import CounterGenerator
from dspark.sampling import SamplingParams

V, D, HEADS, KV, HD, INTER, R, GAMMA = 24, 16, 4, 2, 8, 40, 6, 3
LAYERS, TARGET_LAYERS = 2, [0, 2]

QWEN3_TARGET = {  # the shape of a Qwen3 config.json, shrunk
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V,
    "hidden_size": D, "intermediate_size": INTER, "num_hidden_layers": 4,
    "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "attention_bias": False,
    "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


def deepspec_tensors(g: torch.Generator, markov_rank: int = R, rnn: bool = False,
                     confidence_with_markov: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a DeepSpec Qwen3DSparkModel checkpoint, by name, written out by hand."""
    rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.3
    t = {"fc.weight": rnd(D, len(TARGET_LAYERS) * D), "hidden_norm.weight": 1 + rnd(D),
         "norm.weight": 1 + rnd(D), "embed_tokens.weight": rnd(V, D) * 3,
         "lm_head.weight": rnd(V, D)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rnd(HEADS * HD, D)
        t[p + "self_attn.k_proj.weight"] = rnd(KV * HD, D)
        t[p + "self_attn.v_proj.weight"] = rnd(KV * HD, D)
        t[p + "self_attn.o_proj.weight"] = rnd(D, HEADS * HD)
        t[p + "self_attn.q_norm.weight"] = 1 + rnd(HD)
        t[p + "self_attn.k_norm.weight"] = 1 + rnd(HD)
        t[p + "mlp.gate_proj.weight"] = rnd(INTER, D)
        t[p + "mlp.up_proj.weight"] = rnd(INTER, D)
        t[p + "mlp.down_proj.weight"] = rnd(D, INTER)
        t[p + "input_layernorm.weight"] = 1 + rnd(D)
        t[p + "post_attention_layernorm.weight"] = 1 + rnd(D)
    if markov_rank:
        t["markov_head.markov_w1.weight"] = rnd(V, markov_rank)
        t["markov_head.markov_w2.weight"] = rnd(V, markov_rank) * 3
        if rnn:
            t["markov_head.joint_proj.weight"] = rnd(3 * markov_rank, 2 * markov_rank + D)
            t["markov_head.joint_proj.bias"] = rnd(3 * markov_rank)
    conf_in = D + (markov_rank if confidence_with_markov and markov_rank else 0)
    t["confidence_head.proj.weight"] = rnd(1, conf_in)
    t["confidence_head.proj.bias"] = rnd(1)
    return t


def write_deepspec_checkpoint(folder, tensors, markov_rank=R, head="vanilla",
                              confidence_with_markov=True) -> None:
    config = dict(QWEN3_TARGET)  # DeepSpec: deepcopy of the target's config + drafter fields
    config.update({
        "architectures": ["Qwen3DSparkModel"], "num_target_layers": 4,
        "num_hidden_layers": LAYERS, "block_size": GAMMA, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * LAYERS, "mask_token_id": 5,
        "target_layer_ids": TARGET_LAYERS, "num_anchors": 512, "enable_confidence_head": True,
        "confidence_head_with_markov": confidence_with_markov, "markov_rank": markov_rank,
    })
    if markov_rank:
        config["markov_head_type"] = head
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})


# ---- an independent reference of DeepSpec's forward, from the raw tensors -------------------------


def _rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=1000000.0):
    """x [n, heads, hd] at positions [n]: pairs (i, i + hd/2) rotated by pos * theta^(-2i/hd)."""
    half = x.shape[-1] // 2
    angle = pos.double().view(-1, 1, 1) * theta ** (-torch.arange(half).double() * 2 / x.shape[-1])
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)


def reference_block(t, features, anchor_token, anchor_pos, prev_tokens, mask_token=5, rnn=False):
    """Logits [gamma, V] and confidence logits [gamma] of one block, straight from the tensors."""
    t = {k: v.double() for k, v in t.items()}
    L = features.shape[0]
    h_ctx = _rms(features.double() @ t["fc.weight"].T, t["hidden_norm.weight"])  # [L, D]
    x = t["embed_tokens.weight"][[anchor_token] + [mask_token] * (GAMMA - 1)]  # [gamma, D]
    ctx_pos = torch.arange(L)
    blk_pos = torch.arange(anchor_pos, anchor_pos + GAMMA)
    for i in range(LAYERS):
        p = f"layers.{i}."
        hn = _rms(x, t[p + "input_layernorm.weight"])
        q = _rope(_rms((hn @ t[p + "self_attn.q_proj.weight"].T).view(GAMMA, HEADS, HD),
                       t[p + "self_attn.q_norm.weight"]), blk_pos)
        kv_in = torch.cat([h_ctx, hn])  # context keys come from H_ctx, block keys from h
        k = _rope(_rms((kv_in @ t[p + "self_attn.k_proj.weight"].T).view(-1, KV, HD),
                       t[p + "self_attn.k_norm.weight"]), torch.cat([ctx_pos, blk_pos]))
        v = (kv_in @ t[p + "self_attn.v_proj.weight"].T).view(-1, KV, HD)
        out = torch.zeros(GAMMA, HEADS, HD, dtype=torch.float64)
        for h in range(HEADS):
            kvh = h // (HEADS // KV)
            scores = q[:, h] @ k[:, kvh].T / HD ** 0.5  # [gamma, L + gamma]
            scores[:, :L][:, ctx_pos >= anchor_pos] = float("-inf")
            out[:, h] = torch.softmax(scores, -1) @ v[:, kvh]
        x = x + out.reshape(GAMMA, HEADS * HD) @ t[p + "self_attn.o_proj.weight"].T
        hn = _rms(x, t[p + "post_attention_layernorm.weight"])
        gate = hn @ t[p + "mlp.gate_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * (hn @ t[p + "mlp.up_proj.weight"].T)) @ t[
            p + "mlp.down_proj.weight"].T
    hn = _rms(x, t["norm.weight"])
    logits = hn @ t["lm_head.weight"].T
    prev = torch.tensor([anchor_token] + list(prev_tokens[:-1]))
    conf_in = hn
    if "markov_head.markov_w1.weight" in t:
        w1 = t["markov_head.markov_w1.weight"][prev]  # [gamma, r]
        if rnn:
            s = torch.zeros(R, dtype=torch.float64)
            bias = []
            for k in range(GAMMA):
                z = torch.cat([s, w1[k], hn[k]])
                gr, cr, orr = (t["markov_head.joint_proj.weight"] @ z
                               + t["markov_head.joint_proj.bias"]).chunk(3)
                s = torch.sigmoid(gr) * s + (1 - torch.sigmoid(gr)) * torch.tanh(cr)
                bias.append(t["markov_head.markov_w2.weight"] @ torch.tanh(orr))
            logits = logits + torch.stack(bias)
        else:
            logits = logits + w1 @ t["markov_head.markov_w2.weight"].T
        conf_in = torch.cat([hn, w1], -1)
    conf = conf_in @ t["confidence_head.proj.weight"][0] + t["confidence_head.proj.bias"]
    return logits, conf


@pytest.mark.parametrize("head", ["vanilla", "rnn", "none"])
def test_hand_written_deepspec_checkpoint_loads_and_matches_reference(tmp_path, head):
    g = torch.Generator().manual_seed(0)
    rank = 0 if head == "none" else R
    tensors = deepspec_tensors(g, markov_rank=rank, rnn=head == "rnn",
                               confidence_with_markov=head != "none")
    tensors = {k: v.to(torch.bfloat16).float() for k, v in tensors.items()}  # as stored
    write_deepspec_checkpoint(tmp_path / "ckpt", tensors, markov_rank=rank, head=head,
                              confidence_with_markov=head != "none")
    model = load_drafter(tmp_path / "ckpt")  # no target weights given: the checkpoint's copies
    cfg = model.config
    assert cfg.markov_head_type == {"vanilla": SequentialHead.MARKOV, "rnn": SequentialHead.RNN,
                                    "none": SequentialHead.NONE}[head]
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (GAMMA, 5, TARGET_LAYERS)
    assert cfg.rope_theta == 1000000.0 and cfg.extra["model_type"] == "qwen3"
    for name, value in model.state_dict().items():
        assert torch.equal(value, tensors[name]), name

    features = torch.randn(9, len(TARGET_LAYERS) * D, generator=g)
    model.append_context("r", features[:4], torch.arange(4))
    model.append_context("r", features[4:], torch.arange(4, 9))  # positions 7, 8 are masked
    block = model.draft([DraftRequest("r", 11, 7, SamplingParams(1.0),
                                      CounterGenerator(1))])[0]
    logits, conf = reference_block(tensors, features, 11, 7, block.tokens.tolist(), rnn=head == "rnn")
    assert torch.allclose(block.probs.double(), torch.softmax(logits, -1), atol=1e-5)
    assert torch.allclose(block.confidences.double(), torch.sigmoid(conf), atol=1e-5)


def test_mismatched_checkpoint_is_refused(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = deepspec_tensors(g)
    tensors["layers.0.self_attn.extra_gate.weight"] = torch.zeros(3)
    write_deepspec_checkpoint(tmp_path / "a", tensors)
    with pytest.raises(ValueError, match="unexpected"):
        load_drafter(tmp_path / "a")
    tensors = deepspec_tensors(g)
    del tensors["norm.weight"]
    write_deepspec_checkpoint(tmp_path / "b", tensors)
    with pytest.raises(ValueError, match="missing"):
        load_drafter(tmp_path / "b")
    write_deepspec_checkpoint(tmp_path / "c", deepspec_tensors(g), head="gated")
    with pytest.raises(ValueError, match="markov_head_type"):
        load_drafter(tmp_path / "c")


def _our_drafter(head="markov", draft_ids=None) -> DSparkDrafter:
    cfg = DrafterConfig.from_target_config(
        QWEN3_TARGET, num_hidden_layers=LAYERS, block_size=GAMMA, mask_token_id=5,
        target_layer_ids=TARGET_LAYERS, markov_head_type=head,
        markov_rank=0 if head == "none" else R,
        draft_vocab_size=None if draft_ids is None else draft_ids.numel())
    torch.manual_seed(0)
    model = DSparkDrafter(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.set_target_weights(torch.randn(V, D), torch.randn(V, D), draft_ids)
    return model


@pytest.mark.parametrize("head,reduced", [("markov", False), ("rnn", False), ("none", False),
                                          ("markov", True)])
def test_round_trip(tmp_path, head, reduced):
    draft_ids = torch.tensor([1, 2, 4, 7, 11, 16, 22]) if reduced else None
    model = _our_drafter(head, draft_ids)
    save_drafter(model, tmp_path)
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["architectures"] == ["Qwen3DSparkModel"]
    for key in ("block_size", "mask_token_id", "target_layer_ids", "markov_rank",
                "markov_head_type", "num_hidden_layers", "enable_confidence_head"):
        assert key in config_json, key
    assert config_json["markov_head_type"] == {"markov": "vanilla", "rnn": "rnn", "none": "none"}[head]
    assert config_json["model_type"] == "qwen3" and config_json["eos_token_id"] == 2
    _, tensors = read_checkpoint(tmp_path)
    assert "embed_tokens.weight" not in tensors and "lm_head.weight" not in tensors
    if reduced:
        assert torch.equal(tensors["d2t"] + torch.arange(7), draft_ids)
        assert int(tensors["t2d"].sum()) == 7
    # The drafter takes the draft-vocabulary rows of the target's full LM head.
    lm_head = _full_lm_head(model, draft_ids) if reduced else model.lm_head_weight
    loaded = load_drafter(tmp_path, model.embed_weight, lm_head)
    assert DrafterConfig.from_json_dict(config_json) == loaded.config
    for name, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    features = torch.randn(6, len(TARGET_LAYERS) * D)
    for m in (model, loaded):
        m.append_context("r", features, torch.arange(6))
    reqs = lambda: [DraftRequest("r", 3, 6, SamplingParams(1.0), CounterGenerator(4))]
    a, b = model.draft(reqs())[0], loaded.draft(reqs())[0]
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.probs, b.probs)


def _full_lm_head(model, draft_ids):
    full = torch.zeros(V, D)
    full[draft_ids] = model.lm_head_weight
    return full


def test_bfloat16_save_halves_the_file(tmp_path):
    model = _our_drafter()
    save_drafter(model, tmp_path / "f32")
    save_drafter(model, tmp_path / "bf16", dtype=torch.bfloat16)
    small = (tmp_path / "bf16" / "model.safetensors").stat().st_size
    big = (tmp_path / "f32" / "model.safetensors").stat().st_size
    assert small < 0.6 * big
    loaded = load_drafter(tmp_path / "bf16", model.embed_weight, model.lm_head_weight)
    w = model.state_dict()["fc.weight"]
    assert torch.allclose(loaded.state_dict()["fc.weight"], w, rtol=1e-2, atol=1e-3)
