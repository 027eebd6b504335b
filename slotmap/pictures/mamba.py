"""`slotmap explain --hybrid`: a step's Mamba state indices (spec/mamba.py), per batch row.

Each row's num_computed, seq_len and drafts, whether it is prefilling, and its state blocks: the one it
starts from (`mamba_prev_state_indices`, which table entry that is) and the ones it writes
(`mamba_state_indices`: the write column (seq_len - 1) // block_size, then one entry per draft), beside
what the rule gives from the row's table (in red where the backend's differ). A read is checked against
`(num_computed - 1) // block_size` where nothing drafts (no speculative blocks); with drafts its column
depends on the row's previous step, and only its entry is shown.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from slotmap.pictures.steps import StepView
from spec.mamba import MAMBA, NO_STATE


@dataclass(frozen=True)
class MambaRow:
    batch_idx: int
    req_id: str
    num_computed: int
    seq_len: int
    num_drafts: int
    is_prefilling: bool
    num_accepted: int | None  # num_accepted_tokens[b]; None without speculative blocks
    read: int  # mamba_prev_state_indices[b]: the state block it starts from, -1 for none
    read_entry: int | None  # which entry of its table that block is (None for -1)
    expected_read: int | None  # the rule's block where it does not depend on the previous step, else None
    write_column: int  # (seq_len - 1) // block_size
    written: tuple[int, ...]  # mamba_state_indices[b]: -1 past its drafts
    expected_written: tuple[int, ...]  # the rule's, from its table

    @property
    def consistent(self) -> bool:
        read_ok = self.expected_read is None or self.read == self.expected_read
        return read_ok and self.written == self.expected_written


@dataclass(frozen=True)
class MambaExplanation:
    group: int
    block_size: int
    num_speculative_blocks: int
    rows: tuple[MambaRow, ...]


def explain_mamba(view: StepView) -> MambaExplanation | None:
    """The mamba rows of the step, or None for a model without a mamba group."""
    groups = [g for g, group in enumerate(view.config.kv_groups) if group.kind == MAMBA]
    if not groups:
        return None
    g = groups[0]
    group, batch = view.config.kv_groups[g], view.batch
    bs, width = group.block_size, 1 + group.num_speculative_blocks
    accepted = batch["num_accepted_tokens"]
    drafts = batch.get("num_draft_tokens")
    rows = []
    for b, req_id in enumerate(batch["req_ids"]):
        table = [int(x) for x in batch["block_tables"][g][b]]
        seq_len, scheduled = int(batch["seq_lens"][b]), int(batch["num_scheduled_tokens"][b])
        computed, k = seq_len - scheduled, 0 if drafts is None else int(drafts[b])
        write = (seq_len - 1) // bs
        expected_written = tuple(table[write + i] if i <= k else NO_STATE for i in range(width))
        read = int(batch["mamba_prev_state_indices"][g][b])
        expected_read = None
        if accepted is None:  # no drafts anywhere: the state after position c - 1 is in its block
            expected_read = NO_STATE if computed == 0 else table[(computed - 1) // bs]
        rows.append(
            MambaRow(
                b,
                req_id,
                computed,
                seq_len,
                k,
                bool(batch["is_prefilling"][b]),
                None if accepted is None else int(accepted[b]),
                read,
                table.index(read) if read != NO_STATE and read in table else None,
                expected_read,
                write,
                tuple(int(x) for x in batch["mamba_state_indices"][g][b]),
                expected_written,
            )
        )
    return MambaExplanation(g, bs, group.num_speculative_blocks, tuple(rows))


def render_mamba(mx: MambaExplanation, console: Console) -> None:
    table = Table(
        title=f"mamba state, KV group {mx.group} (block_size {mx.block_size}, {mx.num_speculative_blocks} "
        "speculative blocks): one recurrent state per request, read from one state block and written to another"
    )
    columns = ("batch_idx", "req_id", "num_computed", "seq_len", "drafts", "is_prefilling", "num_accepted",
               "reads (entry)", "write column", "→ writes")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for r in mx.rows:
        read = "-1 (no prior state)" if r.read == NO_STATE else f"{r.read} ({r.read_entry})"
        table.add_row(
            str(r.batch_idx), r.req_id, str(r.num_computed), str(r.seq_len), str(r.num_drafts),
            "yes" if r.is_prefilling else "no", "-" if r.num_accepted is None else str(r.num_accepted),
            Text(read, style="" if r.consistent else "bold red"), str(r.write_column),
            Text(str(list(r.written)), style="" if r.consistent else "bold red"),
        )  # fmt: skip
    console.print(table)
    console.print(
        "write column = (seq_len - 1) // block_size, then one entry per draft (-1 past them); the read is the state "
        "after position num_computed - 1; the group's slot_mappings is all PAD"
    )
    if not all(r.consistent for r in mx.rows):
        console.print("[bold red]state indices in red differ from the rule (spec/mamba.py)[/]")
