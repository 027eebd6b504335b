"""The differential machinery: drive one schedule through a reference and a candidate backend, compare all.

After every step the two must agree exactly on `snapshot()`, on every `BatchInputs` field (values,
dtypes, shapes), on the KV caches after `write_kv` of random keys/values, and, within
conformance.tolerance's rule, on `paged_attention` (an mla group: write_mla_kv and both MLA attention
forms, conformance/mla_compare.py), and on half the steps on a random top-k selection's slots and sparse reader
(conformance/sparse_compare.py). Invalid outputs must be rejected by both with the
same error class, leaving both snapshots unchanged. The reference is always spec; the scheduler model
additionally checks the reference against its own bookkeeping (`expected_snapshot`).

On a difference a `MismatchError` is raised whose `repro` is a self-contained Python program replaying the
steps so far (`replay`) against the same candidate.
"""

from __future__ import annotations

import collections
import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import spec
from conformance.backends import BackendHandle, cross_attention_of
from conformance.mismatch import COUNTS, MismatchError, fp8_arguments
from conformance.mla_compare import compare_mla, latent_cache
from conformance.padded_steps import compare_dummy, compare_splits, probe_misuse
from conformance.scenario import AttentionSpec, Scenario
from conformance.scheduler import ReferenceScheduler
from conformance.sparse_compare import compare_sparse
from conformance.tolerance import assert_attention_close, spec_in_dtype
from shadow.compare import batch_differences
from spec.encoder_attention import cross_attention as spec_cross_attention
from spec.errors import ScheduleError
from spec.graphs import CapturedGraphs
from spec.types import PLACEHOLDER_TOKEN_ID, BatchInputs, PoolSnapshot, SchedulerOutput, WorkerConfig


@dataclass(frozen=True)
class Step:
    """A valid step of a reproduction: apply, prepare(pad_to or graphs), write_kv, attention, the dummy batch and
    the splits (conformance/padded_steps.py), record_sampled(sampled)."""

    out: SchedulerOutput
    pad_to: int | None
    # [num_reqs] one id per batch row, or [num_reqs][width] each row's kept tokens padded with -1 (with drafts)
    sampled: tuple[int, ...] | tuple[tuple[int, ...], ...]
    recorded: bool = True  # record_sampled was called (an engine runs no model on a step with no tokens)
    proposed: tuple[tuple[int, ...], ...] | None = None  # [num_reqs][P] the drafter's ids on the device, or None
    graphs: CapturedGraphs | None = None  # prepared with graphs= (pad_to is then None)
    dummy: tuple[int, CapturedGraphs | None] | None = None  # a DP peer's count this rank runs a dummy batch of
    splits: tuple[int | None, ...] = ()  # split points the batch is split at (None: the default)


@dataclass(frozen=True)
class Invalid:
    """An invalid output: both backends must raise `expected` (or at least the same class) and change nothing."""

    out: SchedulerOutput
    expected: type[ScheduleError] | None = None


# A breaker turns a valid output into an invalid one for the pool state given: (output, expected class) or None.
Breaker = Callable[[SchedulerOutput, WorkerConfig, PoolSnapshot], "tuple[SchedulerOutput, type[ScheduleError]] | None"]


class _Side:
    """One backend's pool and KV caches."""

    def __init__(self, handle: BackendHandle, config: WorkerConfig, attention: AttentionSpec | None) -> None:
        self.handle = handle
        self.pool = handle.make_pool(config)
        self.caches: list[tuple[Any, Any]] = []
        self.latents: dict[int, Any] = {}  # group -> an mla group's latent cache (conformance/mla_compare.py)
        if attention is not None:
            for g in config.kv_groups:
                if g.kind == "mla":
                    self.latents[len(self.caches)] = latent_cache(handle, g, attention)
                shape = (g.num_blocks, g.block_size, attention.num_kv_heads, attention.head_dim)
                if g.kind in ("mamba", "mla"):  # states (spec/mamba.py) or latents: no key and value caches
                    shape = (1, 1, attention.num_kv_heads, attention.head_dim)
                # an fp8 scenario's self-attention groups hold uint8 codes; cross-attention reads the model's dtype
                dtype = attention.cache_dtype if g.kind == "attention" else attention.dtype
                self.caches.append((handle.asarray(np.zeros(shape, dtype)), handle.asarray(np.zeros(shape, dtype))))


class Pair:
    """A reference and a candidate backend fed identical inputs; every method compares what it can."""

    def __init__(
        self,
        reference: BackendHandle,
        candidate: BackendHandle,
        config: WorkerConfig,
        attention: AttentionSpec | None,
        seed: int,
    ) -> None:
        self.config, self.attention = config, attention
        self.ref = _Side(reference, config, attention)
        self.cand = _Side(candidate, config, attention)
        self.kv_rng = np.random.default_rng(seed)  # keys, values and queries only, so replay() draws the same
        self.sparse_rng = np.random.default_rng([seed, 2])  # top-k selections and their queries (sparse_compare.py)
        self.pending: Step | None = None  # the step in progress, for a reproduction that ends with it
        self.misuse: random.Random | None = None  # the invalid suite's: misuse probes (conformance/padded_steps.py)

    # ---- valid steps ------------------------------------------------------------------------
    def run_step(
        self,
        out: SchedulerOutput,
        pad_to: int | None,
        sampled: Callable[[BatchInputs], Sequence[Any]],
        record: bool = True,  # False: the batch is prepared and compared, and not recorded
        proposed: Callable[[BatchInputs], Sequence[Sequence[int]] | None] = lambda batch: None,  # next_draft_ids
        *,
        graphs: CapturedGraphs | None = None,  # prepare(graphs=...) in place of pad_to
        dummy: tuple[int, CapturedGraphs | None] | None = None,  # this rank's dummy batch of a peer's count
        split_at: Callable[[BatchInputs], tuple[int | None, ...]] = lambda batch: (),  # where to split the batch
    ) -> Step:
        shape: dict[str, Any] = {"graphs": graphs, "dummy": dummy}
        self.pending = Step(out, pad_to, (), **shape)
        self._call("apply", lambda side: side.pool.apply(out))
        self.compare_snapshots("after apply")
        if self.misuse is not None:
            probe_misuse(self, out, graphs, None, self.misuse)
        prepare_args = {} if graphs is None else {"graphs": graphs}  # a backend without graphs is asked for none
        batches = self._call("prepare", lambda side: side.pool.prepare(out, pad_to, **prepare_args))
        ref_batch, cand_batch = batches
        self.compare_batches(ref_batch, cand_batch)
        if self.attention is not None:
            self.compare_kv_and_attention(ref_batch, cand_batch)
        if dummy is not None:
            compare_dummy(self, *dummy)
        splits = split_at(ref_batch)
        shape["splits"] = splits
        self.pending = Step(out, pad_to, (), **shape)
        compare_splits(self, out, ref_batch, cand_batch, splits)
        if self.misuse is not None and splits:
            probe_misuse(self, out, graphs, (ref_batch, cand_batch), self.misuse)
        if not record:
            self.pending = None
            return Step(out, pad_to, (), recorded=False, **shape)
        tokens = _frozen(sampled(ref_batch))
        rows = proposed(ref_batch)
        drafter = None if rows is None else tuple(tuple(int(t) for t in row) for row in rows)
        self.pending = Step(out, pad_to, tokens, proposed=drafter, **shape)
        ids = np.array(tokens, np.int64)
        next_ids = None if drafter is None else np.array(drafter, np.int64).reshape(len(drafter), -1)
        self._record(self.ref, ref_batch, ids, next_ids)
        try:
            self._record(self.cand, cand_batch, ids, next_ids)
        except Exception as exc:
            raise MismatchError(f"record_sampled: candidate raised {exc!r}, reference did not") from exc
        self.compare_snapshots("after record_sampled")
        self.pending = None
        return Step(out, pad_to, tokens, proposed=drafter, **shape)

    @staticmethod
    def _record(side: _Side, batch: BatchInputs, ids: np.ndarray, next_ids: np.ndarray | None) -> None:
        """record_sampled, the drafter's ids passed only where there are some: a backend written before rule 8
        takes two arguments."""
        if next_ids is None:
            side.pool.record_sampled(batch, side.handle.asarray(ids))
        else:
            side.pool.record_sampled(batch, side.handle.asarray(ids), side.handle.asarray(next_ids))

    def _call(self, what: str, fn: Callable[[_Side], Any]) -> tuple[Any, Any]:
        try:
            ref = fn(self.ref)
        except ScheduleError as exc:
            raise MismatchError(f"{what}: the reference rejects a scheduler-model output: {exc!r}") from exc
        try:
            cand = fn(self.cand)
        except Exception as exc:
            raise MismatchError(f"{what}: candidate raised {exc!r} on a valid output") from exc
        return ref, cand

    def compare_snapshots(self, when: str, expected: PoolSnapshot | None = None) -> None:
        ref, cand = self.ref.pool.snapshot(), self.cand.pool.snapshot()
        if ref != cand:
            raise MismatchError(f"snapshot {when}: {_first_difference(ref, cand)}")
        if expected is not None and ref != expected:
            raise MismatchError(f"snapshot {when}: reference vs scheduler model: {_first_difference(ref, expected)}")

    def compare_batches(self, ref_batch: BatchInputs, cand_batch: BatchInputs) -> None:
        ref = self.ref.handle.batch_to_numpy(ref_batch)
        problems = batch_differences(ref, self.cand.handle.batch_to_numpy(cand_batch))
        if problems:
            raise MismatchError("BatchInputs differ:\n  " + "\n  ".join(problems))

    def compare_kv_and_attention(self, ref_batch: BatchInputs, cand_batch: BatchInputs) -> None:
        att = self.attention
        assert att is not None
        num_tokens, padded = ref_batch.num_tokens, ref_batch.num_tokens_padded
        for g, group in enumerate(self.config.kv_groups):
            if group.kind == "cross_attention":  # the encoder's KV, written once, read whole
                self.compare_cross_attention(g, ref_batch, cand_batch)
                continue
            if group.kind == "mamba":  # its state indices are compared with the batch; the state is the model's
                continue
            if group.kind == "mla":  # one latent cache, its own write and two attention forms
                compare_mla(self, g, ref_batch, cand_batch)
                compare_sparse(self, g, ref_batch, cand_batch)
                continue
            to = self.cand.handle.asarray
            fp8, cand_fp8 = fp8_arguments(att, np.asarray), fp8_arguments(att, to)
            slots = (ref_batch.slot_mappings[g], cand_batch.slot_mappings[g])
            query = self.write_random_kv(g, padded, padded, *slots, f"write_kv[{g}]", fp8, cand_fp8)
            (rk, rv), (ck, cv) = self.ref.caches[g], self.cand.caches[g]
            window, softcap = group.sliding_window, att.softcap
            table, seq_lens, qsl = ref_batch.block_tables[g], ref_batch.seq_lens, ref_batch.query_start_loc
            # an fp8 cache: both references read the very codes (conformance/tolerance.py's fp8 rule)
            floats, codes = ((query,), (rk, rv)) if fp8 else ((query, rk, rv), ())
            k64, v64 = (rk, rv) if fp8 else (np.asarray(rk, np.float64), np.asarray(rv, np.float64))
            ref64 = spec.paged_attention(
                np.asarray(query, np.float64), k64, v64, table, seq_lens, qsl,
                scale=att.scale, sliding_window=window, softcap=softcap, **fp8,
            )  # fmt: skip
            low = spec_in_dtype(
                spec.paged_attention, att.dtype, floats, *codes, table, seq_lens, qsl,
                scale=att.scale, sliding_window=window, softcap=softcap, **fp8,
            )  # fmt: skip
            try:
                out = self.cand.handle.module.paged_attention(
                    to(query), ck, cv, cand_batch.block_tables[g], cand_batch.seq_lens, cand_batch.query_start_loc,
                    scale=att.scale, sliding_window=window, softcap=softcap, **cand_fp8,
                )  # fmt: skip
            except Exception as exc:
                raise MismatchError(f"paged_attention[{g}]: candidate raised {exc!r}") from exc
            got = np.asarray(self.cand.handle.to_numpy(out), np.float64)
            if got.shape != ref64.shape:
                raise MismatchError(f"paged_attention[{g}]: shape {got.shape}, expected {ref64.shape}")
            if np.any(got[num_tokens:] != 0):
                raise MismatchError(f"paged_attention[{g}]: padding rows {num_tokens}..{padded} are not zero")
            try:
                assert_attention_close(got[:num_tokens], ref64[:num_tokens], low[:num_tokens], att.dtype)
            except AssertionError as exc:
                raise MismatchError(f"paged_attention[{g}] (window {group.sliding_window}): {exc}") from exc
            compare_sparse(self, g, ref_batch, cand_batch)  # a top-k selection over the cache just written

    def write_random_kv(
        self,
        g: int,
        num_kv: int,  # keys and values written: one per slot
        num_queries: int,
        ref_slots: np.ndarray,  # [num_kv] the reference batch's slots
        cand_slots: Any,  # [num_kv] the candidate's
        what: str,  # names the write in a mismatch
        fp8: dict[str, Any],  # the reference's cache format and scales (fp8_arguments)
        cand_fp8: dict[str, Any],  # the candidate's
    ) -> np.ndarray:  # [num_queries, num_heads, head_dim] a random query for the attention that reads them
        """Random keys and values written into group g's caches by both backends' write_kv; the caches must agree."""
        att = self.attention
        assert att is not None
        kv_shape = (num_kv, att.num_kv_heads, att.head_dim)
        key = self.kv_rng.standard_normal(kv_shape).astype(att.dtype)
        value = self.kv_rng.standard_normal(kv_shape).astype(att.dtype)
        query = self.kv_rng.standard_normal((num_queries, att.num_heads, att.head_dim)).astype(att.dtype)
        (rk, rv), (ck, cv) = self.ref.caches[g], self.cand.caches[g]
        to = self.cand.handle.asarray
        spec.write_kv(rk, rv, key, value, ref_slots, **fp8)
        try:
            self.cand.handle.module.write_kv(ck, cv, to(key), to(value), cand_slots, **cand_fp8)
        except Exception as exc:
            raise MismatchError(f"{what}: candidate raised {exc!r}") from exc
        for which, r, c in (("key", rk, ck), ("value", rv, cv)):
            got = self.cand.handle.to_numpy(c)
            if not np.array_equal(got, r):
                where = np.argwhere(got != r)[:3].tolist()
                raise MismatchError(f"{what}: {which} cache differs at [block, offset, head, dim] {where}")
        return query

    def compare_cross_attention(self, g: int, ref_batch: BatchInputs, cand_batch: BatchInputs) -> None:
        """Group g holds the encoder's KV (spec/cross_attention.py): random encoder keys and values go in through
        cross_slot_mapping, then both backends' cross_attention reads them for the decoder's queries."""
        att = self.attention
        assert att is not None
        num_tokens, padded = ref_batch.num_tokens, ref_batch.num_tokens_padded
        slots = (ref_batch.cross_slot_mapping, cand_batch.cross_slot_mapping)
        query = self.write_random_kv(g, len(slots[0]), padded, *slots, f"write_kv[{g}] (encoder)", {}, {})
        (rk, rv), (ck, cv) = self.ref.caches[g], self.cand.caches[g]
        to = self.cand.handle.asarray
        cross = cross_attention_of(self.cand.handle)
        if cross is None:
            return  # a third-party backend without cross-attention: its slots are compared above
        table, lens, qsl = ref_batch.block_tables[g], ref_batch.encoder_seq_lens, ref_batch.query_start_loc
        q64, k64, v64 = (np.asarray(a, np.float64) for a in (query, rk, rv))
        ref64 = spec_cross_attention(q64, k64, v64, table, lens, qsl, scale=att.scale)
        low = spec_in_dtype(spec_cross_attention, att.dtype, (query, rk, rv), table, lens, qsl, scale=att.scale)
        try:
            out = cross(
                to(query), ck, cv, cand_batch.block_tables[g], cand_batch.encoder_seq_lens,
                cand_batch.query_start_loc, scale=att.scale,
            )  # fmt: skip
        except Exception as exc:
            raise MismatchError(f"cross_attention[{g}]: candidate raised {exc!r}") from exc
        got = np.asarray(self.cand.handle.to_numpy(out), np.float64)
        if got.shape != ref64.shape or np.any(got[num_tokens:] != 0):
            raise MismatchError(f"cross_attention[{g}]: shape {got.shape} or nonzero padding rows {num_tokens}..")
        try:
            assert_attention_close(got[:num_tokens], ref64[:num_tokens], low[:num_tokens], att.dtype)
        except AssertionError as exc:
            raise MismatchError(f"cross_attention[{g}]: {exc}") from exc

    # ---- invalid steps ----------------------------------------------------------------------
    def reject(self, out: SchedulerOutput, expected: type[ScheduleError] | None) -> type[ScheduleError]:
        before = self.ref.pool.snapshot()
        raised: list[type[BaseException] | None] = []
        for side in (self.ref, self.cand):
            try:
                side.pool.apply(out)
                raised.append(None)
            except ScheduleError as exc:
                raised.append(type(exc))
            except Exception as exc:
                raise MismatchError(f"invalid output: {side.handle.name} raised {exc!r}, not a ScheduleError") from exc
        ref_cls, cand_cls = raised
        if ref_cls is None or cand_cls is None:
            raise MismatchError(f"invalid output accepted (reference raised {ref_cls}, candidate raised {cand_cls})")
        if ref_cls is not cand_cls:
            raise MismatchError(f"invalid output: reference raised {ref_cls.__name__}, candidate {cand_cls.__name__}")
        if expected is not None and ref_cls is not expected:
            raise MismatchError(
                f"invalid output: both raised {ref_cls.__name__}, the mutation targets {expected.__name__}"
            )
        self.compare_snapshots("after a rejected output", expected=before)
        return ref_cls  # type: ignore[return-value]


class DifferentialRun:
    """A scenario's scheduler driving a reference and a candidate, step by step."""

    def __init__(
        self,
        scenario: Scenario,
        candidate: BackendHandle,
        reference: BackendHandle | None = None,
        misuse: bool = False,  # probe misused graphs, pad_to and splits on the steps that have them (invalid suite)
    ) -> None:
        self.scenario = scenario
        self.candidate = candidate
        self.sched = ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, seed=scenario.seed)
        self.pair = Pair(reference or BackendHandle("spec", spec), candidate, scenario.config, scenario.attention,
                         scenario.seed)  # fmt: skip
        self.sample_rng = np.random.default_rng(scenario.seed + 1)
        self.pair.misuse = random.Random(f"misuse {scenario.seed}") if misuse else None
        self.history: list[Step | Invalid] = []
        self.steps = 0
        self.rejected: collections.Counter[str] = collections.Counter()
        self._admitted = 0

    def done(self) -> bool:
        return self.sched.done()

    def step(self, breaker: Breaker | None = None) -> None:
        """One scheduler step; with a breaker, first an invalid variant of it that both must reject."""
        try:
            self._step(breaker)
        except MismatchError as exc:
            raise MismatchError(f"step {self.steps}: {exc.message}", self.repro()) from exc

    def _step(self, breaker: Breaker | None) -> None:
        config, sched = self.scenario.config, self.sched
        out = sched.schedule()
        shape = sched.step_shape(out)  # pad_to, graphs, a dummy batch, a split (conformance/scheduler/step_shapes.py)
        pad_to = shape.pad_to
        if breaker is not None:
            broken = breaker(out, config, self.pair.ref.pool.snapshot())
            if broken is not None:
                self.history.append(Invalid(*broken))
                cls = self.pair.reject(*broken)
                self.rejected[cls.__name__] += 1
                COUNTS["invalid"] += 1
        takes = set(sched.sampling_req_ids(out))
        stops = {r: sorted(sched.requests[r].spec.stop_token_ids) for r in takes}
        kept: dict[str, tuple[int, ...]] = {}

        def sample(batch: BatchInputs) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
            target = []
            for req_id in batch.req_ids:
                if stops.get(req_id) and self.sample_rng.random() < 0.1:
                    target.append(int(self.sample_rng.choice(stops[req_id])))
                else:
                    target.append(int(self.sample_rng.integers(config.vocab_size)))
            targets = dict(zip(batch.req_ids, target, strict=True))
            kept.update(sched.rejection_step(out, {r: t for r, t in targets.items() if r in takes}))
            rows = [kept.get(r, (t,)) for r, t in targets.items()]
            if not out.scheduled_spec_decode_tokens and self.sample_rng.random() < 0.8:
                return tuple(t for (t,) in rows)  # today's [num_reqs] form
            width = max((len(r) for r in rows), default=1) + int(self.sample_rng.integers(2))  # extra -1 columns
            return tuple((*r, *[PLACEHOLDER_TOKEN_ID] * (width - len(r))) for r in rows)

        # under async scheduling a step with no tokens goes unrecorded, as in an engine that runs no model on it
        # (vLLM returns before sampling): the next step takes no pending token from an older batch (rule 3)
        record = out.total_num_scheduled_tokens > 0 or not config.async_scheduling
        proposals = sched.device_proposals(out)

        def propose(batch: BatchInputs) -> list[list[int]] | None:  # the drafter's output, in batch order
            if not sched.on_device:
                return None
            width = sched.knobs.spec_tokens  # a row that did not sample gets ids the pool never reads
            return [list(proposals.get(r, (0,) * width)) for r in batch.req_ids]

        step = self.pair.run_step(
            out, pad_to, sample, record, propose, graphs=shape.graphs, dummy=shape.dummy,
            split_at=lambda batch: shape.split_points(batch.num_reqs, batch.num_tokens_padded),
        )  # fmt: skip
        COUNTS["graph steps"] += step.graphs is not None
        COUNTS["dummy steps"] += step.dummy is not None
        COUNTS["split steps"] += bool(step.splits)
        self.history.append(step)
        sched.update(out, kept)
        self.pair.compare_snapshots("after the step", expected=sched.expected_snapshot())
        self.steps += 1
        COUNTS["steps"] += 1
        COUNTS[f"steps[{self.candidate.name}]"] += 1
        COUNTS["requests"] += sched.stats.admitted - self._admitted
        self._admitted = sched.stats.admitted

    def repro(self) -> str:
        history = [*self.history, *([self.pair.pending] if self.pair.pending is not None else [])]
        return reproduction(self.candidate.name, self.scenario.config, history, self.scenario.attention,
                            self.scenario.seed)  # fmt: skip


def _frozen(sampled: Sequence[Any]) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
    """The ids handed to record_sampled as nested tuples (for a reproduction's repr)."""
    if all(isinstance(row, Sequence) for row in sampled) and len(sampled):
        return tuple(tuple(int(t) for t in row) for row in sampled)
    return tuple(int(t) for t in sampled)


def replay(
    candidate: BackendHandle,
    config: WorkerConfig,
    steps: Sequence[Step | Invalid],
    attention: AttentionSpec | None = None,
    seed: int = 0,
) -> None:
    """Feed recorded steps to spec and `candidate`; raises MismatchError at the first difference."""
    pair = Pair(BackendHandle("spec", spec), candidate, config, attention, seed)
    for i, s in enumerate(steps):
        try:
            if isinstance(s, Invalid):
                pair.reject(s.out, s.expected)
            else:
                pair.run_step(s.out, s.pad_to, lambda _batch, s=s: s.sampled, s.recorded,  # type: ignore[misc]
                              lambda _batch, s=s: s.proposed, graphs=s.graphs, dummy=s.dummy,  # type: ignore[misc]
                              split_at=lambda _batch, s=s: s.splits)  # type: ignore[misc]  # fmt: skip
        except MismatchError as exc:
            raise MismatchError(f"step {i}: {exc.message}") from exc


def reproduction(
    backend_name: str,
    config: WorkerConfig,
    history: Sequence[Step | Invalid],
    attention: AttentionSpec | None,
    seed: int,
) -> str:
    lines = [
        "from spec import *  # noqa: F403",
        "from conformance.backends import load_backend",
        "from conformance.differential import Invalid, Step, replay",
        "from conformance.scenario import AttentionSpec",
        "",
        f"config = {config!r}",
        "steps = [",
        *(f"    {_repr_step(s)}," for s in history),
        "]",
        f"replay(load_backend({backend_name!r}), config, steps, attention={attention!r}, seed={seed!r})",
    ]
    return "\n".join(lines)


def _repr_step(s: Step | Invalid) -> str:
    if isinstance(s, Invalid):
        expected = s.expected.__name__ if s.expected is not None else None
        return f"Invalid({s.out!r}, {expected})"
    return repr(s)


def _first_difference(a: PoolSnapshot, b: PoolSnapshot) -> str:
    if len(a) != len(b):
        return f"{len(b)} rows vs {len(a)}: {[r.req_id for r in b]} vs {[r.req_id for r in a]}"
    for x, y in zip(a, b, strict=True):
        if x != y:
            return f"row {x.row}: {y} vs {x}"
    return "equal"


@dataclass(frozen=True)
class Budget:
    """How much of the differential suite one backend gets: the Triton interpreter is ~100x slower."""

    examples: int  # Hypothesis examples (scenarios)
    max_steps: int  # scheduler steps per scenario (a scenario usually drains well before)
    max_requests: int  # per workload
    max_model_len: int


def budget_for(backend: BackendHandle, profile_examples: int, scale: float = 1.0) -> Budget:
    if backend.slow:
        return Budget(max(2, round(profile_examples * scale / 8)), 8, 3, 48)
    return Budget(max(1, round(profile_examples * scale * 4)), 200, 12, 160)


def drive(run: DifferentialRun, max_steps: int, breaker: Callable[[], Breaker | None] | None = None) -> None:
    """Step `run` until its workload drains or max_steps; `breaker()` may supply a breakage per step."""
    while not run.done() and run.steps < max_steps:
        run.step(breaker() if breaker is not None else None)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Small tensors on a shared 2-core machine: intra-op threads only contend (20x slower per op there)."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
