"""`slotmap explain --mrope`: a step's three M-RoPE position rows (spec/mrope.py), token by token.

Each flat token's position and its temporal, height and width positions as the backend prepared them,
beside where the rule takes them from: column p of its request's table (a prompt token of a multimodal
request), p + delta (past the prompt), or p (a text request). A token whose rows differ from the rule is
shown in red.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from slotmap.pictures.steps import StepView


@dataclass(frozen=True)
class MRopeToken:
    flat_idx: int
    req_id: str
    position: int  # positions[t]
    rows: tuple[int, int, int]  # mrope_positions[:, t] as the backend prepared them
    source: str  # where the rule takes them from: "table[:, p]", "p + delta (d)" or "p (text)"
    expected: tuple[int, int, int]  # the rule's values

    @property
    def consistent(self) -> bool:
        return self.rows == self.expected


def explain_mrope(view: StepView) -> tuple[MRopeToken, ...] | None:
    """The step's real tokens with their three rows, or None for a model without M-RoPE."""
    batch = view.batch
    if batch.get("mrope_positions") is None or view.workload is None:
        return None
    requests = {r.req_id: r for r in view.workload.requests}
    mrope, positions, qsl = batch["mrope_positions"], batch["positions"], batch["query_start_loc"]
    tokens = []
    for b, req_id in enumerate(batch["req_ids"]):
        table, delta = requests[req_id].mrope_positions, requests[req_id].mrope_position_delta
        for t in range(int(qsl[b]), int(qsl[b + 1])):
            p = int(positions[t])
            if table is not None and p < len(table[0]):
                source, expected = "table[:, p]", (table[0][p], table[1][p], table[2][p])
            elif table is not None:
                source, expected = f"p + delta ({delta})", (p + delta,) * 3
            else:
                source, expected = "p (text)", (p,) * 3
            rows = (int(mrope[0, t]), int(mrope[1, t]), int(mrope[2, t]))
            tokens.append(MRopeToken(t, req_id, p, rows, source, expected))
    return tuple(tokens)


def render_mrope(tokens: tuple[MRopeToken, ...], console: Console) -> None:
    table = Table(title="M-RoPE positions: the three rows the rotary embedding reads (mrope_positions [3, T])")
    for col in ("flat idx", "req_id", "position", "temporal", "height", "width", "from"):
        table.add_column(col, justify="right")
    for tok in tokens:
        style = "" if tok.consistent else "bold red"
        cells = [Text(str(v), style=style) for v in tok.rows]
        table.add_row(str(tok.flat_idx), tok.req_id, str(tok.position), *cells, tok.source)
    console.print(table)
    console.print("a prompt token reads its request's table at its position; past the prompt every row is p + delta")
    if not all(tok.consistent for tok in tokens):
        console.print("[bold red]rows in red differ from the table column or p + delta[/]")
