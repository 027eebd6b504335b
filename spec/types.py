"""The interface's data types: configuration, the scheduler's decision, and the batch it becomes.

Every backend consumes and produces these. Arrays are NumPy in `spec` and torch tensors in `fast`;
the shapes and integer dtypes below are part of the contract and identical in both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PAD_SLOT_ID = -1  # slot of a padding token: write_kv skips it
NULL_BLOCK_ID = 0  # block 0 of every group never holds real KV

# Integer dtypes of BatchInputs (names understood by both NumPy and torch).
INDEX_DTYPE = "int32"  # index_mapping, num_scheduled_tokens, query_start_loc, seq_lens, logits_indices
BLOCK_ID_DTYPE = "int32"  # block tables: block ids are < num_blocks < 2**31
TOKEN_DTYPE = "int64"  # positions, input_ids
SLOT_DTYPE = "int64"  # slot mappings: num_blocks * block_size may exceed 2**31


@dataclass(frozen=True)
class KVCacheGroup:
    block_size: int  # tokens per block
    num_blocks: int  # physical blocks, including the null block 0
    sliding_window: int | None = None  # a query at position p sees keys at positions > p - window

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 2:
            raise ValueError(f"KVCacheGroup needs block_size >= 1 and num_blocks >= 2, got {self}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"KVCacheGroup.sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_blocks > 2**31:  # block tables are int32 (BLOCK_ID_DTYPE): the largest id must fit
            raise ValueError(f"KVCacheGroup.num_blocks must be <= 2**31 (int32 block ids), got {self.num_blocks}")


@dataclass(frozen=True)
class WorkerConfig:
    max_num_reqs: int  # rows in the request state pool
    max_model_len: int  # most tokens a request may ever hold
    max_num_batched_tokens: int  # token budget of one step
    vocab_size: int  # token ids are in [0, vocab_size)
    kv_groups: tuple[KVCacheGroup, ...] = (KVCacheGroup(16, 1024),)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_groups", tuple(self.kv_groups))
        if min(self.max_num_reqs, self.max_model_len, self.max_num_batched_tokens) < 1:
            raise ValueError(f"WorkerConfig sizes must be >= 1, got {self}")
        if self.vocab_size < 1 or not self.kv_groups:
            raise ValueError("WorkerConfig needs vocab_size >= 1 and at least one KV group")

    def max_blocks_per_req(self, group: int) -> int:
        return math.ceil(self.max_model_len / self.kv_groups[group].block_size)


@dataclass(frozen=True)
class NewRequest:
    req_id: str
    prompt_token_ids: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]  # per KV group: the blocks allocated so far
    num_computed_tokens: int = 0  # > 0 on a prefix-cache hit


@dataclass(frozen=True)
class CachedRequest:
    req_id: str
    num_computed_tokens: int  # authoritative: the scheduler's count
    new_block_ids: tuple[tuple[int, ...], ...] | None = None  # per KV group, appended (or replacing)
    resumed: bool = False  # back from preemption: new_block_ids replace the whole table


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: tuple[NewRequest, ...] = ()
    cached_requests: tuple[CachedRequest, ...] = ()
    # req_id -> tokens this step; its order is the tie-break of the batch sort
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)
    finished_req_ids: frozenset[str] = frozenset()

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True, eq=False)
class BatchInputs:
    """One step's inputs for the model. num_reqs = len(req_ids); T = num_tokens_padded."""

    req_ids: tuple[str, ...]  # [num_reqs] batch_idx -> req_id
    index_mapping: Any  # [num_reqs] int32, batch_idx -> req_state_idx
    num_scheduled_tokens: Any  # [num_reqs] int32
    query_start_loc: Any  # [num_reqs + 1] int32, CSR offsets into the flat tokens
    positions: Any  # [T] int64, flat token index -> position in its request (0 for padding)
    input_ids: Any  # [T] int64 (0 for padding)
    seq_lens: Any  # [num_reqs] int32, num_computed_tokens + num_scheduled_tokens
    logits_indices: Any  # [num_reqs] int32, flat index of each request's last scheduled token
    block_tables: tuple[Any, ...]  # per group: [num_reqs, max_blocks_per_req(g)] int32
    slot_mappings: tuple[Any, ...]  # per group: [T] int64 (PAD_SLOT_ID for padding)
    num_tokens: int  # real tokens: query_start_loc[-1]
    num_tokens_padded: int  # T >= num_tokens

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(frozen=True)
class RowSnapshot:
    row: int  # req_state_idx
    req_id: str
    token_ids: tuple[int, ...]  # every known token: prompt, then sampled
    num_computed_tokens: int
    block_ids: tuple[tuple[int, ...], ...]  # per group: the table's filled entries


PoolSnapshot = tuple[RowSnapshot, ...]  # occupied rows, by row
