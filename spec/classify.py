"""Row classification: which batch rows are prefilling, which may run as a decode, and whether the batch is a
uniform decode, all decided from each row's PROGRESS, never from the batch's shape.

A batch whose rows all schedule 1 + K tokens has a uniform decode's shape, but a prompt chunk of exactly
1 + K tokens has it too; dispatched to a uniform-decode graph, that chunk runs the decode kernels, which never
write a linear-attention or Mamba state for its prompt (vLLM #53051, #50532, #47123; vllm-ascend #6835,
#12255). vLLM 0.32's V1 runner decides uniform by shape alone (gpu_model_runner `_is_uniform_decode`:
max_query_len == 1 + K and num_tokens == max_query_len * num_reqs); its model runner v2 asks progress first
(vllm/v1/worker/gpu/model_runner.py `gather_batch_req_state`: `decode_graph_eligible`, then
`get_uniform_decode_token_count`). slotmap follows MRv2, with one difference stated below.

Per batch row b with c = num_computed_tokens before the step, q = num_scheduled_tokens, P = the request's
prompt length (PoolState.prompt_lens, set when the request is added, cleared with its row):

  is_prefilling[b] = c < P       vLLM's rule in both runners (V1 `num_computed_tokens < num_prompt_tokens`,
                                 MRv2 `num_computed_prefill_tokens < prefill_len`; MRv2's prefill_len is the
                                 token count handed to the runner when the request was added, the prompt here:
                                 slotmap keeps a preempted request's row and tokens, so it never re-adds one)
  is_decode[b]     = not is_prefilling[b] and q <= 1 + K
  uniform_decode   = num_reqs > 0 and every row is_decode with q == 1 + K exactly

K is the step's drafts per request (vLLM's num_speculative_tokens; `CapturedGraphs.uniform_decode_query_len`
is 1 + K when graphs are given, else 1 + the most drafts any row of the step has).

Where slotmap differs from MRv2: MRv2 lets a prefilling row with exactly one new token over existing context
run as a decode (`prefill_runs_as_decode_np`), and clears that row's is_prefilling for the Mamba state only.
slotmap does not: a row that schedules any prompt token is a prefill, whatever its length, for every consumer
of the flag (spec/mamba.py's record, spec/mla_split.py). The cost is a graph not taken (the batch dispatches
as mixed), never a state not written.

The decode/prefill split (num_decodes, num_decode_tokens) is vLLM's `split_decodes_and_prefills` with
`treat_short_extends_as_decodes=False` applied to slotmap's batch order: the leading run of decode rows.
slotmap's order (stable sort by q ascending, spec/batch.py) puts short rows first, which is decode-first
only when no prefill row is as short as a decode: a 2-token prompt chunk sorts before a 3-token verification
(K = 2), so the chunk is row 0 and both rows go to the prefill path (num_decodes = 0). A 1 + K-token prompt
chunk among decodes of 1 + K tokens keeps its scheduler place among them, and it ends the decode run there.
vLLM instead reorders its batch decode-first (`reorder_batch_to_split_decodes_and_prefills`, V1; MRv2 sorts
verifications, then rows of 1 + K tokens, by its `sort_batch_req_ids`); spec/mla_split.py's
decode_first_order gives that order where a backend needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from spec.types import is_integral


@dataclass(frozen=True, eq=False)
class RowClasses:
    """The batch's classification (BatchInputs.row_classes), over its real rows in batch order."""

    is_prefilling: Any  # [num_reqs] bool, c < the request's prompt length
    is_decode: Any  # [num_reqs] bool, not prefilling and q <= decode_query_len
    decode_query_len: int  # 1 + K
    uniform_decode: bool  # every row a decode by progress with q == decode_query_len; False for no rows
    max_query_len: int  # max q over the rows (0 for no rows)
    num_decodes: int  # rows [0, num_decodes) are the leading run of decodes (vLLM's split)
    num_decode_tokens: int  # their tokens: flat tokens [0, num_decode_tokens)


def classify(
    num_scheduled: np.ndarray,  # [num_reqs] batch order
    num_computed: np.ndarray,  # [num_reqs] batch order: num_computed_tokens before the step
    prompt_lens: np.ndarray,  # [num_reqs] batch order: the request's prompt length
    decode_query_len: int,  # 1 + K
) -> RowClasses:
    if not is_integral(decode_query_len) or decode_query_len < 1:
        raise ValueError(f"classify: decode_query_len must be an int >= 1, got {decode_query_len!r}")
    q = np.asarray(num_scheduled, np.int64)
    is_prefilling = np.asarray(num_computed, np.int64) < np.asarray(prompt_lens, np.int64)
    is_decode = decode_rows(q, is_prefilling, decode_query_len)
    uniform = bool(q.size) and bool(is_decode.all()) and bool((q == decode_query_len).all())
    num_decodes = q.size if is_decode.all() else int(np.argmin(is_decode))  # the first row that is not a decode
    return RowClasses(
        is_prefilling=is_prefilling,
        is_decode=is_decode,
        decode_query_len=int(decode_query_len),
        uniform_decode=uniform,
        max_query_len=int(q.max()) if q.size else 0,
        num_decodes=num_decodes,
        num_decode_tokens=int(q[:num_decodes].sum()),
    )


def decode_rows(
    query_lens: np.ndarray,  # [num_reqs] int64 tokens scheduled per batch row
    is_prefilling: np.ndarray,  # [num_reqs] bool
    threshold: int,  # the most tokens a decode row schedules: 1 + K, or an MLA backend's reorder_batch_threshold
    *,
    treat_short_extends_as_decodes: bool = False,  # vLLM 0.32's MLA default outside context parallelism: True
) -> np.ndarray:  # [num_reqs] bool, batch_idx -> the row may run as a decode
    """The one rule for "may this row run as a decode": at most `threshold` tokens and not prefilling, so a prompt
    chunk of 1 + K tokens or fewer is a prefill (vLLM #53051, vllm-ascend #5583). vLLM's MLA builder by default
    (`treat_short_extends_as_decodes=True`) looks at the length alone; spec/mla_split.py offers that form."""
    short = query_lens <= threshold
    return short if treat_short_extends_as_decodes else short & ~is_prefilling


def step_decode_query_len(num_drafts: np.ndarray | None) -> int:
    """1 + K for a step prepared without graphs: 1 + the most drafts any of its rows has (1 without drafts)."""
    return 1 + (int(num_drafts.max()) if num_drafts is not None and num_drafts.size else 0)
