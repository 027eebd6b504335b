"""`slotmap explain --graphs`: which captured graph the step replays, each row's class, and what its padding holds.

The step is prepared with `CapturedGraphs` (spec/graphs.py): the descriptor it dispatches to (runtime mode,
padded tokens, padded request rows, uniform decode, max query length), each real row's class from its progress
(spec/classify.py: prefilling while num_computed < its prompt length; a decode when not prefilling and at most
1 + K tokens), and the padding a graph reads (spec/padding.py): tokens past the real ones with position 0,
input id 0 and PAD_SLOT_ID in every group; request rows past the real ones with index_mapping -1, 0 tokens, the
profile's seq_len and block-table rows of the null block. Every value is the backend's; a padded value that is
not what spec/padding.py says is shown in red.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from slotmap.pictures.explanation import Explanation
from spec.padding import NO_REQUEST
from spec.types import NULL_BLOCK_ID, PAD_SLOT_ID


def padding_faults(ex: Explanation, pad_seq_len: int) -> list[str]:
    """What the step's padding holds that spec/padding.py does not say it holds (empty: all as the rules say)."""
    faults = []
    for t in ex.tokens[ex.num_tokens :]:
        if t.position != 0 or t.input_id != 0 or any(s != PAD_SLOT_ID for s in t.slots):
            faults.append(f"padding token {t.flat_idx}: position {t.position}, input id {t.input_id}, slots {t.slots}")
    for r in ex.padded_rows:
        held = (r.req_state_idx, r.num_scheduled_tokens, r.token_start, r.token_end, r.seq_len)
        if held != (NO_REQUEST, 0, ex.num_tokens, ex.num_tokens, pad_seq_len):
            faults.append(f"padded row {r.batch_idx}: (index_mapping, tokens, query start, end, seq_len) = {held}")
        if any(b != NULL_BLOCK_ID for table in r.block_tables for b in table):
            faults.append(f"padded row {r.batch_idx}: block-table entries other than the null block")
    return faults


def render_graphs(ex: Explanation, console: Console, pad_seq_len: int) -> None:
    d = ex.descriptor
    console.rule("captured graphs: the graph this step replays, and what its padding holds")
    if d is None:
        console.print("prepared without graphs: nothing padded but what --pad-to asks")
        return
    console.print(
        f"descriptor: mode {d.mode}, padded tokens {d.num_tokens} (real {ex.num_tokens}), padded requests "
        f"{d.num_reqs} (real {len(ex.batch_rows)}), uniform {d.uniform}, max query len {d.max_query_len}"
    )
    classes = Table(title="rows by progress (spec/classify.py): prefilling while num_computed < prompt length")
    for col in ("batch_idx", "req_id", "num_scheduled_tokens", "seq_len", "class"):
        classes.add_column(col, justify="right")
    for r in ex.batch_rows:
        kind = "prefilling" if r.is_prefilling else "decode" if r.is_decode else "neither (too many tokens)"
        classes.add_row(
            str(r.batch_idx), Text(r.req_id, style=f"bold {ex.colour(r.req_id)}"), str(r.num_scheduled_tokens),
            str(r.seq_len), kind,
        )  # fmt: skip
    console.print(classes)
    if ex.padded_rows:
        rows = Table(title=f"padded request rows [{len(ex.batch_rows)}, {d.num_reqs}): the FULL graph's, no request")
        for col in ("batch_idx", "index_mapping", "num_scheduled_tokens", "query_start_loc", "seq_len"):
            rows.add_column(col, justify="right")
        for g in range(len(ex.groups)):
            rows.add_column(f"block_tables[{g}] row")
        for p in ex.padded_rows:
            rows.add_row(
                str(p.batch_idx), str(p.req_state_idx), str(p.num_scheduled_tokens),
                f"[{p.token_start}, {p.token_end})", str(p.seq_len), *(str(list(t)) for t in p.block_tables),
                style="dim",
            )  # fmt: skip
        console.print(rows)
    else:
        console.print(f"no padded request row: a {d.mode} graph replays the batch's own {len(ex.batch_rows)} rows")
    console.print(
        f"padding tokens [{ex.num_tokens}, {d.num_tokens}): position 0, input id 0, slot PAD_SLOT_ID = {PAD_SLOT_ID}"
        f" in every group; padded rows: index_mapping {NO_REQUEST}, 0 tokens, seq_len {pad_seq_len} (the profile's), "
        f"block-table rows of the null block {NULL_BLOCK_ID}",
        markup=False,
    )
    for fault in padding_faults(ex, pad_seq_len):
        console.print(f"[bold red]{fault}: not what spec/padding.py says[/]")
