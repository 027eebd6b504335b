"""MLA's absorbed decode on CPU: fast's (host mode) beside vLLM's CPU_MLA decode op, at one and two threads.

DeepSeek's latent shapes: kv_lora_rank 512 + rope_dim 64, 16 query heads (a tensor-parallel share of 128), blocks
of 16 (the only block size vLLM's CPU MLA kernel takes), block ids a shuffled free list. The rounds are
interleaved as in benchmarks/test_cpu_kernels.py (its `threads` fixture, settle gap and `_interleaved`), so the
ratio comes from one stretch of time on a shared machine. Before anything is timed both outputs are checked
against spec in float64 on a few batch rows by conformance.tolerance's rule. The work recorded is the latent
cache read (every row's entries once: seq_len x 576 elements), for GB/s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import fast
import spec
from benchmarks import vllm_cpu
from benchmarks.cpu_kernel_cases import THREADS
from benchmarks.harness import record
from benchmarks.test_cpu_kernels import VLLM, _interleaved, _need_vllm, _settle, _workload
from benchmarks.test_cpu_kernels import threads as threads  # the fixture, re-exported for this module's tests
from conformance.tolerance import assert_attention_close, spec_in_dtype

NUM_HEADS, KV_LORA_RANK, ROPE_DIM, BLOCK_SIZE = 16, 512, 64, 16
BF16 = torch.bfloat16


@dataclass(frozen=True)
class MlaCase:
    name: str
    num_reqs: int
    context: int  # seq_len of every row (its decode token included)
    dtype: torch.dtype = torch.float32
    quick: bool = False

    def __str__(self) -> str:
        return self.name


MLA_CASES = (
    MlaCase("mla-decode-16x512", 16, 512, quick=True),
    MlaCase("mla-decode-64x1024", 64, 1024),
    MlaCase("mla-decode-8x4096", 8, 4096),
    MlaCase("mla-decode-64x1024-bf16", 64, 1024, BF16),
    MlaCase("mla-decode-8x4096-bf16", 8, 4096, BF16),
)


@dataclass(frozen=True)
class MlaInputs:
    q_latent: torch.Tensor  # [num_reqs, num_heads, kv_lora_rank]
    q_pe: torch.Tensor  # [num_reqs, num_heads, rope_dim]
    kv_cache: torch.Tensor  # [num_blocks, block_size, kv_lora_rank + rope_dim], block 0 NaN (never read)
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32 batch_idx -> physical block ids
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    scale: float


@functools.lru_cache(maxsize=1)
def mla_inputs(case: MlaCase) -> MlaInputs:
    gen = torch.Generator().manual_seed(0)
    per_row = -(-case.context // BLOCK_SIZE)
    num_blocks = 1 + case.num_reqs * per_row
    table = (1 + torch.randperm(num_blocks - 1, generator=gen)).reshape(case.num_reqs, per_row).to(torch.int32)
    kv_cache = torch.randn((num_blocks, BLOCK_SIZE, KV_LORA_RANK + ROPE_DIM), generator=gen).to(case.dtype)
    kv_cache[0] = float("nan")  # the null block
    q_latent = torch.randn((case.num_reqs, NUM_HEADS, KV_LORA_RANK), generator=gen).to(case.dtype)
    q_pe = torch.randn((case.num_reqs, NUM_HEADS, ROPE_DIM), generator=gen).to(case.dtype)
    seq_lens = torch.full((case.num_reqs,), case.context, dtype=torch.int32)
    qsl = torch.arange(case.num_reqs + 1, dtype=torch.int32)
    # DeepSeek's softmax scale is that of the 192-wide query head before absorption
    return MlaInputs(q_latent, q_pe, kv_cache, table, seq_lens, qsl, (128 + ROPE_DIM) ** -0.5)


def check_mla_rows(inputs: MlaInputs, out: torch.Tensor, rows: tuple[int, ...] = (0, 1, -1)) -> None:
    """out [num_reqs, num_heads, kv_lora_rank] against spec in float64 on a few rows (a sub-batch of their blocks)."""
    picked = sorted({r % inputs.seq_lens.shape[0] for r in rows})
    table = inputs.block_table.numpy()[picked]
    used = np.unique(table)
    dense = np.zeros(int(used.max()) + 1, np.int32)
    dense[used] = np.arange(used.size, dtype=np.int32)
    ints = (dense[table], inputs.seq_lens.numpy()[picked], np.arange(len(picked) + 1, dtype=np.int32))
    q_latent, q_pe, kv_cache = (t.double().numpy() for t in (inputs.q_latent[picked], inputs.q_pe[picked],
                                                              inputs.kv_cache[used]))  # fmt: skip
    floats = (q_latent, q_pe, kv_cache)
    ref64 = spec.mla_decode_attention(q_latent, q_pe, kv_cache, *ints, scale=inputs.scale)
    low = spec_in_dtype(spec.mla_decode_attention, inputs.q_latent.dtype, floats, *ints, scale=inputs.scale)
    assert_attention_close(out[picked], ref64, low, inputs.q_latent.dtype)


def _params() -> list[Any]:
    return [
        pytest.param(c, t, id=f"{c.name}-t{t}", marks=[pytest.mark.quick] if c.quick and t == 1 else [])
        for c in MLA_CASES
        for t in THREADS
    ]


@pytest.mark.parametrize(("case", "threads"), _params(), indirect=["threads"])
def test_mla_decode_vs_vllm(benchmark: Any, bench_budget: float, case: MlaCase, threads: int) -> None:
    _need_vllm()
    inputs = mla_inputs(case)
    args = (inputs.q_latent, inputs.q_pe, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
            inputs.query_start_loc)  # fmt: skip
    peer = vllm_cpu.mla_decode(*args[:5], scale=inputs.scale)
    check_mla_rows(inputs, fast.mla_decode_attention(*args, scale=inputs.scale))
    check_mla_rows(inputs, peer())

    def target() -> None:
        fast.mla_decode_attention(*args, scale=inputs.scale)

    entries = case.num_reqs * case.context * (KV_LORA_RANK + ROPE_DIM)
    requests = tuple((case.context - 1, 1) for _ in range(case.num_reqs))
    record(benchmark, "mla_decode_vs_vllm", _workload(case.name, requests, threads), "fast",
           nbytes=entries * inputs.kv_cache.element_size(), reference=VLLM,
           what="MLA absorbed decode (16 heads, kv_lora_rank 512 + rope 64, blocks of 16), fast's rounds interleaved "
                "with vLLM's CPU_MLA op mla_decode_kvcache; bytes: the latent cache read")  # fmt: skip
    benchmark.extra_info.update(threads=threads, dtype=str(case.dtype).removeprefix("torch."))
    _interleaved(benchmark, target, peer, bench_budget, _settle())
