"""`slotmap explain` and `slotmap demo`: the values they show, the pictures they draw, once per backend.

Expected numbers come from the source article (A on row 6 with blocks [81, 44], B on row 7 with
[37, 12], block_size 16, step 2 schedules B:1 and A:8) or are derived here from the pool snapshot,
never from the code under test.
"""

from __future__ import annotations

import dataclasses
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib.image
import numpy as np
from rich.console import Console
from typer.testing import CliRunner

from conformance.backends import BackendHandle, load_backend
from conformance.examples import A_PROMPT, B_SAMPLED
from slotmap.cli import app
from slotmap.pictures.demo import render_step
from slotmap.pictures.explanation import Explanation, explain_step
from slotmap.pictures.steps import StepView, seeded_step, worked_example_step
from slotmap.pictures.terminal import render
from spec import PAD_SLOT_ID

WIDE = {"COLUMNS": "200"}  # rich wraps table cells at the default 80 columns


def _address_row(flat: int, req_id: str, position: int, logical: int, offset: int, physical: int, slot: int) -> str:
    """A row of an address table as rich prints it: cells between vertical bars."""
    cells = (flat, req_id, position, f"({logical}, {offset})", physical, slot)
    return r"\s*│\s*".join(re.escape(str(c)) for c in cells)


def _article_tokens() -> list[tuple[str, int, int, int, int, int]]:
    """(req_id, position, logical block, offset, physical block, slot) of the article's step, by flat index."""
    b = [("B", 31, 31 // 16, 31 % 16, 12, 12 * 16 + 31 % 16)]
    a = [("A", p, p // 16, p % 16, 44, 44 * 16 + p % 16) for p in range(16, 24)]
    return b + a


def _real_paths(ex: Explanation) -> list[tuple[str | None, int, int, int, int, int]]:
    return [
        (t.req_id, t.position, t.addresses[0].logical_block, t.addresses[0].offset, t.addresses[0].physical_block,
         t.addresses[0].slot)
        for t in ex.tokens if t.addresses
    ]  # fmt: skip


def test_worked_example_is_explained_with_the_articles_numbers(backend: BackendHandle) -> None:
    ex = explain_step(worked_example_step(backend))
    assert _real_paths(ex) == _article_tokens()
    assert ex.tokens[0].slots == (207,)  # the article's own address example
    assert ex.query_start_loc == (0, 1, 9)
    assert [(r.batch_idx, r.req_id, r.req_state_idx, r.num_scheduled_tokens) for r in ex.batch_rows] == [
        (0, "B", 7, 1),
        (1, "A", 6, 8),
    ]
    assert [r.seq_len for r in ex.batch_rows] == [31 + 1, 16 + 8]
    assert [t.input_id for t in ex.tokens] == [B_SAMPLED, *A_PROMPT[16:24]]
    rows = {s.req_id: s for s in ex.state_rows}
    assert (rows["A"].row, rows["A"].block_ids, rows["A"].batch_idx) == (6, ((81, 44),), 1)
    assert (rows["B"].row, rows["B"].block_ids, rows["B"].batch_idx) == (7, ((37, 12),), 0)
    assert (rows["B"].num_computed_tokens, rows["B"].num_known_tokens) == (31, 32)  # 31 prompt + 1 sampled
    assert all(rows[f"R{i}"].batch_idx is None and rows[f"R{i}"].row == i for i in range(6))
    assert all(a.consistent for t in ex.tokens for a in t.addresses)


def test_every_backend_shows_the_same_values_as_spec(backend: BackendHandle) -> None:
    for step, pad_to in ((1, None), (2, None), (2, 12)):
        ours = explain_step(worked_example_step(backend, step, pad_to))
        reference = explain_step(worked_example_step(load_backend("spec"), step, pad_to))
        assert ours == reference, (step, pad_to)


def test_padding_tokens_have_pad_slots_and_no_address() -> None:
    ex = explain_step(worked_example_step(load_backend("spec"), 2, pad_to=12))
    assert len(ex.tokens) == 12
    assert [(t.req_id, t.position, t.input_id, t.slots, t.addresses) for t in ex.tokens[9:]] == [
        (None, 0, 0, (PAD_SLOT_ID,), ())
    ] * 3
    out = Console(record=True, width=200)
    render(ex, out)
    text = out.export_text()
    for flat in (9, 10, 11):
        assert re.search(rf"│\s*{flat}\s*│\s*pad\s*│\s*0\s*│\s*│\s*│\s*-1\s*│", text), flat


def test_a_slot_that_breaks_the_chain_is_flagged() -> None:
    view = worked_example_step(load_backend("spec"))
    slots = view.batch["slot_mappings"][0].copy()
    slots[0] += 1  # 208 is not 12 * 16 + 15
    broken = dataclasses.replace(view, batch={**view.batch, "slot_mappings": (slots,)})
    ex = explain_step(broken)
    assert [a.consistent for t in ex.tokens for a in t.addresses] == [False] + [True] * 8
    out = Console(record=True, width=200)
    render(ex, out)
    text = out.export_text()
    assert re.search(_address_row(0, "B", 31, 1, 15, 12, 208), text)
    assert "differs from physical block * block_size + offset" in text


def test_cli_explain_prints_every_index_space() -> None:
    result = CliRunner().invoke(app, ["explain"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "index_mapping = [7, 6]" in result.output
    assert "query_start_loc = [0, 1, 9]" in result.output
    for flat, token in enumerate(_article_tokens()):
        assert re.search(_address_row(flat, *token), result.output), token


def test_cli_explain_rejects_a_step_past_the_schedule() -> None:
    result = CliRunner().invoke(app, ["explain", "--step", "3"], env=WIDE)
    assert result.exit_code == 2
    assert "only 2 steps" in result.output


def _svg_texts(path: Path) -> list[str]:
    return [(e.text or "").strip() for e in ET.parse(path).iter() if e.tag.endswith("text")]


def test_cli_explain_draws_svg_and_png(tmp_path: Path) -> None:
    svg, png = tmp_path / "step.svg", tmp_path / "step.png"
    result = CliRunner().invoke(app, ["explain", "--svg", str(svg), "--png", str(png)], env=WIDE)
    assert result.exit_code == 0, result.output
    texts = _svg_texts(svg)
    for req_id, position, _, offset, physical, slot in _article_tokens():
        assert {str(position), str(slot), str(offset), str(physical)} <= set(texts), req_id
    assert {"[0]=0", "[1]=1", "[2]=9", "[81, 44]", "[37, 12]", str(B_SAMPLED)} <= set(texts)
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert np.unique(image.reshape(-1, image.shape[2]), axis=0).shape[0] > 10  # not blank


def test_demo_reads_out_the_articles_address_example() -> None:
    out = Console(record=True, width=200)
    render_step(worked_example_step(load_backend("spec")), out)
    text = out.export_text()
    assert "flat token 0 (request B)" in text and "31 → (1, 15) → 12 → 207" in text


def _check_addresses_against_the_snapshot(view: StepView) -> int:
    """Re-derives every token's path from the pool rows (not from the batch's gathered tables)."""
    ex = explain_step(view)
    rows = {s.req_id: s for s in ex.state_rows}
    checked = 0
    for b in ex.batch_rows:
        state = rows[b.req_id]
        assert state.row == b.req_state_idx and state.batch_idx == b.batch_idx
        for i, t in enumerate(ex.tokens[b.token_start : b.token_end]):
            assert (t.req_id, t.batch_idx, t.position) == (b.req_id, b.batch_idx, state.num_computed_tokens + i)
            for g, group in enumerate(view.config.kv_groups):
                logical, offset = divmod(t.position, group.block_size)
                physical = state.block_ids[g][logical]
                assert t.addresses[g] == dataclasses.replace(
                    t.addresses[g], logical_block=logical, offset=offset, physical_block=physical
                )
                assert t.slots[g] == physical * group.block_size + offset
                checked += 1
    assert all(t.slots == (PAD_SLOT_ID,) * len(view.config.kv_groups) for t in ex.tokens[ex.query_start_loc[-1] :])
    return checked


def test_worked_example_addresses_agree_with_the_pool_rows(backend: BackendHandle) -> None:
    assert _check_addresses_against_the_snapshot(worked_example_step(backend)) == 9


def test_seeded_steps_agree_with_the_pool_rows() -> None:
    spec_backend = load_backend("spec")
    checked = 0
    for seed in range(4):
        for step in range(1, 9):
            try:
                view = seeded_step(spec_backend, seed, step)
            except ValueError as e:
                assert "finished after" in str(e)
                break
            checked += _check_addresses_against_the_snapshot(view)
    assert checked > 100  # the workloads are not trivially short


def test_every_backend_explains_a_seeded_step_like_spec(backend: BackendHandle) -> None:
    ours = explain_step(seeded_step(backend, 0, 4))
    assert ours == explain_step(seeded_step(load_backend("spec"), 0, 4))
    assert _check_addresses_against_the_snapshot(seeded_step(backend, 0, 4)) > 0


def test_cli_explain_seeded(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["explain", "--seed", "1", "--svg", str(tmp_path / "s.svg")], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "seed 1, step 4" in result.output and "group 1 (block_size 4, window 8)" in result.output
    assert (tmp_path / "s.svg").stat().st_size > 0
    past = CliRunner().invoke(app, ["explain", "--seed", "1", "--step", "500"], env=WIDE)
    assert past.exit_code == 2 and "finished after" in past.output


def test_a_seeded_title_counts_the_batch_not_the_workload() -> None:
    view = seeded_step(load_backend("spec"), 1, 4)
    in_batch = len(view.batch["req_ids"])
    assert in_batch < 6  # the workload has 6 requests; this step's batch holds fewer
    assert f"{in_batch} requests in the batch (of 6 in the workload)" in view.title


def test_a_drafting_step_shows_its_drafts_slots_and_logits_rows(backend: BackendHandle) -> None:
    """Seed 1, step 4 with up to 3 drafts: which tokens are drafts follows from the snapshot's known tokens,
    and each request's logits rows are its last 1 + k tokens (k drafts), in batch order."""
    view = seeded_step(backend, seed=1, step=4, spec_tokens=3)
    ex = explain_step(view)
    assert ex.has_drafts
    known = {s.req_id: len(s.token_ids) for s in view.snapshot}
    expected_logits = []
    for r in ex.batch_rows:
        rows = [t for t in ex.tokens if t.batch_idx == r.batch_idx]
        drafts = [t.position >= known[r.req_id] for t in rows]
        assert [t.is_draft for t in rows] == drafts
        assert r.num_drafts == sum(drafts)
        expected_logits += [t.flat_idx for t in rows[len(rows) - 1 - sum(drafts) :]]
        for t in rows:  # drafts get slots like any other token
            assert all(a.consistent and a.slot >= 0 for a in t.addresses)
    assert sum(r.num_drafts for r in ex.batch_rows) > 0
    assert list(ex.logits_indices) == expected_logits
    assert [t.logits_row for t in ex.tokens if t.logits_row is not None] == list(range(len(expected_logits)))
    result = CliRunner().invoke(app, ["explain", "--backend", backend.name, "--seed", "1", "--step", "4",
                                      "--spec-tokens", "3"], env=WIDE)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "draft" in result.output and f"logits_indices = {expected_logits}" in result.output


def test_spec_tokens_without_a_seed_is_refused() -> None:
    result = CliRunner().invoke(app, ["explain", "--spec-tokens", "2"])
    assert result.exit_code != 0 and "--seed" in result.output


def test_explain_async_lists_each_pending_token_at_its_requests_last_known_token(backend: BackendHandle) -> None:
    view = seeded_step(backend, 3, 4, spec_tokens=2, async_scheduling=True)
    batch, known = view.batch, {row.req_id: row.token_ids for row in view.snapshot}
    starts = batch["query_start_loc"]
    assert batch["pending_token_indices"].size  # seed 3's step 4 has one
    for t in batch["pending_token_indices"].tolist():
        req_id = batch["req_ids"][int(np.searchsorted(starts, t, side="right")) - 1]
        assert batch["positions"][t] == len(known[req_id]) - 1  # its last known token: the step before sampled it
        assert batch["input_ids"][t] == known[req_id][-1]
    result = CliRunner().invoke(app, ["explain", "--seed", "3", "--step", "4", "--async", "--spec-tokens", "2"])
    assert result.exit_code == 0 and "pending tokens" in result.output
    assert CliRunner().invoke(app, ["explain", "--async"]).exit_code != 0  # the worked example is synchronous
