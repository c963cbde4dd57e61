"""The drafter's per-request context: every layer's keys and values of the context tokens
(`RequestContext`), kept per request (`ContextKVCache`).

The context enters the drafter only as extra keys and values (context K/V injection, see
`dspark.models.drafter_layers`), and each context token's keys and values depend on that token
alone, so the drafter projects them once and appends each round's accepted tokens' features.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

# Position given to padding slots of a gathered context (here and in the drafter's static round
# buffers, dspark.models.draft_graph_runner): never < any anchor position, so masked.
PAD_POSITION = 2**62


class RequestContext:
    """Keys/values of one request's context tokens for every layer, in a growable buffer.

    Slots past `length` are scratch space: drafting writes the block's own keys/values there so
    that attention reads [context; block] straight from this buffer, without copying the context.
    With `hidden_size` > 0 it also keeps each context token's fused state H_ctx [capacity, hidden]
    (for `DrafterConfig.inject_last_context`).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, capacity: int = 64,
                 hidden_size: int = 0) -> None:
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.hidden = torch.empty(capacity if hidden_size else 0, hidden_size, dtype=dtype,
                                  device=device)
        self.positions = torch.empty(capacity, dtype=torch.int64, device=device)
        self.length = 0
        self.max_position = -1
        """The largest context position (host int; -1: none)."""
        self.last_position = -1
        """The position of the last context slot (host int; -1: none)."""
        self.min_position = PAD_POSITION
        """The smallest context position (host int; PAD_POSITION: none)."""

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` slots (amortised doubling)."""
        if capacity <= self.keys.shape[2]:
            return
        cap = max(capacity, 2 * self.keys.shape[2])
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], cap, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        pos = self.positions.new_empty(cap)
        pos[: self.length] = self.positions[: self.length]
        self.positions = pos
        if self.hidden.shape[0]:
            hidden = self.hidden.new_empty(cap, self.hidden.shape[1])
            hidden[: self.length] = self.hidden[: self.length]
            self.hidden = hidden

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               hidden: torch.Tensor | None = None,
               host_positions: torch.Tensor | None = None) -> None:
        """keys/values [num_layers, num_kv_heads, n, head_dim], positions [n], hidden [n, hidden]
        (required iff the context keeps fused states). host_positions [n]: the same positions
        on the host, where the caller has them (they come from the host), so that the bounds
        kept here are read without waiting for the device; None: read from `positions`."""
        n = keys.shape[2]
        need = self.length + n
        assert (hidden is not None) == bool(self.hidden.shape[1]), "fused states: all or none"
        self.reserve(need)
        self.keys[:, :, self.length: need] = keys
        self.values[:, :, self.length: need] = values
        self.positions[self.length: need] = positions
        if hidden is not None:
            self.hidden[self.length: need] = hidden
        self.length = need
        if n:
            known = positions if host_positions is None else host_positions
            self.last_position = int(known[-1])
            self.max_position = max(self.max_position, int(known.max()))
            self.min_position = min(self.min_position, int(known.min()))

    def visibility(self, anchor_position: int, block_size: int) -> torch.Tensor | None:
        """Mask [block_size, length + block_size] of what a block at `anchor_position` may see
        (context positions < anchor, the whole block), or None when it may see everything."""
        if self.max_position < anchor_position:
            return None
        mask = torch.ones(block_size, self.length + block_size, dtype=torch.bool,
                          device=self.positions.device)
        mask[:, : self.length] = self.positions[: self.length] < anchor_position
        return mask

    def last_hidden(self, anchor_position: int) -> torch.Tensor | None:
        """The fused state [hidden] of the latest context position before `anchor_position`
        (the most recently appended one if a position occurs twice), or None if there is none."""
        if self.length == 0 or self.min_position >= anchor_position:
            return None
        last = self.length - 1
        if self.last_position == self.max_position < anchor_position:
            return self.hidden[last]  # the usual case: appended in order, all before the anchor
        # On the device, without reading it: the last slot holding the largest visible position.
        positions = self.positions[: self.length]  # [length]
        visible = positions < anchor_position
        best = torch.where(visible, positions, -1).max()
        slots = torch.arange(self.length, device=positions.device)
        slot = torch.where(visible & (positions == best), slots, -1).max()  # a visible one exists
        return self.hidden.index_select(0, slot.view(1))[0]


class ContextKVCache:
    """The drafter's per-request context: projected context keys/values of every layer."""

    def __init__(self) -> None:
        self._requests: dict[Hashable, RequestContext] = {}

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def length(self, request_id: Hashable) -> int:
        ctx = self._requests.get(request_id)
        return 0 if ctx is None else ctx.length

    def append(self, request_id: Hashable, keys: torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor, hidden: torch.Tensor | None = None,
               host_positions: torch.Tensor | None = None) -> None:
        """As RequestContext.append, for the request's context (created on first use)."""
        ctx = self._requests.get(request_id)
        if ctx is None:
            ctx = RequestContext(keys.shape[0], keys.shape[1], keys.shape[3], keys.dtype,
                                 keys.device, capacity=max(64, keys.shape[2]),
                                 hidden_size=0 if hidden is None else hidden.shape[-1])
            self._requests[request_id] = ctx
        ctx.append(keys, values, positions, hidden, host_positions)

    def release(self, request_id: Hashable) -> None:
        self._requests.pop(request_id, None)

    def fork(self, parent: Hashable, child: Hashable, num_positions: int) -> None:
        """`child`'s context: a copy of `parent`'s context tokens at positions < num_positions
        (their keys, values, positions and fused states, in the parent's order); none when the
        parent has none there. Replaces whatever `child` had."""
        self._requests.pop(child, None)
        ctx = self._requests.get(parent)
        if ctx is None or ctx.length == 0:
            return
        if ctx.max_position < num_positions:  # the usual case: all of it
            keep = torch.arange(ctx.length, device=ctx.positions.device)
        else:
            keep = torch.nonzero(ctx.positions[: ctx.length] < num_positions).flatten()
        n = int(keep.numel())
        if n == 0:
            return
        copy = RequestContext(ctx.keys.shape[0], ctx.keys.shape[1], ctx.keys.shape[3],
                              ctx.keys.dtype, ctx.keys.device, capacity=max(64, n),
                              hidden_size=ctx.hidden.shape[1] if ctx.hidden.shape[0] else 0)
        positions = ctx.positions.index_select(0, keep)  # [n]
        copy.append(ctx.keys.index_select(2, keep), ctx.values.index_select(2, keep), positions,
                    ctx.hidden.index_select(0, keep) if ctx.hidden.shape[0] else None,
                    host_positions=positions.cpu())
        self._requests[child] = copy

    def get(self, request_id: Hashable) -> RequestContext | None:
        return self._requests.get(request_id)

    def gather(self, request_ids: Sequence[Hashable], num_layers: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded copy for batched attention (the Eagle-style drafter): keys/values
        [num_layers, R, num_kv_heads, L_max, head_dim], positions [R, L_max] (padding slots at
        PAD_POSITION, so masked)."""
        return gather_padded([self._requests.get(rid) for rid in request_ids], num_layers,
                             num_kv_heads, head_dim, dtype, device)


def gather_padded(contexts: Sequence[RequestContext | None], num_layers: int, num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype, device: torch.device, extra_slots: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contexts side by side for one attention call over all of them: keys/values
    [num_layers, R, num_kv_heads, L_max + extra_slots, head_dim] and positions [R, L_max]
    (L_max: the longest context; None: an empty one). Padding slots hold zeros (finite, so a
    masked slot adds exactly nothing) at position PAD_POSITION, which no anchor exceeds: a
    mask of `positions < anchor` hides them. The `extra_slots` after L_max are scratch for the
    caller (the drafted block's own keys/values).

    A single request is not copied: its buffer's own slots, with its scratch slots past `length`
    as the extra ones (the caller has reserved them)."""
    lengths = [0 if c is None else c.length for c in contexts]
    R, L = len(contexts), max(lengths, default=0)
    if R == 1 and contexts[0] is not None:
        c = contexts[0]
        assert c.keys.shape[2] >= c.length + extra_slots, "reserve the scratch slots first"
        end = c.length + extra_slots
        return c.keys[:, None, :, :end], c.values[:, None, :, :end], c.positions[None, : c.length]
    keys = torch.zeros(num_layers, R, num_kv_heads, L + extra_slots, head_dim, dtype=dtype,
                       device=device)
    values = torch.zeros_like(keys)
    positions = torch.full((R, L), PAD_POSITION, dtype=torch.int64, device=device)
    for r, c in enumerate(contexts):
        if c is not None and c.length:
            keys[:, r, :, : c.length] = c.keys[:, :, : c.length]
            values[:, r, :, : c.length] = c.values[:, :, : c.length]
            positions[r, : c.length] = c.positions[: c.length]
    return keys, values, positions
