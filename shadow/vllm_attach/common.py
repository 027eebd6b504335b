"""What the two attaches share: vLLM's GPUModelRunner (v1, hook.py) and its model runner v2 (mrv2.py).

Host copies of what a runner built, the tokens each request kept, one step's gathered arrays, the record
kept of each checked step, and `AttachedShadow`: the checker, its WorkerConfig and the counts, which a
subclass feeds from the runner methods it wraps. Nothing here imports vLLM.
"""

from __future__ import annotations

import os
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shadow.checker import ShadowChecker
from shadow.vllm_attach.config import UnsupportedVllmConfigError, worker_config_from_vllm

REPRO_DIR_ENV = "SLOTMAP_SHADOW_REPRO_DIR"  # where reproduction scripts go (default: the checker's)
# the runner classes slotmap attaches to: module, kind ("v1": hook.VllmShadow, "v2": mrv2.VllmShadowV2)
RUNNER_CLASSES = (("vllm.v1.worker.gpu_model_runner", "v1"), ("vllm.v1.worker.gpu.model_runner", "v2"))


def runner_kind(runner: Any) -> str | None:
    """The runner's kind: "v1" for vLLM's GPUModelRunner (or a subclass: the CPU and XPU runners), "v2"
    for model runner v2's GPUModelRunner (vllm/v1/worker/gpu/; its CPU runner too), None for anything
    else. Imports nothing: a runner class whose module was never imported cannot be the runner's."""
    for module_name, kind in RUNNER_CLASSES:
        module = sys.modules.get(module_name)
        if module is not None and isinstance(runner, module.GPUModelRunner):
            return kind
    return None


def host(t: Any) -> np.ndarray:
    """A host copy: the runner reuses its buffers on the next step (and on CPU they are the same memory)."""
    return t.detach().to("cpu", copy=True).numpy() if hasattr(t, "detach") else np.array(t)


def kept(req_ids: list[str], rows: list[list[int]]) -> dict[str, list[int]]:
    """req_id -> the tokens the request keeps (vLLM's placeholder -1 ends a row's accepted tokens)."""
    out = {}
    for req_id, row in zip(req_ids, rows, strict=False):
        tokens = []
        for t in row:
            if t < 0:
                break
            tokens.append(int(t))
        out[req_id] = tokens
    return out


@dataclass
class Step:
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


class AttachedShadow(ABC):
    """The checker attached to one model runner: its config, its checker, the steps checked and recorded.

    A subclass wraps the runner's methods (`_install`), gathers each step into a `Step`, calls `_check`
    before the forward pass and `_record` with the tokens the step kept; `detach` restores the runner.
    """

    def __init__(self, runner: Any, checker: ShadowChecker | None = None, keep_records: bool = True, **kw: Any) -> None:
        self.runner = runner
        if getattr(runner, "kv_cache_config", None) is None:
            raise UnsupportedVllmConfigError(
                "attach after the engine initialised its KV cache (the runner has none yet)"
            )
        self._refuse(runner)
        self.config = worker_config_from_vllm(runner.vllm_config, runner.kv_cache_config)
        if checker is None:
            kw.setdefault("repro_dir", os.environ.get(REPRO_DIR_ENV))
            checker = ShadowChecker(self.config, **kw)
        self.checker = checker
        self.keep_records = keep_records
        self.records: list[StepRecord] = []
        self.steps_checked = 0
        self._step: Step | None = None

    @abstractmethod
    def _refuse(self, runner: Any) -> None:
        """Raise UnsupportedVllmConfigError for a runner setup this attach cannot check."""

    @abstractmethod
    def detach(self) -> None:
        """Restore the runner's own methods."""

    def _check(self, step: Step) -> None:
        step.checked = True
        self.checker.check(step.sched, step.arrays, step.req_ids)
        self.steps_checked += 1

    def _record(self, step: Step, sampled: dict[str, list[int]]) -> None:
        # one token as an int, several (accepted drafts and the bonus) as a list; rows mid-prefill keep none
        self.checker.record_sampled({r: t[0] if len(t) == 1 else t for r, t in sampled.items() if t})
        if self.keep_records:
            drafts = {r: len(t) for r, t in (step.sched.scheduled_spec_decode_tokens or {}).items() if len(t)}
            self.records.append(StepRecord(step.record, tuple(step.req_ids), sampled, drafts))
        if self._step is step:
            self._step = None


def runner_of_worker(worker: Any) -> Any:
    """The model runner of a vLLM worker, or of the WorkerWrapperBase around it (None before init_device)."""
    return getattr(getattr(worker, "worker", worker), "model_runner", None)
