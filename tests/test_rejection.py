"""Lossless verification (dspark.rejection): known answers, fast path == reference,
statistical tests of the joint output distribution that a real bias would fail, and on a pretend
accelerator the CPU's verdict with nothing read off the device, under every rule.

The statistical tests simulate whole speculative generations of 3 tokens with a toy target and a
toy drafter, both order-2 Markov models over a 5-token vocabulary (so the target at position k
depends on the tokens before it), for 200,000 trials per run in one flattened batch, with random
verification lengths 0..gamma chosen independently of the tokens. The joint distribution of the
first 3 output tokens (125 cells) is compared with the target's exact distribution by a
chi-square test. Two deliberately wrong verifiers must fail the same test.
"""

from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chisquare

from dspark.random_draws import CounterGenerator
from dspark.rejection import (
    RandomDraws,
    SparseDraftProbs,
    VerificationRule,
    VerifyBatch,
    VerifyResult,
    draw_uniforms,
    verify,
    verify_reference,
)
from dspark.sampling import SamplingParams, SamplingTensors, probs_from_logits, sample_from_probs

V = 5  # toy vocabulary
BOS = V  # context index used before the first token
GAMMA = 2
NUM_TRIALS = 200_000
P_VALUE_OK = 1e-3  # a right verifier fails this 1 time in 1000 (and the seeds are fixed)
P_VALUE_BIASED = 1e-8  # a wrong verifier must be far out


def seeded_draws(draft_lens: torch.Tensor, seed: int) -> RandomDraws:
    """Keyed draws (dspark.random_draws) for a batch of independent requests: one seed, request
    r's anchor at position r."""
    return draw_uniforms(draft_lens, CounterGenerator(seed), torch.arange(len(draft_lens)))


def one_hot_logits(token: int, vocab: int = 8) -> torch.Tensor:
    row = torch.full((vocab,), -100.0)
    row[token] = 100.0
    return row


# ---------------------------------------------------------------- constructed cases


def test_known_answers_in_one_mixed_batch():
    vocab = 8
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=1.0)
    one_hot = torch.eye(vocab)
    # request 0: no drafts (a plain decode step): the next token is the target's.
    # request 1: 3 drafts all equal to the target's certain choice: all accepted + bonus.
    # request 2: 2 drafts, the first impossible under the target: rejected, recovered = target's.
    # request 3: greedy, 2 drafts, second differs from argmax: 1 accepted, next = argmax.
    draft_tokens = torch.tensor([1, 2, 3, 6, 0, 4, 5])
    draft_lens = torch.tensor([0, 3, 2, 2])
    draft_probs = one_hot[draft_tokens] * 0.5 + 0.5 / vocab  # every draft token has mass
    target_logits = torch.stack([
        one_hot_logits(7),  # r0 bonus
        one_hot_logits(1), one_hot_logits(2), one_hot_logits(3), one_hot_logits(5),  # r1
        one_hot_logits(2), one_hot_logits(0), one_hot_logits(0),  # r2: x1=6 impossible
        one_hot_logits(4), one_hot_logits(1), one_hot_logits(2),  # r3: x1=4 ok, x2=5 != 1
    ])
    batch = VerifyBatch(draft_tokens, draft_lens, draft_probs, target_logits,
                        [sampled, sampled, sampled, greedy])
    for draws in [RandomDraws(torch.full((7,), 0.999), torch.full((4,), 0.5)),
                  RandomDraws(torch.zeros(7), torch.full((4,), 0.001))]:
        for fn in (verify, verify_reference):
            result = fn(batch, draws)
            assert result.num_accepted.tolist() == [0, 3, 0, 1]
            assert result.output_tokens(batch) == [[7], [1, 2, 3, 5], [2], [4, 1]]


def test_greedy_ignores_the_random_draws():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, generator=g)
    argmax = logits.argmax(1)
    drafts = torch.tensor([int(argmax[0]), int(argmax[1]), (int(argmax[2]) + 1) % 6])
    batch = VerifyBatch(drafts, torch.tensor([3]), torch.eye(6)[drafts], logits,
                        [SamplingParams(temperature=0)])
    for seed in range(5):
        result = verify(batch, seeded_draws(batch.draft_lens, seed))
        assert result.output_tokens(batch) == [[int(argmax[0]), int(argmax[1]), int(argmax[2])]]


@pytest.mark.parametrize("rule", [VerificationRule.TOKEN, VerificationRule.BLOCK])
def test_decode_steps_give_the_general_paths_tokens(rule):
    """Requests without drafts (decode steps, `_decode_steps`): nothing accepted, a greedy
    request's next token its row's first argmax (ties included), a sampled one's drawn with its
    next-token uniform; the same tokens the general path gives them beside a sampled request
    with drafts. Under the block rule only all-greedy rounds take this path."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 8, generator=g)
    logits[1, 2] = logits[1, 6] = logits[1].max() + 1.0  # a tie: the lower index wins
    sampling = [SamplingParams(temperature=0), SamplingParams(temperature=0),
                SamplingParams(temperature=0.7, top_k=5)]
    if rule is VerificationRule.BLOCK:
        sampling[2] = SamplingParams(temperature=0)
    no_drafts = torch.tensor([0, 0, 0])
    alone = verify(VerifyBatch(torch.zeros(0, dtype=torch.int64), no_drafts, torch.zeros(0, 8), logits, sampling),
                   seeded_draws(no_drafts, 1), rule)
    assert alone.num_accepted.tolist() == [0, 0, 0]
    assert alone.next_tokens[:2].tolist() == [int(torch.argmax(logits[0])), 2]
    sampled_logits = torch.randn(3, 8, generator=g)  # a sampled request with 2 drafts: 3 rows
    mixed_batch = VerifyBatch(torch.tensor([1, 5]), torch.tensor([0, 0, 0, 2]),
                              torch.softmax(torch.randn(2, 8, generator=g), 1), torch.cat([logits, sampled_logits]),
                              sampling + [SamplingParams(temperature=1.0)])
    mixed = verify(mixed_batch, seeded_draws(mixed_batch.draft_lens, 1), rule)
    assert mixed.num_accepted[:3].tolist() == [0, 0, 0]
    assert torch.equal(mixed.next_tokens[:3], alone.next_tokens)


def test_invalid_batches_name_the_problem():
    with pytest.raises(ValueError, match="target_logits"):
        VerifyBatch(torch.tensor([1]), torch.tensor([1]), torch.eye(4)[[1]], torch.zeros(1, 4),
                    [SamplingParams()])
    with pytest.raises(ValueError, match="draft_tokens"):
        VerifyBatch(torch.tensor([1, 2]), torch.tensor([1]), torch.eye(4)[[1]], torch.zeros(2, 4),
                    [SamplingParams()])
    batch = VerifyBatch(torch.tensor([1]), torch.tensor([1]), torch.eye(4)[[2]], torch.zeros(2, 4),
                        [SamplingParams()])
    with pytest.raises(ValueError, match="zero probability"):
        verify(batch, draw_uniforms(batch.draft_lens, CounterGenerator(0), [0]))


# ---------------------------------------------------------------- fast path == reference


def random_batch(seed: int, num_requests: int, vocab: int, sparse_k: int | None) -> VerifyBatch:
    g = torch.Generator().manual_seed(seed)
    draft_lens = torch.randint(0, 5, (num_requests,), generator=g)
    num_drafts = int(draft_lens.sum())
    menu = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.7, top_k=4), SamplingParams(temperature=1.2, top_p=0.8)]
    sampling = [menu[i] for i in torch.randint(0, 4, (num_requests,), generator=g).tolist()]
    draft_logits = torch.randn(num_drafts, vocab, generator=g) * 2
    if sparse_k is None:
        probs = torch.softmax(draft_logits, 1)
        tokens = sample_from_probs(probs, torch.rand(num_drafts, generator=g))
        draft_probs = probs
    else:
        top = torch.topk(draft_logits, sparse_k, dim=1)
        probs = torch.softmax(top.values, 1)
        local = sample_from_probs(probs, torch.rand(num_drafts, generator=g))
        tokens = top.indices.gather(1, local.unsqueeze(1)).squeeze(1)
        draft_probs = SparseDraftProbs(top.indices, probs)
    # Target logits close to the draft's so that acceptances and rejections both happen often.
    target_logits = torch.randn(num_drafts + num_requests, vocab, generator=g) * 2
    return VerifyBatch(tokens, draft_lens, draft_probs, target_logits, sampling)


@pytest.mark.parametrize("rule", list(VerificationRule))
@pytest.mark.parametrize("sparse_k", [None, 6])
def test_batched_equals_reference_on_the_same_draws(sparse_k, rule):
    for seed in range(20):
        batch = random_batch(seed, num_requests=9, vocab=17, sparse_k=sparse_k)
        draws = seeded_draws(batch.draft_lens, 100 + seed)
        fast, slow = verify(batch, draws, rule), verify_reference(batch, draws, rule)
        assert fast.num_accepted.tolist() == slow.num_accepted.tolist()
        assert fast.next_tokens.tolist() == slow.next_tokens.tolist()


def test_per_request_generators_make_a_request_independent_of_its_batch():
    batch = random_batch(7, num_requests=6, vocab=17, sparse_k=None)
    gens = [CounterGenerator(1000 + r) for r in range(6)]
    anchors = torch.arange(6) * 10 + 3  # where each request's anchor sits
    full = verify(batch, draw_uniforms(batch.draft_lens, gens, anchors)).output_tokens(batch)
    # Request 4 alone, with its own generator seeded the same way, gives the same tokens.
    start = int(batch.draft_lens[:4].sum())
    n = int(batch.draft_lens[4])
    alone = VerifyBatch(batch.draft_tokens[start:start + n], batch.draft_lens[4:5],
                        batch.draft_probs[start:start + n],
                        batch.target_logits[start + 4:start + 4 + n + 1], [batch.sampling[4]])
    draws = draw_uniforms(alone.draft_lens, [CounterGenerator(1004)], anchors[4:5])
    assert verify(alone, draws).output_tokens(alone) == [full[4]]


# ---------------------------------------------------------------- statistical exactness


@dataclass
class ToyModels:
    target_logits: torch.Tensor  # [V + 1, V + 1, V]: logits of the next token given (prev2, prev1)
    draft_logits: torch.Tensor  # same shape, a different model


def toy_models(seed: int = 0) -> ToyModels:
    g = torch.Generator().manual_seed(seed)
    return ToyModels(torch.randn(V + 1, V + 1, V, generator=g) * 1.2,
                     torch.randn(V + 1, V + 1, V, generator=g) * 1.2)


def table_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    flat = logits.reshape(-1, V)
    return probs_from_logits(flat, SamplingTensors.from_params([params] * flat.shape[0])).reshape(
        logits.shape)


def exact_joint(models: ToyModels, target: SamplingParams) -> torch.Tensor:
    """P(y1, y2, y3) under the target with its sampling transform: [V**3], float64."""
    p = table_probs(models.target_logits, target).double()
    joint = p[BOS, BOS][:, None, None] * p[BOS, :V][:, :, None] * p[:V, :V]  # [V, V, V]
    return joint.reshape(-1)


def simulate(models: ToyModels, target: SamplingParams, *, draft_sample_temperature: float = 1.0,
             reported_draft_temperature: float | None = None, sparse_top_k: int | None = None,
             verifier=verify, seed: int = 0, num_trials: int = NUM_TRIALS,
             gamma: int = GAMMA) -> torch.Tensor:
    """Run speculative generation until every trial has >= 3 tokens; return the first 3 as codes.

    The drafter samples each block token from its own model at `draft_sample_temperature`
    (optionally top-k truncated and shipped sparse). `reported_draft_temperature`, when set, makes
    the drafter *report* a different distribution than the one it sampled from (a bug).
    """
    g = torch.Generator().manual_seed(seed)
    n = num_trials
    trial = torch.arange(n)
    seq = torch.full((n, 2 + 3 * (gamma + 1)), BOS, dtype=torch.int64)  # BOS BOS y1 y2 ...
    produced = torch.zeros(n, dtype=torch.int64)
    trial_generators = [CounterGenerator(seed * n + t) for t in range(n)]
    draft_params = SamplingParams(temperature=draft_sample_temperature, top_k=sparse_top_k or 0)
    q_table = table_probs(models.draft_logits, draft_params)  # [V+1, V+1, V]
    reported = q_table if reported_draft_temperature is None else table_probs(
        models.draft_logits, SamplingParams(temperature=reported_draft_temperature))
    while int(produced.min()) < 3:
        prev2, prev1 = seq[trial, produced], seq[trial, produced + 1]  # last two (BOS-padded)
        ctx = [(prev2, prev1)]
        drafts, draft_probs = [], []
        for _ in range(gamma):
            q = q_table[ctx[-1][0], ctx[-1][1]]  # [n, V]
            x = sample_from_probs(q, torch.rand(n, generator=g))
            drafts.append(x)
            draft_probs.append(reported[ctx[-1][0], ctx[-1][1]])
            ctx.append((ctx[-1][1], x))
        drafts_t = torch.stack(drafts, 1)  # [n, gamma]
        draft_probs_t = torch.stack(draft_probs, 1)  # [n, gamma, V]
        target_rows = torch.stack([models.target_logits[a, b] for a, b in ctx], 1)  # [n, gamma+1, V]
        lens = torch.randint(0, gamma + 1, (n,), generator=g)  # chosen independently of the tokens
        pos = torch.arange(gamma + 1)
        draft_mask = pos[:gamma].unsqueeze(0) < lens.unsqueeze(1)  # [n, gamma]
        target_mask = pos.unsqueeze(0) <= lens.unsqueeze(1)  # [n, gamma+1]
        if sparse_top_k is None:
            probs_arg = draft_probs_t[draft_mask]
        else:
            top = torch.topk(draft_probs_t[draft_mask], sparse_top_k, dim=1)
            probs_arg = SparseDraftProbs(top.indices, top.values)
        batch = VerifyBatch(drafts_t[draft_mask], lens, probs_arg, target_rows[target_mask],
                            [target] * n)
        # Keyed as in serving: each trial's own seed, and its anchor's position (one more token
        # produced every round, so every round draws fresh numbers).
        result = verifier(batch, draw_uniforms(lens, trial_generators, produced))
        accepted = result.num_accepted
        for j in range(gamma):
            m = j < accepted
            seq[trial[m], 2 + produced[m] + j] = drafts_t[m, j]
        seq[trial, 2 + produced + accepted] = result.next_tokens
        produced += accepted + 1
    y = seq[:, 2:5]
    return y[:, 0] * V * V + y[:, 1] * V + y[:, 2]


def chi_square_p_value(codes: torch.Tensor, expected_probs: torch.Tensor) -> float:
    observed = torch.bincount(codes, minlength=V ** 3).double()
    possible = expected_probs > 0
    assert float(observed[~possible].sum()) == 0, "a token sequence of target probability 0 appeared"
    expected = expected_probs[possible] / expected_probs[possible].sum() * observed.sum()
    return float(chisquare(observed[possible].numpy(), expected.numpy()).pvalue)


def verifier_without_residual(batch: VerifyBatch, draws: RandomDraws) -> VerifyResult:
    """WRONG on purpose: after a rejection it resamples from p^t instead of max(p^t - p^d, 0)."""
    right = verify(batch, draws)
    rows = batch.draft_start() + right.num_accepted + torch.arange(batch.num_requests)
    p_t = probs_from_logits(batch.target_logits[rows],
                            SamplingTensors.from_params(batch.sampling))
    return VerifyResult(right.num_accepted, sample_from_probs(p_t, draws.sample_uniform))


MODELS = toy_models()
PLAIN = SamplingParams(temperature=1.0)


def test_output_distribution_is_exactly_the_targets():
    codes = simulate(MODELS, PLAIN, seed=1)
    assert chi_square_p_value(codes, exact_joint(MODELS, PLAIN)) > P_VALUE_OK


def test_the_test_has_power_wrong_draft_distribution_fails():
    # The drafter samples at temperature 0.6 but reports its temperature-1 distribution.
    codes = simulate(MODELS, PLAIN, draft_sample_temperature=0.6, reported_draft_temperature=1.0,
                     seed=2)
    assert chi_square_p_value(codes, exact_joint(MODELS, PLAIN)) < P_VALUE_BIASED


def test_the_test_has_power_missing_residual_fails():
    codes = simulate(MODELS, PLAIN, verifier=verifier_without_residual, seed=3)
    assert chi_square_p_value(codes, exact_joint(MODELS, PLAIN)) < P_VALUE_BIASED


@pytest.mark.parametrize("target", [
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.4, top_p=0.75),
    SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
], ids=["temperature", "top_k", "top_p", "all_three"])
def test_preserved_distribution_is_the_transformed_target(target):
    codes = simulate(MODELS, target, draft_sample_temperature=target.temperature, seed=4)
    assert chi_square_p_value(codes, exact_joint(MODELS, target)) > P_VALUE_OK
    # ... and not the untransformed one.
    assert chi_square_p_value(codes, exact_joint(MODELS, PLAIN)) < P_VALUE_BIASED


def test_sparse_draft_distributions_are_exact():
    # The drafter samples from its top-3 truncation and ships it sparsely.
    codes = simulate(MODELS, PLAIN, sparse_top_k=3, seed=5)
    assert chi_square_p_value(codes, exact_joint(MODELS, PLAIN)) > P_VALUE_OK


def test_sparse_and_dense_give_identical_outputs_on_the_same_draws():
    for seed in range(5):
        sparse_batch = random_batch(seed, num_requests=12, vocab=17, sparse_k=5)
        sp = sparse_batch.draft_probs
        dense = torch.zeros(sp.indices.shape[0], 17).scatter_(1, sp.indices, sp.probs)
        dense_batch = VerifyBatch(sparse_batch.draft_tokens, sparse_batch.draft_lens, dense,
                                  sparse_batch.target_logits, sparse_batch.sampling)
        draws = seeded_draws(sparse_batch.draft_lens, seed)
        a, b = verify(sparse_batch, draws), verify(dense_batch, draws)
        assert a.num_accepted.tolist() == b.num_accepted.tolist()
        assert a.next_tokens.tolist() == b.next_tokens.tolist()


# ---------------------------------------------------------------- the block rule


def verify_blocks(batch: VerifyBatch, draws: RandomDraws) -> VerifyResult:
    return verify(batch, draws, VerificationRule.BLOCK)


def block_rule_without_the_weight(batch: VerifyBatch, draws: RandomDraws) -> VerifyResult:
    """WRONG on purpose: the block rule's prefix, but the next token from the token rule's
    residual normalise(max(P - Q, 0)) instead of normalise(max(w_tau P - Q, 0))."""
    right = verify_blocks(batch, draws)
    starts = batch.draft_start()
    rows = starts + right.num_accepted + torch.arange(batch.num_requests)
    p_t = probs_from_logits(batch.target_logits[rows], SamplingTensors.from_params(batch.sampling))
    cut = right.num_accepted < batch.draft_lens
    q = torch.zeros_like(p_t)
    q[cut] = batch.draft_probs[(starts + right.num_accepted)[cut]]
    residual = torch.where(cut.unsqueeze(1), (p_t - q).clamp_min(0.0), p_t)
    return VerifyResult(right.num_accepted, sample_from_probs(residual, draws.sample_uniform))


@pytest.mark.parametrize("gamma", [GAMMA, 3])
def test_block_rule_output_distribution_is_exactly_the_targets(gamma):
    codes = simulate(MODELS, PLAIN, verifier=verify_blocks, seed=11, gamma=gamma)
    assert chi_square_p_value(codes, exact_joint(MODELS, PLAIN)) > P_VALUE_OK


def test_block_rule_keeps_transformed_targets_and_sparse_drafts_exact():
    target = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    codes = simulate(MODELS, target, draft_sample_temperature=0.8, sparse_top_k=3,
                     verifier=verify_blocks, seed=12)
    assert chi_square_p_value(codes, exact_joint(MODELS, target)) > P_VALUE_OK


def test_the_test_has_power_block_rule_without_the_weight_fails():
    codes = simulate(MODELS, PLAIN, verifier=block_rule_without_the_weight, seed=13)
    assert chi_square_p_value(codes, exact_joint(MODELS, PLAIN)) < P_VALUE_BIASED


def test_block_rule_accepts_more_drafts_than_the_token_rule_on_the_same_blocks():
    # Many draws of the same toy blocks: the block rule's mean accepted length is the higher one.
    g = torch.Generator().manual_seed(14)
    q = torch.softmax(torch.randn(3, V, generator=g) * 1.5, dim=1)  # [gamma, V] per position
    reps = 20_000
    tokens = torch.stack([sample_from_probs(q[k].expand(reps, V), torch.rand(reps, generator=g))
                          for k in range(3)], 1).reshape(-1)  # [reps * 3]
    logits = torch.randn(3 + 1, V, generator=g) * 1.5
    batch = VerifyBatch(tokens, torch.full((reps,), 3), q.repeat(reps, 1), logits.repeat(reps, 1),
                        [PLAIN] * reps)
    draws = draw_uniforms(batch.draft_lens, CounterGenerator(14), torch.arange(reps))
    token_rule = verify(batch, draws).num_accepted.float().mean()
    block_rule = verify_blocks(batch, draws).num_accepted.float().mean()
    assert float(block_rule) > float(token_rule) + 0.01


def test_greedy_requests_are_unchanged_by_the_block_rule():
    for seed in range(5):
        batch = random_batch(seed, num_requests=9, vocab=17, sparse_k=None)
        draws = seeded_draws(batch.draft_lens, seed)
        token_rule, block_rule = verify(batch, draws), verify_blocks(batch, draws)
        for r, params in enumerate(batch.sampling):
            if params.is_greedy:
                assert int(token_rule.num_accepted[r]) == int(block_rule.num_accepted[r])
                assert int(token_rule.next_tokens[r]) == int(block_rule.next_tokens[r])


def test_block_rule_is_exact_by_enumeration_and_gains_in_expectation():
    # Every draft of gamma 3 over 3 tokens, target and drafter depending on the whole prefix:
    # P(output) from stop_probabilities and the residuals, extended by the target to 4 tokens,
    # equals the target's joint exactly; and the block rule keeps more drafts on average.
    import itertools

    from dspark.block_verification import stop_probabilities

    vocab, gamma = 3, 3
    g = torch.Generator().manual_seed(15)
    prefixes = [p for n in range(gamma + 2) for p in itertools.product(range(vocab), repeat=n)]
    P = {p: torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, 0)
         for p in prefixes}
    Q = {p: torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, 0)
         for p in prefixes}

    def extend(seq):  # the target's probability of continuing seq to gamma + 1 tokens
        out = {}
        for tail in itertools.product(range(vocab), repeat=gamma + 1 - len(seq)):
            full = seq + tail
            prob = 1.0
            for j in range(len(seq), gamma + 1):
                prob *= float(P[full[:j]][full[j]])
            out[full] = prob
        return out

    got = dict.fromkeys(itertools.product(range(vocab), repeat=gamma + 1), 0.0)
    block_mean = token_mean = 0.0
    for x in itertools.product(range(vocab), repeat=gamma):
        q_x = float(torch.tensor([Q[x[:i]][x[i]] for i in range(gamma)]).prod())
        target_rows = torch.stack([P[x[:i]] for i in range(gamma + 1)])  # [gamma + 1, V]
        draft_rows = torch.stack([Q[x[:i]] for i in range(gamma)])  # [gamma, V]
        h = stop_probabilities(target_rows, draft_rows, torch.tensor(x))
        ratio = (target_rows[:gamma].gather(1, torch.tensor(x).unsqueeze(1)).squeeze(1)
                 / draft_rows.gather(1, torch.tensor(x).unsqueeze(1)).squeeze(1))
        token_mean += q_x * float(torch.cumprod(ratio.clamp(max=1.0), 0).sum())
        w = [1.0]  # w_i = min(1, w_{i-1} ratio_i)
        for i in range(gamma):
            w.append(min(1.0, w[-1] * float(ratio[i])))
        remaining = 1.0
        for tau in range(gamma, -1, -1):
            p_tau = remaining * (float(h[tau - 1]) if tau > 0 else 1.0)
            remaining *= 1.0 - (float(h[tau - 1]) if tau > 0 else 0.0)
            block_mean += q_x * p_tau * tau
            if p_tau == 0.0:  # e.g. an empty residual: never stopped at
                continue
            if tau == gamma:
                nxt = target_rows[gamma]
            else:
                residual = (w[tau] * target_rows[tau] - draft_rows[tau]).clamp_min(0.0)
                nxt = residual / residual.sum()
            for y in range(vocab):
                for seq, prob in extend(x[:tau] + (y,)).items():
                    got[seq] += q_x * p_tau * float(nxt[y]) * prob
    want = extend(())
    assert max(abs(got[s] - want[s]) for s in want) < 1e-12
    assert block_mean > token_mean + 0.01


def test_block_rule_reads_padded_supports_as_the_unpadded_ones():
    # The verifier pads sparse supports of different widths with (token 0, probability 0)
    # columns: repeated ids, which the residual masses must not count twice.
    for seed in range(5):
        batch = random_batch(seed, num_requests=9, vocab=17, sparse_k=6)
        sp = batch.draft_probs
        pad = torch.zeros(sp.indices.shape[0], 4, dtype=torch.int64)
        padded = VerifyBatch(batch.draft_tokens, batch.draft_lens,
                             SparseDraftProbs(torch.cat([sp.indices, pad], 1),
                                              torch.cat([sp.probs, pad.float()], 1)),
                             batch.target_logits, batch.sampling)
        draws = seeded_draws(batch.draft_lens, seed)
        a, b = verify_blocks(batch, draws), verify_blocks(padded, draws)
        assert a.num_accepted.tolist() == b.num_accepted.tolist()
        assert a.next_tokens.tolist() == b.next_tokens.tolist()


@pytest.mark.parametrize("rule", list(VerificationRule))
def test_one_support_row_for_every_draft_reads_as_the_materialised_rows(rule):
    # The verifier passes the drafter's reduced vocabulary as one row expanded (stride 0).
    vocab, k = 40, 12
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        batch = random_batch(seed, num_requests=9, vocab=vocab, sparse_k=None)
        support = torch.randperm(vocab, generator=g)[:k]
        n = batch.draft_tokens.shape[0]
        probs = torch.softmax(torch.randn(n, k, generator=g) * 2, 1)
        tokens = support[sample_from_probs(probs, torch.rand(n, generator=g))]
        shared = SparseDraftProbs(support.expand(n, -1), probs)
        assert shared.shared_support is not None
        materialised = SparseDraftProbs(support.expand(n, -1).contiguous(), probs)
        draws = seeded_draws(batch.draft_lens, seed)
        a, b = (verify(VerifyBatch(tokens, batch.draft_lens, p, batch.target_logits,
                                   batch.sampling), draws, rule) for p in (shared, materialised))
        assert a.num_accepted.tolist() == b.num_accepted.tolist()
        assert a.next_tokens.tolist() == b.next_tokens.tolist()
        ref = verify_reference(VerifyBatch(tokens, batch.draft_lens, materialised,
                                           batch.target_logits, batch.sampling), draws, rule)
        assert a.next_tokens.tolist() == ref.next_tokens.tolist()


# ---------------------------------------------------------------- the drafter-invariant rule


def verify_invariant(batch: VerifyBatch, draws: RandomDraws) -> VerifyResult:
    return verify(batch, draws, VerificationRule.DRAFTER_INVARIANT)


def invariant_rule_with_noise_keyed_by_round(batch: VerifyBatch, draws: RandomDraws
                                             ) -> VerifyResult:
    """WRONG on purpose: every row of a round reads the noise of the round's first position
    (keyed by the anchor, not by the position), so the tokens of one round are coupled."""
    from dspark.gumbel_verification import target_samples
    lens = batch.draft_lens
    rows = lens + 1
    req_of_row = torch.repeat_interleave(torch.arange(batch.num_requests), rows)
    sampling = SamplingTensors.from_params(batch.sampling).repeat(rows)
    y = target_samples(batch.target_logits, sampling, draws.seeds[req_of_row],
                       draws.anchor_positions[req_of_row] + 1)
    starts = torch.cumsum(rows, 0) - rows
    accepted = []
    for r in range(batch.num_requests):
        d0 = int(lens[:r].sum())
        n = 0
        while n < int(lens[r]) and int(batch.draft_tokens[d0 + n]) == int(y[starts[r] + n]):
            n += 1
        accepted.append(n)
    accepted_t = torch.tensor(accepted)
    return VerifyResult(accepted_t, y[starts + accepted_t])


def test_drafter_invariant_rule_output_distribution_is_exactly_the_targets():
    codes = simulate(MODELS, PLAIN, verifier=verify_invariant, seed=21)
    assert chi_square_p_value(codes, exact_joint(MODELS, PLAIN)) > P_VALUE_OK


def test_drafter_invariant_rule_keeps_transformed_targets_and_sparse_drafts_exact():
    target = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    codes = simulate(MODELS, target, draft_sample_temperature=0.8, sparse_top_k=3,
                     verifier=verify_invariant, seed=22)
    assert chi_square_p_value(codes, exact_joint(MODELS, target)) > P_VALUE_OK


def test_the_test_has_power_noise_keyed_by_the_round_fails():
    codes = simulate(MODELS, PLAIN, verifier=invariant_rule_with_noise_keyed_by_round, seed=23,
                     num_trials=20_000)
    assert chi_square_p_value(codes, exact_joint(MODELS, PLAIN)) < P_VALUE_BIASED


# ---------------------------------------------------------------- on an accelerator


def mixed_batch(case: int) -> tuple[VerifyBatch, RandomDraws]:
    """A seeded batch mixing greedy, plain, tempered, top-k, top-p and min_p requests, blocks
    of 0..5 drafts (every block empty in some), dense or sparse draft distributions (one shared
    support in some)."""
    g = torch.Generator().manual_seed(case)
    num_requests = int(torch.randint(1, 9, (1,), generator=g))
    vocab = [16, 64, 300][case % 3]
    lens = torch.randint(0, 6, (num_requests,), generator=g) * (case % 7 != 0)
    num_drafts = int(lens.sum())
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
             SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
             SamplingParams(temperature=1.0, top_p=0.8),
             SamplingParams(temperature=1.3, min_p=0.05)]
    params = [kinds[int(i)] for i in torch.randint(0, len(kinds), (num_requests,), generator=g)]
    logits = torch.randn(num_drafts + num_requests, vocab, generator=g) * 3
    q = torch.softmax(torch.randn(num_drafts, vocab, generator=g) * 3, 1)  # [n_d, V]
    if case % 2 == 0:
        tokens = (torch.multinomial(q, 1, generator=g).squeeze(1) if num_drafts
                  else torch.zeros(0, dtype=torch.int64))
        probs = q
    else:  # sparse: each row's 8 most probable tokens, or one support shared by every row
        top = torch.topk(q, 8, dim=1)
        ids = top.indices if case % 4 == 1 else top.indices[:1].expand(num_drafts, -1)
        probs = SparseDraftProbs(ids, top.values / top.values.sum(1, keepdim=True))
        pick = torch.randint(0, 8, (num_drafts,), generator=g)
        tokens = ids[torch.arange(num_drafts), pick]
    draws = draw_uniforms(lens, [CounterGenerator(case * 100 + r) for r in range(num_requests)],
                          torch.arange(num_requests) * 10 + 5)
    return VerifyBatch(tokens, lens, probs, logits, params), draws


@pytest.mark.parametrize("rule", list(VerificationRule))
def test_on_a_device_verify_reads_nothing_and_gives_the_cpus_verdict(rule):
    """Off the CPU (tests/pretend_device.py) every rule takes its device branches (whole
    distributions, rows chosen by the host's lengths and kinds) and reads nothing: the same
    accepted counts and tokens as on the CPU, where the per-kind branches read the tensors."""
    from .pretend_device import PretendDevice

    for case in range(40):
        batch, draws = mixed_batch(case)
        expected = verify(batch, draws, rule)
        device = PretendDevice()
        with device:
            on = device.device
            probs = (SparseDraftProbs(batch.draft_probs.indices.to(on),
                                      batch.draft_probs.probs.to(on))
                     if isinstance(batch.draft_probs, SparseDraftProbs)
                     else batch.draft_probs.to(on))
            moved = VerifyBatch(batch.draft_tokens.to(on), batch.draft_lens, probs,
                                batch.target_logits.to(on), batch.sampling)
            device.reset_counts()
            got = verify(moved, draws.to(on), rule)
            assert device.syncs == 0, (case, dict(device.sync_calls))
            assert device.is_on_device(got.num_accepted) and device.is_on_device(got.next_tokens)
            accepted, tokens = got.to_host(moved)
        assert accepted == expected.num_accepted.tolist(), case
        assert tokens == expected.output_tokens(batch), case
