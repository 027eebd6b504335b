"""Benchmark workloads: batch shapes from the issue, and an endless stream of valid steps for each.

Continuing requests come as one spec.types.CachedRequestColumns, the columnar form vLLM's scheduler
hands its workers (CachedRequestData); `-objects` workloads send one CachedRequest per request instead,
to show what the object form costs. A running request's id is the same str object in every step's output, as in
vLLM's (its scheduler sends each Request's own request_id): an id list compared with the last step's then matches
by identity, where fresh strings (equal, but made anew each step) were compared byte by byte after the peer's round
had evicted the last step's, one cache miss a request.

A workload is `num_decodes` running requests (contexts drawn from [min_context, max_context]) plus
`num_prefills` fresh prompts of `prefill_len` tokens per step. `StepStream` produces the steady state
an engine sees: every step each decode advances one token (a new block whenever it crosses a block
boundary) and the previous step's prefills finish while new ones arrive, so apply, prepare and
record_sampled can be timed step after step without the pool drifting into another regime.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from spec.types import (
    PLACEHOLDER_TOKEN_ID,
    CachedRequest,
    CachedRequestColumns,
    KVCacheGroup,
    NewRequest,
    SchedulerOutput,
    WorkerConfig,
)

MAX_STREAM_STEPS = 512  # decode steps a stream can take before a request would outgrow max_model_len
VOCAB_SIZE = 32_000
SEED = 1234


@dataclass(frozen=True)
class Workload:
    name: str
    num_decodes: int
    num_prefills: int = 0
    prefill_len: int = 0
    num_groups: int = 1  # 1, or 3: block sizes 16, 32 and a sliding-window group of 16
    # two groups (full attention, a window of 1024; blocks of 16) drawing on one block pool: vLLM's form for hybrid
    # models, where every step checks no id is held in both groups (spec/validate.py, check 9)
    one_pool: bool = False
    quick: bool = False  # in the CI subset (`-m quick`)
    min_context: int = 1024
    max_context: int = 4096
    objects: bool = False  # cached requests as CachedRequest objects instead of CachedRequestColumns
    drafts: int = 0  # drafts per decode per step, every one accepted (decode workloads only)

    @property
    def num_reqs(self) -> int:
        return self.num_decodes + self.num_prefills

    @property
    def num_tokens(self) -> int:
        return self.num_decodes * (1 + self.drafts) + self.num_prefills * self.prefill_len

    @property
    def kind(self) -> str:
        if self.num_prefills == 0:
            return "decode"
        return "prefill" if self.num_decodes == 0 else "mixed"

    def groups(self) -> tuple[tuple[int, int | None], ...]:  # (block_size, sliding_window) per group
        if self.one_pool:
            return ((16, None), (16, 1024))
        return ((16, None),) if self.num_groups == 1 else ((16, None), (32, None), (16, 1024))

    def __str__(self) -> str:
        return self.name


def decode(n: int, groups: int = 1, quick: bool = False) -> Workload:
    return Workload(f"decode-{n}" + ("-g3" if groups == 3 else ""), n, num_groups=groups, quick=quick)


# The sizes. Host stages run all of them; kernels run the ones that fit a CPU's memory and time.
HOST_WORKLOADS = (
    decode(8, quick=True),
    decode(64, quick=True),
    decode(256),
    decode(1024),
    decode(8, groups=3, quick=True),
    decode(256, groups=3),
    Workload("decode-256-pool2", 256, num_groups=2, one_pool=True),
    Workload("decode-256-objects", 256, objects=True),
    Workload("prefill-4x512", 0, 4, 512, quick=True),
    Workload("prefill-16x2048", 0, 16, 2048),
    Workload("mixed-64+2x512", 64, 2, 512, quick=True),
    Workload("mixed-256+4x512", 256, 4, 512),
    Workload("mixed-200+8x2048", 200, 8, 2048),  # decodes beside several whole long prompts
)

# async scheduling's cost beside the synchronous step: the host workloads, and decodes that draft every step (all
# drafts accepted, so the async step counts what the synchronous one does; drafts proposed on the device there)
ASYNC_WORKLOADS = (*HOST_WORKLOADS, Workload("decode-64-drafts3", 64, drafts=3, quick=True))

KERNEL_WORKLOADS = (  # write_kv and paged_attention
    decode(8, quick=True),
    decode(64),
    decode(256),
    decode(1024),
    Workload("prefill-4x512", 0, 4, 512, quick=True),
    Workload("prefill-16x2048", 0, 16, 2048),
    Workload("mixed-64+2x512", 64, 2, 512),
)
LAYER_WORKLOADS = (decode(8, quick=True), decode(64), decode(256), Workload("mixed-64+2x512", 64, 2, 512))

# Sizes left out of CPU runs (a 2-core CI-class machine); a CUDA run measures them all.
CPU_TRIMS: dict[tuple[str, str], str] = {
    ("decode-1024", "*"): "KV cache of 1024 x 2.5k tokens: trimmed on CPU (memory and time)",
    ("prefill-16x2048", "spec@paged_attention"): "spec's float32 einsum over 2048x2048 logits: minutes per call",
    ("decode-256", "spec@layer_step"): "spec's attention alone takes seconds per step at 256 requests (time)",
}


def cpu_trim_reason(workload: Workload, provider: str, stage: str) -> str | None:
    for key in ((workload.name, "*"), (workload.name, provider), (workload.name, f"{provider}@{stage}")):
        if key in CPU_TRIMS:
            return CPU_TRIMS[key]
    return None


@dataclass(frozen=True)
class _Layout:
    config: WorkerConfig
    contexts: tuple[int, ...]  # [num_decodes]
    decode_ids: tuple[str, ...]  # [num_decodes] each running request's id, the same str object every step
    decode_blocks: tuple[np.ndarray, ...]  # per group: [num_decodes, max_blocks_per_req] physical ids
    prefill_blocks: tuple[np.ndarray, ...]  # per group: [2 banks, num_prefills, blocks per prompt]
    first: SchedulerOutput  # adds every request; decodes enter with a prefix hit of context - 1 tokens


@functools.lru_cache(maxsize=4)
def _layout(w: Workload) -> _Layout:
    """Everything about a workload that does not change step to step (cached: prompts are large)."""
    rng = np.random.default_rng(SEED)
    contexts = tuple(int(c) for c in rng.integers(w.min_context, w.max_context + 1, w.num_decodes))
    max_model_len = max(w.max_context, w.prefill_len) + MAX_STREAM_STEPS * (1 + w.drafts) + 1
    groups, decode_blocks, prefill_blocks = [], [], []
    needs = [  # per group: (blocks per running request, blocks per prompt)
        (math.ceil(max_model_len / block_size), math.ceil(w.prefill_len / block_size)) for block_size, _ in w.groups()
    ]
    sizes = [w.num_decodes * per_req + 2 * w.num_prefills * per_prompt for per_req, per_prompt in needs]
    # one pool: every group's ids from one free list, so one id range; else an id range per group
    pooled_ids = rng.permutation(np.arange(1, 1 + sum(sizes), dtype=np.int64)) if w.one_pool else None
    for g, ((block_size, window), (per_req, per_prompt)) in enumerate(zip(w.groups(), needs, strict=True)):
        if pooled_ids is not None:
            num_blocks = 1 + sum(sizes)
            ids = pooled_ids[sum(sizes[:g]) : sum(sizes[: g + 1])]
        else:
            num_blocks = 1 + sizes[g]
            ids = rng.permutation(np.arange(1, num_blocks, dtype=np.int64))  # an allocator's scattered free list
        decode_blocks.append(ids[: w.num_decodes * per_req].reshape(w.num_decodes, per_req))
        prefill_blocks.append(ids[w.num_decodes * per_req :].reshape(2, w.num_prefills, per_prompt))
        groups.append(KVCacheGroup(block_size, num_blocks, window))
    config = WorkerConfig(
        max_num_reqs=max(w.num_reqs * 2, 8),
        max_model_len=max_model_len,
        max_num_batched_tokens=max(w.num_tokens, 8),
        vocab_size=VOCAB_SIZE,
        kv_groups=tuple(groups),
        one_block_pool=w.one_pool,
    )
    new, scheduled = [], {}
    decode_ids = tuple(f"d{i}" for i in range(w.num_decodes))
    for i, ctx in enumerate(contexts):
        prompt = tuple(rng.integers(0, VOCAB_SIZE, ctx).tolist())
        blocks = tuple(
            tuple(decode_blocks[g][i, : math.ceil(ctx / bs)].tolist()) for g, (bs, _) in enumerate(w.groups())
        )
        new.append(NewRequest(decode_ids[i], prompt, blocks, num_computed_tokens=ctx - 1))
        scheduled[decode_ids[i]] = 1
    for req in _prefills(w, prefill_blocks, step=0):
        new.append(req)
        scheduled[req.req_id] = w.prefill_len
    first = SchedulerOutput(new_requests=tuple(new), num_scheduled_tokens=scheduled)
    return _Layout(config, contexts, decode_ids, tuple(decode_blocks), tuple(prefill_blocks), first)


@functools.lru_cache(maxsize=2)
def _prompt(length: int, i: int) -> tuple[int, ...]:
    return tuple(np.random.default_rng(SEED + i).integers(0, VOCAB_SIZE, length).tolist())


def _prefills(w: Workload, prefill_blocks: list[np.ndarray] | tuple[np.ndarray, ...], step: int) -> list[NewRequest]:
    bank = step % 2  # last step's prefills finish in this step, so their blocks are still taken: alternate
    return [
        NewRequest(
            f"p{step}.{i}",
            _prompt(w.prefill_len, i),
            tuple(tuple(blocks[bank, i].tolist()) for blocks in prefill_blocks),
        )
        for i in range(w.num_prefills)
    ]


class StepStream:
    """first() then next(), next(), ...: the scheduler outputs of consecutive steps of one workload.

    A drafting workload's decodes carry the same drafts every step, all accepted; `on_device` sends them as
    placeholders (async scheduling's drafts proposed on the device, spec/async_steps.py rule 8), and each record
    then hands the pool the drafter's ids (`next_drafts`)."""

    def __init__(self, workload: Workload, on_device: bool = False) -> None:
        if workload.drafts and workload.num_prefills:
            raise ValueError(f"{workload.name}: drafting workloads are decodes only (every row keeps the same ids)")
        self.workload = workload
        self.layout = _layout(workload)
        self.config = self.layout.config
        self.step = 0
        self.on_device = on_device and workload.drafts > 0
        self._sampled = np.random.default_rng(SEED).integers(0, VOCAB_SIZE, workload.num_reqs, dtype=np.int64)
        self._drafts = tuple(int(t) for t in self._sampled[1 : 1 + workload.drafts])  # every decode's drafts
        # The last two outputs stay referenced here, so the step before the one a pool applies is freed in the
        # next call to next() (untimed), never inside a timed round. A pool that keeps the output it applied
        # last (to check prepare's argument) would otherwise free the one before inside its apply: for a
        # prefill step that is tens of thousands of prompt ints, about 160 us of 800 at 16x2048, a cost of the
        # caller's objects that every provider's caller pays once per step, timed for some providers only.
        self._recent: tuple[SchedulerOutput | None, SchedulerOutput | None] = (None, None)

    def first(self) -> SchedulerOutput:
        self.step = 0
        return self.layout.first

    def next(self) -> SchedulerOutput:
        self.step += 1
        w, k, layout = self.workload, self.step, self.layout
        if k > MAX_STREAM_STEPS:
            raise RuntimeError(f"{w.name}: more than {MAX_STREAM_STEPS} steps; raise MAX_STREAM_STEPS")
        req_ids, computed, added, scheduled = [], [], [], {}
        for i, ctx in enumerate(layout.contexts):
            position = ctx - 1 + 1 + (k - 1) * (1 + w.drafts)  # the token after the one sampled last step
            reach = range(position, position + 1 + w.drafts)  # it and this step's drafts
            new_blocks = [
                tuple(int(blocks[i, p // bs]) for p in reach if p % bs == 0)
                for blocks, (bs, _) in zip(layout.decode_blocks, w.groups(), strict=True)
            ]
            req_id = layout.decode_ids[i]  # the same object every step, as vLLM's scheduler sends req.request_id
            req_ids.append(req_id)
            computed.append(position)
            added.append(tuple(new_blocks) if any(new_blocks) else None)
            scheduled[req_id] = 1 + w.drafts
        cached: tuple[CachedRequest, ...] | CachedRequestColumns = CachedRequestColumns(req_ids, computed, added)
        if w.objects:
            cached = tuple(cached)
        new = _prefills(w, layout.prefill_blocks, k)
        scheduled.update({r.req_id: w.prefill_len for r in new})
        finished = frozenset(f"p{k - 1}.{i}" for i in range(w.num_prefills))
        drafts = (PLACEHOLDER_TOKEN_ID,) * w.drafts if self.on_device else self._drafts
        spec_decode = dict.fromkeys(layout.decode_ids, drafts) if w.drafts else {}
        out = SchedulerOutput(tuple(new), cached, scheduled, finished, spec_decode)
        self._recent = (self._recent[1], out)
        return out

    def sampled(self, num_reqs: int) -> np.ndarray:  # [num_reqs] or [num_reqs, 1 + drafts] int64: what is kept
        if not self.workload.drafts:
            return self._sampled[:num_reqs]
        kept = (*self._drafts, int(self._sampled[0]))  # every draft accepted, then the bonus token
        return np.tile(np.array(kept, np.int64), (num_reqs, 1))

    def next_drafts(self, num_reqs: int) -> np.ndarray | None:  # [num_reqs, drafts] the drafter's ids, or None
        return np.tile(np.array(self._drafts, np.int64), (num_reqs, 1)) if self.on_device else None
