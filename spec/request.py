"""A scheduled request as it will stand after the step: the one model of it that every check reads.

spec/validate.py builds one per scheduled request (new ones in the order given, then cached ones) from
the output and the pool state, and its numbered checks read nothing else of a request; the suite's fault
generators (conformance/after_step.py) build the same record from a pool snapshot to find each rule's
boundary. A feature (spec/feature.py) keeps what it adds per request (a mamba state read, an encoder
length) in its own step record, keyed by req_id, never here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from spec.types import KVCacheGroup


@dataclass
class ScheduledRequest:
    req_id: str
    known_tokens: int  # tokens known when the step runs: prompt + sampled, as validation counts them
    num_computed: int  # the step's first position (the scheduler's num_computed_tokens)
    num_scheduled: int
    num_drafts: int  # the step's last num_drafts tokens are drafts, at positions known_tokens ..
    tables: list[np.ndarray]  # per group: the whole table after the step, int64 (empty where `malformed`)
    is_new: bool  # a new request: its tables are the given ones
    resumed: bool  # back from preemption: its given tables replace the row's
    malformed: list[int] = field(default_factory=list)  # groups whose given ids are not integers (check 9)

    @property
    def fresh_tables(self) -> bool:
        """The step replaces the request's tables (a new or resumed request)."""
        return self.is_new or self.resumed

    @property
    def end(self) -> int:
        """One past the last position the step writes: its seq_len."""
        return self.num_computed + self.num_scheduled

    @property
    def last(self) -> int:
        return self.end - 1

    @property
    def reaches_end(self) -> bool:
        """The step runs through the last known token and every draft: the row samples."""
        return self.end == self.known_tokens + self.num_drafts

    def live_from(self, group: KVCacheGroup, start: int | None = None) -> int:
        """The first table entry a step starting at `start` (default: num_computed) still holds in `group`.

        Entries before it a sliding window released for good; they may repeat ids (spec/validate.py, check 9).
        """
        return group.first_live_entry(self.num_computed if start is None else start)
