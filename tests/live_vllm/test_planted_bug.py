"""A bug planted inside vLLM at run time (one slot shifted after vLLM computed its slot mapping) is named by
the shadow checker: its step, its request, its field, and a reproduction script that fails the same way."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest

from shadow.checker import ShadowMismatchError
from tests.live_vllm.engine import engine, generate


def test_a_shifted_slot_inside_vllm_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.worker.block_table import BlockTable

    original = BlockTable.compute_slot_mapping
    planted: dict[str, Any] = {}
    with engine("llama", tmp_path) as (llm, shadow, _calls):

        def shifted(self: Any, num_reqs: int, query_start_loc: Any, positions: Any) -> None:
            original(self, num_reqs, query_start_loc, positions)
            if not planted and shadow.steps_checked >= 4 and num_reqs >= 2:
                token = int(query_start_loc[num_reqs - 1])  # the last batch row's first token
                self.slot_mapping.gpu[token] += 1
                planted.update(step=shadow.steps_checked, req_id=shadow.runner.input_batch.req_ids[num_reqs - 1])

        monkeypatch.setattr(BlockTable, "compute_slot_mapping", shifted)
        with pytest.raises(ShadowMismatchError) as caught:
            generate(llm, [list(range(50, 50 + n)) for n in (30, 80, 5)], max_tokens=12)

    error = caught.value
    assert planted, "the bug was never planted"
    assert (error.step, error.req_id, error.field) == (planted["step"], planted["req_id"], "slot_mapping[0]")
    assert error.repro_path is not None and error.repro_path.exists()
    with pytest.raises(ShadowMismatchError) as replayed:
        runpy.run_path(str(error.repro_path))
    assert (replayed.value.step, replayed.value.req_id, replayed.value.field) == (error.step, error.req_id, error.field)


def test_a_shifted_draft_index_inside_vllm_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler's fields are checked too: one draft's target_logits_indices moved inside vLLM."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from tests.live_vllm.test_spec_decode import NGRAM

    original = GPUModelRunner._calc_spec_decode_metadata
    planted: dict[str, Any] = {}
    with engine("llama", tmp_path, speculative_config=NGRAM) as (llm, shadow, _calls):

        def shifted(self: Any, num_draft_tokens: Any, cu_num_scheduled_tokens: Any) -> Any:
            meta = original(self, num_draft_tokens, cu_num_scheduled_tokens)
            if not planted and shadow.steps_checked >= 2 and int(num_draft_tokens.sum()) > 0:
                row = int((num_draft_tokens > 0).argmax())  # the first batch row with drafts: its first draft
                meta.target_logits_indices[int(num_draft_tokens[:row].sum())] += 1
                planted.update(step=shadow.steps_checked, req_id=self.input_batch.req_ids[row])
            return meta

        monkeypatch.setattr(GPUModelRunner, "_calc_spec_decode_metadata", shifted)
        with pytest.raises(ShadowMismatchError) as caught:
            generate(llm, [[7, 8, 9, 10, 11] * 8, [5, 6] * 20], max_tokens=24)

    error = caught.value
    assert planted, "the bug was never planted"
    assert (error.step, error.req_id, error.field) == (planted["step"], planted["req_id"], "target_logits_indices")
