"""BlockManager: reference counts, the LRU free queue, prefix caching."""

from __future__ import annotations

from pagedserve.actors.messages import AddRequest, SamplingParams
from pagedserve.actors.scheduler.block_manager import BlockManager, hash_block
from pagedserve.actors.scheduler.request import Request


def make_request(tokens: list[int], handle: int = 0) -> Request:
    add = AddRequest(
        client=b"c", seq=handle, prompt_token_ids=tokens, sampling=SamplingParams(),
        eos_token_ids=[],
    )  # fmt: skip
    return Request.from_add(add, handle, seed=0)


def admit(bm: BlockManager, req: Request) -> list[int]:
    """Allocate the whole prompt (reusing the cached prefix) and register its full blocks."""
    cached = bm.find_cached_prefix(req)
    assert bm.can_allocate(cached, req.num_tokens)
    bm.allocate(req, cached, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return cached


def test_hash_is_stable_and_chained() -> None:
    a = hash_block(b"", [1, 2, 3, 4])
    assert a == hash_block(b"", [1, 2, 3, 4])
    assert a != hash_block(b"", [1, 2, 3, 5])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(b"", [5, 6, 7, 8])
    # fixed across processes: no Python hash() randomization
    assert a.hex() == hash_block(b"", [1, 2, 3, 4]).hex() and len(a) == 16


def test_same_block_content_under_another_prefix_is_a_miss() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    admit(bm, make_request([1, 1, 2, 2, 3, 3, 0], 1))
    assert bm.find_cached_prefix(make_request([1, 1, 3, 3, 2, 2, 0], 2)) == [0]


def test_shared_prefix_refcounts_then_freed_to_zero() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    r1 = make_request(list(range(10)), 3)  # blocks: [0-3] [4-7] [8-9 partial]
    assert admit(bm, r1) == []
    r2 = make_request(list(range(8)) + [99, 98, 97], 4)
    hit = admit(bm, r2)
    assert hit == r1.block_table[:2]
    assert [bm.blocks[b].ref_count for b in hit] == [2, 2]
    assert bm.blocks[r1.block_table[2]].ref_count == 1
    assert bm.blocks[r2.block_table[2]].ref_count == 1
    assert bm.num_free_blocks == 8 - 4
    bm.deallocate(r1)
    assert [bm.blocks[b].ref_count for b in hit] == [1, 1]
    bm.deallocate(r2)
    assert all(bm.blocks[b].ref_count == 0 for b in range(8))
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_lru_eviction_reuses_oldest_freed_block_and_drops_its_hash() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    r1, r2 = make_request([1, 2, 3, 4], 3), make_request([6, 7, 8, 9], 4)
    admit(bm, r1)
    admit(bm, r2)
    assert bm.num_free_blocks == 0
    bm.deallocate(r1)  # tail first: r1's blocks enter the queue last block first
    bm.deallocate(r2)
    order = list(bm.free_queue)
    assert order == [1, 0, 3, 2]  # r1 = blocks 0, 1 ; r2 = blocks 2, 3
    # Freed blocks are still findable.
    assert bm.find_cached_prefix(make_request([1, 2, 3, 4, 0])) == [0, 1]
    # A new request with unrelated tokens takes the oldest freed block (r1's tail, block 1).
    r3 = make_request([42, 43])
    bm.allocate(r3, [], 2)
    assert r3.block_table == [1]
    assert bm.blocks[1].hash is None
    assert bm.find_cached_prefix(make_request([1, 2, 3, 4, 0])) == [0]  # chain now ends early
    assert bm.find_cached_prefix(make_request([6, 7, 8, 9, 0])) == [2, 3]


def test_hit_on_free_cached_block_revives_it() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    r1 = make_request([1, 2, 3, 4, 5])
    admit(bm, r1)
    bm.deallocate(r1)
    r2 = make_request([1, 2, 3, 4, 7])
    cached = bm.find_cached_prefix(r2)
    assert cached == [0, 1]
    assert bm.can_allocate(cached, 5)  # 2 revived + 1 new = 3 free blocks
    assert not bm.can_allocate(cached, 7)
    bm.allocate(r2, cached, 5)
    assert r2.block_table[:2] == [0, 1] and bm.num_free_blocks == 0
    assert bm.blocks[0].hash is not None  # revived blocks keep their hash


def test_hit_never_covers_the_whole_prompt() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, make_request(list(range(8)), 1))
    # Same 8 tokens: at least one token must be computed, so only the first block is a hit.
    assert len(bm.find_cached_prefix(make_request(list(range(8)), 2))) == 1
    assert len(bm.find_cached_prefix(make_request(list(range(9)), 5))) == 2


def test_only_blocks_of_known_tokens_are_cached() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    req = make_request([1, 2, 3])
    bm.allocate(req, [], 4)
    # The 4th slot holds a sampled token still in flight: computed but unknown.
    req.num_computed_tokens = 4
    req.num_inflight = 1
    bm.cache_full_blocks(req)
    assert bm.blocks[req.block_table[0]].hash is None and req.block_hashes == []
    req.num_inflight = 0
    req.token_ids.append(4)  # the token arrives
    bm.cache_full_blocks(req)
    assert bm.blocks[req.block_table[0]].hash == hash_block(b"", [1, 2, 3, 4])


def test_duplicate_block_is_not_registered_twice() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_request([1, 2, 3], 1), make_request([1, 2, 3], 2)
    for req in (a, b):  # both miss, then both compute the same block
        bm.allocate(req, [], 3)
    for req in (a, b):
        req.num_computed_tokens = 3
        bm.cache_full_blocks(req)
    assert bm.cached == {a.block_hashes[0]: a.block_table[0]}
    assert bm.blocks[b.block_table[0]].hash is None
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 4


def test_append_slots_and_usage() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    req = make_request([1, 2, 3])
    bm.allocate(req, [], 3)
    req.num_computed_tokens = 3
    assert bm.append_slots(req, 1) == []  # slot 4 fits in block 0
    req.num_computed_tokens = 4
    assert bm.can_append(req, 12) and not bm.can_append(req, 13)
    assert len(bm.append_slots(req, 5)) == 2
    assert bm.usage == 0.75


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    admit(bm, make_request([1, 2, 3, 4, 5]))
    assert bm.cached == {}
    assert bm.find_cached_prefix(make_request([1, 2, 3, 4, 5])) == []
