"""A `Run` as the JSON the page embeds: compact (columns of numbers, requests by index) and all spec's.

Layout (every list in index order; `r` is an index into `reqs`):

    config  {max_num_reqs, max_model_len, max_num_batched_tokens,
             groups: [{block_size, num_blocks, window, latent: [kv_lora_rank, rope_dim] (an mla group) | null}]}
    reqs    [req_id]                       colours [css colour] per request
    start_step  the step the page opens at (from 1)
    steps   [{title,
              sched:   {new: [[r, prompt_len, num_computed, [[block ids] per group]]],
                        cached: [[r, num_computed, [[new block ids] per group] | null, resumed]],
                        order: [[r, num_scheduled_tokens]] (the scheduler's order), finished: [r],
                        drafts: [[r, [draft ids]]], pad: pad_to | null},
              rows:    [[req_state_idx, r, num_computed, num_known, batch_idx | -1, status (ROW_STATUS),
                         [[table entries] per group], [released entries per group]]],
              batch:   [[r, req_state_idx, num_scheduled, token_start, token_end, seq_len, num_drafts]],
              qsl:     query_start_loc,
              tokens:  {batch: [batch_idx | -1], position: [..], input_id: [..], draft: [0 | 1],
                        logits_row: [row | -1], verifies: [".."],
                        groups: [{logical: [..], offset: [..], physical: [..], slot: [..]}]} (padding: -1s),
              kv:      [per group [[block, kind (BLOCK_KIND), holders, released, stale]]] (the listed blocks;
                        each list is [r, logical block, r, logical block, ...], trailing empty lists left out),
              written: [per group [blocks this step's tokens write]],
              changes: [[kind, r, text]],
              num_tokens: the real tokens (the rest of `tokens` is padding),
              graph:   [mode, padded tokens, padded request rows, uniform, max query len] | null (no graphs),
              pad_rows: [[batch_idx, index_mapping, num_scheduled, seq_len, every block-table entry 0]] (a FULL
                        graph's request rows past the real ones),
              ubatch:  {split, halves: [[token start, token stop, row start, row stop, [rebased qsl]]],
                        straddling: r | -1} | {refused: why} | null (the run was not asked to split)}]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slotmap.explore.blocks import HELD, NULL, RELEASED, SHARED, STALE, block_uses, released_entries
from slotmap.explore.changes import step_changes
from slotmap.explore.record import Run, StepRecord
from slotmap.pictures.explanation import PALETTE
from slotmap.pictures.ubatch import explain_ubatch
from spec.types import NULL_BLOCK_ID, CachedRequest

# one-letter codes keep the page small (a 200-request run lists some 10,000 blocks); the page names them
ROW_STATUS = {"s": "scheduled", "i": "not scheduled", "p": "preempted"}
BLOCK_KIND = {"n": NULL, "h": HELD, "s": SHARED, "r": RELEASED, "x": STALE}
_KIND_CODE = {kind: code for code, kind in BLOCK_KIND.items()}
COLOURS = tuple(c for c in PALETTE if c != "#7f7f7f")  # explain's palette, less the grey that reads as padding


def export_run(run: Run) -> dict[str, Any]:
    reqs: dict[str, int] = {}  # req_id -> its index, in order of first appearance

    def r(req_id: str) -> int:
        return reqs.setdefault(req_id, len(reqs))

    steps = []
    past_holders: dict[int, str] = {}  # row -> the last request that held it
    waiting: set[str] = set()  # preempted and not resumed yet: their tables are stale
    for step in run.steps:
        resumed = {c.req_id for c in step.sched.cached_requests if c.resumed}
        waiting = (waiting | step.preempted) - resumed - set(step.sched.finished_req_ids)
        steps.append(_step(step, r, past_holders, waiting) | _padding(step) | _ubatch(step, r, run.ubatch))
        for row in step.view.snapshot:
            past_holders[row.row] = row.req_id
    config = run.config
    return {
        "title": run.title,
        "start_step": run.start_step,
        "config": {
            "max_num_reqs": config.max_num_reqs,
            "max_model_len": config.max_model_len,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "groups": [
                {
                    "block_size": g.block_size,
                    "num_blocks": g.num_blocks,
                    "window": g.sliding_window,
                    "latent": [g.kv_lora_rank, g.qk_rope_head_dim] if g.kv_lora_rank else None,
                }
                for g in config.kv_groups
            ],
        },
        "reqs": list(reqs),
        "colours": [COLOURS[i % len(COLOURS)] for i in range(len(reqs))],
        "row_status": ROW_STATUS,
        "block_kind": BLOCK_KIND,
        "steps": steps,
    }


def _step(step: StepRecord, r: Callable[[str], int], past_holders: dict[int, str], waiting: set[str]) -> dict[str, Any]:
    ex, config, sched = step.explanation, step.view.config, step.sched
    groups = config.kv_groups
    rows = []
    for s, state in zip(ex.state_rows, step.view.snapshot, strict=True):
        status = "s" if s.batch_idx is not None else "p" if s.req_id in waiting else "i"
        released = [released_entries(state, g, group) for g, group in enumerate(groups)]
        batch_idx = -1 if s.batch_idx is None else s.batch_idx
        rows.append(
            [s.row, r(s.req_id), s.num_computed_tokens, s.num_known_tokens, batch_idx, status,
             [list(t) for t in s.block_ids], released]
        )  # fmt: skip
    tokens: dict[str, Any] = {
        "batch": [-1 if t.batch_idx is None else t.batch_idx for t in ex.tokens],
        "position": [t.position for t in ex.tokens],
        "input_id": [t.input_id for t in ex.tokens],
        "groups": [
            {
                "logical": [t.addresses[g].logical_block if t.addresses else -1 for t in ex.tokens],
                "offset": [t.addresses[g].offset if t.addresses else -1 for t in ex.tokens],
                "physical": [t.addresses[g].physical_block if t.addresses else -1 for t in ex.tokens],
                "slot": [t.slots[g] for t in ex.tokens],
            }
            for g in range(len(groups))
        ],
    }
    if ex.has_drafts:
        tokens["draft"] = [int(t.is_draft) for t in ex.tokens]
        tokens["logits_row"] = [-1 if t.logits_row is None else t.logits_row for t in ex.tokens]
        tokens["verifies"] = [t.verifies for t in ex.tokens]
    kv = []
    for g, group in enumerate(groups):
        uses = block_uses(step.view.snapshot, g, group, waiting)
        entries = []
        for u in sorted(uses.values(), key=lambda u: u.block):
            lists = [[x for q, j in entries_of for x in (r(q), j)] for entries_of in (u.holders, u.released, u.stale)]
            while lists and not lists[-1]:  # trailing empty lists are left out
                lists.pop()
            entries.append([u.block, _KIND_CODE[u.kind], *lists])
        kv.append(entries)
    written = [sorted({t.addresses[g].physical_block for t in ex.tokens if t.addresses}) for g in range(len(groups))]
    return {
        "title": step.view.title,
        "sched": {
            "new": [
                [r(n.req_id), len(n.prompt_token_ids), n.num_computed_tokens, [list(b) for b in n.block_ids]]
                for n in sched.new_requests
            ],
            "cached": [_cached(c, r) for c in sched.cached_requests],
            "order": [[r(q), int(n)] for q, n in sched.num_scheduled_tokens.items()],
            "finished": [r(q) for q in sorted(sched.finished_req_ids)],
            "drafts": [[r(q), [int(t) for t in d]] for q, d in sched.scheduled_spec_decode_tokens.items() if len(d)],
            "pad": step.pad_to,
        },
        "rows": rows,
        "batch": [
            [r(b.req_id), b.req_state_idx, b.num_scheduled_tokens, b.token_start, b.token_end, b.seq_len, b.num_drafts]
            for b in ex.batch_rows
        ],
        "qsl": list(ex.query_start_loc),
        "tokens": tokens,
        "kv": kv,
        "written": written,
        "changes": [[c.kind, r(c.req_id), c.text] for c in step_changes(step, past_holders)],
    }


def _padding(step: StepRecord) -> dict[str, Any]:
    ex = step.explanation
    d = ex.descriptor
    graph = None if d is None else [d.mode, d.num_tokens, d.num_reqs, d.uniform, d.max_query_len]
    pad_rows = [
        [p.batch_idx, p.req_state_idx, p.num_scheduled_tokens, p.seq_len, _null_only(p.block_tables)]
        for p in ex.padded_rows
    ]
    return {"num_tokens": ex.num_tokens, "graph": graph, "pad_rows": pad_rows}


def _null_only(tables: tuple[tuple[int, ...], ...]) -> bool:
    return all(b == NULL_BLOCK_ID for t in tables for b in t)


def _ubatch(step: StepRecord, r: Callable[[str], int], wanted: bool) -> dict[str, Any]:
    if not wanted:
        return {"ubatch": None}
    try:
        ux = explain_ubatch(step.view)
    except ValueError as e:  # spec's refusal: a step of one token, or none, has no two halves
        return {"ubatch": {"refused": str(e)}}
    halves = [
        [h.token_start, h.token_stop, h.request_start, h.request_stop, list(h.query_start_loc)] for h in ux.halves
    ]
    straddling = -1 if ux.straddling is None else r(ux.straddling)
    return {"ubatch": {"split": ux.split_point, "halves": halves, "straddling": straddling}}


def _cached(c: CachedRequest, r: Callable[[str], int]) -> list[Any]:
    new_block_ids = None if c.new_block_ids is None else [list(b) for b in c.new_block_ids]
    return [r(c.req_id), c.num_computed_tokens, new_block_ids, int(c.resumed)]
