"""Backend handles: one object per implementation under test, so the suite is written once.

A handle wraps a module (or object) satisfying `spec.Backend` and knows how to move arrays between
NumPy and the backend's array type. Select one with `--backend` (pytest) or `slotmap check --backend`:
`spec`, `fast`, `fast-interpret`, or `package.module:factory` for a third-party backend, where
`factory()` returns a `BackendHandle` or a `spec.Backend` (then arrays convert through NumPy, or the
object's own `asarray(np_array)` if it has one).

fast's handles live here, not in fast: the product does not know its test suite. Each pins fast's kernel
mode for everything it runs (`fast-interpret`: Triton's interpreter on CPU tensors; `fast`: vectorised
torch ops), so both CPU modes can be tested in one process. `fast` honours SLOTMAP_TRITON_INTERPRET as
fast itself does: with the variable set (and no CUDA device) it is the interpreter handle, named
`fast-interpret` so that every report says which mode ran. On CUDA tensors the mode is irrelevant
(compiled Triton).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np

import spec
import spec.interop
from spec.async_steps import PENDING_FIELDS
from spec.graphs import CapturedGraphs
from spec.protocol import Backend, MlaBackend, SparseBackend, StatePool
from spec.types import BatchInputs, PoolSnapshot, SchedulerOutput, WorkerConfig
from spec.ubatch import MicroBatch

BATCH_ARRAY_FIELDS = (
    "index_mapping",
    "num_scheduled_tokens",
    "query_start_loc",
    "positions",
    "input_ids",
    "seq_lens",
    "logits_indices",
)

DRAFT_FIELDS = (  # BatchInputs' speculative-decoding fields (logits_indices is in BATCH_ARRAY_FIELDS)
    "num_draft_tokens",
    "cu_num_draft_tokens",
    "draft_token_ids",
    "target_logits_indices",
    "bonus_logits_indices",
)


CROSS_FIELDS = ("encoder_seq_lens", "scheduled_encoder_lens", "cross_slot_mapping")  # spec/cross_attention.py


class BackendLoadError(ValueError):
    """A backend name that names nothing loadable; the message says what to pass instead."""


def to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, on any device
        return x.detach().cpu().numpy()
    return np.asarray(x)


@dataclass
class BackendHandle:
    name: str
    module: Backend
    asarray: Callable[[np.ndarray], Any] = field(default=lambda a: a)  # NumPy -> backend array
    to_numpy: Callable[[Any], np.ndarray] = field(default=to_numpy)  # backend array -> NumPy
    slow: bool = False  # ~100x slower per step (kernels through Triton's interpreter): a small suite budget

    def make_pool(self, config: WorkerConfig) -> StatePool:
        return self.module.RequestStatePool(config)

    def batch_to_numpy(self, batch: BatchInputs) -> dict[str, Any]:
        """Every field of a BatchInputs in NumPy/Python form, ready for exact comparison (shadow/compare.py)."""
        out: dict[str, Any] = {name: self.to_numpy(getattr(batch, name)) for name in BATCH_ARRAY_FIELDS}
        out["req_ids"] = tuple(batch.req_ids)
        out["block_tables"] = tuple(self.to_numpy(t) for t in batch.block_tables)
        out["slot_mappings"] = tuple(self.to_numpy(s) for s in batch.slot_mappings)
        out["num_tokens"] = int(batch.num_tokens)
        out["num_tokens_padded"] = int(batch.num_tokens_padded)
        for name in CROSS_FIELDS:  # encoder-decoder (spec/cross_attention.py): None without a cross group
            value = getattr(batch, name, None)
            out[name] = None if value is None else self.to_numpy(value)
        for name in DRAFT_FIELDS:  # speculative decoding (spec/drafts.py): None in a step without drafts
            value = getattr(batch, name, None)
            out[name] = None if value is None else self.to_numpy(value)
        for name in ("is_prefilling", "num_accepted_tokens"):  # spec/mamba.py: None without a mamba group
            value = getattr(batch, name, None)
            out[name] = None if value is None else self.to_numpy(value)
        for name in ("mamba_state_indices", "mamba_prev_state_indices"):  # per group, None for non-mamba groups
            groups = getattr(batch, name, None)
            out[name] = None if groups is None else tuple(None if a is None else self.to_numpy(a) for a in groups)
        for name in PENDING_FIELDS:  # async scheduling (spec/async_steps.py): None in synchronous mode
            value = getattr(batch, name, None)
            out[name] = None if value is None else self.to_numpy(value)
        mrope = getattr(batch, "mrope_positions", None)  # spec/mrope.py: None for a model without M-RoPE
        out["mrope_positions"] = None if mrope is None else self.to_numpy(mrope)
        out.update(classes_to_numpy(batch.row_classes, self.to_numpy))  # spec/classify.py: every prepare sets it
        out["descriptor"] = batch.descriptor  # spec/graphs.py: None unless prepared with graphs
        return out

    def microbatch_to_numpy(self, half: MicroBatch) -> dict[str, Any]:
        """Every field of a MicroBatch (spec/ubatch.py) in NumPy/Python form, its records' fields by name."""
        out: dict[str, Any] = {
            name: self.to_numpy(getattr(half, name))
            for name in ("index_mapping", "num_scheduled_tokens", "query_start_loc", "seq_lens", "positions",
                         "input_ids")
        }  # fmt: skip
        out["block_tables"] = tuple(self.to_numpy(t) for t in half.block_tables)
        out["slot_mappings"] = tuple(self.to_numpy(s) for s in half.slot_mappings)
        for name in ("request_slice", "token_slice", "req_ids", "num_tokens", "num_tokens_padded"):
            out[name] = getattr(half, name)
        for i, record in enumerate(half.features):  # a split record (M-RoPE's positions): its arrays
            for name in record.__dataclass_fields__:
                value = getattr(record, name)
                out[f"features[{i}].{name}"] = self.to_numpy(value) if hasattr(value, "shape") else value
        return out


def classes_to_numpy(classes: Any, convert: Callable[[Any], np.ndarray]) -> dict[str, Any]:
    """A batch's RowClasses as comparable fields (`row_classes.<name>`); all None for a batch without one."""
    names = ("is_prefilling", "is_decode", "decode_query_len", "uniform_decode", "max_query_len", "num_decodes",
             "num_decode_tokens")  # fmt: skip
    if classes is None:
        return {f"row_classes.{name}": None for name in names}
    return {
        f"row_classes.{name}": convert(value) if name.startswith("is_") else value
        for name in names
        for value in [getattr(classes, name)]
    }


F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def _mode(enabled: bool) -> Iterator[None]:
    from fast.runtime import interpret  # imported here: a spec-only install still loads this module

    with interpret(enabled):
        yield


def _in_mode(fn: F, enabled: bool) -> F:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _mode(enabled):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


class _ModePool:
    """A fast.RequestStatePool whose every call runs in one kernel mode."""

    def __init__(self, pool: Any, enabled: bool) -> None:
        self._pool, self._enabled = pool, enabled

    def apply(self, sched: SchedulerOutput) -> None:
        with _mode(self._enabled):
            self._pool.apply(sched)

    def prepare(
        self, sched: SchedulerOutput, pad_to: int | None = None, *, graphs: CapturedGraphs | None = None
    ) -> BatchInputs:
        with _mode(self._enabled):
            return self._pool.prepare(sched, pad_to, graphs=graphs)

    def record_sampled(self, batch: BatchInputs, sampled_token_ids: Any, next_draft_ids: Any = None) -> None:
        with _mode(self._enabled):
            self._pool.record_sampled(batch, sampled_token_ids, next_draft_ids)

    def row_of(self, req_id: str) -> int:
        return int(self._pool.row_of(req_id))

    def snapshot(self) -> PoolSnapshot:
        return self._pool.snapshot()


class _ModeBackend:
    """fast's pool and kernels (a spec.Backend), all on one device and in one kernel mode."""

    def __init__(self, device: Any, enabled: bool) -> None:
        import fast
        import fast.dummy
        import fast.encoder_attention
        import fast.interop
        import fast.ubatch

        self.device = device
        self.enabled = enabled
        self.write_kv = _in_mode(fast.write_kv, enabled)
        self.paged_attention = _in_mode(fast.paged_attention, enabled)
        # MLA's latent cache (spec.MlaBackend, an optional part of a backend), in the same kernel mode
        self.write_mla_kv = _in_mode(fast.write_mla_kv, enabled)
        self.mla_decode_attention = _in_mode(fast.mla_decode_attention, enabled)
        self.mla_prefill_attention = _in_mode(fast.mla_prefill_attention, enabled)
        # sparse top-k attention (spec.SparseBackend, an optional part of a backend), in the same kernel mode
        self.sparse_slot_mapping = _in_mode(fast.sparse_slot_mapping, enabled)
        self.sparse_paged_attention = _in_mode(fast.sparse_paged_attention, enabled)
        self.sparse_mla_attention = _in_mode(fast.sparse_mla_attention, enabled)
        # encoder-decoder (fast/encoder_attention.py): `cross_attention` names a submodule of both packages
        self.cross_attention = _in_mode(fast.encoder_attention.cross_attention, enabled)
        # a data-parallel rank's dummy batch and the DBO split (optional parts of a backend: dummy_batch_of,
        # split_batch_of), on the pool's device
        self.dummy_batch = _in_mode(functools.partial(fast.dummy.dummy_batch, device=device), enabled)
        self.split_batch = _in_mode(fast.ubatch.split_batch, enabled)
        self.CapturedGraphs = fast.CapturedGraphs
        # the engine layouts (optional part of a backend, docs/porting.md), in the same kernel mode
        self.interop = types.SimpleNamespace(
            **{name: _in_mode(getattr(fast.interop, name), enabled) for name in INTEROP_FUNCTIONS}
        )

    def RequestStatePool(self, config: WorkerConfig) -> _ModePool:  # noqa: N802 - spec.Backend's name
        import fast

        with _mode(self.enabled):  # a pool fixes its kernel mode when built (fast/pool.py)
            pool = fast.RequestStatePool(config, device=self.device)
        return _ModePool(pool, self.enabled)


def fast_handle(interpret: bool) -> BackendHandle:
    """fast on CUDA when there is a device, else on CPU tensors in the given kernel mode."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = "fast-interpret" if interpret else "fast"

    def asarray(array: np.ndarray) -> torch.Tensor:
        return torch.tensor(np.asarray(array), device=device)

    return BackendHandle(name, _ModeBackend(device, interpret), asarray, to_numpy, slow=interpret)


def canonical_name(name: str) -> str:
    """The built-in backend a name runs: `fast` is `fast-interpret` while SLOTMAP_TRITON_INTERPRET is set (CPU)."""
    if name != "fast":
        return name
    import torch

    from fast.runtime import interpret_enabled

    return "fast-interpret" if interpret_enabled() and not torch.cuda.is_available() else "fast"


def cross_attention_of(handle: BackendHandle) -> Callable[..., Any] | None:
    """The backend's attention over the encoder's KV (spec/encoder_attention.py), or None if it has none."""
    if handle.module is spec:
        from spec.encoder_attention import cross_attention

        return cross_attention
    found = getattr(handle.module, "cross_attention", None)
    return found if callable(found) else None


def dummy_batch_of(handle: BackendHandle) -> Callable[..., BatchInputs] | None:
    """The backend's dummy batch (spec/dummy.py: `(config, num_tokens, graphs)`), or None if it has none."""
    if handle.module is spec:
        from spec.dummy import dummy_batch

        return dummy_batch
    found = getattr(handle.module, "dummy_batch", None)
    return found if callable(found) else None


def split_batch_of(handle: BackendHandle) -> Callable[..., tuple[MicroBatch, MicroBatch]] | None:
    """The backend's DBO split (spec/ubatch.py: `(batch, split_point, *, query_lens_np)`), or None."""
    if handle.module is spec:
        from spec.ubatch import split_batch

        return split_batch
    found = getattr(handle.module, "split_batch", None)
    return found if callable(found) else None


MLA_FUNCTIONS = ("write_mla_kv", "mla_decode_attention", "mla_prefill_attention")


def mla_kernels_of(handle: BackendHandle) -> MlaBackend | None:
    """The backend's MLA kernels (spec.MlaBackend, an optional part of a backend), or None if it lacks one."""
    if not all(callable(getattr(handle.module, name, None)) for name in MLA_FUNCTIONS):
        return None
    return cast(MlaBackend, handle.module)


SPARSE_FUNCTIONS = ("sparse_slot_mapping", "sparse_paged_attention", "sparse_mla_attention")


def sparse_kernels_of(handle: BackendHandle) -> SparseBackend | None:
    """The backend's sparse top-k functions (spec.SparseBackend, an optional part of a backend), or None."""
    if not all(callable(getattr(handle.module, name, None)) for name in SPARSE_FUNCTIONS):
        return None
    return cast(SparseBackend, handle.module)


INTEROP_FUNCTIONS = ("paged_kv_layout", "paged_attention", "sglang_layout", "flash_attn_metadata")

BUILTIN: dict[str, Callable[[], BackendHandle]] = {
    "spec": lambda: BackendHandle("spec", spec),
    "fast": lambda: fast_handle(interpret=False),
    "fast-interpret": lambda: fast_handle(interpret=True),
}
USAGE = "use spec, fast, fast-interpret, or package.module:factory"


def load_backend(name: str) -> BackendHandle:
    """The handle a name selects; BackendLoadError (one line, what to pass instead) when it selects nothing."""
    name = canonical_name(name)
    if name in BUILTIN:
        return BUILTIN[name]()
    module_name, colon, factory_name = name.partition(":")
    if not colon or not module_name or not factory_name:
        raise BackendLoadError(f"unknown backend {name!r}: {USAGE}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BackendLoadError(f"backend {name!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?") from e
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        found = "not callable" if factory is not None else "not defined"
        raise BackendLoadError(f"backend {name!r}: {module_name}.{factory_name} is {found}; name a factory function")
    try:
        made = factory()
    except Exception as e:  # the factory's own failure, reported as the backend's: one line, not a traceback
        raise BackendLoadError(f"backend {name!r}: {factory_name}() raised {type(e).__name__}: {e}") from e
    if isinstance(made, BackendHandle):
        return made
    if not callable(getattr(made, "RequestStatePool", None)):
        raise BackendLoadError(f"backend {name!r}: {factory_name}() returned {type(made).__name__}, not a spec.Backend")
    return BackendHandle(name, made, getattr(made, "asarray", lambda a: a))
