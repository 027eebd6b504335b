"""`slotmap explain --encoder-decoder`: a step's cross-attention slots (spec/cross_attention.py), per batch row.

Each row's encoder length L (the keys its cross-attention reads), whether its encoder output is written
this step (its first step), its cross blocks, and the slots the step writes: the backend's part of
cross_slot_mapping, beside the chain's arithmetic block_ids[:cdiv(L, bs)] * bs + arange, cut to L (in red
where the backend's slots differ from it).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from slotmap.pictures.steps import StepView
from spec.cross_attention import cross_group


@dataclass(frozen=True)
class CrossRow:
    batch_idx: int
    req_id: str
    encoder_len: int  # encoder_seq_lens[b]: the keys its cross-attention reads
    written: int  # scheduled_encoder_lens[b]: its encoder tokens written this step (L on its first step, else 0)
    blocks: tuple[int, ...]  # block_tables[g][b][:cdiv(L, bs)], its cross blocks
    slots: tuple[int, ...]  # its part of the backend's cross_slot_mapping
    expected: tuple[int, ...]  # the chain's arithmetic for `written` tokens

    @property
    def consistent(self) -> bool:
        return self.slots == self.expected


@dataclass(frozen=True)
class CrossExplanation:
    group: int
    block_size: int
    rows: tuple[CrossRow, ...]


def explain_cross(view: StepView) -> CrossExplanation | None:
    """The cross rows of the step, or None for a decoder-only model."""
    g = cross_group(view.config)
    if g is None:
        return None
    batch, block_size = view.batch, view.config.kv_groups[g].block_size
    lens = [int(n) for n in batch["encoder_seq_lens"]]
    written = [int(n) for n in batch["scheduled_encoder_lens"]]
    slots = [int(s) for s in batch["cross_slot_mapping"]]
    rows, start = [], 0
    for b, req_id in enumerate(batch["req_ids"]):
        blocks = tuple(int(x) for x in batch["block_tables"][g][b][: -(-lens[b] // block_size)])
        expected = tuple(blocks[i // block_size] * block_size + i % block_size for i in range(written[b]))
        mine = tuple(slots[start : start + written[b]])  # its part of cross_slot_mapping, in batch order
        rows.append(CrossRow(b, req_id, lens[b], written[b], blocks, mine, expected))
        start += written[b]
    return CrossExplanation(g, block_size, tuple(rows))


def render_cross(cx: CrossExplanation, console: Console) -> None:
    table = Table(
        title=f"cross-attention, KV group {cx.group} (block_size {cx.block_size}): the encoder's KV, written on a "
        "request's first step, read whole by every decoder step"
    )
    for col in ("batch_idx", "req_id", "encoder_seq_len", "encoder runs", "cross blocks", "→ slots written"):
        table.add_column(col, justify="right")
    for r in cx.rows:
        shown = _ranges(r.slots) if r.written else "-"
        table.add_row(
            str(r.batch_idx), r.req_id, str(r.encoder_len), "yes" if r.written else "no", str(list(r.blocks)),
            Text(shown, style="" if r.consistent else "bold red"),
        )  # fmt: skip
    console.print(table)
    console.print(f"cross_slot_mapping = {[s for r in cx.rows for s in r.slots]}")
    console.print("slot = block * block_size + offset, cut to encoder_seq_len; the group's slot_mappings is all PAD")
    if not all(r.consistent for r in cx.rows):
        console.print("[bold red]slots in red differ from block_ids[:cdiv(L, bs)] * bs + arange, cut to L[/]")


def _ranges(slots: tuple[int, ...]) -> str:
    """Consecutive runs as a..b: 40..43, 44..45."""
    runs: list[list[int]] = []
    for s in slots:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}..{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
