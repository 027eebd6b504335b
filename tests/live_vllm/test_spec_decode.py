"""n-gram speculative decoding in vLLM with every step checked: drafts scheduled, some kept, some rejected."""

from __future__ import annotations

from pathlib import Path

from tests.live_vllm.engine import engine, features, generate

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_ngram_drafts_accepted_and_rejected_every_step_checked(tmp_path: Path) -> None:
    # prompts that repeat themselves give the n-gram proposer drafts; the random-weight model agrees with
    # some of them (its greedy output repeats too) and not with others
    prompts = [[7, 8, 9, 10, 11] * 8, [40, 41, 42] * 12 + [99, 40, 41], list(range(300, 340)) * 2, [5, 6] * 20]
    with engine("llama", tmp_path, speculative_config=NGRAM) as (llm, shadow, calls):
        outputs = generate(llm, prompts, max_tokens=40)
        f = features(shadow.records, num_groups=1)
        print(f"{shadow.steps_checked} steps checked; {f}")

    assert [len(o) for o in outputs] == [40] * len(prompts)
    assert calls["execute_model"] == shadow.steps_checked == len(shadow.records) == f.steps > 0
    assert f.drafts > 0 and f.accepted_drafts > 0 and f.rejected_drafts > 0, f
