"""Paged KV cache: fixed-size blocks, a block table per request, a free list.

Glossary
- *slot*: one token's place in the cache storage; slot = block_id * block_size + offset.
- *block*: `block_size` consecutive slots; the unit of allocation.
- *block table*: a request's blocks in order; the token at position p lives in slot
  `block_table[p // block_size] * block_size + p % block_size`.
- *length*: how many tokens of the request have K/V in the cache (its positions 0..length-1).

`BlockManager` does the accounting (pure Python, no tensors but the slot indices it hands out);
`PagedKVCache` adds the K/V storage. Growing is all-or-nothing: if the free blocks cannot cover a
whole batch, `KVCacheFull` is raised and nothing changed, so the caller can make a request wait
or refuse it. Truncating (dropping rejected drafts, docs/design.md section 5) returns the blocks that
are no longer needed to the free list.

Forking (`PagedKVCache.fork`, the n samples of one prompt): a new request gets its own blocks
holding a copy of another's first tokens' K/V. Copying rather than sharing full blocks under
a reference count keeps every block owned by one request, so truncation, freeing, growth into
the next block and the contiguous fast path of attention stay as they are; the copy costs one
device copy of the prefix per child, which is small beside the forward it replaces.

Placement. Any free block can serve any request (that is what makes the cache paged), but which
one is chosen matters on a CPU: attention over a request whose blocks happen to be consecutive
reads its K/V in place, while scattered blocks must first be gathered into a copy, and that copy
costs as much memory traffic as the attention itself. So a request grows into the block right
after its last one when that block is free, and a request that starts (or cannot continue) takes
the middle of the largest free run, leaving room on both sides; under memory pressure blocks
scatter and attention falls back to gathering, with the same results.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

RequestId = Hashable


class KVCacheFull(RuntimeError):
    """The free list cannot hold the tokens asked for; the cache state is unchanged."""

    def __init__(self, blocks_needed: int, blocks_free: int) -> None:
        super().__init__(f"KV cache full: {blocks_needed} more blocks needed, {blocks_free} free")
        self.blocks_needed = blocks_needed
        self.blocks_free = blocks_free


class BlockManager:
    """Block accounting of a paged cache: free blocks, block tables and lengths per request."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._is_free: list[bool] = [True] * num_blocks
        self._num_free = num_blocks
        self._tables: dict[RequestId, list[int]] = {}
        self._lengths: dict[RequestId, int] = {}

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """The fraction of blocks that hold some request's tokens (0..1; vLLM's
        kv_cache_usage_perc)."""
        return (self.num_blocks - self._num_free) / self.num_blocks

    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self._tables

    @property
    def request_ids(self) -> list[RequestId]:
        return list(self._tables)

    def length(self, request_id: RequestId) -> int:
        return self._lengths[self._check(request_id)]

    def block_table(self, request_id: RequestId) -> list[int]:
        return list(self._tables[self._check(request_id)])

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, grow: Mapping[RequestId, int]) -> int:
        """How many free blocks growing each request by `grow[request_id]` tokens would take."""
        return sum(
            max(0, self.blocks_for(self._lengths[self._check(rid)] + n) - len(self._tables[rid]))
            for rid, n in grow.items())

    def block_ids(self, request_id: RequestId, num_tokens: int) -> list[int]:
        """The blocks holding the request's first `num_tokens` tokens, in order."""
        table = self._tables[self._check(request_id)]
        needed = self.blocks_for(num_tokens)
        if needed > len(table):
            raise IndexError(f"{num_tokens} tokens exceed the {len(table)} blocks of {request_id!r}")
        return table[:needed]

    def slots(self, request_id: RequestId, start: int, end: int) -> torch.Tensor:
        """Slot indices [end - start] (int64) of positions start..end-1 of the request."""
        table = self._tables[self._check(request_id)]
        if not 0 <= start <= end <= len(table) * self.block_size:
            raise IndexError(f"positions {start}..{end} outside the {len(table)} blocks of {request_id!r}")
        first, last = start // self.block_size, self.blocks_for(end)
        blocks = torch.tensor(table[first:last], dtype=torch.int64)
        offsets = torch.arange(self.block_size, dtype=torch.int64)
        all_slots = (blocks[:, None] * self.block_size + offsets).flatten()
        skip = start - first * self.block_size
        return all_slots[skip:skip + end - start]

    # -- updates -------------------------------------------------------------------------------
    def add_request(self, request_id: RequestId) -> None:
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already in the cache")
        self._tables[request_id] = []
        self._lengths[request_id] = 0

    def grow(self, grow: Mapping[RequestId, int]) -> None:
        """Lengthen each request by `grow[request_id]` tokens, allocating blocks: all or nothing.

        Raises KVCacheFull (state unchanged) when the free list is too short for the whole batch.
        """
        for rid, n in grow.items():
            if n < 0:
                raise ValueError(f"cannot grow {rid!r} by {n} tokens")
        needed = self.extra_blocks_needed(grow)
        if needed > self._num_free:
            raise KVCacheFull(needed, self._num_free)
        for rid, n in grow.items():
            new_length = self._lengths[rid] + n
            table = self._tables[rid]
            while len(table) < self.blocks_for(new_length):
                table.append(self._take_block(table[-1] + 1 if table else None))
            self._lengths[rid] = new_length

    def truncate(self, request_id: RequestId, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens; blocks past them go back to the free list."""
        length = self._lengths[self._check(request_id)]
        if not 0 <= num_tokens <= length:
            raise ValueError(f"cannot truncate {request_id!r} of length {length} to {num_tokens}")
        table = self._tables[request_id]
        keep = self.blocks_for(num_tokens)
        for block in table[keep:]:
            self._is_free[block] = True
        self._num_free += len(table) - keep
        del table[keep:]
        self._lengths[request_id] = num_tokens

    def free(self, request_id: RequestId) -> None:
        """Forget the request and return all its blocks."""
        self.truncate(request_id, 0)
        del self._tables[request_id], self._lengths[request_id]

    def _take_block(self, preferred: int | None) -> int:
        """Mark a free block used: `preferred` if free, else the middle of the largest free run."""
        if preferred is None or preferred >= self.num_blocks or not self._is_free[preferred]:
            preferred = self._placement()
        self._is_free[preferred] = False
        self._num_free -= 1
        return preferred

    def _placement(self) -> int:
        """A block in the largest run of free blocks: its start when nothing precedes the run
        (block 0), else its middle, so the request before the run keeps room to grow."""
        best_start, best_len, start = 0, 0, None
        for block, free in enumerate(self._is_free + [False]):
            if free and start is None:
                start = block
            elif not free and start is not None:
                if block - start > best_len:
                    best_start, best_len = start, block - start
                start = None
        assert best_len > 0, "no free block (grow checks the count first)"
        return best_start if best_start == 0 else best_start + best_len // 2

    def contiguous_start(self, request_id: RequestId, num_tokens: int) -> int | None:
        """First slot of the request's first `num_tokens` tokens when their blocks are consecutive
        (positions 0..num_tokens-1 are then slots start..start+num_tokens-1), else None."""
        blocks = self.block_ids(request_id, num_tokens)
        if not blocks or blocks[-1] - blocks[0] != len(blocks) - 1:
            return None
        if any(b + 1 != c for b, c in zip(blocks, blocks[1:])):
            return None
        return blocks[0] * self.block_size

    def _check(self, request_id: RequestId) -> RequestId:
        if request_id not in self._tables:
            raise KeyError(f"unknown request {request_id!r}")
        return request_id


class PagedKVCache:
    """K/V storage for all layers plus the block accounting.

    Storage per layer is [num_blocks, block_size, num_kv_heads, head_dim]. Attention gathers whole
    blocks (`gather`): one contiguous copy of block_size * num_kv_heads * head_dim values per
    block, measured about 2x faster on CPU than gathering token by token.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str,
                 zeroed: bool = False) -> None:
        self.manager = BlockManager(num_blocks, block_size)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Pages of a torch.empty tensor are only committed when first written, so a generous
        # cache costs memory only as it fills. `zeroed`: every slot starts finite, for an
        # attention that multiplies masked slots by zero (AttentionImpl.FLEX).
        allocate = torch.zeros if zeroed else torch.empty
        self.k = allocate(shape, dtype=dtype, device=device)
        self.v = allocate(shape, dtype=dtype, device=device)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values k, v [num_tokens, num_kv_heads, head_dim] at slot_mapping [num_tokens]."""
        self.k[layer].flatten(0, 1).index_copy_(0, slot_mapping, k)
        self.v[layer].flatten(0, 1).index_copy_(0, slot_mapping, v)

    def fork(self, parent: RequestId, child: RequestId, num_tokens: int) -> None:
        """A new request `child` whose first `num_tokens` positions hold a copy of `parent`'s
        K/V there (all layers). Raises KVCacheFull (nothing changed) when the free blocks
        cannot hold them."""
        manager = self.manager
        if not 0 < num_tokens <= manager.length(parent):
            raise ValueError(f"cannot fork {num_tokens} tokens of {parent!r} "
                             f"(it holds {manager.length(parent)})")
        manager.add_request(child)
        try:
            manager.grow({child: num_tokens})
        except KVCacheFull:
            manager.free(child)
            raise
        source = manager.slots(parent, 0, num_tokens)  # [num_tokens]
        target = manager.slots(child, 0, num_tokens)  # [num_tokens]
        if source.device != self.k.device:
            source, target = source.to(self.k.device), target.to(self.k.device)
        for storage in (self.k, self.v):  # [num_layers, num_blocks, block_size, kv, hd]
            flat = storage.flatten(1, 2)  # [num_layers, num_slots, kv, hd], a view
            flat.index_copy_(1, target, flat.index_select(1, source))

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [len(block_ids) * block_size, num_kv_heads, head_dim] of whole blocks (a copy)."""
        return (self.k[layer].index_select(0, block_ids).flatten(0, 1),
                self.v[layer].index_select(0, block_ids).flatten(0, 1))
