"""Malformed M-RoPE inputs (spec/mrope.py): each a variant of a valid output that check 1 refuses.

Each function takes a valid output, the config and a random source and returns the output with one new
request's table or delta broken (InconsistentSchedulerOutputError), or None where the output offers no
new request to break that way. conformance.mutations lists them among its MALFORMATIONS.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from conformance.malformed import edit
from spec.types import NewRequest, SchedulerOutput, WorkerConfig

MRopeMalform = Callable[[SchedulerOutput, WorkerConfig, random.Random], "SchedulerOutput | None"]


def _with_new(out: SchedulerOutput, changed: NewRequest) -> SchedulerOutput:
    news = tuple(changed if r.req_id == changed.req_id else r for r in out.new_requests)
    return edit(out, new_requests=news)


def _arange_table(n: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(n)) for _ in range(3))


def _on_a_text_model(out: SchedulerOutput, config: WorkerConfig, rng: random.Random) -> SchedulerOutput | None:
    if config.uses_mrope or not out.new_requests:
        return None
    new = rng.choice(out.new_requests)
    if rng.random() < 0.6:
        return _with_new(out, edit(new, mrope_positions=_arange_table(len(new.prompt_token_ids))))
    return _with_new(out, edit(new, mrope_position_delta=rng.choice((-1, 1, 5))))


def _delta_not_an_integer(out: SchedulerOutput, config: WorkerConfig, rng: random.Random) -> SchedulerOutput | None:
    if not config.uses_mrope or not out.new_requests:
        return None
    new = rng.choice(out.new_requests)
    delta = new.mrope_position_delta
    return _with_new(out, edit(new, mrope_position_delta=rng.choice((float(delta), str(delta), True, -(2**62)))))


def _delta_without_a_table(out: SchedulerOutput, config: WorkerConfig, rng: random.Random) -> SchedulerOutput | None:
    text = [r for r in out.new_requests if r.mrope_positions is None]
    if not config.uses_mrope or not text:
        return None
    return _with_new(out, edit(rng.choice(text), mrope_position_delta=rng.choice((-3, -1, 1, 4))))


def _table_not_three_integer_rows(
    out: SchedulerOutput, config: WorkerConfig, rng: random.Random
) -> SchedulerOutput | None:
    if not config.uses_mrope or not out.new_requests:
        return None
    new = rng.choice(out.new_requests)
    table = np.array(
        new.mrope_positions if new.mrope_positions is not None else _arange_table(len(new.prompt_token_ids))
    )
    broken = rng.choice(
        (
            table[:2],  # two rows
            np.concatenate([table, table[:1]]),  # four rows
            table.astype(np.float64),  # not integers
            table[0],  # one flat row
            (tuple(table[0]), tuple(table[1]), tuple(table[2][:-1])),  # rows of unequal length
        )
    )
    return _with_new(out, edit(new, mrope_positions=broken))


def _table_not_the_prompts_length(
    out: SchedulerOutput, config: WorkerConfig, rng: random.Random
) -> SchedulerOutput | None:
    if not config.uses_mrope or not out.new_requests:
        return None
    new = rng.choice(out.new_requests)
    n = len(new.prompt_token_ids)
    width = rng.choice([w for w in (n - 1, n - rng.randint(1, n), n + 1) if w >= 0])  # mostly shorter, as the issue
    return _with_new(out, edit(new, mrope_positions=_arange_table(width)))


MROPE_MALFORMATIONS: dict[str, MRopeMalform] = {
    "mrope table on a model without M-RoPE": _on_a_text_model,
    "mrope delta not an integer": _delta_not_an_integer,
    "mrope delta without a table": _delta_without_a_table,
    "mrope table not 3 integer rows": _table_not_three_integer_rows,
    "mrope table not the prompt's length": _table_not_the_prompts_length,
}
