"""The end-to-end check: everything a request got from the paged pipeline equals a dense recompute.

For one request, run the model densely in float64 over its whole token sequence (prompt + sampled).
Every logits row the paged run produced for it must match the dense row at the same position within
`dense_logit_tolerance`, and every sampled token must be the dense argmax, except where the dense
top-2 margin is within twice the tolerance: there both choices are consistent with float32 rounding,
and the sequence that follows was checked as the one actually generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slotmap.tiny.engine import RequestRecord
from slotmap.tiny.model import TinyDecoder, dense_logit_tolerance, sequence_mrope_positions


@dataclass
class DenseCheck:
    req_id: str
    num_tokens: int  # the request's whole sequence
    rows_checked: int  # logits rows compared
    tokens_checked: int  # sampled tokens compared
    max_error: float  # largest |paged - dense| over every compared logit
    tolerance: float
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def check_request(model: TinyDecoder, record: RequestRecord) -> DenseCheck:
    mrope = None
    if model.config.mrope_section is not None:  # a model with M-RoPE: the sequence's three rows (spec/mrope.py)
        mrope = sequence_mrope_positions(record.mrope_positions, record.mrope_position_delta, len(record.tokens))
    dense = model.forward_dense(record.tokens, torch.float64, mrope, record.encoder_ids).cpu()  # [L, vocab]
    tol = dense_logit_tolerance(dense, model.config)
    check = DenseCheck(record.req_id, len(record.tokens), 0, 0, 0.0, tol)
    for entry in record.logits:
        ref = dense[entry.position]
        err = float((entry.logits.double() - ref).abs().max())
        check.max_error = max(check.max_error, err)
        check.rows_checked += 1
        if not err <= tol:  # also catches NaN from reading an unwritten cache slot
            check.failures.append(f"{record.req_id} position {entry.position}: |paged - dense| = {err:.3g} > {tol:.3g}")
        if entry.sampled is None:
            continue
        check.tokens_checked += 1
        if record.tokens[entry.position + 1] != entry.sampled:
            check.failures.append(
                f"{record.req_id} position {entry.position + 1}: sequence holds {record.tokens[entry.position + 1]},"
                f" sampled {entry.sampled}"
            )
        allowed = torch.nonzero(ref >= ref.max() - 2 * tol).flatten().tolist()  # argmax within rounding
        if entry.sampled not in allowed:
            check.failures.append(
                f"{record.req_id} position {entry.position}: sampled {entry.sampled}, dense argmax {int(ref.argmax())}"
            )
    return check
