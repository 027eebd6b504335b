"""The shadow checker's comparison: an engine's arrays against spec's batch, request by request.

Request r's tokens are found through the engine's query_start_loc (or, without one, laid end to end in
the engine's order) and compared with spec's tokens of r; indices into the flat tokens relative to the
request's first token, indices into the sampler's logits rows relative to the request's first logits
row. Requests the checker no longer follows (`skipped`) keep their place in the engine's layout and are
not compared. `differences` yields each divergence as (req_id, field, detail); req_id None: the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from shadow.compare import entries_difference
from shadow.inputs import GROUPED, REQUEST_FIELDS, TOKEN_FIELDS
from spec.interop.vllm import VllmSchedulerOutput
from spec.types import NULL_BLOCK_ID, PAD_SLOT_ID, BatchInputs, WorkerConfig

Difference = tuple[str | None, str, str]


@dataclass(frozen=True)
class EngineStep:
    """One step as the engine laid it out: its batch order and what it was told to schedule."""

    arrays: Mapping[str, np.ndarray]
    req_ids: Sequence[str]  # [num_reqs] the engine's batch_idx -> req_id
    num_scheduled: Mapping[str, int]  # req_id -> tokens, every request of the engine's batch
    num_drafts: Mapping[str, int]  # req_id -> drafts (absent: none)
    skipped: frozenset[str]  # requests not compared (spec no longer follows them)

    def query_start_loc(self) -> np.ndarray | None:
        """[num_reqs + 1] the engine's offsets (given, or its tokens end to end); None if too short."""
        if "query_start_loc" in self.arrays:
            qsl = self.arrays["query_start_loc"].astype(np.int64)
            return qsl if qsl.shape[0] >= len(self.req_ids) + 1 else None
        counts = [self.num_scheduled.get(r, 0) for r in self.req_ids]
        return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])


def differences(
    batch: BatchInputs, engine: EngineStep, blocks_held: Callable[[str, int], int], num_groups: int
) -> Iterator[Difference]:
    """Every divergence of the step, in spec's batch order (batch-level ones first where they block the rest)."""
    a = engine.arrays
    scheduled = list(batch.req_ids)
    compared = [r for r in engine.req_ids if r not in engine.skipped]
    if sorted(compared) != sorted(scheduled) or len(set(engine.req_ids)) != len(engine.req_ids):
        missing, extra = set(scheduled) - set(compared), set(compared) - set(scheduled)
        req = sorted(missing or extra)[0] if missing or extra else None
        yield req, "req_ids", f"engine batch {list(engine.req_ids)}, spec schedules {sorted(scheduled)}"
        return
    engine_qsl = engine.query_start_loc()
    if engine_qsl is None:
        yield None, "query_start_loc", f"{a['query_start_loc'].shape[0]} entries for {len(engine.req_ids)} requests"
        return
    by_group = {(m.group(1), int(m.group(2) or 0)): name for name in a if (m := GROUPED.match(name))}
    for (_kind, g), name in sorted(by_group.items()):
        if g >= num_groups:
            yield None, name, f"group {g}, the config has {num_groups}"
            return

    engine_idx = {r: e for e, r in enumerate(engine.req_ids)}  # req_id -> the engine's batch_idx
    mine = _SpecRows(batch)
    theirs = _Layout([engine.num_drafts.get(r, 0) for r in engine.req_ids])
    sampler = {name for name in _SAMPLER_LENGTHS if name in a}
    for name in sorted(sampler):
        want = _SAMPLER_LENGTHS[name](theirs)
        if a[name].ndim != 1 or a[name].shape[0] != want:
            yield None, name, f"shape {a[name].shape}, the engine's batch needs [{want}]"
            sampler.discard(name)
    token_fields = [(name, np.asarray(getattr(batch, name))) for name in TOKEN_FIELDS if name in a]
    token_fields += [
        (name, np.asarray(batch.slot_mappings[g]))
        for (kind, g), name in sorted(by_group.items())
        if kind == "slot_mapping"
    ]

    for b, req_id in enumerate(scheduled):
        e = engine_idx[req_id]
        start, n = int(mine.qsl[b]), int(mine.num_scheduled[b])
        e_start, e_n = int(engine_qsl[e]), int(engine_qsl[e + 1] - engine_qsl[e])
        if e_n != n:
            yield req_id, "query_start_loc", f"{e_n} tokens at engine batch index {e}, spec schedules {n}"
            continue
        want_counts = {"num_scheduled_tokens": n, "seq_lens": int(mine.seq_lens[b])}
        for name in REQUEST_FIELDS:
            if name in a and int(a[name][e]) != want_counts[name]:
                yield req_id, name, f"{int(a[name][e])}, spec {want_counts[name]}"
        yield from _sampler_differences(req_id, a, sampler, e, e_start, theirs, b, start, mine)
        for name, spec_tokens in token_fields:
            got_tokens = a[name][e_start : e_start + n].astype(np.int64)
            want_tokens = spec_tokens[start : start + n].astype(np.int64)
            if detail := entries_difference(want_tokens, got_tokens, "its token", "spec"):
                yield req_id, name, detail
        for (kind, g), name in sorted(by_group.items()):
            if kind != "block_table":
                continue
            k = blocks_held(req_id, g)
            row = a[name][e] if a[name].ndim == 2 and a[name].shape[0] > e else np.zeros(0, np.int64)
            got_row, want_row = row[:k].astype(np.int64), np.asarray(batch.block_tables[g])[b, :k].astype(np.int64)
            if detail := entries_difference(want_row, got_row, "entry", "spec"):
                yield req_id, name, f"its {k} entries: {detail}"

    total = int(engine_qsl[len(engine.req_ids)])
    for (kind, _g), name in sorted(by_group.items()):
        padding = a[name][total:] if kind == "slot_mapping" else np.zeros(0)
        if np.any(padding != PAD_SLOT_ID):
            where = total + int(np.flatnonzero(padding != PAD_SLOT_ID)[0])
            yield None, name, f"padding token {where} has slot {int(a[name][where])}, not PAD_SLOT_ID"


class _Layout:
    """Where each batch row's logits rows and drafts lie, given its draft counts: [num_reqs] each."""

    def __init__(self, num_drafts: Sequence[int] | np.ndarray) -> None:
        self.k = np.asarray(num_drafts, np.int64).reshape(-1)
        self.sampled_start = np.cumsum(self.k + 1) - (self.k + 1)  # first logits row of each batch row
        self.draft_start = np.cumsum(self.k) - self.k  # first draft of each batch row
        self.num_rows, self.num_drafts = int((self.k + 1).sum()), int(self.k.sum())


_SAMPLER_LENGTHS: dict[str, Callable[[_Layout], int]] = {
    "logits_indices": lambda t: t.num_rows,
    "draft_token_ids": lambda t: t.num_drafts,
    "target_logits_indices": lambda t: t.num_drafts,
    "num_draft_tokens": lambda t: len(t.k),
    "cu_num_draft_tokens": lambda t: len(t.k),
    "cu_num_sampled_tokens": lambda t: len(t.k),
    "bonus_logits_indices": lambda t: len(t.k),
}


class _SpecRows:
    """spec's batch per row, its sampler fields filled in for a step without drafts (where they are None)."""

    def __init__(self, batch: BatchInputs) -> None:
        self.qsl = np.asarray(batch.query_start_loc, np.int64)
        self.num_scheduled = np.asarray(batch.num_scheduled_tokens, np.int64)
        self.seq_lens = np.asarray(batch.seq_lens, np.int64)
        self.logits = np.asarray(batch.logits_indices, np.int64)
        drafting = batch.num_draft_tokens is not None
        self.layout = _Layout(np.asarray(batch.num_draft_tokens) if drafting else np.zeros(batch.num_reqs, np.int64))
        self.drafts = np.asarray(batch.draft_token_ids, np.int64) if drafting else np.zeros(0, np.int64)
        self.target = np.asarray(batch.target_logits_indices, np.int64) if drafting else np.zeros(0, np.int64)
        self.bonus = np.asarray(batch.bonus_logits_indices, np.int64) if drafting else self.layout.sampled_start


def _sampler_differences(
    req_id: str,
    a: Mapping[str, np.ndarray],
    fields: set[str],
    e: int,
    e_start: int,
    theirs: _Layout,
    b: int,
    start: int,
    mine: _SpecRows,
) -> Iterator[Difference]:
    """The request's logits indices and SpecDecodeMetadata fields, each relative to where its own rows begin."""
    k = int(mine.layout.k[b])
    s, s_spec = int(theirs.sampled_start[e]), int(mine.layout.sampled_start[b])  # first logits row: engine, spec
    d, d_spec = int(theirs.draft_start[e]), int(mine.layout.draft_start[b])  # first draft: engine, spec
    relative = " (relative to the request's first token)"
    if "logits_indices" in fields:
        got = a["logits_indices"][s : s + 1 + k].astype(np.int64) - e_start
        want = mine.logits[s_spec : s_spec + 1 + k] - start
        if detail := entries_difference(want, got, "its logits row", "spec"):
            yield req_id, "logits_indices", detail + relative

    def own(x: np.ndarray) -> int:  # this request's step of a cumulative sum
        return int(x[e] - (x[e - 1] if e else 0))

    counts = {
        "num_draft_tokens": (lambda x: int(x[e]), k),
        "cu_num_draft_tokens": (own, k),
        "cu_num_sampled_tokens": (own, k + 1),
    }
    for name, (read, want_count) in counts.items():
        if name in fields and read(a[name].astype(np.int64)) != want_count:
            what = "" if name == "num_draft_tokens" else " (this request's step of the cumulative sum)"
            yield req_id, name, f"{read(a[name].astype(np.int64))}{what}, spec {want_count}"
    if "draft_token_ids" in fields:
        got, want = a["draft_token_ids"][d : d + k].astype(np.int64), mine.drafts[d_spec : d_spec + k]
        if detail := entries_difference(want, got, "its draft", "spec"):
            yield req_id, "draft_token_ids", detail
    rows = " (rows of logits[logits_indices], relative to the request's first)"
    if "target_logits_indices" in fields:
        got, want = (
            a["target_logits_indices"][d : d + k].astype(np.int64) - s,
            mine.target[d_spec : d_spec + k] - s_spec,
        )
        if detail := entries_difference(want, got, "its draft", "spec"):
            yield req_id, "target_logits_indices", detail + rows
    if "bonus_logits_indices" in fields and int(a["bonus_logits_indices"][e]) - s != int(mine.bonus[b]) - s_spec:
        yield (
            req_id,
            "bonus_logits_indices",
            f"{int(a['bonus_logits_indices'][e]) - s}, spec {int(mine.bonus[b]) - s_spec}{rows}",
        )


def vllm_claims(
    record: VllmSchedulerOutput, batch: BatchInputs, config: WorkerConfig, table_of: Callable[[int, int], np.ndarray]
) -> Iterator[Difference]:
    """What a vLLM output claims about KV that spec's tables can confirm (after the step is applied).

    `new_block_ids_to_zero`: no zeroed block may hold KV a scheduled token reads (written by an earlier
    step, within the window). `num_common_prefix_blocks[g]`: every scheduled request's table starts with
    the same that many blocks. `table_of(b, g)` is spec's table row of batch row b after the step.
    """
    zeroed = set(record.new_block_ids_to_zero or ())
    num_scheduled, seq_lens = np.asarray(batch.num_scheduled_tokens), np.asarray(batch.seq_lens)
    for b, req_id in enumerate(batch.req_ids) if zeroed else ():
        computed = int(seq_lens[b] - num_scheduled[b])  # positions whose KV earlier steps wrote
        for g, group in enumerate(config.kv_groups):
            low = 0 if group.sliding_window is None else max(0, computed - group.sliding_window + 1)
            entries = table_of(b, g)[low // group.block_size : -(-computed // group.block_size)]
            hit = [int(x) for x in entries if int(x) in zeroed and x != NULL_BLOCK_ID]
            if hit:
                detail = f"block {hit[0]} of group {g} holds KV this step reads (positions {low}..{computed - 1})"
                yield req_id, "new_block_ids_to_zero", detail
    counts = record.num_common_prefix_blocks
    if counts and len(counts) != len(config.kv_groups):
        yield None, "num_common_prefix_blocks", f"{len(counts)} entries for {len(config.kv_groups)} KV cache groups"
        return
    for g, n in enumerate(counts):
        if n and batch.num_reqs:
            first = table_of(0, g)[:n]
            for b, req_id in enumerate(batch.req_ids):
                row = table_of(b, g)[:n]  # a table narrower than the claim holds fewer than n: a wrong claim too
                if len(row) < n or not np.array_equal(row, first) or (row == NULL_BLOCK_ID).any():
                    detail = f"{n} common blocks in group {g}, but this request's first {n} are {row.tolist()}"
                    yield req_id, "num_common_prefix_blocks", detail
                    break
