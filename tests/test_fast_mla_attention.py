"""fast's MLA decode paths (host mode's CPU kernel, the Triton kernel through the interpreter) on shapes that reach
their tiling: several key tiles per row, more heads than one head block, a NoPE latent, strided queries, int64
indices, and fp8 codes spread over a whole tile.

Expectations: a dense float64 formulation written here (each request's latents gathered by hand from its slots,
softmax per query and head, no block table, no online softmax), and the tolerance rule of conformance/tolerance.py
with spec in the dtype as its low-precision baseline. Sizes stay tiny: the interpreter runs every lane in NumPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import fast
import spec
from conformance.tolerance import as_float64, assert_attention_close, round_to, spec_in_dtype
from spec.fp8 import KV_CACHE_DTYPES, decode, encode


def _batch(
    rng: np.random.Generator, query_lens: tuple[int, ...], seq_lens: tuple[int, ...], block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(block_table [num_reqs, max_blocks] of shuffled ids, seq_lens [num_reqs], query_start_loc, num_blocks)."""
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(need) + 2  # the null block, and two blocks no request owns
    ids = rng.permutation(np.arange(1, num_blocks))
    table = np.zeros((len(seq_lens), max(need)), np.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n], at = ids[at : at + n], at + n
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return table, np.array(seq_lens, np.int32), qsl, num_blocks


def _dense(q_latent: np.ndarray, q_pe: np.ndarray, cache: np.ndarray, table: np.ndarray, seq_lens: np.ndarray,
           qsl: np.ndarray, scale: float) -> np.ndarray:  # fmt: skip
    """[T, H, L] float64: per query and head, softmax over the positions it sees of (q_latent . c + q_pe . k_pe)."""
    rank, block_size = q_latent.shape[2], cache.shape[1]
    out = np.zeros(q_latent.shape)
    for b in range(len(seq_lens)):
        q_len, seq_len = int(qsl[b + 1] - qsl[b]), int(seq_lens[b])
        entries = np.stack([cache[table[b, p // block_size], p % block_size] for p in range(seq_len)])  # [S, L + R]
        c, pe = entries[:, :rank], entries[:, rank:]
        for i in range(q_len):
            t, seen = int(qsl[b]) + i, seq_len - q_len + i + 1
            for h in range(q_latent.shape[1]):
                logits = (c[:seen] @ q_latent[t, h] + pe[:seen] @ q_pe[t, h]) * scale
                w = np.exp(logits - logits.max())
                out[t, h] = (w / w.sum()) @ c[:seen]
    return out


SHAPES = {
    # name: (num_heads, kv_lora_rank, rope_dim, block_size, query_lens, seq_lens)
    "decode-long": (3, 6, 4, 4, (1, 1), (37, 18)),  # rows of several key tiles (16 positions each)
    "heads-20": (20, 6, 2, 8, (1, 2), (21, 9)),  # two head blocks, the second partial
    "nope-verify": (4, 10, 0, 4, (3, 1, 6), (19, 5, 23)),  # no RoPE part; 1 + K rows; a chunk over 2 query tiles
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mla_decode_matches_dense(mode: str, shape: str, dtype: str) -> None:
    num_heads, rank, rope_dim, block_size, query_lens, seq_lens = SHAPES[shape]
    rng = np.random.default_rng(sum(map(ord, shape)))
    table, lens, qsl, num_blocks = _batch(rng, query_lens, seq_lens, block_size)
    num_tokens = int(qsl[-1]) + 1  # one padding row
    q_latent = round_to(rng.normal(size=(num_tokens, num_heads, rank)), dtype)
    q_pe = round_to(rng.normal(size=(num_tokens, num_heads, rope_dim)), dtype)
    cache = round_to(rng.normal(size=(num_blocks, block_size, rank + rope_dim)), dtype)
    scale = 0.3
    dense = _dense(q_latent, q_pe, cache, table, lens, qsl, scale)
    np.testing.assert_allclose(spec.mla_decode_attention(q_latent, q_pe, cache, table, lens, qsl, scale=scale),
                               dense, atol=1e-12)  # fmt: skip
    low = spec_in_dtype(spec.mla_decode_attention, dtype, (q_latent, q_pe, cache), table, lens, qsl, scale=scale)
    tdtype = getattr(torch, dtype)
    got = fast.mla_decode_attention(
        *(torch.from_numpy(a).to(tdtype) for a in (q_latent, q_pe, cache)),
        *(torch.from_numpy(a) for a in (table, lens, qsl)), scale=scale,
    )  # fmt: skip
    assert got.dtype == tdtype and got.shape == q_latent.shape
    assert_attention_close(got, dense, low, dtype)
    assert not got[-1].any()  # the padding row is exactly zero


def test_mla_decode_reads_strided_queries_and_int64_indices(mode: str) -> None:
    """q_latent and q_pe as views of one [T, H, L + R] query (vLLM splits its concatenated query this way), a
    cache whose entries are padded (stride 24 for 20 elements), int64 indices: the dense result all the same."""
    num_heads, rank, rope_dim, block_size = 5, 12, 8, 4
    rng = np.random.default_rng(7)
    table, lens, qsl, num_blocks = _batch(rng, (1, 4), (26, 17), block_size)
    q = rng.normal(size=(int(qsl[-1]), num_heads, rank + rope_dim)).astype(np.float32)
    padded = rng.normal(size=(num_blocks, block_size, rank + rope_dim + 4)).astype(np.float32)
    cache = padded[:, :, : rank + rope_dim]
    dense = _dense(q[:, :, :rank], q[:, :, rank:], cache.astype(np.float64), table, lens, qsl, 0.2)
    low = spec_in_dtype(spec.mla_decode_attention, "float32", (q[:, :, :rank], q[:, :, rank:], cache), table, lens,
                        qsl, scale=0.2)  # fmt: skip
    query = torch.from_numpy(q)
    got = fast.mla_decode_attention(
        query[:, :, :rank], query[:, :, rank:], torch.from_numpy(padded)[:, :, : rank + rope_dim],
        *(torch.from_numpy(a.astype(np.int64)) for a in (table, lens, qsl)), scale=0.2,
    )  # fmt: skip
    assert_attention_close(got, dense, low, "float32")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("cache_type", ["uint8", "float8"])
def test_mla_decode_reads_fp8_codes_over_several_tiles(mode: str, kv_cache_dtype: str, cache_type: str) -> None:
    """Every code a tile may hold (the latent and RoPE lanes cycle through all finite codes), read as
    decode(code) * k_scale: the dense reference on exactly those values."""
    fmt = KV_CACHE_DTYPES[kv_cache_dtype]
    assert fmt is not None
    num_heads, rank, rope_dim, block_size = 4, 14, 2, 8
    rng = np.random.default_rng(11)
    table, lens, qsl, num_blocks = _batch(rng, (1, 2), (40, 29), block_size)
    finite = np.array([c for c in range(256) if np.isfinite(decode(np.uint8(c), fmt))], np.uint8)
    codes = rng.permutation(np.resize(finite, num_blocks * block_size * (rank + rope_dim)))
    codes = codes.reshape(num_blocks, block_size, rank + rope_dim)
    k_scale = 2.0**-6  # a power of 2: the scaled values are exact in every dtype, so only the arithmetic differs
    values = decode(codes, fmt).astype(np.float64) * k_scale
    assert np.array_equal(decode(encode(values.astype(np.float32) / np.float32(k_scale), fmt), fmt) * k_scale, values)
    q_latent = rng.normal(size=(int(qsl[-1]), num_heads, rank)).astype(np.float32) * 0.05
    q_pe = rng.normal(size=(int(qsl[-1]), num_heads, rope_dim)).astype(np.float32) * 0.05
    dense = _dense(q_latent, q_pe, values, table, lens, qsl, 0.5)
    options: dict[str, Any] = dict(scale=0.5, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale)

    def spec_call(q: np.ndarray, pe: np.ndarray) -> np.ndarray:
        return spec.mla_decode_attention(q, pe, codes, table, lens, qsl, **options)

    np.testing.assert_allclose(spec_call(q_latent.astype(np.float64), q_pe.astype(np.float64)), dense, atol=1e-12)
    low = spec_in_dtype(spec_call, "float32", (q_latent, q_pe))
    cache = torch.from_numpy(codes)
    if cache_type == "float8":
        cache = cache.view(torch.float8_e4m3fn if fmt.name == "e4m3" else torch.float8_e5m2)
    got = fast.mla_decode_attention(torch.from_numpy(q_latent), torch.from_numpy(q_pe), cache,
                                    *(torch.from_numpy(a) for a in (table, lens, qsl)), **options)  # fmt: skip
    assert_attention_close(got, dense, low, "float32")
    assert np.isfinite(as_float64(got)).all()
