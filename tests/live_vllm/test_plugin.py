"""The vllm.general_plugins entry point: installed with slotmap, idle unless SLOTMAP_SHADOW=1, and then it
shadows a model runner vLLM builds on its own (no attach call), from the runner's first step. (Model runner
v2 through the plugin, and a runner it cannot check: test_mrv2.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from shadow.vllm_attach.compat import let_vllm_scan_modules_beside_numba
from tests.live_vllm.engine import MODELS, generate


def test_the_entry_point_is_what_vllm_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.plugins import load_plugins_by_group
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from shadow.vllm_attach import plugin

    own = WorkerWrapperBase.init_device
    monkeypatch.setattr(WorkerWrapperBase, "init_device", own)  # restored after the test, whatever register does
    monkeypatch.delenv(plugin.ENV, raising=False)
    found = load_plugins_by_group("vllm.general_plugins")
    assert found.get("slotmap_shadow") is plugin.register
    plugin.register()
    assert WorkerWrapperBase.init_device is own  # off unless asked


def test_with_slotmap_shadow_set_every_step_of_a_plain_llm_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import LLM
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from shadow.vllm_attach import VllmShadow, model_runner_of, plugin

    monkeypatch.setattr(WorkerWrapperBase, "init_device", WorkerWrapperBase.init_device)
    monkeypatch.setenv(plugin.ENV, "1")
    monkeypatch.setenv("SLOTMAP_SHADOW_REPRO_DIR", str(tmp_path))
    plugin.register()  # what vLLM's load_general_plugins() does in each of its processes (once per process)
    let_vllm_scan_modules_beside_numba()
    llm = LLM(model=str(MODELS / "llama"), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", block_size=32, max_model_len=256, max_num_batched_tokens=64,
              num_gpu_blocks_override=32)  # fmt: skip
    try:
        outputs = generate(llm, [list(range(30, 130)), [3, 4, 5]], max_tokens=8)
        shadow = model_runner_of(llm)._slotmap_shadow
        assert isinstance(shadow, VllmShadow)  # the v1 runner (test_mrv2.py serves model runner v2)
        assert [len(o) for o in outputs] == [8, 8]
        assert shadow.checker.step_index == shadow.steps_checked >= 8 + 1  # 100 tokens at 64 a step: a chunk, then 8
        assert not shadow.records  # the plugin keeps none (a served engine runs indefinitely)
        assert shadow.checker.repro_dir == tmp_path
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_the_command_a_user_copies_reports_the_steps_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from shadow.vllm_attach.__main__ import main

    status = main(["--model", str(MODELS / "llama"), "--requests", "4", "--max-tokens", "6", "--blocks", "32",
                   "--max-model-len", "256"])  # fmt: skip
    assert status == 0
    out = capsys.readouterr().out
    assert "steps of vLLM's model runner agree with spec (4 requests; KV groups: block size 32)" in out
