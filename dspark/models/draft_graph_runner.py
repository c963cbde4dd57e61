"""The DSpark drafter's round over static buffers by batch-size and context-length bucket,
captured as CUDA graphs on CUDA (docs/design.md section 7, docs/gpu.md).

A drafting call of R requests runs over one bucket's static buffers: the requests padded to B
(a size of `graph_runner.BATCH_BUCKETS`), their cached contexts gathered side by side into L
slots (`context_bucket`: a power of two, at least `MIN_CONTEXT_SLOTS`) plus the gamma slots the
block's own keys and values go to: the BATCHED context attention (`ContextAttention.BATCHED`,
`DrafterAttention.forward_padded`) over buffers whose shapes follow (B, L) alone. On CUDA the
captured part runs as one `torch.cuda.CUDAGraph` per bucket, captured on first use and replayed;
on any other device the same static-buffer path runs eagerly, so the bucketing, padding and
copy-back are the code the CPU tests run (tests/models/test_draft_graph_runner.py).

What the graph holds (static shapes):
- the block input: the embedding of the anchor and gamma - 1 mask tokens, plus H_ctx at the
  last context position (`inject_last_context`), RoPE at the block's positions;
- the backbone: every layer over [context; block] with the mask `context position < anchor`
  (padding slots sit at a position no anchor reaches), the final norm and the base logits of
  all gamma positions (a call that samples n < gamma positions reads the first n);
- when every request of the call is greedy and none has logit processing: the sequential
  head's chain (x_k = the first argmax of U_k + B_k(x_{k-1}), fed back through W1) and the
  confidences c_k = sigmoid(logit / T_k + b_k).
What stays outside, on the ordinary path:
- the host's part: the per-request lists, each context copied into its row (device copies,
  one per tensor and request, as the eager BATCHED gather does), one upload of the anchors;
- a call with a sampled request or with logit processing: its chain runs eagerly over the
  graph's hn and base logits. Its row plan (sparse / dense rows, each row's k), the grammar
  masks and logit bias change from call to call, and its uniforms are keyed by each request's
  seed and anchor (`draft_sampling.draft_uniforms`), drawn outside any graph, so a seeded
  request repeats exactly as on the eager path (tests/test_seeded_repeats.py);
- more requests than the largest batch bucket: the eager path.

Glossary
- *padding request*: a bucket row past the call's R: anchor token 0 at position 0, every
  context slot at `PAD_POSITION` (masked), its outputs dropped.
- *padding slot*: a context slot past a request's length: position `PAD_POSITION`, keys and
  values whatever finite numbers an earlier call left there (zeros at first); masked, so they
  add exactly zero.

The graphs read the drafter's weights and target buffers at the addresses they had at capture:
`set_target_weights` drops them (`clear`); the confidence calibration is copied into each call's
static buffers, so changing it needs nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dspark.models.context_kv_cache import PAD_POSITION, RequestContext
from dspark.models.draft_sampling import RowPlan
from dspark.models.graph_runner import batch_bucket, capture_graph
from dspark.models.pass_upload import upload

if TYPE_CHECKING:
    from dspark.models.drafter import DSparkDrafter

__all__ = ["DraftGraphRunner", "RoundOutputs", "MIN_CONTEXT_SLOTS", "context_bucket"]

MIN_CONTEXT_SLOTS = 64
"""The smallest context bucket: short contexts share one (a prompt is rarely shorter)."""


def context_bucket(num_slots: int) -> int:
    """Context slots of the bucket for a longest context of `num_slots` tokens: the next power of
    two, at least MIN_CONTEXT_SLOTS."""
    return max(MIN_CONTEXT_SLOTS, 1 << max(0, num_slots - 1).bit_length())


@dataclasses.dataclass
class RoundOutputs:
    """One call's outputs from the static path, cut to its R requests (n: positions drafted)."""

    hn: torch.Tensor
    """[R, gamma, hidden] norm(h), a view of the bucket's buffer: read it before the next call."""
    base: torch.Tensor
    """[R, gamma, V_d] float32 base logits, a view like hn."""
    anchor_tokens: torch.Tensor
    """[R] int64 target ids of the anchors, a view like hn."""
    tokens: torch.Tensor | None = None
    """[R, n] int64 draft-vocabulary ids of the greedy chain (a copy), None when not chained."""
    confidences: torch.Tensor | None = None
    """[R, n] float32 calibrated confidences of the greedy chain (a copy), None when not chained."""


@dataclasses.dataclass
class _Bucket:
    """The static buffers of one (batch, context slots, greedy chain) bucket."""

    num_requests: int
    """B: requests, real and padding."""
    context_slots: int
    """L: context slots a request (the block's gamma slots come after them)."""
    greedy_chain: bool
    """Whether the captured part includes the greedy chain and the confidences."""
    metadata: torch.Tensor
    """int64 [2 * B] on the device: anchor tokens, anchor positions."""
    anchor_tokens: torch.Tensor  # [B] view of metadata
    anchor_positions: torch.Tensor  # [B] view of metadata
    keys: torch.Tensor
    """[num_layers, B, num_kv_heads, L + gamma, head_dim] the contexts' keys, then the block's."""
    values: torch.Tensor  # as keys
    positions: torch.Tensor
    """[B, L] int64 each context slot's position (PAD_POSITION: a padding slot)."""
    last_hidden: torch.Tensor | None
    """[B, hidden] H_ctx before each anchor (zeros where none), with inject_last_context."""
    conf_temperatures: torch.Tensor
    """[B, gamma] float32 the STS temperatures of each request's calibration row."""
    conf_biases: torch.Tensor  # [B, gamma] float32, the same for the biases
    hn: torch.Tensor | None = None  # [B, gamma, hidden] outputs of the latest run
    base: torch.Tensor | None = None  # [B, gamma, V_d] float32
    tokens: torch.Tensor | None = None  # [B, gamma] int64 draft ids (greedy chain)
    confidences: torch.Tensor | None = None  # [B, gamma] float32 (greedy chain)
    graph: torch.cuda.CUDAGraph | None = None


class DraftGraphRunner:
    """A `DSparkDrafter`'s drafting round over static per-bucket buffers."""

    def __init__(self, drafter: DSparkDrafter, capture: bool) -> None:
        self.drafter = drafter
        self.capture = capture
        """Capture and replay CUDA graphs (CUDA only); False: run the static path eagerly."""
        self.buckets: dict[tuple[int, int, bool], _Bucket] = {}
        """By (B, L, greedy chain)."""
        self.rounds = 0
        """Drafting calls that took the static path (tests and benches read it)."""
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def clear(self) -> None:
        """Drop every bucket and its graph (the drafter's weights changed)."""
        self.buckets.clear()

    def fits(self, num_requests: int) -> bool:
        return batch_bucket(num_requests) is not None

    # -- the round -----------------------------------------------------------------------------
    def run(self, contexts: Sequence[RequestContext], anchor_tokens: Sequence[int],
            anchor_positions: Sequence[int], last_hidden: torch.Tensor | None,
            conf_temperatures: torch.Tensor, conf_biases: torch.Tensor, greedy_chain: bool,
            num_positions: int) -> RoundOutputs:
        """The round of R = len(contexts) requests (each context's gamma scratch slots reserved);
        last_hidden [R, hidden] (inject_last_context) or None; conf_temperatures/biases
        [R, gamma] or [gamma]; greedy_chain: every request greedy, none with processing."""
        d = self.drafter
        R = len(contexts)
        B = batch_bucket(R)
        assert B is not None, f"{R} requests: more than the largest bucket"
        L = context_bucket(max(c.length for c in contexts))
        bucket = self.buckets.get((B, L, greedy_chain)) or self._new_bucket(B, L, greedy_chain)

        pad = B - R
        (metadata,) = upload([torch.tensor([*anchor_tokens, *[0] * pad, *anchor_positions,
                                            *[0] * pad], dtype=torch.int64)], d.fc.weight.device)
        bucket.metadata.copy_(metadata)  # the one host copy
        bucket.positions.fill_(PAD_POSITION)
        for r, c in enumerate(contexts):  # device copies: [num_layers, kv_heads, n, head_dim]
            n = c.length
            if n:
                bucket.keys[:, r, :, :n] = c.keys[:, :, :n]
                bucket.values[:, r, :, :n] = c.values[:, :, :n]
                bucket.positions[r, :n] = c.positions[:n]
        if bucket.last_hidden is not None:
            assert last_hidden is not None and last_hidden.shape[0] == R, "inject_last_context"
            bucket.last_hidden[:R] = last_hidden
            bucket.last_hidden[R:] = 0
        bucket.conf_temperatures[:R] = conf_temperatures
        bucket.conf_biases[:R] = conf_biases
        self._run(bucket)
        self.rounds += 1
        out = RoundOutputs(bucket.hn[:R], bucket.base[:R], bucket.anchor_tokens[:R])
        if greedy_chain:  # copies: the next call's replay writes the buffers again
            out.tokens = bucket.tokens[:R, :num_positions].clone()
            out.confidences = bucket.confidences[:R, :num_positions].clone()
        return out

    # -- buckets -------------------------------------------------------------------------------
    def _new_bucket(self, B: int, L: int, greedy_chain: bool) -> _Bucket:
        d = self.drafter
        cfg = d.config
        device, dtype = d.fc.weight.device, d.fc.weight.dtype
        metadata = torch.zeros(2 * B, dtype=torch.int64, device=device)
        anchor_tokens, anchor_positions = metadata.split([B, B])
        # Zeros: finite from the start (a masked NaN would still poison a row: 0 * NaN).
        keys = torch.zeros(len(d.layers), B, cfg.num_key_value_heads, L + d.gamma, cfg.head_dim,
                           dtype=dtype, device=device)
        bucket = _Bucket(
            B, L, greedy_chain, metadata, anchor_tokens, anchor_positions, keys,
            torch.zeros_like(keys), torch.full((B, L), PAD_POSITION, dtype=torch.int64, device=device),
            torch.zeros(B, cfg.hidden_size, dtype=dtype, device=device)
            if cfg.inject_last_context else None,
            torch.ones(B, d.gamma, dtype=torch.float32, device=device),
            torch.zeros(B, d.gamma, dtype=torch.float32, device=device))
        self.buckets[(B, L, greedy_chain)] = bucket
        return bucket

    def _body(self, bucket: _Bucket) -> tuple[torch.Tensor, ...]:
        """hn, base (and with the greedy chain: tokens, confidences) over the bucket's buffers."""
        d = self.drafter
        x, cos, sin = d.block_input(bucket.anchor_tokens, bucket.anchor_positions,
                                    bucket.last_hidden)
        x = d.padded_backbone(x, cos, sin, bucket.keys, bucket.values, bucket.positions,
                              bucket.anchor_positions)
        hn = d.norm(x)  # [B, gamma, hidden]
        base = d.base_logits(hn)  # [B, gamma, V_d]
        if not bucket.greedy_chain:
            return hn, base
        B = bucket.num_requests
        plan = RowPlan(B, list(range(B)), [1] * B, [], True, None, None, None, None, None, None)
        samples, w1_block = d.draw_positions(hn, base, bucket.anchor_tokens, plan, None, None,
                                             d.gamma)
        tokens = torch.stack([s.tokens for s in samples], dim=1)  # [B, gamma] draft ids
        confidences = d.calibrated_confidences(hn, w1_block, bucket.conf_temperatures,
                                               bucket.conf_biases)  # [B, gamma]
        return hn, base, tokens, confidences

    def _store(self, bucket: _Bucket, outputs: tuple[torch.Tensor, ...]) -> None:
        bucket.hn, bucket.base = outputs[:2]
        if bucket.greedy_chain:
            bucket.tokens, bucket.confidences = outputs[2:]

    def _run(self, bucket: _Bucket) -> None:
        """The captured part over the bucket's current buffers, into its outputs."""
        if not self.capture:
            self._store(bucket, self._body(bucket))
            return
        if bucket.graph is None:
            # The warm-up and the capture write the block's keys and values into the bucket's
            # own slots, as every replay does again.
            bucket.graph = capture_graph(lambda: self._store(bucket, self._body(bucket)), self.pool)
        bucket.graph.replay()
