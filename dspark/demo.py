"""`dspark demo`: lossless verification on a toy target, shown in numbers.

A toy target and a toy drafter (random distributions over a small vocabulary) run one round of
speculative decoding for many independent requests in one flattened batch; the demo prints the
empirical distribution of the first output token next to the target's exact distribution and
the acceptance figures. It needs no model and runs in a second.
"""

from __future__ import annotations

import argparse

import torch

from dspark.random_draws import CounterGenerator, draw_uniforms
from dspark.rejection import VerifyBatch, verify
from dspark.sampling import SamplingParams, SamplingTensors, probs_from_logits, sample_from_probs


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=100_000, help="requests in the batch")
    parser.add_argument("--vocab", type=int, default=6, help="toy vocabulary size")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per request")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    g = torch.Generator().manual_seed(args.seed)
    n, vocab, gamma = args.requests, args.vocab, args.gamma
    params = SamplingParams(temperature=args.temperature)
    target_logits = torch.randn(gamma + 1, vocab, generator=g) * 1.5  # same context for everyone
    draft_logits = target_logits[:gamma] + torch.randn(gamma, vocab, generator=g)  # close, not equal
    rows = SamplingTensors.from_params([params] * gamma)
    draft_probs = probs_from_logits(draft_logits, rows)  # [gamma, vocab]
    drafts = torch.stack([sample_from_probs(draft_probs[k].expand(n, -1), torch.rand(n, generator=g))
                          for k in range(gamma)], 1)  # [n, gamma]
    # A toy target whose distribution does not depend on the drafts: every position shares a row.
    batch = VerifyBatch(drafts.reshape(-1), torch.full((n,), gamma),
                        draft_probs.repeat(n, 1), target_logits.repeat(n, 1), [params] * n)
    result = verify(batch, draw_uniforms(batch.draft_lens, CounterGenerator(args.seed),
                                         torch.arange(n)))
    first = torch.where(result.num_accepted > 0, drafts[:, 0], result.next_tokens)
    empirical = torch.bincount(first, minlength=vocab).double() / n
    exact = probs_from_logits(target_logits[:1], SamplingTensors.from_params([params]))[0]
    print(f"{n} requests, gamma={gamma}, vocab={vocab}, temperature={args.temperature}")
    print("token  target p(x1)  empirical")
    for v in range(vocab):
        print(f"{v:>5}  {float(exact[v]):>12.4f}  {float(empirical[v]):>9.4f}")
    tv = 0.5 * float((empirical - exact.double()).abs().sum())
    tau = float(result.num_accepted.double().mean()) + 1
    print(f"total variation {tv:.4f}; mean tokens per round (tau) {tau:.3f}")
    return 0
