"""Paged KV-cache bookkeeping: reference-counted blocks, an LRU free queue, prefix caching.

A full block is identified by a hash that chains its parent block's hash with its token ids,
so equal hashes mean equal prefixes. A freed block keeps its hash and stays findable until it
is handed out again; the free queue is in LRU order (freed blocks go to the tail, allocation
takes from the head), so the block that has been unused the longest is evicted first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from pagedserve.actors.scheduler.request import Request


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and registered in the cache


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Stable (process-independent) hash of a full block given its parent block's hash."""
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent + data, digest_size=16).digest()


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (including cached ones, which are evictable)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    # ------------------------------------------------------------------ new requests

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached chain of `req`'s full blocks, leaving at least one
        token to compute (the model must produce logits for the last one)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._compute_hashes(req, max_blocks)
        hit: list[int] = []
        for h in req.block_hashes[:max_blocks]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def can_allocate(self, cached: list[int], num_tokens: int) -> bool:
        """Whether a request can hold `num_tokens` slots, reusing the `cached` blocks."""
        num_new = cdiv(num_tokens, self.block_size) - len(cached)
        num_revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return num_new + num_revived <= self.num_free_blocks

    def allocate(self, req: Request, cached: list[int], num_tokens: int) -> None:
        """Give `req` (which holds no blocks) the `cached` blocks plus new ones up to
        `num_tokens` slots."""
        assert not req.block_table, f"{req.request_id} already holds blocks"
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
        num_new = cdiv(num_tokens, self.block_size) - len(cached)
        req.block_table = list(cached) + [self._pop_free() for _ in range(num_new)]
        req.num_cached_blocks = len(cached)

    def deallocate(self, req: Request) -> None:
        """Release `req`'s blocks. The tail is freed first, so that a shared prefix is the
        last part of the chain to be evicted."""
        for block_id in reversed(req.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
        req.block_table = []
        req.num_cached_blocks = 0

    # ------------------------------------------------------------------ running requests

    def num_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = -((req.num_computed_tokens + num_new_tokens) // -self.block_size)  # cdiv
        return max(0, total - len(req.block_table))

    def can_append(self, req: Request, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(req, num_new_tokens) <= len(self.free_queue)

    def append_slots(self, req: Request, num_new_tokens: int) -> list[int]:
        """Grow `req`'s block table to hold `num_new_tokens` more; returns the new block ids."""
        num_new = self.num_blocks_needed(req, num_new_tokens)
        if not num_new:  # the usual decode step: the last block has room
            return []
        new = [self._pop_free() for _ in range(num_new)]
        req.block_table.extend(new)
        return new

    def append_slots_all(
        self, reqs: list[Request], num_new_tokens: list[int]
    ) -> list[list[int]] | None:
        """append_slots for each of `reqs` at once: their new block ids, or None (and nothing
        changed) when the free blocks do not hold them all."""
        needed = [self.num_blocks_needed(r, n) for r, n in zip(reqs, num_new_tokens)]
        if sum(needed) > len(self.free_queue):
            return None
        new = [[self._pop_free() for _ in range(k)] for k in needed]
        for req, blocks in zip(reqs, new):
            req.block_table += blocks
        return new

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks of `req` that are full of computed (or scheduled) tokens whose
        ids are all known."""
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens, len(req.token_ids)) // self.block_size
        if num_full <= req.num_cached_blocks:  # the usual step: no block completed
            return
        num_full = min(num_full, len(req.block_table))
        self._compute_hashes(req, num_full)
        for i in range(req.num_cached_blocks, num_full):
            block, h = self.blocks[req.block_table[i]], req.block_hashes[i]
            if block.hash is None and h not in self.cached:
                block.hash = h
                self.cached[h] = block.block_id
        req.num_cached_blocks = max(req.num_cached_blocks, num_full)

    def forget_cached_blocks(self) -> None:
        """The KV cache's contents are lost (the workers restarted): no block is findable."""
        self.cached.clear()
        for block in self.blocks:
            block.hash = None

    # ------------------------------------------------------------------ helpers

    def _compute_hashes(self, req: Request, num_blocks: int) -> None:
        bs = self.block_size
        assert num_blocks * bs <= req.num_tokens, "only blocks of known tokens can be hashed"
        for i in range(len(req.block_hashes), num_blocks):
            parent = req.block_hashes[i - 1] if i else req.hash_root
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs]))

    def _pop_free(self) -> int:
        """Take the least recently freed block, evicting its cached hash."""
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id
