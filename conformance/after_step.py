"""A scheduled request as it will stand after the step: the one model of it the fault generators share.

conformance.mutations, mutations_drafts and mutations_mamba each break an output at one rule's boundary; to
find a boundary they need what spec/validate.py's `_Scheduled` holds for each scheduled request (its progress,
its known tokens, its tables once the step's blocks are added, its drafts), rebuilt here from the output and the
pool's snapshot, the only view of the pool a generator gets.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.mamba import write_column
from spec.types import KVCacheGroup, PoolSnapshot, SchedulerOutput, WorkerConfig


@dataclass
class ScheduledRequest:
    req_id: str
    num_computed: int
    num_scheduled: int
    known: int  # tokens known when the step runs, counted as validation counts them
    drafts: tuple[int, ...]  # the step's last len(drafts) tokens
    tables: list[list[int]]  # per group: the whole table after the step
    is_new: bool
    resumed: bool
    may_draft: bool  # drafts added to it meet no other rule first
    counted_ahead: bool = False  # async: its step counts drafts the previous step rejected (so they were unverified)

    @property
    def end(self) -> int:
        return self.num_computed + self.num_scheduled

    @property
    def last(self) -> int:
        return self.end - 1  # last position written

    @property
    def reaches_end(self) -> bool:
        return self.end == self.known + len(self.drafts)

    def live_from(self, group: KVCacheGroup) -> int:
        """The first table entry the step reads: entries before it a window released (they may repeat ids)."""
        return group.first_live_entry(self.num_computed)

    def write(self, block_size: int) -> int:
        """The mamba state entry the step writes (spec/mamba.py)."""
        return write_column(self.num_computed, self.num_scheduled, block_size)


def scheduled_requests(out: SchedulerOutput, config: WorkerConfig, snapshot: PoolSnapshot) -> list[ScheduledRequest]:
    """Every scheduled request of `out`: the new ones in order, then the cached ones."""
    rows = {row.req_id: row for row in snapshot}
    groups = range(len(config.kv_groups))
    drafts = out.scheduled_spec_decode_tokens
    reqs = [
        ScheduledRequest(r.req_id, r.num_computed_tokens, out.num_scheduled_tokens[r.req_id], len(r.prompt_token_ids),
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
            ScheduledRequest(c.req_id, c.num_computed_tokens, out.num_scheduled_tokens[c.req_id], known,
                             tuple(drafts.get(c.req_id, ())), [kept[g] + list(added[g]) for g in groups], False,
                             c.resumed, may_draft, known > len(rows[c.req_id].token_ids))
        )  # fmt: skip
    return reqs
