"""The interface every backend implements. mypy checks `spec` and `fast` against it (tests/typecheck_backends.py).

Arrays are typed `Any`: NumPy in spec, torch tensors in fast; shapes and dtypes are in spec.types.
"""

from __future__ import annotations

from typing import Any, Protocol

from spec.context_parallel import ContextParallel
from spec.graphs import CapturedGraphs
from spec.types import BatchInputs, PoolSnapshot, SchedulerOutput, WorkerConfig


class StatePool(Protocol):
    def apply(self, sched: SchedulerOutput) -> None: ...

    def prepare(
        self, sched: SchedulerOutput, pad_to: int | None = None, *, graphs: CapturedGraphs | None = None
    ) -> BatchInputs: ...

    def record_sampled(self, batch: BatchInputs, sampled_token_ids: Any, next_draft_ids: Any = None) -> None: ...

    def row_of(self, req_id: str) -> int: ...

    def snapshot(self) -> PoolSnapshot: ...


class PoolFactory(Protocol):
    def __call__(self, config: WorkerConfig) -> StatePool: ...


class WriteKV(Protocol):
    def __call__(
        self,
        key_cache: Any,
        value_cache: Any,
        key: Any,
        value: Any,
        slot_mapping: Any,
        *,
        kv_cache_dtype: str = "auto",
        k_scale: Any = 1.0,  # a number, or an array of 1 or num_kv_heads floats (spec/kv_cache.py)
        v_scale: Any = 1.0,
    ) -> None: ...


class PagedAttention(Protocol):
    def __call__(
        self,
        query: Any,
        key_cache: Any,
        value_cache: Any,
        block_table: Any,
        seq_lens: Any,
        query_start_loc: Any,
        *,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        kv_cache_dtype: str = "auto",
        k_scale: Any = 1.0,
        v_scale: Any = 1.0,
        out: Any = None,
    ) -> Any: ...


class Backend(Protocol):
    """A module (or object) offering the pool and the two kernels, like `spec` and `fast`."""

    @property
    def RequestStatePool(self) -> PoolFactory: ...  # noqa: N802 - the public class name

    @property
    def write_kv(self) -> WriteKV: ...

    @property
    def paged_attention(self) -> PagedAttention: ...


class WriteMlaKV(Protocol):
    def __call__(
        self,
        kv_cache: Any,
        kv_c: Any,
        k_pe: Any,
        slot_mapping: Any,
        *,
        kv_cache_dtype: str = "auto",
        k_scale: Any = 1.0,
    ) -> None: ...


class MlaDecodeAttention(Protocol):
    def __call__(
        self,
        q_latent: Any,
        q_pe: Any,
        kv_cache: Any,
        block_table: Any,
        seq_lens: Any,
        query_start_loc: Any,
        *,
        scale: float,
        kv_cache_dtype: str = "auto",
        k_scale: Any = 1.0,
    ) -> Any: ...


class MlaPrefillAttention(Protocol):
    def __call__(
        self,
        q_nope: Any,
        q_pe: Any,
        kv_cache: Any,
        w_uk: Any,
        w_uv: Any,
        block_table: Any,
        seq_lens: Any,
        query_start_loc: Any,
        *,
        scale: float,
        kv_cache_dtype: str = "auto",
        k_scale: Any = 1.0,
    ) -> Any: ...


class MlaBackend(Protocol):
    """The optional MLA part of a backend (spec/mla_cache.py, spec/mla_attention.py): a backend for DeepSeek-style
    models offers it beside `Backend`'s; one without MLA need not."""

    @property
    def write_mla_kv(self) -> WriteMlaKV: ...

    @property
    def mla_decode_attention(self) -> MlaDecodeAttention: ...

    @property
    def mla_prefill_attention(self) -> MlaPrefillAttention: ...


class SparseSlotMapping(Protocol):
    def __call__(
        self,
        batch: BatchInputs,
        config: WorkerConfig,
        topk_indices: Any,
        group: int = 0,
        *,
        cp: ContextParallel | None = None,
    ) -> Any: ...


class SparsePagedAttention(Protocol):
    def __call__(
        self,
        query: Any,
        key_cache: Any,
        value_cache: Any,
        topk_slots: Any,
        *,
        scale: float,
        softcap: float | None = None,
    ) -> Any: ...


class SparseMlaAttention(Protocol):
    def __call__(
        self,
        q_latent: Any,
        q_pe: Any,
        kv_cache: Any,
        topk_slots: Any,
        *,
        scale: float,
        kv_cache_dtype: str = "auto",
        k_scale: Any = 1.0,
    ) -> Any: ...


class SparseBackend(Protocol):
    """The optional sparse top-k part of a backend (spec/sparse_topk.py, spec/sparse_attention.py,
    spec/sparse_mla.py), for DeepSeek-V3.2-style indexer attention: the slots of the selected keys, and
    attention over them in an ordinary cache or an MLA latent cache."""

    @property
    def sparse_slot_mapping(self) -> SparseSlotMapping: ...

    @property
    def sparse_paged_attention(self) -> SparsePagedAttention: ...

    @property
    def sparse_mla_attention(self) -> SparseMlaAttention: ...
