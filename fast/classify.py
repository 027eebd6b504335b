"""Row classification on the host (spec/classify.py's rule): one compiled pass over counts the pool already has.

The classification decides the graph a batch runs, a host decision (fast/graphs.py), so it is made on the host
copies prepare holds anyway (the plan's counts in batch order, the mirror's prompt lengths): no device read. Its
arrays are handed out as CPU tensors over host memory (vLLM's is_prefilling is a CPU tensor too).

A pool classifies every step, so its `Classifier` keeps the flags in a buffer reused from step to step, as
fast/host_prepare.py keeps the batch's (valid until the next prepare), and a step classified like the last (every
step of a steady decode batch) hands out the last step's RowClasses object, its views holding this step's flags:
the per-step cost is the compiled pass alone.
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
    """One classification with buffers of its own (a dummy batch's, a test's)."""
    return Classifier()(num_scheduled, num_computed, prompt_lens, decode_query_len)


class Classifier:
    """The classification of each step of one pool, its flags in a reused buffer."""

    def __init__(self) -> None:
        self._flags = np.zeros((2, 0), np.bool_)  # [2, >= num_reqs] is_prefilling | is_decode
        self._stats = np.zeros(4, np.int64)  # uniform, max_query_len, num_decodes, num_decode_tokens
        self._last: RowClasses | None = None
        self._last_key: tuple[int, ...] = ()
        # the flags' two tensors over the buffer for _views_rows rows: kept while the row count holds (a drafting
        # step's counts change from step to step, its rows seldom)
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None
        self._views_rows = -1

    def __call__(
        self,
        num_scheduled: np.ndarray,  # [num_reqs] int64 batch order
        num_computed: np.ndarray,  # [num_reqs] int64 batch order
        prompt_lens: np.ndarray,  # [num_reqs] int64 batch order
        decode_query_len: int,  # 1 + K
    ) -> RowClasses:
        n = num_scheduled.shape[0]
        if self._flags.shape[1] < n:
            self._flags = np.zeros((2, max(n, 2 * self._flags.shape[1])), np.bool_)
            self._last_key, self._views_rows = (), -1  # views over the old buffer are stale
        flags = self._flags[:, :n]
        _classify(num_scheduled, num_computed, prompt_lens, decode_query_len, flags, self._stats)
        uniform, longest, num_decodes, decode_tokens = self._stats.tolist()
        key = (n, decode_query_len, uniform, longest, num_decodes, decode_tokens)
        if key != self._last_key or self._last is None:
            if n != self._views_rows or self._views is None:
                self._views, self._views_rows = (torch.from_numpy(flags[0]), torch.from_numpy(flags[1])), n
            self._last = RowClasses(
                is_prefilling=self._views[0],
                is_decode=self._views[1],
                decode_query_len=decode_query_len,
                uniform_decode=bool(uniform),
                max_query_len=longest,
                num_decodes=num_decodes,
                num_decode_tokens=decode_tokens,
            )
            self._last_key = key
        return self._last


@njit(cache=True, nogil=True)
def _classify(  # pragma: no cover - compiled; tested against spec's classify
    num_scheduled: np.ndarray,  # [n] int64
    num_computed: np.ndarray,  # [n] int64
    prompt_lens: np.ndarray,  # [n] int64
    decode_query_len: int,
    flags: np.ndarray,  # [2, n] bool out: is_prefilling | is_decode
    stats: np.ndarray,  # [4] int64 out: uniform, max_query_len, num_decodes, num_decode_tokens
) -> None:
    n = num_scheduled.shape[0]
    uniform = n > 0
    longest, num_decodes, decode_tokens, leading = 0, 0, 0, True
    for b in range(n):
        q = num_scheduled[b]
        prefilling = num_computed[b] < prompt_lens[b]
        decode = (not prefilling) and q <= decode_query_len  # spec.classify.decode_rows
        flags[0, b] = prefilling
        flags[1, b] = decode
        uniform = uniform and decode and q == decode_query_len
        longest = max(longest, q)
        leading = leading and decode
        if leading:
            num_decodes += 1
            decode_tokens += q
    stats[0], stats[1], stats[2], stats[3] = uniform, longest, num_decodes, decode_tokens
