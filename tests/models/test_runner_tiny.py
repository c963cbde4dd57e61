"""TargetRunner against transformers on tiny random Llama / Qwen2 / Qwen3 models (fp32, CPU).

The reference is a plain transformers forward over each request's whole sequence (no cache):
our logits for any new token must equal its logits there (max abs diff <= TOL, same argmax),
whatever mix of prefill, decode, chunking, truncation and request interleaving produced them.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from dspark.models.kv_cache import KVCacheFull
from dspark.models.packed_linear import packing_available
from dspark.models.runner import ForwardItem, RunnerConfig, TargetRunner, generate_greedy
from dspark.models.transformer import AttentionImpl

TOL = 1e-4  # max abs logit difference held (observed: ~3e-7 in fp32)
VOCAB = 151
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=112, max_position_embeddings=512)

MODELS = {
    # Llama with llama3 rope scaling and GQA, separate LM head.
    "llama": (LlamaForCausalLM, LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Llama with tied embeddings and linear rope scaling (SmolLM2-like head).
    "llama_tied": (LlamaForCausalLM, LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**COMMON, tie_word_embeddings=False)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny(request, tmp_path_factory):
    """(transformers model, folder) of a tiny random model saved in Hugging Face format."""
    model_cls, config = MODELS[request.param]
    torch.manual_seed(1234)
    model = model_cls(config).eval()
    with torch.no_grad():  # random init leaves RMSNorm weights at 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


EMULATED = (AttentionImpl.FLEX, AttentionImpl.TRITON)
"""GPU attentions that run emulated on a CPU (FlexAttention's dense reference, Triton's
interpreter: seconds a test), checked on the SmolLM2-like model and Qwen3 (q/k norms, head_dim 32)."""


@pytest.fixture(autouse=True)
def emulated_attention_on_two_models(request):
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("impl") in EMULATED and \
            params.params.get("tiny") not in ("llama_tied", "qwen3"):
        pytest.skip("emulated GPU attention: checked on llama_tied and qwen3")


def make_runner(folder, **kwargs) -> TargetRunner:
    defaults = dict(block_size=4, kv_cache_tokens=512, max_tokens_per_pass=64)
    return TargetRunner(folder, RunnerConfig(**{**defaults, **kwargs}))


def reference(model, token_ids: list[int]):
    """transformers logits [len, vocab] and hidden states (tuple of [len, hidden]) of a whole sequence."""
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    return out.logits[0].float(), [h[0] for h in out.hidden_states]


def assert_logits_match(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    assert ours.numel() == 0 or (ours - theirs).abs().max().item() <= TOL
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("impl", list(AttentionImpl))
def test_prefill_all_positions(tiny, impl):
    model, folder = tiny
    runner = make_runner(folder, attention=impl)
    prompt = random_tokens(37, seed=1)
    runner.add_request("a")
    out = runner.forward([ForwardItem("a", prompt, logits_from=0)])
    assert out.logit_counts == [37] and runner.length("a") == 37
    assert_logits_match(out.logits, reference(model, prompt)[0])


def test_chunked_prefill_equals_one_pass(tiny):
    model, folder = tiny
    prompt = random_tokens(50, seed=2)
    runner = make_runner(folder, max_tokens_per_pass=16)  # 50 tokens -> 4 passes
    runner.add_request("a")
    out = runner.forward([ForwardItem("a", prompt, logits_from=0)])
    assert_logits_match(out.logits, reference(model, prompt)[0])
    # Only the last row asked (a prefill): the last row of the reference.
    runner.add_request("b")
    last = runner.forward([ForwardItem("b", prompt)])
    assert last.logit_counts == [1]
    assert_logits_match(last.logits, reference(model, prompt)[0][-1:])


@pytest.mark.parametrize("impl", list(AttentionImpl))
def test_single_token_decode(tiny, impl):
    model, folder = tiny
    runner = make_runner(folder, attention=impl)
    seq = random_tokens(12, seed=3)
    runner.add_request("a")
    runner.forward([ForwardItem("a", seq)])
    decoded = []
    for step in range(6):  # crosses block boundaries (block_size 4)
        tok = random_tokens(1, seed=100 + step)
        seq = seq + tok
        decoded.append(runner.forward([ForwardItem("a", tok)]).logits)
    ref = reference(model, seq)[0]
    assert_logits_match(torch.cat(decoded), ref[-6:])


@pytest.mark.parametrize("impl", list(AttentionImpl))
def test_mixed_batch(tiny, impl):
    """Requests with different context lengths and new-token counts in one forward, one of them
    a fresh prefill, one asking for no logits at all."""
    model, folder = tiny
    runner = make_runner(folder, attention=impl, max_tokens_per_pass=24)
    contexts = {"a": random_tokens(5, 10), "b": random_tokens(30, 11), "c": random_tokens(17, 12)}
    for rid, ctx in contexts.items():
        runner.add_request(rid)
        runner.forward([ForwardItem(rid, ctx)])
    new = {"a": random_tokens(1, 20), "b": random_tokens(8, 21), "c": random_tokens(3, 22),
           "d": random_tokens(26, 23)}
    runner.add_request("d")
    items = [ForwardItem("b", new["b"], logits_from=0), ForwardItem("d", new["d"], logits_from=20),
             ForwardItem("a", new["a"], logits_from=0), ForwardItem("c", new["c"], logits_from=3)]
    out = runner.forward(items)  # 38 tokens with max 24 per pass: chunked across two passes
    assert out.logit_counts == [8, 6, 1, 0]
    for index, it in enumerate(items):
        full = contexts.get(it.request_id, []) + new[it.request_id]
        ref = reference(model, full)[0][len(full) - len(it.token_ids) + it.first_logit:]
        assert_logits_match(out.logits_of(index), ref)
        assert runner.length(it.request_id) == len(full)


@pytest.mark.parametrize("impl", list(AttentionImpl))
def test_truncate_then_extend(tiny, impl):
    """Verification rejects drafts: truncate back, then the request continues as if they never were."""
    model, folder = tiny
    runner = make_runner(folder, attention=impl)
    prompt, drafts, accepted_then = random_tokens(14, 30), random_tokens(7, 31), random_tokens(4, 32)
    runner.add_request("a")
    runner.add_request("b")
    runner.forward([ForwardItem("a", prompt), ForwardItem("b", random_tokens(9, 33))])
    free_before = runner.num_free_blocks
    runner.forward([ForwardItem("a", drafts, logits_from=0)])  # 14 + 7 = 21 tokens: 6 blocks
    runner.truncate("a", 16)  # keep 2 drafts: 16 tokens = 4 blocks
    assert runner.length("a") == 16
    assert runner.num_free_blocks == free_before  # 14 and 16 tokens both take 4 blocks
    out = runner.forward([ForwardItem("a", accepted_then, logits_from=0)])
    seq = prompt + drafts[:2] + accepted_then
    assert_logits_match(out.logits, reference(model, seq)[0][-4:])


@pytest.mark.parametrize("impl", list(AttentionImpl))
def test_scattered_blocks(tiny, impl):
    """Requests whose blocks are not consecutive (fragmented cache) read their context by gathering."""
    model, folder = tiny
    runner = make_runner(folder, attention=impl, kv_cache_tokens=128)  # 32 blocks of 4
    manager = runner.cache.manager
    for i in range(32):  # fill every block, then free every other one
        runner.add_request(("filler", i))
        runner.forward([ForwardItem(("filler", i), [1])])
    for i in range(0, 32, 2):
        runner.free(("filler", i))
    seqs = {"a": random_tokens(13, 40), "b": random_tokens(9, 41)}
    for rid in seqs:
        runner.add_request(rid)
    out = runner.forward([ForwardItem(rid, s, logits_from=0) for rid, s in seqs.items()])
    assert manager.contiguous_start("a", 13) is None  # really scattered
    for index, s in enumerate(seqs.values()):
        assert_logits_match(out.logits_of(index), reference(model, s)[0])


def test_in_place_and_gathered_contexts_in_one_forward(tiny):
    """One forward whose requests read their contexts both ways (in place and gathered), each
    with one new token (the decode path) or several (the verification path)."""
    model, folder = tiny
    runner = make_runner(folder, kv_cache_tokens=128)  # 32 blocks of 4
    manager = runner.cache.manager
    seqs = {"c": random_tokens(10, 52), "d": random_tokens(6, 53)}
    for rid in ("c", "d"):  # an empty cache: consecutive blocks
        runner.add_request(rid)
        runner.forward([ForwardItem(rid, seqs[rid])])
    fillers = [("filler", i) for i in range(manager.num_free_blocks)]
    for rid in fillers:  # fill every other block, then free every other filler: scattered blocks
        runner.add_request(rid)
        runner.forward([ForwardItem(rid, [1])])
    for rid in fillers[::2]:
        runner.free(rid)
    seqs |= {"a": random_tokens(13, 50), "b": random_tokens(9, 51)}
    for rid in ("a", "b"):
        runner.add_request(rid)
        runner.forward([ForwardItem(rid, seqs[rid])])
    new = {"a": random_tokens(1, 60), "b": random_tokens(3, 61), "c": random_tokens(1, 62),
           "d": random_tokens(2, 63)}
    out = runner.forward([ForwardItem(rid, new[rid], logits_from=0) for rid in new])
    full = {rid: seqs[rid] + new[rid] for rid in new}
    in_place = {rid: manager.contiguous_start(rid, len(full[rid])) is not None for rid in new}
    assert in_place == {"a": False, "b": False, "c": True, "d": True}
    for index, rid in enumerate(new):
        assert_logits_match(out.logits_of(index), reference(model, full[rid])[0][-len(new[rid]):])


def test_hidden_states_match_output_hidden_states(tiny):
    model, folder = tiny
    num_layers = model.config.num_hidden_layers
    runner = make_runner(folder, hidden_layer_ids=(0, 1, num_layers - 1), max_tokens_per_pass=8)
    seqs = {"a": random_tokens(11, 50), "b": random_tokens(6, 51)}
    runner.add_request("a")
    runner.forward([ForwardItem("a", seqs["a"][:4])])  # part of a is cached already
    runner.add_request("b")
    out = runner.forward([ForwardItem("a", seqs["a"][4:]), ForwardItem("b", seqs["b"])])
    assert out.hidden.shape == (7 + 6, 3, model.config.hidden_size)
    assert out.hidden_counts == [7, 6]
    for index, (rid, s) in enumerate(seqs.items()):
        _, hs = reference(model, s)
        new = len(s) - out.hidden_counts[index]
        ours = out.hidden_of(index)
        # Layer i's output is transformers' hidden_states[i + 1] ...
        for col, layer in enumerate((0, 1)):
            assert (ours[:, col] - hs[layer + 1][new:]).abs().max().item() <= TOL
        # ... except after the last layer, where transformers reports it after the final norm.
        assert (model.model.norm(ours[:, 2]) - hs[num_layers][new:]).abs().max().item() <= TOL
        # compute_logits is the final norm + LM head of a layer output.
        assert_logits_match(runner.compute_logits(ours[-1:, 2]), reference(model, s)[0][-1:])


def test_no_hidden_without_layer_ids(tiny):
    _, folder = tiny
    runner = make_runner(folder)
    runner.add_request("a")
    out = runner.forward([ForwardItem("a", random_tokens(5, 60))])
    assert out.hidden is None and out.hidden_counts == [5]


def test_kv_cache_full_leaves_runner_usable(tiny):
    model, folder = tiny
    runner = make_runner(folder, kv_cache_tokens=32)  # 8 blocks of 4
    seq = random_tokens(20, 70)
    runner.add_request("a")
    runner.add_request("b")
    runner.forward([ForwardItem("a", seq[:10])])  # 3 blocks
    free = runner.num_free_blocks
    with pytest.raises(KVCacheFull):  # a: +10 -> 5 blocks (2 more), b: 14 -> 4 blocks: 6 > 5 free
        runner.forward([ForwardItem("a", seq[10:]), ForwardItem("b", random_tokens(14, 71))])
    assert runner.length("a") == 10 and runner.length("b") == 0 and runner.num_free_blocks == free
    out = runner.forward([ForwardItem("a", seq[10:], logits_from=0)])
    assert_logits_match(out.logits, reference(model, seq)[0][10:])


def test_forward_rejects_bad_items(tiny):
    _, folder = tiny
    runner = make_runner(folder)
    runner.add_request("a")
    with pytest.raises(ValueError):
        runner.forward([ForwardItem("a", [1]), ForwardItem("a", [2])])
    with pytest.raises(KeyError):
        runner.forward([ForwardItem("nope", [1])])
    with pytest.raises(ValueError):
        runner.forward([ForwardItem("a", [1, 2], logits_from=3)])
    assert runner.length("a") == 0


def test_generate_greedy_matches_transformers(tiny):
    model, folder = tiny
    runner = make_runner(folder)
    prompts = [random_tokens(n, 80 + n) for n in (3, 17, 9)]
    ours = generate_greedy(runner, prompts, max_new_tokens=12)
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist()
    assert runner.num_free_blocks == runner.cache.manager.num_blocks  # streams freed


def test_generate_greedy_stops_on_stop_token(tiny):
    _, folder = tiny
    runner = make_runner(folder)
    prompt = random_tokens(8, 90)
    free_run = generate_greedy(runner, [prompt], max_new_tokens=10)[0]
    stop = free_run[4]
    stopped = generate_greedy(runner, [prompt], max_new_tokens=10, stop_token_ids=[stop])[0]
    assert stopped == free_run[:free_run.index(stop) + 1]


def test_bf16_runner_close_to_fp32_reference(tiny):
    """bf16 weights (with the CPU float32 upcast for multi-row products, without it, and packed
    for oneDNN where this CPU supports bf16) stay within bf16 rounding of the fp32 reference; the
    bf16 paths agree with each other."""
    model, folder = tiny
    seq = random_tokens(20, 95)
    ref = reference(model, seq)[0]
    outs = []
    paths = [dict(cpu_upcast_min_rows=2, cpu_packed_weights=False),
             dict(cpu_upcast_min_rows=None, cpu_packed_weights=False)]
    if packing_available("cpu", torch.bfloat16):
        paths.append(dict(cpu_packed_weights=True))
    for path in paths:
        runner = make_runner(folder, dtype="bfloat16", **path)
        runner.add_request("a")
        out = runner.forward([ForwardItem("a", seq[:12], logits_from=0)]).logits
        out = torch.cat([out, runner.forward([ForwardItem("a", seq[12:], logits_from=0)]).logits])
        assert out.dtype == torch.float32
        outs.append(out)
        scale = ref.abs().max().item()
        assert (out - ref).abs().max().item() <= 0.02 * scale  # observed <= 0.009 * scale
    for other in outs[1:]:
        assert (outs[0] - other).abs().max().item() <= 0.02 * ref.abs().max().item()


def test_dspark_attention_names_the_default_implementation(tiny, monkeypatch):
    _, folder = tiny
    monkeypatch.setenv("DSPARK_ATTENTION", "per_request")
    assert make_runner(folder).attention is AttentionImpl.PER_REQUEST
    assert make_runner(folder, attention=AttentionImpl.PADDED).attention is AttentionImpl.PADDED
    monkeypatch.setenv("DSPARK_ATTENTION", "flash")
    with pytest.raises(ValueError, match="DSPARK_ATTENTION='flash': expected one of paged"):
        make_runner(folder)



def test_fused_attention_step_gives_the_bits_of_the_separate_steps(tiny, monkeypatch):
    """PAGED attention on float32 runs RoPE + K/V write + attention as one kernel call
    (`rope_write_attention`); the same runner on the separate steps (`Attention.fused_step`
    off) gives the same logits bits, for prefill (its long queries go the separate way),
    decode steps and a verification block beside a decode step."""
    from dspark.models import paged_attention as pa
    from dspark.models import transformer

    if not pa.cpu_kernel_available():
        pytest.skip("no C++ compiler for the CPU kernel")
    model, folder = tiny
    calls = []
    real = transformer.rope_write_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def run() -> list[torch.Tensor]:
        runner = make_runner(folder, attention=AttentionImpl.PAGED)
        outs = []
        for r, n in (("a", 37), ("b", 9)):
            runner.add_request(r)
            outs.append(runner.forward([ForwardItem(r, random_tokens(n, seed=n), logits_from=0)]).logits)
        for step in range(5):
            outs.append(runner.forward([ForwardItem("a", random_tokens(1, seed=200 + step)),
                                        ForwardItem("b", random_tokens(1, seed=300 + step))]).logits)
        outs.append(runner.forward([ForwardItem("a", random_tokens(8, seed=7), logits_from=0),
                                    ForwardItem("b", random_tokens(1, seed=8))]).logits)
        return outs

    monkeypatch.setattr(transformer, "rope_write_attention", counted)
    fused = run()
    assert bool(calls) == (not model.config.model_type == "qwen3")  # q/k norms keep the separate steps
    monkeypatch.setattr(transformer.Attention, "fused_step", False)
    calls.clear()
    separate = run()
    assert not calls
    for a, b in zip(fused, separate, strict=True):
        assert torch.equal(a, b)
