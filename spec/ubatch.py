"""Micro-batches (dual-batch overlap, DBO): one prepared batch split in two, each half run on its own stream.

vLLM 0.32 overlaps one micro-batch's expert all-to-all with the other's compute (vllm/v1/worker/ubatch_utils.py,
vllm/v1/worker/gpu/ubatch_utils.py for model runner v2). The rules below follow model runner v2, rule by rule:

1. Split point (`maybe_create_ubatch_slices`): the first half takes flat tokens [0, S), the second [S, T) with
   T = num_tokens_padded and S = T // 2 by default. Padding tokens belong to whichever half holds them.
2. Request slices (`maybe_create_ubatch_slices`, `_pad_out_ubatch_slices`, v2's `create_ubatch_slices`): over
   query_start_loc of the real requests, the first half holds batch rows [0, searchsorted(qsl, S, "left")), the
   second [searchsorted(qsl, S, "right") - 1, num_reqs_padded), num_reqs_padded being the rows of the batch's
   per-request arrays (padded request rows included). A request that straddles S is in both. The second half's
   start is clamped to the last real request and the first's stop to num_reqs_padded (v2's clamp), so a second
   half lying wholly in padding holds the last request with no query tokens: a well-formed half with no work.
3. query_start_loc (`_slice_query_start_loc`): the half's rows' offsets minus the half's first token, clamped to
   [0, the half's token count]: a straddling request keeps, in each half, just the tokens that half owns.
4. seq_lens (`_slice_seq_lens`): the half's rows' seq_lens; the last row loses the tokens past the half's end,
   max(0, qsl[stop] - token_stop). Tokens of a request the FIRST half ran still count in the second: their KV is
   written before the second half reads it (the second half's attention sees the whole prefix).
5. Everything per request (index_mapping, block tables) is the request slice of the batch's; everything per
   token (positions, input_ids, slot mappings, M-RoPE positions: `slice_model_inputs`) the token slice.
6. The half's own counts (`_slice_input_batch`): num_reqs = real rows in it, num_scheduled_tokens =
   diff(query_start_loc)[:num_reqs], num_tokens = real tokens in it, num_tokens_padded = its token count.
7. Not split: logits_indices, the draft fields (spec/drafts.py) and the async pending fields
   (spec/async_steps.py). Sampling runs once over the merged output (`merge_ubatch_outputs` concatenates the
   halves' outputs in token order), so the whole batch's logits_indices index it unchanged; v2's sub-batch
   carries them over "and must not be read off a sub-batch". The pending input ids are gathered into
   input_ids before the model runs, so the halves' input_ids already hold them.
8. Model-kind records (BatchInputs.features): a record that defines `split_for_ubatch(request_slice,
   token_slice)` is split by it (M-RoPE's [3, T] positions: the token slice, as `slice_model_inputs`); a batch
   with any other record (Mamba's state indices, cross-attention's encoder slots) is refused.
9. When to split (`should_split`): v1 splits when the step's real token count reaches a threshold
   (`check_ubatch_thresholds`: dbo_decode_token_threshold for a uniform decode batch, else
   dbo_prefill_token_threshold) and the last half would hold a real token (`is_last_ubatch_empty`); v2 drops
   the second test and runs an all-padding half as a dummy (rule 2). Shown for one data-parallel rank.
10. Refused (UbatchSplitError, a ValueError naming the argument): a split point that is not an integer in
    [1, num_tokens_padded - 1] (either half would have no tokens: v2 asserts `not ubatch_slice.is_empty()`), a
    batch with no request, host query lengths that are not the batch's, and records as in rule 8. The batch is
    never changed: the halves' rebased arrays are new ones.

Property (tests/test_ubatch.py): each half's paged attention over its query_start_loc, seq_lens and block
table equals the whole batch's attention on the half's tokens; the halves' outputs concatenated are the
whole batch's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from spec.types import FEATURE_FIELDS, INDEX_DTYPE, BatchInputs, SchedulerOutput, is_integral

DECODE_TOKEN_THRESHOLD = 32  # vLLM's ParallelConfig.dbo_decode_token_threshold default
PREFILL_TOKEN_THRESHOLD = 512  # vLLM's ParallelConfig.dbo_prefill_token_threshold default


class UbatchSplitError(ValueError):
    """A batch, split point or host count the split refuses. `argument` names the argument; nothing changed."""

    def __init__(self, argument: str, detail: str) -> None:
        self.argument = argument
        self.detail = detail
        super().__init__(f"split_batch: {argument}: {detail}")


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """One half of a batch: what a backend runs attention on. Its rows are ubatch rows, u = batch_idx -
    request_slice.start; its tokens are flat token index - token_slice.start. n = rows of its per-request
    arrays (request_slice's length), num_reqs = len(req_ids) <= n, T' = num_tokens_padded."""

    request_slice: slice  # batch_idx range of the whole batch this half's rows are
    token_slice: slice  # flat token range of the whole batch this half's tokens are
    req_ids: tuple[str, ...]  # [num_reqs] ubatch row -> req_id (real rows only)
    index_mapping: Any  # [n] int32, ubatch row -> req_state_idx
    num_scheduled_tokens: Any  # [num_reqs] int32, ubatch row -> its tokens in THIS half
    query_start_loc: Any  # [n + 1] int32, rebased onto the half's tokens, clamped to [0, T']
    seq_lens: Any  # [n] int32, the last row cut at the half's end
    positions: Any  # [T'] int64
    input_ids: Any  # [T'] int64
    block_tables: tuple[Any, ...]  # per group: [n, max_blocks_per_req(g)] int32, ubatch row -> physical block ids
    slot_mappings: tuple[Any, ...]  # per group: [T'] int64 (PAD_SLOT_ID for padding)
    num_tokens: int  # real tokens in the half
    num_tokens_padded: int  # T' = token_slice's length
    features: tuple[Any, ...] = ()  # the batch's feature records, each split by its split_for_ubatch

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def __getattr__(self, name: str) -> Any:
        """A feature record's field by its name, as on BatchInputs (`half.mrope_positions`; None without it)."""
        for record in self.__dict__.get("features", ()):
            if name in record.__dataclass_fields__:
                return getattr(record, name)
        if name in FEATURE_FIELDS:
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def should_split(
    num_tokens: int,  # the step's real tokens
    num_tokens_padded: int,
    *,
    uniform_decode: bool,  # every request runs the same decode query length (1 + drafts)
    decode_token_threshold: int = DECODE_TOKEN_THRESHOLD,
    prefill_token_threshold: int = PREFILL_TOKEN_THRESHOLD,
    refuse_empty_last: bool = True,  # v1 (is_last_ubatch_empty); False: v2, which runs it as a dummy
) -> bool:
    """Rule 9: whether vLLM splits a step of one data-parallel rank in two."""
    for name, value in (("num_tokens", num_tokens), ("num_tokens_padded", num_tokens_padded),
                        ("decode_token_threshold", decode_token_threshold),
                        ("prefill_token_threshold", prefill_token_threshold)):  # fmt: skip
        if not is_integral(value) or value < 0:
            raise ValueError(f"should_split: {name} must be an integer >= 0, got {value!r}")
    if num_tokens_padded < num_tokens:
        raise ValueError(f"should_split: num_tokens_padded {num_tokens_padded} < num_tokens {num_tokens}")
    threshold = decode_token_threshold if uniform_decode else prefill_token_threshold
    if num_tokens < threshold:
        return False
    return not (refuse_empty_last and num_tokens_padded // 2 >= num_tokens)


def host_query_lens(sched: SchedulerOutput, batch: BatchInputs) -> np.ndarray:  # [num_reqs] int32
    """The batch's query lengths from the host's own copy (the scheduler's counts, in batch order): what a
    device backend splits by without reading the device."""
    return np.array([sched.num_scheduled_tokens[r] for r in batch.req_ids], INDEX_DTYPE)


@dataclass(frozen=True)
class UbatchSlices:
    """Rule 2's slices of the two halves, from host counts only."""

    first_requests: slice
    first_tokens: slice
    second_requests: slice
    second_tokens: slice

    def halves(self) -> tuple[tuple[slice, slice], tuple[slice, slice]]:
        return (self.first_requests, self.first_tokens), (self.second_requests, self.second_tokens)


def ubatch_slices(
    query_lens_np: np.ndarray,  # [num_reqs] the real requests' query lengths, batch order
    num_reqs_padded: int,  # rows of the batch's per-request arrays
    num_tokens_padded: int,
    split_point: int,
) -> UbatchSlices:
    """Rules 1 and 2 (`maybe_create_ubatch_slices` with v2's clamp), on host counts; the arguments are checked."""
    cu = np.zeros(len(query_lens_np) + 1, np.int64)  # [num_reqs + 1] query_start_loc of the real requests
    np.cumsum(query_lens_np, out=cu[1:])
    num_reqs = len(query_lens_np)
    first_stop = min(int(np.searchsorted(cu, split_point, side="left")), num_reqs_padded)
    second_start = min(int(np.searchsorted(cu, split_point, side="right")) - 1, num_reqs - 1)
    return UbatchSlices(
        slice(0, first_stop), slice(0, split_point),
        slice(second_start, num_reqs_padded), slice(split_point, num_tokens_padded),
    )  # fmt: skip


def check_split(batch: BatchInputs, split_point: object, query_lens_np: object) -> tuple[int, np.ndarray]:
    """Rule 10 on what the host knows: the split point (default T // 2) and the host query lengths, checked
    against the batch's shapes and counts; shared by every backend (values on a device are not read)."""
    padded = batch.num_tokens_padded
    if split_point is None:
        split_point = padded // 2
    if not is_integral(split_point):
        raise UbatchSplitError("split_point", f"must be an integer, got {split_point!r}")
    if not 0 < int(split_point) < padded:  # type: ignore[call-overload]
        raise UbatchSplitError(
            "split_point", f"{split_point} leaves a half without tokens: it must lie in [1, {padded - 1}] "
            f"(num_tokens_padded={padded})"
        )  # fmt: skip
    if batch.num_reqs == 0:
        raise UbatchSplitError("batch", "holds no request: there is nothing to split")
    lens = np.asarray(query_lens_np)
    if lens.shape != (batch.num_reqs,) or not np.issubdtype(lens.dtype, np.integer):
        raise UbatchSplitError(
            "query_lens_np", f"must be [{batch.num_reqs}] integers (one per request), got {lens.dtype} {lens.shape}"
        )
    if int(lens.sum()) != batch.num_tokens or (lens.size and int(lens.min()) < 1):
        raise UbatchSplitError(
            "query_lens_np", f"{lens.tolist()} are not the batch's query lengths ({batch.num_tokens} tokens, >= 1 each)"
        )
    for record in batch.features:
        if not callable(getattr(record, "split_for_ubatch", None)):
            kind = f"{type(record).__module__}.{type(record).__name__}"
            raise UbatchSplitError("batch.features", f"the {kind} record cannot be split into micro-batches yet")
    return int(split_point), lens  # type: ignore[call-overload]


def split_batch(
    batch: BatchInputs,
    split_point: int | None = None,  # first token of the second half; None: num_tokens_padded // 2
    *,
    query_lens_np: np.ndarray | None = None,  # [num_reqs] host query lengths; None: batch.num_scheduled_tokens
) -> tuple[MicroBatch, MicroBatch]:
    """The batch's two micro-batches (module docstring, rules 1 to 8)."""
    own = np.asarray(batch.num_scheduled_tokens)[: batch.num_reqs]  # [num_reqs] padded request rows left out
    split, lens = check_split(batch, split_point, own if query_lens_np is None else query_lens_np)
    if not np.array_equal(lens, own):
        raise UbatchSplitError("query_lens_np", f"{lens.tolist()} differ from the batch's num_scheduled_tokens")
    slices = ubatch_slices(lens, len(batch.index_mapping), batch.num_tokens_padded, split)
    first, second = (_half(batch, requests, tokens) for requests, tokens in slices.halves())
    return first, second


def _half(batch: BatchInputs, requests: slice, tokens: slice) -> MicroBatch:
    start, stop = requests.start, requests.stop
    num_tokens_padded = tokens.stop - tokens.start
    qsl = np.clip(batch.query_start_loc[start : stop + 1].astype(np.int64) - tokens.start, 0, num_tokens_padded)
    seq_lens = batch.seq_lens[start:stop].copy()  # [n] the batch's stay as they are
    seq_lens[-1] -= max(0, int(batch.query_start_loc[stop]) - tokens.stop)
    num_reqs = max(0, min(stop, batch.num_reqs) - start)
    return MicroBatch(
        request_slice=requests,
        token_slice=tokens,
        req_ids=batch.req_ids[start : start + num_reqs],
        index_mapping=batch.index_mapping[start:stop],
        num_scheduled_tokens=np.diff(qsl)[:num_reqs].astype(INDEX_DTYPE),
        query_start_loc=qsl.astype(INDEX_DTYPE),
        seq_lens=seq_lens,
        positions=batch.positions[tokens],
        input_ids=batch.input_ids[tokens],
        block_tables=tuple(t[start:stop] for t in batch.block_tables),
        slot_mappings=tuple(s[tokens] for s in batch.slot_mappings),
        num_tokens=max(0, min(tokens.stop, batch.num_tokens) - tokens.start),
        num_tokens_padded=num_tokens_padded,
        features=tuple(r.split_for_ubatch(requests, tokens) for r in batch.features),
    )
