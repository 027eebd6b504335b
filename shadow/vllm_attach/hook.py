"""The shadow checker inside vLLM's model runner: every step's scheduler output and built inputs go to spec.

    shadow = attach(llm)          # an in-process vllm.LLM (VLLM_ENABLE_V1_MULTIPROCESSING=0), or its model runner
    llm.generate(...)             # each step is checked before the model runs; a divergence raises
    shadow.steps_checked, shadow.checker

`attach` finds the runner and picks the attach for its kind: vLLM's `GPUModelRunner` (v1, this module) or
model runner v2 (`shadow/vllm_attach/mrv2.py`); any other runner is refused, naming its type. For v1
it wraps five methods of one `GPUModelRunner` instance (the CPU, XPU and CUDA runners all are one), each
capturing what the runner itself built, as host copies, before the forward pass reads it:

| runner method | what is taken |
|---|---|
| `execute_model(scheduler_output)` | the step's SchedulerOutput (handed to `spec.interop.from_vllm` by the checker) |
| `_prepare_inputs` | `logits_indices`, the `SpecDecodeMetadata` (drafts, target/bonus indices), the batch order |
| each attention group's `build_metadata` | per KV cache group, the `CommonAttentionMetadata` its backend is built |
| | from: `query_start_loc`, `seq_lens`, `block_table_tensor`, `slot_mapping` |
| `_model_forward(input_ids=, positions=)` | the model's own inputs; the step is checked here, before the forward pass |
| `sample_tokens` | the tokens each request kept (1..k+1 with drafts, none mid-prefill) -> `record_sampled` |

With async scheduling (no drafts) the sampled tokens are read from the step's pending host copy when the
next step starts. Nothing here imports vLLM: the runner's classes are recognised among the modules
vLLM already loaded (`common.runner_kind`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from shadow.checker import ShadowChecker
from shadow.vllm_attach.common import AttachedShadow, Step, host, kept, runner_kind, runner_of_worker
from shadow.vllm_attach.config import UnsupportedVllmConfigError

_WRAPPED = ("execute_model", "_prepare_inputs", "_build_attention_metadata", "_model_forward", "sample_tokens")


class VllmShadow(AttachedShadow):
    """The attached checker of one GPUModelRunner (v1; see the module docstring)."""

    def __init__(self, runner: Any, checker: ShadowChecker | None = None, keep_records: bool = True, **kw: Any) -> None:
        super().__init__(runner, checker, keep_records, **kw)
        self._pending_async: Any = None  # the last step's AsyncModelRunnerOutput, not yet recorded
        self._originals: dict[str, Callable[..., Any]] = {}
        self._group_originals: list[tuple[Any, Callable[..., Any]]] = []
        self._install()

    def _refuse(self, runner: Any) -> None:
        if runner.speculative_config is not None and runner.use_async_scheduling:
            raise UnsupportedVllmConfigError(
                "async_scheduling with speculative decoding: the scheduler's drafts are placeholders the worker "
                "fills on the device; attach with async_scheduling=False"
            )

    # ---- installation ----------------------------------------------------------------------------
    def _install(self) -> None:
        r = self.runner
        for name in _WRAPPED:
            self._originals[name] = getattr(r, name)
            setattr(r, name, getattr(self, f"_w{name}" if name.startswith("_") else f"_w_{name}"))
        for gid, attn_groups in enumerate(r.attn_groups):
            for attn_group in attn_groups:
                original = attn_group.build_metadata
                self._group_originals.append((attn_group, original))
                attn_group.build_metadata = self._group_builder(gid, original)
        r._slotmap_shadow = self

    def detach(self) -> None:
        """Restore the runner's own methods (recording a pending async step first)."""
        self._flush_async()
        for name in self._originals:
            self.runner.__dict__.pop(name, None)
        for attn_group, _original in self._group_originals:
            attn_group.__dict__.pop("build_metadata", None)
        self.runner.__dict__.pop("_slotmap_shadow", None)

    # ---- the wrapped methods ---------------------------------------------------------------------
    def _w_execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        self._flush_async()
        self._step = Step(scheduler_output, copy.deepcopy(scheduler_output) if self.keep_records else None)
        out = self._originals["execute_model"](scheduler_output, intermediate_tensors)
        step = self._step
        if not step.checked and scheduler_output.total_num_scheduled_tokens == 0:
            # no forward pass and no sample_tokens call: the step only finishes or preempts requests
            self._check(step)
            self._record(step, {})
        return out

    def _w_prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        logits_indices, spec_meta, max_sampled = self._originals["_prepare_inputs"](
            scheduler_output, num_scheduled_tokens
        )
        step = self._step
        if step is not None and not step.checked:
            batch = self.runner.input_batch
            step.req_ids = list(batch.req_ids[: batch.num_reqs])
            step.arrays["logits_indices"] = host(logits_indices)
            step.arrays["num_scheduled_tokens"] = np.array(num_scheduled_tokens, copy=True)
            if spec_meta is not None:
                step.arrays.update(_spec_decode_arrays(spec_meta))
        return logits_indices, spec_meta, max_sampled

    def _w_build_attention_metadata(self, *args: Any, **kwargs: Any) -> Any:
        step = self._step
        if step is None or step.checked or "query_start_loc" in step.arrays:
            return self._originals["_build_attention_metadata"](*args, **kwargs)
        step.in_attention_build = True
        try:
            result = self._originals["_build_attention_metadata"](*args, **kwargs)
        finally:
            step.in_attention_build = False
        bound = _bound(self._originals["_build_attention_metadata"], args, kwargs)
        num_reqs, slot_mappings = bound["num_reqs"], bound.get("slot_mappings") or {}
        for gid in range(len(self.config.kv_groups)):
            # a group whose backend reused another group's metadata (update_block_table): the runner's buffers
            if f"slot_mapping[{gid}]" not in step.arrays and gid in slot_mappings:
                step.arrays[f"slot_mapping[{gid}]"] = host(slot_mappings[gid])
            if f"block_table[{gid}]" not in step.arrays:
                table = self.runner.input_batch.block_table[gid].get_device_tensor(num_reqs)
                step.arrays[f"block_table[{gid}]"] = host(table)
        return result

    def _group_builder(self, gid: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def build_metadata(common_attn_metadata: Any, ubatch_idx: int = 0, *args: Any, **kwargs: Any) -> Any:
            step = self._step
            if step is not None and step.in_attention_build and ubatch_idx == 0:
                cm = common_attn_metadata
                n = cm.num_reqs
                if "query_start_loc" not in step.arrays:
                    step.arrays["query_start_loc"] = host(cm.query_start_loc[: n + 1])
                    step.arrays["seq_lens"] = host(cm.seq_lens[:n])
                step.arrays.setdefault(f"block_table[{gid}]", host(cm.block_table_tensor[:n]))
                step.arrays.setdefault(f"slot_mapping[{gid}]", host(cm.slot_mapping))
            return original(common_attn_metadata, ubatch_idx, *args, **kwargs)

        return build_metadata

    def _w_model_forward(self, *args: Any, **kwargs: Any) -> Any:
        step = self._step
        if step is not None and not step.checked:
            for name in ("input_ids", "positions"):
                value = kwargs.get(name)
                if value is not None and value.ndim == 1:  # M-RoPE's [3, T] positions are not slotmap's
                    step.arrays[name] = host(value)
            self._check(step)
        return self._originals["_model_forward"](*args, **kwargs)

    def _w_sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        out = self._originals["sample_tokens"](*args, **kwargs)
        step = self._step
        if step is None or not step.checked or out is None:
            return out
        if hasattr(out, "sampled_token_ids") and isinstance(out.sampled_token_ids, list):
            self._record(step, kept(out.req_ids, out.sampled_token_ids))
        else:  # async scheduling: the host copy is still in flight; read it when the next step starts
            self._pending_async = (step, out)
        return out

    # ---- async scheduling -----------------------------------------------------------------------
    def _flush_async(self) -> None:
        if self._pending_async is None:
            return
        step, out = self._pending_async
        self._pending_async = None
        out.async_copy_ready_event.synchronize()
        rows = out.sampled_token_ids_cpu.tolist()
        for i in out._invalid_req_indices:
            rows[i] = []
        self._record(step, kept(out._model_runner_output.req_ids, rows))


def _spec_decode_arrays(meta: Any) -> dict[str, np.ndarray]:
    """SpecDecodeMetadata as the shadow checker's drafting fields (vLLM's names)."""
    return {
        "num_draft_tokens": np.asarray(meta.num_draft_tokens, np.int64),
        "cu_num_draft_tokens": host(meta.cu_num_draft_tokens),
        "cu_num_sampled_tokens": host(meta.cu_num_sampled_tokens),
        "draft_token_ids": host(meta.draft_token_ids),
        "target_logits_indices": host(meta.target_logits_indices),
        "bonus_logits_indices": host(meta.bonus_logits_indices),
    }


def _bound(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    return dict(inspect.signature(fn).bind(*args, **kwargs).arguments)


def model_runner_of(llm: Any) -> Any:
    """The model runner of an in-process vllm.LLM (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker): v1's or MRv2's."""
    core = getattr(getattr(llm, "llm_engine", llm), "engine_core", None)
    engine_core = getattr(core, "engine_core", None)
    if engine_core is None:
        raise UnsupportedVllmConfigError(
            "the engine core runs in another process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 to attach in-process, "
            "or SLOTMAP_SHADOW=1 to attach through slotmap's vllm.general_plugins entry point in every worker"
        )
    return runner_of_worker(engine_core.model_executor.driver_worker)


def attach(target: Any, checker: ShadowChecker | None = None, **checker_kwargs: Any) -> AttachedShadow:
    """Attach the shadow checker to a vllm.LLM (in-process) or its model runner; returns the attached shadow.

    vLLM's GPUModelRunner (v1, and its CPU and XPU subclasses) gets a `VllmShadow` (this module), model
    runner v2 (vllm/v1/worker/gpu/, and its CPU subclass) a `mrv2.VllmShadowV2`; any other runner is
    refused with UnsupportedVllmConfigError naming its type. Attaching twice returns the first attach.
    """
    runner = model_runner_of(target) if hasattr(target, "llm_engine") or hasattr(target, "engine_core") else target
    existing = getattr(runner, "_slotmap_shadow", None)
    if existing is not None:
        return existing
    kind = runner_kind(runner)
    if kind == "v1":
        return VllmShadow(runner, checker, **checker_kwargs)
    if kind == "v2":
        from shadow.vllm_attach.mrv2 import VllmShadowV2

        return VllmShadowV2(runner, checker, **checker_kwargs)
    raise UnsupportedVllmConfigError(
        f"{type(runner).__module__}.{type(runner).__qualname__}: slotmap attaches to vLLM's GPUModelRunner "
        "(vllm/v1/worker/gpu_model_runner.py) and model runner v2's (vllm/v1/worker/gpu/model_runner.py), "
        "and their subclasses"
    )
