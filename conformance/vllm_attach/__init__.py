"""Moved: vllm_attach is `shadow.vllm_attach` now (`python -m shadow.vllm_attach`, `shadow.vllm_attach.attach`).

This package keeps the old import path working for one release and warns once imported.
"""

import warnings

from shadow.vllm_attach import (
    AttachedShadow,
    StepRecord,
    UnsupportedVllmConfigError,
    VllmShadow,
    VllmShadowV2,
    attach,
    model_runner_of,
    worker_config_from_vllm,
)

warnings.warn(
    "conformance.vllm_attach moved to shadow.vllm_attach (conformance.vllm_attach goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "AttachedShadow",
    "StepRecord",
    "UnsupportedVllmConfigError",
    "VllmShadow",
    "VllmShadowV2",
    "attach",
    "model_runner_of",
    "worker_config_from_vllm",
]
