"""slotmap's fast backend: spec's interface on torch tensors, with Triton kernels for every per-token stage.

State lives on the pool's device (`RequestStatePool(config, device="cuda")`); `BatchInputs` arrays are
torch tensors on that device. Types, constants and errors are spec's own (re-exported here), so the
two backends raise the same classes for the same input.

Modes (fast/runtime.py):
- Triton: compiled Triton kernels on CUDA tensors, or the same kernels through Triton's interpreter on
  CPU tensors when the environment variable SLOTMAP_TRITON_INTERPRET=1 is set (before running; any value
  other than "" or "0" turns it on), so machines without a GPU still execute the kernel code.
  `fast.runtime.interpret(True/False)` overrides the variable for a block of code (the conformance
  suite's `fast` and `fast-interpret` handles, conformance/backends.py, pin one mode each this way).
- host mode: CPU tensors without the interpreter. The device is the host: a pool's tensors share memory
  with its host mirror, so apply's commit is the device write and prepare is compiled loops (Numba) over
  it, wrapped as tensors; write_kv and paged_attention run their CPU code.
A pool fixes its mode when it is built (`pool.host_mode`). Under Triton the pool keeps separate device
tensors and writes them with one apply kernel and one prepare kernel per step.
The kernels write_kv and paged_attention choose their mode per call, from their tensors' device.
"""

from fast.attention import paged_attention
from fast.kv_cache import write_kv
from fast.mla_attention import mla_decode_attention, mla_prefill_attention
from fast.mla_cache import write_mla_kv
from fast.pool import RequestStatePool
from fast.sparse_attention import sparse_paged_attention
from fast.sparse_mla import sparse_mla_attention
from fast.sparse_topk import sparse_slot_mapping
from spec import (
    ALL_ERRORS,
    NULL_BLOCK_ID,
    PAD_SLOT_ID,
    Backend,
    BatchDescriptor,
    BatchInputs,
    BlockIdError,
    BlockTableOverflowError,
    CachedRequest,
    CapturedGraphs,
    DuplicateRequestError,
    DuplicateSlotError,
    InconsistentSchedulerOutputError,
    KVCacheGroup,
    MissingBlockError,
    MlaBackend,
    MlaBatchSplit,
    ModelLengthError,
    NewRequest,
    NullBlockError,
    PaddingProfile,
    PoolFullError,
    PoolSnapshot,
    RowSnapshot,
    ScheduleError,
    SchedulerOutput,
    SparseBackend,
    SparseIndexError,
    StatePool,
    TokenBudgetError,
    TokenIdError,
    UnknownRequestError,
    UnknownTokenError,
    WorkerConfig,
    mla_cache_shape,
    split_mla_batch,
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
