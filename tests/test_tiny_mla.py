"""The tiny MLA decoder (slotmap/tiny/mla.py): its greedy output through the paged pipeline (write_mla_kv into the
latent cache, the batch split by split_mla_batch, the absorbed form on decodes and the prefill form on the
rest) equals its dense form (every head's keys and values up-projected from the whole sequence's latents, no
cache) token for token, the dense form in float64. spec runs the paged model in float64, fast in float32.

The schedules hold chunked prefills, prefix hits (a request reading latents another request wrote), drafts
(verify rows of 1 + K tokens, decodes under threshold 1 + K) and preemptions; the control shows the comparison
fails when the latent and RoPE parts of the cache entry are swapped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from conformance.backends import BackendHandle, load_backend
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload
from slotmap.tiny.mla import MlaModelConfig, TinyMlaDecoder
from slotmap.tiny.mla_engine import generate_paged
from spec.types import KVCacheGroup, WorkerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py

MODEL = MlaModelConfig()
GROUP = KVCacheGroup(4, 16, kind="mla", kv_lora_rank=MODEL.kv_lora_rank, qk_rope_head_dim=MODEL.qk_rope_head_dim)
CONFIG = WorkerConfig(4, 40, 24, MODEL.vocab_size, (GROUP,))  # 15 real blocks: the longest requests preempt
VARIANTS = {
    "plain": (SchedulerKnobs(max_chunk=6), MODEL),
    # verify rows of 1 + 2 tokens: decodes under threshold 3 (the absorbed form over several queries)
    "drafts": (SchedulerKnobs(max_chunk=6, spec_tokens=2), dataclasses.replace(MODEL, decode_threshold=3)),
    # vLLM 0.32's default: prompt chunks of <= 4 tokens (a prompt's tail, a short prompt) taken for decodes too
    "short-extends": (SchedulerKnobs(max_chunk=6),
                      dataclasses.replace(MODEL, decode_threshold=4, treat_short_extends_as_decodes=True)),
}  # fmt: skip
WORKLOAD = make_workload(3, CONFIG, num_requests=5, max_arrival_step=3, num_prefixes=1, shared_prefix_prob=0.8,
                         max_new_tokens=8, stop_token_prob=0.0)  # fmt: skip


class _Counting:
    """A backend module whose MLA attention calls are counted per form (and whose write may be replaced)."""

    def __init__(self, module: Any, write: Callable[..., None] | None = None) -> None:
        self._module, self._write = module, write
        self.calls = {"mla_decode_attention": 0, "mla_prefill_attention": 0}

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._module, name)
        if name in self.calls:

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls[name] += 1
                return found(*args, **kwargs)

            return counted
        if name == "write_mla_kv" and self._write is not None:
            return self._write
        return found


def _mismatches(model: TinyMlaDecoder, tokens: dict[str, list[int]]) -> list[str]:
    """The requests whose paged tokens are not the dense form's greedy continuation of their prompt."""
    wrong = []
    for request in WORKLOAD.requests:
        sequence, prompt_len = tokens[request.req_id], len(request.prompt_token_ids)
        assert len(sequence) > prompt_len, request.req_id
        if model.generate_dense(sequence[:prompt_len], len(sequence) - prompt_len) != sequence:
            wrong.append(request.req_id)
    return wrong


def _run(backend: BackendHandle, variant: str, write: Callable[..., None] | None = None) -> tuple[Any, ...]:
    knobs, model_config = VARIANTS[variant]
    module = _Counting(backend.module, write)
    handle = dataclasses.replace(backend, module=module)  # type: ignore[arg-type]
    model = TinyMlaDecoder(model_config, CONFIG.kv_groups)
    scheduler = ReferenceScheduler(CONFIG, WORKLOAD, knobs, seed=1)
    dtype = torch.float64 if backend.name == "spec" else torch.float32  # fast's MLA kernels stop at float32
    tokens = generate_paged(handle, CONFIG, model, scheduler, dtype)
    return model, tokens, scheduler.stats, module.calls


@pytest.mark.not_on_backends("fast-interpret", reason="interpreter: tests/test_mla.py runs the write kernel")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_paged_mla_generation_equals_the_dense_form(backend: BackendHandle, variant: str) -> None:
    model, tokens, stats, calls = _run(backend, variant)
    assert len(tokens) == 5 and stats.prefix_hit_tokens > 0 and stats.preemptions > 0
    assert calls["mla_decode_attention"] > 0 and calls["mla_prefill_attention"] > 0
    if variant == "drafts":
        assert stats.drafts_scheduled > 0
    assert _mismatches(model, tokens) == []


def test_swapped_latent_and_rope_parts_break_generation() -> None:
    """Control: a write that stores [k_pe, kv_c] instead of [kv_c, k_pe] (each entry rotated) changes the tokens."""
    spec_backend = load_backend("spec")

    def swapped(cache: np.ndarray, kv_c: np.ndarray, k_pe: np.ndarray, slots: np.ndarray, **kw: Any) -> None:
        whole = np.concatenate([k_pe, kv_c], axis=1)
        spec_backend.module.write_mla_kv(cache, whole[:, : kv_c.shape[1]], whole[:, kv_c.shape[1] :], slots, **kw)

    model, tokens, _, _ = _run(spec_backend, "plain", swapped)
    assert _mismatches(model, tokens)
