"""`slotmap explain --graphs / --ubatch / --mla`: padding rows, the micro-batch split and MLA, in the terminal and
in the pictures.

Expected values are derived here by hand from the articles' worked example (A on row 6 with blocks [81, 44],
16 of its 24 prompt tokens computed; B on row 7 with [37, 12], its 31 prompt tokens computed and one sampled;
step 2 schedules B:1 then A:8, block_size 16) or from the pool snapshot, never from the command's output.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conformance.backends import BackendHandle, load_backend
from conformance.examples import worked_example
from slotmap.cli import app
from slotmap.pictures.explanation import explain_step
from slotmap.pictures.mla import explain_mla
from slotmap.pictures.steps import SEEDED_CONFIG, captured_graphs, seeded_step, worked_example_step
from slotmap.pictures.ubatch import explain_ubatch
from spec import PAD_SLOT_ID

WIDE = {"COLUMNS": "220"}
SPEC = load_backend("spec")
SIZES = (1, 2, 4, 8, 16)


def _cells(*values: object) -> str:
    """A table row as rich prints it: the values between vertical bars."""
    return r"\s*│\s*".join(re.escape(str(v)) for v in values)


def _invoke(*args: str) -> str:
    result = CliRunner().invoke(app, ["explain", *args], env=WIDE)
    assert result.exit_code == 0, result.output
    return result.output


# ---- captured graphs and padding -------------------------------------------------------------


def test_a_full_graph_pads_the_worked_example_to_16_tokens_and_8_rows(backend: BackendHandle) -> None:
    config = worked_example().config
    view = worked_example_step(backend, graphs=captured_graphs(config, SIZES, "FULL"))
    ex = explain_step(view)
    d = ex.descriptor
    # 9 tokens: the smallest size >= 9 is 16; a mixed FULL graph replays min(16, max_num_reqs = 8) rows
    assert (d.mode, d.num_tokens, d.num_reqs, d.uniform, d.max_query_len) == ("FULL", 16, 8, False, 8)
    assert ex.num_tokens == 9 and len(ex.tokens) == 16
    # B: 31 computed = its prompt, 1 token: a decode; A: 16 computed < 24 prompt tokens: prefilling
    assert [(r.req_id, r.is_prefilling, r.is_decode) for r in ex.batch_rows] == [("B", False, True), ("A", True, False)]
    assert [p.batch_idx for p in ex.padded_rows] == [2, 3, 4, 5, 6, 7]
    blocks_per_req = config.max_blocks_per_req(0)
    for p in ex.padded_rows:
        assert (p.req_state_idx, p.num_scheduled_tokens, p.token_start, p.token_end, p.seq_len) == (-1, 0, 9, 9, 0)
        assert p.block_tables == ((0,) * blocks_per_req,)
    for t in ex.tokens[9:]:
        assert (t.req_id, t.position, t.input_id, t.slots) == (None, 0, 0, (PAD_SLOT_ID,))
    assert ex.query_start_loc == (0, 1, 9, 9, 9, 9, 9, 9, 9)


def test_piecewise_pads_tokens_only() -> None:
    ex = explain_step(worked_example_step(SPEC, graphs=captured_graphs(worked_example().config, SIZES)))
    d = ex.descriptor  # FULL_AND_PIECEWISE: A prefills, so the batch is mixed and runs the PIECEWISE graph
    assert (d.mode, d.num_tokens, d.num_reqs, d.uniform) == ("PIECEWISE", 16, 2, False)
    assert ex.padded_rows == () and len(ex.tokens) == 16


def test_cli_prints_the_descriptor_classes_and_padded_rows() -> None:
    out = _invoke("--graphs", "1,2,4,8,16", "--graph-mode", "FULL")
    assert "descriptor: mode FULL, padded tokens 16 (real 9), padded requests 8 (real 2), uniform False, " \
        "max query len 8" in out  # fmt: skip
    assert re.search(_cells(0, "B", 1, 32, "decode"), out) and re.search(_cells(1, "A", 8, 24, "prefilling"), out)
    for b in range(2, 8):
        assert re.search(_cells(b, -1, 0, "[9, 9)", 0, "[0, 0, 0, 0]"), out), b
    for t in range(9, 16):  # the address table's padding rows: position 0, slot -1
        assert re.search(rf"│\s*{t}\s*│\s*pad\s*│\s*0\s*│\s*│\s*│\s*-1\s*│", out), t
    assert "not what spec/padding.py says" not in out


def test_the_flashmla_profile_pads_seq_lens_with_one() -> None:
    out = _invoke("--graphs", "16", "--graph-mode", "FULL", "--profile", "flashmla")
    assert re.search(_cells(2, -1, 0, "[9, 9)", 1, "[0, 0, 0, 0]"), out)
    view = worked_example_step(SPEC, graphs=captured_graphs(worked_example().config, (16,), "FULL", "flashmla"))
    assert [int(s) for s in view.batch["seq_lens"]] == [32, 24, 1, 1, 1, 1, 1, 1]


def test_a_seeded_step_with_graphs_pads_every_row_past_the_real_ones() -> None:
    graphs = captured_graphs(SEEDED_CONFIG, (8, 16, 32), "FULL")
    view = seeded_step(SPEC, 0, 4, graphs=graphs)
    batch = view.batch
    num_reqs, num_tokens = len(batch["req_ids"]), int(batch["num_tokens"])
    expected_tokens = next(s for s in (8, 16, 32) if s >= num_tokens)
    ex = explain_step(view)
    assert ex.descriptor.num_tokens == expected_tokens == len(ex.tokens)
    assert ex.descriptor.num_reqs == min(expected_tokens, SEEDED_CONFIG.max_num_reqs)
    assert len(ex.padded_rows) == ex.descriptor.num_reqs - num_reqs
    prompt = {r.req_id: len(r.prompt_token_ids) for r in view.workload.requests}
    for r in ex.batch_rows:  # prefilling: computed before the step (seq_len - scheduled) < its prompt length
        assert r.is_prefilling == (r.seq_len - r.num_scheduled_tokens < prompt[r.req_id]), r
        assert r.is_decode == (not r.is_prefilling and r.num_scheduled_tokens <= 1), r
    assert {r.is_prefilling for r in ex.batch_rows} == {True, False}  # the step shows both classes
    assert all(p.req_state_idx == -1 and p.seq_len == 0 for p in ex.padded_rows)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--graphs", "4,2"], "ascending"),
        (["--graphs", "0,4"], "positive"),
        (["--graphs", "2,x"], "separated by commas"),
        (["--graphs", "4", "--pad-to", "12"], "give one"),
        (["--graph-mode", "FULL"], "--graph-mode needs --graphs"),
        (["--graphs", "16", "--graph-mode", "SOMETIMES"], "not a cudagraph mode"),
        (["--graphs", "16", "--profile", "flashfoo"], "not a padding profile"),
        (["--ubatch", "--split-at", "9"], "[1, 8]"),
        (["--ubatch", "--split-at", "0"], "[1, 8]"),
        (["--split-at", "3"], "--split-at needs --ubatch"),
        (["--topk", "3"], "--topk needs --mla"),
        (["--seed", "3", "--hybrid", "--ubatch"], "cannot be split"),
    ],
)
def test_bad_flags_end_in_a_typer_error(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["explain", *args], env=WIDE)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.replace("│", " ").split()), result.output


# ---- micro-batches -----------------------------------------------------------------------------


def test_the_default_split_cuts_a_inside_and_keeps_it_in_both_halves(backend: BackendHandle) -> None:
    ux = explain_ubatch(worked_example_step(backend))
    first, second = ux.halves
    assert ux.split_point == 9 // 2 == 4 and ux.straddling == "A"
    # flat tokens: B at 0, A at 1..8 (positions 16..23); the first half holds A's positions 16..18
    assert (first.token_start, first.token_stop, first.request_start, first.request_stop) == (0, 4, 0, 2)
    assert (first.req_ids, first.index_mapping, first.query_start_loc) == (("B", "A"), (7, 6), (0, 1, 4))
    assert first.seq_lens == (32, 19) and first.num_tokens == 4
    assert (second.token_start, second.token_stop, second.request_start, second.request_stop) == (4, 9, 1, 2)
    assert (second.req_ids, second.index_mapping) == (("A",), (6,))
    assert (second.query_start_loc, second.seq_lens) == ((0, 5), (24,))


def test_a_split_at_a_request_boundary_straddles_nothing() -> None:
    ux = explain_ubatch(worked_example_step(SPEC), 1)
    first, second = ux.halves
    assert ux.straddling is None
    assert (first.req_ids, first.query_start_loc, first.seq_lens) == (("B",), (0, 1), (32,))
    assert (second.req_ids, second.query_start_loc, second.seq_lens) == (("A",), (0, 8), (24,))


def test_cli_ubatch_prints_both_halves() -> None:
    out = _invoke("--ubatch")
    assert "split at flat token 4 of 9" in out
    assert re.search(_cells(0, "[0, 4)", "[0, 2)", "B, A", "[7, 6]", "[0, 1, 4]", "[32, 19]", 4), out)
    assert re.search(_cells(1, "[4, 9)", "[1, 2)", "A", "[6]", "[0, 5]", "[24]", 5), out)
    assert "A straddles the split" in out
    padded = _invoke("--ubatch", "--graphs", "16", "--graph-mode", "FULL", "--split-at", "12")
    # second half [12, 16) is all padding: it holds A (the last real request) with no query token (v2's clamp)
    assert re.search(_cells(1, "[12, 16)", "[1, 8)", "A", "[6, -1, -1, -1, -1, -1, -1]"), padded)


# ---- MLA ------------------------------------------------------------------------------------------


def test_the_mla_worked_example_keeps_the_articles_slots(backend: BackendHandle) -> None:
    view = worked_example_step(backend, mla=True)
    mx = explain_mla(view, topk=0)
    assert mx is not None and (mx.group, mx.kv_lora_rank, mx.rope_dim) == (0, 512, 64)
    assert mx.cache_shape == (128, 16, 512 + 64)
    # B's token at position 31 -> block 12, offset 15 -> slot 207; A's 16..23 -> block 44, offsets 0..7
    assert [(b.block, b.req_id, b.offsets, b.slots) for b in mx.blocks] == [
        (12, "B", (15,), (207,)),
        (44, "A", tuple(range(8)), tuple(44 * 16 + o for o in range(8))),
    ]
    # B decodes one token; A prefills: decode-first order is the batch order, one decode token
    assert mx.is_decode == (True, False) and mx.order == (0, 1)
    s = mx.split
    assert (s.num_decodes, s.num_prefills, s.num_decode_tokens, s.num_prefill_tokens) == (1, 1, 1, 8)
    assert explain_mla(worked_example_step(backend)) is None  # no mla group: nothing to show


@pytest.mark.parametrize(("seed", "k"), [(None, 5), (0, 4), (2, 40)])
def test_a_topk_selection_lies_in_the_causal_range_and_maps_through_the_table(seed: int | None, k: int) -> None:
    view = worked_example_step(SPEC, mla=True) if seed is None else seeded_step(SPEC, seed, 4, mla=True)
    mx = explain_mla(view, topk=k)
    assert mx is not None and mx.selection is not None
    sel = mx.selection
    num_tokens = int(view.batch["num_tokens"])
    assert sel.flat_idx == num_tokens - 1 and sel.position == int(view.batch["positions"][num_tokens - 1])
    chosen = [p for p in sel.positions if p >= 0]
    assert len(chosen) == min(k, sel.position + 1) == len(set(chosen))
    assert all(0 <= p <= sel.position for p in chosen)
    assert list(sel.positions[len(chosen) :]) == [-1] * (k - len(chosen))
    table = {r.req_id: r for r in view.snapshot}[sel.req_id].block_ids[mx.group]
    bs = mx.block_size
    assert list(sel.slots) == [table[p // bs] * bs + p % bs if p >= 0 else -1 for p in sel.positions]


def test_cli_mla_shows_latent_blocks_split_and_selection() -> None:
    out = _invoke("--mla", "--topk", "3")
    assert "[num_blocks, block_size, kv_lora_rank + rope] = [128, 16, 576]" in out
    assert "kv_c [512]" in out and "k_pe [64]" in out
    assert re.search(_cells(44, "A", "0..7", "704..711", "8 × [512 | 64]"), out)
    assert re.search(_cells(0, 0, "B", 1, "decode (absorbed)"), out) and re.search(_cells(1, 1, "A", 8, "prefill"), out)
    assert "sparse top-3: flat token 8 (A, position 23)" in " ".join(out.split())
    assert "latent 512 + rope 64 per slot" in out  # the address table's group label
    seeded = _invoke("--seed", "0", "--mla", "--graphs", "8,16,32", "--graph-mode", "FULL", "--profile", "flashmla")
    assert "MLA, KV group 0" in seeded and "padded request rows" in seeded


# ---- pictures ---------------------------------------------------------------------------------------


def test_pictures_draw_padding_the_split_and_the_mla_paths(tmp_path: Path) -> None:
    svg, png = tmp_path / "step.svg", tmp_path / "step.png"
    _invoke("--graphs", "16", "--graph-mode", "FULL", "--ubatch", "--mla", "--svg", str(svg), "--png", str(png))
    texts = ["".join(e.itertext()) for e in ET.parse(svg).getroot().iter() if e.tag.endswith("text")]
    for b in range(2, 8):
        assert f"{b}: pad → -1, seq_len 0, blocks 0" in texts, b
    assert texts.count("-1") >= 16 - 9  # each padding token's slot under it
    assert "graph: FULL, 16 tokens, 8 request rows, uniform False" in texts
    # 16 padded tokens split at 8: B and 7 of A's tokens, then A's last token, the padding and the 6 padded rows
    assert "ubatch 0: rows [0, 2), qsl [0, 1, 8]" in texts
    assert "ubatch 1: rows [1, 8), qsl [0, 1, 1, 1, 1, 1, 1, 1]" in texts
    assert texts.count("MLA decode") == 1 and texts.count("MLA prefill") == 1
    assert any("latent 512 + rope 64 per slot" in t for t in texts)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plain = tmp_path / "plain.svg"
    _invoke("--svg", str(plain))
    plain_texts = "".join(ET.parse(plain).getroot().itertext())
    assert "pad →" not in plain_texts and "ubatch" not in plain_texts and "MLA" not in plain_texts
