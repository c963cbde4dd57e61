"""The target's log-probabilities of produced tokens (OpenAI's `logprobs`), computed where the
verifier has the target's logits.

Which distribution: log_softmax of the target's raw logits at the position that produced the
token, in float32, before the request's temperature, top-k or top-p (vLLM's default,
`logprobs_mode="raw_logprobs"`). Under speculation every produced token (an accepted draft, the
recovered or the bonus token, a prompt's first token) comes from a position the target ran in
that round's forward, so its row is at hand: the log-probabilities cost a log_softmax over the
rows of the requests that asked, and nothing for the others.

`num_top` (OpenAI's top_logprobs / the legacy completions' logprobs): the k most probable tokens
at each position besides the produced one; 0 = the produced token only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
"""The most alternatives a position reports (OpenAI's limit on chat top_logprobs)."""


@dataclass
class TokenLogprobs:
    """Log-probabilities of n produced tokens, in order."""

    token_logprobs: torch.Tensor  # [n] float32: log p^t(produced token)
    top_token_ids: torch.Tensor  # [n, num_top] int64, most probable first
    top_logprobs: torch.Tensor  # [n, num_top] float32

    def __post_init__(self) -> None:
        n = self.token_logprobs.shape[0]
        assert self.token_logprobs.shape == (n,), self.token_logprobs.shape
        assert self.top_token_ids.shape == self.top_logprobs.shape, (
            self.top_token_ids.shape, self.top_logprobs.shape)
        assert self.top_token_ids.shape[0] == n, (self.top_token_ids.shape, n)

    def __len__(self) -> int:
        return self.token_logprobs.shape[0]

    def __getitem__(self, rows: slice) -> "TokenLogprobs":
        return TokenLogprobs(self.token_logprobs[rows], self.top_token_ids[rows],
                             self.top_logprobs[rows])

    @staticmethod
    def empty(num_top: int = 0) -> "TokenLogprobs":
        return TokenLogprobs(torch.zeros(0), torch.zeros(0, num_top, dtype=torch.int64),
                             torch.zeros(0, num_top))

    @staticmethod
    def cat(parts: "list[TokenLogprobs]") -> "TokenLogprobs":
        return TokenLogprobs(torch.cat([p.token_logprobs for p in parts]),
                             torch.cat([p.top_token_ids for p in parts]),
                             torch.cat([p.top_logprobs for p in parts]))


def check_num_top(num_top: int) -> None:
    if not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs: top count must be in 0..{MAX_TOP_LOGPROBS}, got {num_top}")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> TokenLogprobs:
    """logits [n, vocab_size] (the target's rows that produced the tokens), tokens [n] ->
    log_softmax(logits)[i, tokens[i]] and each row's num_top most probable tokens, on the CPU."""
    n = tokens.shape[0]
    assert logits.dim() == 2 and logits.shape[0] == n, (logits.shape, n)
    check_num_top(num_top)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab_size]
    picked = logprobs.gather(1, tokens.to(logits.device).long().unsqueeze(1)).squeeze(1)  # [n]
    top_values, top_ids = torch.topk(logprobs, min(num_top, logits.shape[1]), dim=-1)  # [n, k]
    return TokenLogprobs(picked.cpu(), top_ids.cpu(), top_values.cpu())


def grouped_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                           groups: "list[tuple[int, int]]") -> "list[TokenLogprobs]":
    """Several requests' rows in one log_softmax: logits [n, vocab_size], tokens [n], groups
    [(num_rows, num_top)] in row order (the rows sum to n) -> one TokenLogprobs per group."""
    assert sum(rows for rows, _ in groups) == tokens.shape[0], (groups, tokens.shape)
    computed = token_logprobs(logits, tokens, max((k for _, k in groups), default=0))
    out, first = [], 0
    for rows, num_top in groups:
        part = computed[first:first + rows]
        out.append(TokenLogprobs(part.token_logprobs, part.top_token_ids[:, :num_top],
                                 part.top_logprobs[:, :num_top]))
        first += rows
    return out
