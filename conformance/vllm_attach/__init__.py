"""slotmap beside a running vLLM: the shadow checker attached to vLLM's own model runner.

    from conformance.vllm_attach import attach
    shadow = attach(llm)      # in-process vllm.LLM; or SLOTMAP_SHADOW=1 through the vllm.general_plugins entry point

`worker_config_from_vllm(vllm_config, kv_cache_config)` builds the WorkerConfig. Importing this package
imports nothing from vLLM; `attach` and `worker_config_from_vllm` import it when called.
"""

from conformance.vllm_attach.config import UnsupportedVllmConfigError, worker_config_from_vllm
from conformance.vllm_attach.hook import StepRecord, VllmShadow, attach, model_runner_of

__all__ = [
    "StepRecord",
    "UnsupportedVllmConfigError",
    "VllmShadow",
    "attach",
    "model_runner_of",
    "worker_config_from_vllm",
]
