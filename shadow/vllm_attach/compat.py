"""vLLM 0.32 beside numba in one process.

When vLLM builds an engine it rebinds its Triton kernels by reading `vars(x).get("kernel")` of every
attribute of every loaded module (vllm/triton_utils/dispatcher.py, `_rebind_kernels`). llvmlite's library
proxy (`llvmlite.binding.ffi.lib`, loaded with numba, which slotmap's fast backend uses) answers any
attribute, `__dict__` included, with a wrapped C function, so that scan raises AttributeError once numba
is loaded. The proxy looks its own table up first: an entry for `__dict__` (an empty dict) makes `vars()`
of it an empty namespace, and nothing else about llvmlite changes.
"""

from __future__ import annotations

import importlib.util


def let_vllm_scan_modules_beside_numba() -> None:
    """Call before building a vLLM engine in a process that has (or may load) numba; harmless otherwise."""
    if importlib.util.find_spec("llvmlite") is None:
        return
    from llvmlite.binding import ffi

    ffi.lib._fntab.setdefault("__dict__", {})
