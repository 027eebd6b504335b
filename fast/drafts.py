"""Drafts (speculative decoding, spec/drafts.py) in fast: where apply stores them and how prepare orders them.

apply writes each drafting request's drafts into the token storage just past its known tokens (under
Triton as token ops of apply's one launch, fast/writes.py), as vLLM v1 writes spec tokens into
token_ids_cpu, so prepare reads them as input ids like any other token. They are not known tokens:
snapshot never shows them, and record_sampled's accepted tokens (or the next step's drafts) overwrite
them. The plan holds the drafts in scheduler order; the batch and the sampler need them in batch order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fast.runtime import upload
from spec.drafts import DraftLogits
from spec.state import StepPlan, ranges
from spec.types import INDEX_DTYPE


def draft_columns(plan: StepPlan, num_drafts: np.ndarray) -> np.ndarray:
    """[n] scheduler order: the column where each request's drafts start, its known tokens after apply.

    A drafting step ends exactly at its last draft (spec/validate.py, check 8), so the column is
    seq_len - num_drafts, read from the plan: a new request's row may still count a previous owner's tokens.
    """
    return plan.num_computed + plan.num_scheduled - num_drafts


def draft_positions(plan: StepPlan, num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([num_drafts] req_state_idx, [num_drafts] position) of every draft of the plan, in its order."""
    drafting = np.flatnonzero(num_drafts)  # [d] scheduler order
    which, within = ranges(num_drafts[drafting])  # [num_drafts] each draft's request, its index there
    return plan.rows[drafting][which], draft_columns(plan, num_drafts)[drafting][which] + within


def batch_drafts(
    num_drafts: np.ndarray,  # [n] scheduler order
    draft_ids: np.ndarray,  # [sum(num_drafts)] scheduler order
    order: np.ndarray | None,  # [n] batch_idx -> scheduler order index, or None: the same order
) -> tuple[np.ndarray, np.ndarray]:
    """(num_drafts [num_reqs], draft ids [sum]) in batch order."""
    if order is None:
        return num_drafts, draft_ids
    counts = num_drafts[order]  # [num_reqs]
    starts = (np.cumsum(num_drafts) - num_drafts)[order]  # [num_reqs] where each row's drafts begin in draft_ids
    which, within = ranges(counts)
    return counts, draft_ids[starts[which] + within]


def sampler_tensors(sampler: DraftLogits, device: torch.device) -> dict[str, Any]:
    """The sampler's indices as BatchInputs fields: the int32 ones in one host->device copy, the ids in another."""
    int32 = [sampler.logits_indices, sampler.num_draft_tokens, sampler.cu_num_draft_tokens,
             sampler.target_logits_indices, sampler.bonus_logits_indices]  # fmt: skip
    packed = upload(np.concatenate(int32).astype(INDEX_DTYPE), device)
    ends = np.cumsum([a.size for a in int32]).tolist()
    parts = [packed[end - a.size : end] for a, end in zip(int32, ends, strict=True)]
    names = ("logits_indices", "num_draft_tokens", "cu_num_draft_tokens", "target_logits_indices",
             "bonus_logits_indices")  # fmt: skip
    return dict(zip(names, parts, strict=True)) | {"draft_token_ids": upload(sampler.draft_token_ids, device)}
