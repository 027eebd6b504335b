"""The terminal form of an `Explanation`: one rich table per index space, in the order the pipeline reads them."""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from slotmap.pictures.explanation import Explanation, TokenRow, group_label
from slotmap.pictures.steps import StepView
from spec.types import PAD_SLOT_ID


def render(ex: Explanation, console: Console) -> None:
    def req(req_id: str | None) -> Text:
        return Text("pad" if req_id is None else req_id, style=f"bold {ex.colour(req_id)}")

    if ex.title:
        console.rule(ex.title)

    pool = Table(title="1. request state pool: req_state_idx → request (persistent; after apply)")
    for col in ("req_state_idx", "req_id", "computed / known", "batch_idx"):
        pool.add_column(col, justify="right")
    for g, group in enumerate(ex.groups):
        pool.add_column(f"block_table, {group_label(g, group)}")
    for s in ex.state_rows:
        tables = [str(list(ids)) for ids in s.block_ids]
        scheduled = "-" if s.batch_idx is None else str(s.batch_idx)
        pool.add_row(str(s.row), req(s.req_id), f"{s.num_computed_tokens} / {s.num_known_tokens}", scheduled, *tables)
    console.print(pool)

    batch = Table(title="2. batch: batch_idx → req_state_idx (index_mapping), sorted by num_scheduled_tokens")
    for col in ("batch_idx", "req_id", "req_state_idx", "num_scheduled_tokens", "flat tokens", "seq_len"):
        batch.add_column(col, justify="right")
    if ex.has_drafts:
        batch.add_column("num_draft_tokens", justify="right")
    for r in ex.batch_rows:
        drafts = [str(r.num_drafts)] if ex.has_drafts else []
        batch.add_row(
            str(r.batch_idx), req(r.req_id), str(r.req_state_idx), str(r.num_scheduled_tokens),
            f"[{r.token_start}, {r.token_end})", str(r.seq_len), *drafts,
        )  # fmt: skip
    console.print(batch)
    console.print(f"index_mapping = {[r.req_state_idx for r in ex.batch_rows]}")
    console.print(f"query_start_loc = {list(ex.query_start_loc)}")

    tokens = Table(title="3. flat tokens: flat idx → (batch_idx, position), cut by query_start_loc")
    columns = ["flat idx", "query_start_loc", "batch_idx", "req_id", "position", "input_id"]
    if ex.has_drafts:  # speculative decoding: which tokens are drafts, and where each request's logits are taken
        columns += ["draft", "logits row (logits_indices)", "its logits decide"]
    for col in columns:
        tokens.add_column(col, justify="right")
    starts = {start: b for b, start in enumerate(ex.query_start_loc[:-1])}
    for t in ex.tokens:
        boundary = f"[{starts[t.flat_idx]}] = {t.flat_idx}" if t.flat_idx in starts and t.req_id is not None else ""
        cells: list[str | Text] = [
            str(t.flat_idx), boundary, "-" if t.batch_idx is None else str(t.batch_idx), req(t.req_id),
            str(t.position), str(t.input_id),
        ]  # fmt: skip
        if ex.has_drafts:
            logits = "" if t.logits_row is None else f"{t.logits_row} (flat {t.flat_idx})"
            cells += [Text("draft", style="bold") if t.is_draft else Text(""), logits, t.verifies]
        tokens.add_row(*cells, end_section=_ends_request(ex, t))
    console.print(tokens)
    if ex.has_drafts:
        console.print(f"logits_indices = {list(ex.logits_indices)}")
        console.print(
            "drafts are input tokens past each request's known tokens: they get slots like any token, and the "
            "logits at the token before each draft verify it (vLLM's target_logits_indices); the last row of "
            "each request gives its bonus token (bonus_logits_indices)"
        )

    for g, group in enumerate(ex.groups):
        if group.kind in ("cross_attention", "mamba"):  # the encoder's slots, or states (cross.py, mamba.py)
            continue
        paths = Table(title=f"{4 + g}. addresses in KV {group_label(g, group)}: position → slot")
        for col in ("flat idx", "req_id", "position", "→ (logical, offset)", "→ physical block", "→ slot"):
            paths.add_column(col, justify="right")
        if ex.has_drafts:
            paths.add_column("draft", justify="right")
        for t in ex.tokens:
            if not t.addresses:
                paths.add_row(str(t.flat_idx), req(None), str(t.position), "", "", str(t.slots[g]))
                continue
            a = t.addresses[g]
            slot = Text(str(a.slot), style="" if a.consistent else "bold red")
            draft = [Text("draft", style="bold") if t.is_draft else Text("")] if ex.has_drafts else []
            paths.add_row(
                str(t.flat_idx), req(t.req_id), str(t.position), f"({a.logical_block}, {a.offset})",
                str(a.physical_block), slot, *draft, end_section=_ends_request(ex, t),
            )  # fmt: skip
        console.print(paths)
    if any(not a.consistent for t in ex.tokens for a in t.addresses):
        console.print("[bold red]slots in red: the backend's slot differs from physical block * block_size + offset[/]")
    if any(t.req_id is None for t in ex.tokens):
        console.print(f"padding tokens: position 0, input id 0, slot PAD_SLOT_ID = {PAD_SLOT_ID}")


def _ends_request(ex: Explanation, t: TokenRow) -> bool:
    return t.batch_idx is not None and t.flat_idx + 1 == ex.query_start_loc[t.batch_idx + 1]


def render_pending(view: StepView, console: Console) -> None:
    """Async scheduling: the tokens whose input id is the previous step's sample (spec/async_steps.py)."""
    indices, sources = view.batch["pending_token_indices"], view.batch["pending_prev_batch_idx"]
    table = Table(title="pending tokens: input ids the host does not have yet (async scheduling)")
    for column in ("flat token", "req_id", "position", "input id", "sampled by batch row of the step before"):
        table.add_column(column, justify="right")
    starts = view.batch["query_start_loc"]
    for t, source in zip(indices.tolist(), sources.tolist(), strict=True):
        b = int(np.searchsorted(starts, t, side="right")) - 1  # the batch row whose tokens hold t
        position, token = int(view.batch["positions"][t]), int(view.batch["input_ids"][t])
        table.add_row(str(t), view.batch["req_ids"][b], str(position), str(token), str(source))
    console.print(table)
    if not len(indices):
        console.print("no pending token: no row of this step sampled in the step before")
