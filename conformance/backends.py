"""Backend handles: one object per implementation under test, so the suite is written once.

A handle wraps a module (or object) satisfying `spec.Backend` and knows how to move arrays between
NumPy and the backend's array type. Select one with `--backend` (pytest) or `slotmap check --backend`:
`spec`, `fast`, `fast-interpret`, or `package.module:factory` for a third-party backend, where
`factory()` returns a `BackendHandle` or a `spec.Backend` (then arrays convert through NumPy, or the
object's own `asarray(np_array)` if it has one).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import spec
from spec.protocol import Backend, StatePool
from spec.types import BatchInputs, WorkerConfig

BATCH_ARRAY_FIELDS = (
    "index_mapping",
    "num_scheduled_tokens",
    "query_start_loc",
    "positions",
    "input_ids",
    "seq_lens",
    "logits_indices",
)


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

    def make_pool(self, config: WorkerConfig) -> StatePool:
        return self.module.RequestStatePool(config)

    def batch_to_numpy(self, batch: BatchInputs) -> dict[str, Any]:
        """Every field of a BatchInputs in NumPy/Python form, ready for exact comparison."""
        out: dict[str, Any] = {name: self.to_numpy(getattr(batch, name)) for name in BATCH_ARRAY_FIELDS}
        out["req_ids"] = tuple(batch.req_ids)
        out["block_tables"] = tuple(self.to_numpy(t) for t in batch.block_tables)
        out["slot_mappings"] = tuple(self.to_numpy(s) for s in batch.slot_mappings)
        out["num_tokens"] = int(batch.num_tokens)
        out["num_tokens_padded"] = int(batch.num_tokens_padded)
        return out


def _spec() -> BackendHandle:
    return BackendHandle("spec", spec)


def _fast(interpret: bool) -> BackendHandle:
    fast = importlib.import_module("fast")  # the handle pins the kernel mode; no process-wide setting
    return fast.backend_handle(interpret=interpret)


BUILTIN: dict[str, Callable[[], BackendHandle]] = {
    "spec": _spec,
    "fast": lambda: _fast(interpret=False),
    "fast-interpret": lambda: _fast(interpret=True),
}


def load_backend(name: str) -> BackendHandle:
    if name in BUILTIN:
        return BUILTIN[name]()
    if ":" not in name:
        raise ValueError(f"unknown backend {name!r}: use one of {sorted(BUILTIN)} or 'module:factory'")
    module_name, factory_name = name.split(":", 1)
    made = getattr(importlib.import_module(module_name), factory_name)()
    if isinstance(made, BackendHandle):
        return made
    return BackendHandle(name, made, getattr(made, "asarray", lambda a: a))
