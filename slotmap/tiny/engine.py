"""The engine loop: scheduler -> pool -> model -> greedy sample -> record_sampled -> scheduler update.

With speculative decoding (a scheduler whose outputs carry drafts), the model's logits cover every
drafting position and greedy verification (slotmap.tiny.drafting) keeps the matching drafts plus one
token: the tokens are those of a plain greedy run, in fewer steps.

One `Engine.step` is one scheduler output through a backend's pool and the tiny decoder, timed per
stage. The engine keeps its own account of every request's tokens (prompt, then what it sampled) and,
if asked, of every logits row the model produced with the position it predicts from, so that a dense
recompute can check it afterwards (slotmap.simulate.dense_check).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from conformance.backends import BackendHandle
from slotmap.tiny.drafting import greedy_verify
from slotmap.tiny.kv_caches import PagedKV
from slotmap.tiny.model import ModelConfig, TinyDecoder, encoder_input_ids
from spec.drafts import pad_accepted
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
    mrope_positions: Any = None  # a multimodal request's [3, prompt_len] M-RoPE table (spec/mrope.py); None: text
    mrope_position_delta: int = 0
    encoder_ids: tuple[int, ...] = ()  # an encoder-decoder request's encoder input (spec/cross_attention.py)


@dataclass
class StepStats:
    num_reqs: int
    prefill_tokens: int  # prompt tokens, recomputed tokens after preemption, and chunked prefill
    decode_tokens: int  # generated tokens fed back: one per decoding row, plus its drafts
    padding_tokens: int
    sampled: int  # tokens appended (one per sampling row, more where drafts were accepted)
    drafts: int = 0  # draft tokens verified
    accepted: int = 0  # of which kept


@dataclass
class StepResult:
    batch: BatchInputs
    logits: torch.Tensor  # [num_reqs + num_drafts, vocab] float32, at the batch's logits_indices
    argmax: np.ndarray  # [num_reqs + num_drafts] int64, the greedy token of every logits row (kept or not)
    kept: list[tuple[int, ...]]  # [num_reqs] per batch row, what greedy verification keeps (recorded or not)
    sampled: dict[str, tuple[int, ...]]  # req_id -> tokens appended this step (rows that reached their last token)
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
        cross = self.model.cross_group if self.model_config.cross_attention else None
        self.kv = PagedKV(
            backend, config.kv_groups, self.model_config.layer_groups,
            self.model_config.num_kv_heads, self.model_config.head_dim, self.device,
            None if cross is None else config.kv_groups[cross],
        )  # fmt: skip
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
            encoder = encoder_input_ids(new.prompt_token_ids, new.encoder_len, self.config.vocab_size)
            self.requests[new.req_id] = RequestRecord(
                new.req_id, new.prompt_token_ids, list(new.prompt_token_ids), [],
                new.mrope_positions, new.mrope_position_delta, encoder,
            )  # fmt: skip
        with self.timed("prepare"):
            batch = self.pool.prepare(out, pad_to)
        if before_model is not None:
            with self.timed("verify"):
                before_model(batch)
        with self.timed("model"):
            logits = self.model.forward_paged(batch, self.kv, self._encoder_inputs(batch))
        with self.timed("sample"):
            sampled_ids = logits.argmax(dim=-1)  # [num_reqs + num_drafts] greedy
            sampled_host = sampled_ids.cpu().numpy().astype(np.int64)
            drafting = batch.num_draft_tokens is not None
            num_drafts = self.backend.to_numpy(batch.num_draft_tokens) if drafting else np.zeros(batch.num_reqs, int)
            draft_ids = self.backend.to_numpy(batch.draft_token_ids) if drafting else None
            kept = greedy_verify(sampled_host, num_drafts if drafting else None, draft_ids)
        seq_lens = self.backend.to_numpy(batch.seq_lens)
        num_scheduled = self.backend.to_numpy(batch.num_scheduled_tokens)
        takes = [
            int(seq_lens[b]) == len(self.requests[r].tokens) + int(num_drafts[b]) for b, r in enumerate(batch.req_ids)
        ]
        with self.timed("record_sampled"):
            if drafting:  # the rejection sampler's form: [num_reqs, max_k + 1] padded with -1
                native = self.backend.asarray(pad_accepted(kept))
            else:
                native = sampled_ids if self.kv.native_torch else self.backend.asarray(sampled_host)
            self.pool.record_sampled(batch, native)
        sampled: dict[str, tuple[int, ...]] = {}
        decode = drafts = accepted = 0
        logits_host = logits.detach().cpu() if self.record_logits else None  # one copy, not one per row
        first_row = 0  # the batch row's first logits row
        for b, req_id in enumerate(batch.req_ids):
            record, k = self.requests[req_id], int(num_drafts[b])
            if num_scheduled[b] == 1 + k and seq_lens[b] - 1 - k >= len(record.prompt) and takes[b]:
                decode += 1 + k
            if logits_host is not None:  # rows past a rejected draft saw a token the sequence does not hold
                for i in range(len(kept[b])):
                    token = kept[b][i] if takes[b] else None
                    position = int(seq_lens[b]) - 1 - k + i
                    record.logits.append(LogitsRecord(position, logits_host[first_row + i].clone(), token))
            if takes[b]:
                record.tokens.extend(kept[b])
                sampled[req_id] = kept[b]
                drafts, accepted = drafts + k, accepted + len(kept[b]) - 1
            first_row += 1 + k
        stats = StepStats(
            num_reqs=batch.num_reqs,
            prefill_tokens=batch.num_tokens - decode,
            decode_tokens=decode,
            padding_tokens=batch.num_tokens_padded - batch.num_tokens,
            sampled=sum(len(t) for t in sampled.values()),
            drafts=drafts,
            accepted=accepted,
        )
        return StepResult(batch, logits, sampled_host, kept, sampled, stats)

    def _encoder_inputs(self, batch: BatchInputs) -> list[int]:
        """The encoder inputs of the rows whose encoder runs this step, in batch order (cross_slot_mapping's)."""
        if batch.scheduled_encoder_lens is None or not self.model_config.cross_attention:
            return []
        written = self.backend.to_numpy(batch.scheduled_encoder_lens)
        return [t for b, r in enumerate(batch.req_ids) if written[b] for t in self.requests[r].encoder_ids]

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

    def update(self, out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> None: ...


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
