"""Sparse top-k attention in the suite: runs of the reference scheduler and an indexer's random selections.

The indexer is the model's job; here it is a random one that picks, per real query at position p, distinct
positions of its own request within the query's reach (causal, and inside the group's window if it has one),
leaving the rest of its row -1 in shuffled columns; padded tokens select nothing. A dense reference attends
each query over the keys written at every position of its request, masked to the selected ones: it never
looks at a slot, a table or a block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload
from spec.protocol import StatePool
from spec.sparse_topk import (
    DuplicateIndexError,
    FutureIndexError,
    InvalidIndexError,
    PaddingIndexError,
    SparseIndexError,
    WindowIndexError,
)
from spec.types import BatchInputs, WorkerConfig


def random_topk(
    positions: np.ndarray,  # [T] flat token index -> position
    num_tokens: int,  # real tokens; the rest of the T rows are padding
    top_k: int,
    window: int | None,
    rng: np.random.Generator,
) -> np.ndarray:  # [T, top_k] int32, -1: none
    topk = np.full((positions.shape[0], top_k), -1, np.int32)
    for t in range(num_tokens):
        p = int(positions[t])
        first = 0 if window is None else max(0, p - window + 1)
        reach = np.arange(first, p + 1)  # the positions query t may read
        count = int(rng.integers(0, min(top_k, reach.size) + 1))
        columns = rng.permutation(top_k)[:count]
        topk[t, columns] = rng.choice(reach, size=count, replace=False)
    return topk


@dataclass(frozen=True)
class BrokenTopk:
    """A valid selection with one entry broken: the rule it breaks and where, as the error must name it."""

    topk: np.ndarray  # [T, top_k]
    error: type[SparseIndexError]
    token: int  # flat token index
    column: int

    @property
    def field(self) -> str:
        return f"topk_indices[{self.token}, {self.column}]"


def break_topk(
    topk: np.ndarray,  # [T, top_k] a valid selection (random_topk's)
    positions: np.ndarray,  # [T] flat token index -> position
    num_tokens: int,  # real tokens; the rest of the T rows are padding
    window: int | None,
    rng: np.random.Generator,
) -> BrokenTopk | None:
    """One entry of `topk` changed so that exactly one rule of spec/sparse_topk.py refuses it, the rule drawn among
    those the step can break (None if none can be: no token, or one column and nothing to break but the rest).
    The future index and the one outside the window sit on the boundary half the time, where an off-by-one
    check lets them through."""
    num_rows, width = topk.shape
    choices: list[type[SparseIndexError]] = []
    if num_rows > num_tokens and width:
        choices.append(PaddingIndexError)
    if num_tokens and width:
        choices += [InvalidIndexError, FutureIndexError]
    pos = np.asarray(positions, np.int64)
    windowed = [t for t in range(num_tokens) if window is not None and pos[t] - window >= 0]
    if windowed and width:
        choices.append(WindowIndexError)
    duplicable = [t for t in range(num_tokens) if (topk[t] >= 0).sum() >= 1] if width >= 2 else []
    if duplicable:
        choices.append(DuplicateIndexError)
    if not choices:
        return None
    error = choices[int(rng.integers(len(choices)))]
    broken = topk.copy()
    column = int(rng.integers(width))
    if error is PaddingIndexError:
        token = int(rng.integers(num_tokens, num_rows))
        broken[token, column] = int(rng.integers(0, 3))
    elif error is InvalidIndexError:
        token = int(rng.integers(num_tokens))
        broken[token, column] = -2 - int(rng.integers(0, 3))
    elif error is FutureIndexError:
        token = int(rng.integers(num_tokens))
        broken[token, column] = pos[token] + 1 + (0 if rng.random() < 0.5 else int(rng.integers(1, 4)))
    elif error is WindowIndexError:
        assert window is not None
        token = windowed[int(rng.integers(len(windowed)))]
        reach = int(pos[token]) - window  # the last position the window no longer sees
        # a window's valid row lists only positions > reach: this one is no duplicate
        broken[token, column] = reach if rng.random() < 0.5 else int(rng.integers(0, reach + 1))
    else:
        token = duplicable[int(rng.integers(len(duplicable)))]
        listed = [j for j in range(width) if topk[token, j] >= 0]
        source = listed[int(rng.integers(len(listed)))]
        column = int(rng.choice([j for j in range(width) if j != source]))
        broken[token, column] = topk[token, source]
        column = max(column, source)  # the rule names the repeat: the later of the two columns
    return BrokenTopk(broken, error, token, column)


def scheduled_batches(
    config: WorkerConfig, seed: int, pools: Sequence[StatePool], max_steps: int, knobs: SchedulerKnobs
) -> Iterator[list[BatchInputs]]:
    """Up to max_steps steps of a reference-scheduler workload through every pool (the same outputs, one batch
    per pool, in `pools` order); each pool records the same sampled ids, in its own array type."""
    workload = make_workload(seed, config, num_requests=4, max_arrival_step=3, max_new_tokens=8)
    sched = ReferenceScheduler(config, workload, knobs, seed=seed)
    rng = np.random.default_rng(seed)
    steps = 0
    while not sched.done() and steps < max_steps:
        out = sched.schedule()
        pad_to = sched.pad_to(out)
        batches = []
        for pool in pools:
            pool.apply(out)
            batches.append(pool.prepare(out, pad_to))
        yield batches
        targets = {r: int(rng.integers(config.vocab_size)) for r in sched.sampling_req_ids(out)}
        ids = np.array([targets.get(r, 0) for r in batches[0].req_ids], np.int64)
        for pool, batch in zip(pools, batches, strict=True):
            pool.record_sampled(batch, as_backend_ids(batch, ids))
        sched.update(out, targets)
        steps += 1


def as_backend_ids(batch: BatchInputs, ids: np.ndarray) -> Any:
    """`ids` in the array type of the batch's backend (a torch tensor for a batch of torch tensors)."""
    if isinstance(batch.positions, np.ndarray):
        return ids
    import torch

    return torch.from_numpy(ids).to(batch.positions.device)


def dense_masked_attention(
    query: np.ndarray,  # [num_tokens, num_heads, head_dim] float64, the real queries
    keys: list[np.ndarray],  # per real token: [p + 1, num_kv_heads, head_dim] its request's keys at positions 0..p
    values: list[np.ndarray],  # per real token: [p + 1, num_kv_heads, head_dim]
    topk: np.ndarray,  # [num_tokens, top_k] positions, -1: none
    scale: float,
) -> tuple[np.ndarray, np.ndarray]:  # ([num_tokens, num_heads, head_dim], [num_tokens, num_heads]) float64
    """Full causal attention of each query over its request, with every position outside its row masked."""
    num_tokens, num_heads, head_dim = query.shape
    out = np.zeros((num_tokens, num_heads, head_dim))
    lse = np.full((num_tokens, num_heads), -np.inf)
    for t in range(num_tokens):
        chosen = set(int(i) for i in topk[t] if i >= 0)
        if not chosen:
            continue
        group = num_heads // keys[t].shape[1]
        k = np.repeat(keys[t], group, axis=1)  # [p + 1, num_heads, head_dim]
        v = np.repeat(values[t], group, axis=1)
        logits = np.einsum("hd,khd->hk", query[t], k) * scale
        mask = np.array([i in chosen for i in range(k.shape[0])])
        logits = np.where(mask[None, :], logits, -np.inf)
        peak = logits.max(axis=1, keepdims=True)
        weights = np.exp(logits - peak)
        out[t] = np.einsum("hk,khd->hd", weights / weights.sum(axis=1, keepdims=True), v)
        lse[t] = peak[:, 0] + np.log(weights.sum(axis=1))
    return out, lse


class TinyLatent:
    """An MLA token's cache entry and absorbed query from its id and position (float64), the same whichever request
    or rank computes it, so a prefix-cache hit's shared positions hold what the request's own tokens would."""

    def __init__(self, vocab_size: int, rank: int, rope: int, num_heads: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.c = rng.standard_normal((vocab_size, rank))  # [vocab, L]
        self.pe = rng.standard_normal((vocab_size, rope))  # [vocab, R]
        self.q = rng.standard_normal((vocab_size, num_heads, rank))  # [vocab, H, L]
        self.q_pe = rng.standard_normal((vocab_size, num_heads, rope))  # [vocab, H, R]

    def entries(self, ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [n, L], [n, R]
        angle = 0.3 * positions.astype(np.float64)[:, None]
        return self.c[ids] + np.sin(angle), self.pe[ids] * np.cos(angle)

    def queries(self, ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [n, H, L], [n, H, R]
        angle = 0.3 * positions.astype(np.float64)[:, None, None]
        return self.q[ids] * np.cos(angle), self.q_pe[ids] * np.sin(angle + 1.0)


def dense_masked_mla(
    q_latent: np.ndarray,  # [num_tokens, num_heads, L] float64, the real queries
    q_pe: np.ndarray,  # [num_tokens, num_heads, R] float64
    entries: list[np.ndarray],  # per real token: [p + 1, L + R] the values its request's positions 0..p hold
    topk: np.ndarray,  # [num_tokens, top_k] positions, -1: none
    scale: float,
) -> tuple[np.ndarray, np.ndarray]:  # ([num_tokens, num_heads, L], [num_tokens, num_heads]) float64
    """The absorbed MLA decode of each query over every position of its request up to its own, with the positions
    outside its row masked: a latent is its own value, every head reads the one entry."""
    num_tokens, num_heads, rank = q_latent.shape
    out = np.zeros((num_tokens, num_heads, rank))
    lse = np.full((num_tokens, num_heads), -np.inf)
    for t in range(num_tokens):
        chosen = set(int(i) for i in topk[t] if i >= 0)
        if not chosen:
            continue
        latents, k_pe = entries[t][:, :rank], entries[t][:, rank:]
        mask = np.array([i in chosen for i in range(latents.shape[0])])
        for h in range(num_heads):
            logits = np.array([q_latent[t, h] @ latents[i] + q_pe[t, h] @ k_pe[i] for i in range(latents.shape[0])])
            logits = np.where(mask, logits * scale, -np.inf)
            weights = np.exp(logits - logits.max())
            out[t, h] = weights @ latents / weights.sum()
            lse[t, h] = logits.max() + np.log(weights.sum())
    return out, lse
