"""slotmap's `vllm.general_plugins` entry point: with SLOTMAP_SHADOW=1, every vLLM model runner is shadowed.

vLLM calls `register()` in every process it starts (front end, engine core, workers) before it builds a
model runner. Unless SLOTMAP_SHADOW is 1 it does nothing and imports nothing. With it, it wraps
`WorkerWrapperBase.init_device`, the call in which every executor's worker (in-process, multiprocess,
Ray) builds its model runner. Right after that call the runner is either one slotmap checks (vLLM's
GPUModelRunner, model runner v2's, or a subclass of either: the CPU, XPU and CUDA runners) and gets an
`execute_model` of its own that attaches the shadow checker at the runner's first step (when the KV
cache exists; profile and dummy runs before it pass through), so every step the engine runs is checked;
or it is not, and the worker fails there with UnsupportedVllmConfigError naming the runner's type: with
the plugin on, an engine slotmap cannot check never runs unchecked. A runner configuration `attach`
refuses (e.g. model runner v2 with speculative decoding) fails the first step the same way.
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
    from vllm.v1.worker.worker_base import WorkerWrapperBase  # only when asked for

    from shadow.vllm_attach.compat import let_vllm_scan_modules_beside_numba

    let_vllm_scan_modules_beside_numba()  # plugins load before vLLM builds its engine and scans the modules

    if getattr(WorkerWrapperBase.init_device, "_slotmap_attaches", False):
        return  # vLLM may load plugins more than once per process
    own = WorkerWrapperBase.init_device

    def init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = own(self, *args, **kwargs)
        attach_at_first_step(self)
        return result

    init_device._slotmap_attaches = True  # type: ignore[attr-defined]
    WorkerWrapperBase.init_device = init_device


def attach_at_first_step(worker: Any) -> None:
    """Give the worker's model runner an execute_model that attaches the checker at the first real step;
    UnsupportedVllmConfigError, naming the type, for a runner (or no runner) slotmap cannot check."""
    from shadow.vllm_attach.common import runner_kind, runner_of_worker
    from shadow.vllm_attach.config import UnsupportedVllmConfigError

    runner = runner_of_worker(worker)
    if runner_kind(runner) is None:
        what = "no model runner" if runner is None else f"{type(runner).__module__}.{type(runner).__qualname__}"
        raise UnsupportedVllmConfigError(
            f"{ENV}=1: the worker built {what}; slotmap checks vLLM's GPUModelRunner "
            "(vllm/v1/worker/gpu_model_runner.py), model runner v2's (vllm/v1/worker/gpu/model_runner.py) "
            f"and their subclasses. Unset {ENV} to serve this engine unchecked"
        )
    if "execute_model" in runner.__dict__:
        return  # already given (or attached)

    def execute_model(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("dummy_run"):  # model runner v2's profile and padding runs: no step of the engine's
            return type(runner).execute_model(runner, *args, **kwargs)
        from shadow.vllm_attach.hook import attach

        del runner.execute_model  # the class's own, which attach wraps
        try:
            # keep_records=False: a served engine runs indefinitely, and the records are for tests and
            # benchmarks; attach installs the instance's own wrapped execute_model, which this call goes through
            attach(runner, keep_records=False)
        except BaseException:
            runner.execute_model = execute_model  # refused: so is every later step, none runs unchecked
            raise
        return runner.execute_model(*args, **kwargs)

    runner.execute_model = execute_model
