"""The engine loop: scheduler -> pool -> model -> greedy sample -> record_sampled -> scheduler update.

One `Engine.step` is one scheduler output through a backend's pool and the tiny decoder, timed per
stage. The engine keeps its own account of every request's tokens (prompt, then what it sampled) and,
if asked, of every logits row the model produced with the position it predicts from, so that a dense
recompute can check it afterwards (slotmap.simulate.dense_check).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from conformance.backends import BackendHandle
from slotmap.tiny.kv_caches import PagedKV
from slotmap.tiny.model import ModelConfig, TinyDecoder
from spec.types import BatchInputs, SchedulerOutput, WorkerConfig

STAGES = ("schedule", "apply", "prepare", "model", "sample", "record_sampled", "update", "verify")


@dataclass
class LogitsRecord:
    position: int  # the position whose logits these are: they predict the token at position + 1
    logits: torch.Tensor  # [vocab] float32, on the CPU
    sampled: int | None  # the token appended to the request, None where the pool discarded it (mid-prefill)


@dataclass
class RequestRecord:
    req_id: str
    prompt: tuple[int, ...]
    tokens: list[int]  # prompt, then every sampled token, in order
    logits: list[LogitsRecord] = field(default_factory=list)


@dataclass
class StepStats:
    num_reqs: int
    prefill_tokens: int  # prompt tokens, recomputed tokens after preemption, and chunked prefill
    decode_tokens: int  # single generated tokens fed back
    padding_tokens: int
    sampled: int  # rows that appended a token


@dataclass
class StepResult:
    batch: BatchInputs
    logits: torch.Tensor  # [num_reqs, vocab] float32
    argmax: np.ndarray  # [num_reqs] int64, the greedy token of every batch row (kept or not)
    sampled: dict[str, int]  # req_id -> token appended this step (rows that reached their last known token)
    stats: StepStats


def backend_device(backend: BackendHandle) -> torch.device:
    """Where a backend keeps its arrays: the device of its tensors, or the CPU for NumPy backends."""
    probe = backend.asarray(np.zeros(1, np.float32))
    return probe.device if isinstance(probe, torch.Tensor) else torch.device("cpu")


class Engine:
    def __init__(
        self,
        backend: BackendHandle,
        config: WorkerConfig,
        model_config: ModelConfig | None = None,
        device: torch.device | str | None = None,
        record_logits: bool = True,
    ) -> None:
        self.backend = backend
        self.config = config
        self.model_config = model_config or ModelConfig(vocab_size=config.vocab_size)
        if self.model_config.vocab_size != config.vocab_size:
            raise ValueError(f"model vocab {self.model_config.vocab_size} != worker vocab {config.vocab_size}")
        self.device = torch.device(device) if device is not None else backend_device(backend)
        self.model = TinyDecoder(self.model_config, config.kv_groups, self.device)
        self.pool = backend.make_pool(config)
        self.kv = PagedKV(
            backend, config.kv_groups, self.model_config.layer_groups,
            self.model_config.num_kv_heads, self.model_config.head_dim, self.device,
        )
        self.record_logits = record_logits
        self.requests: dict[str, RequestRecord] = {}  # live requests, by req_id
        self.stage_seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # kernels are asynchronous: charge them to their stage
            self.stage_seconds[stage] += time.perf_counter() - start

    def step(
        self,
        out: SchedulerOutput,
        pad_to: int | None = None,
        before_model: Callable[[BatchInputs], None] | None = None,
    ) -> StepResult:
        """Run one scheduler output. `before_model(batch)` sees the batch while the caches still hold
        only earlier steps' KV (the verifier snapshots them there)."""
        with self.timed("apply"):
            self.pool.apply(out)
        for new in out.new_requests:
            self.requests[new.req_id] = RequestRecord(new.req_id, new.prompt_token_ids, list(new.prompt_token_ids))
        with self.timed("prepare"):
            batch = self.pool.prepare(out, pad_to)
        if before_model is not None:
            with self.timed("verify"):
                before_model(batch)
        with self.timed("model"):
            logits = self.model.forward_paged(batch, self.kv)
        with self.timed("sample"):
            sampled_ids = logits.argmax(dim=-1)  # [num_reqs] greedy
            sampled_host = sampled_ids.cpu().numpy()
        seq_lens = self.backend.to_numpy(batch.seq_lens)
        num_scheduled = self.backend.to_numpy(batch.num_scheduled_tokens)
        takes = [int(seq_lens[b]) == len(self.requests[r].tokens) for b, r in enumerate(batch.req_ids)]
        with self.timed("record_sampled"):
            native = sampled_ids if self.kv.native_torch else self.backend.asarray(sampled_host.astype(np.int64))
            self.pool.record_sampled(batch, native)
        sampled: dict[str, int] = {}
        decode = 0
        logits_host = logits.detach().cpu() if self.record_logits else None  # one copy, not one per row
        for b, req_id in enumerate(batch.req_ids):
            record = self.requests[req_id]
            if num_scheduled[b] == 1 and seq_lens[b] - 1 >= len(record.prompt) and takes[b]:
                decode += 1
            token = int(sampled_host[b]) if takes[b] else None
            if logits_host is not None:
                record.logits.append(LogitsRecord(int(seq_lens[b]) - 1, logits_host[b].clone(), token))
            if token is not None:
                record.tokens.append(token)
                sampled[req_id] = token
        stats = StepStats(
            num_reqs=batch.num_reqs,
            prefill_tokens=batch.num_tokens - decode,
            decode_tokens=decode,
            padding_tokens=batch.num_tokens_padded - batch.num_tokens,
            sampled=len(sampled),
        )
        return StepResult(batch, logits, sampled_host.astype(np.int64), sampled, stats)

    def idle(self, out: SchedulerOutput) -> None:
        """A step that schedules no tokens: only its finished requests are removed from the pool."""
        with self.timed("apply"):
            self.pool.apply(out)

    def finish(self, req_ids: frozenset[str] | set[str]) -> list[RequestRecord]:
        """Forget finished requests; their records go to the caller (e.g. the dense check)."""
        return [self.requests.pop(r) for r in sorted(req_ids) if r in self.requests]


class Scheduler(Protocol):
    """What the loop needs from a scheduler (conformance.scheduler.ReferenceScheduler provides it)."""

    def done(self) -> bool: ...

    def schedule(self) -> SchedulerOutput: ...

    def pad_to(self, out: SchedulerOutput) -> int | None: ...

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> None: ...


class StepObserver(Protocol):
    """Sees every step around the model (slotmap.simulate.verify.SpecVerifier is one)."""

    def before_model(self, out: SchedulerOutput, pad_to: int | None) -> Callable[[BatchInputs], None]: ...

    def after_model(self, result: StepResult) -> None: ...

    def idle(self, out: SchedulerOutput) -> None: ...


def drive(
    engine: Engine,
    scheduler: Scheduler,
    *,
    observer: StepObserver | None = None,
    on_step: Callable[[SchedulerOutput, StepResult | None], None] | None = None,
    on_finished: Callable[[RequestRecord], None] | None = None,
    max_steps: int | None = None,
) -> int:
    """Run the scheduler to completion (or `max_steps`); returns the number of steps taken."""
    steps = 0
    while not scheduler.done() and (max_steps is None or steps < max_steps):
        with engine.timed("schedule"):
            out = scheduler.schedule()
            pad_to = scheduler.pad_to(out)
        for record in engine.finish(out.finished_req_ids):
            if on_finished is not None:
                on_finished(record)
        result: StepResult | None = None
        if out.total_num_scheduled_tokens == 0:  # nothing runnable this step; finished rows are still freed
            engine.idle(out)
            if observer is not None:
                observer.idle(out)
        else:
            hook = observer.before_model(out, pad_to) if observer is not None else None
            result = engine.step(out, pad_to, hook)
            if observer is not None:
                with engine.timed("verify"):
                    observer.after_model(result)
        with engine.timed("update"):
            scheduler.update(out, result.sampled if result is not None else {})
        if on_step is not None:
            on_step(out, result)
        steps += 1
    return steps
