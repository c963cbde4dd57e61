"""dspark.sampling against a brute-force per-row reference."""

import pytest
import torch

from dspark.sampling import (
    TOP_P_CANDIDATES,
    SamplingParams,
    SamplingTensors,
    argmax_first,
    probs_at_columns,
    probs_from_logits,
    sample_from_probs,
    token_probs_from_logits,
)


def reference_probs(logits: list[float], params: SamplingParams) -> list[float]:
    """The sampling transform written as plainly as possible, one row, in float64."""
    vocab = len(logits)
    if params.temperature == 0:
        best = max(range(vocab), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    scaled = [x / params.temperature for x in logits]
    keep = set(range(vocab))
    if 0 < params.top_k < vocab:
        kth = sorted(scaled, reverse=True)[params.top_k - 1]
        keep = {i for i in keep if scaled[i] >= kth}
    m = max(scaled[i] for i in keep)
    weights = {i: torch.tensor(scaled[i] - m, dtype=torch.float64).exp().item() for i in keep}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    if params.top_p < 1.0:
        order = sorted(probs, key=lambda i: -probs[i])
        kept, mass = [], 0.0
        for i in order:
            if mass >= params.top_p and kept:
                break
            kept.append(i)
            mass += probs[i]
        total = sum(probs[i] for i in kept)
        probs = {i: probs[i] / total for i in kept}
    return [probs.get(i, 0.0) for i in range(vocab)]


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=0.8, top_p=0.7),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=50),  # top_k >= vocab: no filter
]


def test_probs_match_reference_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PARAMS) * 4, 11, generator=g) * 2
    params = [p for p in PARAMS for _ in range(4)]
    probs = probs_from_logits(logits, SamplingTensors.from_params(params))
    for row, p in enumerate(params):
        expected = torch.tensor(reference_probs(logits[row].tolist(), p), dtype=torch.float64)
        torch.testing.assert_close(probs[row].double(), expected, atol=1e-6, rtol=1e-5)
        assert abs(float(probs[row].sum()) - 1.0) < 1e-5


def test_greedy_is_one_hot_at_argmax_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    probs = probs_from_logits(logits, SamplingTensors.from_params([SamplingParams(temperature=0)]))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_k_keeps_ties_and_top_p_never_empty():
    logits = torch.tensor([[2.0, 2.0, 2.0, -1.0], [10.0, 0.0, 0.0, 0.0]])
    sampling = SamplingTensors.from_params([SamplingParams(top_k=2), SamplingParams(top_p=0.01)])
    probs = probs_from_logits(logits, sampling)
    torch.testing.assert_close(probs[0], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))
    assert probs[1].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_invalid_params_name_the_problem():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)


def test_inverse_cdf_sampling_is_exact_and_skips_zero_mass():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    n = 200_000
    g = torch.Generator().manual_seed(1)
    tokens = sample_from_probs(probs.expand(n, -1), torch.rand(n, generator=g))
    counts = torch.bincount(tokens, minlength=6).double() / n
    assert counts[0] == counts[2] == counts[5] == 0
    torch.testing.assert_close(counts, probs.double(), atol=4e-3, rtol=0)
    # The extreme uniforms land on tokens that have mass.
    edge = sample_from_probs(probs.expand(2, -1), torch.tensor([0.0, 1.0 - 1e-9]))
    assert edge.tolist() == [1, 4]


def test_wide_nuclei_take_the_wider_partial_sort_or_a_full_sort():
    # 6000 tokens: a nearly flat row whose 0.9 nucleus is wider than every partial sort (a full
    # sort), a row whose nucleus needs the second width, a peaked row that the first width serves.
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 6000, generator=g) * 0.1
    logits[1] *= 100
    logits[3] = torch.randn(6000, generator=g) * 2.5
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9), SamplingParams(top_p=0.5),
              SamplingParams(top_p=0.9)]
    probs = probs_from_logits(logits, SamplingTensors.from_params(params))
    for row, p in enumerate(params):
        expected = torch.tensor(reference_probs(logits[row].tolist(), p), dtype=torch.float64)
        torch.testing.assert_close(probs[row].double(), expected, atol=1e-6, rtol=1e-4)
    first, second = TOP_P_CANDIDATES
    assert int((probs[0] > 0).sum()) > second
    assert first < int((probs[3] > 0).sum()) <= second
    assert int((probs[1] > 0).sum()) <= first


def test_token_probs_equal_the_full_distribution_gathered():
    g = torch.Generator().manual_seed(4)
    params = PARAMS * 3
    logits = torch.randn(len(params), 300, generator=g) * 3
    tokens = torch.randint(0, 300, (len(params),), generator=g)
    tokens[1] = logits[1].argmax()  # a greedy row whose token is the argmax
    sampling = SamplingTensors.from_params(params)
    full = probs_from_logits(logits, sampling).gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(token_probs_from_logits(logits, tokens, sampling), full,
                               atol=1e-7, rtol=1e-5)
    # every plain row at T = 1 (the path that reads the logits in place) and greedy rows beside
    plain = [SamplingParams(temperature=1.0)] * 5 + [SamplingParams(temperature=0.0)]
    plain_sampling = SamplingTensors.from_params(plain)
    plain_full = probs_from_logits(logits[:6], plain_sampling).gather(
        1, tokens[:6].unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(token_probs_from_logits(logits[:6], tokens[:6], plain_sampling),
                               plain_full, atol=1e-7, rtol=1e-5)
    # the caller's every-row argmax, as rejection.verify passes it, gives the same
    torch.testing.assert_close(token_probs_from_logits(logits, tokens, sampling,
                                                       row_argmax=logits.argmax(dim=1)), full,
                               atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_first_is_argmax_on_ties_nan_and_inf(dtype):
    """The brute-force reference is torch.argmax itself: the first maximum, a NaN counting as it."""
    g = torch.Generator().manual_seed(5)
    for trial in range(60):
        rows, vocab = int(torch.randint(1, 70, (1,), generator=g)), int(torch.randint(1, 5000, (1,), generator=g))
        x = torch.randint(-3, 4, (rows, vocab), generator=g).to(dtype)  # many ties
        if trial % 3 == 0:
            x[0, int(torch.randint(0, vocab, (1,), generator=g))] = float("nan")
        if trial % 4 == 0:
            x[-1] = float("-inf")
        assert torch.equal(argmax_first(x, dim=1), torch.argmax(x, dim=1))
        assert torch.equal(argmax_first(x, dim=0), torch.argmax(x, dim=0))
        assert torch.equal(argmax_first(x.view(1, rows, vocab)), torch.argmax(x.view(1, rows, vocab), dim=-1))
    tie = torch.tensor([[0.0, 2.0, 2.0, 1.0]], dtype=dtype)
    assert argmax_first(tie).tolist() == [1]


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-37, 1e-20, 1e-6])
def test_temperatures_below_the_epsilon_are_greedy(temperature):
    """logits / T overflows float32 to inf below about T = 1e-37 and softmax(inf) is NaN; these
    temperatures are greedy instead (a one-hot at the argmax, lowest index on ties)."""
    from dspark.sampling import GREEDY_TEMPERATURE

    assert temperature < GREEDY_TEMPERATURE
    params = SamplingParams(temperature=temperature)
    assert params.is_greedy and params.temperature == 0.0
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [50.0, -50.0, 0.0, 49.5]])
    probs = probs_from_logits(logits, SamplingTensors.from_params([params, params]))
    assert torch.isfinite(probs).all()
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_temperature_at_the_epsilon_still_samples():
    from dspark.sampling import GREEDY_TEMPERATURE

    params = SamplingParams(temperature=GREEDY_TEMPERATURE)
    assert not params.is_greedy
    logits = torch.tensor([[0.0, 0.0, -1.0]])  # a tie: both tied tokens keep half the mass
    probs = probs_from_logits(logits, SamplingTensors.from_params([params]))
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.5, 0.0]]))


@pytest.mark.parametrize("rows_taken", ["most", "few"])  # T = 1 reads the whole matrix or not
def test_probs_at_columns_are_the_gathered_distributions(rows_taken):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 50, generator=g) * 3
    rows = (torch.tensor([0, 2, 3, 4, 5, 6, 7, 9]) if rows_taken == "most"
            else torch.tensor([1, 8]))
    columns = torch.randint(0, 50, (rows.shape[0], 6), generator=g)
    menu = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
            SamplingParams(temperature=1.3, top_p=0.8)]
    for params in ([menu[0]] * rows.shape[0],
                   [menu[i % len(menu)] for i in range(rows.shape[0])]):
        sampling = SamplingTensors.from_params(params)
        want = probs_from_logits(logits[rows], sampling).gather(1, columns)
        got = probs_at_columns(logits, columns, sampling, rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("filters", [True, False])
def test_mixed_rows_on_an_accelerator_read_nothing_and_equal_the_cpu(filters):
    """top-k, top-p (a nucleus wider than the first partial sort included), plain and greedy
    rows mixed (or greedy and plain rows only), on a pretend CUDA device
    (tests/pretend_device.py): probs_from_logits, token_probs_from_logits and probs_at_columns
    make no host-device synchronisation, and give what the CPU's partial-sort and per-kind paths
    give."""
    from .pretend_device import PretendDevice

    g = torch.Generator().manual_seed(6)
    vocab = 600
    menu = PARAMS if filters else [SamplingParams(temperature=t) for t in (1.0, 0.0, 0.5)]
    params = [SamplingParams(temperature=1.0, top_p=0.9 if filters else 1.0)] + menu * 2
    logits = torch.randn(len(params), vocab, generator=g) * 3
    logits[0] *= 0.01  # a nearly flat row: its nucleus is wider than TOP_P_CANDIDATES[0]
    tokens = torch.randint(0, vocab, (len(params),), generator=g)
    columns = torch.randint(0, vocab, (len(params), 5), generator=g)
    rows = torch.arange(len(params)).flip(0)
    host = SamplingTensors.from_params(params)
    want = (probs_from_logits(logits, host), token_probs_from_logits(logits, tokens, host, rows),
            probs_at_columns(logits, columns, host, rows))
    device = PretendDevice()
    device.place(logits, tokens, columns, rows)
    with device:
        sampling = SamplingTensors.from_params(params, device=device.device)
        device.reset_counts()
        got = (probs_from_logits(logits, sampling),
               token_probs_from_logits(logits, tokens, sampling, rows),
               probs_at_columns(logits, columns, sampling, rows))
        assert device.syncs == 0, dict(device.sync_calls)
    if filters:
        assert int((want[0][0] > 0).sum()) > TOP_P_CANDIDATES[0]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
