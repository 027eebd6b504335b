"""write_kv and paged_attention past one tile of the kernels, windowed and soft-capped, on every backend.

Run through the backend handle (`--backend fast-interpret` runs the Triton kernels in the interpreter), so
window and soft-cap attention are checked on the kernel path too, not only on the torch path. The sizes are
derived from the kernels' tile constants: every request's visible keys span at least two full BLOCK_N tiles
plus a ragged tail (windows included: they start mid-tile), the prefill's queries span two full query tiles
(BLOCK_Q tokens per program for this group size) plus a tail, and write_kv's heads two full head tiles plus
one. Small head dims, few tokens per step, long requests: it fits CI's time under the interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest

import spec
from conformance.backends import BackendHandle
from conformance.tolerance import assert_attention_close, spec_in_dtype

try:
    from fast.kernels.paged_attention import BLOCK_N, query_tile
    from fast.kernels.write_kv import head_tile
except ImportError:  # no Triton on this platform: nothing for the tiles to be derived from
    pytest.skip("fast's Triton kernels are not importable here", allow_module_level=True)

GROUP = 2  # query heads per KV head
NUM_KV_HEADS = 2
HEAD_DIM = 16
BLOCK_SIZE = 8
BLOCK_Q = query_tile(GROUP)[2]
RAGGED = 5
CONTEXT = 3 * BLOCK_N + RAGGED  # keys before the decode query: 3 full tiles and a tail
PREFILL = 2 * BLOCK_Q + RAGGED  # queries of the chunked prefill: 2 full query tiles and a tail
WINDOW = 2 * BLOCK_N + RAGGED  # a window of 2 full tiles and a tail, starting mid-tile
SOFTCAP = 2.5


def _crosses(size: int, tile: int) -> bool:
    return size >= 2 * tile and size % tile != 0


def test_sizes_cross_the_kernels_tiles() -> None:
    assert _crosses(CONTEXT, BLOCK_N) and _crosses(WINDOW, BLOCK_N) and _crosses(PREFILL, BLOCK_Q)
    assert (CONTEXT - WINDOW + 1) % BLOCK_N != 0, "the window's first key is mid-tile"


@pytest.mark.parametrize(
    ("sliding_window", "softcap"), [(None, None), (WINDOW, None), (None, SOFTCAP), (WINDOW, SOFTCAP)]
)
def test_long_requests_windowed_and_soft_capped(
    backend: BackendHandle, sliding_window: int | None, softcap: float | None
) -> None:
    rng = np.random.default_rng(0)
    # batch row 0 decodes after CONTEXT tokens, row 1 prefills PREFILL tokens after CONTEXT (a chunk), row 2
    # is a fresh prompt of PREFILL tokens: queries at the start of a sequence, with no context at all
    requests = [(CONTEXT, 1), (CONTEXT, PREFILL), (0, PREFILL)]
    seq_lens = np.array([c + n for c, n in requests], np.int32)
    width = int(-(-seq_lens.max() // BLOCK_SIZE))
    num_blocks = 1 + len(requests) * width
    table = (1 + rng.permutation(len(requests) * width)).reshape(len(requests), width).astype(np.int32)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache, value_cache = rng.standard_normal(shape), rng.standard_normal(shape)
    query_start_loc = np.concatenate([[0], np.cumsum([n for _, n in requests])]).astype(np.int32)
    num_tokens = int(query_start_loc[-1])
    query = rng.standard_normal((num_tokens, NUM_KV_HEADS * GROUP, HEAD_DIM))
    ints = (table, seq_lens, query_start_loc)
    kwargs = {"scale": HEAD_DIM**-0.5, "sliding_window": sliding_window, "softcap": softcap}

    # every key of the three requests is written by write_kv first, in one call: one token per slot
    positions = [np.arange(s) for s in seq_lens.tolist()]
    slots = np.concatenate([table[b, p // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + p % BLOCK_SIZE
                            for b, p in enumerate(positions)])  # fmt: skip
    new_keys = rng.standard_normal((slots.size, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    new_values = rng.standard_normal((slots.size, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    caches = [backend.asarray(c.astype(np.float32)) for c in (key_cache, value_cache)]
    backend.module.write_kv(
        caches[0], caches[1], backend.asarray(new_keys), backend.asarray(new_values), backend.asarray(slots)
    )
    key_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE] = new_keys
    value_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE] = new_values
    np.testing.assert_array_equal(backend.to_numpy(caches[0]), key_cache.astype(np.float32))
    np.testing.assert_array_equal(backend.to_numpy(caches[1]), value_cache.astype(np.float32))

    q32 = query.astype(np.float32)
    out = backend.module.paged_attention(backend.asarray(q32), *caches, *(backend.asarray(a) for a in ints), **kwargs)
    floats = (q32.astype(np.float64), key_cache.astype(np.float32).astype(np.float64),
              value_cache.astype(np.float32).astype(np.float64))  # fmt: skip
    ref64 = spec.paged_attention(*floats, *ints, **kwargs)
    low = spec_in_dtype(spec.paged_attention, "float32", floats, *ints, **kwargs)
    assert_attention_close(backend.to_numpy(out), ref64, low, "float32")


def test_write_kv_across_head_tiles(backend: BackendHandle) -> None:
    """More KV heads than two of write_kv's head tiles (float32, head_dim 64), plus a ragged tail."""
    head_dim = 64
    block_h, _ = head_tile(1 << 20, head_dim, np.dtype(np.float32).itemsize)  # the widest tile it would take
    num_kv_heads = 2 * block_h + 3
    rng = np.random.default_rng(1)
    shape = (3, 4, num_kv_heads, head_dim)
    key_cache, value_cache = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    key, value = (rng.standard_normal((5, num_kv_heads, head_dim)).astype(np.float32) for _ in "kv")
    slots = np.array([3, -1, 11, 0, 6], np.int64)
    caches = [backend.asarray(c) for c in (key_cache, value_cache)]
    backend.module.write_kv(caches[0], caches[1], backend.asarray(key), backend.asarray(value), backend.asarray(slots))
    spec.write_kv(key_cache, value_cache, key, value, slots)
    np.testing.assert_array_equal(backend.to_numpy(caches[0]), key_cache)
    np.testing.assert_array_equal(backend.to_numpy(caches[1]), value_cache)
