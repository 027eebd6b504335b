"""The shadow checker on padded steps (shadow/compare_padding.py): vLLM-shaped padded inputs, written by hand.

Each step is laid out as vLLM's runner pads it for a FULL graph (gpu_model_runner `_build_attention_metadata`;
FlashMLA's seq_lens clamp, vLLM PR #35969): the real requests in the engine's order, then the padded request
rows. The expectations are derived in the comments from spec/graphs.py's and spec/padding.py's rules, not read off
spec; each planted padding bug must be reported with its step, the batch (a padded row has no request) and field.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shadow.checker import ShadowChecker, ShadowMismatchError
from spec.graphs import BatchDescriptor, CapturedGraphs
from spec.padding_profiles import FLASHMLA
from spec.types import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIG = WorkerConfig(4, 32, 64, 100, (KVCacheGroup(4, 20),))  # tables 32 / 4 = 8 wide
# 5 tokens dispatch to the 8-token graph; mode FULL captures mixed graphs of min(8, max_num_reqs=4) = 4 rows
GRAPHS = CapturedGraphs((4, 8), max_num_reqs=4, mode="FULL", profile=FLASHMLA)
STEP = SchedulerOutput(
    new_requests=(NewRequest("a", (11, 12, 13), ((1,),)), NewRequest("b", (21, 22), ((2,),))),
    num_scheduled_tokens={"a": 3, "b": 2},
)


def _engine_arrays() -> dict[str, np.ndarray]:
    """vLLM's inputs, its order a, b; rows 2 and 3 are the graph's padded request rows."""
    table = np.zeros((4, 8), np.int32)
    table[0, 0], table[1, 0] = 1, 2
    return {
        "query_start_loc": np.array([0, 3, 5, 5, 5], np.int32),  # padded rows repeat the real count, 5
        "seq_lens": np.array([3, 2, 1, 1], np.int32),  # FlashMLA's padded rows: 1
        "positions": np.array([0, 1, 2, 0, 1, 0, 0, 0], np.int64),
        "input_ids": np.array([11, 12, 13, 21, 22, 0, 0, 0], np.int64),
        "slot_mapping": np.array([4, 5, 6, 8, 9, -1, -1, -1], np.int64),  # block 1 -> 4.., block 2 -> 8..
        "block_table": table,
    }


DESCRIPTOR = BatchDescriptor("FULL", 8, 4, False, 3)  # longest query: a's 3 tokens


def _check(arrays: dict[str, Any], descriptor: BatchDescriptor = DESCRIPTOR, **options: Any) -> ShadowChecker:
    checker = ShadowChecker(CONFIG, **options)
    checker.check(STEP, arrays, ("a", "b"), graphs=GRAPHS, descriptor=descriptor)
    return checker


def test_vllm_shaped_padded_inputs_agree() -> None:
    checker = _check(_engine_arrays(), write_repro=False)
    assert checker.reports == []
    checker.record_sampled({"a": 5, "b": 6})  # the padded batch records one token per real request


def _stale_block_row(a: dict[str, np.ndarray]) -> None:
    a["block_table"][3, 2] = 7  # a larger earlier batch's row left in the reused buffer


def _stale_pad_slot(a: dict[str, np.ndarray]) -> None:
    a["slot_mapping"][6] = 13  # an earlier, larger step's slot past the real tokens


def _zero_seq_lens(a: dict[str, np.ndarray]) -> None:
    a["seq_lens"][2:] = 0  # FlashAttention's pad value under FlashMLA


def _zero_query_start_loc(a: dict[str, np.ndarray]) -> None:
    a["query_start_loc"][3:] = 0  # padded rows' offsets left at 0: query_start_loc decreases


@pytest.mark.parametrize(
    ("plant", "field", "detail"),
    [
        (_zero_seq_lens, "seq_lens", "rows 2..3 padded"),
        (_zero_query_start_loc, "query_start_loc", "rows 2..3 padded"),
        (_stale_block_row, "block_table", "padded row 3: entry 2 holds block 7"),
        (_stale_pad_slot, "slot_mapping", "padding token 6 has slot 13"),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_each_planted_padding_bug_is_reported_with_step_and_field(plant: Any, field: str, detail: str,
                                                                   tmp_path: Path) -> None:  # fmt: skip
    arrays = _engine_arrays()
    plant(arrays)
    with pytest.raises(ShadowMismatchError) as caught:
        _check(arrays, repro_dir=tmp_path)
    report = caught.value
    assert (report.step, report.req_id, report.field) == (0, None, field)
    assert detail in report.detail and str(report).startswith(f"step 0: batch: {field}: ")
    assert report.repro_path is not None  # the script replays the padded step and raises the same report
    done = subprocess.run([sys.executable, str(report.repro_path)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode != 0 and f"step 0: batch: {field}: " in done.stderr


def test_a_descriptor_chosen_by_shape_is_reported() -> None:
    """V1's shape test: a 1-token prompt chunk (K = 0) looks like a uniform decode. By progress it is a prefill
    (3 of 4 prompt tokens computed), so under FULL_AND_PIECEWISE spec runs it on the 1-token PIECEWISE graph."""
    graphs = CapturedGraphs((1, 2), max_num_reqs=2, mode="FULL_AND_PIECEWISE")
    checker = ShadowChecker(CONFIG, write_repro=False)
    first = SchedulerOutput(new_requests=(NewRequest("a", (1, 2, 3, 4), ((1,),)),), num_scheduled_tokens={"a": 3})
    table = np.zeros((1, 8), np.int32)
    table[0, 0] = 1
    checker.check(first, {"query_start_loc": np.array([0, 3]), "slot_mapping": np.array([4, 5, 6]),
                          "block_table": table}, ("a",))  # fmt: skip
    checker.record_sampled({"a": 9})  # mid-prefill: discarded
    chunk = SchedulerOutput(cached_requests=(CachedRequest("a", 3),), num_scheduled_tokens={"a": 1})  # its last
    arrays = {"query_start_loc": np.array([0, 1]), "seq_lens": np.array([4]), "slot_mapping": np.array([7]),
              "block_table": table}  # fmt: skip
    by_shape = BatchDescriptor("FULL", 1, 1, True, 1)  # FULL_AND_PIECEWISE's uniform-decode graph: 1 // 1 rows
    with pytest.raises(ShadowMismatchError) as caught:
        checker.check(chunk, arrays, ("a",), graphs=graphs, descriptor=by_shape)
    report = caught.value
    assert (report.step, report.req_id, report.field) == (1, None, "descriptor")
    assert "mode 'FULL', spec 'PIECEWISE'" in report.detail


def test_a_descriptor_needs_its_graphs() -> None:
    checker = ShadowChecker(CONFIG, write_repro=False)
    with pytest.raises(ValueError, match="descriptor"):
        checker.check(STEP, _engine_arrays(), ("a", "b"), descriptor=DESCRIPTOR)
    with pytest.raises(ValueError, match="graphs"):
        checker.check(STEP, _engine_arrays(), ("a", "b"), graphs=(4, 8))  # type: ignore[arg-type]
    assert checker.steps == []  # nothing kept: the step can be sent again
    checker.check(STEP, _engine_arrays(), ("a", "b"), graphs=GRAPHS, descriptor=DESCRIPTOR)
