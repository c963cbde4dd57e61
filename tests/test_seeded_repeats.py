"""A seeded sampled request gives the same tokens every time, under every policy, alone or
beside other requests (the embedded engine on the tiny target, float32).

Token rule: the same deployment (policy, drafter) repeats a seeded request token for token,
whatever runs beside it: its random numbers are keyed by its seed and its rounds' anchors
(dspark.random_draws) and, under async_topk, the number of drafts it verifies depends on its own
confidences only (dspark.seeded_admission). The drafter-invariant rule: the tokens are moreover
those of target-only decoding (policy none) with the same seed, whatever the policy.
"""

from __future__ import annotations

import pytest
import torch

from dspark.cost_table import CostTable
from dspark.rejection import VerificationRule
from dspark.sampling import SamplingParams
from loadtest.tiny_models import VOCAB

from .test_engine import make_engine


@pytest.fixture(scope="module")
def varied_target(tmp_path_factory, save_tiny_llama):
    """TINY_LLAMA with its LM head times 3: at T = 1 its samples vary (the peaked target of the
    other tests repeats its last token) and drafts are still accepted now and then."""
    folder = tmp_path_factory.mktemp("varied_llama")
    model = save_tiny_llama(folder, peaked=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(folder)
    return folder

POLICIES = ["none", "async_topk", "fixed:1", "fixed:7"]
PROMPT = [3, 9, 27, 17, 5]
SEEDED = SamplingParams(temperature=1.0, seed=1234)
MAX_TOKENS = 40
REPEATS = 5


def seeded_output(engine, others: int, repeat: int) -> list[int]:
    """The seeded request's tokens, sent with `others` unseeded requests of random prompts and
    lengths (different in every repeat)."""
    g = torch.Generator().manual_seed(1000 + repeat)
    rid = engine.add_request(PROMPT, SEEDED, max_tokens=MAX_TOKENS)
    for _ in range(others):
        n = int(torch.randint(1, 12, (1,), generator=g))
        prompt = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        temperature = float(torch.rand(1, generator=g)) * 1.5
        engine.add_request(prompt, SamplingParams(temperature=temperature),
                           max_tokens=int(torch.randint(5, 60, (1,), generator=g)))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.request_id == rid:
                tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("policy", POLICIES)
def test_a_seeded_request_repeats_alone_and_in_a_batch(varied_target, policy):
    folder = varied_target
    outputs = []
    for repeat in range(REPEATS):
        for others in (0, 7):
            engine = make_engine(folder, policy, seed=0)
            torch.manual_seed(repeat)  # the unseeded requests' fresh seeds differ every time
            outputs.append(seeded_output(engine, others, repeat))
    assert len(outputs[0]) == MAX_TOKENS
    assert all(o == outputs[0] for o in outputs), [o[:12] for o in outputs]


def test_one_engine_repeats_a_seeded_request_while_others_come_and_go(varied_target):
    """The same engine (its cost table and admission history carried over) serves the seeded
    request again and again among different others."""
    folder = varied_target
    engine = make_engine(folder, "async_topk", seed=0)
    outputs = [seeded_output(engine, others, repeat)
               for repeat, others in enumerate([0, 7, 3, 7, 1])]
    assert all(o == outputs[0] for o in outputs)


@pytest.mark.parametrize("others", [0, 7])
def test_drafter_invariant_rule_gives_target_only_decoding(varied_target, others):
    folder = varied_target
    rule = VerificationRule.DRAFTER_INVARIANT
    reference = seeded_output(make_engine(folder, "none", rule=rule), 0, 0)
    assert len(reference) == MAX_TOKENS
    for policy in POLICIES:
        for drafter_seed in (0, 1):  # two different (untrained) drafters
            engine = make_engine(folder, policy, seed=drafter_seed, rule=rule)
            assert seeded_output(engine, others, drafter_seed) == reference, policy



def test_a_seed_on_a_greedy_request_leaves_async_topk_its_own_decisions(varied_target):
    """Greedy output depends on no random number, so a seed on a greedy request must not put it
    on the seeded path (whole blocks drafted, the drafting gate bypassed). With a cost table
    under which no draft pays, async_topk verifies none for the greedy request, seeded or not,
    while a seeded sampled request still verifies its own confidences' drafts."""
    steep = CostTable.from_step_seconds({b: 0.01 * b for b in (1, 2, 4, 8, 16, 32, 64)})

    def drafts_verified(sampling: SamplingParams) -> int:
        engine = make_engine(varied_target, "async_topk", seed=0, table=steep)
        engine.add_request(PROMPT, sampling, max_tokens=MAX_TOKENS)
        return sum(result.stats.drafts_admitted for result in engine.steps())

    assert drafts_verified(SamplingParams(temperature=0.0)) == 0
    assert drafts_verified(SamplingParams(temperature=0.0, seed=1234)) == 0
    assert drafts_verified(SEEDED) > 0


@pytest.mark.parametrize("policy", ["async_topk", "fixed:7"])
def test_a_seeded_request_repeats_with_the_drafters_round_graphs(varied_target, policy):
    """The drafter's round on its static per-bucket buffers (dspark.models.draft_graph_runner,
    the CUDA default, run eagerly here): the seeded request's uniforms are still drawn outside
    the captured part, keyed by its seed and anchors, so it repeats alone (batch bucket 1) and
    among 7 others (bucket 8)."""
    outputs = []
    for repeat in range(3):
        for others in (0, 7):
            engine = make_engine(varied_target, policy, seed=0)
            engine.drafter.use_round_graphs(True)
            torch.manual_seed(repeat)
            outputs.append(seeded_output(engine, others, repeat))
            assert engine.drafter.round_graphs.rounds > 0
    assert len(outputs[0]) == MAX_TOKENS
    assert all(o == outputs[0] for o in outputs), [o[:12] for o in outputs]
