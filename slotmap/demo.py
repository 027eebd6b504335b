"""`slotmap demo`: the articles' worked example, drawn the way the articles draw it."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from slotmap.steps import StepView


def render_step(view: StepView, console: Console) -> None:
    batch, config = view.batch, view.config
    by_req = {row.req_id: row for row in view.snapshot}

    rows = Table(title="1. request state pool (persistent rows)")
    for col in ("req_state_idx", "req_id", "known tokens", "num_computed_tokens", "block_table (group 0)"):
        rows.add_column(col)
    for row in view.snapshot:
        rows.add_row(str(row.row), row.req_id, str(len(row.token_ids)), str(row.num_computed_tokens), str(list(row.block_ids[0])))
    console.print(rows)

    order = Table(title="2. batch: sorted by num_scheduled_tokens (index_mapping = batch_idx -> req_state_idx)")
    for col in ("batch_idx", "req_id", "req_state_idx", "num_scheduled_tokens", "query_start_loc", "seq_len"):
        order.add_column(col)
    for b, req_id in enumerate(batch["req_ids"]):
        order.add_row(
            str(b), req_id, str(batch["index_mapping"][b]), str(batch["num_scheduled_tokens"][b]),
            f"{batch['query_start_loc'][b]}..{batch['query_start_loc'][b + 1]}", str(batch["seq_lens"][b]),
        )
    console.print(order)
    console.print(f"query_start_loc = {batch['query_start_loc'].tolist()}")

    tokens = Table(title="3-5. flat tokens -> position -> (logical block, offset) -> physical block -> slot")
    for col in ("flat idx", "req_id", "position", "input_id", "block = pos // bs", "offset = pos % bs",
                "physical = table[row][block]", "slot = physical * bs + offset"):
        tokens.add_column(col)
    block_size = config.kv_groups[0].block_size
    token_owner = [r for r, n in zip(batch["req_ids"], batch["num_scheduled_tokens"], strict=True) for _ in range(n)]
    for t, req_id in enumerate(token_owner):
        pos = int(batch["positions"][t])
        logical, offset = divmod(pos, block_size)
        physical = by_req[req_id].block_ids[0][logical]
        tokens.add_row(
            str(t), req_id, str(pos), str(batch["input_ids"][t]), f"{pos} // {block_size} = {logical}",
            f"{pos} % {block_size} = {offset}", str(physical),
            f"{physical} * {block_size} + {offset} = {batch['slot_mappings'][0][t]}",
        )
    console.print(tokens)
