"""Faults of encoder-decoder requests (spec/cross_attention.py), for conformance/mutations.py's breakers.

Each takes a valid output and returns one that fails exactly the named check, or None where the output
offers no way to: an encoder_len that is not an integer >= 0 (check 1), one outside [1, max_encoder_len]
or on a model without a cross group (check 7), a cross table shorter than cdiv(L, block_size) or new cross
blocks on a step that does not start at 0 (check 11). The reference scheduler gives every request exactly
cdiv(L, block_size) cross blocks, so a cached request's L is read from its table's length.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import replace

from conformance.malformed import edit
from spec.cross_attention import cross_group
from spec.types import RowSnapshot, SchedulerOutput, WorkerConfig


def _with_new(out: SchedulerOutput, req_id: str, **changes: object) -> SchedulerOutput:
    news = tuple(replace(r, **changes) if r.req_id == req_id else r for r in out.new_requests)  # type: ignore[arg-type]
    return replace(out, new_requests=news)


def malformed_encoder_len(out: SchedulerOutput, config: WorkerConfig, rng: random.Random) -> SchedulerOutput | None:
    """Check 1: a new request's encoder_len that is not an integer >= 0."""
    if not out.new_requests:
        return None
    new = rng.choice(out.new_requests)
    bad = rng.choice((-1, 1.5, "3", True, None))
    news = tuple(edit(r, encoder_len=bad) if r is new else r for r in out.new_requests)
    return replace(out, new_requests=news)


def encoder_length_fault(out: SchedulerOutput, config: WorkerConfig, rng: random.Random) -> SchedulerOutput | None:
    """Check 7: encoder_len past max_encoder_len or 0 with a cross group; > 0 without one."""
    if not out.new_requests:
        return None
    new = rng.choice(out.new_requests)
    if cross_group(config) is None:
        return _with_new(out, new.req_id, encoder_len=rng.randint(1, 8))
    return _with_new(out, new.req_id, encoder_len=rng.choice((0, config.max_encoder_len + 1)))


def cross_block_fault(
    out: SchedulerOutput, config: WorkerConfig, rows: Mapping[str, RowSnapshot], rng: random.Random
) -> SchedulerOutput | None:
    """Check 11: a cross table one block short of its encoder, or new cross blocks where the step starts past 0."""
    g = cross_group(config)
    if g is None:
        return None
    faults = []
    for new in out.new_requests:
        if new.block_ids[g]:
            short = tuple(t[:-1] if i == g else t for i, t in enumerate(new.block_ids))
            faults.append(lambda new=new, short=short: _with_new(out, new.req_id, block_ids=short))
        n = out.num_scheduled_tokens[new.req_id]
        drafts = out.scheduled_spec_decode_tokens.get(new.req_id)
        if len(new.prompt_token_ids) > n and not drafts:  # a start past 0 reading only known tokens (check 8)
            start = rng.randint(1, len(new.prompt_token_ids) - n)
            faults.append(lambda new=new, start=start: _with_new(out, new.req_id, num_computed_tokens=start))
    for cached in out.cached_requests:
        if cached.resumed or cached.num_computed_tokens == 0:
            continue
        if config.async_scheduling and cached.req_id not in out.scheduled_spec_decode_tokens:
            continue  # may have unverified drafts behind it: resumed, check 8 refuses it first (async rule 7)
        held = [list(t) for t in rows[cached.req_id].block_ids]
        for i, ids in enumerate(cached.new_block_ids or ()):
            held[i] += list(ids)
        taken = {b for row in rows.values() for b in row.block_ids[g]}
        if config.one_block_pool:  # ids any group lists, or is handed this step, are not the cross group's to take
            given = [*(n.block_ids for n in out.new_requests), *(c.new_block_ids or () for c in out.cached_requests)]
            taken |= {b for row in rows.values() for t in row.block_ids for b in t}
            taken |= {b for tables in given for t in tables for b in t}
        fresh = [b for b in range(1, min(config.kv_groups[g].num_blocks, 4096)) if b not in taken]
        if len(fresh) >= len(held[g]) > 0:
            held[g] = rng.sample(fresh, len(held[g]))  # other blocks: its encoder's KV is not in them
            tables = tuple(tuple(t) for t in held)
            changed = replace(cached, new_block_ids=tables, resumed=True)
            faults.append(
                lambda c=cached, changed=changed: replace(
                    out, cached_requests=tuple(changed if x is c else x for x in out.cached_requests)
                )
            )
    return rng.choice(faults)() if faults else None
