"""What one step changed, in words: rows added, freed and recycled, blocks appended, released by a window,
preemptions and resumptions, prefix hits, drafts accepted and rolled back, tokens sampled.

Read from the step's scheduler output and spec's snapshots around it (before apply, after apply,
after record_sampled); nothing here recomputes a mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from slotmap.explore.blocks import released_entries
from slotmap.explore.record import StepRecord
from spec.types import RowSnapshot


@dataclass(frozen=True)
class Change:
    kind: str  # added, recycled, freed, appended, resumed, preempted, prefix, window, drafts, sampled
    req_id: str
    text: str


def step_changes(step: StepRecord, past_holders: Mapping[int, str]) -> list[Change]:
    """The step's changes; `past_holders` is row -> the last request that held it before this step."""
    config, sched = step.view.config, step.sched
    before = {r.req_id: r for r in step.before}
    applied = {r.req_id: r for r in step.view.snapshot}
    after = {r.req_id: r for r in step.after}
    changes = []
    for req_id in sorted(sched.finished_req_ids):
        if req_id in before:
            changes.append(Change("freed", req_id, f"row {before[req_id].row} freed: {req_id} finished"))
    for req_id in sorted(step.preempted):
        text = (
            f"{req_id} preempted: its blocks went back to the allocator; it keeps row {applied[req_id].row} "
            "and waits to resume"
        )
        changes.append(Change("preempted", req_id, text))
    for new in sched.new_requests:
        row = applied[new.req_id]
        tables = _tables(row)
        previous = past_holders.get(row.row)
        if previous is None:
            changes.append(Change("added", new.req_id, f"row {row.row} added: {new.req_id}, blocks {tables}"))
        else:
            text = f"row {row.row} recycled: {new.req_id} takes the row {previous} held, blocks {tables}"
            changes.append(Change("recycled", new.req_id, text))
        if row.num_computed_tokens:
            changes.append(Change("prefix", new.req_id, _prefix_text(row)))
    for cached in sched.cached_requests:
        req_id, row = cached.req_id, applied[cached.req_id]
        if cached.resumed:
            text = f"{req_id} resumed after preemption: its table replaced by {_tables(row)}"
            changes.append(Change("resumed", req_id, text))
            if row.num_computed_tokens:
                changes.append(Change("prefix", req_id, _prefix_text(row)))
            continue
        old = before[req_id]
        for g in range(len(config.kv_groups)):
            added = row.block_ids[g][len(old.block_ids[g]) :]
            if added:
                changes.append(Change("appended", req_id, f"{req_id}: group {g} blocks appended {list(added)}"))
    for req_id, row in applied.items():
        if req_id not in before or any(c.resumed and c.req_id == req_id for c in sched.cached_requests):
            continue
        for g, group in enumerate(config.kv_groups):
            was, now = released_entries(before[req_id], g, group), released_entries(row, g, group)
            if now > was:
                blocks = list(row.block_ids[g][was:now])
                text = f"{req_id}: group {g}'s window released entries {was}..{now - 1} (blocks {blocks})"
                changes.append(Change("window", req_id, text))
    batch = step.view.batch
    num_drafts = batch.get("num_draft_tokens")
    for b, req_id in enumerate(batch["req_ids"]):
        appended = list(after[req_id].token_ids[len(applied[req_id].token_ids) :])
        k = 0 if num_drafts is None else int(num_drafts[b])
        if k:
            accepted = len(appended) - 1
            text = f"{req_id}: {k} draft{'s' if k > 1 else ''}, {accepted} accepted, {k - accepted} rolled back"
            changes.append(Change("drafts", req_id, text))
        if appended:
            changes.append(Change("sampled", req_id, f"{req_id} sampled {appended}"))
    return changes


def _tables(row: RowSnapshot) -> str:
    return " / ".join(str(list(t)) for t in row.block_ids)


def _prefix_text(row: RowSnapshot) -> str:
    return f"{row.req_id}: prefix cache hit, {row.num_computed_tokens} tokens already computed in its first blocks"
