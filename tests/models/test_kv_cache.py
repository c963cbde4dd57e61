"""Paged KV cache: block accounting, free list, slot mapping, all-or-nothing growth."""

from __future__ import annotations

import pytest
import torch

from dspark.models.kv_cache import BlockManager, KVCacheFull, PagedKVCache


def snapshot(m: BlockManager) -> tuple:
    return (m.num_free_blocks, {r: (m.length(r), m.block_table(r)) for r in m.request_ids})


def test_blocks_allocated_on_demand_and_accounted():
    m = BlockManager(num_blocks=8, block_size=4)
    m.add_request("a")
    assert m.length("a") == 0 and m.block_table("a") == [] and m.num_free_blocks == 8
    m.grow({"a": 5})  # 5 tokens -> 2 blocks
    assert m.length("a") == 5 and len(m.block_table("a")) == 2 and m.num_free_blocks == 6
    m.grow({"a": 3})  # 8 tokens still fit in 2 blocks
    assert len(m.block_table("a")) == 2 and m.num_free_blocks == 6
    m.grow({"a": 1})
    assert len(m.block_table("a")) == 3 and m.num_free_blocks == 5
    assert m.capacity_tokens == 32


def test_usage_is_the_fraction_of_blocks_in_use():
    m = BlockManager(num_blocks=8, block_size=4)
    assert m.usage == 0.0
    m.add_request("a")
    m.add_request("b")
    m.grow({"a": 5, "b": 4})  # 2 + 1 blocks
    assert m.usage == 3 / 8
    m.truncate("a", 4)  # a's second block goes back
    assert m.usage == 2 / 8
    m.free("a")
    m.free("b")
    assert m.usage == 0.0


def test_slots_follow_the_block_table():
    m = BlockManager(num_blocks=8, block_size=4)
    m.add_request("a")
    m.add_request("b")
    m.grow({"a": 3})
    m.grow({"b": 6})
    m.grow({"a": 3})  # a now spans its first block and a block allocated after b's
    table = m.block_table("a")
    expected = [table[p // 4] * 4 + p % 4 for p in range(6)]
    assert m.slots("a", 0, 6).tolist() == expected
    assert m.slots("a", 2, 5).tolist() == expected[2:5]
    assert m.slots("a", 4, 4).tolist() == []
    # No slot is shared between requests.
    assert not set(m.slots("a", 0, 6).tolist()) & set(m.slots("b", 0, 6).tolist())
    with pytest.raises(IndexError):
        m.slots("a", 0, 9)  # past the allocated blocks


def test_truncate_frees_blocks_no_longer_needed():
    m = BlockManager(num_blocks=8, block_size=4)
    m.add_request("a")
    m.grow({"a": 10})  # 3 blocks
    kept = m.block_table("a")[:2]
    m.truncate("a", 8)
    assert m.length("a") == 8 and m.block_table("a") == kept and m.num_free_blocks == 6
    m.truncate("a", 5)  # still 2 blocks
    assert m.block_table("a") == kept and m.num_free_blocks == 6
    m.truncate("a", 0)
    assert m.block_table("a") == [] and m.num_free_blocks == 8
    with pytest.raises(ValueError):
        m.truncate("a", 1)  # cannot grow by truncating


def test_free_returns_blocks_and_they_are_reused():
    m = BlockManager(num_blocks=4, block_size=2)
    m.add_request("a")
    m.grow({"a": 8})
    assert m.num_free_blocks == 0
    blocks = set(m.block_table("a"))
    m.free("a")
    assert "a" not in m and m.num_free_blocks == 4
    m.add_request("b")
    m.grow({"b": 8})
    assert set(m.block_table("b")) == blocks


def test_kv_cache_full_leaves_state_unchanged():
    m = BlockManager(num_blocks=4, block_size=4)
    for r in "abc":
        m.add_request(r)
    m.grow({"a": 6, "b": 3})  # 3 blocks used, 1 free
    before = snapshot(m)
    # a needs 0 more blocks for +2, b needs 1 for +2, c needs 1 for +1: 2 > 1 free.
    with pytest.raises(KVCacheFull) as err:
        m.grow({"a": 2, "b": 2, "c": 1})
    assert isinstance(err.value, RuntimeError)
    assert (err.value.blocks_needed, err.value.blocks_free) == (2, 1)
    assert snapshot(m) == before
    m.grow({"a": 2, "b": 2})  # what fits still works
    assert m.num_free_blocks == 0 and m.length("a") == 8 and m.length("b") == 5


def test_request_errors():
    m = BlockManager(num_blocks=2, block_size=2)
    m.add_request("a")
    with pytest.raises(ValueError):
        m.add_request("a")
    with pytest.raises(KeyError):
        m.grow({"zzz": 1})
    with pytest.raises(KeyError):
        m.free("zzz")
    with pytest.raises(ValueError):
        m.grow({"a": -1})


def test_paged_storage_roundtrip():
    torch.manual_seed(0)
    cache = PagedKVCache(num_layers=2, num_kv_heads=3, head_dim=5, num_blocks=6, block_size=4,
                         dtype=torch.float32, device="cpu")
    m = cache.manager
    m.add_request("a")
    m.add_request("b")
    k_a, v_a = torch.randn(7, 3, 5), torch.randn(7, 3, 5)
    k_b, v_b = torch.randn(5, 3, 5), torch.randn(5, 3, 5)
    m.grow({"a": 3, "b": 5})
    m.grow({"a": 4})  # interleaved blocks
    cache.write(1, m.slots("a", 0, 7), k_a, v_a)
    cache.write(1, m.slots("b", 0, 5), k_b, v_b)
    blocks_a = torch.tensor(m.block_ids("a", 7))
    k, v = cache.gather(1, blocks_a)  # [2 blocks * 4, num_kv_heads, head_dim]: a's tokens, then garbage
    assert k.shape == (8, 3, 5)
    assert torch.equal(k[:7], k_a) and torch.equal(v[:7], v_a)
    k, v = cache.gather(1, torch.tensor(m.block_ids("b", 5)[1:]))  # b's second block: positions 4..7
    assert torch.equal(k[:1], k_b[4:]) and torch.equal(v[:1], v_b[4:])
    cache.write(0, m.slots("b", 0, 5), k_b, v_b)  # layers are separate
    assert not torch.equal(cache.gather(0, blocks_a)[0][:7], k_a)


def test_block_ids_cover_the_tokens():
    m = BlockManager(num_blocks=8, block_size=4)
    m.add_request("a")
    m.grow({"a": 9})
    assert m.block_ids("a", 9) == m.block_table("a")
    assert m.block_ids("a", 4) == m.block_table("a")[:1]
    assert m.block_ids("a", 0) == []
    with pytest.raises(IndexError):
        m.block_ids("a", 13)


def test_interleaved_growth_keeps_requests_contiguous():
    """Placement: each request grows into the block after its last, the next request starts in the
    middle of the largest free run, so decode-style interleaved growth keeps contexts in place."""
    m = BlockManager(num_blocks=64, block_size=4)
    for r in "abcd":
        m.add_request(r)
        m.grow({r: 6})
    for _ in range(20):  # 20 decode steps of 1 token each, interleaved
        m.grow({r: 1 for r in "abcd"})
    for r in "abcd":
        table = m.block_table(r)
        assert table == list(range(table[0], table[0] + 7))  # 26 tokens -> 7 consecutive blocks
        assert m.contiguous_start(r, 26) == table[0] * 4
        assert m.slots(r, 0, 26).tolist() == list(range(table[0] * 4, table[0] * 4 + 26))
    assert m.num_free_blocks == 64 - 4 * 7


def test_contiguous_start_none_when_scattered():
    m = BlockManager(num_blocks=4, block_size=2)
    for r in "wxyz":
        m.add_request(r)
        m.grow({r: 2})  # one block each: the cache is full
    owner = {m.block_table(r)[0]: r for r in "wxyz"}
    m.free(owner[0])
    m.free(owner[2])  # free blocks 0 and 2: not adjacent
    m.add_request("a")
    m.grow({"a": 4})
    assert m.block_table("a") == [0, 2] or m.block_table("a") == [2, 0]
    assert m.contiguous_start("a", 4) is None
    assert m.contiguous_start("a", 2) == m.block_table("a")[0] * 2  # one block is always contiguous
