"""`TargetRunner`: the verifier's engine (docs/design.md sections 5 and 7).

Glossary
- *request*: one sequence with its own KV cache blocks; identified by any hashable id.
- *item*: what one request contributes to a forward: new token ids appended to its sequence, and
  from which new-token index on logits are wanted (verification of l drafts asks for the last
  l + 1 rows: anchor and drafts; a prefill asks for the last row only).
- *pass*: one model forward over a flattened batch of at most `max_tokens_per_pass` tokens; a
  forward whose items hold more tokens (a long prompt: chunked prefill) runs several passes, a
  request's chunks in order.

All KV blocks for a forward are reserved before the first pass: either the whole forward fits or
`KVCacheFull` is raised with the cache untouched.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from dspark.models.config import ModelConfig
from dspark.models.gguf_blocks import check_against_dense, find_gguf, read_block_weights
from dspark.models.graph_runner import GRAPHED_ATTENTION, GraphRunner
from dspark.models.kv_cache import KVCacheFull, PagedKVCache, RequestId
from dspark.models.loader import load_model, resolve_dtype
from dspark.models.packed_linear import packing_available
from dspark.models.quantized_linear import kernel_available as block_kernel_available
from dspark.models.quantized_linear import kernel_isa as block_kernel_isa
from dspark.models.paged_attention import LONG_QUERY_MIN_TOKENS, cpu_kernel_available
from dspark.models.pass_upload import upload
from dspark.models.transformer import AttentionImpl, FlatBatch, Transformer
from dspark.models.triton_paged_attention import triton_available
from dspark.sampling import argmax_first

__all__ = ["RunnerConfig", "WEIGHT_MODES", "choose_weights", "ForwardItem", "ForwardOutput", "TargetRunner", "KVCacheFull",
           "generate_greedy"]


WEIGHT_MODES = ("q4", "dense")


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """How the target runs. Build it in the CLI/service and pass it down."""

    device: str = "cpu"
    """torch device; "cuda" works the same way (nothing here assumes a CPU)."""
    dtype: str | None = None
    """"float32" | "bfloat16" | "float16"; None: float32 on CPU, bfloat16 on CUDA."""
    block_size: int = 16
    """Tokens per KV cache block."""
    kv_cache_tokens: int = 16384
    """Cache capacity in tokens (rounded up to whole blocks), shared by all requests."""
    max_tokens_per_pass: int = 256
    """Chunk size: at most this many new tokens go through one model forward (chunked prefill)."""
    hidden_layer_ids: tuple[int, ...] = ()
    """Decoder layers whose outputs `forward` returns for every new token (DeepSpec's target_layer_ids)."""
    attention: AttentionImpl | None = None
    """None: PAGED on a CPU where its C++ kernel builds (else PER_REQUEST), PADDED elsewhere (one
    batched SDPA call per layer; no per-request launches on a GPU). FLEX and TRITON are the
    paged GPU candidates (bench/attention_backends.py compares them). See `AttentionImpl`."""
    cpu_upcast_min_rows: int | None = 2
    """CPU with bf16/fp16 weights: matrix products over at least this many rows run in float32
    (transformer.Linear; measured 1.7-4x faster at 2-8 rows on an AVX2 CPU). None: never. Ignored
    on CUDA, and where the weights are packed (a CPU with bf16 support, below)."""

    cpu_packed_weights: bool = True
    """CPU float32, and bf16 where oneDNN supports it (AVX512 and newer): multiply with
    oneDNN-packed weights (transformer.Linear.pack). float32: measured 1.3x faster at one new
    token and 1.9-2.3x at 2-8 than MKL on a 2-core CPU; bf16 on an AVX512-BF16 CPU: 1.5-2x faster
    than F.linear, and no per-call float32 copy of every weight as with the upcast. False: MKL."""

    weights: str | None = None
    """How the target's linear weights are held. "q4": the model folder's GGUF blocks as stored
    (Q4_1 layer projections, Q8_0 LM head; float32 activations and accumulation, a sixth of the
    float32 bytes read per step, batch-invariant: `dspark.models.quantized_linear`); it needs a
    CPU, dtype float32, the GGUF beside the safetensors (`dspark fetch-model`) and a C++
    compiler. "dense": the `dtype` tensors (packed per `cpu_packed_weights`). None: "q4" where
    it applies and the kernel has its AVX-512 or AVX2 path, else "dense"."""

    cuda_graphs: bool | None = None
    """Decode and verification forwards over static per-bucket buffers, captured as CUDA graphs
    on CUDA and run eagerly elsewhere (`dspark.models.graph_runner`); they need the PADDED or
    the TRITON attention. None: on for CUDA with either, off elsewhere."""
    graph_rows_per_request: int = 8
    """A graphed forward's rows a request: gamma + 1 (the shipped drafter's block of 7, plus 1)."""

    q4_max_rows: int | None = 64
    """weights "q4": passes of more rows than this multiply with the packed float32 weights (kept
    beside the blocks), which run many rows about 2x faster than the block kernel (prompt
    chunks, verification of many streams); up to it, a row's result is the same bits in any
    batch. None: the blocks for every pass (batch-invariant at any size; no packed copy)."""

    def __post_init__(self) -> None:
        if self.weights not in (None, *WEIGHT_MODES):
            raise ValueError(f"weights must be one of {WEIGHT_MODES} or None, got {self.weights!r}")
        if self.block_size <= 0 or self.kv_cache_tokens <= 0 or self.max_tokens_per_pass <= 0:
            raise ValueError("block_size, kv_cache_tokens and max_tokens_per_pass must be positive")
        if self.dtype is not None:
            resolve_dtype(self.dtype)
        if len(set(self.hidden_layer_ids)) != len(self.hidden_layer_ids):
            raise ValueError(f"hidden_layer_ids has duplicates: {self.hidden_layer_ids}")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return resolve_dtype(self.dtype)
        return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32


@dataclasses.dataclass(frozen=True)
class ForwardItem:
    """Append `token_ids` to request `request_id`; return logits for new-token indices
    `logits_from .. len(token_ids) - 1` (None: only the last)."""

    request_id: RequestId
    token_ids: Sequence[int]
    logits_from: int | None = None

    @property
    def first_logit(self) -> int:
        return len(self.token_ids) - 1 if self.logits_from is None else self.logits_from


@dataclasses.dataclass
class ForwardOutput:
    """Results of one `TargetRunner.forward`, rows in item order."""

    logits: torch.Tensor
    """[num_logit_rows, vocab_size] float32."""
    logit_counts: list[int]
    """[num_items]: logit rows per item."""
    hidden: torch.Tensor | None
    """[num_tokens, len(hidden_layer_ids), hidden_size] in the model dtype; None without hidden_layer_ids."""
    hidden_counts: list[int]
    """[num_items]: hidden rows per item (its number of new tokens)."""

    def logits_of(self, item_index: int) -> torch.Tensor:
        """Logits [logit_counts[item_index], vocab_size] of one item."""
        start = sum(self.logit_counts[:item_index])
        return self.logits[start:start + self.logit_counts[item_index]]

    def hidden_of(self, item_index: int) -> torch.Tensor:
        """Hidden states [hidden_counts[item_index], num_layers_selected, hidden_size] of one item."""
        if self.hidden is None:
            raise ValueError("no hidden_layer_ids configured")
        start = sum(self.hidden_counts[:item_index])
        return self.hidden[start:start + self.hidden_counts[item_index]]


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Tokens `start..end-1` of item `item` (one chunk of it) in one pass."""

    item: int
    start: int
    end: int


class TargetRunner:
    """Our target model with a paged KV cache, run over flattened variable-length batches."""

    def __init__(self, model_dir: str | Path | None = None, config: RunnerConfig = RunnerConfig(),
                 model: Transformer | None = None) -> None:
        if (model_dir is None) == (model is None):
            raise ValueError("give exactly one of model_dir and model")
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.model = model if model is not None else load_model(model_dir, self.dtype, self.device)
        low_precision_cpu = self.device.type == "cpu" and self.dtype != torch.float32
        self.model.set_upcast_min_rows(config.cpu_upcast_min_rows if low_precision_cpu else None)
        self.weights = choose_weights(config, model_dir if model is None else None, self.device, self.dtype)
        """"q4" or "dense": how the linears' weights are held (RunnerConfig.weights, resolved)."""
        blocks = None
        if self.weights == "q4":
            blocks = read_block_weights(find_gguf(model_dir), self.model.config)
            _check_blocks(self.model, blocks)
        packed = config.cpu_packed_weights and packing_available(self.device, self.dtype)
        if packed and (blocks is None or config.q4_max_rows is not None):
            self.model.pack_linear_weights()
        if blocks is not None:
            self.model.use_block_weights(blocks, max_rows=config.q4_max_rows if packed else None)
        self.attention = config.attention or default_attention(self.device)
        if self.attention is AttentionImpl.TRITON and not triton_available(self.device):
            raise ValueError(f"attention 'triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 "
                             f"on a CPU); the runner is on {self.device}")
        mc = self.model_config
        bad = [i for i in config.hidden_layer_ids if not 0 <= i < mc.num_hidden_layers]
        if bad:
            raise ValueError(f"hidden_layer_ids {bad} outside 0..{mc.num_hidden_layers - 1}")
        self.cache = PagedKVCache(
            num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
            num_blocks=-(-config.kv_cache_tokens // config.block_size), block_size=config.block_size,
            dtype=self.dtype, device=self.device,
            zeroed=self.attention is AttentionImpl.FLEX)  # FlexAttention multiplies unwritten slots by 0
        graphs = config.cuda_graphs
        if graphs is None:
            graphs = self.device.type == "cuda" and self.attention in GRAPHED_ATTENTION
        self.graphs = (GraphRunner(self, config.graph_rows_per_request, self.device.type == "cuda")
                       if graphs else None)

    # -- model facts ---------------------------------------------------------------------------
    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head of layer outputs [num_rows, hidden_size] -> [num_rows, vocab_size] float32."""
        with torch.inference_mode():
            return self.model.compute_logits(hidden)

    # -- request lifecycle ---------------------------------------------------------------------
    def add_request(self, request_id: RequestId) -> None:
        self.cache.manager.add_request(request_id)

    def has_request(self, request_id: RequestId) -> bool:
        return request_id in self.cache.manager

    def length(self, request_id: RequestId) -> int:
        """Tokens of the request held in the KV cache."""
        return self.cache.manager.length(request_id)

    def truncate(self, request_id: RequestId, num_tokens: int) -> None:
        """Keep the request's first `num_tokens` tokens (drop rejected drafts); frees unneeded blocks."""
        self.cache.manager.truncate(request_id, num_tokens)

    def free(self, request_id: RequestId) -> None:
        self.cache.manager.free(request_id)

    def fork(self, parent: RequestId, child: RequestId, num_tokens: int) -> None:
        """A new request `child` holding a copy of `parent`'s first `num_tokens` tokens' K/V
        (PagedKVCache.fork); KVCacheFull (nothing changed) when they do not fit."""
        self.cache.fork(parent, child, num_tokens)

    @property
    def num_free_blocks(self) -> int:
        return self.cache.manager.num_free_blocks

    def can_fit(self, grow: dict[RequestId, int]) -> bool:
        """Whether growing requests by these token counts fits in the free blocks."""
        return self.cache.manager.extra_blocks_needed(grow) <= self.cache.manager.num_free_blocks

    # -- the forward ---------------------------------------------------------------------------
    def forward(self, items: Sequence[ForwardItem]) -> ForwardOutput:
        """Append each item's tokens to its request and run the model over all of them at once.

        Raises KVCacheFull (nothing changed) if the cache cannot hold all the new tokens.
        """
        self._validate(items)
        manager = self.cache.manager
        old_lengths = [manager.length(it.request_id) for it in items]
        manager.grow({it.request_id: len(it.token_ids) for it in items})
        try:
            with torch.inference_mode():
                return self._run(items, old_lengths)
        except BaseException:
            for it, n in zip(items, old_lengths):
                manager.truncate(it.request_id, n)
            raise

    def _validate(self, items: Sequence[ForwardItem]) -> None:
        if not items:
            raise ValueError("forward needs at least one item")
        seen = set()
        for it in items:
            if it.request_id in seen:
                raise ValueError(f"request {it.request_id!r} appears twice in one forward")
            seen.add(it.request_id)
            if it.request_id not in self.cache.manager:
                raise KeyError(f"unknown request {it.request_id!r}; add_request first")
            if not it.token_ids:
                raise ValueError(f"request {it.request_id!r}: no new tokens")
            if not 0 <= it.first_logit <= len(it.token_ids):
                raise ValueError(f"request {it.request_id!r}: logits_from {it.logits_from} outside "
                                 f"0..{len(it.token_ids)}")

    def _plan(self, items: Sequence[ForwardItem]) -> list[list[_Piece]]:
        """Split the items' tokens into passes of <= max_tokens_per_pass, each request's chunks in order."""
        budget = self.config.max_tokens_per_pass
        passes: list[list[_Piece]] = [[]]
        room = budget
        for index, it in enumerate(items):
            start = 0
            while start < len(it.token_ids):
                if room == 0:
                    passes.append([])
                    room = budget
                end = min(len(it.token_ids), start + room)
                passes[-1].append(_Piece(index, start, end))
                room -= end - start
                start = end
        return passes

    def _run(self, items: Sequence[ForwardItem], old_lengths: list[int]) -> ForwardOutput:
        if self.graphs is not None and (out := self.graphs.forward(items, old_lengths)) is not None:
            return out
        logits_parts: list[list[torch.Tensor]] = [[] for _ in items]
        hidden_parts: list[list[torch.Tensor]] = [[] for _ in items]
        group = self.model_config.num_queries_per_kv
        layer_ids = self.config.hidden_layer_ids
        passes = self._plan(items)
        for pieces in passes:
            if self.attention.uses_block_tables:
                batch, logit_rows, rows = self._table_batch(items, old_lengths, pieces)
            else:
                batch, logit_rows, rows = self._flat_batch(items, old_lengths, pieces)
            batch.prepare(self.attention, group, self.cache)
            h, hidden = self.model(batch, self.cache, self.attention, layer_ids)
            logits = self.model.compute_logits(h.index_select(0, rows))
            row = token = 0
            for piece, piece_rows in zip(pieces, logit_rows):
                logits_parts[piece.item].append(logits[row:row + len(piece_rows)])
                row += len(piece_rows)
                if hidden is not None:
                    hidden_parts[piece.item].append(hidden[token:token + piece.end - piece.start])
                token += piece.end - piece.start
        logit_counts = [sum(p.shape[0] for p in parts) for parts in logits_parts]
        if len(passes) == 1:
            # one pass (every decode and verification step): `_plan` lays its pieces out one an
            # item, in item order, so the pass's rows already are the output; copying a big
            # batch's logits into a fresh tensor costs more than the LM head's own conversion
            out_logits, out_hidden = logits, hidden
        else:
            out_logits = torch.cat([p for parts in logits_parts for p in parts], dim=0)
            out_hidden = (torch.cat([p for parts in hidden_parts for p in parts], dim=0)
                          if layer_ids else None)
        return ForwardOutput(out_logits, logit_counts, out_hidden, [len(it.token_ids) for it in items])

    def _flat_batch(self, items: Sequence[ForwardItem], old_lengths: list[int],
                    pieces: list[_Piece]) -> tuple[FlatBatch, list[list[int]], torch.Tensor]:
        """Metadata of one pass, per piece the pass-local token rows that need logits, and
        those rows [num_logit_rows] on the device (all of it uploaded in one copy)."""
        manager = self.cache.manager
        token_ids: list[int] = []
        positions, slot_mapping, gather_blocks = [], [], []
        query_lens, context_lens, in_place, context_offsets, logit_rows = [], [], [], [], []
        # The block-diagonal mask needs every context in one gathered tensor.
        allow_in_place = self.attention is AttentionImpl.PER_REQUEST
        for piece in pieces:
            it = items[piece.item]
            first_pos = old_lengths[piece.item] + piece.start
            ctx_len = old_lengths[piece.item] + piece.end
            q_len = piece.end - piece.start
            offset = len(token_ids)
            logit_rows.append([offset + i - piece.start
                               for i in range(max(piece.start, it.first_logit), piece.end)])
            token_ids.extend(it.token_ids[piece.start:piece.end])
            positions.append(torch.arange(first_pos, ctx_len, dtype=torch.int64))
            slot_mapping.append(manager.slots(it.request_id, first_pos, ctx_len))  # [q_len]
            start = manager.contiguous_start(it.request_id, ctx_len) if allow_in_place else None
            in_place.append(start is not None)
            if start is not None:
                context_offsets.append(start)
            else:
                context_offsets.append(len(gather_blocks) * manager.block_size)
                gather_blocks.extend(manager.block_ids(it.request_id, ctx_len))
            query_lens.append(q_len)
            context_lens.append(ctx_len)
        token_ids_t, positions_t, slot_mapping_t, gather_blocks_t, rows = upload(
            [torch.tensor(token_ids, dtype=torch.int64), torch.cat(positions),
             torch.cat(slot_mapping), torch.tensor(gather_blocks, dtype=torch.int64),
             _flat_rows(logit_rows)], self.device)
        batch = FlatBatch(
            token_ids=token_ids_t,
            positions=positions_t,
            slot_mapping=slot_mapping_t,
            query_lens=query_lens,
            context_lens=context_lens,
            context_in_place=in_place,
            context_offsets=context_offsets,
            gather_blocks=gather_blocks_t,
        )
        return batch, logit_rows, rows


    def _table_batch(self, items: Sequence[ForwardItem], old_lengths: list[int],
                     pieces: list[_Piece]) -> tuple[FlatBatch, list[list[int]], torch.Tensor]:
        """Metadata of one pass for the block-table attentions (PAGED, PADDED, FLEX, TRITON), built with a
        constant number of tensor ops whatever the number of requests: block tables, per-token
        positions and cache slots, query starts and context lengths; with the logit rows as
        `_flat_batch`'s, all of it uploaded in one copy."""
        manager = self.cache.manager
        block_size = manager.block_size
        token_ids: list[int] = []
        query_lens, context_lens, tables, logit_rows = [], [], [], []
        for piece in pieces:
            it = items[piece.item]
            ctx_len = old_lengths[piece.item] + piece.end
            offset = len(token_ids)
            logit_rows.append(list(range(offset + max(piece.start, it.first_logit) - piece.start,
                                         offset + piece.end - piece.start)))
            token_ids.extend(it.token_ids[piece.start:piece.end])
            query_lens.append(piece.end - piece.start)
            context_lens.append(ctx_len)
            tables.append(manager.block_ids(it.request_id, ctx_len))
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)  # [R, width]
        q_lens = torch.tensor(query_lens, dtype=torch.int64)  # [R]
        ctx_lens = torch.tensor(context_lens, dtype=torch.int64)  # [R]
        query_start = torch.zeros(len(pieces) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=query_start[1:])  # [R + 1]
        request_of_token = torch.repeat_interleave(torch.arange(len(pieces)), q_lens)  # [num_tokens]
        index_in_query = torch.arange(len(token_ids)) - query_start[request_of_token]  # [num_tokens]
        positions = (ctx_lens - q_lens)[request_of_token] + index_in_query  # [num_tokens]
        slot_mapping = block_tables[request_of_token, positions // block_size] * block_size + positions % block_size
        long = long_queries(query_lens, context_lens, block_tables, block_size)
        (token_ids_t, positions_t, slot_mapping_t, block_tables_t, query_start_t, q_lens_t,
         ctx_lens_t, rows, *long_slots) = upload(
            [torch.tensor(token_ids, dtype=torch.int64), positions, slot_mapping, block_tables,
             query_start, q_lens, ctx_lens, _flat_rows(logit_rows),
             *(slots for _, _, _, slots in long)], self.device)
        batch = FlatBatch(
            token_ids=token_ids_t,
            positions=positions_t,
            slot_mapping=slot_mapping_t,
            query_lens=query_lens,
            context_lens=context_lens,
            context_in_place=[False] * len(pieces),
            context_offsets=[0] * len(pieces),
            gather_blocks=torch.empty(0, dtype=torch.int64, device=self.device),
            block_tables=block_tables_t,
            query_start=query_start_t,
            query_lens_t=q_lens_t,
            context_lens_t=ctx_lens_t,
            long_queries=[(start, q_len, ctx_len, slots) for (start, q_len, ctx_len, _), slots
                          in zip(long, long_slots)],
        )
        return batch, logit_rows, rows


def _flat_rows(logit_rows: list[list[int]]) -> torch.Tensor:
    """The pass-local rows that need logits, every piece's in order: [num_logit_rows] int64."""
    return torch.tensor(list(itertools.chain.from_iterable(logit_rows)), dtype=torch.int64)


def long_queries(query_lens: list[int], context_lens: list[int], block_tables: torch.Tensor,
                 block_size: int, min_len: int = LONG_QUERY_MIN_TOKENS
                 ) -> list[tuple[int, int, int, torch.Tensor]]:
    """(first token row, new tokens, context length, context cache slots [context_len] int64) of
    the requests with at least `min_len` new tokens: the rule the PAGED kernel applies to skip
    them. block_tables [num_requests, max_blocks] int64 (CPU)."""
    spans, start = [], 0
    for r, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens)):
        if q_len >= min_len:
            pos = torch.arange(ctx_len)
            slots = block_tables[r, pos // block_size] * block_size + pos % block_size  # [ctx_len]
            spans.append((start, q_len, ctx_len, slots))
        start += q_len
    return spans


ATTENTION_ENV = "DSPARK_ATTENTION"
"""Names the `AttentionImpl` (its value, e.g. `per_request`) of every runner that is not given one:
a whole service stack or benchmark compares implementations without a flag in each process."""


def choose_weights(config: RunnerConfig, model_dir: str | Path | None, device: torch.device,
                   dtype: torch.dtype) -> str:
    """RunnerConfig.weights resolved for this model folder (None: a model passed in) and machine."""
    problems = []
    if device.type != "cpu" or dtype != torch.float32:
        problems.append("it runs on a CPU in float32 only")
    if model_dir is None or find_gguf(model_dir) is None:
        problems.append("the model folder has no GGUF file (dspark fetch-model keeps it)")
    elif not block_kernel_available():
        problems.append("its C++ kernel does not build here")
    if config.weights is None and not problems and block_kernel_isa() not in ("avx512", "avx2"):
        return "dense"  # the portable loops are exact but slower than the packed float32 path
    if config.weights == "q4" and problems:
        raise ValueError("weights='q4' does not apply: " + "; ".join(problems))
    if config.weights is None:
        return "dense" if problems else "q4"
    return config.weights


def _check_blocks(model: Transformer, blocks: dict) -> None:
    """The GGUF blocks of the first and last layer and of the LM head must dequantise to the
    folder's float32 weights bit for bit (the file is the one the folder was made from)."""
    last = model.config.num_hidden_layers - 1
    dense = {}
    for name in blocks:
        if name == "lm_head" or name.startswith(("layers.0.", f"layers.{last}.")):
            module = model.get_submodule(name)
            dense[name] = module.weight.t() if module.transposed else module.weight  # [out, in]
    check_against_dense({name: blocks[name] for name in dense}, dense)


def default_attention(device: torch.device) -> AttentionImpl:
    """$DSPARK_ATTENTION when set; else PAGED on a CPU where its kernel builds, else per-request
    SDPA; PADDED on other devices."""
    if os.environ.get(ATTENTION_ENV):
        try:
            return AttentionImpl(os.environ[ATTENTION_ENV])
        except ValueError:
            raise ValueError(f"{ATTENTION_ENV}={os.environ[ATTENTION_ENV]!r}: expected one of "
                             f"{', '.join(a.value for a in AttentionImpl)}") from None
    if device.type != "cpu":
        return AttentionImpl.PADDED
    return AttentionImpl.PAGED if cpu_kernel_available() else AttentionImpl.PER_REQUEST


def generate_greedy(runner: TargetRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
    """Greedy-decode all prompts concurrently (one flattened forward per step); new tokens per prompt.

    A stream stops after `max_new_tokens` or after emitting a token in `stop_token_ids` (kept).
    """
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    stop = set(stop_token_ids)
    request_ids = [("generate_greedy", id(prompts), i) for i in range(len(prompts))]
    for rid in request_ids:
        runner.add_request(rid)
    try:
        outputs: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        items = [ForwardItem(request_ids[i], list(prompts[i])) for i in active]
        while active:
            next_tokens = argmax_first(runner.forward(items).logits).tolist()
            still = []
            for i, tok in zip(active, next_tokens):
                outputs[i].append(tok)
                if tok not in stop and len(outputs[i]) < max_new_tokens:
                    still.append(i)
            active = still
            items = [ForwardItem(request_ids[i], [outputs[i][-1]]) for i in active]
        return outputs
    finally:
        for rid in request_ids:
            runner.free(rid)
