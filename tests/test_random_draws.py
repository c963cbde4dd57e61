"""The counter-based generator (dspark.random_draws): Random123's known answers, values that
depend on their key alone, and statistical tests of uniformity and of independence across
positions, purposes and seeds (with a check that the independence test has power)."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from dspark.models.draft_sampling import draft_uniforms
from dspark.models.draft_types import DraftRequest
from dspark.random_draws import (CounterGenerator, Purpose, gumbel_noise, keyed_uniforms,
                                 philox4x32, seed_tensor)
from dspark.rejection import draw_uniforms
from dspark.sampling import SamplingParams

N = 200_000
P_VALUE_OK = 1e-3


@pytest.mark.parametrize("counter,key,expected", [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
])
def test_philox_known_answers(counter, key, expected):
    # Random123's kat_vectors for philox4x32-10.
    out = philox4x32(torch.tensor([counter]), torch.tensor([key]))
    assert out[0].tolist() == expected


def keys(n: int, seed: int = 7, first_position: int = 0):
    seeds = torch.full((n,), seed, dtype=torch.int64)
    positions = torch.arange(first_position, first_position + n, dtype=torch.int64)
    return seeds, positions, torch.zeros(n, dtype=torch.int64)


def test_a_uniform_depends_on_its_key_alone():
    seeds, positions, offsets = keys(1000)
    whole = keyed_uniforms(seeds, positions, offsets, Purpose.ACCEPT)
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(0))[:300]
    part = keyed_uniforms(seeds[order], positions[order], offsets[order], Purpose.ACCEPT)
    assert torch.equal(part, whole[order])
    assert bool((whole > 0).all() and (whole < 1).all())
    # Seeds reduce to 64 bits: -1 and 2^64 - 1 are one key.
    assert seed_tensor([CounterGenerator(-1)]).item() == seed_tensor(
        [CounterGenerator(2 ** 64 - 1)]).item()


def test_uniforms_are_uniform():
    u = keyed_uniforms(*keys(N), Purpose.NEXT).double().numpy()
    assert kstest(u, "uniform").pvalue > P_VALUE_OK
    counts = np.bincount((u * 100).astype(int), minlength=100)
    assert chisquare(counts).pvalue > P_VALUE_OK


def pair_p_value(a: torch.Tensor, b: torch.Tensor, bins: int = 16) -> float:
    """Chi-square of the joint histogram of (a, b) against independent uniforms."""
    cells = (a * bins).long() * bins + (b * bins).long()
    return float(chisquare(np.bincount(cells.numpy(), minlength=bins * bins)).pvalue)


@pytest.mark.parametrize("what", ["adjacent positions", "purposes", "adjacent seeds",
                                  "adjacent offsets"])
def test_uniforms_are_independent_across_keys(what):
    seeds, positions, offsets = keys(N)
    a = keyed_uniforms(seeds, positions, offsets, Purpose.ACCEPT)
    if what == "adjacent positions":
        b = keyed_uniforms(seeds, positions + 1, offsets, Purpose.ACCEPT)
    elif what == "purposes":
        b = keyed_uniforms(seeds, positions, offsets, Purpose.DRAFT)
    elif what == "adjacent seeds":
        b = keyed_uniforms(seeds + 1, positions, offsets, Purpose.ACCEPT)
    else:
        b = keyed_uniforms(seeds, positions, offsets + 1, Purpose.ACCEPT)
    assert pair_p_value(a, b) > P_VALUE_OK
    assert abs(float(np.corrcoef(a.numpy(), b.numpy())[0, 1])) < 4 / math.sqrt(N)


def test_the_independence_test_has_power():
    # A generator whose next position is its last shifted by a little fails the pair test.
    a = keyed_uniforms(*keys(N), Purpose.ACCEPT)
    b = torch.remainder(a + 0.02 * keyed_uniforms(*keys(N, seed=8), Purpose.ACCEPT), 1.0)
    assert pair_p_value(a, b) < 1e-8


def test_gumbel_noise_is_standard_gumbel_and_reads_the_same_at_any_columns():
    seeds, positions, _ = keys(40, seed=3)
    vocab = torch.arange(5000).expand(40, -1)
    noise = gumbel_noise(seeds, positions, vocab)  # [40, 5000]
    flat = noise.double().reshape(-1).numpy()
    assert kstest(flat, "gumbel_r").pvalue > P_VALUE_OK
    columns = torch.tensor([[4999, 3, 17]] * 40)
    assert torch.equal(gumbel_noise(seeds, positions, columns), noise[:, [4999, 3, 17]])
    # Rows at adjacent positions are independent.
    assert pair_p_value(torch.exp(-torch.exp(-noise[:-1])).reshape(-1),
                        torch.exp(-torch.exp(-noise[1:])).reshape(-1)) > P_VALUE_OK


def test_gumbel_max_samples_the_distribution():
    probs = torch.softmax(torch.randn(12, generator=torch.Generator().manual_seed(1)) * 1.5, 0)
    seeds, positions, _ = keys(N, seed=11)
    noise = gumbel_noise(seeds, positions, torch.arange(12).expand(N, -1))
    picks = torch.argmax(torch.log(probs) + noise, dim=1)
    counts = torch.bincount(picks, minlength=12).double().numpy()
    expected = probs.double().numpy()
    assert chisquare(counts, expected / expected.sum() * N).pvalue > P_VALUE_OK


def test_host_philox_gives_the_tensor_philoxs_uniforms():
    """Up to HOST_PHILOX_MAX_KEYS keys on the host, keyed_uniforms runs Philox on Python integers;
    its uniforms are the bits of philox4x32 as torch operators (negative seeds, positions past
    2^32, per-key purposes), and a key's uniform is the same drawn among more keys than that."""
    from dspark.random_draws import HOST_PHILOX_MAX_KEYS, _counters, unit_floats

    g = torch.Generator().manual_seed(9)
    n = HOST_PHILOX_MAX_KEYS + 1
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), generator=g)
    positions = torch.randint(0, 2**40, (n,), generator=g)
    offsets = torch.randint(0, 2**31, (n,), generator=g)
    for purpose in (Purpose.ACCEPT, torch.randint(0, 6, (n,), generator=g)):
        counter, key = _counters(seeds, positions, offsets, purpose)
        reference = unit_floats(philox4x32(counter, key)[:, 0])  # [n], torch operators
        assert torch.equal(keyed_uniforms(seeds, positions, offsets, purpose), reference)  # n keys: tensors
        part = slice(0, HOST_PHILOX_MAX_KEYS)
        purposes = purpose[part] if isinstance(purpose, torch.Tensor) else purpose
        host = keyed_uniforms(seeds[part], positions[part], offsets[part], purposes)  # host integers
        assert host.dtype == torch.float32 and torch.equal(host, reference[part])


def test_a_rounds_draws_are_their_keys_uniforms():
    """One Philox call serves both kinds of a round: request r's accept uniforms are the keys
    (seed_r, n_r, k, ACCEPT), k = 1..l_r, and its next-token uniform (seed_r, n_r, 0, NEXT),
    each drawn alone here."""
    gens = [CounterGenerator(s) for s in (5, 6, 7)]
    lens, anchors = torch.tensor([2, 0, 3]), torch.tensor([10, 20, 30])
    draws = draw_uniforms(lens, gens, anchors)
    seeds = seed_tensor(gens)
    accept = [keyed_uniforms(seeds[r:r + 1], anchors[r:r + 1], torch.tensor([k]), Purpose.ACCEPT)
              for r in range(3) for k in range(1, int(lens[r]) + 1)]
    assert torch.equal(draws.accept_uniform, torch.cat(accept))
    assert torch.equal(draws.sample_uniform, keyed_uniforms(seeds, anchors, torch.zeros(3, dtype=torch.int64),
                                                            Purpose.NEXT))


def test_greedy_rounds_draw_no_uniforms_and_decide_the_same():
    """An all-greedy round's draws are zeros (no Philox), and every greedy verdict is the one
    the keyed uniforms give: accepted drafts, rejections and next tokens."""
    from dspark.rejection import VerifyBatch, verify

    vocab, lens = 16, torch.tensor([3, 0, 4, 1])
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(int(lens.sum()) + 4, vocab, generator=g)  # l_r + 1 rows a request
    argmax = logits.argmax(dim=1)
    tokens, row = [], 0
    for r, n in enumerate(lens.tolist()):  # request r's drafts follow the target for r steps
        tokens += [int(argmax[row + k]) if k < r else (int(argmax[row + k]) + 1) % vocab for k in range(n)]
        row += n + 1
    probs = torch.softmax(torch.randn(len(tokens), vocab, generator=g), dim=1)
    batch = VerifyBatch(draft_tokens=torch.tensor(tokens), draft_lens=lens, draft_probs=probs,
                        target_logits=logits, sampling=[SamplingParams(temperature=0.0)] * 4)
    gens, anchors = [CounterGenerator(s) for s in range(4)], torch.tensor([7, 8, 9, 10])
    greedy = draw_uniforms(lens, gens, anchors, greedy=True)
    assert not greedy.accept_uniform.any() and not greedy.sample_uniform.any()
    assert greedy.accept_uniform.shape == (8,) and greedy.sample_uniform.shape == (4,)
    keyed = verify(batch, draw_uniforms(lens, gens, anchors))
    zeros = verify(batch, greedy)
    assert keyed.num_accepted.tolist() == zeros.num_accepted.tolist() == [0, 0, 2, 1]
    assert torch.equal(keyed.next_tokens, zeros.next_tokens)


def test_verification_and_draft_draws_depend_on_the_request_alone():
    gens = [CounterGenerator(s) for s in (5, 6, 7)]
    lens = torch.tensor([2, 0, 3])
    anchors = torch.tensor([10, 20, 30])
    both = draw_uniforms(lens, gens, anchors)
    alone = draw_uniforms(lens[2:], gens[2:], anchors[2:])
    assert torch.equal(both.accept_uniform[2:], alone.accept_uniform)
    assert torch.equal(both.sample_uniform[2:], alone.sample_uniform)
    # A round at the next anchor draws fresh numbers.
    later = draw_uniforms(lens[2:], gens[2:], anchors[2:] + 1)
    assert not torch.equal(later.accept_uniform, alone.accept_uniform)

    def request(rid, seed, anchor):
        return DraftRequest(rid, 1, anchor, SamplingParams(1.0), CounterGenerator(seed))

    together = draft_uniforms([request("a", 5, 10), request("b", 6, 20)], 4, torch.device("cpu"))
    single = draft_uniforms([request("b", 6, 20)], 4, torch.device("cpu"))
    assert torch.equal(together[1], single[0])
    assert not torch.equal(together[0], together[1])


def test_unseeded_requests_get_a_fresh_seed_each():
    a, b = SamplingParams().generator(), SamplingParams().generator()
    assert not a.seeded and not b.seeded and a.seed != b.seed
    seeded = SamplingParams(seed=42).generator()
    assert seeded == CounterGenerator(42, seeded=True)
