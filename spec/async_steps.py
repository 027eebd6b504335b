"""Async scheduling: each step is scheduled before the previous step's samples are known on the host.

With `WorkerConfig.async_scheduling` the engine runs one step ahead (vLLM's async scheduling, SGLang's overlap
scheduler). The calls keep their order, apply, prepare, record_sampled, but the host never waits for sampled
values: the scheduler sends step N+1 before step N's samples reach it, and in fast record_sampled leaves the ids
on the device. What changes, rule by rule (docs/semantics.md, "Async scheduling"):

1. Optimistic counts. A batch row that takes its sample in step N (its step reached its last input token) counts,
   for step N+1, as holding 1 + k more tokens: its sample and all k of its drafts, accepted or not, because the
   scheduler cannot know yet how many were rejected. `PoolState.num_known_tokens` holds this count between the
   record and the next apply, so validation reads exactly what the scheduler assumed.
2. Correction. The sampler rejects r of the k drafts; the pool knows r (spec at once, fast on the device). When it
   applies step N+1 it subtracts r from the row's known tokens, and from the num_computed_tokens that step N+1
   sends for a continuing (not resumed) request: vLLM's device correction `num_computed += query_len -
   num_rejected`. Step N+1's positions, slots and seq_lens follow the corrected count; its known tokens are then
   exact, and step N+2, scheduled after step N's verdict arrived, sends exact counts.
3. Pending tokens. The input id of a step N+1 token at the position of a row's last token appended by step N's
   record (its sample, or after accepted drafts the token sampled after them) is unknown to the host:
   `BatchInputs.pending_token_indices` lists those flat indices and `pending_prev_batch_idx` the batch row of
   step N that sampled each. `input_ids` holds the value (spec's pool has it; fast gathers it on the device).
   Only a row that sampled in step N and still has its owner has one: a new request takes none, even on a row
   whose previous owner sampled (the -1 placeholder of vLLM #37159 reached such requests).
4. Windows are checked for every verdict. A step sent with k unverified drafts behind it starts, after the
   correction, anywhere from num_computed - k to num_computed: its window's reads (checks 9 and 12) are checked
   from the lowest of those starts, so no outcome reads a block the scheduler released on the optimistic count.
5. Drafts the scheduler sends after unverified drafts are refused (UnknownTokenError, check 8): their positions
   depend on a verdict the host has not read, so a host drafter could not have made them. Drafts proposed on the
   device (rule 8) may follow them.
6. Late faults. record_sampled checks at once what the host knows without values (the batch, the ids' dtype and
   shape). The checks of the values (spec/drafts.py's, in their order) are reported by the first apply after
   step N+1 was applied (the apply after next, unless an output was refused in between): the first call whose
   host work may wait for step N's sampler without stalling the pipeline. It raises spec's error for the first
   faulty row before it validates anything. The clock is steps applied, not calls: a refused output in between
   changes nothing, so step N+1 is always validated on the optimistic count. The faulty record appends
   PLACEHOLDER_TOKEN_ID (-1) for each taking row's 1 + k tokens, so a batch prepared before the report carries
   -1, which no embedding lookup accepts, instead of a plausible stale id. After the report the pool goes on.

7. A resumed request waits for its verdict. A request preempted while the verdict on its last record's k drafts
   is unread, and resumed at once, may be scheduled only over the tokens it held before that record (vLLM's
   scheduler resets the in-flight placeholders on preemption and resumes over the tokens it has): past them,
   the position of each token depends on how many drafts were rejected, and rule 2 corrects no resumed count.
   Refused otherwise (UnknownTokenError, check 8), in every backend alike. Without drafts the record's one
   sample has one position, and rule 3 finds it. No verdict moves a resumed step's start: rule 4 checks its
   window from there. Its neighbours: after a step whose batch was not recorded (no tokens: an engine runs no
   model on it), no row has a pending token (rule 3 names the batch run just before); a new request on the row
   of one aborted before its verdict is read takes nothing of it (no pending token, no rejected drafts).

8. Drafts proposed on the device. Under async scheduling the drafter runs on the device right after the sampler
   (vLLM's model runner v2 keeps its output in `req_states.draft_tokens`), so the scheduler knows the drafts only by
   count: it sends k PLACEHOLDER_TOKEN_ID ids in scheduled_spec_decode_tokens. record_sampled takes the drafter's
   output as `next_draft_ids` ([num_reqs, P], batch order), and each row that took its sample keeps those P ids as
   its proposals (a row of the batch that did not take its sample, or a record without next_draft_ids, keeps none;
   a freed, new or resumed row keeps none: nothing of a previous owner is carried over, vllm-ascend #13864). A step
   with k placeholder drafts takes its drafts from the first k proposals of its row, at the positions of the
   corrected count (rule 2): unlike drafts the scheduler sends, these may follow unverified drafts (rule 5 does not
   apply). More placeholders than proposals (or any on a new or resumed request) is UnknownTokenError (check 8).
   The values are checked late as the sampled ids are (rule 6): a proposal outside the vocabulary is a
   TokenIdError on `next_draft_ids`, checked after the row's sampled ids, and a faulty record leaves
   PLACEHOLDER_TOKEN_ID in every proposal it stored. Validation reads the scheduler's optimistic counts, so the
   blocks a step needs are those of its optimistic reach (num_computed + num_scheduled as sent): the corrected
   reach is never longer, and a step whose table does not cover the optimistic one is refused before anything is
   written (TensorRT-LLM #16280: a device position past the host's blocks).

A run in async order ends in the pool a synchronous run ends in: the tokens recorded, the counts corrected
(`conformance/test_async.py` drives both on every backend and compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from spec.drafts import check_accepted
from spec.errors import ScheduleError, TokenIdError, UnknownTokenError
from spec.types import INDEX_DTYPE, PLACEHOLDER_TOKEN_ID, SchedulerOutput, WorkerConfig

if TYPE_CHECKING:
    from spec.state import PoolState

REPORTED_AFTER = 1  # steps applied after a record before an apply reports its faults (rule 6)
PENDING_FIELDS = ("pending_token_indices", "pending_prev_batch_idx")  # the BatchInputs fields of rule 3


@dataclass(frozen=True)
class LateFault:
    """A record's fault, kept for the apply that reports it."""

    error: ScheduleError
    due: int  # the apply call (counted from 1) that raises it


def record_ahead(
    state: PoolState,
    token_ids: np.ndarray,  # [R, max_model_len] the pool's tokens, appended to here
    req_ids: tuple[str, ...],  # [n] batch order
    rows: np.ndarray,  # [n] int64 batch_idx -> req_state_idx, as prepared
    takes: np.ndarray,  # [n] bool: the row's step reached its last input token
    tokens: np.ndarray,  # [n, width] each row's accepted tokens, then placeholders (spec.drafts.accepted_rows)
    counts: np.ndarray,  # [n] tokens before each row's first placeholder
    drafts: list[np.ndarray],  # [n] each batch row's drafts
    proposed: np.ndarray | None,  # [n, P] the drafter's ids for each batch row's next drafts (rule 8), or None
    proposals: np.ndarray,  # [R, >= P] each row's proposals, written here
) -> tuple[np.ndarray, ScheduleError | None]:
    """record_sampled's effect in async mode (rules 1, 6 and 8): returns ([R] drafts rejected per row, the fault)."""
    config = state.config
    known = state.num_known_tokens[rows]  # [n] before the record
    fault = first_fault(req_ids, takes, tokens, counts, drafts, known, config, proposed)
    state.num_proposed[rows] = 0  # a row that does not take its sample proposes nothing
    num_rejected = np.zeros(config.max_num_reqs, np.int64)  # [R]
    state.sampled_in[:] = -1
    for b in np.flatnonzero(takes):
        row, k = rows[b], drafts[b].size
        appended = tokens[b, : counts[b]] if fault is None else np.full(1 + k, PLACEHOLDER_TOKEN_ID)
        end = min(int(known[b]) + appended.size, config.max_model_len)
        token_ids[row, known[b] : end] = appended[: end - known[b]]
        state.num_known_tokens[row] += 1 + k  # the scheduler's count: every draft assumed accepted
        num_rejected[row] = 1 + k - appended.size
        state.sampled_in[row] = b
        state.num_unverified_drafts[row] = k
        if proposed is not None:
            proposals[row, : proposed.shape[1]] = proposed[b] if fault is None else PLACEHOLDER_TOKEN_ID
            state.num_proposed[row] = proposed.shape[1]
    return num_rejected, fault


def first_fault(
    req_ids: tuple[str, ...],
    takes: np.ndarray,  # [n] bool
    tokens: np.ndarray,  # [n, width]
    counts: np.ndarray,  # [n]
    drafts: list[np.ndarray],  # [n]
    known: np.ndarray,  # [n] known tokens of each row before the record
    config: WorkerConfig,
    proposed: np.ndarray | None = None,  # [n, P] the drafter's next drafts (rule 8), or None
) -> ScheduleError | None:
    """The error the synchronous record_sampled would raise for these ids (its first faulty taking row), or None;
    a taking row's proposals are checked after its sampled ids."""
    for b in np.flatnonzero(takes):
        try:
            check_accepted(req_ids[b], tokens[b], int(counts[b]), drafts[b], int(known[b]), config)
        except ScheduleError as error:
            return error
        if proposed is not None:
            bad = proposed[b][(proposed[b] < 0) | (proposed[b] >= config.vocab_size)]
            if bad.size:
                return TokenIdError(req_ids[b], "next_draft_ids", f"{bad[0]} not in [0, {config.vocab_size})")
    return None


def correct_counts(
    state: PoolState,
    sched: SchedulerOutput,
    freed_rows: np.ndarray,  # [f] req_state_idx the apply freed
    num_rejected: np.ndarray,  # [R] drafts the last record rejected per row, cleared here
) -> None:
    """Rule 2, after the next apply's commit: the rejected drafts leave the known tokens, and the optimistic
    num_computed_tokens of each continuing request that apply scheduled. A freed row's count went with it."""
    num_rejected[freed_rows] = 0
    continuing = [state.row_of[c.req_id] for c in sched.cached_requests if not c.resumed]
    state.num_computed_tokens[continuing] -= num_rejected[continuing]
    state.num_known_tokens -= num_rejected
    num_rejected[:] = 0


def forget_unrecorded(state: PoolState, recorded: bool) -> None:
    """Rule 3, at an apply: the rows that sampled in the last record have a pending token only in the step right
    after it. When the step applied before this one was not recorded (it ran no tokens, and an engine runs no
    model on it), its batch is the last one run and sampled nothing: no row takes a pending token from an
    older batch (the host has read that record by now: rule 6's apply after next)."""
    if not recorded:
        state.sampled_in[:] = -1


def proposed_on_device(drafts: np.ndarray, config: WorkerConfig) -> bool:
    """Rule 8: drafts sent as placeholders under async scheduling, their ids the drafter's proposals."""
    return config.async_scheduling and drafts.size > 0 and bool((drafts == PLACEHOLDER_TOKEN_ID).all())


def check_no_drafts_after_unverified(state: PoolState, drafts_of: dict[str, np.ndarray]) -> None:
    """Rule 5 (check 8): a request whose last record's drafts are unverified on the host may not draft again,
    unless its drafts are proposed on the device (rule 8)."""
    for req_id, drafts in drafts_of.items():
        row = state.row_of.get(req_id)
        if row is not None and state.num_unverified_drafts[row] and not proposed_on_device(drafts, state.config):
            detail = f"drafts after {state.num_unverified_drafts[row]} drafts whose verdict the host has not read"
            raise UnknownTokenError(req_id, "scheduled_spec_decode_tokens", detail)


def check_proposed_drafts(state: PoolState, sched: SchedulerOutput, drafts_of: dict[str, np.ndarray]) -> None:
    """Rule 8 (check 8): k placeholder drafts need k proposals the drafter made at the row's last sample; a new or
    resumed request has none (its row's proposals, if any, were not made for the tokens it runs now)."""
    resumed = {c.req_id for c in sched.cached_requests if c.resumed}
    for req_id, drafts in drafts_of.items():
        if not proposed_on_device(drafts, state.config):
            continue
        row = state.row_of.get(req_id)
        proposed = 0 if row is None or req_id in resumed else int(state.num_proposed[row])
        if drafts.size > proposed:
            whose = "a new request" if row is None else "a resumed request" if req_id in resumed else "its row"
            detail = f"{drafts.size} drafts proposed on the device, but the drafter proposed {proposed} for {whose}"
            raise UnknownTokenError(req_id, "scheduled_spec_decode_tokens", detail)


def take_proposals(
    plan_rows: np.ndarray,  # [n] scheduler order -> req_state_idx
    num_drafts: np.ndarray,  # [n] scheduler order
    draft_ids: np.ndarray,  # [sum(num_drafts)] scheduler order: placeholders replaced here
    proposals: np.ndarray,  # [R, P] each row's proposals
) -> None:
    """Rule 8 at the apply: each run of placeholder drafts becomes its row's first k proposals."""
    at = 0
    for row, k in zip(plan_rows.tolist(), num_drafts.tolist(), strict=True):
        if k and draft_ids[at] == PLACEHOLDER_TOKEN_ID:  # validation refuses a mix of ids and placeholders
            draft_ids[at : at + k] = proposals[row, :k]
        at += k


def check_resumed_within_known(state: PoolState, sched: SchedulerOutput) -> None:
    """Rule 7 (check 8): a request resumed while the verdict on its last record's k drafts is unread may be
    scheduled only over the tokens it held before that record: from there on, which token stands at which
    position is the verdict's (with r drafts rejected, the sample lands r positions earlier)."""
    for cached in sched.cached_requests:
        row = state.row_of.get(cached.req_id)
        k = 0 if row is None else int(state.num_unverified_drafts[row])
        if not (cached.resumed and k):
            continue
        held = int(state.num_known_tokens[row]) - 1 - k  # the scheduler's count less the record's 1 + k tokens
        end = int(cached.num_computed_tokens) + int(sched.num_scheduled_tokens[cached.req_id])
        if end > held:
            detail = (f"resumed up to position {end - 1}, but the unread verdict on its {k} drafts decides the "
                      f"tokens from position {held} on")  # fmt: skip
            raise UnknownTokenError(cached.req_id, "num_scheduled_tokens", detail)


def lowest_start(state: PoolState, req_id: str, num_computed: int, resumed: bool) -> int:
    """Rule 4: the lowest position a step sent at `num_computed` may start from once the verdicts are in. A
    resumed count is not corrected (rule 2): such a step starts where it says, whatever the verdict."""
    row = state.row_of.get(req_id)  # a new request holds no row yet, and no unverified drafts
    if row is None or resumed:
        return num_computed
    return max(0, num_computed - int(state.num_unverified_drafts[row]))


def pending_tokens(
    sampled_in: np.ndarray,  # [num_reqs] batch order: the previous batch's batch_idx the row sampled in, or -1
    num_known: np.ndarray,  # [num_reqs] batch order: known tokens, as the scheduler counts them
    num_computed: np.ndarray,  # [num_reqs] batch order: num_computed_tokens, counted the same way
    query_start_loc: np.ndarray,  # [num_reqs + 1]
    num_scheduled: np.ndarray,  # [num_reqs]
) -> tuple[np.ndarray, np.ndarray]:
    """Rule 3: ([num_pending] flat token indices, [num_pending] the previous batch's batch_idx of each).

    The last token's offset in the step, `num_known - 1 - num_computed`, is the same before and after the
    correction (both counts drop by the rejected drafts), so a host that only has the optimistic counts finds it.
    """
    offset = num_known - 1 - num_computed  # [num_reqs]
    pending = (sampled_in >= 0) & (offset >= 0) & (offset < num_scheduled)  # [num_reqs]
    indices = query_start_loc[:-1][pending] + offset[pending]
    return indices.astype(INDEX_DTYPE), sampled_in[pending].astype(INDEX_DTYPE)
