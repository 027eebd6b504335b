"""A tiny Gemma-2 (a sliding-window layer and a full-attention layer: two KV cache groups) in vLLM, every step
checked, while the window releases blocks that vLLM's allocator hands out again, to the same request too."""

from __future__ import annotations

from pathlib import Path

from tests.live_vllm.engine import engine, features, generate


def test_two_kv_groups_window_releases_every_step_checked(tmp_path: Path) -> None:
    with engine("gemma2", tmp_path, num_gpu_blocks_override=24, max_model_len=320) as (llm, shadow, calls):
        assert [g.sliding_window for g in shadow.config.kv_groups] == [64, None]
        prompts = [list(range(20 + i, 20 + i + n)) for i, n in enumerate((150, 40, 90))]
        outputs = generate(llm, prompts, max_tokens=100)
        f = features(shadow.records, num_groups=2)
        print(f"{shadow.steps_checked} steps checked; {f}")

    assert [len(o) for o in outputs] == [100] * len(prompts)
    assert calls["execute_model"] == shadow.steps_checked == len(shadow.records) == f.steps > 0
    assert f.window_reuses > 0 and f.window_reuses_same_request > 0, f
    assert f.partial_prefills > 0, f
