"""Drive a real vLLM model runner with the reference scheduler's steps, every step checked against spec.

    from conformance.vllm_drive import DrivePlan, EngineSpec, build_llm, drive
    from conformance.scheduler import SchedulerKnobs

    llm = build_llm(EngineSpec("tests/live_vllm/models/llama", num_blocks=64, spec_tokens=3))
    report = drive(llm, DrivePlan(SchedulerKnobs(spec_tokens=3), seed=0, scheduler_blocks=12), steps=400)
    print(report.summary())   # steps checked; prefills, chunks, prefix hits, preemptions, drafts kept, ...

or `python -m conformance.vllm_drive --runner v1 --model tests/live_vllm/models/llama --seed 0 --steps 400`.

vLLM's scheduler is bypassed: each output of `conformance.scheduler.ReferenceScheduler` goes, in vLLM 0.32's
form (`as_vllm`) and classes (vllm_output.py), into the runner's `execute_model` / `sample_tokens`
(runner_step.py) with the shadow checker attached (shadow/vllm_attach), and the runner's kept tokens
drive the scheduler: with drafts from prompt lookup (proposer.py) the runner's rejection sampler decides what
is accepted. The modules:

- driver.py: `drive`, `DriveError` (step, request, field or traceback, reproduction script);
- plan.py: `DrivePlan`, what to drive independent of the engine (knobs, seed, workload shape, pool size);
- workload.py: repetitive prompts with shared prefixes, request ids unique per round;
- proposer.py: `NgramProposer`, the scheduler's Proposer by prompt lookup;
- gates.py: `RUNNER_GATES`, the knobs each runner cannot take, with the reason beside each;
- engine.py: `EngineSpec`, `build_llm`, `engine_spec_of` (an engine described and rebuilt), `runner_kind`;
- vllm_output.py: the scheduler's output in vLLM's own classes, with greedy SamplingParams;
- runner_step.py: one `execute_model` + `sample_tokens`, the runner's kept tokens;
- mrv2_drafts.py: model runner v2 reads draft ids from its own store: the drive writes them there;
- repro.py: the reproduction script and `replay` into a fresh runner;
- report.py: `DriveReport`, the counts of each kind of step reached;
- strategies.py: Hypothesis plans (one engine serves every example).

Importing this package imports nothing from vLLM; the functions that need it import it when called.
"""

from conformance.vllm_drive.driver import DriveError, drive
from conformance.vllm_drive.engine import (
    EngineSpec,
    RunnerKindError,
    build_llm,
    engine_spec_of,
    runner_kind,
    shutdown,
)
from conformance.vllm_drive.gates import FORCED, NOT_USED, RUNNER_GATES, KnobGateError, gated
from conformance.vllm_drive.plan import DrivePlan
from conformance.vllm_drive.proposer import NgramProposer
from conformance.vllm_drive.report import DriveReport

__all__ = [
    "FORCED",
    "NOT_USED",
    "RUNNER_GATES",
    "DriveError",
    "DrivePlan",
    "DriveReport",
    "EngineSpec",
    "KnobGateError",
    "NgramProposer",
    "RunnerKindError",
    "build_llm",
    "drive",
    "engine_spec_of",
    "gated",
    "runner_kind",
    "shutdown",
]
