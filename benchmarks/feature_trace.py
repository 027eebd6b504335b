"""A feature workload's steps, recorded before any timing so every pool replays the very same ones.

The reference scheduler (conformance/scheduler/) runs the workload as conformance/differential.py drives it: per
output, a random target token for every batch row, the rejection step's verdict on the drafts, the drafter's ids
proposed on the device, and `update`. What a pool's record_sampled takes is kept in batch order, the order every
pool's prepare gives (spec/batch.py: a stable sort by tokens scheduled, which the pool's rows do not change), so
the recording needs no pool. The outputs' continuing requests are turned into CachedRequestColumns, the columnar
form vLLM's scheduler sends (CachedRequestData), as benchmarks/workloads.py's streams send them.

The steps before the workload's steady state (its prefills) are the warm-up, replayed untimed; from the first
output of the steady shape on, every output must keep it, or the recording fails: no round times another regime.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.columns import in_columns
from benchmarks.feature_workloads import FeatureWorkload
from conformance.scheduler import ReferenceScheduler
from spec.batch import batch_order
from spec.types import PLACEHOLDER_TOKEN_ID, SchedulerOutput, WorkerConfig

MAX_WARMUP = 200  # outputs before the steady state; past this the workload's setting is wrong
SEED = 4321  # the target tokens' generator (the scheduler's own draws follow the workload's seed)


@dataclass(frozen=True)
class TraceStep:
    out: SchedulerOutput
    sampled: np.ndarray  # [num_reqs] int64, or [num_reqs, 1 + drafts] when the step drafts: kept ids, -1 padded
    proposed: np.ndarray | None  # [num_reqs, drafts] int64 the drafter's ids on the device, or None


@dataclass(frozen=True)
class Trace:
    workload: FeatureWorkload
    config: WorkerConfig
    warmup: tuple[TraceStep, ...]
    steady: tuple[TraceStep, ...]

    @property
    def name(self) -> str:
        return self.workload.name

    @property
    def kind(self) -> str:
        return "mixed" if self.workload.steady_shape[0] else "decode"

    @property
    def num_reqs(self) -> int:  # median over the steady steps (what `record` states)
        return int(np.median([len(s.out.num_scheduled_tokens) for s in self.steady]))

    @property
    def num_tokens(self) -> int:  # median: a drafting step's count varies with the drafter's
        return int(np.median([s.out.total_num_scheduled_tokens for s in self.steady]))

    @property
    def num_groups(self) -> int:
        return len(self.config.kv_groups)


def record_trace(workload: FeatureWorkload, num_steady: int) -> Trace:
    """The warm-up and `num_steady` outputs of the steady state, with what each step samples and proposes."""
    sched = workload.scheduler(num_steps=MAX_WARMUP + num_steady)
    rng = np.random.default_rng(SEED)
    warmup: list[TraceStep] = []
    steady: list[TraceStep] = []
    while len(steady) < num_steady:
        step = _step(sched, rng)
        if _is_steady(workload, step.out):
            steady.append(step)
        elif steady:
            raise RuntimeError(f"{workload.name}: output {len(warmup) + len(steady)} left the steady state")
        elif len(warmup) < MAX_WARMUP:
            warmup.append(step)
        else:
            raise RuntimeError(f"{workload.name}: no steady state within {MAX_WARMUP} outputs")
    return Trace(workload, sched.config, tuple(warmup), tuple(steady))


def _is_steady(workload: FeatureWorkload, out: SchedulerOutput) -> bool:
    """The steady shape, and every continuing request decoding (its token and drafts: no prefill chunk left)."""
    shape = (len(out.new_requests), len(out.cached_requests), len(out.finished_req_ids))
    decoding = all(out.num_scheduled_tokens[c.req_id] <= 1 + workload.drafts for c in out.cached_requests)
    return shape == workload.steady_shape and decoding


def _step(sched: ReferenceScheduler, rng: np.random.Generator) -> TraceStep:
    out = sched.schedule()
    # batch_order's row map only fills index_mapping, unused here: any rows give the pools' order
    req_ids, _, _ = batch_order(list(out.num_scheduled_tokens.items()), dict.fromkeys(out.num_scheduled_tokens, 0))
    takes = set(sched.sampling_req_ids(out))
    target = {r: int(rng.integers(sched.config.vocab_size)) for r in req_ids}
    kept = sched.rejection_step(out, {r: t for r, t in target.items() if r in takes})
    rows = [kept.get(r, (target[r],)) for r in req_ids]  # a row that does not take its sample: any id
    drafts = sched.knobs.spec_tokens
    if out.scheduled_spec_decode_tokens:  # the sampler's fixed width, as an engine's: 1 + the most drafts
        sampled = np.full((len(rows), 1 + drafts), PLACEHOLDER_TOKEN_ID, np.int64)  # [num_reqs, 1 + drafts]
        for b, tokens in enumerate(rows):
            sampled[b, : len(tokens)] = tokens
    else:
        sampled = np.array([tokens[0] for tokens in rows], np.int64)  # [num_reqs]
    proposed = None
    if sched.on_device:  # a row that did not sample gets ids the pool never reads
        proposals = sched.device_proposals(out)
        proposed = np.array([proposals.get(r, (0,) * drafts) for r in req_ids], np.int64).reshape(len(rows), drafts)
    sched.update(out, kept)
    return TraceStep(in_columns(out), sampled, proposed)
