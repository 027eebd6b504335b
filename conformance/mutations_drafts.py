"""Draft faults for the invalid-output generator: a valid output broken in a way the draft rules name.

Speculative decoding's rules (spec/drafts.py, and checks 1, 6 and 8 of spec/validate.py) can be broken
by an output's drafts: drafts for a request that is not scheduled, fewer than 1 + k scheduled tokens, a
draft id outside the vocabulary or not an integer, a step that ends before or after its drafts, drafts
on a mid-prefill chunk, drafts that run past max_model_len or past the request's blocks. Each mutation
keeps every check that runs before its class passing, so the class is known by construction.

conformance.mutations.break_output composes them with its own through `draft_fault_or`: where a draft
fault of the class asked for exists it is used part of the time (always for UnknownTokenError on an output with
drafts, where moving num_computed by one, the generic fault, may land exactly on a draft and stay valid).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from conformance.after_step import GeneratorRequest, scheduled_requests
from conformance.malformed import edit
from spec.errors import (
    InconsistentSchedulerOutputError,
    MissingBlockError,
    ModelLengthError,
    ScheduleError,
    TokenIdError,
    UnknownTokenError,
)
from spec.types import PoolSnapshot, SchedulerOutput, WorkerConfig

BreakOutput = Callable[
    [type[ScheduleError], SchedulerOutput, WorkerConfig, PoolSnapshot, random.Random],
    "tuple[SchedulerOutput, type[ScheduleError]] | None",
]


class _Ctx:
    def __init__(self, out: SchedulerOutput, config: WorkerConfig, snapshot: PoolSnapshot, rng: random.Random):
        self.out, self.config, self.rng = out, config, rng
        self.reqs = scheduled_requests(out, config, snapshot)
        self.spare_budget = config.max_num_batched_tokens - out.total_num_scheduled_tokens

    def pick(self, condition: Callable[[GeneratorRequest], bool]) -> GeneratorRequest | None:
        fitting = [r for r in self.reqs if condition(r)]
        return self.rng.choice(fitting) if fitting else None

    def token(self) -> int:
        return self.rng.randrange(self.config.vocab_size)


def _with_drafts(out: SchedulerOutput, req_id: str, drafts: Any, num_scheduled: int | None = None) -> SchedulerOutput:
    counts = dict(out.num_scheduled_tokens)
    if num_scheduled is not None:
        counts[req_id] = num_scheduled
    return replace(out, num_scheduled_tokens=counts, scheduled_spec_decode_tokens={
        **out.scheduled_spec_decode_tokens, req_id: drafts})  # fmt: skip


# ---- one breaker per class, in validation order ---------------------------------------------------
def _inconsistent(ctx: _Ctx) -> SchedulerOutput | None:
    out = ctx.out
    options: list[Callable[[], SchedulerOutput]] = [
        lambda: _with_drafts(out, _unscheduled_id(ctx), (ctx.token(),)),  # drafts of a request not scheduled
        lambda: edit(out, scheduled_spec_decode_tokens=[(r, (1,)) for r in out.num_scheduled_tokens]),  # pairs
    ]
    r = ctx.pick(lambda r: True)
    if r is not None:  # k drafts on num_scheduled <= k tokens: no room for the verifying token
        options.append(lambda: _with_drafts(out, r.req_id, tuple(ctx.token() for _ in range(r.num_scheduled))))
        not_str: dict[Any, Any] = dict(out.scheduled_spec_decode_tokens)
        not_str[r.req_id.encode()] = (ctx.token(),)  # a key that is bytes
        options.append(lambda: edit(out, scheduled_spec_decode_tokens=not_str))
    return ctx.rng.choice(options)()


def _unscheduled_id(ctx: _Ctx) -> str:
    i = 0
    while f"ghost-{i}" in ctx.out.num_scheduled_tokens:
        i += 1
    return f"ghost-{i}"


def _token_id(ctx: _Ctx) -> SchedulerOutput | None:
    """A draft outside the vocabulary, or drafts that are not integer ids (k <= num_scheduled - 1: check 1 passes)."""
    r = ctx.pick(lambda r: bool(r.drafts) or (r.num_scheduled > 1 and r.may_draft))
    if r is None:
        return None
    drafts: list[Any] = list(r.drafts) or [ctx.token() for _ in range(ctx.rng.randint(1, r.num_scheduled - 1))]
    i = ctx.rng.randrange(len(drafts))
    # under async scheduling -1 is PLACEHOLDER_TOKEN_ID, a draft proposed on the device (rule 8), not a bad id
    negative = () if ctx.config.async_scheduling else (-1,)
    bad = ctx.rng.choice((ctx.config.vocab_size, *negative, 2**40, float(drafts[i]), drafts[i] + 0.5, str(drafts[i])))
    drafts[i] = bad
    return _with_drafts(ctx.out, r.req_id, ctx.rng.choice((tuple(drafts), list(drafts))))


def _model_length(ctx: _Ctx) -> SchedulerOutput | None:
    """Drafts (and the tokens to run them) past max_model_len on a request whose step reaches its end."""
    limit = ctx.config.max_model_len
    r = ctx.pick(lambda r: r.reaches_end and r.may_draft and limit + 1 - r.end <= ctx.spare_budget)
    if r is None:
        return None
    k = limit + 1 - r.known_tokens  # the last draft at position max_model_len
    return _with_drafts(ctx.out, r.req_id, tuple(ctx.token() for _ in range(k)), r.num_scheduled + limit + 1 - r.end)


def _unknown_token(ctx: _Ctx) -> SchedulerOutput | None:
    out, limit = ctx.out, ctx.config.max_model_len
    options: list[Callable[[], SchedulerOutput]] = []
    drafting = ctx.pick(lambda r: bool(r.drafts))
    if drafting is not None:  # one draft fewer: the last scheduled position has no input id
        options.append(lambda: _with_drafts(out, drafting.req_id, drafting.drafts[:-1]))
        if drafting.end < limit and ctx.spare_budget > 0:  # one token past the drafts
            options.append(lambda: _with_drafts(out, drafting.req_id, drafting.drafts, drafting.num_scheduled + 1))
    short = ctx.pick(lambda r: not r.drafts and r.may_draft and r.num_scheduled > 1 and r.end <= r.known_tokens)
    if short is not None:  # drafts on a chunk that ends before them: mid-prefill, or ending at the last known token
        k = ctx.rng.randint(1, short.num_scheduled - 1)
        options.append(lambda: _with_drafts(out, short.req_id, tuple(ctx.token() for _ in range(k))))
    ahead = ctx.pick(lambda r: r.counted_ahead and not r.resumed and r.end < limit and ctx.spare_budget > 0)
    if ahead is not None:  # async (spec/async_steps.py): a draft right after drafts whose verdict is unread
        options.append(lambda: _with_drafts(out, ahead.req_id, (ctx.token(),), ahead.num_scheduled + 1))
    return ctx.rng.choice(options)() if options else None


def _missing_block(ctx: _Ctx) -> SchedulerOutput | None:
    """More drafts than the request's blocks hold (the blocks a scheduler forgot to allocate for its drafts)."""
    limit = ctx.config.max_model_len
    if any(g.kind == "mamba" for g in ctx.config.kv_groups):  # more drafts than speculative blocks: check 10 first
        return None
    for r in ctx.rng.sample(ctx.reqs, len(ctx.reqs)):
        if not r.reaches_end or not r.may_draft:
            continue
        groups = zip(r.table_lists(), ctx.config.kv_groups, strict=True)  # the decoder's: drafts write no cross block
        covered = min(len(t) * g.block_size for t, g in groups if g.kind != "cross_attention")
        extra = covered + 1 - r.end  # the last draft at the first position without a block
        if 0 < extra <= ctx.spare_budget and covered + 1 <= limit:
            drafts = (*r.drafts, *(ctx.token() for _ in range(extra)))
            return _with_drafts(ctx.out, r.req_id, drafts, r.num_scheduled + extra)
    return None


DRAFT_BREAKERS: dict[type[ScheduleError], Callable[[_Ctx], SchedulerOutput | None]] = {
    InconsistentSchedulerOutputError: _inconsistent,
    TokenIdError: _token_id,
    ModelLengthError: _model_length,
    UnknownTokenError: _unknown_token,
    MissingBlockError: _missing_block,
}


def break_drafts(
    cls: type[ScheduleError], out: SchedulerOutput, config: WorkerConfig, snapshot: PoolSnapshot, rng: random.Random
) -> tuple[SchedulerOutput, type[ScheduleError]] | None:
    """A draft fault of class `cls` in `out`, or None where the output offers none (or cls has no draft fault)."""
    make = DRAFT_BREAKERS.get(cls)
    broken = None if make is None else make(_Ctx(out, config, snapshot, rng))
    return None if broken is None else (broken, cls)


def draft_fault_or(
    plain: BreakOutput,
    cls: type[ScheduleError],
    out: SchedulerOutput,
    config: WorkerConfig,
    snapshot: PoolSnapshot,
    rng: random.Random,
) -> tuple[SchedulerOutput, type[ScheduleError]] | None:
    """A draft fault of class `cls` part of the time (see the module docstring), else `plain`'s fault."""
    has_drafts = any(len(d) for d in out.scheduled_spec_decode_tokens.values())
    if (cls is UnknownTokenError and has_drafts) or rng.random() < 0.4:
        drafted = break_drafts(cls, out, config, snapshot, rng)
        if drafted is not None or (cls is UnknownTokenError and has_drafts):
            return drafted
    return plain(cls, out, config, snapshot, rng)
