"""The drive: the reference scheduler's steps sent into a real vLLM model runner, every step checked against spec.

    report = drive(llm, DrivePlan(knobs=SchedulerKnobs(spec_tokens=3), scheduler_blocks=12), steps=500)

Per step: `sched.schedule()`, its vLLM form (`as_vllm`), in vLLM's own classes (`to_vllm`), into the runner's
`execute_model` and `sample_tokens`, with the shadow checker attached (shadow/vllm_attach), which compares
what the runner built with spec before the forward pass. The runner's kept tokens go back to the scheduler
(`sched.update`): with drafts, the runner's rejection sampler, not the scheduler's drawn one, decides how many
it accepts, and the scheduler rolls back past the rest. vLLM's own scheduler is bypassed.

Rounds: a workload runs to its end, then the next (its own seed, a fresh scheduler, request ids tagged so that
none repeats in the runner's life), until `steps` steps ran (None: one round). A round cut short finishes its
requests in one more step, so the runner holds nothing between rounds and after the drive; one engine serves
any number of drives. The shadow checker gets a fresh spec pool for each drive (the runner holds nothing
then either).

On a divergence (ShadowMismatchError, or a ShadowRefusalError), or an exception inside the runner, `drive`
raises `DriveError`: the step, the request and field (or the runner's traceback), and a reproduction
script (conformance/vllm_drive/repro.py) that replays the outputs sent so far into a fresh runner. The
runner is then emptied too, so the engine can go on serving.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from conformance.scenario import Scenario
from conformance.scheduler import ReferenceScheduler, Workload, as_vllm
from conformance.vllm_drive.engine import engine_spec_of, runner_kind
from conformance.vllm_drive.gates import KnobGateError, for_runner, gated
from conformance.vllm_drive.mrv2_drafts import quiet_speculator, restore_speculator
from conformance.vllm_drive.plan import DrivePlan
from conformance.vllm_drive.proposer import NgramProposer
from conformance.vllm_drive.report import DriveReport
from conformance.vllm_drive.repro import write
from conformance.vllm_drive.runner_step import held_requests, release_state, run_step
from conformance.vllm_drive.vllm_output import finishing, to_vllm
from conformance.vllm_drive.workload import retagged
from shadow.checker import ShadowChecker, ShadowMismatchError, ShadowRefusalError
from spec.interop.vllm import VllmSchedulerOutput
from spec.types import WorkerConfig

MAX_IDLE_STEPS = 200  # empty steps in a row before a round is declared stuck (arrivals come within a few steps)
_drives = itertools.count()  # tags request ids: no id repeats in one process's runners


class DriveError(AssertionError):
    """The runner diverged from spec, or crashed, at a step (`kind`: mismatch, refusal, crash)."""

    def __init__(
        self,
        kind: str,
        step: int,
        req_id: str | None,
        field: str,
        detail: str,
        repro_path: Path | None,
        report: DriveReport,
        runner_traceback: str | None = None,
        spec_repro_path: Path | None = None,
    ) -> None:
        self.kind, self.step, self.req_id, self.field, self.detail = kind, step, req_id, field, detail
        self.repro_path, self.report, self.runner_traceback = repro_path, report, runner_traceback
        self.spec_repro_path = spec_repro_path  # the shadow checker's own script (spec only, no vLLM needed)
        who = f"request {req_id!r}" if req_id is not None else "batch"
        trace = f"\nthe runner's traceback:\n{runner_traceback}" if runner_traceback else ""
        where = f"\nreproduction (a fresh runner): python {repro_path}" if repro_path is not None else ""
        if spec_repro_path is not None:
            where += f"\nspec's side alone (the recorded arrays): python {spec_repro_path}"
        super().__init__(f"{kind} at step {step}: {who}: {field}: {detail}{trace}{where}")


def drive(
    target: Any,
    plan: DrivePlan | Scenario | None = None,
    *,
    steps: int | None = None,
    rounds: int | None = None,
    repro_dir: str | Path | None = None,
    drop_gated: bool = False,
    on_step: Callable[[int, DriveReport], None] | None = None,
) -> DriveReport:
    """Drive `target` (an in-process vllm.LLM, or its model runner) with the reference scheduler.

    `plan`: a DrivePlan (knobs, seed, workload shape), or a Scenario (its knobs, seed and workload; its config is
    replaced by the runner's). `steps`: run rounds until this many steps; `rounds`: at most this many rounds (both
    None: one round; a round cut short by `steps` finishes its requests in one more step). Knobs the runner cannot take
    (conformance/vllm_drive/gates.py) raise KnobGateError, or with `drop_gated` are reset and listed in the
    report. Raises DriveError at the first divergence or runner crash. `on_step(steps, report)` after each step.
    """
    plan = plan if plan is not None else DrivePlan()
    rounds = 1 if steps is None and rounds is None else rounds
    session = _Session(target, repro_dir)
    knobs, dropped = for_runner(session.kind, plan.knobs, drop_gated)
    spec_tokens = session.engine.spec_tokens
    if knobs.spec_tokens > spec_tokens:
        reason = (
            f"{knobs.spec_tokens} drafts a step, but the engine verifies at most {spec_tokens}: build it "
            f"with a speculative config of num_speculative_tokens >= {knobs.spec_tokens} (EngineSpec)"
        )
        raise KnobGateError(session.kind, {"spec_tokens": reason})
    report = DriveReport(runner=session.kind, dropped_knobs=dropped)
    start = time.perf_counter()
    report.steps += session.flush()
    for r in itertools.count():
        tag = f"d{next(_drives)}"
        if isinstance(plan, Scenario):
            config, workload, seed = plan.config, retagged(plan.workload, tag), plan.seed
            config = _scenario_config(session.config, config)
            _check_fits(workload, config)
        else:
            config = plan.scheduler_config(session.config)
            workload, seed = plan.workload(config, r, tag), plan.round_seed(r)
        refused = gated(session.kind, knobs, config, workload)
        if refused:
            raise KnobGateError(session.kind, refused)
        proposer = NgramProposer(knobs.spec_tokens) if knobs.spec_tokens else None
        sched = ReferenceScheduler(config, workload, knobs, seed=seed, proposer=proposer)
        session.max_tokens.update({q.req_id: q.max_new_tokens for q in workload.requests})
        session.run_round(sched, report, steps, on_step)
        report.rounds += 1
        report.add_stats(sched.stats)
        enough_steps = steps is not None and report.steps >= steps
        if enough_steps or (rounds is not None and report.rounds >= rounds) or isinstance(plan, Scenario):
            break
    report.seconds = time.perf_counter() - start
    report.steps_checked = session.shadow.steps_checked - session.checked_before
    session.finish()
    return report


def _scenario_config(runner: WorkerConfig, wanted: WorkerConfig) -> WorkerConfig:
    """A Scenario's config as the runner has it: the runner's, its pool cut to about the scenario's blocks (block
    sizes differ), but never below what one request of the runner's max_model_len needs alone in every group."""
    pooled = (
        wanted.kv_groups[0].num_blocks if wanted.one_block_pool else sum(g.num_blocks - 1 for g in wanted.kv_groups) + 1
    )
    alone = sum(math.ceil(runner.max_model_len / g.block_size) for g in runner.kv_groups) + 1
    blocks = min(max(pooled, alone), min(g.num_blocks for g in runner.kv_groups))
    return replace(runner, kv_groups=tuple(replace(g, num_blocks=blocks) for g in runner.kv_groups))


def _check_fits(workload: Workload, config: WorkerConfig) -> None:
    """A Scenario's workload, drawn for its own config, must fit the runner's: token ids and lengths."""
    for r in workload.requests:
        if max(r.prompt_token_ids) >= config.vocab_size:
            raise ValueError(f"{r.req_id}: token id {max(r.prompt_token_ids)} >= the model's vocabulary "
                             f"({config.vocab_size})")  # fmt: skip
        if len(r.prompt_token_ids) + r.max_new_tokens > config.max_model_len:
            raise ValueError(f"{r.req_id}: {len(r.prompt_token_ids)} prompt + {r.max_new_tokens} new tokens > "
                             f"max_model_len {config.max_model_len}")  # fmt: skip


class _Session:
    """One drive's runner, shadow, record of the outputs sent, and failure handling."""

    def __init__(self, target: Any, repro_dir: str | Path | None) -> None:
        from shadow.vllm_attach import attach, model_runner_of

        self.llm = None if _is_runner(target) else target
        self.runner = target if self.llm is None else model_runner_of(target)
        self.kind = runner_kind(self.runner)
        self.shadow = attach(target, keep_records=False)
        self.engine = engine_spec_of(self.runner)
        if self.kind == "v2":
            quiet_speculator(self.runner)  # the drive is v2's speculator (mrv2_drafts.py)
        self.config: WorkerConfig = self.shadow.config
        self.repro_dir = repro_dir
        self.sent: list[VllmSchedulerOutput] = []
        self.max_tokens: dict[str, int] = {}
        self._fresh_checker()
        self.checked_before = self.shadow.steps_checked
        self.started = time.perf_counter()

    def _fresh_checker(self) -> None:
        """spec's pool starts empty, as the runner is at the start of a drive (and after a failure's cleanup)."""
        self.shadow.checker = ShadowChecker(self.shadow.config, repro_dir=self.repro_dir)

    def flush(self) -> int:
        """Finish what the runner still holds from before (e.g. requests vLLM's own scheduler finished last)."""
        return self._finish_held()

    def _finish_held(self) -> int:
        """One step that finishes every request the runner holds (checked); the steps sent: 0 or 1."""
        held = held_requests(self.runner)
        if held:
            self.step(finishing(held))
        return int(bool(held))

    def finish(self) -> None:
        if self.kind == "v2":
            restore_speculator(self.runner)
        if self.llm is not None:  # vLLM's own prefix cache may name blocks the drive wrote other KV into
            self.llm.reset_prefix_cache()

    def run_round(self, sched: ReferenceScheduler, report: DriveReport, steps: int | None,
                  on_step: Callable[[int, DriveReport], None] | None) -> None:  # fmt: skip
        preempted: frozenset[str] = frozenset()
        idle = 0  # consecutive steps that scheduled nothing
        while not sched.done():
            if steps is not None and report.steps >= steps:
                report.steps += self._finish_held()
                return
            out = sched.schedule()
            idle = 0 if out.total_num_scheduled_tokens else idle + 1
            if idle > MAX_IDLE_STEPS:
                self._finish_held()
                raise RuntimeError(
                    f"the reference scheduler scheduled nothing for {MAX_IDLE_STEPS} steps with {len(sched.waiting)} "
                    "requests waiting: one that cannot get a block in every group even alone waits forever (give "
                    "the scheduler more blocks)"
                )
            form = as_vllm(out, sched)
            sampling = sched.sampling_req_ids(out)
            known = {r: sched.requests[r].num_tokens for r in out.num_scheduled_tokens}
            kept_all = self.step(form, report)
            kept = {r: tuple(kept_all.get(r, ())) for r in sampling}
            missing = sorted(r for r, k in kept.items() if not k)
            extra = sorted(r for r, k in kept_all.items() if k and r not in kept)
            if missing or extra:
                detail = (
                    "the scheduler expected a token from this row, the runner kept none"
                    if missing
                    else f"the runner kept {kept_all[extra[0]]} from a row whose chunk stops before its last token"
                )
                raise self._failure("mismatch", len(self.sent) - 1, (missing or extra)[0], "sampled_token_ids",
                                    detail, report)  # fmt: skip
            report.count_step(out, sampling, preempted, known)
            report.preemptions += len(sched.preempted_req_ids)
            report.count_drafts(out.scheduled_spec_decode_tokens, kept)
            try:
                sched.update(out, kept)
            except ValueError as e:  # kept tokens that are not accepted drafts and one more (the shadow checks first)
                raise self._failure("mismatch", len(self.sent) - 1, None, "sampled_token_ids", str(e), report) from e
            preempted = sched.preempted_req_ids
            report.steps += 1
            if on_step is not None:
                on_step(report.steps, report)

    def step(self, form: VllmSchedulerOutput, report: DriveReport | None = None) -> dict[str, list[int]]:
        self.sent.append(form)
        try:
            return run_step(self.runner, to_vllm(form, self.max_tokens), self.kind)
        except (ShadowMismatchError, ShadowRefusalError) as e:
            kind = "mismatch" if isinstance(e, ShadowMismatchError) else "refusal"
            raise self._failure(kind, e.step, e.req_id, e.field, e.detail, report, spec_repro=e.repro_path) from e
        except Exception as e:
            n = len(self.sent) - 1
            raise self._failure("crash", n, None, type(e).__name__, str(e), report, traceback.format_exc()) from e

    def _failure(self, kind: str, step: int, req_id: str | None, field: str, detail: str, report: DriveReport | None,
                 runner_traceback: str | None = None, spec_repro: Path | None = None) -> DriveError:  # fmt: skip
        report = report or DriveReport(runner=self.kind)
        report.steps_checked = self.shadow.steps_checked - self.checked_before
        report.seconds = time.perf_counter() - self.started
        failure = DriveError(kind, step, req_id, field, detail, None, report, runner_traceback)
        report.failure = str(failure).split("\n")[0]
        path = write(self.engine, self.max_tokens, self.sent[: step + 1], str(failure).split("\nthe runner's")[0],
                     self.repro_dir)  # fmt: skip
        failure = DriveError(kind, step, req_id, field, detail, path, report, runner_traceback, spec_repro)
        self._recover()
        return failure

    def _recover(self) -> None:
        """Empty the runner after a failure (unchecked: spec's pool no longer follows it)."""
        release_state(self.runner)
        held = held_requests(self.runner)
        self._fresh_checker()
        if held:
            with contextlib.suppress(Exception):  # best effort: the failure being reported matters more
                run_step(self.runner, to_vllm(finishing(held), self.max_tokens), self.kind)
        self._fresh_checker()


def _is_runner(target: Any) -> bool:
    return hasattr(target, "execute_model") and hasattr(target, "sample_tokens")
