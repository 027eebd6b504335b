"""Baseline 2: vectorised NumPy over persistent arrays, the way vLLM v1's GPU model runner builds inputs on the CPU.

State lives in preallocated arrays indexed by row (token ids, progress, block tables); `apply` is a
Python loop over the scheduler's requests writing into them (vLLM's `_update_states`); `prepare` is
index arithmetic over whole arrays (`np.repeat` of request indices, `cumsum` offsets, flat gathers
from the token and block-table buffers, vLLM's `_prepare_inputs`) into persistent output buffers.
No validation: the scheduler is trusted. This is the strongest CPU peer. As in vLLM, the arrays of
the returned BatchInputs are views of persistent buffers, valid until the next `prepare`.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from spec.classify import classify
from spec.types import (
    PAD_SLOT_ID,
    BatchInputs,
    CachedRequestColumns,
    PoolSnapshot,
    RowSnapshot,
    SchedulerOutput,
    WorkerConfig,
)


class NumpyVectorisedPool:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        rows, groups = config.max_num_reqs, config.kv_groups
        max_tokens = config.max_num_batched_tokens
        self.req_ids: list[str | None] = [None] * rows  # req_state_idx -> req_id
        self.row_of_req: dict[str, int] = {}  # req_id -> req_state_idx
        self.free_rows = list(range(rows))  # a heap: new requests take the lowest row
        self.token_ids = np.zeros((rows, config.max_model_len), np.int32)  # [R, max_model_len], int32 as vLLM's
        self.num_tokens = np.zeros(rows, np.int64)  # [R] known tokens
        self.num_computed_tokens = np.zeros(rows, np.int64)  # [R]
        self.prompt_lens = np.zeros(rows, np.int64)  # [R] what the rows' classification reads (spec/classify.py)
        self.num_blocks = np.zeros((len(groups), rows), np.int64)  # [G, R] filled table entries
        self.block_tables = [  # per group: [R, max_blocks_per_req(g)]
            np.zeros((rows, config.max_blocks_per_req(g)), np.int32) for g in range(len(groups))
        ]
        self.arange = np.arange(max(max_tokens, rows) + 1, dtype=np.int64)  # [max_tokens + 1]
        # Persistent output buffers, sized for the largest step (vLLM's *_cpu tensors).
        self.positions = np.zeros(max_tokens, np.int64)  # [max_tokens]
        self.input_ids = np.zeros(max_tokens, np.int64)  # [max_tokens]
        self.slot_mappings = [np.zeros(max_tokens, np.int64) for _ in groups]  # per group: [max_tokens]
        self.query_start_loc = np.zeros(rows + 1, np.int32)  # [R + 1]

    def apply(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            row = self.row_of_req.pop(req_id)
            self.req_ids[row] = None
            self.num_tokens[row] = self.num_computed_tokens[row] = self.prompt_lens[row] = 0
            self.num_blocks[:, row] = 0
            for table in self.block_tables:
                table[row] = 0
            heapq.heappush(self.free_rows, row)
        for new in sched.new_requests:
            row = heapq.heappop(self.free_rows)
            self.req_ids[row], self.row_of_req[new.req_id] = new.req_id, row
            prompt = np.asarray(new.prompt_token_ids, np.int32)
            self.token_ids[row, : prompt.size] = prompt
            self.num_tokens[row] = self.prompt_lens[row] = prompt.size
            self.num_computed_tokens[row] = new.num_computed_tokens
            for g, ids in enumerate(new.block_ids):
                self.block_tables[g][row, : len(ids)] = ids
                self.num_blocks[g, row] = len(ids)
        cached = sched.cached_requests
        if isinstance(cached, CachedRequestColumns):  # vLLM's CachedRequestData: parallel lists
            req_ids, computed = cached.req_ids, cached.num_computed_tokens
            added = cached.new_block_ids or [None] * len(req_ids)
            resumed = [r in cached.resumed_req_ids for r in req_ids] if cached.resumed_req_ids else None
        else:
            req_ids, computed = [c.req_id for c in cached], [c.num_computed_tokens for c in cached]
            added, resumed = [c.new_block_ids for c in cached], [c.resumed for c in cached]
        rows = [self.row_of_req[r] for r in req_ids]
        self.num_computed_tokens[rows] = computed
        for i, row in enumerate(rows):
            if resumed is not None and resumed[i]:
                self.num_blocks[:, row] = 0
                for table in self.block_tables:
                    table[row] = 0
            for g, ids in enumerate(added[i] or ()):
                if ids:
                    start = self.num_blocks[g, row]
                    self.block_tables[g][row, start : start + len(ids)] = ids
                    self.num_blocks[g, row] = start + len(ids)

    def prepare(self, sched: SchedulerOutput, pad_to: int | None = None) -> BatchInputs:
        scheduled = sched.num_scheduled_tokens
        num_reqs = len(scheduled)
        ids = list(scheduled)
        counts = np.fromiter(scheduled.values(), np.int32, num_reqs)
        order = np.argsort(counts, kind="stable")  # decodes first, ties in scheduler order
        rows = np.fromiter((self.row_of_req[r] for r in ids), np.int32, num_reqs)
        index_mapping = rows[order]  # [num_reqs] batch_idx -> req_state_idx
        num_scheduled = counts[order]  # [num_reqs]
        cu_num_tokens = np.cumsum(num_scheduled)  # [num_reqs]
        num_tokens = int(cu_num_tokens[-1])
        padded = num_tokens if pad_to is None else pad_to

        if padded > self.positions.shape[0]:  # padding past the token budget: grow, once per new size
            self._grow(padded)
        token_rows = np.repeat(index_mapping, num_scheduled)  # [num_tokens] flat token -> req_state_idx
        offsets = self.arange[:num_tokens] - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        positions = self.positions[:padded]
        np.add(self.num_computed_tokens[token_rows], offsets, out=positions[:num_tokens])
        positions[num_tokens:] = 0
        max_len = self.token_ids.shape[1]
        input_ids = self.input_ids[:padded]
        input_ids[:num_tokens] = np.take(self.token_ids.ravel(), token_rows * max_len + positions[:num_tokens])
        input_ids[num_tokens:] = 0
        slot_mappings = []
        for g, group in enumerate(self.config.kv_groups):
            table, bs = self.block_tables[g], group.block_size
            flat_index = token_rows * table.shape[1] + positions[:num_tokens] // bs
            slots = self.slot_mappings[g][:padded]
            np.multiply(np.take(table.ravel(), flat_index), bs, out=slots[:num_tokens])  # int64: may pass 2**31
            slots[:num_tokens] += positions[:num_tokens] % bs
            slots[num_tokens:] = PAD_SLOT_ID
            slot_mappings.append(slots)
        query_start_loc = self.query_start_loc[: num_reqs + 1]
        query_start_loc[1:] = cu_num_tokens
        return BatchInputs(
            req_ids=tuple(ids[i] for i in order.tolist()),
            index_mapping=index_mapping,
            num_scheduled_tokens=num_scheduled,
            query_start_loc=query_start_loc,
            positions=positions,
            input_ids=input_ids,
            seq_lens=(self.num_computed_tokens[index_mapping] + num_scheduled).astype(np.int32),
            # the batch every slotmap backend returns carries its rows' classes: computed the plain NumPy way
            row_classes=classify(
                num_scheduled, self.num_computed_tokens[index_mapping], self.prompt_lens[index_mapping], 1
            ),
            logits_indices=(cu_num_tokens - 1).astype(np.int32),
            block_tables=tuple(table[index_mapping] for table in self.block_tables),
            slot_mappings=tuple(slot_mappings),
            num_tokens=num_tokens,
            num_tokens_padded=padded,
        )

    def _grow(self, size: int) -> None:
        self.positions = np.zeros(size, np.int64)
        self.input_ids = np.zeros(size, np.int64)
        self.slot_mappings = [np.zeros(size, np.int64) for _ in self.slot_mappings]
        self.arange = np.arange(max(size, self.arange.shape[0]), dtype=np.int64)

    def record_sampled(self, batch: BatchInputs, sampled_token_ids: Any) -> None:
        rows = batch.index_mapping
        takes = batch.seq_lens == self.num_tokens[rows]  # [num_reqs] rows that reached their last token
        rows = rows[takes]
        self.token_ids[rows, self.num_tokens[rows]] = np.asarray(sampled_token_ids)[takes]
        self.num_tokens[rows] += 1

    def row_of(self, req_id: str) -> int:
        return self.row_of_req[req_id]

    def snapshot(self) -> PoolSnapshot:
        return tuple(
            RowSnapshot(
                row,
                req_id,
                tuple(self.token_ids[row, : self.num_tokens[row]].tolist()),
                int(self.num_computed_tokens[row]),
                tuple(tuple(t[row, : self.num_blocks[g, row]].tolist()) for g, t in enumerate(self.block_tables)),
            )
            for row, req_id in enumerate(self.req_ids)
            if req_id is not None
        )
