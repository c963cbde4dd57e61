"""OpenAI `logprobs` through the real services stack (scheduler, remote drafter and verifier,
speculation on): the reported values are the target's log_softmax at each output position,
checked against transformers' forward over prompt + output on the same tiny weights, for greedy
and sampled requests, streamed and not, on completions, chat completions and gRPC; bad values
are a 400 naming the field."""

from __future__ import annotations

import grpc
import openai
import pytest
import torch

from dspark.serving.grpc_runtime import channel
from dspark.serving.protos import pb, rpc

PROMPT = [3, 9, 27, 17]
CHAT = [{"role": "user", "content": "t11 t12 t13"}]
CHAT_PROMPT = [1, 11, 12, 13, 2, 3]  # the tiny chat template: t1 <content> t2 t3


@pytest.fixture(scope="module")
def target(stack):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(stack.models.target_dir).eval()


def reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] transformers' log_softmax at each output position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


def check(model, prompt, output, values, top_ids=None, top_values=None) -> None:
    ref = reference(model, prompt, output)
    expected = ref.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(values), expected, atol=1e-4, rtol=1e-4)
    if top_ids is not None:
        k = len(top_ids[0])
        torch.testing.assert_close(torch.tensor(top_values), torch.topk(ref, k).values,
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ref.gather(1, torch.tensor(top_ids)), torch.tensor(top_values),
                                   atol=1e-4, rtol=1e-4)


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=stack.api_key,
                         max_retries=0, timeout=60)


def token_id(text: str) -> int:
    """The tiny word-level tokenizer: "t<i>" is token i."""
    return int(text.removeprefix("t"))


def test_completion_logprobs_greedy(stack, target):
    out = client(stack).completions.create(model="tiny", prompt=PROMPT, max_tokens=16,
                                           temperature=0, logprobs=3)
    ids = out.model_extra["dspark"]["token_ids"]
    lp = out.choices[0].logprobs
    assert lp.tokens == [f"t{t}" for t in ids] and len(ids) == 16
    check(target, PROMPT, ids, lp.token_logprobs)
    ref = reference(target, PROMPT, ids)
    for i, (t, top) in enumerate(zip(ids, lp.top_logprobs)):
        alternatives = torch.topk(ref[i], 3).indices.tolist()
        assert set(map(token_id, top)) == set(alternatives) | {t}  # the top 3 and the produced
        for text, value in top.items():
            assert abs(value - ref[i, token_id(text)].item()) < 1e-4
    assert lp.text_offset == [sum(len(f"t{t}") for t in ids[:i]) for i in range(len(ids))]
    # speculation ran: accepted drafts came out with bonus tokens in the same rounds
    assert out.model_extra["dspark"]["spec_decode"]["drafts_accepted"] > 0


def test_streamed_sampled_completion_logprobs_per_chunk(stack, target):
    chunks = list(client(stack).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.8, seed=7, logprobs=0,
        stream=True))
    ids, values, offsets = [], [], []
    for c in chunks:
        own = c.model_extra["dspark"]["token_ids"]
        lp = c.choices[0].logprobs
        if not own:
            continue
        assert lp.tokens == [f"t{t}" for t in own]  # each chunk: its own tokens
        assert [list(d) for d in lp.top_logprobs] == [[f"t{t}"] for t in own]  # k = 0
        ids += own
        values += lp.token_logprobs
        offsets += lp.text_offset
    assert len(ids) == 20
    check(target, PROMPT, ids, values)  # the raw distribution, not the temperature's
    assert offsets == [sum(len(f"t{t}") for t in ids[:i]) for i in range(len(ids))]


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_streamed_chat_logprobs_through_the_openai_client(stack, target, temperature):
    chunks = list(client(stack).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=16, temperature=temperature, seed=3,
        logprobs=True, top_logprobs=5, stream=True))
    assert chunks[0].choices[0].logprobs is None  # the role chunk
    ids, entries = [], []
    for c in chunks[1:]:
        own = c.model_extra["dspark"]["token_ids"]
        content = c.choices[0].logprobs.content if own else []
        assert [e.token for e in content] == [f"t{t}" for t in own]
        ids += own
        entries += content
    assert len(ids) == 16 and all(len(e.top_logprobs) == 5 for e in entries)
    assert all(e.bytes == list(e.token.encode()) for e in entries)
    check(target, CHAT_PROMPT, ids, [e.logprob for e in entries],
          [[token_id(a.token) for a in e.top_logprobs] for e in entries],
          [[a.logprob for a in e.top_logprobs] for e in entries])


def test_chat_logprobs_without_top_and_without_logprobs(stack, target):
    out = client(stack).chat.completions.create(model="tiny", messages=CHAT, max_tokens=8,
                                                temperature=0, logprobs=True)
    ids = out.model_extra["dspark"]["token_ids"]
    content = out.choices[0].logprobs.content
    assert [e.top_logprobs for e in content] == [[]] * 8
    check(target, CHAT_PROMPT, ids, [e.logprob for e in content])
    plain = client(stack).chat.completions.create(model="tiny", messages=CHAT, max_tokens=8,
                                                  temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.model_extra["dspark"]["token_ids"] == ids


def test_grpc_generate_returns_logprobs(stack, target):
    stub = rpc.generation.GenerationStub(channel(f"127.0.0.1:{stack.grpc_port}"))
    metadata = [("authorization", f"Bearer {stack.api_key}")]
    request = pb.generation.GenerateRequest(model="tiny", prompt_token_ids=PROMPT, max_tokens=12,
                                            logprobs=2)
    replies = list(stub.Generate(request, metadata=metadata, timeout=60))
    ids = [t for r in replies for t in r.token_ids]
    entries = [e for r in replies for e in r.logprobs]
    assert [e.token_id for e in entries] == ids and len(ids) == 12
    check(target, PROMPT, ids, [e.logprob for e in entries],
          [list(e.top_token_ids) for e in entries], [list(e.top_logprobs) for e in entries])
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.generation.GenerateRequest(model="tiny", prompt_token_ids=PROMPT,
                                                         max_tokens=4, logprobs=21),
                           metadata=metadata, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in e.value.details()


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
])
def test_bad_logprobs_values_are_a_400_naming_the_field(stack, path, extra, param):
    body = {"model": "tiny", "max_tokens": 4, **extra}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": PROMPT})
    status, reply = stack.post(path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_logprobs_with_the_token_that_completed_it(stack, embedded_greedy,
                                                                         target, stream):
    expected = embedded_greedy(PROMPT, 20)
    text = " ".join(f"t{t}" for t in expected)
    stop = f" t{expected[6]}"  # the 7th token's word: its first appearance ends the output
    end = text.find(stop) + len(stop)
    last = min(k for k in range(len(expected)) if len(" ".join(text.split()[:k + 1])) >= end)
    out = client(stack).completions.create(model="tiny", prompt=PROMPT, max_tokens=20,
                                           temperature=0, stop=[stop], logprobs=1, stream=stream)
    chunks = list(out) if stream else [out]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs
              for v in c.choices[0].logprobs.token_logprobs]
    assert tokens == [f"t{t}" for t in expected[:last + 1]]
    check(target, PROMPT, expected[:last + 1], values)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_remote_verifier_prefill_rpc_carries_first_token_logprobs(shared_verifier, tiny_models,
                                                                  target):
    """Whole-prompt prefill (`--prefill-chunk-tokens 0`: the Prefill RPC) and plain steps, through
    RemoteVerifier; a count outside 0..20 is the verifier's INVALID_ARGUMENT."""
    from dspark.cost_table import CostTable
    from dspark.engine import AdmissionConfig, BatchingConfig, Engine, EngineConfig
    from dspark.sampling import SamplingParams
    from dspark.serving.remote_verifier import RemoteVerifier, VerifierRejected

    verifier = RemoteVerifier(shared_verifier.address, wait_seconds=30)
    try:
        engine = Engine(verifier, None, CostTable.load(tiny_models.cost_table),
                        EngineConfig(AdmissionConfig(policy="none"),
                                     batching=BatchingConfig(prefill_chunk_tokens=0),
                                     update_cost_table=False))
        rid = engine.add_request(PROMPT, SamplingParams(temperature=0.9, seed=2), 6, logprobs=4,
                                 request_id="logprobs-prefill-rpc")
        request = engine.waiting[0]
        outputs = list(engine.stream())
        ids = request.output_ids
        values = torch.cat([o.logprobs.token_logprobs for o in outputs if o.request_id == rid])
        check(target, PROMPT, ids, values.tolist())
        with pytest.raises(VerifierRejected, match="0..20"):
            verifier.prefill(["bad-count"], [PROMPT], [SamplingParams()], [None], [21])
    finally:
        verifier.close()
