"""`slotmap explore`: the page's data is spec's, the page is self-contained, and in a real browser what it
highlights for a token is spec's path for that token.

Expected numbers come from the source article (the worked example: B's token at position 31 lands in
slot 12 * 16 + 15 = 207) or from spec's own arrays reached by another path than the page's export
(`slotmap explain`'s `seeded_step`, the pool driven by hand, the reference scheduler's expected pool).
The browser tests run headless Chromium (scripts/setup-browser installs it); without it they skip, and
say what is missing, unless SLOTMAP_REQUIRE_BROWSER is set, which turns the skip into a failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import spec
from conformance.backends import load_backend
from conformance.examples import B_SAMPLED, worked_example
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload
from shadow.checker import ShadowChecker
from slotmap.cli import app
from slotmap.explore import Recorder, seeded_run, shadow_run, worked_example_run, write_page
from slotmap.explore.blocks import block_uses
from slotmap.explore.browser import BrowserUnavailableError, find_browser, headless_chromium
from slotmap.explore.export import export_run
from slotmap.explore.page import render_page
from slotmap.pictures.explanation import explain_step
from slotmap.pictures.steps import SEEDED_CONFIG, captured_graphs, seeded_step
from spec.types import (
    PAD_SLOT_ID,
    CachedRequest,
    KVCacheGroup,
    NewRequest,
    RowSnapshot,
    SchedulerOutput,
    WorkerConfig,
)

SPEC = load_backend("spec")
RUNS = [(0, 2), (1, 0)]  # (seed, spec_tokens): prefix sharing, null entries and drafts; preemption and resumption


def _embedded(html: str) -> dict[str, Any]:
    found = re.search(r'<script type="application/json" id="slotmap-data">(.*?)</script>', html, re.S)
    assert found is not None
    data: dict[str, Any] = json.loads(found.group(1))
    return data


# ---- the data ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("seed", "spec_tokens"), RUNS)
def test_each_step_of_a_seeded_run_is_what_slotmap_explain_shows(seed: int, spec_tokens: int) -> None:
    run = seeded_run(seed, spec_tokens=spec_tokens)
    assert len(run.steps) > 4
    for step in run.steps:
        expected = explain_step(seeded_step(SPEC, seed, step.number, spec_tokens=spec_tokens))
        assert dataclasses.replace(step.explanation, title="") == dataclasses.replace(expected, title="")


def test_the_worked_example_exports_the_articles_numbers() -> None:
    data = export_run(worked_example_run())
    assert data["start_step"] == 2
    step = data["steps"][1]
    reqs = data["reqs"]
    assert [(reqs[r], row) for r, row, *_ in step["batch"]] == [("B", 7), ("A", 6)]
    assert step["qsl"] == [0, 1, 9]
    tokens = step["tokens"]
    assert tokens["position"] == [31, *range(16, 24)]
    assert tokens["input_id"][0] == B_SAMPLED
    g0 = tokens["groups"][0]
    assert (g0["logical"][0], g0["offset"][0], g0["physical"][0], g0["slot"][0]) == (1, 15, 12, 12 * 16 + 15)
    assert g0["slot"][1:] == list(range(44 * 16, 44 * 16 + 8))
    assert step["written"] == [[12, 44]]
    rows = {reqs[r]: (row, entries) for row, r, _, _, _, _, entries, _ in step["rows"]}
    assert rows["A"] == (6, [[81, 44]]) and rows["B"] == (7, [[37, 12]])


def _graphs_run() -> Any:
    graphs = captured_graphs(SEEDED_CONFIG, (4, 8, 16, 32), "FULL")
    return graphs, seeded_run(0, graphs=graphs, ubatch=True, mla=True)


def test_a_run_with_graphs_exports_each_steps_padding_as_slotmap_explain_shows_it() -> None:
    graphs, run = _graphs_run()
    data = export_run(run)
    assert data["config"]["groups"][0]["latent"] == [512, 64] and data["config"]["groups"][1]["latent"] is None
    padded_somewhere = False
    for number, step in enumerate(data["steps"], start=1):
        batch = seeded_step(SPEC, 0, number, graphs=graphs, mla=True).batch  # spec's arrays by explain's path
        num_reqs, num_tokens = len(batch["req_ids"]), int(batch["num_tokens"])
        assert step["num_tokens"] == num_tokens
        # the smallest graph that fits; a step without tokens runs no graph
        padded = next((s for s in (4, 8, 16, 32) if s >= num_tokens), None) if num_tokens else None
        if padded is None:
            assert step["graph"][0] == "NONE" and step["pad_rows"] == []
            continue
        rows = min(padded, SEEDED_CONFIG.max_num_reqs)  # a mixed FULL graph's request rows
        assert step["graph"][:3] == ["FULL", padded, rows], number
        assert len(step["tokens"]["position"]) == padded
        assert step["tokens"]["batch"][num_tokens:] == [-1] * (padded - num_tokens)
        assert all(g["slot"][num_tokens:] == [PAD_SLOT_ID] * (padded - num_tokens) for g in step["tokens"]["groups"])
        assert step["pad_rows"] == [[b, -1, 0, 0, True] for b in range(num_reqs, rows)], number
        assert step["qsl"][num_reqs + 1 :] == [num_tokens] * (rows - num_reqs)
        padded_somewhere |= rows > num_reqs
    assert padded_somewhere


def test_a_run_with_ubatch_marks_each_steps_split_at_half_its_padded_tokens() -> None:
    _, run = _graphs_run()
    data = export_run(run)
    straddled = False
    for step in data["steps"]:
        qsl, total = step["qsl"][: len(step["batch"]) + 1], len(step["tokens"]["position"])
        u = step["ubatch"]
        if total < 2:
            assert "refused" in u
            continue
        split = total // 2
        assert u["split"] == split
        (s0, e0, *_), (s1, e1, *_) = u["halves"]
        assert (s0, e0, s1, e1) == (0, split, split, total)
        inside = [b for b in range(len(qsl) - 1) if qsl[b] < split < qsl[b + 1]]  # the request cut by the split
        assert u["straddling"] == (step["batch"][inside[0]][0] if inside else -1)
        straddled |= bool(inside)
    assert straddled
    assert all(s["ubatch"] is None for s in export_run(seeded_run(0, max_steps=3))["steps"])


def test_the_page_loads_nothing_from_the_network() -> None:
    html = render_page(worked_example_run())

    class Tags(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.fetching: list[tuple[str, list[tuple[str, str | None]]]] = []

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag in ("link", "img", "iframe", "object", "embed") or any(k in ("src", "href") for k, _ in attrs):
                self.fetching.append((tag, attrs))

    tags = Tags()
    tags.feed(html)
    assert tags.fetching == []
    assert "@import" not in html and "url(" not in html and "fetch(" not in html


def test_the_embedded_data_survives_any_request_name() -> None:
    """A req_id holding `</script>` must not end the data element early."""
    config = WorkerConfig(2, 16, 16, 50, (KVCacheGroup(4, 8),))
    name = "</script><script>alert(1)</script>"
    recorder = Recorder(config)
    sched = SchedulerOutput(new_requests=(NewRequest(name, (1, 2, 3), ((1,),)),), num_scheduled_tokens={name: 3})
    recorder.step(sched)
    recorder.sampled([7])
    run = recorder.run("a hostile name")
    html = render_page(run)
    assert html.count("</script>") == 2  # the data's and the page script's own
    assert _embedded(html) == export_run(run)


def test_a_200_request_page_stays_under_a_mebibyte(tmp_path: Path) -> None:
    size = write_page(seeded_run(0, requests=200), tmp_path / "run.html")
    assert size < 2**20


# ---- what changed, and the blocks ---------------------------------------------------------------


def test_first_live_entry_is_the_first_entry_the_next_query_reads() -> None:
    window = KVCacheGroup(block_size=4, num_blocks=16, sliding_window=8)
    # num_computed 12: the next query (position 12) reads keys 5..12, so entry 0 (positions 0..3) is released
    assert [window.first_live_entry(n) for n in (0, 8, 11, 12, 15, 16)] == [0, 0, 1, 1, 2, 2]
    assert KVCacheGroup(block_size=4, num_blocks=16).first_live_entry(40) == 0


def test_block_uses_name_held_shared_released_null_and_stale_blocks() -> None:
    group = KVCacheGroup(block_size=4, num_blocks=16, sliding_window=8)
    snapshot = (
        RowSnapshot(0, "a", tuple(range(13)), 12, ((5, 6, 7, 9),)),  # entry 0 released (live from 1)
        RowSnapshot(1, "b", tuple(range(8)), 4, ((0, 6, 10),)),  # a prefix hit: null, then 6 shared with a
        RowSnapshot(2, "c", tuple(range(4)), 0, ((11, 5),)),  # preempted: its table is stale
    )
    uses = block_uses(snapshot, 0, group, preempted={"c"})
    kinds = {block: use.kind for block, use in uses.items()}
    assert kinds == {5: "released", 6: "shared", 7: "held", 9: "held", 0: "null", 10: "held", 11: "stale"}
    assert uses[6].holders == [("a", 1), ("b", 1)]
    assert uses[5].released == [("a", 0)] and uses[5].stale == [("c", 1)]


def test_a_block_a_window_released_and_the_same_request_got_back_is_shown_reused() -> None:
    """vLLM's case (issue 18's minimal form): window 8, block size 4, 12 tokens in blocks 5, 6, 7; position 12
    is handed block 5 again, which its released entry 0 still lists."""
    config = WorkerConfig(2, 32, 16, 50, (KVCacheGroup(4, 8, sliding_window=8),))
    recorder = Recorder(config)
    new = NewRequest("r", tuple(range(12)), ((5, 6, 7),))
    prefill = SchedulerOutput(new_requests=(new,), num_scheduled_tokens={"r": 12})
    decode = SchedulerOutput(cached_requests=(CachedRequest("r", 12, ((5,),)),), num_scheduled_tokens={"r": 1})
    for sched in (prefill, decode):
        recorder.step(sched)
        recorder.sampled([9])
    data = export_run(recorder.run("reuse"))
    step = data["steps"][1]
    assert step["tokens"]["groups"][0]["slot"] == [5 * 4 + 0]  # position 12: logical block 3, now block 5 again
    assert step["rows"][0][6:] == [[[5, 6, 7, 5]], [1]]  # the table, and its one released entry
    assert step["kv"][0][0] == [5, "h", [0, 3], [0, 0]]  # held at entry 3, released at entry 0
    kinds = {kind for kind, _, _ in step["changes"]}
    assert {"window", "appended"} <= kinds


def test_changes_name_preemptions_resumptions_recycled_rows_and_drafts() -> None:
    seen: set[str] = set()
    for seed, spec_tokens in RUNS:
        data = export_run(seeded_run(seed, spec_tokens=spec_tokens))
        preempted_at: dict[int, int] = {}
        holders: dict[int, int] = {}  # row -> the request index that last held it
        for number, step in enumerate(data["steps"]):
            rows = {r: row for row, r, *_ in step["rows"]}
            for kind, r, text in step["changes"]:
                seen.add(kind)
                if kind == "preempted":
                    assert r in rows and all(b[0] != r for b in step["batch"]), text  # keeps its row, not scheduled
                    preempted_at[r] = number
                elif kind == "resumed":
                    assert preempted_at.pop(r) < number, text
                elif kind == "recycled":
                    assert holders[rows[r]] != r, text
                elif kind == "drafts":
                    k, accepted, rolled_back = map(int, re.findall(r"(\d+) drafts?, (\d+) accepted, (\d+)", text)[0])
                    assert accepted + rolled_back == k > 0
            holders.update({row: r for row, r, *_ in step["rows"]})
    assert {"added", "freed", "recycled", "appended", "window", "prefix", "preempted", "resumed", "drafts"} <= seen


def test_a_shadow_checker_run_replays_to_the_pools_the_scheduler_expected() -> None:
    config = WorkerConfig(4, 48, 40, 97, (KVCacheGroup(4, 22), KVCacheGroup(3, 30, sliding_window=7)))
    workload = make_workload(2, config, num_requests=8, max_arrival_step=6, max_new_tokens=10)
    sched = ReferenceScheduler(config, workload, SchedulerKnobs(max_chunk=9), seed=2)
    checker = ShadowChecker(config, write_repro=False)
    engine = spec.RequestStatePool(config)  # an "engine" whose arrays the checker compares
    expected = []
    while not sched.done():
        out = sched.schedule()
        engine.apply(out)
        batch = engine.prepare(out)
        arrays = {"positions": batch.positions, "input_ids": batch.input_ids, "slot_mapping": batch.slot_mappings[0]}
        checker.check(out, arrays, batch.req_ids)
        sampled = {r: 3 for r in sched.sampling_req_ids(out)}
        engine.record_sampled(batch, np.array([sampled.get(r, 0) for r in batch.req_ids], np.int64))
        checker.record_sampled(sampled)
        sched.update(out, sampled)
        expected.append(sched.expected_snapshot())
    run = shadow_run(checker.config, checker.steps)
    assert [step.after for step in run.steps] == expected


# ---- the command --------------------------------------------------------------------------------


def test_the_command_writes_a_page_that_opens_where_asked(tmp_path: Path) -> None:
    out = tmp_path / "page.html"
    result = CliRunner().invoke(app, ["explore", "--seed", "1", "--step", "3", "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = _embedded(out.read_text())
    assert data["start_step"] == 3 and len(data["steps"]) == len(seeded_run(1).steps)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--requests", "9"], "need --seed"),
        (["--seed", "0", "--step", "999"], "steps"),
        (["-o", "page.txt"], ".html"),
        (["--screenshot", "page.jpg"], ".png"),
        (["--graph-mode", "FULL"], "--graph-mode needs --graphs"),
        (["--graphs", "8,4"], "ascending"),
    ],
)
def test_misuse_ends_in_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["explore", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and message in result.output, result.output


# ---- in a browser -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        find_browser()
    except BrowserUnavailableError as e:
        if os.environ.get("SLOTMAP_REQUIRE_BROWSER"):
            pytest.fail(f"SLOTMAP_REQUIRE_BROWSER is set, but: {e}")
        pytest.skip(f"no headless browser here: {e}")
    with headless_chromium() as driver:
        yield driver


READ_HIGHLIGHTS = """
const all = (selector) => [...document.querySelectorAll(selector)];
return {
  step: document.getElementById("step-label").textContent,
  rows: all(".state-row.hl").map((e) => Number(e.dataset.row)),
  batch: all(".batch-row.hl").map((e) => Number(e.dataset.batch)),
  tokens: all(".token.hl").map((e) => Number(e.dataset.flat)),
  path: Object.fromEntries(
    all("#path [data-field]").map((e) => [e.dataset.field + (e.dataset.group ?? ""), e.textContent])),
  blocks: all("#kv .block.hl").map((e) => [Number(e.dataset.group), Number(e.dataset.block)]),
  entries: all(".entry.hl").map((e) => [Number(e.dataset.group), Number(e.dataset.logical), Number(e.textContent)]),
  slots: all(".slot.hl").map((e) => [Number(e.dataset.group), Number(e.textContent)]),
  written: all("#kv .block.written").map((e) => [Number(e.dataset.group), Number(e.dataset.block)]),
  focused: document.activeElement.dataset.flat ?? document.activeElement.id,
};
"""


# each token of arguments[0] clicked in turn, the highlights read after each click: one round trip per step
CLICK_EACH_AND_READ = (
    "const read = () => {" + READ_HIGHLIGHTS + "};\n"
    'return arguments[0].map((t) => { document.querySelector(`.token[data-flat="${t}"]`).click(); return read(); });'
)


def _open(driver: Any, run: Any, tmp_path: Path, name: str) -> None:
    page = tmp_path / f"{name}.html"
    write_page(run, page)
    driver.get(page.resolve().as_uri())


def _expected_path(batch: dict[str, Any], groups: tuple[KVCacheGroup, ...], t: int) -> dict[str, Any]:
    """What the page must highlight for flat token t, read from spec's arrays of the step."""
    qsl = batch["query_start_loc"]
    if t >= qsl[-1]:
        return {"padding": [(g, int(s[t])) for g, s in enumerate(batch["slot_mappings"])]}
    b = int(np.searchsorted(qsl, t, side="right")) - 1
    row, position = int(batch["index_mapping"][b]), int(batch["positions"][t])
    path: dict[str, Any] = {"req_state_idx": str(row), "batch_idx": str(b), "flat": str(t), "position": str(position)}
    blocks, entries, slots = [], [], []
    for g, group in enumerate(groups):
        logical, offset = divmod(position, group.block_size)
        physical, slot = int(batch["block_tables"][g][b, logical]), int(batch["slot_mappings"][g][t])
        assert physical * group.block_size + offset == slot  # the chain holds in spec's own arrays
        path |= {f"logical{g}": str(logical), f"offset{g}": str(offset), f"physical{g}": str(physical)}
        path |= {f"slot{g}": str(slot), f"formula{g}": f"{physical} * {group.block_size} + {offset} = {slot}"}
        blocks.append([g, physical])
        entries.append([g, logical, physical])
        slots.append([g, slot])
    return {"rows": [row], "batch": [b], "path": path, "blocks": blocks, "entries": entries, "slots": slots}


def _check_token(seen: dict[str, Any], expected: dict[str, Any], t: int) -> None:
    assert seen["tokens"] == [t]
    if "padding" in expected:
        assert seen["rows"] == seen["batch"] == seen["blocks"] == []
        assert seen["path"] == {"slot0": str(PAD_SLOT_ID)} and seen["slots"] == [[g, s] for g, s in expected["padding"]]
        return
    for key in ("rows", "batch", "blocks", "entries", "slots"):
        assert seen[key] == expected[key], (t, key)
    assert {k: v for k, v in seen["path"].items() if k != "input_id"} == expected["path"], t


def test_the_worked_example_opens_on_the_articles_token_and_slot_207(browser: Any, tmp_path: Path) -> None:
    _open(browser, worked_example_run(), tmp_path, "worked")
    seen = browser.execute_script(READ_HIGHLIGHTS)
    assert seen["step"] == "step 2 of 2"
    assert (seen["rows"], seen["batch"], seen["tokens"]) == ([7], [0], [0])
    assert seen["path"] == {
        "req_state_idx": "7", "batch_idx": "0", "flat": "0", "position": "31", "input_id": str(B_SAMPLED),
        "logical0": "1", "offset0": "15", "physical0": "12", "slot0": "207", "formula0": "12 * 16 + 15 = 207",
    }  # fmt: skip
    assert (seen["blocks"], seen["entries"], seen["slots"]) == ([[0, 12]], [[0, 1, 12]], [[0, 207]])
    assert sorted(seen["written"]) == [[0, 12], [0, 44]]
    label = browser.find_element("css selector", '.token[data-flat="0"]').get_attribute("aria-label")
    assert "position 31" in label and "slot 207" in label


def test_clicking_each_token_highlights_spec_path_on_every_step(browser: Any, tmp_path: Path) -> None:
    ex = worked_example()
    pool = spec.RequestStatePool(ex.config)
    batches = []
    for sched in (ex.step1, ex.step2):
        pool.apply(sched)
        batch = pool.prepare(sched)
        batches.append(SPEC.batch_to_numpy(batch))
        pool.record_sampled(batch, np.array(ex.sampled_after_step1(batch.req_ids)))
    _open(browser, worked_example_run(), tmp_path, "worked")
    browser.find_element("id", "step-prev").click()
    for number, batch in enumerate(batches, start=1):
        assert browser.execute_script(READ_HIGHLIGHTS)["step"] == f"step {number} of 2"
        tokens = list(range(int(batch["num_tokens_padded"])))
        if number == 2:  # the articles' step through WebDriver's own clicks; step 1's 71 tokens from the page
            seen_each = []
            for t in tokens:
                browser.find_element("css selector", f'.token[data-flat="{t}"]').click()
                seen_each.append(browser.execute_script(READ_HIGHLIGHTS))
        else:
            seen_each = browser.execute_script(CLICK_EACH_AND_READ, tokens)
        for t, seen in zip(tokens, seen_each, strict=True):
            _check_token(seen, _expected_path(batch, ex.config.kv_groups, t), t)
        browser.find_element("id", "step-next").click()


@pytest.mark.parametrize(("seed", "spec_tokens", "reuse"), [(*r, False) for r in RUNS] + [(1, 0, True)])
def test_a_seeded_run_stepped_through_shows_spec_arrays(
    browser: Any, tmp_path: Path, seed: int, spec_tokens: int, reuse: bool
) -> None:
    """With reuse (freed blocks first, as vLLM), explain has no such run: spec's batches as prepare returned them."""
    run = seeded_run(seed, spec_tokens=spec_tokens, reuse_freed_first=reuse)
    _open(browser, run, tmp_path, f"seed{seed}")
    groups = run.config.kv_groups
    reused = 0
    for number in range(1, len(run.steps) + 1):
        if reuse:
            batch = run.steps[number - 1].view.batch
        else:
            batch = seeded_step(SPEC, seed, number, spec_tokens=spec_tokens).batch
        num_tokens = int(batch["num_tokens_padded"])
        # every real token's block is marked as written this step
        written = {(g, int(batch["block_tables"][g][b, int(batch["positions"][t]) // group.block_size]))
                   for g, group in enumerate(groups) for b in range(len(batch["req_ids"]))
                   for t in range(int(batch["query_start_loc"][b]), int(batch["query_start_loc"][b + 1]))}  # fmt: skip
        seen = browser.execute_script(READ_HIGHLIGHTS)
        assert seen["step"] == f"step {number} of {len(run.steps)}"
        assert {tuple(w) for w in seen["written"]} == written
        for t, seen in enumerate(browser.execute_script(CLICK_EACH_AND_READ, list(range(num_tokens)))):
            _check_token(seen, _expected_path(batch, groups, t), t)
        reused += browser.execute_script("return document.querySelectorAll('#kv .block[aria-label*=reused]').length")
        browser.find_element("id", "step-next").click()
    assert browser.get_log("browser") == []  # no script error on any step
    if reuse:
        assert reused > 0  # a block a window released and handed out again says so


def test_the_page_is_usable_from_the_keyboard(browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.keys import Keys

    run = seeded_run(0)
    _open(browser, run, tmp_path, "keys")
    body = browser.find_element("tag name", "body")
    body.send_keys("n")
    body.send_keys("n")
    assert browser.execute_script(READ_HIGHLIGHTS)["step"] == f"step 3 of {len(run.steps)}"
    body.send_keys("p")
    assert browser.execute_script(READ_HIGHLIGHTS)["step"] == f"step 2 of {len(run.steps)}"
    # Tab order: prev, slider, next, then the token strip enters at the selected token (roving tabindex)
    tabbable = browser.execute_script(
        "return [...document.querySelectorAll('button, input, [tabindex]')].filter((e) => e.tabIndex >= 0)"
        ".map((e) => e.id || 'token ' + e.dataset.flat)"
    )
    assert tabbable == ["step-prev", "step-slider", "step-next", "token 0"]
    browser.find_element("css selector", '.token[data-flat="0"]').send_keys(Keys.ARROW_RIGHT)
    seen = browser.execute_script(READ_HIGHLIGHTS)
    assert seen["tokens"] == [1] and seen["focused"] == "1"
    batch = seeded_step(SPEC, 0, 2).batch
    last = int(batch["num_tokens_padded"]) - 1
    browser.switch_to.active_element.send_keys(Keys.END)
    _check_token(browser.execute_script(READ_HIGHLIGHTS), _expected_path(batch, run.config.kv_groups, last), last)
    browser.find_element("id", "step-slider").send_keys(Keys.ARROW_RIGHT)
    assert browser.execute_script(READ_HIGHLIGHTS)["step"] == f"step 3 of {len(run.steps)}"


def test_the_command_takes_a_screenshot_of_the_whole_page(browser: Any, tmp_path: Path) -> None:
    png = tmp_path / "page.png"
    result = CliRunner().invoke(app, ["explore", "-o", str(tmp_path / "page.html"), "--screenshot", str(png)])
    assert result.exit_code == 0, result.output
    from PIL import Image

    with Image.open(png) as image:
        width, height = image.size
    browser.get((tmp_path / "page.html").resolve().as_uri())
    page_height = browser.execute_script("return document.documentElement.scrollHeight")
    assert width == 1500 and height >= page_height  # the whole page, not the first screenful


def test_steps_without_tokens_show_an_empty_batch(browser: Any, tmp_path: Path) -> None:
    config = WorkerConfig(2, 16, 16, 50, (KVCacheGroup(4, 8),))
    recorder = Recorder(config)
    prefill = SchedulerOutput(new_requests=(NewRequest("a", (1, 2, 3), ((1,),)),), num_scheduled_tokens={"a": 3})
    for sched in (SchedulerOutput(), prefill, SchedulerOutput(finished_req_ids=frozenset({"a"}))):
        batch = recorder.step(sched)
        recorder.sampled([5] * batch.num_reqs)
    _open(browser, recorder.run("empty steps"), tmp_path, "empty")
    texts = []
    for _ in range(3):
        seen = browser.execute_script(READ_HIGHLIGHTS)
        texts.append((seen["tokens"], browser.find_element("id", "path").text))
        browser.find_element("id", "step-next").click()
    assert texts[0] == texts[2] == ([], "no tokens in this step")
    assert texts[1][0] == [0] and "slot 4" in texts[1][1]  # block 1, offset 0: slot 1 * 4 + 0
    assert browser.get_log("browser") == []


def test_padding_rows_tokens_and_the_split_are_drawn_apart_from_the_requests(browser: Any, tmp_path: Path) -> None:
    graphs = captured_graphs(worked_example().config, (16,), "FULL")
    _open(browser, worked_example_run(graphs, ubatch=True, mla=True), tmp_path, "padded")
    read = """
    const all = (s) => [...document.querySelectorAll(s)];
    return {
      padTokens: all(".token.pad").map((e) => Number(e.dataset.flat)),
      padSlots: all(".slot.pad").map((e) => Number(e.textContent)),
      padRows: all(".pad-row").map((e) => [...e.children].map((c) => c.textContent)),
      split: all(".token.ubatch-split").map((e) => Number(e.dataset.flat)),
      halves: all("#ubatch .half").map((e) => e.textContent),
      graph: document.getElementById("graph").textContent,
      mapping: document.getElementById("index-mapping").textContent,
      groups: document.getElementById("config").textContent,
    };"""
    seen = browser.execute_script(read)
    # the articles' step: 9 real tokens padded to the 16-token graph, 2 rows to min(16, 8) = 8
    assert seen["padTokens"] == list(range(9, 16)) and seen["padSlots"] == [PAD_SLOT_ID] * 7
    assert seen["padRows"] == [[str(b), "padding", "-1", "0", "[9, 9)", "0"] for b in range(2, 8)]
    assert seen["mapping"] == "index_mapping = [7, 6, -1, -1, -1, -1, -1, -1]"
    assert seen["graph"].startswith("captured graph: FULL, 16 tokens (9 real), 8 request rows (2 real)")
    assert seen["split"] == [8]  # 16 // 2
    assert seen["halves"] == [
        "ubatch 0: tokens [0, 8), rows [0, 2), query_start_loc [0, 1, 8]",
        "ubatch 1: tokens [8, 16), rows [1, 8), query_start_loc [0, 1, 1, 1, 1, 1, 1, 1]",
    ]
    assert "MLA latent 512 + rope 64 per slot" in seen["groups"]
    browser.find_element("css selector", '.token[data-flat="12"]').click()
    assert "is padding" in browser.find_element("id", "path").text
    assert browser.get_log("browser") == []
