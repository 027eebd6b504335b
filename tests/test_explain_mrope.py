"""`slotmap explain --mrope`: each token's three M-RoPE rows (spec/mrope.py), checked against the request's table.

Expected rows are read from the workload's tables (column p in the prompt, p + delta past it, p for text),
never from the code under test.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
from rich.console import Console
from typer.testing import CliRunner

from conformance.backends import BackendHandle
from slotmap.cli import app
from slotmap.pictures.mrope import explain_mrope, render_mrope
from slotmap.pictures.steps import seeded_step

WIDE = {"COLUMNS": "200"}
SEED, STEP = 1, 4  # a step with a multimodal prompt chunk, a multimodal decode row and a text request


def test_every_token_shows_its_tables_column_or_p_plus_delta(backend: BackendHandle) -> None:
    view = seeded_step(backend, SEED, STEP, mrope=True)
    requests = {r.req_id: r for r in view.workload.requests}
    tokens = explain_mrope(view)
    assert tokens is not None and len(tokens) == view.batch["num_tokens"]
    kinds = set()
    for tok in tokens:
        table, delta = requests[tok.req_id].mrope_positions, requests[tok.req_id].mrope_position_delta
        if table is None:
            want, kinds = (tok.position,) * 3, kinds | {"text"}
        elif tok.position < len(table[0]):
            want, kinds = tuple(row[tok.position] for row in table), kinds | {"table"}
        else:
            want, kinds = (tok.position + delta,) * 3, kinds | {"delta"}
        assert tok.rows == want and tok.consistent
    assert kinds == {"text", "table", "delta"}


def test_a_wrong_row_is_shown_in_red(backend: BackendHandle) -> None:
    view = seeded_step(backend, SEED, STEP, mrope=True)
    mrope = np.array(view.batch["mrope_positions"])
    mrope[1, 0] += 1
    tokens = explain_mrope(dataclasses.replace(view, batch={**view.batch, "mrope_positions": mrope}))
    assert tokens is not None and [t.flat_idx for t in tokens if not t.consistent] == [0]
    console = Console(record=True, width=200)
    render_mrope(tokens, console)
    assert "differ from the table column or p + delta" in console.export_text()


def test_the_cli_prints_the_three_rows() -> None:
    result = CliRunner().invoke(app, ["explain", "--seed", str(SEED), "--step", str(STEP), "--mrope"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "M-RoPE positions" in result.output
    assert re.search(r"temporal\s*┃\s*height\s*┃\s*width", result.output)
    assert "p + delta (" in result.output and "table[:, p]" in result.output and "p (text)" in result.output


def test_mrope_needs_a_seed() -> None:
    result = CliRunner().invoke(app, ["explain", "--mrope"], env=WIDE)
    assert result.exit_code != 0 and "--mrope needs --seed" in result.output
