"""Break a valid scheduler output in each way an error class names, so that exactly that check fails.

`break_output(cls, out, config, snapshot, rng)` returns (invalid output, cls), or None where this
output and pool state offer no way to produce `cls` (e.g. NullBlockError without a sliding window).
Each mutation leaves every check that validation runs before `cls` passing (spec/validate.py's order),
so the expected class is derived from the mutation, not from running a backend.
`snapshot` is the pool before the output (spec's `snapshot()`), `out` is valid for it.

Besides the faults of values (an id out of range, a count too large), each class's breaker also makes
the faults of types its check owns: check 1 refuses malformed fields, wrong containers and ids listed
twice (conformance.malformed), check 6 float or non-sequence prompt ids, check 9 float block ids and a
block listed twice in one table. `MALFORMATIONS` names every type- and container-level fault with the
class it provokes, so each can be driven on its own (`malformation_breaker`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from conformance.after_step import GeneratorRequest, scheduled_requests
from conformance.malformed import CHECK_ONE, edit
from conformance.malformed_mrope import MROPE_MALFORMATIONS
from conformance.mutations_drafts import draft_fault_or
from conformance.mutations_encoder import cross_block_fault, encoder_length_fault, malformed_encoder_len
from conformance.mutations_mamba import mamba_fault_or, resumable
from spec.cross_attention import cross_group
from spec.errors import (
    ALL_ERRORS,
    BlockIdError,
    BlockTableOverflowError,
    DuplicateRequestError,
    DuplicateSlotError,
    InconsistentSchedulerOutputError,
    MissingBlockError,
    ModelLengthError,
    NullBlockError,
    PoolFullError,
    ScheduleError,
    TokenBudgetError,
    TokenIdError,
    UnknownRequestError,
    UnknownTokenError,
)
from spec.types import (
    NULL_BLOCK_ID,
    CachedRequest,
    NewRequest,
    PoolSnapshot,
    SchedulerOutput,
    WorkerConfig,
)

Tables = list[list[int]]


class _Ctx:
    def __init__(self, out: SchedulerOutput, config: WorkerConfig, snapshot: PoolSnapshot, rng: random.Random):
        self.out, self.config, self.rng = out, config, rng
        self.rows = {row.req_id: row for row in snapshot}
        self.num_groups = len(config.kv_groups)
        self.reqs = scheduled_requests(out, config, snapshot)
        # the requests whose tables a breaker may resend (a cached one then comes back resumed): under async
        # scheduling not one that may have unverified drafts behind it, whose resumption is refused first
        # (check 8, spec/async_steps.py rule 7); `may_draft` says its verdict was read
        self.table_reqs = [r for r in self.reqs if r.is_new or r.resumed or r.may_draft]

    def free_rows_after(self) -> int:
        held = len(self.rows) - len(self.out.finished_req_ids) + len(self.out.new_requests)
        return self.config.max_num_reqs - held

    def fresh_id(self, prefix: str) -> str:
        taken = set(self.rows) | set(self.out.num_scheduled_tokens) | set(self.out.finished_req_ids)
        i = 0
        while f"{prefix}-{i}" in taken:
            i += 1
        return f"{prefix}-{i}"

    def pick(self, reqs: list[GeneratorRequest]) -> GeneratorRequest | None:
        return self.rng.choice(reqs) if reqs else None

    def unused_blocks(self, g: int, count: int, avoid: set[int]) -> list[int] | None:
        """`count` distinct real block ids of group g outside `avoid`, or None if there are not enough.

        With one block pool, ids another group's scheduled tables list are avoided too (check 9 would refuse
        them before the check a breaker aims at)."""
        num_blocks = self.config.kv_groups[g].num_blocks
        if self.config.one_block_pool:
            avoid = avoid | {b for r in self.reqs for h, t in enumerate(r.table_lists()) if h != g for b in t}
        if num_blocks - 1 - len(avoid - {NULL_BLOCK_ID}) < count:
            return None
        chosen: list[int] = []
        candidates = range(1, num_blocks) if num_blocks < 4096 else None
        while len(chosen) < count:
            b = self.rng.choice(candidates) if candidates is not None else self.rng.randrange(1, num_blocks)
            if b not in avoid and b not in chosen:
                chosen.append(b)
        return chosen

    def written_blocks(self, g: int) -> set[int]:
        """Blocks of group g that some scheduled token of `out` writes."""
        bs = self.config.kv_groups[g].block_size
        if g == cross_group(self.config):  # the encoder's blocks: every one a scheduled request holds
            return {b for r in self.reqs for b in r.table(g)}
        return {int(b) for r in self.reqs for b in r.tables[g][r.num_computed // bs : r.last // bs + 1]}


def _with_tables(out: SchedulerOutput, req_id: str, tables: Tables) -> SchedulerOutput:
    """`out` with req_id's whole table replaced: block_ids of a new request, a resumed table for a cached one."""
    blocks = tuple(tuple(t) for t in tables)
    news = tuple(replace(r, block_ids=blocks) if r.req_id == req_id else r for r in out.new_requests)
    cached = tuple(
        replace(r, new_block_ids=blocks, resumed=True) if r.req_id == req_id else r for r in out.cached_requests
    )
    return replace(out, new_requests=news, cached_requests=cached)


def _with_computed(out: SchedulerOutput, req_id: str, num_computed: int) -> SchedulerOutput:
    news = tuple(replace(r, num_computed_tokens=num_computed) if r.req_id == req_id else r for r in out.new_requests)
    cached = tuple(
        replace(r, num_computed_tokens=num_computed) if r.req_id == req_id else r for r in out.cached_requests
    )
    return replace(out, new_requests=news, cached_requests=cached)


def _add_new(out: SchedulerOutput, request: NewRequest, n: int) -> SchedulerOutput:
    return replace(
        out,
        new_requests=(*out.new_requests, request),
        num_scheduled_tokens={**out.num_scheduled_tokens, request.req_id: n},
    )


def _empty_tables(ctx: _Ctx) -> tuple[tuple[int, ...], ...]:
    return tuple(() for _ in range(ctx.num_groups))


# ---- one breaker per class, in validation order ---------------------------------------------------
def _inconsistent(ctx: _Ctx) -> SchedulerOutput | None:
    out = ctx.out
    options: list[Callable[[], SchedulerOutput]] = [
        lambda: replace(out, num_scheduled_tokens={**out.num_scheduled_tokens, ctx.fresh_id("ghost"): 1}),
    ]
    if ctx.reqs:
        r = ctx.pick(ctx.reqs)
        assert r is not None
        options += [
            lambda: replace(out, num_scheduled_tokens={**out.num_scheduled_tokens, r.req_id: 0}),  # zero-length row
            lambda: replace(
                out, num_scheduled_tokens={k: v for k, v in out.num_scheduled_tokens.items() if k != r.req_id}
            ),
            lambda: replace(out, finished_req_ids=out.finished_req_ids | {r.req_id}),
            lambda: _with_computed(out, r.req_id, -1),
        ]
    if out.new_requests:
        new = ctx.rng.choice(out.new_requests)
        options.append(lambda: _replace_new(out, new.req_id, block_ids=(*new.block_ids, ())))
    if out.cached_requests:
        options.append(lambda: replace(out, cached_requests=(*out.cached_requests, out.cached_requests[0])))
    if ctx.rng.random() < 0.5:  # a malformed field, container or repeated id instead of a contradiction
        for name in ctx.rng.sample(sorted(CHECK_ONE), len(CHECK_ONE)):
            broken = CHECK_ONE[name](out, list(ctx.rows), ctx.rng)
            if broken is not None:
                return broken
    return ctx.rng.choice(options)()


def _replace_new(out: SchedulerOutput, req_id: str, **changes: object) -> SchedulerOutput:
    news = tuple(replace(r, **changes) if r.req_id == req_id else r for r in out.new_requests)  # type: ignore[arg-type]
    return replace(out, new_requests=news)


def _unknown_request(ctx: _Ctx) -> SchedulerOutput | None:
    out, ghost = ctx.out, ctx.fresh_id("ghost")
    if ctx.rng.random() < 0.5:
        return replace(out, finished_req_ids=out.finished_req_ids | {ghost})
    return replace(
        out,
        cached_requests=(*out.cached_requests, CachedRequest(ghost, 0)),
        num_scheduled_tokens={**out.num_scheduled_tokens, ghost: 1},
    )


def _duplicate_request(ctx: _Ctx) -> SchedulerOutput | None:
    out = ctx.out
    listed = set(out.num_scheduled_tokens) | set(out.finished_req_ids)
    idle = [r for r in ctx.rows if r not in listed]
    if idle:
        return _add_new(out, NewRequest(ctx.rng.choice(idle), (0,), _empty_tables(ctx)), 1)
    if out.cached_requests:  # the cached request reappears as a new one (and is no longer listed as cached)
        victim = ctx.rng.choice(out.cached_requests)
        rest = tuple(c for c in out.cached_requests if c is not victim)
        return replace(
            out,
            cached_requests=rest,
            new_requests=(*out.new_requests, NewRequest(victim.req_id, (0,), _empty_tables(ctx))),
        )
    return None


def _pool_full(ctx: _Ctx) -> SchedulerOutput | None:
    out = ctx.out
    for _ in range(ctx.free_rows_after() + 1):
        out = _add_new(
            out, NewRequest(ctx.fresh_id("extra") + f"-{len(out.new_requests)}", (0,), _empty_tables(ctx)), 1
        )
    return out


def _token_budget(ctx: _Ctx) -> SchedulerOutput | None:
    out, budget = ctx.out, ctx.config.max_num_batched_tokens
    extra = budget - out.total_num_scheduled_tokens + 1
    if ctx.reqs:
        r = ctx.rng.choice(ctx.reqs)
        return replace(out, num_scheduled_tokens={**out.num_scheduled_tokens, r.req_id: r.num_scheduled + extra})
    if ctx.free_rows_after() > 0:
        return _add_new(out, NewRequest(ctx.fresh_id("big"), (0,), _empty_tables(ctx)), extra)
    return None


def _token_id(ctx: _Ctx) -> SchedulerOutput | None:
    out, vocab = ctx.out, ctx.config.vocab_size
    if out.new_requests and ctx.rng.random() < 0.4:
        return _malformed_prompt(ctx)
    bad = ctx.rng.choice((vocab, vocab + 7, -1, 2**63, 2**64))
    if out.new_requests:
        new = ctx.rng.choice(out.new_requests)
        prompt = list(new.prompt_token_ids)
        prompt[ctx.rng.randrange(len(prompt))] = bad
        return _replace_new(out, new.req_id, prompt_token_ids=tuple(prompt))
    if ctx.free_rows_after() > 0 and out.total_num_scheduled_tokens < ctx.config.max_num_batched_tokens:
        return _add_new(out, NewRequest(ctx.fresh_id("bad"), (bad,), _empty_tables(ctx)), 1)
    return None


def _malformed_prompt(ctx: _Ctx) -> SchedulerOutput | None:
    """A prompt that is not integer ids: a float among them (whole or not), all floats, or not a list at all."""
    if not ctx.out.new_requests:
        return None
    new = ctx.rng.choice(ctx.out.new_requests)
    prompt: list[Any] = list(new.prompt_token_ids)
    i = ctx.rng.randrange(len(prompt))
    disguises: list[Callable[[], object]] = [
        lambda: (*prompt[:i], float(prompt[i]), *prompt[i + 1 :]),  # 3.0: floats are never ids
        lambda: (*prompt[:i], prompt[i] + 0.5, *prompt[i + 1 :]),
        lambda: np.asarray(prompt, np.float64),
        lambda: np.asarray([prompt]),  # 2-D
        lambda: (*prompt[:i], str(prompt[i]), *prompt[i + 1 :]),
        lambda: (*prompt[:i], None, *prompt[i + 1 :]),
        lambda: (t for t in prompt),  # a generator: read once, so never ids
        lambda: "".join(map(chr, (65 + t % 26 for t in prompt))),  # a str of the same length
    ]
    news = tuple(edit(r, prompt_token_ids=ctx.rng.choice(disguises)()) if r is new else r for r in ctx.out.new_requests)
    return replace(ctx.out, new_requests=news)


def _model_length(ctx: _Ctx) -> SchedulerOutput | None:
    out, limit = ctx.out, ctx.config.max_model_len
    if out.new_requests and ctx.rng.random() < 0.3:  # the encoder's length (spec/cross_attention.py)
        return encoder_length_fault(out, ctx.config, ctx.rng)
    if out.new_requests and ctx.rng.random() < 0.5:
        new = ctx.rng.choice(out.new_requests)
        too_long = {"prompt_token_ids": (0,) * (limit + 1), "mrope_positions": None, "mrope_position_delta": 0}
        return _replace_new(out, new.req_id, **too_long)  # a text request: a table would no longer fit its prompt
    r = ctx.pick(ctx.reqs)
    if r is None:
        return None
    return _with_computed(out, r.req_id, limit - r.num_scheduled + 1)  # seq_len = max_model_len + 1


def _unknown_token(ctx: _Ctx) -> SchedulerOutput | None:
    r = ctx.pick([r for r in ctx.reqs if r.known_tokens < ctx.config.max_model_len])
    if r is None:
        return None
    return _with_computed(ctx.out, r.req_id, r.known_tokens - r.num_scheduled + 1)  # reads position `known`


def _block_id(ctx: _Ctx) -> SchedulerOutput | None:
    r = ctx.pick(ctx.table_reqs)
    if r is None:
        return None
    g = ctx.rng.randrange(ctx.num_groups)
    group, table = ctx.config.kv_groups[g], list(r.table(g))
    first = min(r.live_from(group), len(table))
    real = [b for b in table[first:] if b != NULL_BLOCK_ID]  # a repeat must be among the live entries
    if ctx.rng.random() < 0.3:
        broken = _malformed_block_id(ctx) or _repeated_block_appended(ctx)
        if broken is not None:
            return broken
    if ctx.config.one_block_pool and ctx.rng.random() < 0.3:
        broken = _held_in_another_group(ctx)
        if broken is not None:
            return broken
    options: list[Any] = [group.num_blocks, group.num_blocks + 3, -1, 2**63]  # out of range
    if real:
        options.append(ctx.rng.choice(real))  # repeated in one table
    if group.sliding_window is None and group.kind != "mamba":  # a mamba table may hold nulls (spec/mamba.py)
        options.append(NULL_BLOCK_ID)  # the null block where no window allows it
    table.insert(ctx.rng.randint(first, len(table)), ctx.rng.choice(options))
    return _with_tables(ctx.out, r.req_id, [table if i == g else t for i, t in enumerate(r.table_lists())])


def _held_in_another_group(ctx: _Ctx) -> SchedulerOutput | None:
    """With one block pool: a request's table given an id some scheduled request holds in another group."""
    groups = ctx.config.kv_groups
    held = [
        (h, b)
        for r in ctx.reqs
        for h in range(ctx.num_groups)
        for b in r.table(h)[r.live_from(groups[h]) :]
        if b != NULL_BLOCK_ID
    ]
    r = ctx.pick(ctx.table_reqs)
    if not held or r is None:
        return None
    h, block = ctx.rng.choice(held)
    g = ctx.rng.choice([x for x in range(ctx.num_groups) if x != h])
    table = list(r.table(g))
    table.insert(ctx.rng.randint(min(r.live_from(groups[g]), len(table)), len(table)), block)
    return _with_tables(ctx.out, r.req_id, [table if i == g else t for i, t in enumerate(r.table_lists())])


def _malformed_block_id(ctx: _Ctx) -> SchedulerOutput | None:
    """One entry of a table as a float (whole or not), or a table that is not a list of integers."""
    holding = [(r, g) for r in ctx.table_reqs for g in range(ctx.num_groups) if r.table(g)]
    if not holding:
        return None
    r, g = ctx.rng.choice(holding)
    table: list[Any] = list(r.table(g))
    i = ctx.rng.randrange(len(table))
    disguise = ctx.rng.choice(
        (
            lambda: [*table[:i], float(table[i]), *table[i + 1 :]],
            lambda: [*table[:i], table[i] + 0.7, *table[i + 1 :]],
            lambda: np.asarray(table, np.float32),
            lambda: np.asarray([table]),  # 2-D
            lambda: (b for b in table),
            lambda: {b: None for b in table},
        )
    )()
    tables = tuple(disguise if h == g else tuple(t) for h, t in enumerate(r.table_lists()))
    news = tuple(edit(x, block_ids=tables) if x.req_id == r.req_id else x for x in ctx.out.new_requests)
    cached = tuple(
        edit(x, new_block_ids=tables, resumed=True) if x.req_id == r.req_id else x for x in ctx.out.cached_requests
    )
    return replace(ctx.out, new_requests=news, cached_requests=cached)


def _repeated_block_appended(ctx: _Ctx) -> SchedulerOutput | None:
    """A continuing request is given again, as a new block, one of its table's live entries already holds."""
    groups = ctx.config.kv_groups
    options = [
        (c, g, b)
        for c in ctx.out.cached_requests
        if not c.resumed
        for g in range(ctx.num_groups)
        for b in ctx.rows[c.req_id].block_ids[g][groups[g].first_live_entry(c.num_computed_tokens) :]
        if b != NULL_BLOCK_ID
    ]
    if not options:
        return None
    cached, g, block = ctx.rng.choice(options)
    added = [list(ids) for ids in (cached.new_block_ids or _empty_tables(ctx))]
    added[g].insert(ctx.rng.randint(0, len(added[g])), block)
    changed = replace(cached, new_block_ids=tuple(tuple(ids) for ids in added))
    return replace(ctx.out, cached_requests=tuple(changed if c is cached else c for c in ctx.out.cached_requests))


def _table_overflow(ctx: _Ctx) -> SchedulerOutput | None:
    r = ctx.pick(ctx.table_reqs)
    if r is None:
        return None
    for g in ctx.rng.sample(range(ctx.num_groups), ctx.num_groups):
        table, group = r.table(g), ctx.config.kv_groups[g]
        missing = ctx.config.max_blocks_per_req(g) + 1 - len(table)
        if group.sliding_window is not None and ctx.rng.random() < 0.5:
            extra = [NULL_BLOCK_ID] * missing  # nulls may repeat in a window group
        else:
            found = ctx.unused_blocks(g, missing, set(table))
            if found is None:
                continue
            extra = found
        return _with_tables(ctx.out, r.req_id, [t + extra if i == g else t for i, t in enumerate(r.table_lists())])
    return None


def _missing_block(ctx: _Ctx) -> SchedulerOutput | None:
    cross = cross_group(ctx.config)
    if cross is not None and ctx.rng.random() < 0.5:  # the encoder's blocks (spec/cross_attention.py)
        return cross_block_fault(ctx.out, ctx.config, ctx.rows, ctx.rng)
    r = ctx.pick(ctx.table_reqs)
    if r is None:
        return None
    g = ctx.rng.choice([g for g in range(ctx.num_groups) if g != cross])
    keep = r.last // ctx.config.kv_groups[g].block_size  # the last written position's block goes
    return _with_tables(ctx.out, r.req_id, [t[:keep] if i == g else t for i, t in enumerate(r.table_lists())])


def _null_block(ctx: _Ctx) -> SchedulerOutput | None:
    windows = [g for g, group in enumerate(ctx.config.kv_groups) if group.sliding_window is not None]
    r = ctx.pick([r for r in ctx.table_reqs if resumable(ctx.config, r.num_computed, r.is_new)])  # keeps mamba reads
    if r is None or not windows:
        return None
    g = ctx.rng.choice(windows)
    bs = ctx.config.kv_groups[g].block_size
    position = ctx.rng.randint(r.num_computed, r.last)  # a written position: always read or written
    table = list(r.table(g))
    table[position // bs] = NULL_BLOCK_ID
    return _with_tables(ctx.out, r.req_id, [table if i == g else t for i, t in enumerate(r.table_lists())])


def _duplicate_slot(ctx: _Ctx) -> SchedulerOutput | None:
    """Point a second writer at a slot some scheduled token already writes."""
    cross = cross_group(ctx.config)
    kinds = ctx.config.kv_groups  # decoder tokens write no cross slot; a mamba group's faults are its own
    g = ctx.rng.choice([g for g in range(ctx.num_groups) if g != cross and kinds[g].kind != "mamba"])
    bs = ctx.config.kv_groups[g].block_size
    writers = ctx.rng.sample(ctx.reqs, len(ctx.reqs))
    for a in writers:
        pos_a = ctx.rng.randint(a.num_computed, a.last)
        block_a, offset = a.table(g)[pos_a // bs], pos_a % bs
        for b in writers:
            if b is a or b not in ctx.table_reqs or not resumable(ctx.config, b.num_computed, b.is_new):
                continue
            positions = [p for p in range(b.num_computed, b.last + 1) if p % bs == offset]
            if not positions:
                continue
            index = ctx.rng.choice(positions) // bs
            if block_a in b.table(g):
                continue  # would repeat a block in b's table (BlockIdError)
            table = list(b.table(g))
            table[index] = block_a
            return _with_tables(ctx.out, b.req_id, [table if i == g else t for i, t in enumerate(b.table_lists())])
    # no second writer fits: a new request writes offsets 0..offset of that block
    if not ctx.reqs or ctx.free_rows_after() < 1:
        return None
    a = ctx.rng.choice(ctx.reqs)
    pos_a = ctx.rng.randint(a.num_computed, a.last)
    block_a, offset = a.table(g)[pos_a // bs], pos_a % bs
    if ctx.out.total_num_scheduled_tokens + offset + 1 > ctx.config.max_num_batched_tokens:
        return None
    tables: list[tuple[int, ...]] = []
    for h, group in enumerate(ctx.config.kv_groups):
        if h == g:
            tables.append((block_a,))
            continue
        mine = {b for t in tables for b in t} if ctx.config.one_block_pool else set()  # one id, one group
        found = ctx.unused_blocks(h, math.ceil((offset + 1) / group.block_size), ctx.written_blocks(h) | mine)
        if found is None:
            return None
        tables.append(tuple(found))
    encoder_len = 0 if cross is None else min(len(tables[cross]) * ctx.config.kv_groups[cross].block_size,
                                              ctx.config.max_encoder_len)  # fmt: skip
    dup = NewRequest(ctx.fresh_id("dup"), (0,) * (offset + 1), tuple(tables), encoder_len=encoder_len)
    return _add_new(ctx.out, dup, offset + 1)


BREAKERS: dict[type[ScheduleError], Callable[[_Ctx], SchedulerOutput | None]] = {
    InconsistentSchedulerOutputError: _inconsistent,
    UnknownRequestError: _unknown_request,
    DuplicateRequestError: _duplicate_request,
    PoolFullError: _pool_full,
    TokenBudgetError: _token_budget,
    TokenIdError: _token_id,
    ModelLengthError: _model_length,
    UnknownTokenError: _unknown_token,
    BlockIdError: _block_id,
    BlockTableOverflowError: _table_overflow,
    MissingBlockError: _missing_block,
    NullBlockError: _null_block,
    DuplicateSlotError: _duplicate_slot,
}
assert set(BREAKERS) == set(ALL_ERRORS), "every error class needs a way to provoke it"


def _check_one(name: str) -> Callable[[_Ctx], SchedulerOutput | None]:
    return lambda ctx: CHECK_ONE[name](ctx.out, list(ctx.rows), ctx.rng)


def _mrope_fault(name: str) -> Callable[[_Ctx], SchedulerOutput | None]:
    return lambda ctx: MROPE_MALFORMATIONS[name](ctx.out, ctx.config, ctx.rng)


def _encoder_len_fault(ctx: _Ctx) -> SchedulerOutput | None:
    return malformed_encoder_len(ctx.out, ctx.config, ctx.rng)


def _repeated_block_in_table(ctx: _Ctx) -> SchedulerOutput | None:
    groups = ctx.config.kv_groups
    holding = [
        (r, g)
        for r in ctx.table_reqs
        for g in range(ctx.num_groups)
        if any(b != NULL_BLOCK_ID for b in r.table(g)[r.live_from(groups[g]) :])
    ]
    if not holding:
        return None
    r, g = ctx.rng.choice(holding)
    table, first = list(r.table(g)), r.live_from(groups[g])  # the repeat goes among the live entries
    table.insert(ctx.rng.randint(first, len(table)), ctx.rng.choice([b for b in table[first:] if b != NULL_BLOCK_ID]))
    return _with_tables(ctx.out, r.req_id, [table if i == g else t for i, t in enumerate(r.table_lists())])


# every type- and container-level fault, and every way to list an id twice, with the class it provokes
MALFORMATIONS: dict[str, tuple[type[ScheduleError], Callable[[_Ctx], SchedulerOutput | None]]] = {
    **{name: (InconsistentSchedulerOutputError, _check_one(name)) for name in CHECK_ONE},
    "prompt not integer ids": (TokenIdError, _malformed_prompt),
    "block ids not integers": (BlockIdError, _malformed_block_id),
    "repeated block in a table": (BlockIdError, _repeated_block_in_table),
    "repeated block appended": (BlockIdError, _repeated_block_appended),
    **{name: (InconsistentSchedulerOutputError, _mrope_fault(name)) for name in MROPE_MALFORMATIONS},
    "encoder_len not an integer >= 0": (InconsistentSchedulerOutputError, _encoder_len_fault),
}


def malformation_breaker(
    name: str, rng: random.Random
) -> Callable[[SchedulerOutput, WorkerConfig, PoolSnapshot], tuple[SchedulerOutput, type[ScheduleError]] | None]:
    """The malformation `name` of MALFORMATIONS as a `conformance.differential.Breaker`."""
    cls, make = MALFORMATIONS[name]

    def apply(
        out: SchedulerOutput, config: WorkerConfig, snapshot: PoolSnapshot
    ) -> tuple[SchedulerOutput, type[ScheduleError]] | None:
        broken = make(_Ctx(out, config, snapshot, rng))
        return None if broken is None else (broken, cls)

    return apply


def break_output(
    cls: type[ScheduleError], out: SchedulerOutput, config: WorkerConfig, snapshot: PoolSnapshot, rng: random.Random
) -> tuple[SchedulerOutput, type[ScheduleError]] | None:
    """A fault of class `cls` in `out`: a draft fault (conformance/mutations_drafts.py) part of the time, else
    one of BREAKERS."""
    return draft_fault_or(_plain_or_mamba_fault, cls, out, config, snapshot, rng)


def _plain_or_mamba_fault(
    cls: type[ScheduleError], out: SchedulerOutput, config: WorkerConfig, snapshot: PoolSnapshot, rng: random.Random
) -> tuple[SchedulerOutput, type[ScheduleError]] | None:
    return mamba_fault_or(_plain_fault, cls, out, config, snapshot, rng)  # conformance/mutations_mamba.py


def _plain_fault(
    cls: type[ScheduleError], out: SchedulerOutput, config: WorkerConfig, snapshot: PoolSnapshot, rng: random.Random
) -> tuple[SchedulerOutput, type[ScheduleError]] | None:
    broken = BREAKERS[cls](_Ctx(out, config, snapshot, rng))
    return None if broken is None else (broken, cls)


def breaker(
    cls: type[ScheduleError], rng: random.Random
) -> Callable[[SchedulerOutput, WorkerConfig, PoolSnapshot], tuple[SchedulerOutput, type[ScheduleError]] | None]:
    """`break_output` bound to a class and a random source: a `conformance.differential.Breaker`."""

    def apply(
        out: SchedulerOutput, config: WorkerConfig, snapshot: PoolSnapshot
    ) -> tuple[SchedulerOutput, type[ScheduleError]] | None:
        return break_output(cls, out, config, snapshot, rng)

    return apply
