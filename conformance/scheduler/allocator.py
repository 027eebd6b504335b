"""A block allocator for one KV cache group: free queue, reference counts, and the prefix cache.

Block 0 is the null block and is never handed out. Blocks never used yet are produced lazily in an
order chosen by a knob (so a group of 2**26 blocks costs nothing and can still hand out ids past
2**31 / block_size); freed blocks join an LRU queue and keep their prefix-cache hash until reused,
as vLLM's free block queue does.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterator

from spec.types import NULL_BLOCK_ID

ALLOCATION_ORDERS = ("ascending", "descending", "random")


class BlockAllocator:
    def __init__(self, num_blocks: int, order: str = "ascending", reuse_freed_first: bool = False, seed: int = 0):
        if order not in ALLOCATION_ORDERS:
            raise ValueError(f"allocation order {order!r} not in {ALLOCATION_ORDERS}")
        self.num_blocks = num_blocks
        self.num_usable = num_blocks - 1  # every block but the null block
        self.reuse_freed_first = reuse_freed_first
        self._order = order
        self._num_fresh_used = 0  # fresh blocks handed out so far: the next is _fresh(_num_fresh_used)
        self._freed: OrderedDict[int, None] = OrderedDict()  # LRU: freed first -> evicted first
        self.ref_count: dict[int, int] = {}  # block -> holders; only blocks with holders
        # key -> block (full, computed blocks): the chained block hash, with the group's index where groups
        # share one allocator (vLLM's BlockHashWithGroupId: a block caches one group's KV)
        self.cached: dict[Hashable, int] = {}
        self.hash_of: dict[int, Hashable] = {}  # block -> its key while cached
        rng = random.Random(seed)
        # random order: an affine bijection of [0, num_usable), so it stays lazy for huge groups
        self._stride = 1
        if order == "random" and self.num_usable > 1:
            self._stride = rng.randrange(1, self.num_usable)
            while math.gcd(self._stride, self.num_usable) != 1:
                self._stride = rng.randrange(1, self.num_usable)
        self._shift = rng.randrange(self.num_usable) if order == "random" else 0

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.num_usable - self._num_fresh_used + len(self._freed)

    @property
    def num_used(self) -> int:
        return len(self.ref_count)

    def is_free(self, block: int) -> bool:
        return block not in self.ref_count

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks with one holder each; raises if fewer are free."""
        if self.num_free < n:
            raise RuntimeError(f"allocator: {n} blocks requested, {self.num_free} free")
        out: list[int] = []
        for block in self._candidates():
            if len(out) == n:
                break
            out.append(block)
        for block in out:
            self._take(block)
        return out

    def touch(self, block: int) -> None:
        """One more holder of a cached block (a prefix-cache hit), reviving it from the free queue."""
        if block in self.ref_count:
            self.ref_count[block] += 1
        else:
            del self._freed[block]  # a hit on a free block: it must still be in the queue, hash intact
            self.ref_count[block] = 1

    def release(self, block: int) -> None:
        if block == NULL_BLOCK_ID:
            return
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            del self.ref_count[block]
            self._freed[block] = None  # keeps its hash: a later request may still hit it

    # ---- prefix cache -----------------------------------------------------------------------
    def register(self, block: int, block_hash: Hashable) -> None:
        """Block `block` now holds the computed KV of the full block whose chained hash is `block_hash`."""
        if block_hash in self.cached or block in self.hash_of:
            return  # the first block computed for a hash stays the cached one
        self.cached[block_hash] = block
        self.hash_of[block] = block_hash

    def lookup(self, block_hash: Hashable) -> int | None:
        return self.cached.get(block_hash)

    # ---- internals --------------------------------------------------------------------------
    def _fresh(self, i: int) -> int:
        if self._order == "descending":
            return self.num_usable - i
        return (i * self._stride + self._shift) % self.num_usable + 1

    def _candidates(self) -> Iterator[int]:
        freed = iter(list(self._freed))
        fresh = (self._fresh(i) for i in range(self._num_fresh_used, self.num_usable))
        first, second = (freed, fresh) if self.reuse_freed_first else (fresh, freed)
        yield from first
        yield from second

    def _take(self, block: int) -> None:
        if block in self._freed:
            del self._freed[block]
            old_hash = self.hash_of.pop(block, None)
            if old_hash is not None:
                del self.cached[old_hash]  # evicted: its content is about to be overwritten
        else:
            self._num_fresh_used += 1  # fresh blocks are taken in _fresh order
        self.ref_count[block] = 1
