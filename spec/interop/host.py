"""Host-known counts of a step, read from the scheduler output instead of from device arrays.

A layout whose size or scalar fields depend on the data (FlashInfer's page count, vLLM's
max_query_len / max_seq_len) would otherwise copy device values back to the host. The scheduler
output already holds them: a request's seq_len is its num_computed_tokens (new or cached) plus its
num_scheduled_tokens. fast's interop functions take these instead of syncing; spec's check them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from spec.errors import InconsistentSchedulerOutputError
from spec.types import SchedulerOutput


@dataclass(frozen=True)
class HostCounts:
    num_scheduled_np: np.ndarray  # [num_reqs] int64, in batch order
    seq_lens_np: np.ndarray  # [num_reqs] int64, num_computed_tokens + num_scheduled_tokens


def host_counts(sched: SchedulerOutput, req_ids: Sequence[str]) -> HostCounts:
    """The counts of `req_ids` (a batch's batch_idx -> req_id) from the applied scheduler output."""
    computed = {r.req_id: r.num_computed_tokens for r in sched.new_requests}
    computed.update({r.req_id: r.num_computed_tokens for r in sched.cached_requests})
    num_scheduled = np.zeros(len(req_ids), np.int64)
    seq_lens = np.zeros(len(req_ids), np.int64)
    for b, req_id in enumerate(req_ids):
        if req_id not in computed or req_id not in sched.num_scheduled_tokens:
            raise InconsistentSchedulerOutputError(req_id, "req_ids", "not a scheduled request of this output")
        num_scheduled[b] = sched.num_scheduled_tokens[req_id]
        seq_lens[b] = computed[req_id] + num_scheduled[b]
    return HostCounts(num_scheduled, seq_lens)


def check_host_counts(host: HostCounts | None, num_scheduled: np.ndarray, seq_lens: np.ndarray) -> None:
    """spec's side of the contract: host counts handed in must be the batch's own."""
    if host is None:
        return
    if not np.array_equal(host.num_scheduled_np, num_scheduled) or not np.array_equal(host.seq_lens_np, seq_lens):
        raise ValueError("host: HostCounts do not match the batch's num_scheduled_tokens / seq_lens")
