"""Malformed scheduler outputs: a field of the wrong type or container, or an id listed twice.

Each function takes a valid output (and the ids of the pool's live requests) and returns a variant that
check 1 of spec/validate.py refuses (InconsistentSchedulerOutputError), or None where the output offers
nothing to malform that way. Check 1 runs first, so no other fault can decide the class instead.
The type-level faults that later checks own (float token ids: check 6; float block ids, a block twice:
check 9) are made in conformance.mutations, next to the other faults of their class.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from spec.types import CachedRequest, CachedRequestColumns, NewRequest, SchedulerOutput

T = TypeVar("T")
Malform = Callable[[SchedulerOutput, Sequence[str], random.Random], "SchedulerOutput | None"]


def edit(obj: T, **changes: Any) -> T:
    """dataclasses.replace with values of any type: breaking the field annotations is the point here."""
    return replace(obj, **changes)  # type: ignore[type-var]


def _scheduled(out: SchedulerOutput) -> list[NewRequest | CachedRequest]:
    return [*out.new_requests, *out.cached_requests]


def _rename(out: SchedulerOutput, req_id: str, to: Any) -> SchedulerOutput:
    """req_id renamed everywhere it appears (its request and its num_scheduled_tokens key, order kept)."""
    news = tuple(edit(r, req_id=to) if r.req_id == req_id else r for r in out.new_requests)
    cached = tuple(edit(r, req_id=to) if r.req_id == req_id else r for r in out.cached_requests)
    counts = {(to if k == req_id else k): n for k, n in out.num_scheduled_tokens.items()}
    return edit(out, new_requests=news, cached_requests=cached, num_scheduled_tokens=counts)


def _non_str_id(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    scheduled = _scheduled(out)
    if scheduled and rng.random() < 0.7:
        req_id = rng.choice(scheduled).req_id
        return _rename(out, req_id, rng.choice((req_id.encode(), hash(req_id) % 1000, (req_id,))))
    victim = rng.choice([*out.finished_req_ids, *live, "ghost"])
    return edit(out, finished_req_ids=frozenset({*out.finished_req_ids, victim.encode()}))


def _bool_count(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    scheduled = _scheduled(out)
    if not scheduled:
        return None
    req = rng.choice(scheduled)
    if rng.random() < 0.5:  # a bool equal to the count where the count is 0 or 1
        n = out.num_scheduled_tokens[req.req_id]
        counts = {**out.num_scheduled_tokens, req.req_id: n == 1 or bool(rng.getrandbits(1))}
        return edit(out, num_scheduled_tokens=counts)
    return _with_request(out, edit(req, num_computed_tokens=bool(req.num_computed_tokens)))


def _float_count(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    scheduled = _scheduled(out)
    if not scheduled:
        return None
    req = rng.choice(scheduled)
    if rng.random() < 0.5:
        counts = {**out.num_scheduled_tokens, req.req_id: float(out.num_scheduled_tokens[req.req_id])}
        return edit(out, num_scheduled_tokens=counts)
    return _with_request(out, edit(req, num_computed_tokens=float(req.num_computed_tokens)))


def _with_request(out: SchedulerOutput, changed: NewRequest | CachedRequest) -> SchedulerOutput:
    """`out` with the request of changed.req_id replaced by `changed` (same place)."""
    if isinstance(changed, NewRequest):
        news = tuple(changed if r.req_id == changed.req_id else r for r in out.new_requests)
        return edit(out, new_requests=news)
    cached = tuple(changed if r.req_id == changed.req_id else r for r in out.cached_requests)
    return edit(out, cached_requests=cached)


def _generator_container(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    def once(items: Sequence[Any]) -> Iterator[Any]:
        yield from items

    field = rng.choice(("new_requests", "cached_requests", "finished_req_ids", "block_ids"))
    if field == "block_ids":
        if not out.new_requests:
            return None
        new = rng.choice(out.new_requests)
        return _with_request(out, edit(new, block_ids=once(new.block_ids)))
    return edit(out, **{field: once(tuple(getattr(out, field)))})


def _items_container(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    if rng.random() < 0.5:
        return edit(out, num_scheduled_tokens=out.num_scheduled_tokens.items())
    if rng.random() < 0.5:
        return edit(out, num_scheduled_tokens=list(out.num_scheduled_tokens.items()))
    return edit(out, finished_req_ids=dict.fromkeys(out.finished_req_ids).keys())


def _str_finished(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    # iterated per character, a one-letter id would free that request: a str is never a set of ids
    candidates = [*out.finished_req_ids, *(r for r in live if r not in out.num_scheduled_tokens), "ghost"]
    return edit(out, finished_req_ids=rng.choice(candidates))


def _repeated_finished(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    idle = [r for r in live if r not in out.num_scheduled_tokens and r not in out.finished_req_ids]
    finished = list(out.finished_req_ids)
    twice = rng.choice(finished or idle or ["ghost"])
    ids = [*finished, *([] if twice in finished else [twice])]
    ids.insert(rng.randint(0, len(ids)), twice)
    return edit(out, finished_req_ids=tuple(ids) if rng.random() < 0.5 else ids)


def _repeated_new(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    if not out.new_requests:
        return None
    news = list(out.new_requests)
    news.insert(rng.randint(0, len(news)), rng.choice(news))
    return edit(out, new_requests=tuple(news))


def _repeated_cached(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    if not out.cached_requests:
        return None
    cached = list(out.cached_requests)
    cached.insert(rng.randint(0, len(cached)), rng.choice(cached))
    return edit(out, cached_requests=tuple(cached))


def _new_and_cached(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    """One req_id both new and cached: a cached request listed again as new, or a new one again as cached."""
    if out.cached_requests and (not out.new_requests or rng.random() < 0.5):
        cached = rng.choice(out.cached_requests)
        again = NewRequest(cached.req_id, (0,), ((),))  # check 1 refuses the repeat before it counts groups
        return edit(out, new_requests=(*out.new_requests, again))
    if not out.new_requests:
        return None
    new = rng.choice(out.new_requests)
    return edit(out, cached_requests=(*out.cached_requests, CachedRequest(new.req_id, new.num_computed_tokens)))


def _non_bool_resumed(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    if not out.cached_requests:
        return None
    cached = rng.choice(out.cached_requests)
    return _with_request(out, edit(cached, resumed=rng.choice((int(cached.resumed), None, "yes"))))


def _block_ids_not_per_group(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    if not out.new_requests:
        return None
    new = rng.choice(out.new_requests)
    groups = new.block_ids
    disguise = rng.choice((None, 7, dict(enumerate(groups)), (*groups, ())))  # no tuple of num_groups entries
    return _with_request(out, edit(new, block_ids=disguise))


def _none_count(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    scheduled = _scheduled(out)
    if not scheduled:
        return None
    return _with_request(out, edit(rng.choice(scheduled), num_computed_tokens=None))


def _non_str_count_key(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    """A count under a key that is no req_id (bytes or int): every request listed keeps its own count."""
    named = rng.choice([*out.num_scheduled_tokens, "ghost"])
    key = rng.choice((named.encode(), hash(named) % 1000))
    items: list[tuple[Any, int]] = list(out.num_scheduled_tokens.items())
    items.insert(rng.randint(0, len(items)), (key, 1))
    return edit(out, num_scheduled_tokens=dict(items))


def _foreign_new_request(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    """new_requests holding a request's fields as a tuple, or a CachedRequest of the same id."""
    if not out.new_requests:
        return None
    news = _one_replaced(out.new_requests, rng, lambda r: ((r.req_id, r.prompt_token_ids, r.block_ids),
                                                              CachedRequest(r.req_id, 0)))  # fmt: skip
    return edit(out, new_requests=news)


def _foreign_cached_request(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    """cached_requests (as a tuple) holding a request's fields as a tuple, or a NewRequest of the same id."""
    if not out.cached_requests:
        return None
    cached = _one_replaced(out.cached_requests, rng, lambda r: ((r.req_id, r.num_computed_tokens),
                                                                   NewRequest(r.req_id, (0,), ((),))))  # fmt: skip
    return edit(out, cached_requests=cached)


def _one_replaced(requests: Sequence[Any], rng: random.Random, foreign: Callable[[Any], tuple[Any, ...]]) -> tuple:
    """`requests` with one of them replaced by one of its `foreign(request)` stand-ins."""
    items = list(requests)
    i = rng.randrange(len(items))
    items[i] = rng.choice(foreign(items[i]))
    return tuple(items)


def _columns(out: SchedulerOutput) -> CachedRequestColumns | None:
    """out's cached requests as columns (vLLM's CachedRequestData), or None if it has none."""
    cached = tuple(out.cached_requests)
    if not cached:
        return None
    return CachedRequestColumns(
        req_ids=[r.req_id for r in cached],
        num_computed_tokens=[r.num_computed_tokens for r in cached],
        new_block_ids=[r.new_block_ids for r in cached],
        resumed_req_ids=frozenset(r.req_id for r in cached if r.resumed),
    )


def _unequal_columns(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    columns = _columns(out)
    if columns is None:
        return None
    name = rng.choice(("num_computed_tokens", "new_block_ids"))
    column: Any = list(getattr(columns, name))
    roll = rng.random()
    if roll < 0.2:  # no column at all (None means "no new ids" for new_block_ids, nothing for the counts)
        column = 7 if name == "new_block_ids" else rng.choice((7, None))
    else:  # one entry short or one too many
        column = column[:-1] if roll < 0.6 else [*column, column[-1]]
    return edit(out, cached_requests=edit(columns, **{name: column}))


def _resumed_ids_not_a_set(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    columns = _columns(out)
    if columns is None:
        return None
    ids = sorted(columns.resumed_req_ids)
    return edit(out, cached_requests=edit(columns, resumed_req_ids=rng.choice((ids, tuple(ids)))))


def _resumed_id_not_cached(out: SchedulerOutput, live: Sequence[str], rng: random.Random) -> SchedulerOutput | None:
    """A resumed id among the columns that none of their req_ids is: a new request's, a finished one's, a ghost."""
    columns = _columns(out)
    if columns is None:
        return None
    stranger = rng.choice([*(r.req_id for r in out.new_requests), *out.finished_req_ids, "ghost"])
    return edit(out, cached_requests=edit(columns, resumed_req_ids=columns.resumed_req_ids | {stranger}))


def _new_block_ids_not_per_group(
    out: SchedulerOutput, live: Sequence[str], rng: random.Random
) -> SchedulerOutput | None:
    if not out.cached_requests:
        return None
    cached = rng.choice(tuple(out.cached_requests))
    groups = tuple(cached.new_block_ids or ())  # () for None: then only a non-sequence is surely wrong
    miscounted = ((*groups, ()), groups[:-1]) if groups else ()  # one group too many or too few
    # an array (its truth ambiguous) where a tuple of per-group ids belongs
    disguise = rng.choice((7, dict(enumerate(groups)), np.array([7, 8]), *miscounted))
    return _with_request(out, edit(cached, new_block_ids=disguise))


CHECK_ONE: dict[str, Malform] = {
    "non-str req id": _non_str_id,
    "bool count": _bool_count,
    "float count": _float_count,
    "generator container": _generator_container,
    "items container": _items_container,
    "str as finished_req_ids": _str_finished,
    "repeated finished id": _repeated_finished,
    "repeated new request": _repeated_new,
    "repeated cached request": _repeated_cached,
    "new and cached": _new_and_cached,
    "non-bool resumed": _non_bool_resumed,
    "block ids not per group": _block_ids_not_per_group,
    "None count": _none_count,
    "non-str count key": _non_str_count_key,
    "request not a NewRequest": _foreign_new_request,
    "request not a CachedRequest": _foreign_cached_request,
    "columns of unequal length": _unequal_columns,
    "resumed ids not a set": _resumed_ids_not_a_set,
    "resumed id not cached": _resumed_id_not_cached,
    "new block ids not per group": _new_block_ids_not_per_group,
}
