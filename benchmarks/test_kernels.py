"""Device stages: write_kv, paged_attention (vs dense SDPA), and a whole layer step.

The step's batch comes from spec (benchmarks.reference). For write_kv and attention its block ids are
renumbered densely (same scatter, fewer blocks) so the KV cache holds only what the step touches.
Shapes: on CPU 8 query heads, 2 KV heads, head_dim 64, float32; on CUDA 32 / 8 / 128, bfloat16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks import providers
from benchmarks.baselines.dense_sdpa import contiguous_kv, dense_attention
from benchmarks.harness import param, record, run_plain, run_stateful
from benchmarks.providers import Provider
from benchmarks.reference import reference, started
from benchmarks.workloads import KERNEL_WORKLOADS, LAYER_WORKLOADS, StepStream, Workload, cpu_trim_reason


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def scale(self) -> float:
        return float(self.head_dim**-0.5)


def shape_for(device: str) -> Shape:
    return Shape(32, 8, 128, torch.bfloat16) if device == "cuda" else Shape(8, 2, 64, torch.float32)


@dataclass(frozen=True)
class KernelInputs:
    """One step's kernel inputs as tensors on the provider's device (NumPy views of the CPU ones feed spec)."""

    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    key: torch.Tensor  # [T, num_kv_heads, head_dim], this step's new keys
    value: torch.Tensor  # [T, num_kv_heads, head_dim]
    query: torch.Tensor  # [T, num_heads, head_dim]
    slot_mapping: np.ndarray  # [T] int64
    block_table: np.ndarray  # [num_reqs, max_blocks] int32, batch_idx -> physical block ids
    seq_lens: np.ndarray  # [num_reqs] int32
    query_start_loc: np.ndarray  # [num_reqs + 1] int32


@functools.lru_cache(maxsize=1)
def kernel_inputs(workload: Workload, device_kind: str) -> KernelInputs:
    _, _, batch = reference(workload)
    shape, block_size = shape_for(device_kind), reference(workload)[0].config.kv_groups[0].block_size
    table = np.asarray(batch.block_tables[0])
    used = np.unique(table[table != 0])
    dense = np.zeros(int(table.max()) + 1, np.int64)  # old block id -> dense id, scatter order kept
    dense[used] = np.arange(1, used.size + 1)
    slots = np.asarray(batch.slot_mappings[0])
    num_tokens = slots.shape[0]
    gen = torch.Generator(device_kind).manual_seed(0)  # drawn where they are used: caches reach gigabytes on GPU

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=device_kind, dtype=shape.dtype)

    cache_shape = (used.size + 1, block_size, shape.num_kv_heads, shape.head_dim)
    token_kv = (num_tokens, shape.num_kv_heads, shape.head_dim)
    return KernelInputs(
        key_cache=randn(*cache_shape),
        value_cache=randn(*cache_shape),
        key=randn(*token_kv),
        value=randn(*token_kv),
        query=randn(num_tokens, shape.num_heads, shape.head_dim),
        slot_mapping=dense[slots // block_size] * block_size + slots % block_size,
        block_table=dense[table].astype(np.int32),
        seq_lens=np.asarray(batch.seq_lens),
        query_start_loc=np.asarray(batch.query_start_loc),
    )


def _native(provider: Provider, t: torch.Tensor) -> Any:
    return t.numpy() if provider.is_numpy else t.to(provider.device)


def _skip_if_trimmed(workload: Workload, provider: Provider, stage: str) -> None:
    if provider.device != "cuda":
        reason = cpu_trim_reason(workload, provider.name, stage)
        if reason:
            pytest.skip(reason)


def _attention_work(query_start_loc: np.ndarray, seq_lens: np.ndarray, shape: Shape) -> tuple[int, int]:
    """(bytes, flops): K and V read once per request, q and out; 4 flops per (query, visible key, dim, head)."""
    q_lens = np.diff(query_start_loc).astype(np.int64)
    seq = seq_lens.astype(np.int64)
    visible = int((q_lens * seq - q_lens * (q_lens - 1) // 2).sum())  # causal: query i of n sees seq - n + i + 1
    item = torch.finfo(shape.dtype).bits // 8
    nbytes = 2 * int(seq.sum()) * shape.num_kv_heads * shape.head_dim * item
    nbytes += 2 * int(q_lens.sum()) * shape.num_heads * shape.head_dim * item
    return nbytes, 4 * visible * shape.num_heads * shape.head_dim


@pytest.mark.parametrize(
    ("workload", "provider_name"), [param(w, p) for w in KERNEL_WORKLOADS for p in providers.KERNEL_PROVIDERS]
)
def test_write_kv(benchmark: Any, bench_budget: float, workload: Workload, provider_name: str) -> None:
    provider = providers.get(provider_name)
    _skip_if_trimmed(workload, provider, "write_kv")
    inputs = kernel_inputs(workload, provider.device if provider.device == "cuda" else "cpu")
    write_kv = provider.module.write_kv
    args = [_native(provider, t) for t in (inputs.key_cache, inputs.value_cache, inputs.key, inputs.value)]
    args.append(provider.asarray(inputs.slot_mapping))

    def target() -> None:
        write_kv(*args)  # idempotent: the same slots get the same values every round
        provider.sync()

    item = inputs.key.element_size()
    record(
        benchmark, "write_kv", workload, provider_name, nbytes=4 * inputs.key.numel() * item + 8 * inputs.key.shape[0]
    )
    run_plain(benchmark, target, bench_budget)


@pytest.mark.parametrize(
    ("workload", "provider_name"), [param(w, p) for w in KERNEL_WORKLOADS for p in providers.ATTENTION_PROVIDERS]
)
def test_paged_attention(benchmark: Any, bench_budget: float, workload: Workload, provider_name: str) -> None:
    provider = providers.get(provider_name)
    _skip_if_trimmed(workload, provider, "paged_attention")
    device_kind = "cuda" if provider.device == "cuda" else "cpu"
    inputs, shape = kernel_inputs(workload, device_kind), shape_for(device_kind)
    qsl = inputs.query_start_loc
    if provider_name.startswith("dense-sdpa"):
        kv = contiguous_kv(  # the contiguous layout is built once, untimed: it is the baseline's premise
            inputs.key_cache.to(provider.device), inputs.value_cache.to(provider.device),
            inputs.block_table, inputs.seq_lens, qsl,
        )  # fmt: skip
        query, starts = inputs.query.to(provider.device), qsl.tolist()

        def target() -> None:
            dense_attention(query, kv, starts, scale=shape.scale)
            provider.sync()
    else:
        attention = provider.module.paged_attention
        args = [_native(provider, t) for t in (inputs.query, inputs.key_cache, inputs.value_cache)]
        args += [provider.asarray(a) for a in (inputs.block_table, inputs.seq_lens, qsl)]

        def target() -> None:
            attention(*args, scale=shape.scale)
            provider.sync()

    nbytes, flops = _attention_work(qsl, inputs.seq_lens, shape)
    record(benchmark, "paged_attention", workload, provider_name, nbytes=nbytes, flops=flops)
    run_plain(benchmark, target, bench_budget)


@pytest.mark.parametrize(("workload", "provider_name"), [param(w, "fast") for w in KERNEL_WORKLOADS])
def test_paged_attention_interleaved(
    benchmark: Any, bench_budget: float, workload: Workload, provider_name: str
) -> None:
    """fast's CPU paged attention with dense SDPA on the same tokens run between its rounds (the ratio targets).

    As host_step_interleaved: separate benchmarks seconds apart are too noisy on a shared machine to divide.
    """
    provider, dense = providers.get(provider_name), providers.get("dense-sdpa")
    _skip_if_trimmed(workload, provider, "paged_attention")
    _skip_if_trimmed(workload, dense, "paged_attention")
    inputs, shape = kernel_inputs(workload, "cpu"), shape_for("cpu")
    qsl = inputs.query_start_loc
    kv = contiguous_kv(inputs.key_cache, inputs.value_cache, inputs.block_table, inputs.seq_lens, qsl)
    starts = qsl.tolist()
    args = [_native(provider, t) for t in (inputs.query, inputs.key_cache, inputs.value_cache)]
    args += [provider.asarray(a) for a in (inputs.block_table, inputs.seq_lens, qsl)]
    timer, dense_times = benchmark._timer, []

    def setup() -> tuple[Any, ...]:
        start = timer()
        dense_attention(inputs.query, kv, starts, scale=shape.scale)
        dense_times.append(timer() - start)
        return ()

    def target() -> None:
        provider.module.paged_attention(*args, scale=shape.scale)

    nbytes, flops = _attention_work(qsl, inputs.seq_lens, shape)
    record(benchmark, "paged_attention_interleaved", workload, provider_name, nbytes=nbytes, flops=flops,
           reference="dense-sdpa", what="paged attention, fast's rounds interleaved with dense SDPA's")  # fmt: skip
    run_stateful(benchmark, target, setup, bench_budget)
    if dense_times:
        benchmark.extra_info["reference_median"] = float(np.median(dense_times[1:] or dense_times))


@pytest.mark.parametrize(
    ("workload", "provider_name"), [param(w, p) for w in LAYER_WORKLOADS for p in providers.KERNEL_PROVIDERS]
)
def test_layer_step(benchmark: Any, bench_budget: float, workload: Workload, provider_name: str) -> None:
    """apply + prepare + write_kv + paged_attention for one layer (+ record_sampled, to keep the stream valid)."""
    provider = providers.get(provider_name)
    _skip_if_trimmed(workload, provider, "layer_step")
    shape = shape_for("cuda" if provider.device == "cuda" else "cpu")
    stream = StepStream(workload)
    pool = started(provider, stream)
    group = stream.config.kv_groups[0]
    # zeros: untouched pages are never made resident, so only the blocks the stream uses cost memory
    cache_shape = (group.num_blocks, group.block_size, shape.num_kv_heads, shape.head_dim)
    torch_device = "cpu" if provider.is_numpy else provider.device
    key_cache = torch.zeros(cache_shape, dtype=shape.dtype, device=torch_device)
    value_cache = torch.zeros(cache_shape, dtype=shape.dtype, device=torch_device)
    gen = torch.Generator().manual_seed(0)
    tokens = workload.num_tokens
    key = torch.randn((tokens, shape.num_kv_heads, shape.head_dim), generator=gen).to(shape.dtype)
    query = torch.randn((tokens, shape.num_heads, shape.head_dim), generator=gen).to(shape.dtype)
    kc, vc, k, v, q = (_native(provider, t) for t in (key_cache, value_cache, key, key.clone(), query))
    sampled = provider.asarray(stream.sampled(workload.num_reqs))
    m = provider.module

    def target(sched: Any) -> None:
        pool.apply(sched)
        batch = pool.prepare(sched)
        m.write_kv(kc, vc, k, v, batch.slot_mappings[0])
        m.paged_attention(q, kc, vc, batch.block_tables[0], batch.seq_lens, batch.query_start_loc, scale=shape.scale)
        pool.record_sampled(batch, sampled)
        provider.sync()

    batch = reference(workload)[2]
    nbytes, flops = _attention_work(np.asarray(batch.query_start_loc), np.asarray(batch.seq_lens), shape)
    record(benchmark, "layer_step", workload, provider_name, nbytes=nbytes, flops=flops)
    run_stateful(benchmark, target, lambda: (stream.next(),), bench_budget)
