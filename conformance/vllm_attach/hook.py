"""The shadow checker inside vLLM's model runner: every step's scheduler output and built inputs go to spec.

    shadow = attach(llm)          # an in-process vllm.LLM (VLLM_ENABLE_V1_MULTIPROCESSING=0), or its model runner
    llm.generate(...)             # each step is checked before the model runs; a divergence raises
    shadow.steps_checked, shadow.checker

`attach` wraps five methods of one `GPUModelRunner` instance (the CPU, XPU and CUDA runners all are one),
each capturing what the runner itself built, as host copies, before the forward pass reads it:

| runner method | what is taken |
|---|---|
| `execute_model(scheduler_output)` | the step's SchedulerOutput (handed to `spec.interop.from_vllm` by the checker) |
| `_prepare_inputs` | `logits_indices`, the `SpecDecodeMetadata` (drafts, target/bonus indices), the batch order |
| each attention group's `build_metadata` | per KV cache group, the `CommonAttentionMetadata` its backend is built |
| | from: `query_start_loc`, `seq_lens`, `block_table_tensor`, `slot_mapping` |
| `_model_forward(input_ids=, positions=)` | the model's own inputs; the step is checked here, before the forward pass |
| `sample_tokens` | the tokens each request kept (1..k+1 with drafts, none mid-prefill) -> `record_sampled` |

With async scheduling (no drafts) the sampled tokens are read from the step's pending host copy when the
next step starts. Nothing here imports vLLM at module level: vLLM is imported only inside `attach`.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conformance.shadow import ShadowChecker
from conformance.vllm_attach.config import UnsupportedVllmConfigError, worker_config_from_vllm

_WRAPPED = ("execute_model", "_prepare_inputs", "_build_attention_metadata", "_model_forward", "sample_tokens")
REPRO_DIR_ENV = "SLOTMAP_SHADOW_REPRO_DIR"  # where reproduction scripts go (default: the checker's)


def _host(t: Any) -> np.ndarray:
    """A host copy: the runner reuses its buffers on the next step (and on CPU they are the same memory)."""
    return t.detach().to("cpu", copy=True).numpy() if hasattr(t, "detach") else np.array(t)


@dataclass
class _Step:
    """What one step's runner built, gathered across the wrapped methods."""

    sched: Any  # vLLM's SchedulerOutput
    record: Any  # a deep copy taken before the runner read it (None without keep_records)
    req_ids: list[str] = field(default_factory=list)  # [num_reqs] batch_idx -> req_id (the runner's batch order)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # shadow field name -> host copy
    in_attention_build: bool = False
    checked: bool = False


@dataclass
class StepRecord:
    """One checked step, for tests and the benchmark: the scheduler output and what the runner sampled."""

    # vLLM's SchedulerOutput, copied as the runner received it: in one process the runner's request states
    # share its block-id lists and extend them on later steps
    sched: Any
    req_ids: tuple[str, ...]  # batch order
    sampled: dict[str, list[int]]  # req_id -> tokens kept this step (empty mid-prefill)
    num_draft_tokens: dict[str, int]  # req_id -> drafts scheduled


class VllmShadow:
    """The attached checker of one model runner (see the module docstring)."""

    def __init__(self, runner: Any, checker: ShadowChecker | None = None, keep_records: bool = True, **kw: Any) -> None:
        self.runner = runner
        if getattr(runner, "kv_cache_config", None) is None:
            raise UnsupportedVllmConfigError(
                "attach after the engine initialised its KV cache (the runner has none yet)"
            )
        if runner.speculative_config is not None and runner.use_async_scheduling:
            raise UnsupportedVllmConfigError(
                "async_scheduling with speculative decoding: the scheduler's drafts are placeholders the worker "
                "fills on the device; attach with async_scheduling=False"
            )
        self.config = worker_config_from_vllm(runner.vllm_config, runner.kv_cache_config)
        if checker is None:
            kw.setdefault("repro_dir", os.environ.get(REPRO_DIR_ENV))
            checker = ShadowChecker(self.config, **kw)
        self.checker = checker
        self.keep_records = keep_records
        self.records: list[StepRecord] = []
        self.steps_checked = 0
        self._step: _Step | None = None
        self._pending_async: Any = None  # the last step's AsyncModelRunnerOutput, not yet recorded
        self._originals: dict[str, Callable[..., Any]] = {}
        self._group_originals: list[tuple[Any, Callable[..., Any]]] = []
        self._install()

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
        self._step = _Step(scheduler_output, copy.deepcopy(scheduler_output) if self.keep_records else None)
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
            step.arrays["logits_indices"] = _host(logits_indices)
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
                step.arrays[f"slot_mapping[{gid}]"] = _host(slot_mappings[gid])
            if f"block_table[{gid}]" not in step.arrays:
                table = self.runner.input_batch.block_table[gid].get_device_tensor(num_reqs)
                step.arrays[f"block_table[{gid}]"] = _host(table)
        return result

    def _group_builder(self, gid: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def build_metadata(common_attn_metadata: Any, ubatch_idx: int = 0, *args: Any, **kwargs: Any) -> Any:
            step = self._step
            if step is not None and step.in_attention_build and ubatch_idx == 0:
                cm = common_attn_metadata
                n = cm.num_reqs
                if "query_start_loc" not in step.arrays:
                    step.arrays["query_start_loc"] = _host(cm.query_start_loc[: n + 1])
                    step.arrays["seq_lens"] = _host(cm.seq_lens[:n])
                step.arrays.setdefault(f"block_table[{gid}]", _host(cm.block_table_tensor[:n]))
                step.arrays.setdefault(f"slot_mapping[{gid}]", _host(cm.slot_mapping))
            return original(common_attn_metadata, ubatch_idx, *args, **kwargs)

        return build_metadata

    def _w_model_forward(self, *args: Any, **kwargs: Any) -> Any:
        step = self._step
        if step is not None and not step.checked:
            for name in ("input_ids", "positions"):
                value = kwargs.get(name)
                if value is not None and value.ndim == 1:  # M-RoPE's [3, T] positions are not slotmap's
                    step.arrays[name] = _host(value)
            self._check(step)
        return self._originals["_model_forward"](*args, **kwargs)

    def _w_sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        out = self._originals["sample_tokens"](*args, **kwargs)
        step = self._step
        if step is None or not step.checked or out is None:
            return out
        if hasattr(out, "sampled_token_ids") and isinstance(out.sampled_token_ids, list):
            self._record(step, _kept(out.req_ids, out.sampled_token_ids))
        else:  # async scheduling: the host copy is still in flight; read it when the next step starts
            self._pending_async = (step, out)
        return out

    # ---- checking --------------------------------------------------------------------------------
    def _check(self, step: _Step) -> None:
        step.checked = True
        self.checker.check(step.sched, step.arrays, step.req_ids)
        self.steps_checked += 1

    def _record(self, step: _Step, sampled: dict[str, list[int]]) -> None:
        # one token as an int, several (accepted drafts and the bonus) as a list; rows mid-prefill keep none
        self.checker.record_sampled({r: t[0] if len(t) == 1 else t for r, t in sampled.items() if t})
        if self.keep_records:
            drafts = {r: len(t) for r, t in (step.sched.scheduled_spec_decode_tokens or {}).items() if len(t)}
            self.records.append(StepRecord(step.record, tuple(step.req_ids), sampled, drafts))
        self._step = None

    def _flush_async(self) -> None:
        if self._pending_async is None:
            return
        step, out = self._pending_async
        self._pending_async = None
        out.async_copy_ready_event.synchronize()
        rows = out.sampled_token_ids_cpu.tolist()
        for i in out._invalid_req_indices:
            rows[i] = []
        self._record(step, _kept(out._model_runner_output.req_ids, rows))


def _kept(req_ids: list[str], rows: list[list[int]]) -> dict[str, list[int]]:
    """req_id -> the tokens the request keeps (vLLM's placeholder -1 ends a row's accepted tokens)."""
    kept = {}
    for req_id, row in zip(req_ids, rows, strict=False):
        tokens = []
        for t in row:
            if t < 0:
                break
            tokens.append(int(t))
        kept[req_id] = tokens
    return kept


def _spec_decode_arrays(meta: Any) -> dict[str, np.ndarray]:
    """SpecDecodeMetadata as the shadow checker's drafting fields (vLLM's names)."""
    return {
        "num_draft_tokens": np.asarray(meta.num_draft_tokens, np.int64),
        "cu_num_draft_tokens": _host(meta.cu_num_draft_tokens),
        "cu_num_sampled_tokens": _host(meta.cu_num_sampled_tokens),
        "draft_token_ids": _host(meta.draft_token_ids),
        "target_logits_indices": _host(meta.target_logits_indices),
        "bonus_logits_indices": _host(meta.bonus_logits_indices),
    }


def _bound(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    return dict(inspect.signature(fn).bind(*args, **kwargs).arguments)


def model_runner_of(llm: Any) -> Any:
    """The GPUModelRunner of an in-process vllm.LLM (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker)."""
    core = getattr(getattr(llm, "llm_engine", llm), "engine_core", None)
    engine_core = getattr(core, "engine_core", None)
    if engine_core is None:
        raise UnsupportedVllmConfigError(
            "the engine core runs in another process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 to attach in-process, "
            "or SLOTMAP_SHADOW=1 to attach through slotmap's vllm.general_plugins entry point in every worker"
        )
    worker = engine_core.model_executor.driver_worker
    return getattr(worker, "worker", worker).model_runner


def attach(target: Any, checker: ShadowChecker | None = None, **checker_kwargs: Any) -> VllmShadow:
    """Attach the shadow checker to a vllm.LLM (in-process) or a GPUModelRunner; returns the VllmShadow."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # only when attached

    runner = target if isinstance(target, GPUModelRunner) else model_runner_of(target)
    if not isinstance(runner, GPUModelRunner):  # model runner v2 (vllm/v1/worker/gpu/) builds its inputs otherwise
        raise UnsupportedVllmConfigError(f"{type(runner).__name__}: slotmap attaches to vLLM's GPUModelRunner (v1)")
    existing = getattr(runner, "_slotmap_shadow", None)
    if existing is not None:
        return existing
    return VllmShadow(runner, checker, **checker_kwargs)
