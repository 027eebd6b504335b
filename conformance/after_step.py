"""A scheduled request as it will stand after the step, as the fault generators see it.

conformance.mutations, mutations_drafts and mutations_mamba each break an output at one rule's boundary; to
find a boundary they need what spec/validate.py's checks read of each scheduled request: spec's own
`spec.request.ScheduledRequest` (its progress, its known tokens, its tables once the step's blocks are
added, its drafts), built here from the output and the pool's snapshot, the only view of the pool a
generator gets, with what a generator needs besides: the draft ids and two facts of async scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spec.mamba import write_column
from spec.request import ScheduledRequest
from spec.types import PoolSnapshot, SchedulerOutput, WorkerConfig


@dataclass(kw_only=True)
class GeneratorRequest(ScheduledRequest):
    drafts: tuple[int, ...] = ()  # the step's last len(drafts) tokens (num_drafts of them)
    may_draft: bool = True  # drafts added to it meet no other rule first
    counted_ahead: bool = False  # async: its step counts drafts the previous step rejected (so they were unverified)

    def table(self, g: int) -> list[int]:
        """Group g's table after the step, as the list of ints a generator edits and gives back."""
        return [int(b) for b in self.tables[g]]

    def table_lists(self) -> list[list[int]]:
        return [self.table(g) for g in range(len(self.tables))]

    def write(self, block_size: int) -> int:
        """The mamba state entry the step writes (spec/mamba.py)."""
        return write_column(self.num_computed, self.num_scheduled, block_size)


def _request(
    req_id: str, num_computed: int, num_scheduled: int, known: int, drafts: tuple[int, ...], tables: list[list[int]],
    is_new: bool, resumed: bool, may_draft: bool, counted_ahead: bool = False,
) -> GeneratorRequest:  # fmt: skip
    arrays = [np.array(t, np.int64) for t in tables]
    return GeneratorRequest(req_id, known, num_computed, num_scheduled, len(drafts), arrays, is_new, resumed,
                            drafts=drafts, may_draft=may_draft, counted_ahead=counted_ahead)  # fmt: skip


def scheduled_requests(out: SchedulerOutput, config: WorkerConfig, snapshot: PoolSnapshot) -> list[GeneratorRequest]:
    """Every scheduled request of `out`: the new ones in order, then the cached ones."""
    rows = {row.req_id: row for row in snapshot}
    groups = range(len(config.kv_groups))
    drafts = out.scheduled_spec_decode_tokens
    reqs = [
        _request(r.req_id, r.num_computed_tokens, out.num_scheduled_tokens[r.req_id], len(r.prompt_token_ids),
                         tuple(drafts.get(r.req_id, ())), [list(t) for t in r.block_ids], True, False, True)
        for r in out.new_requests
    ]  # fmt: skip
    for c in out.cached_requests:
        added = c.new_block_ids or tuple(() for _ in groups)
        kept = [[] if c.resumed else list(rows[c.req_id].block_ids[g]) for g in groups]
        # Under async scheduling (spec/async_steps.py) a step sent one ahead counts the previous step's drafts
        # as if all were kept (so it may start past the snapshot's last token), and drafts right after drafts are
        # refused: a request that drafts in this output surely did not in the last, one that does not may have.
        known = max(len(rows[c.req_id].token_ids), c.num_computed_tokens + 1)
        may_draft = not config.async_scheduling or c.req_id in drafts
        reqs.append(
            _request(c.req_id, c.num_computed_tokens, out.num_scheduled_tokens[c.req_id], known,
                             tuple(drafts.get(c.req_id, ())), [kept[g] + list(added[g]) for g in groups], False,
                             c.resumed, may_draft, known > len(rows[c.req_id].token_ids))
        )  # fmt: skip
    return reqs
