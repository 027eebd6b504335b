"""Drafts (speculative decoding, spec/drafts.py) in fast: where apply stores them and how prepare orders them.

apply writes each drafting request's drafts into the token storage just past its known tokens (under
Triton as token ops of apply's one launch, fast/writes.py), as vLLM v1 writes spec tokens into
token_ids_cpu, so prepare reads them as input ids like any other token. They are not known tokens:
snapshot never shows them, and record_sampled's accepted tokens (or the next step's drafts) overwrite
them. The plan holds the drafts in scheduler order; the batch and the sampler need them in batch order:
`sampler_fields`, one compiled pass that writes the sampler's indices and the batch-order drafts into a batch's
own buffers (host mode: fast/host_prepare.py, beside the batch's other arrays, wrapped with them), or
SamplerFields' reused buffers, uploaded (Triton: fast/kernel_prepare.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from numba import njit

from fast.runtime import upload
from spec.state import StepPlan

# What prepare knows of a drafting step's drafts: (num_drafts [n] int64 scheduler order, draft ids [d] scheduler
# order, order [n] batch_idx -> scheduler index or None when the scheduler's order is the batch order)
StepDrafts = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]
# the same in batch order, for record_sampled: (num_drafts [n] int64, draft ids [d] int64), views of reused buffers
BatchDrafts = tuple[np.ndarray, np.ndarray]
# the sampler's int32 fields, in the order sampler_fields writes them end to end (sizes32): the three of
# [num_reqs] first, so their place depends on the batch's rows alone (host mode keeps their views while it holds)
FIELDS32 = ("num_draft_tokens", "cu_num_draft_tokens", "bonus_logits_indices", "logits_indices",
            "target_logits_indices")  # fmt: skip


def sizes32(n: int, d: int) -> list[int]:
    """The lengths of FIELDS32 for n batch rows and d drafts: [n], [n], [n], [n + d], [d] (4 n + 2 d in all)."""
    return [n, n, n, n + d, d]


def draft_columns(plan: StepPlan, num_drafts: np.ndarray) -> np.ndarray:
    """[n] scheduler order: the column where each request's drafts start, its known tokens after apply.

    A drafting step ends exactly at its last draft (spec/validate.py, check 8), so the column is
    seq_len - num_drafts, read from the plan: a new request's row may still count a previous owner's tokens.
    """
    return plan.num_computed + plan.num_scheduled - num_drafts


@njit(cache=True, nogil=True)
def drafts_end(  # pragma: no cover - compiled; tested through the pool against spec
    num_computed: np.ndarray,  # [n] int64 scheduler order
    num_scheduled: np.ndarray,  # [n] int64 scheduler order
) -> int:
    """The token capacity a drafting step's rows need: the end of the furthest request's last draft (a drafting
    step ends exactly there), in one pass where NumPy's sum and max are two dispatches."""
    end = 0
    for i in range(num_computed.shape[0]):
        end = max(end, num_computed[i] + num_scheduled[i])
    return end


def store_drafts(token_ids: np.ndarray, plan: StepPlan, num_drafts: np.ndarray) -> None:
    """Host mode: every draft of the plan into the token storage [R, capacity] (reserved), in one compiled pass."""
    _store_drafts(token_ids, plan.rows, draft_columns(plan, num_drafts), num_drafts, plan.draft_ids)


@njit(cache=True, nogil=True)
def _store_drafts(  # pragma: no cover - compiled; tested through the pool against spec
    token_ids: np.ndarray,  # [R, capacity] int32 the token storage
    rows: np.ndarray,  # [n] int64 scheduler order -> req_state_idx
    columns: np.ndarray,  # [n] int64 scheduler order: where each request's drafts start (draft_columns)
    num_drafts: np.ndarray,  # [n] int64 scheduler order
    draft_ids: np.ndarray,  # [sum(num_drafts)] scheduler order
) -> None:
    at = 0
    for i in range(rows.shape[0]):
        for j in range(num_drafts[i]):
            token_ids[rows[i], columns[i] + j] = draft_ids[at + j]
        at += num_drafts[i]


class SamplerFields:
    """Under Triton (fast/kernel_prepare.py): a drafting step's sampler fields, built by `sampler_fields` into
    host buffers reused from step to step, then uploaded (under the interpreter, CPU tensors: views of them).
    As the batch's other arrays, they are valid until the next prepare. Host mode writes the same fields into
    the batch's own buffers instead (fast/host_prepare.py).
    """

    def __init__(self) -> None:
        self._out32 = np.zeros(0, np.int32)  # FIELDS32 end to end
        self._out64 = np.zeros(0, np.int64)  # draft_token_ids | num_drafts [num_reqs] (record_sampled's copy)
        self._cpu32, self._cpu64 = torch.from_numpy(self._out32), torch.from_numpy(self._out64)  # on CPU: views
        self._fields: dict[str, Any] = {}  # the last step's tensors
        self._key: tuple[int, int] | None = None  # on CPU: the (num_reqs, num_drafts) _fields were cut for

    def build(
        self,
        cu_num_tokens: np.ndarray,  # [num_reqs] int64 batch order: each row's end in the flat tokens
        drafts: StepDrafts,
        device: torch.device,
    ) -> tuple[dict[str, Any], BatchDrafts]:
        """(the BatchInputs fields, the drafts in batch order)."""
        num_drafts, draft_ids, order = drafts
        n, d = num_drafts.shape[0], draft_ids.shape[0]
        if self._out32.shape[0] < 4 * n + 2 * d or self._out64.shape[0] < n + d:
            self._out32 = np.zeros(2 * (4 * n + 2 * d), np.int32)
            self._out64 = np.zeros(2 * (n + d), np.int64)
            self._cpu32, self._cpu64 = torch.from_numpy(self._out32), torch.from_numpy(self._out64)
            self._key = None  # the views were of the old buffers
        out32, out64 = self._out32[: 4 * n + 2 * d], self._out64[: n + d]
        sampler_fields(cu_num_tokens, num_drafts, draft_ids, IDENTITY if order is None else order, out32, out64)
        on_cpu = device.type == "cpu"
        if not on_cpu or (n, d) != self._key:  # on CPU the tensors view the buffers: same shape, same views
            packed32 = self._cpu32 if on_cpu else upload(out32, device)
            packed64 = self._cpu64 if on_cpu else upload(out64, device)
            parts = packed32.split([*sizes32(n, d), packed32.shape[0] - (4 * n + 2 * d)])  # one call, six views
            self._fields = dict(zip(FIELDS32, parts, strict=False)) | {"draft_token_ids": packed64[:d]}
            self._key = (n, d) if on_cpu else None
        return self._fields, (out64[d:], out64[:d])


IDENTITY = np.zeros(0, np.int64)  # sampler_fields' order for the scheduler's own


@njit(cache=True, nogil=True)
def sampler_fields(  # pragma: no cover - compiled; tested through the pool against spec's draft_logits
    cu_num_tokens: np.ndarray,  # [n] int64 batch order
    num_drafts: np.ndarray,  # [n] int64 scheduler order
    draft_ids: np.ndarray,  # [d] scheduler order
    order: np.ndarray,  # [n] int64 batch_idx -> scheduler index, or empty: the same order
    out32: np.ndarray,  # [4n + 2d] int32 out: num_draft_tokens [n] | cu [n] | bonus [n] | logits [n + d] | target [d]
    out64: np.ndarray,  # [n + d] int64 out: draft_token_ids [d] | num_drafts [n], batch order
) -> None:
    """spec.drafts.draft_logits for every batch row, the batch order, the logits rows and the draft ids written
    together, row by row (a dozen NumPy calls over the step cost more than the rest of a drafting prepare)."""
    n, d = num_drafts.shape[0], draft_ids.shape[0]
    first_draft = np.empty(n, np.int64)  # [n] scheduler order: where each request's drafts start in draft_ids
    total = 0
    for s in range(n):
        first_draft[s] = total
        total += num_drafts[s]
    counts, cu, bonus, logits, target = 0, n, 2 * n, 3 * n, 4 * n + d
    logits_row = drafts_done = 0
    for b in range(n):
        s = order[b] if order.shape[0] else b
        k = num_drafts[s]
        end = cu_num_tokens[b]
        for j in range(k + 1):  # the row's last k + 1 tokens: its drafts' targets, then the bonus token
            out32[logits + logits_row + j] = end - (k + 1) + j
        for j in range(k):
            out32[target + drafts_done + j] = logits_row + j
            out64[drafts_done + j] = draft_ids[first_draft[s] + j]
        out32[bonus + b] = logits_row + k
        drafts_done += k
        out32[counts + b] = k
        out32[cu + b] = drafts_done
        out64[d + b] = k
        logits_row += k + 1
