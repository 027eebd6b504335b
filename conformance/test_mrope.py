"""M-RoPE positions (spec/mrope.py, docs/semantics.md "M-RoPE positions") pinned on any backend (`--backend NAME`).

The expected positions are worked out by hand from one table: a 10-token prompt of two text tokens, an
image of 1 x 2 x 3 grid tokens starting at position 2, and two text tokens continuing from 2 + 3 = 5:

    temporal  0 1 2 2 2 2 2 2 5 6
    height    0 1 2 2 2 3 3 3 5 6
    width     0 1 2 3 4 2 3 4 5 6      max 6, so delta = 6 + 1 - 10 = -3: position 10 -> 7, 11 -> 8, ...
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from conformance.backends import BackendHandle
from conformance.driving import step
from spec import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig
from spec.errors import InconsistentSchedulerOutputError

TABLE = (
    (0, 1, 2, 2, 2, 2, 2, 2, 5, 6),
    (0, 1, 2, 2, 2, 3, 3, 3, 5, 6),
    (0, 1, 2, 3, 4, 2, 3, 4, 5, 6),
)
DELTA = -3
PROMPT = tuple(range(100, 110))
CONFIG = WorkerConfig(4, 32, 64, 1000, (KVCacheGroup(4, 64),), uses_mrope=True)


def _image_request(req_id: str = "img", blocks: tuple[int, ...] = (1, 2, 3, 4), **changes: Any) -> NewRequest:
    fields: dict[str, Any] = {"mrope_positions": TABLE, "mrope_position_delta": DELTA, **changes}
    return NewRequest(req_id, PROMPT, (blocks,), **fields)


def _columns(batch: dict[str, Any], req_id: str) -> list[list[int]]:
    """The request's columns of the step's [3, T] M-RoPE positions, as three lists."""
    b = batch["req_ids"].index(req_id)
    start, end = batch["query_start_loc"][b], batch["query_start_loc"][b + 1]
    assert batch["mrope_positions"].dtype == np.int64
    return batch["mrope_positions"][:, start:end].tolist()


def _chunkings() -> list[list[int]]:
    rng = random.Random(0)
    drawn = []
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, 10), rng.randint(1, 5)))
        drawn.append([b - a for a, b in zip([0, *cuts], [*cuts, 10], strict=True)])
    return [[10], [1] * 10, [3, 3, 4], [2, 6, 2], [7, 3], [1, 8, 1], *drawn]


@pytest.mark.parametrize("chunks", _chunkings(), ids=lambda c: "+".join(map(str, c)))
def test_prompt_positions_are_the_table_under_every_chunking(backend: BackendHandle, chunks: list[int]) -> None:
    """Each chunk reads the table at its own positions and stops at its end; the delta never changes."""
    pool = backend.make_pool(CONFIG)
    seen: list[list[int]] = [[], [], []]
    done = 0
    for i, n in enumerate(chunks):
        if i == 0:
            out = SchedulerOutput(new_requests=(_image_request(),), num_scheduled_tokens={"img": n})
        else:
            out = SchedulerOutput(cached_requests=(CachedRequest("img", done),), num_scheduled_tokens={"img": n})
        batch = step(backend, pool, out, pad_to=n + 3)
        assert batch["mrope_positions"].shape == (3, n + 3)
        assert batch["mrope_positions"][:, n:].tolist() == [[0] * 3] * 3  # padding columns are 0
        for row, got in zip(seen, _columns(batch, "img"), strict=True):
            row.extend(got)
        done += n
    for p in (10, 11):  # two decode steps past the prompt: p + delta on all three rows
        out = SchedulerOutput(cached_requests=(CachedRequest("img", p),), num_scheduled_tokens={"img": 1})
        for row, got in zip(seen, _columns(step(backend, pool, out), "img"), strict=True):
            row.extend(got)
    assert seen == [[*t, 7, 8] for t in TABLE]


def test_decode_rows_beside_prefill_rows_get_their_mrope_positions(backend: BackendHandle) -> None:
    """A mixed batch: the multimodal decode row reads p + delta, the text decode row p, the prefill its table."""
    pool = backend.make_pool(CONFIG)
    first = SchedulerOutput(
        new_requests=(_image_request(), NewRequest("txt", (5, 6, 7), ((5,),))),
        num_scheduled_tokens={"img": 10, "txt": 3},
    )
    step(backend, pool, first)
    mixed = SchedulerOutput(
        new_requests=(_image_request("img2", (6, 7, 8)),),
        cached_requests=(CachedRequest("img", 10), CachedRequest("txt", 3)),
        num_scheduled_tokens={"img2": 6, "img": 1, "txt": 1},
    )
    batch = step(backend, pool, mixed)
    assert _columns(batch, "img") == [[7], [7], [7]]  # position 10 + delta -3
    assert _columns(batch, "txt") == [[3], [3], [3]]  # a text request: its plain position on every row
    assert _columns(batch, "img2") == [list(t[:6]) for t in TABLE]


def test_drafts_and_a_resumed_request_read_their_rows_table(backend: BackendHandle) -> None:
    """Drafts lie past the prompt (p + delta); a request back from preemption recomputes from its row's table."""
    pool = backend.make_pool(CONFIG)
    step(backend, pool, SchedulerOutput(new_requests=(_image_request(),), num_scheduled_tokens={"img": 10}))
    drafting = SchedulerOutput(
        cached_requests=(CachedRequest("img", 10),),
        num_scheduled_tokens={"img": 3},
        scheduled_spec_decode_tokens={"img": (40, 41)},
    )
    batch = step(backend, pool, drafting, sampled={"img": [40, 9]})  # positions 10, 11, 12; one draft kept
    assert _columns(batch, "img") == [[7, 8, 9]] * 3
    resumed = SchedulerOutput(
        cached_requests=(CachedRequest("img", 0, ((9, 10, 11, 12),), resumed=True),),
        num_scheduled_tokens={"img": 12},  # the prompt and the two kept tokens, recomputed
    )
    batch = step(backend, pool, resumed)
    assert _columns(batch, "img") == [[*t, 7, 8] for t in TABLE]


def test_a_model_without_mrope_has_no_mrope_positions(backend: BackendHandle) -> None:
    config = WorkerConfig(2, 16, 16, 100, (KVCacheGroup(4, 16),))
    pool = backend.make_pool(config)
    batch = step(
        backend, pool, SchedulerOutput(new_requests=(NewRequest("a", (1, 2), ((1,),)),), num_scheduled_tokens={"a": 2})
    )
    assert batch["mrope_positions"] is None


def _bad_inputs() -> dict[str, tuple[WorkerConfig, dict[str, Any], str]]:
    plain = WorkerConfig(4, 32, 64, 1000, (KVCacheGroup(4, 64),))
    short = tuple(t[:9] for t in TABLE)
    return {
        "table shorter than the prompt": (CONFIG, {"mrope_positions": short}, "mrope_positions"),
        "table longer than the prompt": (CONFIG, {"mrope_positions": tuple((*t, 7) for t in TABLE)}, "mrope_positions"),
        "two rows": (CONFIG, {"mrope_positions": TABLE[:2]}, "mrope_positions"),
        "float table": (CONFIG, {"mrope_positions": np.array(TABLE, np.float64)}, "mrope_positions"),
        "rows of unequal length": (CONFIG, {"mrope_positions": (TABLE[0], TABLE[1], short[2])}, "mrope_positions"),
        "a flat table": (CONFIG, {"mrope_positions": np.array(TABLE[0])}, "mrope_positions"),
        "float delta": (CONFIG, {"mrope_position_delta": -3.0}, "mrope_position_delta"),
        "bool delta": (CONFIG, {"mrope_position_delta": True}, "mrope_position_delta"),
        "delta past 2**62": (CONFIG, {"mrope_position_delta": 2**62}, "mrope_position_delta"),
        "delta without a table": (CONFIG, {"mrope_positions": None, "mrope_position_delta": 2}, "mrope_position_delta"),
        "table on a model without M-RoPE": (plain, {}, "mrope_positions"),
        "delta on a model without M-RoPE": (plain, {"mrope_positions": None}, "mrope_position_delta"),
    }


@pytest.mark.parametrize("name", sorted(_bad_inputs()))
def test_bad_mrope_inputs_are_refused_and_change_nothing(backend: BackendHandle, name: str) -> None:
    config, changes, field = _bad_inputs()[name]
    pool = backend.make_pool(config)
    text = SchedulerOutput(new_requests=(NewRequest("t", (1, 2, 3), ((9,),)),), num_scheduled_tokens={"t": 2})
    step(backend, pool, text)
    before = pool.snapshot()
    bad = SchedulerOutput(
        new_requests=(_image_request(**changes),),
        cached_requests=(CachedRequest("t", 2),),
        num_scheduled_tokens={"img": 10, "t": 1},
    )
    with pytest.raises(InconsistentSchedulerOutputError) as raised:
        pool.apply(bad)
    assert (raised.value.req_id, raised.value.field) == ("img", field)
    assert pool.snapshot() == before
    after = step(
        backend, pool, SchedulerOutput(cached_requests=(CachedRequest("t", 2),), num_scheduled_tokens={"t": 1})
    )
    assert after["positions"].tolist() == [2]


def test_tables_of_every_accepted_form_give_the_same_positions(backend: BackendHandle) -> None:
    """A tuple or list of three id sequences, or a 2-D integer array of any integer dtype (the input policy)."""
    forms = [TABLE, [list(t) for t in TABLE], np.array(TABLE, np.int32), np.array(TABLE, np.uint16)]
    for form in forms:
        pool = backend.make_pool(CONFIG)
        new = _image_request(mrope_positions=form, mrope_position_delta=np.int64(DELTA))
        step(backend, pool, SchedulerOutput(new_requests=(new,), num_scheduled_tokens={"img": 10}))
        out = SchedulerOutput(cached_requests=(CachedRequest("img", 10),), num_scheduled_tokens={"img": 1})
        assert _columns(step(backend, pool, out), "img") == [[7], [7], [7]]
