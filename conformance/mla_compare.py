"""The differential suite's MLA part: an mla group's latent cache written and read by both backends' kernels.

Per step and mla group g (spec/mla_cache.py, spec/mla_attention.py): random latents kv_c and RoPE parts k_pe
for every padded token go into each side's latent cache with its write_mla_kv at its batch's slot_mappings[g]
(the caches must then be equal, bit for bit, fp8 codes too); then both attention forms read the cache over
every batch row, each against spec in float64 on the very cache the candidate read, within
conformance/tolerance.py's rule. Both forms take any query length and agree in real arithmetic, so running
each over every row covers what any split of the batch (spec/mla_split.py) hands either kernel.

Shapes come from the scenario's AttentionSpec: its heads are the query heads, its head_dim both
qk_nope_head_dim and v_head_dim; the group gives kv_lora_rank and qk_rope_head_dim. The latent cache holds the
attention's dtype, or uint8 codes with an fp8 kv_cache_dtype; MLA's fp8 scale is one per tensor, the spec's
first k_scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

import spec
from conformance.backends import BackendHandle, mla_kernels_of
from conformance.mismatch import MismatchError
from conformance.mismatch import PairView as Pair
from conformance.scenario import AttentionSpec
from conformance.tolerance import assert_attention_close, spec_in_dtype
from spec.types import BatchInputs, KVCacheGroup


def latent_cache(handle: BackendHandle, group: KVCacheGroup, attention: AttentionSpec) -> Any:
    """A zeroed latent cache [num_blocks, block_size, kv_lora_rank + rope_dim] in the backend's array type."""
    return handle.asarray(np.zeros(spec.mla_cache_shape(group), attention.cache_dtype))


def mlafp8_arguments(attention: AttentionSpec) -> dict[str, Any]:
    """write_mla_kv's and both forms' fp8 keywords ({} for an "auto" cache): one scale, per tensor."""
    if attention.kv_cache_dtype == "auto":
        return {}
    return {"kv_cache_dtype": attention.kv_cache_dtype, "k_scale": attention.k_scale[0]}


def compare_mla(pair: Pair, g: int, ref_batch: BatchInputs, cand_batch: BatchInputs) -> None:
    """Group g is an mla group: write random latents through both backends, then read them with both forms."""

    att, group = pair.attention, pair.config.kv_groups[g]
    assert att is not None
    kernels = mla_kernels_of(pair.cand.handle)
    if kernels is None:
        return  # a third-party backend without MLA kernels: its slots are compared with the batch
    rng, dtype, to = pair.kv_rng, np.dtype(att.dtype), pair.cand.handle.asarray
    num_tokens, padded = ref_batch.num_tokens, ref_batch.num_tokens_padded
    rank, rope, heads, width = group.kv_lora_rank, group.qk_rope_head_dim, att.num_heads, att.head_dim
    fp8 = mlafp8_arguments(att)
    kv_c = rng.standard_normal((padded, rank)).astype(dtype)  # [T, L]
    k_pe = rng.standard_normal((padded, rope)).astype(dtype)  # [T, R]
    ref_cache, cand_cache = pair.ref.latents[g], pair.cand.latents[g]
    spec.write_mla_kv(ref_cache, kv_c, k_pe, ref_batch.slot_mappings[g], **fp8)
    try:
        kernels.write_mla_kv(cand_cache, to(kv_c), to(k_pe), cand_batch.slot_mappings[g], **fp8)
    except Exception as exc:
        raise MismatchError(f"write_mla_kv[{g}]: candidate raised {exc!r}") from exc
    got_cache = pair.cand.handle.to_numpy(cand_cache)
    if not np.array_equal(got_cache, ref_cache):
        where = np.argwhere(got_cache != ref_cache)[:3].tolist()
        raise MismatchError(f"write_mla_kv[{g}]: latent cache differs at [block, offset, element] {where}")

    q_latent = rng.standard_normal((padded, heads, rank)).astype(dtype)  # [T, H, L] already absorbed
    q_nope = rng.standard_normal((padded, heads, width)).astype(dtype)  # [T, H, P]
    q_pe = rng.standard_normal((padded, heads, rope)).astype(dtype)  # [T, H, R]
    w_uk = (rng.standard_normal((rank, heads, width)) / math.sqrt(rank)).astype(dtype)  # [L, H, P]
    w_uv = (rng.standard_normal((rank, heads, width)) / math.sqrt(rank)).astype(dtype)  # [L, H, V]
    scale = 1.0 / math.sqrt(width + rope)  # DeepSeek's softmax scale: over the whole query head (nope + rope)
    indices = (ref_batch.block_tables[g], ref_batch.seq_lens, ref_batch.query_start_loc)
    cand_indices = (cand_batch.block_tables[g], cand_batch.seq_lens, cand_batch.query_start_loc)
    forms: tuple[tuple[str, Callable[..., Any], Callable[..., Any], tuple[np.ndarray, ...], int], ...] = (
        ("mla_decode_attention", spec.mla_decode_attention, kernels.mla_decode_attention, (q_latent, q_pe), rank),
        ("mla_prefill_attention", spec.mla_prefill_attention, kernels.mla_prefill_attention,
         (q_nope, q_pe, w_uk, w_uv), width),
    )  # fmt: skip
    for name, spec_form, cand_form, floats, out_width in forms:

        def reference(*f: np.ndarray, spec_form: Callable[..., Any] = spec_form) -> np.ndarray:
            """spec's form on the queries (and weights) `f`; an "auto" cache is f's last, in f's dtype."""
            queries, cache = (f, ref_cache) if fp8 else (f[:-1], f[-1])
            return np.asarray(spec_form(queries[0], queries[1], cache, *queries[2:], *indices, scale=scale, **fp8))

        args = floats if fp8 else (*floats, ref_cache)  # fp8: both references read the very codes
        ref64 = reference(*(np.asarray(a, np.float64) for a in args))
        low = spec_in_dtype(reference, att.dtype, args)
        try:
            out = cand_form(to(floats[0]), to(floats[1]), cand_cache, *(to(w) for w in floats[2:]), *cand_indices,
                            scale=scale, **fp8)  # fmt: skip
        except Exception as exc:
            raise MismatchError(f"{name}[{g}]: candidate raised {exc!r}") from exc
        got = np.asarray(pair.cand.handle.to_numpy(out), np.float64)
        if got.shape != (padded, heads, out_width):
            raise MismatchError(f"{name}[{g}]: shape {got.shape}, expected {(padded, heads, out_width)}")
        if np.any(got[num_tokens:] != 0):
            raise MismatchError(f"{name}[{g}]: padding rows {num_tokens}..{padded} are not zero")
        try:
            assert_attention_close(got[:num_tokens], ref64[:num_tokens], low[:num_tokens], att.dtype)
        except AssertionError as exc:
            raise MismatchError(f"{name}[{g}]: {exc}") from exc
