"""The target's decode and verification forwards over static buffers by batch-size bucket, captured
as CUDA graphs on CUDA (docs/design.md section 7).

A forward whose requests each bring at most `rows_per_request` new tokens (verification of l
drafts: l + 1 <= gamma + 1) runs over one bucket's static buffers: the requests padded to B (a
size of `BATCH_BUCKETS`), each request to Q rows (1 when every request brings one token, a
decode step; else `rows_per_request`), each block table to W blocks (a power of two). A bucket
(B, W, Q) holds one int64 metadata buffer on the device, the `FlatBatch`
viewing it, and the model's outputs. On CUDA the layers over it are captured once into a
`torch.cuda.CUDAGraph` and replayed (a forward is then one metadata copy, one replay and the LM
head); on any other device the same static-buffer path runs eagerly, so the bucketing, padding
and copy-back are the code the CPU tests run (tests/models/test_graph_runner.py).

Glossary
- *real rows* of request r: its q new tokens, rows r*Q + Q - q .. r*Q + Q - 1 (last, in order).
- *padding rows*: the Q - q rows before them, and every row of a padding request (bucket slots
  past the batch). Token 0 at position 0, their keys and values written to `scratch` slots.
- *scratch block*: one cache block the runner reserves under its own request id (`SCRATCH_ID`),
  in no real request's block table; it also pads the tables to W blocks.

Why the rows line up: with every query length Q, the PADDED attention's causal limit of row i of
a request whose context is c tokens (cached + new) is c - Q + i. For real row i = Q - q + j that
is c - q + j, the real token's own position; a padding row sees a prefix of the context (its
limit is clamped to 0 at least, `padded_attention`) and its output is dropped. The Triton
kernel (`triton_paged_attention`) places a request's rows the same way (row i of Q at position
c - Q + i; a row that sees nothing gives zeros): its launch grid is (B, heads, Q / rows a
program), and it reads the block tables, query starts and context lengths from the device, so
it is graphed as well. The PADDED attention (the CUDA default) and TRITON are graphed
(`GRAPHED_ATTENTION`): their shapes follow (B, Q, W) alone. FLEX is not: its kernel is
compiled by torch.compile, which a CPU runs as a dense reference of other code, so a graphed
FLEX could not be checked here.

The LM head runs outside the graph, over the rows that need logits only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from dspark.models.pass_upload import upload
from dspark.models.transformer import AttentionImpl, FlatBatch

if TYPE_CHECKING:
    from dspark.models.runner import ForwardItem, ForwardOutput, TargetRunner

__all__ = ["GraphRunner", "BATCH_BUCKETS", "GRAPHED_ATTENTION", "SCRATCH_ID", "batch_bucket",
           "capture_graph", "table_bucket"]

GRAPHED_ATTENTION = (AttentionImpl.PADDED, AttentionImpl.TRITON)
"""The attentions whose forwards run over the static buckets (see the module's docstring)."""

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Batch sizes a graph is captured for; a forward of more requests runs the ordinary path."""
SCRATCH_ID = ("dspark.graph_runner", "scratch")
"""The request id of the scratch block in the cache's block manager."""


def batch_bucket(num_requests: int) -> int | None:
    """The smallest bucket that holds `num_requests` (None: more than the largest)."""
    return next((b for b in BATCH_BUCKETS if b >= num_requests), None)


def table_bucket(num_blocks: int) -> int:
    """Block-table width for a longest table of `num_blocks` blocks: the next power of two."""
    return 1 << max(0, num_blocks - 1).bit_length()


@dataclasses.dataclass
class _Bucket:
    """The static buffers of one (batch, table width, rows a request) bucket."""

    num_requests: int
    """B: requests, real and padding."""
    table_width: int
    """W: blocks per block-table row."""
    rows_per_request: int
    """Q: rows per request."""
    metadata: torch.Tensor
    """int64 [3 * B * Q + B * W + (B + 1) + 2 * B] on the device: token ids, positions, slots,
    block tables, query starts, query lengths, context lengths, in that order."""
    batch: FlatBatch
    """Views of `metadata`; its host lists hold the bucket's bounds (every query Q rows, every
    context at most W blocks), which is all the PADDED and TRITON attentions read of them."""
    h: torch.Tensor | None = None
    """[B * Q, hidden_size]: the last layer's output of the latest run."""
    hidden: torch.Tensor | None = None
    """[B * Q, len(hidden_layer_ids), hidden_size] or None."""
    graph: torch.cuda.CUDAGraph | None = None


class GraphRunner:
    """Decode and verification forwards of a `TargetRunner` over static per-bucket buffers."""

    def __init__(self, runner: TargetRunner, rows_per_request: int, capture: bool) -> None:
        if runner.attention not in GRAPHED_ATTENTION:
            raise ValueError(f"graphed forwards need the PADDED or TRITON attention, not "
                             f"{runner.attention.value}")
        if rows_per_request <= 0:
            raise ValueError(f"rows_per_request must be positive, got {rows_per_request}")
        self.runner = runner
        self.rows_per_request = rows_per_request
        self.capture = capture
        """Capture and replay CUDA graphs (CUDA only); False: run the static path eagerly."""
        manager = runner.cache.manager
        block_size = manager.block_size
        manager.add_request(SCRATCH_ID)
        manager.grow({SCRATCH_ID: block_size})
        self.scratch_block = manager.block_ids(SCRATCH_ID, block_size)[0]
        self.scratch_slot = self.scratch_block * block_size
        # Every slot finite from the start: padding rows read the scratch block and slot 0, and a
        # masked NaN would still poison the rows that mask it (0 * NaN).
        runner.cache.k.zero_()
        runner.cache.v.zero_()
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}
        """By (B, W, Q)."""
        self.forwards = 0
        """Forwards that took the static path (tests and benches read it)."""
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    # -- the forward ---------------------------------------------------------------------------
    def forward(self, items: Sequence[ForwardItem], old_lengths: list[int]) -> ForwardOutput | None:
        """The runner's forward of `items` (their cache blocks already grown) over a bucket, or
        None when it does not fit one (more requests than the largest bucket, or a request with
        more than `rows_per_request` new tokens): the caller then runs the ordinary path."""
        from dspark.models.runner import ForwardOutput

        longest = max(len(it.token_ids) for it in items)
        if longest > self.rows_per_request:
            return None
        Q = 1 if longest == 1 else self.rows_per_request
        B = batch_bucket(len(items))
        if B is None:
            return None
        manager = self.runner.cache.manager
        block_size = manager.block_size
        context_lens = [n + len(it.token_ids) for it, n in zip(items, old_lengths)]
        W = table_bucket(max(-(-c // block_size) for c in context_lens))
        bucket = self.buckets.get((B, W, Q)) or self._new_bucket(B, W, Q)

        # Host lists, filled per request and made tensors once: padding rows are token 0 at
        # position 0 written to the scratch slot; padding table entries the scratch block.
        token_ids = [0] * (B * Q)  # [B * Q]
        positions = [0] * (B * Q)  # [B * Q]
        slots = [self.scratch_slot] * (B * Q)  # [B * Q]
        tables = [self.scratch_block] * (B * W)  # [B, W]
        ctx_lens = [0] * B  # [B]
        logit_rows: list[int] = []  # [num_logit_rows] rows of the B * Q outputs, in item order
        token_rows: list[int] = []  # [num_tokens] rows of every real token, in item order
        for r, (it, old, ctx) in enumerate(zip(items, old_lengths, context_lens)):
            q = len(it.token_ids)
            first = r * Q + Q - q  # the request's first real row
            blocks = manager.block_ids(it.request_id, ctx)
            token_ids[first: first + q] = it.token_ids
            positions[first: first + q] = range(old, ctx)
            slots[first: first + q] = [blocks[p // block_size] * block_size + p % block_size
                                       for p in range(old, ctx)]
            tables[r * W: r * W + len(blocks)] = blocks
            ctx_lens[r] = ctx
            logit_rows.extend(range(first + it.first_logit, first + q))
            token_rows.extend(range(first, first + q))
        query_start = list(range(0, (B + 1) * Q, Q))  # [B + 1]
        metadata, rows, real_tokens = upload(
            [torch.tensor(token_ids + positions + slots + tables + query_start + [Q] * B + ctx_lens,
                          dtype=torch.int64),
             torch.tensor(logit_rows, dtype=torch.int64),
             torch.tensor(token_rows, dtype=torch.int64)], self.runner.device)
        bucket.metadata.copy_(metadata)  # the one host copy, then on the device
        self._run(bucket)
        logits = self.runner.model.compute_logits(bucket.h.index_select(0, rows))
        hidden = None if bucket.hidden is None else bucket.hidden.index_select(0, real_tokens)
        self.forwards += 1
        logit_counts = [len(it.token_ids) - it.first_logit for it in items]
        return ForwardOutput(logits, logit_counts, hidden, [len(it.token_ids) for it in items])

    # -- buckets -------------------------------------------------------------------------------
    def _new_bucket(self, B: int, W: int, Q: int) -> _Bucket:
        device = self.runner.device
        block_size = self.runner.cache.manager.block_size
        sizes = [B * Q, B * Q, B * Q, B * W, B + 1, B, B]
        metadata = torch.zeros(sum(sizes), dtype=torch.int64, device=device)
        token_ids, positions, slots, tables, query_start, query_lens, ctx_lens = metadata.split(sizes)
        batch = FlatBatch(
            token_ids=token_ids, positions=positions, slot_mapping=slots,
            query_lens=[Q] * B, context_lens=[W * block_size] * B,
            context_in_place=[False] * B, context_offsets=[0] * B,
            gather_blocks=torch.empty(0, dtype=torch.int64, device=device),
            block_tables=tables.view(B, W), query_start=query_start, query_lens_t=query_lens,
            context_lens_t=ctx_lens)
        bucket = _Bucket(B, W, Q, metadata, batch)
        self.buckets[(B, W, Q)] = bucket
        return bucket

    def _body(self, bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor | None]:
        runner = self.runner
        bucket.batch.prepare(runner.attention, runner.model_config.num_queries_per_kv, runner.cache)
        return runner.model(bucket.batch, runner.cache, runner.attention,
                            runner.config.hidden_layer_ids)

    def _run(self, bucket: _Bucket) -> None:
        """The layers over the bucket's current metadata, into bucket.h / bucket.hidden."""
        if not self.capture:
            bucket.h, bucket.hidden = self._body(bucket)
            return
        if bucket.graph is None:
            # The warm-up and the capture write this forward's keys and values, as the replay
            # below does again: the same values.
            def body() -> None:
                bucket.h, bucket.hidden = self._body(bucket)

            bucket.graph = capture_graph(body, self.pool)
        bucket.graph.replay()


def capture_graph(body: Callable[[], None], pool: tuple[int, int] | None) -> torch.cuda.CUDAGraph:
    """`body` (a function that writes its outputs where its caller keeps them) run once on a side
    stream (lazy initialisation, the allocator's warm-up), then captured into a CUDA graph over
    the memory pool `pool`. The graph is not replayed yet; the outputs `body` kept point into
    the pool, and the replays write them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph
