"""Mamba faults for the invalid-output generator: a valid output of a hybrid model broken where spec/mamba.py refuses.

Each mutation keeps every check before its class passing (spec/validate.py's order), so its class is known by
construction:
- BlockTableOverflowError: a drafting request sent more drafts than its mamba group keeps speculative blocks;
- MissingBlockError: a continuing request whose num_computed_tokens moved back one, so the state after its last
  computed token was never stored; or a drafting request's mamba table one entry short of its last draft's state
  (the table width without the speculative blocks, vllm-ascend PR #11466);
- NullBlockError: the null block as the state a step reads or one it writes (vLLM PR #33937);
- DuplicateSlotError: a second request writing a state block another one writes this step.

A table edit of a continuing request resends its whole table as a resumed one, which makes its state read a
fresh row's (a cached state at a block end), so only requests whose num_computed_tokens is a multiple of every
mamba block size are edited that way (`resumable`), and under async scheduling only requests whose last verdict
was read (a resumption with unverified drafts behind it is refused first: check 8, spec/async_steps.py rule 7).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from conformance.after_step import GeneratorRequest, scheduled_requests
from spec.errors import BlockTableOverflowError, DuplicateSlotError, MissingBlockError, NullBlockError, ScheduleError
from spec.mamba import MAMBA
from spec.types import NULL_BLOCK_ID, PoolSnapshot, SchedulerOutput, WorkerConfig

BreakOutput = Callable[
    [type[ScheduleError], SchedulerOutput, WorkerConfig, PoolSnapshot, random.Random],
    "tuple[SchedulerOutput, type[ScheduleError]] | None",
]


def mamba_groups(config: WorkerConfig) -> list[int]:
    return [g for g, group in enumerate(config.kv_groups) if group.kind == MAMBA]


def resumable(config: WorkerConfig, num_computed: int, is_new: bool) -> bool:
    """Whether resending the request's tables as a resumed one keeps its mamba state read valid."""
    return is_new or all(num_computed % config.kv_groups[g].block_size == 0 for g in mamba_groups(config))


class _Ctx:
    def __init__(self, out: SchedulerOutput, config: WorkerConfig, snapshot: PoolSnapshot, rng: random.Random):
        self.out, self.config, self.rng = out, config, rng
        self.reqs = scheduled_requests(out, config, snapshot)
        self.mamba = mamba_groups(config)
        self.spare_budget = config.max_num_batched_tokens - out.total_num_scheduled_tokens

    def editable(self) -> list[GeneratorRequest]:
        fresh = [r for r in self.reqs if r.is_new or r.resumed or r.may_draft]  # may_draft: its verdict was read
        return [r for r in fresh if resumable(self.config, r.num_computed, r.is_new or r.resumed)]


def _with_table(ctx: _Ctx, r: GeneratorRequest, g: int, table: list[int]) -> SchedulerOutput:
    """`r`'s tables with group g's replaced: block_ids of a new request, a resumed table for a cached one."""
    blocks = tuple(tuple(table) if h == g else tuple(t) for h, t in enumerate(r.table_lists()))
    out = ctx.out
    news = tuple(replace(x, block_ids=blocks) if x.req_id == r.req_id else x for x in out.new_requests)
    cached = tuple(
        replace(x, new_block_ids=blocks, resumed=True) if x.req_id == r.req_id else x for x in out.cached_requests
    )
    return replace(out, new_requests=news, cached_requests=cached)


def _too_many_drafts(ctx: _Ctx) -> SchedulerOutput | None:
    limit = ctx.config.max_model_len
    for r in ctx.rng.sample(ctx.reqs, len(ctx.reqs)):
        end = r.num_computed + r.num_scheduled
        if not r.drafts or end != r.known_tokens + len(r.drafts):
            continue
        extra = 1 + max(ctx.config.kv_groups[g].num_speculative_blocks for g in ctx.mamba) - len(r.drafts)
        if extra > ctx.spare_budget or end + extra > limit:
            continue
        drafts = (*r.drafts, *(ctx.rng.randrange(ctx.config.vocab_size) for _ in range(extra)))
        counts = {**ctx.out.num_scheduled_tokens, r.req_id: r.num_scheduled + extra}
        spec = {**ctx.out.scheduled_spec_decode_tokens, r.req_id: drafts}
        return replace(ctx.out, num_scheduled_tokens=counts, scheduled_spec_decode_tokens=spec)
    return None


def _state_missing(ctx: _Ctx) -> SchedulerOutput | None:
    """A continuing request moved back past every state its last step kept (1 + its drafts, at most 1 + S)."""
    groups = ctx.config.kv_groups
    back = 1 + max(groups[g].num_speculative_blocks for g in ctx.mamba)
    # async: windows are checked from the lowest start a verdict gives (rule 4), up to the drafts it may have behind it
    ahead = 0 if not ctx.config.async_scheduling else back - 1
    options = [
        r
        for r in ctx.reqs
        if not r.is_new and not r.resumed and not r.drafts and r.num_computed >= back + ahead * (not r.may_draft)
        and all(g.first_live_entry(r.num_computed - back - ahead * (not r.may_draft))
                == g.first_live_entry(r.num_computed) for g in groups)
    ]  # fmt: skip
    if not options:
        return None
    r = ctx.rng.choice(options)
    out = ctx.out
    cached = tuple(replace(x, num_computed_tokens=r.num_computed - back) if x.req_id == r.req_id else x
                   for x in out.cached_requests)  # fmt: skip
    return replace(out, cached_requests=cached)


def _speculative_block_missing(ctx: _Ctx) -> SchedulerOutput | None:
    """A drafting request's mamba table cut just before its last draft's state block."""
    options = [(r, g) for r in ctx.reqs if r.drafts for g in ctx.mamba]
    if not options:
        return None
    r, g = ctx.rng.choice(options)
    keep = r.write(ctx.config.kv_groups[g].block_size) + len(r.drafts)
    return _with_table(ctx, r, g, r.table(g)[:keep])


def _null_state(ctx: _Ctx) -> SchedulerOutput | None:
    """The null block where the step reads its state (a cached one at a block end) or writes one."""
    options = []
    for r in ctx.editable():
        for g in ctx.mamba:
            bs = ctx.config.kv_groups[g].block_size
            write = r.write(bs)
            entries = list(range(write, write + len(r.drafts) + 1))
            if r.num_computed > 0:
                entries.append((r.num_computed - 1) // bs)
            options += [(r, g, e) for e in entries]
    if not options:
        return None
    r, g, entry = ctx.rng.choice(options)
    table = list(r.table(g))
    table[entry] = NULL_BLOCK_ID
    return _with_table(ctx, r, g, table)


def _shared_state(ctx: _Ctx) -> SchedulerOutput | None:
    """A second request's written state block made the one another request writes."""
    for g in ctx.rng.sample(ctx.mamba, len(ctx.mamba)):
        bs = ctx.config.kv_groups[g].block_size
        for a in ctx.rng.sample(ctx.reqs, len(ctx.reqs)):
            block = a.table(g)[a.write(bs) + ctx.rng.randint(0, len(a.drafts))]
            for b in ctx.editable():
                if b is not a and block not in b.table(g):
                    table = list(b.table(g))
                    table[b.write(bs) + ctx.rng.randint(0, len(b.drafts))] = block
                    return _with_table(ctx, b, g, table)
    return None


MAMBA_BREAKERS: dict[type[ScheduleError], tuple[Callable[[_Ctx], SchedulerOutput | None], ...]] = {
    BlockTableOverflowError: (_too_many_drafts,),
    MissingBlockError: (_state_missing, _speculative_block_missing),
    NullBlockError: (_null_state,),
    DuplicateSlotError: (_shared_state,),
}


def mamba_fault_or(
    plain: BreakOutput,
    cls: type[ScheduleError],
    out: SchedulerOutput,
    config: WorkerConfig,
    snapshot: PoolSnapshot,
    rng: random.Random,
) -> tuple[SchedulerOutput, type[ScheduleError]] | None:
    """On a hybrid model, a mamba fault of class `cls` half of the time where one exists, else `plain`'s fault."""
    makers = MAMBA_BREAKERS.get(cls, ())
    if makers and mamba_groups(config) and rng.random() < 0.5:
        broken = rng.choice(makers)(_Ctx(out, config, snapshot, rng))
        if broken is not None:
            return broken, cls
    return plain(cls, out, config, snapshot, rng)
