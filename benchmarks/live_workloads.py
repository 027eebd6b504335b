"""The live workloads the benchmarks beside vLLM serve (test_vllm_prep.py, mrv2_prep.py): token-id prompts and
engine arguments only. Importing this sets nothing and imports nothing from vLLM."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELS = Path(__file__).resolve().parent.parent / "tests" / "live_vllm" / "models"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PREFIX = tuple(range(88, 88 + 96))  # three blocks of 32 every prompt of `prefix` starts with


@dataclass(frozen=True)
class LiveWorkload:
    name: str
    model: str  # a folder of MODELS
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    engine: dict[str, Any]  # vLLM engine arguments beyond the common ones


def prompts(seed: int, n: int, lo: int, hi: int, prefix: tuple[int, ...] = (), repeat: bool = False) -> tuple:
    """n prompts of lo..hi tokens after `prefix`; with `repeat`, short patterns repeated (n-gram lookups hit)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        if repeat:
            pattern = [rng.randrange(3, 500) for _ in range(rng.randint(2, 6))]
            body = (pattern * (length // len(pattern) + 1))[:length]
        else:
            body = [rng.randrange(3, 500) for _ in range(length)]
        out.append(prefix + tuple(body))
    return tuple(out)


def five_workloads(num_prompts: int, max_tokens: int, preemption_blocks: int) -> tuple[LiveWorkload, ...]:
    """plain, prefix (shared prefix: cache hits), preemption (few blocks), hybrid (two KV groups), drafts (n-gram)."""
    return (
        LiveWorkload("plain", "llama", prompts(0, num_prompts, 16, 200), max_tokens, {}),
        LiveWorkload("prefix", "llama", prompts(1, num_prompts, 16, 120, prefix=PREFIX), max_tokens, {}),
        LiveWorkload("preemption", "llama", prompts(2, num_prompts, 16, 200), max_tokens,
                     {"num_gpu_blocks_override": preemption_blocks}),
        LiveWorkload("hybrid", "gemma2", prompts(3, num_prompts, 16, 200), max_tokens, {}),
        LiveWorkload("drafts", "llama", prompts(4, num_prompts, 16, 120, repeat=True), max_tokens,
                     {"speculative_config": NGRAM}),
    )  # fmt: skip
