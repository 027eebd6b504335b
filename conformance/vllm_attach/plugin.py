"""slotmap's `vllm.general_plugins` entry point: with SLOTMAP_SHADOW=1, every vLLM model runner is shadowed.

vLLM calls `register()` in every process it starts (front end, engine core, workers) before it builds a
model runner. Unless SLOTMAP_SHADOW is 1 it does nothing and imports nothing. With it, GPUModelRunner's
`execute_model` (the CPU, XPU and CUDA runners inherit it) attaches the shadow checker to its runner on
the runner's first step, when the KV cache exists, so every step the engine runs is checked.
SLOTMAP_SHADOW_REPRO_DIR says where a divergence's reproduction script is written.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "SLOTMAP_SHADOW"


def enabled() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0")


def register() -> None:
    if not enabled():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # only when asked for

    from conformance.vllm_attach.compat import let_vllm_scan_modules_beside_numba

    let_vllm_scan_modules_beside_numba()  # plugins load before vLLM builds its engine and scans the modules

    if getattr(GPUModelRunner.execute_model, "_slotmap_attaches", False):
        return  # vLLM may load plugins more than once per process
    own = GPUModelRunner.execute_model

    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "_slotmap_shadow" not in self.__dict__:
            from conformance.vllm_attach.hook import attach

            # keep_records=False: a served engine runs indefinitely, and the records are for tests and benchmarks;
            # this installs the instance's own wrapped execute_model, which this call goes through
            attach(self, keep_records=False)
            return self.execute_model(*args, **kwargs)
        return own(self, *args, **kwargs)

    execute_model._slotmap_attaches = True  # type: ignore[attr-defined]
    GPUModelRunner.execute_model = execute_model
