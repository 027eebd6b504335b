"""Speculative decoding must not change what greedy decoding generates: the comparison with a plain run.

`slotmap simulate --spec-tokens K` runs its workload with an n-gram drafter (slotmap.tiny.drafting) and
greedy verification; this module runs the same workload again without drafts and compares each
request's generated tokens, up to its first stop token (a speculative step may keep tokens past a stop
token that a plain run never generates; the request finishes there either way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from conformance.backends import BackendHandle
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, Workload
from slotmap.tiny.engine import Engine, RequestRecord, drive
from slotmap.tiny.model import ModelConfig
from spec.types import WorkerConfig


@dataclass
class SpeculativeComparison:
    spec_tokens: int  # most drafts per request per step
    drafts: int = 0  # draft tokens scheduled
    accepted: int = 0  # of which kept
    plain_steps: int = 0
    speculative_steps: int = 0
    requests_compared: int = 0
    differences: list[str] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafts if self.drafts else 0.0

    @property
    def identical(self) -> bool:
        return not self.differences


def generated(record: RequestRecord, stop_token_ids: frozenset[int]) -> list[int]:
    """A request's generated tokens up to and including its first stop token."""
    out = []
    for token in record.tokens[len(record.prompt) :]:
        out.append(token)
        if token in stop_token_ids:
            break
    return out


def plain_greedy_run(
    backend: BackendHandle, config: WorkerConfig, workload: Workload, knobs: SchedulerKnobs, seed: int,
    model_config: ModelConfig,
) -> tuple[dict[str, RequestRecord], int]:  # fmt: skip
    """The workload decoded without drafts: every request's record, and the steps it took."""
    engine = Engine(backend, config, model_config, record_logits=False)
    scheduler = ReferenceScheduler(config, workload, replace(knobs, spec_tokens=0), seed=seed)
    records: list[RequestRecord] = []
    steps = drive(engine, scheduler, on_finished=records.append)
    records += engine.finish(set(engine.requests))
    return {r.req_id: r for r in records}, steps


def compare(
    comparison: SpeculativeComparison,
    workload: Workload,
    plain: dict[str, RequestRecord],
    speculative: Sequence[RequestRecord],
) -> None:
    stops = {r.req_id: r.stop_token_ids for r in workload.requests}
    for record in speculative:
        expected = generated(plain[record.req_id], stops[record.req_id])
        got = generated(record, stops[record.req_id])
        comparison.requests_compared += 1
        if got != expected:
            at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got),
                      len(expected)))  # fmt: skip
            comparison.differences.append(
                f"{record.req_id}: generated token {at} differs (speculative {got[at : at + 3]}, plain "
                f"{expected[at : at + 3]})"
            )


def prefix_check(
    comparison: SpeculativeComparison, plain: dict[str, RequestRecord], engine: Engine
) -> Callable[[object, object], None]:
    """An `on_step` hook: after every speculative step, each request's tokens are a prefix of the plain run's."""

    def check(_out: object, _result: object) -> None:
        for req_id, record in engine.requests.items():
            n = min(len(record.tokens), len(plain[req_id].tokens))  # past a stop token the plain run has none
            if record.tokens[:n] != plain[req_id].tokens[:n] and len(comparison.differences) < 10:
                comparison.differences.append(f"{req_id}: after {len(record.tokens)} tokens the runs differ")

    return check
