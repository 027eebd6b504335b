"""`slotmap explain --ubatch [--split-at N]`: the step split into two micro-batches (spec/ubatch.py).

spec's split_batch applied to the backend's batch: each half's token slice and request slice (a request
that straddles the split point is in both), its query_start_loc rebased onto its own tokens, its seq_lens
with the last row cut at the half's end (the second half still counts the first half's tokens of a
straddling request: their KV is written before it reads), and its index_mapping. Default split point:
num_tokens_padded // 2, as vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from slotmap.pictures.steps import StepView, spec_inputs
from spec.ubatch import split_batch


@dataclass(frozen=True)
class Half:
    token_start: int  # the half's flat tokens are [token_start, token_stop) of the whole batch
    token_stop: int
    request_start: int  # its rows are batch rows [request_start, request_stop)
    request_stop: int
    req_ids: tuple[str, ...]  # [num_reqs] its real rows' requests
    index_mapping: tuple[int, ...]  # [n] ubatch row -> req_state_idx
    query_start_loc: tuple[int, ...]  # [n + 1] rebased onto the half's tokens
    seq_lens: tuple[int, ...]  # [n] the last row cut at the half's end
    num_tokens: int  # real tokens in the half


@dataclass(frozen=True)
class UbatchExplanation:
    split_point: int  # first flat token of the second half
    num_tokens_padded: int
    halves: tuple[Half, Half]
    straddling: str | None  # the request both halves hold tokens of, if any


def explain_ubatch(view: StepView, split_point: int | None = None) -> UbatchExplanation:
    """The step's two micro-batches; UbatchSplitError (a ValueError naming the argument) where spec refuses."""
    halves = split_batch(spec_inputs(view), split_point)
    shown = tuple(
        Half(
            h.token_slice.start, h.token_slice.stop, h.request_slice.start, h.request_slice.stop, tuple(h.req_ids),
            tuple(int(x) for x in h.index_mapping), tuple(int(x) for x in h.query_start_loc),
            tuple(int(x) for x in h.seq_lens), int(h.num_tokens),
        )
        for h in halves
    )  # fmt: skip
    first, second = shown
    both = [r for r in first.req_ids if r in second.req_ids and _has_tokens(first, r) and _has_tokens(second, r)]
    return UbatchExplanation(first.token_stop, second.token_stop, (first, second), both[0] if both else None)


def _has_tokens(half: Half, req_id: str) -> bool:
    u = half.req_ids.index(req_id)
    return half.query_start_loc[u + 1] > half.query_start_loc[u]


def render_ubatch(ux: UbatchExplanation, console: Console) -> None:
    console.rule(f"micro-batches: split at flat token {ux.split_point} of {ux.num_tokens_padded}")
    table = Table(title="each half: a token slice and a request slice of the batch, rebased")
    for col in ("half", "flat tokens", "batch rows", "req_ids", "index_mapping", "query_start_loc", "seq_lens",
                "real tokens"):  # fmt: skip
        table.add_column(col, justify="right")
    for i, h in enumerate(ux.halves):
        table.add_row(
            str(i), f"[{h.token_start}, {h.token_stop})", f"[{h.request_start}, {h.request_stop})",
            ", ".join(h.req_ids), str(list(h.index_mapping)), str(list(h.query_start_loc)), str(list(h.seq_lens)),
            str(h.num_tokens),
        )  # fmt: skip
    console.print(table)
    if ux.straddling is not None:
        first = ux.halves[0]
        cut = first.seq_lens[first.req_ids.index(ux.straddling)]
        console.print(
            f"{ux.straddling} straddles the split: in both halves; the first half's seq_len for it is cut to {cut} "
            "(its tokens past the split are the second half's), the second's keeps the whole prefix",
            markup=False,
        )
    else:
        console.print("no request straddles the split point")
    console.print("logits_indices, drafts and pending tokens are not split: sampling runs once on the merged output")
