"""fast as a conformance backend: a handle that pins the kernel mode for everything it runs.

`backend_handle(interpret=True)` runs every pool method and kernel inside `interpret(True)` (Triton's
interpreter on CPU tensors), `interpret=False` inside `interpret(False)` (vectorised torch ops on CPU),
so both CPU modes can be tested in one process whatever SLOTMAP_TRITON_INTERPRET says. Pools are built
inside that mode, since a pool fixes its mode at construction (fast-interpret: separate state written
by the Triton kernels; fast: state shared with the host mirror). With CUDA
available the handle works on CUDA tensors, where the mode is irrelevant (compiled Triton).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from conformance.backends import BackendHandle, to_numpy
from fast.attention import paged_attention
from fast.kv_cache import write_kv
from fast.pool import RequestStatePool
from fast.runtime import interpret
from spec.types import BatchInputs, PoolSnapshot, SchedulerOutput, WorkerConfig

F = TypeVar("F", bound=Callable[..., Any])


def _in_mode(fn: F, enabled: bool) -> F:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with interpret(enabled):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


class _ModePool:
    """A fast.RequestStatePool whose every call runs in one kernel mode."""

    def __init__(self, pool: RequestStatePool, enabled: bool) -> None:
        self._pool, self._enabled = pool, enabled

    def apply(self, sched: SchedulerOutput) -> None:
        with interpret(self._enabled):
            self._pool.apply(sched)

    def prepare(self, sched: SchedulerOutput, pad_to: int | None = None) -> BatchInputs:
        with interpret(self._enabled):
            return self._pool.prepare(sched, pad_to)

    def record_sampled(self, batch: BatchInputs, sampled_token_ids: Any) -> None:
        with interpret(self._enabled):
            self._pool.record_sampled(batch, sampled_token_ids)

    def row_of(self, req_id: str) -> int:
        return self._pool.row_of(req_id)

    def snapshot(self) -> PoolSnapshot:
        return self._pool.snapshot()


class _ModeBackend:
    """fast's pool and kernels (a spec.Backend), all on one device and in one kernel mode."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device = device
        self.enabled = enabled
        self.write_kv = _in_mode(write_kv, enabled)
        self.paged_attention = _in_mode(paged_attention, enabled)

    def RequestStatePool(self, config: WorkerConfig) -> _ModePool:  # noqa: N802 - spec.Backend's name
        with interpret(self.enabled):  # a pool fixes its kernel mode when built (fast/pool.py)
            pool = RequestStatePool(config, device=self.device)
        return _ModePool(pool, self.enabled)


def backend_handle(interpret: bool) -> BackendHandle:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = "fast-interpret" if interpret else "fast"

    def asarray(array: np.ndarray) -> torch.Tensor:
        return torch.tensor(np.asarray(array), device=device)

    return BackendHandle(name, _ModeBackend(device, interpret), asarray, to_numpy)
