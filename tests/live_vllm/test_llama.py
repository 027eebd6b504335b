"""A tiny Llama in vLLM with every step checked: chunked prefill, prefix-cache hits, preemption and resumption."""

from __future__ import annotations

from pathlib import Path

from tests.live_vllm.engine import engine, features, generate

PREFIX = list(range(10, 10 + 64))  # two full blocks of 32: what a later request can find cached


def test_chunked_prefill_prefix_hits_preemption_every_step_checked(tmp_path: Path) -> None:
    # 14 blocks of 32 tokens for 8 requests of up to 200 tokens: the scheduler must preempt and resume;
    # 64 tokens a step: prompts of 100..170 tokens arrive in chunks
    with engine("llama", tmp_path, num_gpu_blocks_override=14, max_model_len=320) as (llm, shadow, calls):
        tails = (40, 100, 7, 70, 30, 90, 3, 55)
        prompts = [PREFIX + list(range(200 + 13 * i, 200 + 13 * i + n)) for i, n in enumerate(tails)]
        outputs = generate(llm, prompts, max_tokens=48)
        f = features(shadow.records, num_groups=1)
        print(f"{shadow.steps_checked} steps checked; {f}")

    assert [len(o) for o in outputs] == [48] * len(prompts)
    assert calls["execute_model"] == shadow.steps_checked == len(shadow.records) == f.steps > 0
    assert f.partial_prefills > 0, f
    assert f.prefix_hits > 0, f
    assert f.preemptions > 0 and f.resumptions > 0, f
    assert f.window_reuses == 0, f  # full attention: no block comes back while a live table names it
