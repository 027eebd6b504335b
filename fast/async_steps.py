"""Async scheduling in fast: spec/async_steps.py's rules with the sampled ids never read by the host in time.

record_sampled leaves the ids where they are. On the device (Triton, fast/kernels/record_ahead.py: two launches)
they are checked as spec.drafts.check_accepted does, and each taking row's accepted tokens (or, after a fault,
PLACEHOLDER_TOKEN_ID for its 1 + k tokens) are appended to the token store at the device's own count of known
tokens; each row's rejected drafts stay on the device. In host mode (CPU tensors without Triton) one compiled
loop does the same on host memory. The host meanwhile counts every taking row's 1 + k tokens (the scheduler's
optimistic count) and starts a copy of what it needs later.

The next apply corrects num_computed on the device (`commit`). The apply after it reads the copy (`read_due`):
the host mirror learns the rejections, and a fault raises spec's error, rebuilt from the copied ids.

Drafts proposed on the device (rule 8): the drafter's ids stay on the device as each row's proposals, and the host
knows only their count. After the correction an apply copies a placeholder-drafting row's proposals into the token
store at the device's count, so prepare reads them as input ids; the record reads them back from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from fast.kernels.record_ahead import record_ahead_triton
from fast.runtime import HostCopy, interpret, start_host_copy, upload
from fast.sampled import placeholder_counts
from fast.state import DeviceState
from spec.async_steps import REPORTED_AFTER, first_fault
from spec.state import PoolState, StepPlan, ranges
from spec.types import PLACEHOLDER_TOKEN_ID, WorkerConfig

_EMPTY = np.zeros(0, np.int64)
_NO_PROPOSALS = np.zeros((0, 0), np.int64)  # [n, 0] for _record_compiled: no drafter's ids


@dataclass(slots=True)
class _Record:
    """One record_sampled in flight: what the host needs of it once its copy is read."""

    at: int  # the steps applied when it was recorded; read by the first apply after at + REPORTED_AFTER
    req_ids: tuple[str, ...]  # [n] the batch's requests
    taking: np.ndarray  # [m] int64 batch_idx of the taking rows
    rows: np.ndarray  # [m] int64 their req_state_idx
    num_drafts: np.ndarray  # [m] int64 their drafts
    draft_ids: np.ndarray  # [sum(num_drafts)] their drafts end to end
    one_per_row: bool  # the ids came as [n]
    copy: HostCopy  # written [m], known before [m], faults [m], tokens [m, w], then the two below where set
    drafts_copied: bool  # draft_ids are placeholders: the copy holds the drafts as read on the device [sum(k)]
    proposals_copied: bool  # the copy holds the taking rows' proposals [m, P] (rule 8)
    continuing: np.ndarray | None = None  # [c] rows the next apply corrected on the device (set then)
    freed: np.ndarray | None = None  # [f] rows the next apply freed (their counts went with them)


class AheadState:
    """The device's count of known tokens and rejected drafts, and the records whose host copy is unread."""

    def __init__(self, config: WorkerConfig, dev: DeviceState, host_mode: bool, interpreted: bool) -> None:
        self.config = config
        self.dev = dev
        self.host_mode = host_mode
        self._interpret = interpreted
        rows = config.max_num_reqs
        self.num_known = torch.zeros(rows, dtype=torch.int64, device=dev.device)  # [R] tokens held, exact
        self.num_rejected = torch.zeros(rows, dtype=torch.int64, device=dev.device)  # [R] the last record's
        self.proposals = torch.zeros((rows, 0), dtype=torch.int64, device=dev.device)  # [R, P] the drafter's ids
        self.unverified = False  # a record since the last apply kept drafts whose verdict the host has not read
        if host_mode:  # host memory: the compiled loop and the commit work on NumPy views of the same arrays
            self._known_np, self._rejected_np = self.num_known.numpy(), self.num_rejected.numpy()
            self._computed_np = dev.num_computed.numpy()
            self._proposals_np = self.proposals.numpy()
        self.in_flight: list[_Record] = []

    # ---- record_sampled ---------------------------------------------------------------------------------
    def record(
        self,
        state: PoolState,  # the host mirror: optimistic counts (spec/async_steps.py, rule 1)
        applied_steps: int,
        req_ids: tuple[str, ...],  # [n] batch order
        rows: np.ndarray,  # [n] int64 batch_idx -> req_state_idx, as prepared
        seq_lens: np.ndarray,  # [n] int64 as prepared (from host counts)
        num_drafts: np.ndarray,  # [n] int64 drafts of each batch row; empty: none
        draft_ids: np.ndarray,  # [sum(num_drafts)] batch order
        sampled: torch.Tensor | np.ndarray,  # [n] or [n, width] integer ids, on the device (host mode: NumPy)
        proposed: torch.Tensor | np.ndarray | None,  # [n, P] int64 the drafter's ids (rule 8), as sampled, or None
    ) -> None:
        n = rows.shape[0]
        scratch = np.empty((5, n), np.int64)  # taking | taking_rows | k | starts | own starts, the first m filled
        own_drafts = np.empty(draft_ids.shape[0], draft_ids.dtype)  # [sum(num_drafts)], the first sum(k) filled
        width = 0 if proposed is None else int(proposed.shape[1])
        m, own, longest, most_drafts, placeholders = _bookkeep(
            seq_lens, rows, num_drafts, draft_ids, state.sampled_in, state.num_unverified_drafts,
            state.num_known_tokens, state.num_proposed, width, scratch, own_drafts
        )  # fmt: skip
        if not m:
            return
        self.unverified = self.unverified or most_drafts > 0
        taking, taking_rows, k, starts = scratch[0, :m], scratch[1, :m], scratch[2, :m], scratch[3, :m]
        own_drafts = own_drafts[:own]
        if placeholders:  # rule 8: each taking row's drafts, end to end, as apply stored them (take_proposals)
            starts = scratch[4, :m]
        if width > self.proposals.shape[1]:
            self._grow_proposals(width)
        one_per_row = sampled.ndim < 2
        tokens = sampled.reshape(rows.size, -1)
        self.dev.reserve_tokens(longest + max(int(tokens.shape[1]), 1 + most_drafts))  # ids, or 1 + k placeholders
        if isinstance(tokens, np.ndarray):  # host mode (fast/step_modes.py hands it NumPy)
            if placeholders:
                own_drafts = self._stored_drafts_host(taking_rows, k, own)
                draft_ids = own_drafts
            if isinstance(proposed, torch.Tensor):  # fast/step_modes.py hands host mode NumPy
                raise TypeError("host mode records NumPy proposals")
            copy = self._record_host(tokens, taking, taking_rows, k, draft_ids, starts, one_per_row, proposed)
            placeholders = False  # own_drafts holds the values: nothing more to copy
        else:
            if isinstance(proposed, np.ndarray):
                raise TypeError("the device path records proposals on the device")
            copy = self._record_device(tokens, taking, taking_rows, k, draft_ids, starts, one_per_row, proposed,
                                       placeholders)  # fmt: skip
        self.in_flight.append(_Record(applied_steps, req_ids, taking, taking_rows, k, own_drafts, one_per_row, copy,
                                      placeholders, proposed is not None))  # fmt: skip

    def _grow_proposals(self, width: int) -> None:
        grown = torch.zeros((self.proposals.shape[0], width), dtype=torch.int64, device=self.dev.device)
        grown[:, : self.proposals.shape[1]] = self.proposals
        self.proposals = grown
        if self.host_mode:
            self._proposals_np = grown.numpy()

    def _stored_drafts_host(self, rows: np.ndarray, k: np.ndarray, total: int) -> np.ndarray:
        """[total = sum(k)] int64 each row's k drafts, end to end, from the token store just past its known tokens."""
        store = self.dev.token_ids_np
        if store is None:
            raise RuntimeError("host mode keeps the token store in NumPy (fast/state.py), but this pool has none")
        out = np.empty(total, np.int64)
        _gather_stored(rows, k, self._known_np, store, out)
        return out

    def _stored_drafts_device(self, rows: np.ndarray, k: np.ndarray) -> torch.Tensor:
        """_stored_drafts_host on the device: [sum(k)] int64, read without a host sync."""
        which, within = ranges(k)
        index = upload(np.stack([rows[which], within]), self.dev.device)  # [2, sum(k)] row, draft
        row_index = index[0]
        return self.dev.token_ids[row_index, self.num_known[row_index] + index[1]].to(torch.int64)

    def _record_host(
        self,
        tokens: np.ndarray,  # [n, w] the caller's ids
        taking: np.ndarray,  # [m] int64 batch_idx
        rows: np.ndarray,  # [m] int64 req_state_idx
        k: np.ndarray,  # [m] int64 drafts
        draft_ids: np.ndarray,  # [sum(drafts of the batch)] integer
        starts: np.ndarray,  # [m] int64 each row's first draft
        one_per_row: bool,
        proposed: np.ndarray | None,  # [n, P] int64 the drafter's ids, or None
    ) -> HostCopy:
        ids = tokens.astype(np.int64, copy=False)
        draft_ids = draft_ids.astype(np.int64, copy=False)
        m = taking.size
        counts = np.empty((3, m), np.int64)  # written | known before | faults
        store = self.dev.token_ids_np
        if store is None:
            raise RuntimeError("host mode keeps the token store in NumPy (fast/state.py), but this pool has none")
        config = self.config
        drafter = _NO_PROPOSALS if proposed is None else proposed
        faulty = _record_compiled(ids, taking, rows, k, starts, draft_ids, one_per_row, config.vocab_size,
                                  config.max_model_len, self._known_np, self._rejected_np, store, drafter,
                                  self._proposals_np, counts[0], counts[1], counts[2])  # fmt: skip
        # the ids are read again only to rebuild a fault's error, and host mode knows now whether there is one
        tokens_kept = ids[taking] if faulty else _NO_PROPOSALS
        if proposed is None:
            return HostCopy.of_host(counts[0], counts[1], counts[2], tokens_kept)
        return HostCopy.of_host(counts[0], counts[1], counts[2], tokens_kept, proposed[taking] if faulty else proposed)

    def _record_device(
        self,
        tokens: torch.Tensor,  # [n, w] on the device
        taking: np.ndarray,
        rows: np.ndarray,
        k: np.ndarray,
        draft_ids: np.ndarray,
        starts: np.ndarray,
        one_per_row: bool,
        proposed: torch.Tensor | None,  # [n, P] int64 on the device, or None
        placeholders: bool,  # draft_ids are placeholders: the drafts are read where apply stored them
    ) -> HostCopy:
        device = self.dev.device
        ids = tokens.to(torch.int64).contiguous()
        host_drafts = np.zeros(1, np.int64) if placeholders else draft_ids.astype(np.int64)
        packed = upload(np.concatenate([taking, rows, k, starts, host_drafts, [0]]), device)
        m = taking.size
        taking_t, rows_t, k_t, starts_t = (packed[i * m : (i + 1) * m] for i in range(4))
        drafts = packed[4 * m :]
        if placeholders:
            stored = self._stored_drafts_device(rows, k)
            drafts = torch.cat([stored, drafts[:1]])  # one spare entry, as the kernel wants
        config = self.config
        with interpret(self._interpret):
            written, known, faults = record_ahead_triton(
                ids, taking_t, rows_t, k_t, starts_t, drafts, self.num_known, self.num_rejected,
                self.dev.token_ids, one_per_row, int(k.max()), config.vocab_size, config.max_model_len,
                None if proposed is None else (proposed, self.proposals),
            )  # fmt: skip
        copied = [written, known, faults, ids[taking_t]]
        if placeholders:
            copied.append(stored)
        if proposed is not None:
            copied.append(proposed[taking_t])
        return start_host_copy(*copied)

    # ---- rule 8 at the apply ------------------------------------------------------------------------
    def take_proposals(self, rows: np.ndarray, k: np.ndarray) -> None:
        """After the correction: each row's first k proposals into the token store at the device's count."""
        if self.host_mode:
            store = self.dev.token_ids_np
            if store is None:
                raise RuntimeError("host mode keeps the token store in NumPy (fast/state.py), but this pool has none")
            _copy_proposals(rows, k, self._known_np, self._proposals_np, store)
            return
        which, within = ranges(k)
        index = upload(np.stack([rows[which], within]), self.dev.device)  # [2, sum(k)] row, draft
        row_index, draft = index[0], index[1]
        values = self.proposals[row_index, draft].to(torch.int32)
        self.dev.token_ids.index_put_((row_index, self.num_known[row_index] + draft), values)

    def batch_drafts(self, rows: np.ndarray, k: np.ndarray, total: int) -> torch.Tensor:
        """[total = sum(k)] int64 the drafts of batch rows `rows` (k each), as stored: a placeholder step's
        draft_token_ids."""
        if self.host_mode:
            return torch.from_numpy(self._stored_drafts_host(rows, k, total))
        return self._stored_drafts_device(rows, k)

    # ---- apply --------------------------------------------------------------------------------------
    def commit(self, plan: StepPlan) -> None:
        """After the next apply's commit: correct its continuing rows' num_computed on the device (rule 2). A new or
        resumed request's row (its table replaced) continues nothing: its count is the one the step sent."""
        tables = plan.tables[0]
        if self.host_mode:  # the mirror's arrays are the device's (fast/state.py): one compiled pass on them
            continuing = _correct(plan.freed_rows, plan.new_rows, plan.prompt_lens, plan.rows, tables.rows,
                                  tables.replaced, self._known_np, self._rejected_np, self._computed_np)  # fmt: skip
        else:
            continuing = continuing_rows(plan.rows, tables.rows, tables.replaced, self.config.max_num_reqs)
            device = self.dev.device
            freed, new, cont = (upload(a, device) for a in (plan.freed_rows, plan.new_rows, continuing))
            self.num_known[freed] = 0
            self.num_rejected[freed] = 0
            self.num_known[new] = upload(plan.prompt_lens, device)
            self.dev.num_computed[cont] -= self.num_rejected[cont]
            self.num_rejected.zero_()
        for record in self.in_flight:
            if record.continuing is None:
                record.continuing, record.freed = continuing, plan.freed_rows

    def read_due(self, state: PoolState, applied_steps: int) -> None:
        """At an apply: read the copies of records REPORTED_AFTER steps old; correct the mirror; raise a fault."""
        while self.in_flight and self.in_flight[0].at + REPORTED_AFTER <= applied_steps:
            record = self.in_flight.pop(0)
            written, known, faults, tokens, *extra = record.copy.wait()
            freed = _EMPTY if record.freed is None else record.freed
            # host mode corrected num_computed in the shared array at the apply (commit); the mirror of the device
            # path learns it here, for the rows that apply continued
            continuing = _EMPTY if self.host_mode or record.continuing is None else record.continuing
            faulty = _learn_verdicts(record.rows, record.num_drafts, written, freed, faults, continuing,
                                     state.num_known_tokens, state.num_computed_tokens)  # fmt: skip
            if faulty:
                raise self._fault(record, tokens, known, extra)

    def _fault(self, record: _Record, tokens: np.ndarray, known: np.ndarray, extra: list[np.ndarray]) -> Exception:
        """spec's error for the record's first faulty row, from the copied ids (and drafts and proposals)."""
        counts = placeholder_counts(tokens.astype(np.int64, copy=False), record.one_per_row)  # [m]
        draft_ids = extra.pop(0) if record.drafts_copied else record.draft_ids
        proposed = extra.pop(0) if record.proposals_copied else None
        ends = np.cumsum(record.num_drafts)
        drafts = [draft_ids[e - n : e] for e, n in zip(ends, record.num_drafts, strict=True)]
        req_ids = tuple(record.req_ids[b] for b in record.taking)
        takes = np.ones(len(req_ids), bool)
        error = first_fault(req_ids, takes, tokens, counts, drafts, known, self.config, proposed)
        if error is None:
            return AssertionError("record_sampled: the device found a fault that spec's checks do not")
        return error

    def known_counts(self) -> np.ndarray:
        """[R] the device's exact count of known tokens (a host read: for snapshot)."""
        return self.num_known.cpu().numpy()


@njit(cache=True, nogil=True)
def _record_compiled(  # pragma: no cover - compiled; tested through record_sampled against spec
    tokens: np.ndarray,  # [n, w] int64
    taking: np.ndarray,  # [m] int64 batch_idx
    rows: np.ndarray,  # [m] int64 req_state_idx
    num_drafts: np.ndarray,  # [m] int64
    starts: np.ndarray,  # [m] int64 each row's first draft in draft_ids
    draft_ids: np.ndarray,  # [sum] int64
    one_per_row: bool,
    vocab: int,
    max_len: int,
    num_known: np.ndarray,  # [R] int64, advanced
    num_rejected: np.ndarray,  # [R] int64 out
    token_ids: np.ndarray,  # [R, capacity] int32 (room reserved)
    proposed: np.ndarray,  # [n, P] int64 the drafter's ids (P = 0: none)
    proposals: np.ndarray,  # [R, >= P] int64 out: each taking row's proposals
    written: np.ndarray,  # [m] int64 out
    known_before: np.ndarray,  # [m] int64 out
    faults: np.ndarray,  # [m] int64 out: 1 for a faulty row
) -> bool:
    """fast/kernels/record_ahead.py's two kernels as one loop on host memory: every check, then every append.
    Returns whether any row was faulty."""
    m, w, width = taking.shape[0], tokens.shape[1], proposed.shape[1]
    any_fault = False
    for i in range(m):
        b, k = taking[i], num_drafts[i]
        count = 1 if one_per_row else w
        if not one_per_row:
            for j in range(w):
                if tokens[b, j] == PLACEHOLDER_TOKEN_ID:
                    count = j
                    break
        fault = count == 0 or count > 1 + k or num_known[rows[i]] + count > max_len
        for j in range(count, w):
            fault = fault or tokens[b, j] != PLACEHOLDER_TOKEN_ID
        for j in range(count):
            fault = fault or tokens[b, j] < 0 or tokens[b, j] >= vocab
            fault = fault or (j < count - 1 and tokens[b, j] != draft_ids[starts[i] + j])
        for j in range(width):
            fault = fault or proposed[b, j] < 0 or proposed[b, j] >= vocab
        written[i] = count
        known_before[i] = num_known[rows[i]]
        faults[i] = fault
        any_fault = any_fault or fault
    for i in range(m):
        b, row, k, known = taking[i], rows[i], num_drafts[i], known_before[i]
        n = 1 + k if any_fault else written[i]
        for j in range(min(n, max_len - known)):
            token_ids[row, known + j] = PLACEHOLDER_TOKEN_ID if any_fault else tokens[b, j]
        written[i] = n
        num_known[row] = known + n
        num_rejected[row] = 1 + k - n
        for j in range(width):
            proposals[row, j] = PLACEHOLDER_TOKEN_ID if any_fault else proposed[b, j]
    return any_fault


@njit(cache=True, nogil=True)
def _bookkeep(  # pragma: no cover - compiled; tested through record_sampled against spec
    seq_lens: np.ndarray,  # [n] int64 as prepared: a row whose step reached its last input token takes its sample
    rows: np.ndarray,  # [n] int64 batch_idx -> req_state_idx
    num_drafts: np.ndarray,  # [n] int64 drafts of each batch row (empty: none)
    draft_ids: np.ndarray,  # [sum(num_drafts)] batch order
    sampled_in: np.ndarray,  # [R] int64 out: the batch_idx each row sampled in, -1 for none
    num_unverified: np.ndarray,  # [R] int64 out: drafts whose verdict is unread
    num_known: np.ndarray,  # [R] int64: the scheduler's (optimistic) count, advanced by 1 + k for every taking row
    num_proposed: np.ndarray,  # [R] int64 out: the drafter's ids each batch row keeps (rule 8)
    width: int,  # the drafter's ids per row (0: none)
    out: np.ndarray,  # [5, n] int64 out, the first m of each: taking batch_idx | their req_state_idx | their
    #                   drafts k | each one's first draft in draft_ids | in own_drafts
    own_drafts: np.ndarray,  # [sum(k)] out: the taking rows' drafts, batch order
) -> tuple[int, int, int, int, bool]:
    """The host's side of a record under async scheduling (spec/async_steps.py, rule 1), one pass: (taking rows m,
    their drafts sum(k), the longest known length of one before the step, the most drafts of one, whether some
    drafts are placeholders: proposed on the device, rule 8)."""
    sampled_in[:] = -1
    i = at = own = longest = most = 0
    placeholders = False
    drafting = num_drafts.shape[0] > 0
    for b in range(rows.shape[0]):
        row = rows[b]
        d = num_drafts[b] if drafting else 0
        takes = seq_lens[b] == num_known[row] + d  # before this row's own count moves (rows are distinct)
        num_proposed[row] = width if takes else 0
        if takes:
            out[0, i], out[1, i], out[2, i], out[3, i], out[4, i] = b, row, d, at, own
            placeholders = placeholders or (d > 0 and draft_ids[at] == PLACEHOLDER_TOKEN_ID)
            sampled_in[row] = b
            num_unverified[row] = d
            longest = max(longest, num_known[row])
            most = max(most, d)
            num_known[row] += 1 + d
            for j in range(d):
                own_drafts[own + j] = draft_ids[at + j]
            own += d
            i += 1
        at += d
    return i, own, longest, most, placeholders


@njit(cache=True, nogil=True)
def _learn_verdicts(  # pragma: no cover - compiled; tested through record_sampled against spec
    rows: np.ndarray,  # [m] int64 the record's taking rows
    num_drafts: np.ndarray,  # [m] int64 their drafts
    written: np.ndarray,  # [m] int64 tokens each kept (1 + k after a fault: nothing is kept then)
    freed: np.ndarray,  # [f] int64 rows freed since the record: their counts left with their requests
    faults: np.ndarray,  # [m] integer: the rows the device found faulty
    continuing: np.ndarray,  # [c] int64 rows whose num_computed the next apply corrected on the device
    num_known: np.ndarray,  # [R] int64 the mirror's count, corrected here
    num_computed: np.ndarray,  # [R] int64 the mirror's num_computed, corrected here for the continuing rows
) -> bool:
    """The mirror learns a record's rejections; returns whether the device found a fault."""
    by_row = np.zeros(num_known.shape[0] if continuing.shape[0] else 0, np.int64)  # [R] rejected per held row
    for i in range(rows.shape[0]):
        gone = False
        for row in freed:  # a freed row's counts left with its request
            gone = gone or row == rows[i]
        if not gone:
            rejected = 1 + num_drafts[i] - written[i]
            num_known[rows[i]] -= rejected
            if continuing.shape[0]:
                by_row[rows[i]] = rejected
    for row in continuing:
        num_computed[row] -= by_row[row]
    any_fault = False
    for fault in faults:
        any_fault = any_fault or fault != 0
    return any_fault


@njit(cache=True, nogil=True)
def continuing_rows(  # pragma: no cover - compiled; tested through apply against spec
    rows: np.ndarray,  # [n] int64 the plan's req_state_idx
    table_rows: np.ndarray,  # [t] int64 the rows whose group-0 table the plan writes
    replaced: np.ndarray,  # [t] bool: that table is replaced (a new or resumed request)
    num_rows: int,
) -> np.ndarray:
    """[c] int64 the plan's rows whose table was not replaced, in order: the continuing requests' rows."""
    drop = np.zeros(num_rows, np.bool_)
    for i in range(table_rows.shape[0]):
        if replaced[i]:
            drop[table_rows[i]] = True
    out = np.empty(rows.shape[0], np.int64)
    c = 0
    for v in rows:
        if not drop[v]:
            out[c] = v
            c += 1
    return out[:c]


@njit(cache=True, nogil=True)
def pending_tokens_into(  # pragma: no cover - compiled; tested through prepare against spec
    sampled_in: np.ndarray,  # [R] int64 the last record's batch_idx of each row, or -1
    num_known: np.ndarray,  # [R] int64 known tokens, as the scheduler counts them
    index_mapping: np.ndarray,  # [num_reqs] int64 batch_idx -> req_state_idx
    num_computed: np.ndarray,  # [num_reqs] int64 batch order, counted as num_known
    cu_num_tokens: np.ndarray,  # [num_reqs] int64 each row's end in the flat tokens
    num_scheduled: np.ndarray,  # [num_reqs] int64
    out: np.ndarray,  # [2 num_reqs] int32 out: flat token indices from 0, the previous batch_idx from num_reqs
) -> int:
    """spec.async_steps.pending_tokens (rule 3) in one pass: the number of pending tokens, written to `out`."""
    n, count = index_mapping.shape[0], 0
    for b in range(n):
        row = index_mapping[b]
        offset = num_known[row] - 1 - num_computed[b]
        if sampled_in[row] >= 0 and 0 <= offset < num_scheduled[b]:
            out[count] = cu_num_tokens[b] - num_scheduled[b] + offset
            out[n + count] = sampled_in[row]
            count += 1
    return count


@njit(cache=True, nogil=True)
def _correct(  # pragma: no cover - compiled; tested through apply against spec
    freed: np.ndarray,  # [f] int64 rows the apply freed
    new_rows: np.ndarray,  # [k] int64 rows new requests took
    prompt_lens: np.ndarray,  # [k] int64 their prompts
    rows: np.ndarray,  # [n] int64 the plan's rows
    table_rows: np.ndarray,  # [t] int64 the rows whose group-0 table the plan writes
    replaced: np.ndarray,  # [t] bool: replaced (a new or resumed request)
    known: np.ndarray,  # [R] int64 the device's exact count of known tokens
    rejected: np.ndarray,  # [R] int64 the last record's rejected drafts per row, zeroed here
    computed: np.ndarray,  # [R] int64 num_computed_tokens, corrected (rule 2)
) -> np.ndarray:
    """AheadState.commit on host memory, one pass: freed rows hold nothing, new ones their prompt, continuing
    rows give back the drafts the last record rejected. Returns [c] the continuing rows."""
    continuing = continuing_rows(rows, table_rows, replaced, known.shape[0])
    for row in freed:
        known[row] = 0
        rejected[row] = 0
    for i in range(new_rows.shape[0]):
        known[new_rows[i]] = prompt_lens[i]
    for row in continuing:
        computed[row] -= rejected[row]
    rejected[:] = 0
    return continuing


@njit(cache=True, nogil=True)
def async_drafts_hold(  # pragma: no cover - compiled; tested through apply against spec's plan_step
    rows: np.ndarray,  # [n] int64 the plan's req_state_idx, scheduler order
    num_drafts: np.ndarray,  # [n] int64 drafts of each (empty: none)
    draft_ids: np.ndarray,  # [sum(num_drafts)] scheduler order
    table_rows: np.ndarray,  # [t] int64 the rows whose group-0 table the plan writes
    replaced: np.ndarray,  # [t] bool: replaced (a new or resumed request)
    num_unverified: np.ndarray,  # [R] int64 drafts whose verdict the host has not read
    num_proposed: np.ndarray,  # [R] int64 the drafter's ids each row keeps
) -> bool:
    """spec/async_steps.py's rules 5, 7 and 8 hold for a plan: a new or resumed request's row has no unread verdict
    (7, for both: the bulk planner leaves either to spec then) and no placeholders; placeholders take no more than
    the row's proposals (8); drafts sent with their ids follow no unread verdict (5)."""
    fresh = np.zeros(num_unverified.shape[0], np.bool_)
    for i in range(table_rows.shape[0]):
        if replaced[i]:
            fresh[table_rows[i]] = True
            if num_unverified[table_rows[i]]:
                return False
    at = 0
    for i in range(num_drafts.shape[0]):
        k = num_drafts[i]
        if k:
            row = rows[i]
            if draft_ids[at] == PLACEHOLDER_TOKEN_ID:
                if fresh[row] or num_proposed[row] < k:
                    return False
            elif num_unverified[row]:
                return False
        at += k
    return True


@njit(cache=True, nogil=True)
def _copy_proposals(  # pragma: no cover - compiled; tested through apply against spec
    rows: np.ndarray,  # [p] int64 req_state_idx of the rows whose drafts are placeholders
    k: np.ndarray,  # [p] int64 their drafts
    known: np.ndarray,  # [R] int64 the device's exact count of known tokens
    proposals: np.ndarray,  # [R, P] int64 the drafter's ids
    store: np.ndarray,  # [R, capacity] int32 the token store, written past each row's known tokens
) -> None:
    for i in range(rows.shape[0]):
        row = rows[i]
        for j in range(k[i]):
            store[row, known[row] + j] = proposals[row, j]


@njit(cache=True, nogil=True)
def _gather_stored(  # pragma: no cover - compiled; tested through prepare and record_sampled against spec
    rows: np.ndarray,  # [p] int64 req_state_idx
    k: np.ndarray,  # [p] int64 drafts of each
    known: np.ndarray,  # [R] int64 the device's exact count of known tokens
    store: np.ndarray,  # [R, capacity] int32 the token store
    out: np.ndarray,  # [sum(k)] int64 out: each row's k drafts, end to end
) -> None:
    at = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        for j in range(k[i]):
            out[at + j] = store[row, known[row] + j]
        at += k[i]


@njit(cache=True, nogil=True)
def placeholder_runs(  # pragma: no cover - compiled; tested through apply and prepare against spec
    num_drafts: np.ndarray,  # [n] int64 scheduler order
    draft_ids: np.ndarray,  # [sum(num_drafts)] scheduler order
    on_device: np.ndarray,  # [n] bool out: the request's drafts are placeholders (never a mix: validation)
) -> bool:
    """Which requests' drafts are placeholders (rule 8); returns whether any is."""
    at, found = 0, False
    for i in range(num_drafts.shape[0]):
        on_device[i] = num_drafts[i] > 0 and draft_ids[at] == PLACEHOLDER_TOKEN_ID
        found = found or on_device[i]
        at += num_drafts[i]
    return found
