"""`slotmap explain`: one engine step laid out in the four index spaces, from a backend's own values.

    req_state_idx (pool rows) <- index_mapping -- batch_idx -- query_start_loc --> flat token index
    flat token index -> position -> (logical block, offset) -> physical block -> slot, per KV group

`explain_step` turns a `StepView` into an `Explanation` (plain rows of numbers); `render` prints it as
rich tables and `slotmap.pictures.drawing` draws the same rows. Every number shown is the backend's output
except the two the chain defines by arithmetic, divmod(position, block_size), and the check
physical block * block_size + offset, shown in red wherever it disagrees with the backend's slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from slotmap.pictures.steps import StepView
from spec.types import PAD_SLOT_ID

# One colour per request (matplotlib's tab10), shared by the terminal and the pictures.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
PAD_COLOUR = "#c7c7c7"


@dataclass(frozen=True)
class StateRow:
    row: int  # req_state_idx
    req_id: str
    num_computed_tokens: int
    num_known_tokens: int  # prompt + sampled so far
    block_ids: tuple[tuple[int, ...], ...]  # per group: the table's filled entries (0 = null block)
    batch_idx: int | None  # None: holds a row but is not scheduled this step


@dataclass(frozen=True)
class BatchRow:
    batch_idx: int
    req_id: str
    req_state_idx: int  # index_mapping[batch_idx]
    num_scheduled_tokens: int
    token_start: int  # query_start_loc[batch_idx]
    token_end: int  # query_start_loc[batch_idx + 1]
    seq_len: int


@dataclass(frozen=True)
class Address:
    """One real token's path through one KV group's block table."""

    logical_block: int  # position // block_size
    offset: int  # position % block_size
    physical_block: int  # block_tables[g][batch_idx, logical_block], as the backend gathered it
    slot: int  # slot_mappings[g][flat index], as the backend computed it
    block_size: int

    @property
    def consistent(self) -> bool:
        return self.slot == self.physical_block * self.block_size + self.offset


@dataclass(frozen=True)
class TokenRow:
    flat_idx: int
    batch_idx: int | None  # None for padding
    req_id: str | None  # None for padding
    position: int
    input_id: int
    addresses: tuple[Address, ...]  # per group; empty for padding
    slots: tuple[int, ...]  # per group: the backend's slot_mappings[g][flat_idx] (PAD_SLOT_ID for padding)


@dataclass(frozen=True)
class GroupInfo:
    block_size: int
    sliding_window: int | None


@dataclass(frozen=True)
class Explanation:
    title: str
    groups: tuple[GroupInfo, ...]
    state_rows: tuple[StateRow, ...]
    batch_rows: tuple[BatchRow, ...]
    query_start_loc: tuple[int, ...]  # [num_reqs + 1]
    tokens: tuple[TokenRow, ...]  # [num_tokens_padded]
    colours: dict[str, str]  # req_id -> colour

    def colour(self, req_id: str | None) -> str:
        return PAD_COLOUR if req_id is None else self.colours[req_id]


def explain_step(view: StepView) -> Explanation:
    batch, groups = view.batch, view.config.kv_groups
    req_ids: tuple[str, ...] = batch["req_ids"]
    index_mapping = batch["index_mapping"].tolist()  # batch_idx -> req_state_idx
    qsl = [int(x) for x in batch["query_start_loc"].tolist()]
    batch_of = {r: b for b, r in enumerate(req_ids)}
    state_rows = tuple(
        StateRow(s.row, s.req_id, s.num_computed_tokens, len(s.token_ids), s.block_ids, batch_of.get(s.req_id))
        for s in view.snapshot
    )
    batch_rows = tuple(
        BatchRow(
            b, r, int(index_mapping[b]), int(batch["num_scheduled_tokens"][b]), qsl[b], qsl[b + 1],
            int(batch["seq_lens"][b]),
        )
        for b, r in enumerate(req_ids)
    )  # fmt: skip
    owner = [b for b in range(len(req_ids)) for _ in range(qsl[b], qsl[b + 1])]  # flat token index -> batch_idx
    tokens = []
    for t in range(int(batch["num_tokens_padded"])):
        position, input_id = int(batch["positions"][t]), int(batch["input_ids"][t])
        slots = tuple(int(s[t]) for s in batch["slot_mappings"])
        if t >= len(owner):
            tokens.append(TokenRow(t, None, None, position, input_id, (), slots))
            continue
        b = owner[t]
        addresses = []
        for g, group in enumerate(groups):
            logical, offset = divmod(position, group.block_size)
            physical = int(batch["block_tables"][g][b, logical])
            addresses.append(Address(logical, offset, physical, slots[g], group.block_size))
        tokens.append(TokenRow(t, b, req_ids[b], position, input_id, tuple(addresses), slots))
    by_colour = [*req_ids, *(s.req_id for s in state_rows if s.batch_idx is None)]  # the batch gets the first colours
    colours = {r: PALETTE[i % len(PALETTE)] for i, r in enumerate(by_colour)}
    return Explanation(
        view.title,
        tuple(GroupInfo(g.block_size, g.sliding_window) for g in groups),
        state_rows,
        batch_rows,
        tuple(qsl),
        tuple(tokens),
        colours,
    )


def group_label(g: int, group: GroupInfo) -> str:
    window = "" if group.sliding_window is None else f", window {group.sliding_window}"
    return f"group {g} (block_size {group.block_size}{window})"


def address_path(token: TokenRow, g: int) -> str:
    """'position → (logical block, offset) → physical block → slot', the chain of one group."""
    if not token.addresses:
        return f"padding → {token.slots[g]}"
    a = token.addresses[g]
    return f"{token.position} → ({a.logical_block}, {a.offset}) → {a.physical_block} → {a.slot}"


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
    for r in ex.batch_rows:
        batch.add_row(
            str(r.batch_idx), req(r.req_id), str(r.req_state_idx), str(r.num_scheduled_tokens),
            f"[{r.token_start}, {r.token_end})", str(r.seq_len),
        )  # fmt: skip
    console.print(batch)
    console.print(f"index_mapping = {[r.req_state_idx for r in ex.batch_rows]}")
    console.print(f"query_start_loc = {list(ex.query_start_loc)}")

    tokens = Table(title="3. flat tokens: flat idx → (batch_idx, position), cut by query_start_loc")
    for col in ("flat idx", "query_start_loc", "batch_idx", "req_id", "position", "input_id"):
        tokens.add_column(col, justify="right")
    starts = {start: b for b, start in enumerate(ex.query_start_loc[:-1])}
    for t in ex.tokens:
        boundary = f"[{starts[t.flat_idx]}] = {t.flat_idx}" if t.flat_idx in starts and t.req_id is not None else ""
        tokens.add_row(
            str(t.flat_idx), boundary, "-" if t.batch_idx is None else str(t.batch_idx), req(t.req_id),
            str(t.position), str(t.input_id), end_section=_ends_request(ex, t),
        )  # fmt: skip
    console.print(tokens)

    for g, group in enumerate(ex.groups):
        paths = Table(title=f"{4 + g}. addresses in KV {group_label(g, group)}: position → slot")
        for col in ("flat idx", "req_id", "position", "→ (logical, offset)", "→ physical block", "→ slot"):
            paths.add_column(col, justify="right")
        for t in ex.tokens:
            if not t.addresses:
                paths.add_row(str(t.flat_idx), req(None), str(t.position), "", "", str(t.slots[g]))
                continue
            a = t.addresses[g]
            slot = Text(str(a.slot), style="" if a.consistent else "bold red")
            paths.add_row(
                str(t.flat_idx), req(t.req_id), str(t.position), f"({a.logical_block}, {a.offset})",
                str(a.physical_block), slot, end_section=_ends_request(ex, t),
            )  # fmt: skip
        console.print(paths)
    if any(not a.consistent for t in ex.tokens for a in t.addresses):
        console.print("[bold red]slots in red: the backend's slot differs from physical block * block_size + offset[/]")
    if any(t.req_id is None for t in ex.tokens):
        console.print(f"padding tokens: position 0, input id 0, slot PAD_SLOT_ID = {PAD_SLOT_ID}")


def _ends_request(ex: Explanation, t: TokenRow) -> bool:
    return t.batch_idx is not None and t.flat_idx + 1 == ex.query_start_loc[t.batch_idx + 1]


def explain_command(
    backend_name: str,
    seed: int | None,
    step: int | None,
    pad_to: int | None,
    svg: Path | None,
    png: Path | None,
    console: Console,
) -> None:
    """What `slotmap explain` does: pick the step, print it, and draw it if asked."""
    from conformance.backends import load_backend
    from slotmap.pictures import steps

    backend = load_backend(backend_name)
    try:
        if seed is None:
            view = steps.worked_example_step(backend, 2 if step is None else step, pad_to)
        else:
            view = steps.seeded_step(backend, seed, step, pad_to)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    ex = explain_step(view)
    render(ex, console)
    for path, fmt in ((svg, "svg"), (png, "png")):
        if path is not None:
            from slotmap.pictures.drawing import save_picture

            save_picture(ex, path, fmt)
            console.print(f"wrote {path}")
