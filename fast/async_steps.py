"""Async scheduling on the device: spec/async_steps.py's rules with the sampled ids never read by the host in time.

record_sampled leaves the ids where they are. One pass of torch ops (no host sync: no .item(), no boolean
indexing, no data-dependent shapes) checks them as spec.drafts.check_accepted does, appends each taking row's
accepted tokens (or, after a fault, PLACEHOLDER_TOKEN_ID for its 1 + k tokens) to the device token store at the
device's own count of known tokens, and keeps each row's rejected drafts on the device. The host meanwhile counts
every taking row's 1 + k tokens (the scheduler's optimistic count) and starts a copy of what it will need later.

The next apply corrects num_computed on the device (`correct_on_device`). The apply after it reads the copy
(`read_due`): the host mirror learns the rejections, and a fault raises spec's error, rebuilt from the copied ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fast.runtime import HostCopy, start_host_copy
from fast.state import DeviceState
from spec.async_steps import REPORTED_AFTER, first_fault
from spec.state import PoolState, StepPlan
from spec.types import PLACEHOLDER_TOKEN_ID, WorkerConfig


@dataclass
class _Record:
    """One record_sampled in flight: what the host needs of it once its copy is read."""

    at: int  # the steps applied when it was recorded; read by the first apply after at + REPORTED_AFTER
    req_ids: tuple[str, ...]  # [m] the taking rows' requests
    rows: np.ndarray  # [m] int64 req_state_idx of the taking rows
    num_drafts: np.ndarray  # [m] int64 their drafts
    drafts: list[np.ndarray]  # [m] their draft ids
    copy: HostCopy  # written [m], known before [m], tokens [m, w], fault [1]
    one_per_row: bool  # the ids came as [n]
    continuing: np.ndarray | None = None  # [c] rows the next apply corrected on the device (set then)


class AheadState:
    """The device's count of known tokens and rejected drafts, and the records whose host copy is unread."""

    def __init__(self, config: WorkerConfig, dev: DeviceState) -> None:
        self.config = config
        self.dev = dev
        rows = config.max_num_reqs
        self.num_known = torch.zeros(rows, dtype=torch.int64, device=dev.device)  # [R] tokens held, exact
        self.num_rejected = torch.zeros(rows, dtype=torch.int64, device=dev.device)  # [R] the last record's
        self.in_flight: list[_Record] = []

    # ---- record_sampled ---------------------------------------------------------------------------------
    def record(
        self,
        state: PoolState,  # the host mirror: optimistic counts (spec/async_steps.py, rule 1)
        applied_steps: int,
        req_ids: tuple[str, ...],  # [n] batch order
        rows: np.ndarray,  # [n] int64 batch_idx -> req_state_idx, as prepared
        takes: np.ndarray,  # [n] bool, from host counts
        num_drafts: np.ndarray,  # [n] int64 drafts of each batch row
        draft_ids: np.ndarray,  # [sum(num_drafts)] batch order
        sampled: torch.Tensor,  # [n] or [n, width] integer ids, on the device
    ) -> None:
        device = self.dev.device
        taking = np.flatnonzero(takes)  # [m] batch_idx
        state.sampled_in[:] = -1
        state.sampled_in[rows[taking]] = taking
        state.num_unverified_drafts[rows[taking]] = num_drafts[taking]
        starts = np.cumsum(num_drafts) - num_drafts
        drafts = [draft_ids[starts[b] : starts[b] + num_drafts[b]] for b in taking]
        k = num_drafts[taking]  # [m]
        width = max(int(sampled.shape[1]) if sampled.ndim == 2 else 1, 1 + int(k.max(initial=0)))
        self.dev.reserve_tokens(int(state.num_known_tokens[rows[taking]].max(initial=0)) + width)
        state.num_known_tokens[rows[taking]] += 1 + k  # the scheduler's count: every draft assumed accepted
        if not taking.size:
            return
        tokens = sampled.reshape(rows.size, -1).to(torch.int64)[torch.from_numpy(taking).to(device)]  # [m, w]
        row_t = torch.from_numpy(rows[taking]).to(device)
        known = self.num_known[row_t]  # [m] before the record
        one_per_row = sampled.ndim < 2
        args = (tokens, row_t, known, torch.from_numpy(k).to(device), drafts, width, one_per_row)
        written, fault = self._append(*args)
        self.num_rejected.zero_()
        self.num_rejected[row_t] = torch.from_numpy(1 + k).to(device) - written
        copy = start_host_copy(written, known, tokens, fault.reshape(1))
        taking_ids = tuple(req_ids[b] for b in taking)
        self.in_flight.append(_Record(applied_steps, taking_ids, rows[taking], k, drafts, copy, one_per_row))

    def _append(
        self,
        tokens: torch.Tensor,  # [m, w] int64 the taking rows' ids
        rows: torch.Tensor,  # [m] int64 req_state_idx
        known: torch.Tensor,  # [m] int64 device count before the record
        num_drafts: torch.Tensor,  # [m] int64
        drafts: list[np.ndarray],  # [m] host draft ids
        width: int,  # >= w and >= 1 + max(num_drafts): the columns written
        one_per_row: bool,  # the ids came as [n]: one token per row, -1 an id (out of the vocabulary)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [m] int64 tokens appended per row, [] bool any fault
        """spec.drafts.check_accepted for every row at once; then append, all rows or (after a fault) placeholders."""
        m, w = tokens.shape
        config, device = self.config, tokens.device
        cols = torch.arange(width, device=device)  # [width]
        padded = torch.full((m, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
        padded[:, :w] = tokens
        is_placeholder = padded == PLACEHOLDER_TOKEN_ID
        if one_per_row:
            count = torch.ones(m, dtype=torch.int64, device=device)
        else:
            count = torch.where(is_placeholder.any(1), is_placeholder.to(torch.int64).argmax(1), width)
        kept = cols[None, :] < count[:, None]  # [m, width]
        draft_grid = torch.full((m, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
        if drafts and max(d.size for d in drafts):
            host = np.full((m, width), PLACEHOLDER_TOKEN_ID, np.int64)
            for i, d in enumerate(drafts):
                host[i, : d.size] = d
            draft_grid = torch.from_numpy(host).to(device)
        fault = (
            (count == 0)
            | (~is_placeholder & ~kept).any(1)  # a token after the placeholder
            | (count > 1 + num_drafts)
            | (kept & ((padded < 0) | (padded >= config.vocab_size))).any(1)
            | (kept & (cols[None, :] < count[:, None] - 1) & (padded != draft_grid)).any(1)
            | (known + count > config.max_model_len)
        ).any()  # [] bool, stays on the device
        written = torch.where(fault, 1 + num_drafts, count)  # [m]
        values = torch.where(fault, torch.full_like(padded, PLACEHOLDER_TOKEN_ID), padded)
        limit = min(self.dev.token_capacity, config.max_model_len) - 1
        positions = (known[:, None] + cols[None, :]).clamp(max=limit)  # [m, width]
        write = cols[None, :] < written[:, None]
        write &= known[:, None] + cols[None, :] <= limit
        store = self.dev.token_ids
        row_grid = rows[:, None].expand(m, width)
        old = store[row_grid, positions].to(torch.int64)
        # An accumulated delta instead of a masked scatter: the entries not written add 0, so the clamped
        # positions they share with real ones cannot race them, and no boolean index forces a host sync.
        delta = torch.where(write, values - old, 0).to(store.dtype)
        store.index_put_((row_grid, positions), delta, accumulate=True)
        self.num_known[rows] = known + written
        return written, fault

    # ---- apply --------------------------------------------------------------------------------------
    def commit(self, plan: StepPlan, continuing: np.ndarray) -> None:
        """After the next apply's commit: correct its continuing rows' num_computed on the device (rule 2)."""
        device = self.dev.device
        if plan.freed_rows.size:
            freed = torch.from_numpy(plan.freed_rows).to(device)
            self.num_known[freed] = 0
            self.num_rejected[freed] = 0
        if plan.new_rows.size:
            self.num_known[torch.from_numpy(plan.new_rows).to(device)] = torch.from_numpy(plan.prompt_lens).to(device)
        if continuing.size:
            cont = torch.from_numpy(continuing).to(device)
            self.dev.num_computed[cont] -= self.num_rejected[cont]
        self.num_rejected.zero_()
        for record in self.in_flight:
            if record.continuing is None:
                record.continuing = continuing

    def read_due(self, state: PoolState, applied_steps: int, shares_computed: bool) -> None:
        """At an apply: read the copies of records REPORTED_AFTER steps old; correct the mirror; raise a fault."""
        while self.in_flight and self.in_flight[0].at + REPORTED_AFTER <= applied_steps:
            record = self.in_flight.pop(0)
            written, known, tokens, fault = record.copy.wait()
            rejected = 1 + record.num_drafts - written  # [m]
            owned = np.array([state.req_ids[r] == q for r, q in zip(record.rows, record.req_ids, strict=True)], bool)
            state.num_known_tokens[record.rows[owned]] -= rejected[owned]
            if not shares_computed and record.continuing is not None:  # host mode corrected it in shared memory
                by_row = dict(zip(record.rows.tolist(), rejected.tolist(), strict=True))
                cont = record.continuing
                state.num_computed_tokens[cont] -= np.array([by_row.get(r, 0) for r in cont.tolist()], np.int64)
            if fault[0]:
                counts = _counts_as_recorded(tokens, record.one_per_row)
                takes = np.ones(len(record.req_ids), bool)
                error = first_fault(record.req_ids, takes, tokens, counts, record.drafts, known, self.config)
                if error is None:
                    raise AssertionError("record_sampled: the device found a fault that spec's checks do not")
                raise error


def _counts_as_recorded(tokens: np.ndarray, one_per_row: bool) -> np.ndarray:
    """[m] each copied row's tokens before its first placeholder, as spec.drafts.accepted_rows counts them."""
    if one_per_row:
        return np.ones(tokens.shape[0], np.int64)
    is_placeholder = np.concatenate([tokens == PLACEHOLDER_TOKEN_ID, np.ones((tokens.shape[0], 1), bool)], axis=1)
    return is_placeholder.argmax(axis=1).astype(np.int64)
