"""The differential suite's sparse part: top-k selections drawn on the scheduler's steps, mapped and read by both.

On half the steps (the pair's own random stream, so a reproduction replays the same draws), for every group that
holds KV per position (an attention group, windowed or not, or an mla group): a random indexer's selection within
each query's reach (conformance/sparse_topk.py's random_topk: causal, inside the group's window) goes through
both backends' sparse_slot_mapping, which must agree exactly (values and dtype); then the group's sparse reader
reads the cache this step just wrote, at those slots, against spec in float64 on the very cache the candidate
read, within conformance/tolerance.py's rule: sparse_paged_attention for an attention group with a float cache
(that reader takes no fp8 codes), sparse_mla_attention for an mla group (fp8 codes too). Rows that select nothing
must be exactly zero.

The invalid side, on the same steps: the selection with one entry broken (break_topk: a padded token selecting,
an index below -1, a future index, one outside the window, a duplicate) must be refused by both backends with
the same SparseIndexError class naming the same request, token and field, the entry that was broken; the call
raises instead of returning, so nothing it computed reaches the caller.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import spec
from conformance.backends import sparse_kernels_of
from conformance.mismatch import COUNTS, MismatchError
from conformance.mismatch import PairView as Pair
from conformance.mla_compare import mlafp8_arguments
from conformance.sparse_topk import BrokenTopk, break_topk, random_topk
from conformance.tolerance import assert_attention_close, spec_in_dtype
from spec.protocol import SparseBackend
from spec.sparse_topk import POSITION_KINDS, SparseIndexError
from spec.types import BatchInputs

SPARSE_STEP_CHANCE = 0.5  # of a step's groups being read sparsely (the spec reader loops per token in Python)
MAX_TOP_K = 6


def compare_sparse(pair: Pair, g: int, ref_batch: BatchInputs, cand_batch: BatchInputs) -> None:
    """Group g's caches were written this step: draw a selection, compare the slots, the reader and a refusal."""

    kernels = sparse_kernels_of(pair.cand.handle)
    group = pair.config.kv_groups[g]
    if kernels is None or group.kind not in POSITION_KINDS or pair.sparse_rng.random() >= SPARSE_STEP_CHANCE:
        return
    rng, handle = pair.sparse_rng, pair.cand.handle
    positions, num_tokens = np.asarray(ref_batch.positions), ref_batch.num_tokens
    topk = random_topk(positions, num_tokens, int(rng.integers(1, MAX_TOP_K + 1)), group.sliding_window, rng)
    ref_slots = spec.sparse_slot_mapping(ref_batch, pair.config, topk, g)
    try:
        cand_slots = kernels.sparse_slot_mapping(cand_batch, pair.config, handle.asarray(topk), g)
    except Exception as exc:
        raise MismatchError(f"sparse_slot_mapping[{g}]: candidate raised {exc!r} on a valid selection") from exc
    got = handle.to_numpy(cand_slots)
    if got.dtype != ref_slots.dtype or not np.array_equal(got, ref_slots):
        where = np.argwhere(got != ref_slots)[:3].tolist() if got.shape == ref_slots.shape else got.shape
        raise MismatchError(f"sparse_slot_mapping[{g}]: {got.dtype} slots differ from spec's at {where}")
    _compare_reader(pair, g, kernels, ref_slots, cand_slots, num_tokens)
    COUNTS["sparse steps"] += 1
    broken = break_topk(topk, positions, num_tokens, group.sliding_window, rng)
    if broken is not None:
        _compare_refusal(pair, g, kernels, ref_batch, cand_batch, broken)
        COUNTS[f"sparse refused[{broken.error.__name__}]"] += 1


def _compare_reader(
    pair: Pair,
    g: int,
    kernels: SparseBackend,
    ref_slots: np.ndarray,  # [T, top_k] int64
    cand_slots: Any,  # [T, top_k] the candidate's own, equal to ref_slots
    num_tokens: int,
) -> None:

    att, group, rng = pair.attention, pair.config.kv_groups[g], pair.sparse_rng
    assert att is not None
    to, dtype, padded = pair.cand.handle.asarray, att.dtype, ref_slots.shape[0]
    if group.kind == "mla":
        fp8 = mlafp8_arguments(att)
        rank, rope = group.kv_lora_rank, group.qk_rope_head_dim
        q_latent = rng.standard_normal((padded, att.num_heads, rank)).astype(dtype)  # [T, H, L] already absorbed
        q_pe = rng.standard_normal((padded, att.num_heads, rope)).astype(dtype)  # [T, H, R]
        scale = 1.0 / math.sqrt(att.head_dim + rope)
        cache, name = pair.ref.latents[g], "sparse_mla_attention"

        def reference(*f: np.ndarray) -> np.ndarray:
            """spec on the queries `f`; an "auto" cache is f's last, in f's dtype; fp8 reads the very codes."""
            kv = cache if fp8 else f[2]
            return np.asarray(spec.sparse_mla_attention(f[0], f[1], kv, ref_slots, scale=scale, **fp8))

        floats = (q_latent, q_pe) if fp8 else (q_latent, q_pe, cache)
        call = lambda: kernels.sparse_mla_attention(  # noqa: E731
            to(q_latent), to(q_pe), pair.cand.latents[g], cand_slots, scale=scale, **fp8
        )
    else:
        if att.kv_cache_dtype != "auto":
            return  # the attention reader takes float caches only (spec/sparse_attention.py)
        query = rng.standard_normal((padded, att.num_heads, att.head_dim)).astype(dtype)  # [T, H, D]
        (rk, rv), (ck, cv), name = pair.ref.caches[g], pair.cand.caches[g], "sparse_paged_attention"

        def reference(*f: np.ndarray) -> np.ndarray:
            out = spec.sparse_paged_attention(f[0], f[1], f[2], ref_slots, scale=att.scale, softcap=att.softcap)
            return np.asarray(out)

        floats = (query, rk, rv)
        call = lambda: kernels.sparse_paged_attention(  # noqa: E731
            to(query), ck, cv, cand_slots, scale=att.scale, softcap=att.softcap
        )
    ref64 = reference(*(np.asarray(a, np.float64) for a in floats))
    low = spec_in_dtype(reference, dtype, floats)
    try:
        out = call()
    except Exception as exc:
        raise MismatchError(f"{name}[{g}]: candidate raised {exc!r}") from exc
    got = np.asarray(pair.cand.handle.to_numpy(out), np.float64)
    if got.shape != ref64.shape:
        raise MismatchError(f"{name}[{g}]: shape {got.shape}, expected {ref64.shape}")
    empty = (ref_slots < 0).all(axis=1)  # [T] padding rows, and real queries that selected nothing
    if np.any(got[empty] != 0):
        raise MismatchError(f"{name}[{g}]: rows {np.flatnonzero(empty).tolist()} select nothing but are not zero")
    try:
        assert_attention_close(got[:num_tokens], ref64[:num_tokens], low[:num_tokens], dtype)
    except AssertionError as exc:
        raise MismatchError(f"{name}[{g}]: {exc}") from exc


def _compare_refusal(
    pair: Pair, g: int, kernels: SparseBackend, ref_batch: BatchInputs, cand_batch: BatchInputs, broken: BrokenTopk
) -> None:

    qsl = np.asarray(ref_batch.query_start_loc)
    row = int(np.searchsorted(qsl[1:], broken.token, side="right"))
    req_id = ref_batch.req_ids[row] if broken.token < ref_batch.num_tokens else None
    expected = (broken.error.__name__, req_id, broken.token, broken.field)
    calls = (
        ("reference", lambda: spec.sparse_slot_mapping(ref_batch, pair.config, broken.topk, g)),
        ("candidate", lambda: kernels.sparse_slot_mapping(
            cand_batch, pair.config, pair.cand.handle.asarray(broken.topk), g)),
    )  # fmt: skip
    for who, call in calls:
        try:
            call()
        except SparseIndexError as exc:
            got = (type(exc).__name__, exc.req_id, exc.token, exc.field)
            if got != expected:
                raise MismatchError(f"sparse_slot_mapping[{g}]: {who} refused {got}, expected {expected}") from exc
            continue
        except Exception as exc:
            raise MismatchError(f"sparse_slot_mapping[{g}]: {who} raised {exc!r}, expected {expected}") from exc
        raise MismatchError(f"sparse_slot_mapping[{g}]: {who} accepted a selection breaking {expected}")
