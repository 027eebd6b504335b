"""`slotmap explain --hybrid`: the Mamba state indices of a step (slotmap/pictures/mamba.py).

Expected blocks are derived here from the pool's snapshot (each request's state table and num_computed),
never from the code under test.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from rich.console import Console
from typer.testing import CliRunner

from conformance.backends import BackendHandle, load_backend
from slotmap.cli import app
from slotmap.pictures.explanation import explain_step
from slotmap.pictures.mamba import explain_mamba, render_mamba
from slotmap.pictures.steps import seeded_step
from spec import PAD_SLOT_ID

WIDE = {"COLUMNS": "200"}


def test_each_rows_state_blocks_follow_from_its_table(backend: BackendHandle) -> None:
    for step in (1, 4):
        view = seeded_step(backend, 3, step, hybrid=True)
        states = explain_mamba(view)
        assert states is not None
        bs, g = states.block_size, states.group
        rows = {r.req_id: r for r in view.snapshot}
        for r in states.rows:
            table, computed = rows[r.req_id].block_ids[g], rows[r.req_id].num_computed_tokens
            assert r.num_computed == computed
            assert r.written == (table[(r.seq_len - 1) // bs],)  # no drafts: one state, no speculative blocks
            assert r.read == (-1 if computed == 0 else table[(computed - 1) // bs])
            assert r.consistent
        assert (view.batch["slot_mappings"][g] == PAD_SLOT_ID).all()  # no token writes KV to a mamba group
        assert all(a.consistent for t in explain_step(view).tokens for a in t.addresses)
    assert any(r.read != -1 for r in states.rows) and any(r.is_prefilling for r in states.rows)


def test_drafts_write_their_states_to_the_speculative_blocks() -> None:
    view = seeded_step(load_backend("spec"), 3, 5, spec_tokens=2, hybrid=True)
    states = explain_mamba(view)
    assert states is not None and states.num_speculative_blocks == 2
    rows = {r.req_id: r for r in view.snapshot}
    drafting = [r for r in states.rows if r.num_drafts]
    assert drafting
    for r in states.rows:
        table = rows[r.req_id].block_ids[states.group]
        w = (r.seq_len - 1) // states.block_size
        assert r.written == tuple(table[w + i] if i <= r.num_drafts else -1 for i in range(3))
        assert r.num_accepted is not None and r.num_accepted >= 1


def test_a_state_index_that_breaks_the_rule_is_flagged() -> None:
    view = seeded_step(load_backend("spec"), 3, 4, hybrid=True)
    g = len(view.config.kv_groups) - 1
    written = [np.array(a) if a is not None else None for a in view.batch["mamba_state_indices"]]
    written[g][0, 0] += 1
    states = explain_mamba(dataclasses.replace(view, batch={**view.batch, "mamba_state_indices": tuple(written)}))
    assert states is not None and not states.rows[0].consistent
    out = Console(record=True, width=220)
    render_mamba(states, out)
    assert "state indices in red differ from the rule" in out.export_text()


def test_cli_explain_shows_the_state_indices() -> None:
    result = CliRunner().invoke(app, ["explain", "--seed", "3", "--step", "5", "--hybrid", "--spec-tokens", "2"],
                                env=WIDE)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "mamba state, KV group 2 (block_size 8, 2 speculative blocks)" in result.output
    assert "write column" in result.output and "differ from the rule" not in result.output
    refused = CliRunner().invoke(app, ["explain", "--hybrid"], env=WIDE)
    assert refused.exit_code == 2 and "--hybrid needs --seed" in refused.output
