"""slotmap's reference: the exact semantics of a paged-KV engine's input pipeline, in NumPy.

Read in pipeline order: types, errors, state, validate, batch, flatten, slots, kv_cache, attention, pool.
"""

from spec.attention import paged_attention
from spec.errors import (
    ALL_ERRORS,
    BlockIdError,
    BlockTableOverflowError,
    DuplicateRequestError,
    DuplicateSlotError,
    InconsistentSchedulerOutputError,
    MissingBlockError,
    ModelLengthError,
    NullBlockError,
    PoolFullError,
    ScheduleError,
    TokenBudgetError,
    TokenIdError,
    UnknownRequestError,
    UnknownTokenError,
)
from spec.graphs import BatchDescriptor, CapturedGraphs
from spec.kv_cache import write_kv
from spec.mla_attention import mla_decode_attention, mla_prefill_attention
from spec.mla_cache import mla_cache_shape, write_mla_kv
from spec.mla_split import MlaBatchSplit, split_mla_batch
from spec.padding_profiles import PaddingProfile
from spec.pool import RequestStatePool
from spec.protocol import Backend, MlaBackend, SparseBackend, StatePool
from spec.sparse_attention import sparse_paged_attention
from spec.sparse_mla import sparse_mla_attention
from spec.sparse_topk import SparseIndexError, sparse_slot_mapping
from spec.types import (
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    BatchInputs,
    CachedRequest,
    KVCacheGroup,
    NewRequest,
    PoolSnapshot,
    RowSnapshot,
    SchedulerOutput,
    WorkerConfig,
)

__all__ = [
    "ALL_ERRORS",
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "Backend",
    "BatchDescriptor",
    "BatchInputs",
    "BlockIdError",
    "BlockTableOverflowError",
    "CachedRequest",
    "CapturedGraphs",
    "DuplicateRequestError",
    "DuplicateSlotError",
    "InconsistentSchedulerOutputError",
    "KVCacheGroup",
    "MissingBlockError",
    "MlaBackend",
    "MlaBatchSplit",
    "ModelLengthError",
    "NewRequest",
    "NullBlockError",
    "PaddingProfile",
    "PoolFullError",
    "PoolSnapshot",
    "RequestStatePool",
    "RowSnapshot",
    "ScheduleError",
    "SchedulerOutput",
    "SparseBackend",
    "SparseIndexError",
    "StatePool",
    "TokenBudgetError",
    "TokenIdError",
    "UnknownRequestError",
    "UnknownTokenError",
    "WorkerConfig",
    "mla_cache_shape",
    "mla_decode_attention",
    "mla_prefill_attention",
    "paged_attention",
    "sparse_mla_attention",
    "sparse_paged_attention",
    "sparse_slot_mapping",
    "split_mla_batch",
    "write_kv",
    "write_mla_kv",
]
