"""Baseline 1: inputs built token by token in Python lists, then turned into tensors.

This is how small educational engines (nano-vllm's ModelRunner.prepare_prefill / prepare_decode)
do it: each request is a Python object holding its token list and block table, and every step walks
the batch, extending `input_ids`, `positions` and `slot_mapping` lists per token before one
`torch.tensor(...)` per field. No validation: the scheduler is trusted. Same semantics as spec on
valid input (batch order, lowest free row, zeroed table tails), so its output can be checked exactly.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from spec.classify import classify
from spec.types import PAD_SLOT_ID, BatchInputs, PoolSnapshot, RowSnapshot, SchedulerOutput, WorkerConfig


@dataclass
class _Sequence:
    row: int  # req_state_idx
    token_ids: list[int]  # prompt, then sampled
    num_computed_tokens: int
    block_tables: list[list[int]]  # per group: logical block -> physical block id
    prompt_len: int  # what the row's classification reads (spec/classify.py)


class PythonListPool:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.seqs: dict[str, _Sequence] = {}
        self.free_rows = list(range(config.max_num_reqs))  # a heap: new requests take the lowest row

    def apply(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            heapq.heappush(self.free_rows, self.seqs.pop(req_id).row)
        for new in sched.new_requests:
            self.seqs[new.req_id] = _Sequence(
                heapq.heappop(self.free_rows),
                list(new.prompt_token_ids),
                new.num_computed_tokens,
                [list(ids) for ids in new.block_ids],
                len(new.prompt_token_ids),
            )
        for cached in sched.cached_requests:
            seq = self.seqs[cached.req_id]
            seq.num_computed_tokens = cached.num_computed_tokens
            if cached.resumed:
                seq.block_tables = [[] for _ in self.config.kv_groups]
            for table, ids in zip(seq.block_tables, cached.new_block_ids or (), strict=False):
                table.extend(ids)

    def prepare(self, sched: SchedulerOutput, pad_to: int | None = None) -> BatchInputs:
        groups = self.config.kv_groups
        order = sorted(sched.num_scheduled_tokens.items(), key=lambda item: item[1])  # stable
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mappings: list[list[int]] = [[] for _ in groups]
        query_start_loc, seq_lens, rows = [0], [], []
        block_tables: list[list[list[int]]] = [[] for _ in groups]  # per group: [num_reqs][blocks held]
        for req_id, num_scheduled in order:
            seq = self.seqs[req_id]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_scheduled
            rows.append(seq.row)
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + num_scheduled)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            for g, group in enumerate(groups):
                table, bs = seq.block_tables[g], group.block_size
                for pos in range(start, end):
                    slot_mappings[g].append(table[pos // bs] * bs + pos % bs)
                block_tables[g].append(table)
        num_tokens = query_start_loc[-1]
        padded = num_tokens if pad_to is None else pad_to
        pad = padded - num_tokens
        return BatchInputs(
            req_ids=tuple(req_id for req_id, _ in order),
            index_mapping=torch.tensor(rows, dtype=torch.int32),
            num_scheduled_tokens=torch.tensor([n for _, n in order], dtype=torch.int32),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            positions=torch.tensor(positions + [0] * pad, dtype=torch.int64),
            input_ids=torch.tensor(input_ids + [0] * pad, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            row_classes=classify(  # the rows' classes every slotmap backend's batch carries (spec/classify.py)
                np.array([n for _, n in order], np.int64),
                np.array([self.seqs[r].num_computed_tokens for r, _ in order], np.int64),
                np.array([self.seqs[r].prompt_len for r, _ in order], np.int64),
                1,
            ),
            logits_indices=torch.tensor([q - 1 for q in query_start_loc[1:]], dtype=torch.int32),
            block_tables=tuple(self._block_table(g, tables) for g, tables in enumerate(block_tables)),
            slot_mappings=tuple(torch.tensor(s + [PAD_SLOT_ID] * pad, dtype=torch.int64) for s in slot_mappings),
            num_tokens=num_tokens,
            num_tokens_padded=padded,
        )

    def _block_table(self, group: int, tables: list[list[int]]) -> torch.Tensor:  # [num_reqs, max_blocks_per_req]
        # nano-vllm pads every table to the longest in the batch and converts once; the contract's width is
        # max_blocks_per_req, so that block lands in the left columns of a zeroed tensor
        longest = max((len(t) for t in tables), default=0)
        out = torch.zeros((len(tables), self.config.max_blocks_per_req(group)), dtype=torch.int32)
        if longest:
            out[:, :longest] = torch.tensor([t + [0] * (longest - len(t)) for t in tables], dtype=torch.int32)
        return out

    def record_sampled(self, batch: BatchInputs, sampled_token_ids: Any) -> None:
        sampled = torch.as_tensor(sampled_token_ids).tolist()
        for req_id, seq_len, token in zip(batch.req_ids, batch.seq_lens.tolist(), sampled, strict=True):
            seq = self.seqs[req_id]
            if seq_len == len(seq.token_ids):  # the step reached the last known token: keep the sample
                seq.token_ids.append(token)

    def row_of(self, req_id: str) -> int:
        return self.seqs[req_id].row

    def snapshot(self) -> PoolSnapshot:
        return tuple(
            RowSnapshot(
                s.row, req_id, tuple(s.token_ids), s.num_computed_tokens, tuple(tuple(t) for t in s.block_tables)
            )
            for req_id, s in sorted(self.seqs.items(), key=lambda item: item[1].row)
        )
