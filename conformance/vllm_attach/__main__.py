"""`python -m conformance.vllm_attach`: the old name of `python -m shadow.vllm_attach`, kept for one release."""

import runpy
import warnings

warnings.warn("python -m conformance.vllm_attach is now python -m shadow.vllm_attach", DeprecationWarning, stacklevel=1)
runpy.run_module("shadow.vllm_attach", run_name="__main__", alter_sys=True)
