"""What a drive reached: counts of each kind of step, so a test can check every corner was exercised."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from conformance.scheduler import SchedulerStats
from spec.types import SchedulerOutput

# summed from each round's SchedulerStats (conformance/scheduler/stats.py) at its end
_FROM_STATS = ("admitted", "finished", "stopped_by_token", "aborted", "unfittable", "window_releases", "window_reuses",
               "null_lookaheads", "full_prefix_hits", "drafts_on_admission", "drafts_on_prefill",
               "drafts_crossing_blocks")  # fmt: skip


@dataclass
class DriveReport:
    runner: str = "v1"
    rounds: int = 0  # workloads run (each with a fresh scheduler and its own request ids)
    steps: int = 0  # scheduler outputs sent to the runner, the rounds' final cleanup steps included
    steps_checked: int = 0  # of them, checked by the shadow checker
    scheduled_tokens: int = 0
    prefills: int = 0  # request-steps computing prompt tokens (a chunk or a whole prompt)
    chunked_prefills: int = 0  # of them, chunks that leave part of the known tokens for a later step
    prefix_hits: int = 0  # new or resumed requests that start with cached tokens (num_computed_tokens > 0)
    preemptions: int = 0
    resumptions: int = 0
    next_step_resumptions: int = 0  # resumed on the step right after the one that preempted them
    drafts_scheduled: int = 0  # draft tokens sent in scheduled_spec_decode_tokens
    drafts_accepted: int = 0  # kept by the runner's rejection sampler
    all_drafts_accepted: int = 0  # drafting request-steps that kept every draft
    no_draft_accepted: int = 0  # and that kept none
    # from the rounds' SchedulerStats
    admitted: int = 0
    finished: int = 0
    stopped_by_token: int = 0
    aborted: int = 0
    unfittable: int = 0
    window_releases: int = 0  # blocks a sliding window released
    window_reuses: int = 0  # released blocks handed back to the request whose table still lists them
    null_lookaheads: int = 0
    full_prefix_hits: int = 0
    drafts_on_admission: int = 0
    drafts_on_prefill: int = 0
    drafts_crossing_blocks: int = 0
    seconds: float = 0.0
    dropped_knobs: dict[str, str] = field(default_factory=dict)  # gated knobs reset (drop_gated=True): reasons
    failure: str | None = None  # the DriveError's first line, when the drive stopped at one

    @property
    def drafts_rejected(self) -> int:
        return self.drafts_scheduled - self.drafts_accepted

    @property
    def ms_per_step(self) -> float:
        return 1000.0 * self.seconds / self.steps if self.steps else 0.0

    def add_stats(self, stats: SchedulerStats) -> None:
        for name in _FROM_STATS:
            setattr(self, name, getattr(self, name) + getattr(stats, name))

    def count_step(self, out: SchedulerOutput, sampling: Sequence[str], preempted_before: frozenset[str],
                   known: Mapping[str, int]) -> None:  # fmt: skip
        """One step: `sampling` the requests whose step reaches their last known token, `preempted_before` those
        the previous step preempted, `known[req_id]` each scheduled request's known tokens before the step."""
        self.scheduled_tokens += out.total_num_scheduled_tokens
        starts = {r.req_id: r.num_computed_tokens for r in out.new_requests}
        starts.update({r.req_id: r.num_computed_tokens for r in out.cached_requests})
        self.prefix_hits += sum(r.num_computed_tokens > 0 for r in out.new_requests)
        for r in out.cached_requests:
            if r.resumed:
                self.prefix_hits += r.num_computed_tokens > 0
                self.resumptions += 1
                self.next_step_resumptions += r.req_id in preempted_before
        for req_id in out.num_scheduled_tokens:
            if known[req_id] - starts[req_id] > 1:  # more than the last token: prompt (or recomputed) tokens
                self.prefills += 1
                self.chunked_prefills += req_id not in sampling

    def count_drafts(self, drafts: Mapping[str, Sequence[int]], kept: Mapping[str, Sequence[int]]) -> None:
        for req_id, d in drafts.items():
            if not d or req_id not in kept:
                continue
            accepted = len(kept[req_id]) - 1
            self.drafts_scheduled += len(d)
            self.drafts_accepted += accepted
            self.all_drafts_accepted += accepted == len(d)
            self.no_draft_accepted += accepted == 0

    def summary(self) -> str:
        """One line per group of counts."""
        skip = {"runner", "seconds", "dropped_knobs", "failure"}
        counts = ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self) if f.name not in skip)
        line = (
            f"model runner {self.runner}: {self.steps_checked} of {self.steps} steps checked, "
            f"{'all agreeing' if self.failure is None else 'then ' + self.failure}, in "
            f"{self.seconds:.1f} s ({self.ms_per_step:.1f} ms/step); drafts rejected {self.drafts_rejected}"
        )
        dropped = "".join(f"\n  reset {k}: {v}" for k, v in self.dropped_knobs.items())
        return f"{line}\n  {counts}{dropped}"  # fmt: skip
