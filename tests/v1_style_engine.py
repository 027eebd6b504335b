"""A test-only engine in the style of vLLM v1's model runner, to show the shadow checker on a real loop.

It speaks vLLM's language, not slotmap's: it consumes vLLM-shaped scheduler outputs
(spec.interop.VllmSchedulerOutput, from conformance.scheduler.as_vllm) and keeps a persistent batch whose
batch index is the row:
- finished requests leave; requests not scheduled this step leave the batch (their state is kept);
  new and re-added requests fill the first hole, then the batch is condensed (`move_row` of the last
  rows into the holes) and reordered decodes-first by `swap_rows` (vLLM v1 reorders this way for
  attention backends that split decodes and prefills), so rows move every step;
- a new request carrying `prefill_token_ids` (model runner v2's form) starts from those tokens: v2 sends a
  preempted request back that way;
- conventions of v1: block-table width rounded to 128 tokens (spec.interop.vllm_table_width), unused
  entries 0, int32 input ids, slot buffers of max_num_batched_tokens with padding -1, and input-id /
  position buffers whose padding holds whatever an earlier step left there.

`bug="swap_keeps_block_table"` plants a classic persistent-batch bug: swap_rows swaps tokens and
progress but not the block-table rows, so a reordered request reads another's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from spec.interop import VllmSchedulerOutput, vllm_table_width
from spec.types import WorkerConfig

BUGS = (None, "swap_keeps_block_table")


@dataclass
class _RequestState:
    """What the engine remembers of a request, in or out of the batch (vLLM's CachedRequestState)."""

    token_ids: list[int]
    block_ids: list[list[int]]  # per group
    num_computed_tokens: int


@dataclass
class V1StyleEngine:
    config: WorkerConfig
    bug: str | None = None
    requests: dict[str, _RequestState] = field(default_factory=dict)
    batch: list[str | None] = field(default_factory=list)  # batch_idx (= row) -> req_id, None: a hole
    swaps: int = 0  # how many swap_rows the reorder did (the planted bug needs some)
    seq_lens: dict[str, int] = field(default_factory=dict)  # req_id -> seq_len of the last prepared step

    def __post_init__(self) -> None:
        if self.bug not in BUGS:
            raise ValueError(f"bug: one of {BUGS}, got {self.bug!r}")
        c = self.config
        rows, budget = c.max_num_reqs, c.max_num_batched_tokens
        self.token_ids = np.zeros((rows, c.max_model_len), np.int32)  # [R, L] v1 keeps int32 token ids
        self.num_tokens = np.zeros(rows, np.int64)  # [R]
        self.num_computed = np.zeros(rows, np.int64)  # [R]
        self.tables = [np.zeros((rows, vllm_table_width(c, g)), np.int32) for g in range(len(c.kv_groups))]
        self.num_blocks = np.zeros((len(c.kv_groups), rows), np.int64)  # [G, R]
        # step buffers, reused: their tails keep what earlier steps wrote
        self.input_ids = np.zeros(budget, np.int32)  # [max_num_batched_tokens]
        self.positions = np.zeros(budget, np.int64)  # [max_num_batched_tokens]
        self.slot_mapping = [np.zeros(budget, np.int64) for _ in c.kv_groups]  # per group [max_num_batched_tokens]

    # ---- the step --------------------------------------------------------------------------
    def execute(self, out: VllmSchedulerOutput) -> tuple[dict[str, np.ndarray], list[str]]:
        """Update the persistent batch and build the model inputs; returns (arrays, batch_idx -> req_id)."""
        self._update_states(out)
        order = [r for r in self.batch if r is not None]
        return self._prepare_inputs(out, order), order

    def record_sampled(self, sampled: dict[str, int]) -> None:
        for row, req_id in enumerate(self.batch):
            if req_id in sampled:
                state = self.requests[req_id]
                if self.seq_lens[req_id] == len(state.token_ids):  # the step reached its last token
                    state.token_ids.append(sampled[req_id])
                    self.token_ids[row, self.num_tokens[row]] = sampled[req_id]
                    self.num_tokens[row] += 1

    def _update_states(self, out: VllmSchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            self._remove(req_id)
        for req_id in [r for r in self.batch if r is not None and r not in out.num_scheduled_tokens]:
            self._remove(req_id)  # not scheduled (e.g. preempted): leaves the batch, keeps its state
        to_add = []
        for new in out.scheduled_new_reqs:
            if new.prompt_token_ids is None:
                raise ValueError(f"request {new.req_id!r}: prompt_token_ids: this engine needs token ids")
            tokens = new.prompt_token_ids if new.prefill_token_ids is None else new.prefill_token_ids
            self.requests[new.req_id] = _RequestState(list(tokens), [list(g) for g in new.block_ids],
                                                      new.num_computed_tokens)  # fmt: skip
            to_add.append(new.req_id)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            resumed = req_id in cached.resumed_req_ids
            new_blocks = cached.new_block_ids[i]
            if resumed:
                state.token_ids = list(cached.all_token_ids[req_id])
                state.block_ids = [list(g) for g in new_blocks or ()]
            elif new_blocks is not None:
                for g, ids in enumerate(new_blocks):
                    state.block_ids[g] += ids
            # the scheduler's count after this step's tokens are computed is num_computed + scheduled;
            # v1 stores the count before the step, as sent
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if req_id in self.batch and not resumed:
                row = self.batch.index(req_id)
                self.num_computed[row] = state.num_computed_tokens
                for g, ids in enumerate(new_blocks or ()):
                    self._append_blocks(g, row, ids)
            else:
                if req_id in self.batch:
                    self._remove(req_id)
                to_add.append(req_id)
        for req_id in to_add:
            self._add(req_id)
        self._condense()
        self._reorder_decodes_first(out.num_scheduled_tokens)

    def _prepare_inputs(self, out: VllmSchedulerOutput, order: list[str]) -> dict[str, np.ndarray]:
        n = len(order)
        num_scheduled = np.array([out.num_scheduled_tokens[r] for r in order], np.int32)  # [num_reqs]
        query_start_loc = np.zeros(n + 1, np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        rows = np.repeat(np.arange(n), num_scheduled)  # [total] flat token -> row (= batch_idx)
        positions = self.num_computed[rows] + np.arange(total) - query_start_loc[:-1][rows]
        self.positions[:total] = positions
        self.input_ids[:total] = self.token_ids[rows, positions]
        seq_lens = (self.num_computed[:n] + num_scheduled).astype(np.int32)  # [num_reqs]
        self.seq_lens = dict(zip(order, seq_lens.tolist(), strict=True))
        for g, group in enumerate(self.config.kv_groups):
            bs = group.block_size
            self.slot_mapping[g][:total] = self.tables[g][rows, positions // bs].astype(np.int64) * bs + positions % bs
            self.slot_mapping[g][total:] = -1
        arrays: dict[str, np.ndarray] = {
            "query_start_loc": query_start_loc,
            "num_scheduled_tokens": num_scheduled,
            "positions": self.positions,
            "input_ids": self.input_ids,
            "seq_lens": seq_lens,
            "logits_indices": query_start_loc[1:] - 1,
        }
        for g in range(len(self.config.kv_groups)):
            arrays[f"block_table[{g}]"] = self.tables[g][:n]
            arrays[f"slot_mapping[{g}]"] = self.slot_mapping[g]
        return arrays

    # ---- persistent-batch moves --------------------------------------------------------------
    def _add(self, req_id: str) -> None:
        state = self.requests[req_id]
        row = self.batch.index(None) if None in self.batch else len(self.batch)
        if row == len(self.batch):
            self.batch.append(None)
        self.batch[row] = req_id
        self.token_ids[row, : len(state.token_ids)] = state.token_ids
        self.num_tokens[row] = len(state.token_ids)
        self.num_computed[row] = state.num_computed_tokens
        for g in range(len(self.tables)):
            self.tables[g][row] = 0  # v1: unused entries are 0
            self.num_blocks[g, row] = 0
            self._append_blocks(g, row, state.block_ids[g])

    def _append_blocks(self, g: int, row: int, ids: list[int]) -> None:
        start = self.num_blocks[g, row]
        self.tables[g][row, start : start + len(ids)] = ids
        self.num_blocks[g, row] = start + len(ids)

    def _remove(self, req_id: str) -> None:
        if req_id in self.batch:
            self.batch[self.batch.index(req_id)] = None

    def _condense(self) -> None:
        while None in self.batch:
            hole = self.batch.index(None)
            while self.batch and self.batch[-1] is None:
                self.batch.pop()
            if hole >= len(self.batch):
                break
            self._move_row(len(self.batch) - 1, hole)
            self.batch[hole] = self.batch.pop()

    def _move_row(self, src: int, dst: int) -> None:
        self.token_ids[dst] = self.token_ids[src]
        self.num_tokens[dst], self.num_computed[dst] = self.num_tokens[src], self.num_computed[src]
        for g, table in enumerate(self.tables):
            table[dst] = 0
            table[dst, : self.num_blocks[g, src]] = table[src, : self.num_blocks[g, src]]
            self.num_blocks[g, dst] = self.num_blocks[g, src]

    def _swap_rows(self, i: int, j: int) -> None:
        self.swaps += 1
        self.batch[i], self.batch[j] = self.batch[j], self.batch[i]
        for array in (self.token_ids, self.num_tokens, self.num_computed):
            array[[i, j]] = array[[j, i]]
        if self.bug == "swap_keeps_block_table":
            return
        for table in self.tables:
            table[[i, j]] = table[[j, i]]
        self.num_blocks[:, [i, j]] = self.num_blocks[:, [j, i]]

    def _reorder_decodes_first(self, num_scheduled: dict[str, int]) -> None:
        front, back = 0, len(self.batch) - 1
        while front < back:
            if num_scheduled[self.batch[front]] == 1:  # type: ignore[index]
                front += 1
            elif num_scheduled[self.batch[back]] > 1:  # type: ignore[index]
                back -= 1
            else:
                self._swap_rows(front, back)
