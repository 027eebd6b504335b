"""Row classification on the host (spec/classify.py's rule): one compiled pass over counts the pool already has.

The classification decides the graph a batch runs, a host decision (fast/graphs.py), so it is made on the host
copies prepare holds anyway (the plan's counts in batch order, the mirror's prompt lengths): no device read. Its
arrays are handed out as CPU tensors over host memory (vLLM's is_prefilling is a CPU tensor too).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from spec.classify import RowClasses


def classify(
    num_scheduled: np.ndarray,  # [num_reqs] int64 batch order
    num_computed: np.ndarray,  # [num_reqs] int64 batch order, before the step (the host's count)
    prompt_lens: np.ndarray,  # [num_reqs] int64 batch order
    decode_query_len: int,  # 1 + K
) -> RowClasses:
    n = num_scheduled.shape[0]
    flags = np.empty((2, n), np.bool_)  # is_prefilling | is_decode
    uniform, max_query_len, num_decodes, num_decode_tokens = _classify(
        num_scheduled, num_computed, prompt_lens, decode_query_len, flags
    )
    return RowClasses(
        is_prefilling=torch.from_numpy(flags[0]),
        is_decode=torch.from_numpy(flags[1]),
        decode_query_len=decode_query_len,
        uniform_decode=bool(uniform),
        max_query_len=int(max_query_len),
        num_decodes=int(num_decodes),
        num_decode_tokens=int(num_decode_tokens),
    )


@njit(cache=True, nogil=True)
def _classify(  # pragma: no cover - compiled; tested against spec's classify
    num_scheduled: np.ndarray,  # [n] int64
    num_computed: np.ndarray,  # [n] int64
    prompt_lens: np.ndarray,  # [n] int64
    decode_query_len: int,
    flags: np.ndarray,  # [2, n] bool out: is_prefilling | is_decode
) -> tuple[bool, int, int, int]:  # uniform, max_query_len, num_decodes, num_decode_tokens
    n = num_scheduled.shape[0]
    uniform = n > 0
    longest, num_decodes, decode_tokens, leading = 0, 0, 0, True
    for b in range(n):
        q = num_scheduled[b]
        prefilling = num_computed[b] < prompt_lens[b]
        decode = (not prefilling) and q <= decode_query_len
        flags[0, b] = prefilling
        flags[1, b] = decode
        uniform = uniform and decode and q == decode_query_len
        longest = max(longest, q)
        leading = leading and decode
        if leading:
            num_decodes += 1
            decode_tokens += q
    return uniform, longest, num_decodes, decode_tokens
