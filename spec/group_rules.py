"""A KV group's table rules: checks 9 to 13 for one group's table, and the slot each token writes there.

The validator (spec/validate.py) and prepare (spec/pool.py) hold one `GroupRules` per KV group
(`spec.feature.group_rules`) and call it without asking what kind of group it is. `AttentionRules` are
the rules of a group of the decoder's own KV (full attention, or a sliding window): the core's. A feature
whose groups hold something else (spec/cross_attention.py: the encoder's KV; spec/mamba.py: recurrent
states) supplies its own rules for them, subclassing these where only some rules differ.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import numpy as np

from spec.async_steps import lowest_start
from spec.errors import BlockIdError, BlockTableOverflowError, MissingBlockError, NullBlockError
from spec.request import ScheduledRequest
from spec.slots import slot_mapping
from spec.types import NULL_BLOCK_ID, PAD_SLOT_ID, SLOT_DTYPE

if TYPE_CHECKING:
    from spec.state import PoolState


class GroupRules(abc.ABC):
    """The rules of group g's table, one method per numbered check (spec/validate.py), each for one request."""

    @abc.abstractmethod
    def check_ids(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        """9: the ids of s's table in group g."""

    @abc.abstractmethod
    def held_ids(self, state: PoolState, s: ScheduledRequest, g: int) -> np.ndarray:
        """9, with one block pool: the ids s holds in group g after the step (no other group may hold them)."""

    @abc.abstractmethod
    def check_size(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        """10: the table fits its width."""

    @abc.abstractmethod
    def check_present(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        """11: every block the step needs is in the table."""

    @abc.abstractmethod
    def check_not_null(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        """12: the step neither writes nor reads through the null block."""

    @abc.abstractmethod
    def written(self, state: PoolState, s: ScheduledRequest, g: int) -> np.ndarray:
        """13: what the step writes in group g, as int64 keys no two requests may share (slots, or state blocks)."""

    @abc.abstractmethod
    def token_slots(
        self,
        table: np.ndarray,  # [R, max_blocks_per_req(g)] req_state_idx -> physical block ids
        token_rows: np.ndarray,  # [num_tokens] flat token index -> req_state_idx
        positions: np.ndarray,  # [T] flat token index -> position (0 for padding)
        block_size: int,
    ) -> np.ndarray:
        """prepare: `slot_mappings[g]`, [T] int64, the slot each token's KV goes to in group g (PAD for padding)."""


class AttentionRules(GroupRules):
    """A group of the decoder's own KV: a slot per token, each position's KV at its block's offset."""

    def check_ids(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        group, table = state.config.kv_groups[g], s.tables[g]
        self.check_range(state, s, g)
        live_from = self.live_from(state, s, g)
        real = np.sort(self.held_ids(state, s, g))
        if (real[1:] == real[:-1]).any():  # sorted, a repeated id sits next to itself
            again = int(real[1:][real[1:] == real[:-1]][0])
            raise BlockIdError(
                s.req_id, f"block_ids[{g}]", f"block {again} appears twice among the entries from {live_from} on"
            )
        if group.sliding_window is None and (table == NULL_BLOCK_ID).any():
            raise BlockIdError(s.req_id, f"block_ids[{g}]", "null block in a group without a sliding window")

    @staticmethod
    def check_range(state: PoolState, s: ScheduledRequest, g: int) -> None:
        """9, for every kind of group: the given ids are integers, each in [0, num_blocks)."""
        group, table = state.config.kv_groups[g], s.tables[g]
        if g in s.malformed:
            raise BlockIdError(s.req_id, f"block_ids[{g}]", "not a tuple, list or 1-D array of integer ids")
        bad = table[(table < 0) | (table >= group.num_blocks)]
        if bad.size:
            raise BlockIdError(s.req_id, f"block_ids[{g}]", f"{bad[0]} not in [0, {group.num_blocks})")

    def live_from(self, state: PoolState, s: ScheduledRequest, g: int) -> int:
        """The first entry of s's table that the request still holds.

        Entries before the step's first read are released for good (this and every later step reads past
        them): vLLM's worker table is append-only and its allocator reuses freed blocks first, so such an
        entry may hold an id the request, or another group, is handed again. Under async scheduling the
        step may start lower than its count says (spec/async_steps.py, rule 4).
        """
        return s.live_from(state.config.kv_groups[g], lowest_start(state, s.req_id, s.num_computed, s.resumed))

    def held_ids(self, state: PoolState, s: ScheduledRequest, g: int) -> np.ndarray:
        live = s.tables[g][self.live_from(state, s, g) :]
        return live[live != NULL_BLOCK_ID]

    def check_size(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        limit = state.config.max_blocks_per_req(g)
        if s.tables[g].size > limit:
            raise BlockTableOverflowError(s.req_id, f"block_ids[{g}]", f"{s.tables[g].size} blocks > {limit}")

    def check_present(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        last_block = s.last // state.config.kv_groups[g].block_size
        if last_block >= s.tables[g].size:
            detail = f"position needs logical block {last_block}, table has {s.tables[g].size}"
            raise MissingBlockError(s.req_id, f"block_ids[{g}]", detail)

    def check_not_null(self, state: PoolState, s: ScheduledRequest, g: int) -> None:
        group = state.config.kv_groups[g]
        first_read = group.first_read(lowest_start(state, s.req_id, s.num_computed, s.resumed))
        read = s.tables[g][first_read // group.block_size : s.last // group.block_size + 1]
        if (read == NULL_BLOCK_ID).any():
            detail = f"null block inside positions {first_read}..{s.last}"
            raise NullBlockError(s.req_id, f"block_ids[{g}]", detail)

    def written(self, state: PoolState, s: ScheduledRequest, g: int) -> np.ndarray:
        block_size = state.config.kv_groups[g].block_size
        positions = np.arange(s.num_computed, s.end)
        return s.tables[g][positions // block_size] * block_size + positions % block_size

    def token_slots(
        self, table: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, block_size: int
    ) -> np.ndarray:
        return slot_mapping(table, token_rows, positions, block_size)


class NoTokenKV(AttentionRules):
    """A group no decoder token writes KV to (the encoder's, the recurrent states'): its slot mapping is all PAD."""

    def token_slots(
        self, table: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, block_size: int
    ) -> np.ndarray:
        return np.full(positions.size, PAD_SLOT_ID, SLOT_DTYPE)


ATTENTION_RULES = AttentionRules()
