"""slotmap beside a running vLLM: the shadow checker attached to vLLM's own model runner.

    from shadow.vllm_attach import attach
    shadow = attach(llm)      # in-process vllm.LLM; or SLOTMAP_SHADOW=1 through the vllm.general_plugins entry point

`attach` checks vLLM's GPUModelRunner (v1: `VllmShadow`) and its model runner v2 (`VllmShadowV2`).

`worker_config_from_vllm(vllm_config, kv_cache_config)` builds the WorkerConfig. Importing this package
imports nothing from vLLM; `worker_config_from_vllm` imports it when called, and `attach` recognises the
runner's class among the modules vLLM has loaded.
"""

from shadow.vllm_attach.common import AttachedShadow, StepRecord
from shadow.vllm_attach.config import UnsupportedVllmConfigError, worker_config_from_vllm
from shadow.vllm_attach.hook import VllmShadow, attach, model_runner_of
from shadow.vllm_attach.mrv2 import VllmShadowV2

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
