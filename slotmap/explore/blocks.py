"""What each physical block of a KV cache group holds at one step, read from the pool's block tables.

A row's table entries before `KVCacheGroup.first_live_entry` are released: a sliding window has moved past them for good
(the step's first query reads no key before `num_computed - window + 1`, and later steps read even
less), so the id there is stale and may be handed out again, to another request or to the same one
(spec/validate.py, check 9; docs/semantics.md). Every other real entry is held by its row. A block
held by two rows is shared through prefix caching. A row whose request the scheduler preempted keeps
its table until it resumes, but those blocks went back to the allocator: they are listed as stale.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from spec.types import NULL_BLOCK_ID, KVCacheGroup, PoolSnapshot, RowSnapshot

NULL, HELD, SHARED, RELEASED, STALE = "null", "held", "shared", "released", "stale"


@dataclass
class BlockUse:
    """Who lists one physical block of one group, and how."""

    block: int
    holders: list[tuple[str, int]] = field(default_factory=list)  # (req_id, logical block) of live entries
    released: list[tuple[str, int]] = field(default_factory=list)  # entries a window released
    stale: list[tuple[str, int]] = field(default_factory=list)  # entries of a preempted request's table

    @property
    def kind(self) -> str:
        if self.block == NULL_BLOCK_ID:
            return NULL
        if len(self.holders) > 1:
            return SHARED
        if self.holders:
            return HELD
        return RELEASED if self.released else STALE


def block_uses(
    snapshot: PoolSnapshot, g: int, group: KVCacheGroup, preempted: Collection[str] = ()
) -> dict[int, BlockUse]:
    """block id -> its use, for every block some row's table lists (block 0 included when listed)."""
    uses: dict[int, BlockUse] = {}
    for row in snapshot:
        for logical, block in enumerate(row.block_ids[g]):
            use = uses.setdefault(block, BlockUse(block))
            if row.req_id in preempted:
                use.stale.append((row.req_id, logical))
            elif logical < group.first_live_entry(row.num_computed_tokens) or block == NULL_BLOCK_ID:
                use.released.append((row.req_id, logical))
            else:
                use.holders.append((row.req_id, logical))
    return uses


def released_entries(row: RowSnapshot, g: int, group: KVCacheGroup) -> int:
    """How many of the row's first table entries a window has released."""
    return min(group.first_live_entry(row.num_computed_tokens), len(row.block_ids[g]))
