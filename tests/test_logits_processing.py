"""vLLM's logit-space parameters (logit_bias, min_tokens, repetition / frequency / presence
penalties) and min_p, applied to the target's rows inside verification (dspark.logits_processing).

References: transformers' own logits processors (MinNewTokensLengthLogitsProcessor,
SequenceBiasLogitsProcessor, RepetitionPenaltyLogitsProcessor) and a loop for the frequency and
presence penalties, over the whole sequence through the transformers model at every step. Greedy
output equals the reference under every policy (target-only, async_topk, fixed:7), with chunked
prefill and with preemption; a sampled processed request has exactly the processed distribution
under speculation (chi-square against the enumerated distribution).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare
from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from dspark.logits_processing import PenaltyProcessor
from dspark.rejection import VerificationRule
from dspark.sampling import SamplingParams, SamplingTensors, probs_from_logits
from loadtest.tiny_models import GAMMA, VOCAB

from .test_engine import PROMPTS, make_engine


@pytest.fixture(scope="module")
def varied_target(tmp_path_factory, save_tiny_llama):
    """(folder, model): TINY_LLAMA with its LM head times 3, whose greedy outputs do not just
    repeat the prompt's last token (the peaked target's gaps outweigh any penalty), while
    drafts are still accepted now and then."""
    folder = tmp_path_factory.mktemp("varied_llama")
    model = save_tiny_llama(folder, peaked=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(folder)
    return folder, model


def reference_processed(logits: torch.Tensor, prompt: list[int], output: list[int],
                        params: SamplingParams) -> torch.Tensor:
    """One row processed by transformers' processors (vLLM's order: min_tokens, logit_bias,
    repetition) and a loop for frequency and presence: logits [V] -> [V] float32."""
    processors = LogitsProcessorList()
    if params.min_tokens and params.stop_token_ids:
        processors.append(MinNewTokensLengthLogitsProcessor(
            len(prompt), params.min_tokens, list(params.stop_token_ids)))
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    ids = torch.tensor([prompt + output])
    row = processors(ids, logits.float().clone().unsqueeze(0))[0]
    for t in set(output):
        row[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return row


def reference_greedy(model, prompt: list[int], params: SamplingParams, max_tokens: int,
                     stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(reference_processed(logits, prompt, out, params).argmax()))
            if out[-1] in stop_token_ids:
                break
    return out


CASES = {
    "repetition": SamplingParams(temperature=0, repetition_penalty=3.0),
    "frequency_presence": SamplingParams(temperature=0, frequency_penalty=1.5,
                                         presence_penalty=0.7),
    "logit_bias": SamplingParams(temperature=0, logit_bias={5: 4.0, 9: 2.5, 40: -100.0}),
    "everything": SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.6,
                                 presence_penalty=0.4, logit_bias={7: 1.5, 13: -1.0}),
}
"""Each changes the greedy output of some prompt (asserted), so a parameter ignored fails."""


@pytest.mark.parametrize("policy", ["none", "async_topk", "fixed:7"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_equals_the_transformers_processors(varied_target, policy, case):
    folder, model = varied_target
    params = CASES[case]
    engine = make_engine(folder, policy, prefill_chunk_tokens=3 if case == "everything" else 256)
    requests = engine.generate(PROMPTS, params, max_tokens=12)
    expected = [reference_greedy(model, p, params, 12) for p in PROMPTS]
    assert [r.output_ids for r in requests] == expected
    plain = [reference_greedy(model, p, SamplingParams(temperature=0), 12) for p in PROMPTS]
    assert expected != plain  # the parameters change the output
    if policy != "none":
        assert sum(r.metrics.drafts_verified for r in requests) > 0


@pytest.mark.parametrize("policy", ["none", "async_topk", "fixed:7"])
def test_min_tokens_holds_the_stop_tokens_back(varied_target, policy):
    """Each prompt's stop tokens are its plain greedy output's first two tokens: without
    min_tokens it ends at once; with min_tokens 6 they are held back for six tokens."""
    folder, model = varied_target
    engine = make_engine(folder, policy)
    plain = SamplingParams(temperature=0)
    expected, ids = [], []
    for p in PROMPTS:
        stops = tuple(reference_greedy(model, p, plain, 2))
        params = SamplingParams(temperature=0, min_tokens=6)
        held = SamplingParams(temperature=0, min_tokens=6, stop_token_ids=stops)
        expected.append(reference_greedy(model, p, held, 16, stops))
        assert len(expected[-1]) >= 6 and not set(expected[-1][:6]) & set(stops)
        ids.append(engine.add_request(p, params, max_tokens=16, stop_token_ids=stops))
    outputs: dict = {i: [] for i in ids}
    for out in engine.stream():
        outputs[out.request_id] += out.new_token_ids
    assert [outputs[i] for i in ids] == expected


@pytest.mark.parametrize("policy", ["none", f"fixed:{GAMMA}", "async_topk"])
def test_a_preempted_penalised_request_keeps_its_counts(varied_target, policy):
    """Preemption re-reads prompt and output: the output tokens count as output again
    (frequency and presence), so every output is still the reference."""
    folder, model = varied_target
    params = CASES["everything"]
    engine = make_engine(folder, policy, kv_cache_tokens=64)
    requests = engine.generate(PROMPTS, params, max_tokens=24)
    assert engine.stats.preemptions > 0
    assert [r.output_ids for r in requests] == [reference_greedy(model, p, params, 24)
                                                 for p in PROMPTS]


def test_rows_count_the_drafts_before_them():
    """PenaltyProcessor.apply on a block of rows equals the reference row by row: row j counts
    drafts[:j] as output (and min_tokens counts them)."""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, repetition_penalty=1.4, frequency_penalty=0.6,
                            presence_penalty=0.3, logit_bias={3: 2.0, 11: -5.0}, min_tokens=4,
                            stop_token_ids=(2, 8))
    prompt, output, drafts = [4, 5, 6, 5], [8, 9], [9, 10, 9, 2]
    logits = torch.randn(len(drafts) + 1, 16, generator=g) * 3
    processor = PenaltyProcessor(params, 16, torch.device("cpu"))
    processor.observe(prompt, output=False)
    processor.observe(output, output=True)
    got = logits.clone()
    processor.apply(drafts, got)
    for j in range(len(drafts) + 1):
        expected = reference_processed(logits[j], prompt, output + drafts[:j], params)
        torch.testing.assert_close(got[j], expected)


@pytest.mark.parametrize("drafts", [[], [9, 10, 9, 2], [0, 15, 15]])
def test_penalties_off_the_cpu_equal_the_cpu_bit_for_bit_without_a_device_read(drafts):
    """On an accelerator (tests/pretend_device.py) the penalties run over every column instead
    of the seen ones: the same logits exactly, and nothing read off the device."""
    from .pretend_device import PretendDevice

    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0, repetition_penalty=1.4, frequency_penalty=0.6,
                            presence_penalty=0.3, logit_bias={3: 2.0}, min_tokens=3,
                            stop_token_ids=(2,))
    history = [([4, 5, 6, 5, 0], False), ([8, 9], True), ([9], True)]
    logits = torch.randn(len(drafts) + 1, 16, generator=g) * 3
    logits[0, 7] = -0.0  # a signed zero stays as it is
    on_cpu = PenaltyProcessor(params, 16, torch.device("cpu"))
    for tokens, output in history:
        on_cpu.observe(tokens, output)
    expected = logits.clone()
    on_cpu.apply(drafts, expected)
    device = PretendDevice()
    with device:
        got = logits.clone().to(device.device)
        on_device = PenaltyProcessor(params, 16, device.device)
        device.reset_counts()
        for tokens, output in history:
            on_device.observe(tokens, output)
        on_device.apply(drafts, got)
        assert device.syncs == 0, dict(device.sync_calls)
    assert torch.equal(got, expected) and torch.equal(got.signbit(), expected.signbit())


def test_logit_bias_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        PenaltyProcessor(SamplingParams(logit_bias={16: 1.0}), 16, torch.device("cpu"))


@pytest.mark.parametrize("fields, words", [
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be in"),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"logit_bias": {3: 101.0}}, "logit_bias values must be in [-100, 100]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias token ids must be >= 0"),
    ({"min_tokens": -1}, "min_tokens must be a non-negative integer"),
])
def test_sampling_params_refuse_out_of_range(fields, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**fields)
    assert words in str(e.value)


def test_min_p_drops_what_is_below_its_share_of_the_top():
    """probs_from_logits with min_p against the definition: tokens with p < min_p * max p go,
    the rest renormalised, after temperature and before top-k / top-p; the kinds path (host
    branches) and the tensor path agree."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 32, generator=g) * 2
    params = [SamplingParams(temperature=t, min_p=m, top_k=k)
              for t, m, k in [(1.0, 0.1, 0), (0.7, 0.3, 0), (1.3, 0.05, 5), (1.0, 0.0, 0),
                              (0.0, 0.5, 0), (2.0, 1.0, 0)]]
    expected = []
    for row, p in zip(logits, params):
        if p.is_greedy:
            expected.append(torch.nn.functional.one_hot(row.argmax(), 32).float())
            continue
        probs = torch.softmax(row / p.temperature, 0)
        keep = probs >= p.min_p * probs.max()
        scaled = (row / p.temperature).masked_fill(~keep, float("-inf"))
        if p.top_k:
            scaled = scaled.masked_fill(scaled < scaled.topk(p.top_k).values[-1], float("-inf"))
        expected.append(torch.softmax(scaled, 0))
    sampling = SamplingTensors.from_params(params)
    torch.testing.assert_close(probs_from_logits(logits, sampling), torch.stack(expected))
    sampling.kinds = None
    torch.testing.assert_close(probs_from_logits(logits, sampling), torch.stack(expected))


def exact_processed_triples(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(y1, y2, y3) of the processed target (penalties by reference_processed, then temperature
    and min_p) by enumeration: [VOCAB ** 3] float64."""
    rows = SamplingTensors.from_params([params])

    def dist(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        processed = reference_processed(logits, prompt, output, params)
        return probs_from_logits(processed.unsqueeze(0), rows)[0].double()

    pairs = [[a, b] for a in range(VOCAB) for b in range(VOCAB)]
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1]
        second = model(torch.tensor([prompt + [v] for v in range(VOCAB)])).logits[:, -1]
        third = model(torch.tensor([prompt + ab for ab in pairs])).logits[:, -1]
    p1 = dist(first, [])  # [V]
    p2 = torch.stack([dist(second[v], [v]) for v in range(VOCAB)])  # [V, V]
    p3 = torch.stack([dist(third[i], ab) for i, ab in enumerate(pairs)])  # [V * V, V]
    return ((p1[:, None] * p2).reshape(-1, 1) * p3).reshape(-1)


SAMPLED_CASES = {
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.8, presence_penalty=0.8,
                                min_p=0.05),
}


def drafts_processed_params(model, prompt: list[int]) -> SamplingParams:
    """Processed on the drafts too (dspark.models.draft_processing): min_tokens 2 holds the
    target's most likely first token back as a stop token, logit_bias bans its second and
    favours token 5. They change the draft distribution q, which must stay the one the drafts
    are drawn from."""
    with torch.no_grad():
        top = model(torch.tensor([prompt])).logits[0, -1].topk(2).indices.tolist()
    return SamplingParams(temperature=1.0, logit_bias={top[1]: -100.0, 5: 2.0}, min_tokens=2,
                          stop_token_ids=(top[0],))


@pytest.mark.parametrize("rule,case", [(VerificationRule.TOKEN, "penalties"),
                                       (VerificationRule.BLOCK, "penalties"),
                                       (VerificationRule.TOKEN, "drafts_processed")])
def test_sampled_processed_request_has_the_processed_distribution(tiny_target, rule, case):
    """Repetition penalty, presence penalty and min_p at T = 1 under speculation (token and
    block rules), and logit_bias with min_tokens, which the drafts are processed by too: the
    joint distribution of the three tokens (the second and third verified in one round, the
    third's row counting the second as a draft) is the processed target's (chi-square). The
    peaked target: 119 triples hold 83% of the mass, enough for the test's resolution."""
    folder, model = tiny_target
    prompt = [3, 9, 27]
    params = (drafts_processed_params(model, prompt) if case == "drafts_processed"
              else SAMPLED_CASES[case])
    expected = exact_processed_triples(model, prompt, params)
    plain = exact_processed_triples(model, prompt, SamplingParams(temperature=1.0))
    assert (expected - plain).abs().sum() > 0.2  # the parameters move the distribution
    num = 3000
    engine = make_engine(folder, f"fixed:{GAMMA}", max_running=64, sparse_top_k=8, rule=rule)
    for i in range(num):
        engine.add_request(prompt, params, max_tokens=3, request_id=i)
    outputs: dict[int, list[int]] = {}
    accepted = 0
    for result in engine.steps():
        accepted += result.stats.drafts_accepted
        for out in result.outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert accepted > 0
    codes = torch.tensor([(o[0] * VOCAB + o[1]) * VOCAB + o[2] for o in outputs.values()])
    observed = torch.bincount(codes, minlength=VOCAB ** 3).double()
    assert float(observed[expected == 0].sum()) == 0  # min_p's dropped tokens never appear
    exp_counts = expected * num
    big = exp_counts >= 5  # cells with small expected counts pooled
    obs = torch.cat([observed[big], observed[~big].sum(0, keepdim=True)])
    exp = torch.cat([exp_counts[big], exp_counts[~big].sum(0, keepdim=True)])
    exp = exp / exp.sum() * obs.sum()
    assert float(chisquare(obs.numpy(), exp.numpy()).pvalue) > 1e-3


@pytest.mark.parametrize("policy", ["none", f"fixed:{GAMMA}"])
@pytest.mark.parametrize("kv_cache_tokens", [8192, 64])
def test_a_resumed_request_counts_its_earlier_output(varied_target, policy, kv_cache_tokens):
    """A request resumed after 5 tokens (its earlier output given back as the end of the
    prompt, `earlier_output`) continues exactly as if it had never stopped: frequency and
    presence penalties and min_tokens count the earlier output as output, repetition counts it
    either way. With a 64-token cache the resumed requests are preempted on top. Read as
    prompt (min_tokens reduced by 5), some output differs: the test sees the difference."""
    folder, model = varied_target
    params = SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=0.7,
                            min_tokens=8)
    first = 5
    wholes, stops = [], []
    for p in PROMPTS:
        stop = tuple(reference_greedy(model, p, SamplingParams(temperature=0), 1))
        held = dataclasses.replace(params, stop_token_ids=stop)
        wholes.append(reference_greedy(model, p, held, 16, stop))
        stops.append(stop)
        assert len(wholes[-1]) > first

    def resumed(counted: bool) -> list[list[int]]:
        engine = make_engine(folder, policy, kv_cache_tokens=kv_cache_tokens)
        ids = [engine.add_request(
            p + w[:first], params if counted else dataclasses.replace(params, min_tokens=3),
            16 - first, s, earlier_output=w[:first] if counted else ())
            for p, w, s in zip(PROMPTS, wholes, stops)]
        outputs: dict = {i: [] for i in ids}
        for out in engine.stream():
            outputs[out.request_id] += out.new_token_ids
        if kv_cache_tokens == 64:
            assert engine.stats.preemptions > 0
        return [outputs[i] for i in ids]

    expected = [w[first:] for w in wholes]
    assert resumed(True) == expected
    assert resumed(False) != expected
