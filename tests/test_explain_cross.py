"""`slotmap explain --encoder-decoder`: the cross-attention slots of a step (slotmap/pictures/cross.py).

Expected slots are derived here from the pool's snapshot (each request's cross blocks and encoder length),
never from the code under test.
"""

from __future__ import annotations

import dataclasses

from rich.console import Console
from typer.testing import CliRunner

from conformance.backends import BackendHandle, load_backend
from slotmap.cli import app
from slotmap.pictures.cross import explain_cross, render_cross
from slotmap.pictures.explanation import explain_step
from slotmap.pictures.steps import seeded_step
from spec import PAD_SLOT_ID

WIDE = {"COLUMNS": "200"}


def _expected_slots(view_snapshot: object, req_id: str, g: int, encoder_len: int, block_size: int) -> list[int]:
    row = next(r for r in view_snapshot if r.req_id == req_id)  # type: ignore[attr-defined]
    blocks = row.block_ids[g]
    return [blocks[i // block_size] * block_size + i % block_size for i in range(encoder_len)]


def test_each_rows_cross_slots_are_its_blocks_cut_to_its_encoder_len(backend: BackendHandle) -> None:
    for step in (1, 3):
        view = seeded_step(backend, 1, step, encoder_decoder=True)
        cross = explain_cross(view)
        assert cross is not None
        computed = {r.req_id: r.num_computed_tokens for r in view.snapshot}
        for r in cross.rows:
            assert r.written == (r.encoder_len if computed[r.req_id] == 0 else 0)  # its first step only
            want = _expected_slots(view.snapshot, r.req_id, cross.group, r.written, cross.block_size)
            assert list(r.slots) == want and r.consistent
        assert (view.batch["slot_mappings"][cross.group] == PAD_SLOT_ID).all()  # decoder tokens write no cross KV
        assert all(a.consistent for t in explain_step(view).tokens for a in t.addresses)
    assert any(r.written == 0 for r in cross.rows)  # step 3 has a row whose encoder ran before


def test_a_cross_slot_that_breaks_the_chain_is_flagged() -> None:
    view = seeded_step(load_backend("spec"), 1, 1, encoder_decoder=True)
    slots = view.batch["cross_slot_mapping"].copy()
    slots[0] += 1
    cross = explain_cross(dataclasses.replace(view, batch={**view.batch, "cross_slot_mapping": slots}))
    assert cross is not None and not cross.rows[0].consistent
    out = Console(record=True, width=200)
    render_cross(cross, out)
    assert "slots in red differ" in out.export_text()


def test_cli_explain_shows_the_cross_attention_slots() -> None:
    result = CliRunner().invoke(app, ["explain", "--seed", "1", "--step", "1", "--encoder-decoder"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "cross-attention, KV group 2" in result.output
    assert "cross_slot_mapping = [" in result.output
    refused = CliRunner().invoke(app, ["explain", "--encoder-decoder"], env=WIDE)
    assert refused.exit_code == 2 and "--encoder-decoder needs --seed" in refused.output
