"""A scheduler output's continuing requests in columns, the form the benchmarks replay them in."""

from __future__ import annotations

import dataclasses

from spec.types import CachedRequestColumns, SchedulerOutput


def in_columns(out: SchedulerOutput) -> SchedulerOutput:
    """`out` with its continuing requests as spec.types.CachedRequestColumns (vLLM's columnar CachedRequestData), as
    an engine's scheduler sends them, where the reference scheduler and from_vllm give one object per request."""
    cached = list(out.cached_requests)
    columns = CachedRequestColumns(
        req_ids=[c.req_id for c in cached],
        num_computed_tokens=[c.num_computed_tokens for c in cached],
        new_block_ids=[c.new_block_ids for c in cached],
        resumed_req_ids=frozenset(c.req_id for c in cached if c.resumed),
    )
    return dataclasses.replace(out, cached_requests=columns)
