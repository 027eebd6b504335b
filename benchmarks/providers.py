"""Providers: one object per implementation being timed, so every suite is written once.

Names are fixed (test ids stay stable across machines); a provider that cannot run here (no CUDA
device) is skipped with the reason. Every call into a CUDA provider is followed by
`sync()` inside the timed target, so a benchmark measures finished work, not queued launches.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import spec
import spec.slots
from benchmarks.baselines.numpy_vectorised import NumpyVectorisedPool
from benchmarks.baselines.python_lists import PythonListPool

# "-async": the same pool under async scheduling (spec/async_steps.py): record_sampled leaves the ids on the device
POOL_PROVIDERS = ("spec", "fast", "fast-async", "fast-cuda", "numpy-vectorised", "python-lists")
SLOT_PROVIDERS = ("spec", "fast", "numpy-vectorised", "python-lists")  # on CUDA, fast fuses slots into prepare
KERNEL_PROVIDERS = ("spec", "fast", "fast-cuda")  # write_kv and the whole layer step
ATTENTION_PROVIDERS = ("spec", "fast", "fast-cuda", "dense-sdpa", "dense-sdpa-cuda")


@dataclass(frozen=True)
class Provider:
    name: str
    device: str  # "cpu" or "cuda"; "numpy" for spec and the NumPy baseline
    make_pool: Callable[[spec.WorkerConfig], Any] | None = None
    module: Any = None  # spec or fast: write_kv, paged_attention, slots.slot_mapping

    @property
    def is_numpy(self) -> bool:
        return self.device == "numpy"

    def asarray(self, array: np.ndarray) -> Any:
        """NumPy -> this provider's array type, on its device."""
        if self.is_numpy:
            return array
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


def _fast_module() -> Any:
    import fast  # a broken fast must fail the benchmark build, not skip it

    return fast


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")


def get(name: str) -> Provider:
    """The provider called `name`, or pytest.skip with the reason it cannot run here."""
    if name == "spec":
        return Provider("spec", "numpy", spec.RequestStatePool, spec)
    if name == "numpy-vectorised":
        return Provider(name, "numpy", NumpyVectorisedPool)
    if name == "python-lists":
        return Provider(name, "cpu", PythonListPool)
    if name in ("dense-sdpa", "dense-sdpa-cuda"):
        if name.endswith("cuda"):
            _need_cuda()
        return Provider(name, "cuda" if name.endswith("cuda") else "cpu")
    if name.endswith("-async"):
        base = get(name.removesuffix("-async"))
        make = base.make_pool
        if make is None:
            raise ValueError(f"{name}: {base.name} has no pool")
        return dataclasses.replace(
            base, name=name, make_pool=lambda config: make(dataclasses.replace(config, async_scheduling=True))
        )
    if name in ("fast", "fast-cuda"):
        if name == "fast-cuda":
            _need_cuda()
        fast = _fast_module()
        device = "cuda" if name == "fast-cuda" else "cpu"
        return Provider(name, device, lambda config: fast.RequestStatePool(config, device=device), fast)
    raise ValueError(f"unknown provider {name!r}")


def slot_mapping_fn(provider: Provider) -> Callable[[Any, Any, Any, int], Any]:
    """(block_table [R, max_blocks], token_rows [num_tokens], positions [T], block_size) -> slots [T]."""
    if provider.name == "spec":
        return spec.slots.slot_mapping
    if provider.name == "numpy-vectorised":
        return numpy_slot_mapping
    if provider.name == "python-lists":
        return python_slot_mapping
    return fast_slot_mapping


def fast_slot_mapping(
    block_table_np: np.ndarray, token_rows_np: np.ndarray, positions_np: np.ndarray, block_size: int
) -> np.ndarray:
    """fast's compiled CPU stage (it writes into the caller's buffer; here a fresh one, as the other providers)."""
    import fast.slots

    out = np.empty(positions_np.shape[0], np.int64)
    fast.slots.slot_mapping(block_table_np, token_rows_np, positions_np, block_size, out)
    return out


def host_arguments(fn: Callable[..., Any]) -> set[str]:
    """Parameters `fn` takes as host NumPy arrays: by the project's convention their names end in `_np`."""
    return {name for name in inspect.signature(fn).parameters if name.endswith("_np")}


def numpy_slot_mapping(block_table: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, bs: int) -> np.ndarray:
    # the slot stage of NumpyVectorisedPool.prepare on its own: one flat gather, then arithmetic
    flat_index = token_rows * block_table.shape[1] + positions // bs
    slots = np.take(block_table.ravel(), flat_index).astype(np.int64)
    slots *= bs
    slots += positions % bs
    return slots


def python_slot_mapping(block_table: Any, token_rows: Any, positions: Any, bs: int) -> torch.Tensor:
    # the slot loop of PythonListPool.prepare on its own: tables are Python lists there
    slots = [block_table[row][pos // bs] * bs + pos % bs for row, pos in zip(token_rows, positions, strict=True)]
    return torch.tensor(slots, dtype=torch.int64)
