"""How fast runs a kernel: compiled Triton on CUDA; on CPU, Triton's interpreter or host mode.

CPU tensors run in host mode (CPU code, no Triton) unless the interpreter is on, either for the whole process
(`SLOTMAP_TRITON_INTERPRET=1` in the environment) or for a block of code (`with interpret(True):`),
so that CI, which has no GPU, still executes the real kernel code. A fast.RequestStatePool reads the
mode once, when it is built, and keeps it (its state layout depends on it, see fast/pool.py); the
kernels called on their own (write_kv, paged_attention) read it at each call. Both kernel flavours are built
from the same Python function, so spec-vs-fast and spec-vs-fast-interpret can run in one process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch

try:
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    HAVE_TRITON = True
except ImportError:  # platforms without Triton wheels: host mode still works on CPU
    HAVE_TRITON = False

INTERPRET_ENV = "SLOTMAP_TRITON_INTERPRET"
_interpret_override: ContextVar[bool | None] = ContextVar("slotmap_interpret", default=None)


def interpret_enabled() -> bool:
    override = _interpret_override.get()
    if override is not None:
        return override
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


@contextlib.contextmanager
def interpret(enabled: bool) -> Iterator[None]:
    token = _interpret_override.set(enabled)
    try:
        yield
    finally:
        _interpret_override.reset(token)


def use_triton(device: torch.device) -> bool:
    """Triton for CUDA tensors always; for CPU tensors only through the interpreter."""
    return device.type == "cuda" or (interpret_enabled() and HAVE_TRITON)


class Kernel:
    """One Triton kernel in two flavours: `kernel[grid](...)` picks by the mode at launch time."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.compiled = triton.jit(fn) if HAVE_TRITON else None
        self.interpreted = InterpretedFunction(fn) if HAVE_TRITON else None

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        flavour = self.interpreted if interpret_enabled() else self.compiled
        if flavour is None:
            raise RuntimeError("Triton is not installed; use CPU tensors without SLOTMAP_TRITON_INTERPRET")
        return flavour[grid]


def kernel(fn: Callable[..., Any]) -> Kernel:
    """Decorator for slotmap's Triton kernels (instead of @triton.jit)."""
    return Kernel(fn)


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """One host->device copy that does not wait for the device (pinned staging on CUDA)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def upload_into(destination: torch.Tensor, array: np.ndarray) -> torch.Tensor:
    """`array` copied into `destination` (a persistent device buffer of its size) without waiting for the device:
    on CUDA from pinned memory, which the caching host allocator keeps until the copy is done."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if destination.device.type == "cpu":
        return destination.copy_(host)
    return destination.copy_(host.pin_memory(), non_blocking=True)


class HostCopy:
    """Device tensors on their way to the host: the copy starts when made and `wait` returns them as NumPy.

    On CUDA the copy goes to pinned memory behind the work already queued, with an event, so `wait` waits for
    that work only and not for whatever was queued after it (the next step's forward, when async scheduling reads
    a record two applies late). CPU tensors are copied at once.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self._event: Any = None
        self._arrays: list[np.ndarray] | None = None  # of_host's arrays, handed back as they are
        if tensors and tensors[0].device.type == "cuda":
            self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
            for host, t in zip(self._host, tensors, strict=True):
                host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tuple(t.clone() for t in tensors)

    @classmethod
    def of_host(cls, *arrays: np.ndarray) -> HostCopy:
        """Arrays already on the host (host mode), fresh ones: nothing to copy or wait for."""
        copy = cls.__new__(cls)  # no tensors to copy: __init__'s work is all for them
        copy._event, copy._host, copy._arrays = None, (), list(arrays)
        return copy

    def wait(self) -> list[np.ndarray]:
        if self._arrays is not None:
            return self._arrays
        if self._event is not None:
            self._event.synchronize()
        return [t.numpy() for t in self._host]


def start_host_copy(*tensors: torch.Tensor) -> HostCopy:
    return HostCopy(tensors)


# Tensor methods and functions that make the host wait for the device on CUDA: their result (a Python value, a
# host array, or a shape) depends on the device's values. Boolean-mask indexing counts too (its shape does).
_HOST_SYNCS = frozenset(("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
                         "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"))  # fmt: skip


class HostSyncCounter(torch.overrides.TorchFunctionMode):
    """Counts the calls that would wait for the device on CUDA, on any device (so CPU tests can assert none).

    On CUDA `torch.cuda.set_sync_debug_mode("error")` is the authority (scripts/gpu-check); this counter is its
    portable stand-in: it sees the torch calls themselves, so a CPU run of the same code path counts the same.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name in _HOST_SYNCS or (name in ("__getitem__", "__setitem__", "index_put_") and _has_bool_index(args)):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _has_bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else ()
    flat = indices if isinstance(indices, tuple | list) else (indices,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in flat)
