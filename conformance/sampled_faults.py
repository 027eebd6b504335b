"""Invalid `record_sampled` inputs, made from a valid step's accepted tokens: the generator of their refusals.

`break_sampled(name, sampled, config, rng)` turns the valid accepted tokens of a prepared batch
(conformance.seeded.Sampled: per batch row the tokens it keeps, its drafts, whether it samples at all, the
tokens it knew before the step) into the ids of one fault of spec/drafts.py's and spec/pool.py's rules, as the
array record_sampled is handed, with the class spec raises for it; None where this step offers no way
to make that fault. Every check before the fault's own still passes, so the class is known by construction
(spec's order: the array's shape, then per taking row in batch order: a token, no gap, at most 1 + k,
in the vocabulary, the drafts' prefix, room below max_model_len).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from conformance.seeded import Sampled
from spec.drafts import pad_accepted
from spec.errors import InconsistentSchedulerOutputError, ModelLengthError, ScheduleError, TokenIdError
from spec.types import PLACEHOLDER_TOKEN_ID, BatchInputs, WorkerConfig

Rows = list[list[int]]
Maker = Callable[[Sampled, WorkerConfig, random.Random], "np.ndarray | None"]


def _first_taking(takes: Sequence[bool]) -> int | None:
    """The first taking row: spec checks rows in batch order, so a fault there is the one it names."""
    taking = [b for b, t in enumerate(takes) if t]
    return taking[0] if taking else None


def _no_token(s: Sampled, config: WorkerConfig, rng: random.Random) -> np.ndarray | None:
    b = _first_taking(s.takes)
    if b is None:
        return None
    rows = [list(r) for r in s.rows]
    rows[b] = []
    return _padded(rows, extra=1)


def _gap(s: Sampled, config: WorkerConfig, rng: random.Random) -> np.ndarray | None:
    b = _first_taking(s.takes)
    if b is None:
        return None
    padded = _padded(s.rows, extra=2)
    padded[b, len(s.rows[b]) + 1] = rng.randrange(config.vocab_size)  # a token after the first placeholder
    return padded


def _too_many(s: Sampled, config: WorkerConfig, rng: random.Random) -> np.ndarray | None:
    b = _first_taking(s.takes)
    if b is None or len(s.rows[b]) < len(s.drafts[b]) + 1:
        return None  # only a row that kept every draft can get one more than 1 + k
    rows = [list(r) for r in s.rows]
    rows[b].append(rng.randrange(config.vocab_size))
    return _padded(rows)


def _out_of_vocabulary(s: Sampled, config: WorkerConfig, rng: random.Random) -> np.ndarray | None:
    b = _first_taking(s.takes)
    if b is None:
        return None
    rows = [list(r) for r in s.rows]
    rows[b][-1] = rng.choice((config.vocab_size, config.vocab_size + 7, -3))  # the sampled (last) token
    return _padded(rows)


def _negative_one_id_per_row(s: Sampled, config: WorkerConfig, rng: random.Random) -> np.ndarray | None:
    """[num_reqs] has no placeholders: -1 there is an id outside the vocabulary (vLLM #37159's class)."""
    b = _first_taking(s.takes)
    if b is None or any(s.drafts) or any(len(r) != 1 for r in s.rows):
        return None
    ids = np.array([r[0] for r in s.rows], np.int64)
    ids[b] = PLACEHOLDER_TOKEN_ID
    return ids


def _not_the_drafts(s: Sampled, config: WorkerConfig, rng: random.Random) -> np.ndarray | None:
    b = _first_taking(s.takes)
    if b is None or len(s.rows[b]) < 2 or config.vocab_size < 2:
        return None  # needs an accepted draft to change
    rows = [list(r) for r in s.rows]
    j = rng.randrange(len(rows[b]) - 1)  # any position of the accepted prefix, the last draft before the bonus too
    rows[b][j] = (rows[b][j] + 1 + rng.randrange(config.vocab_size - 1)) % config.vocab_size
    return _padded(rows)


def _wrong_row_count(s: Sampled, config: WorkerConfig, rng: random.Random) -> np.ndarray | None:
    padded = _padded(s.rows)
    return padded[:-1] if rng.random() < 0.5 else np.concatenate([padded, padded[:1]])


def _three_dimensions(s: Sampled, config: WorkerConfig, rng: random.Random) -> np.ndarray | None:
    return _padded(s.rows)[:, :, None]


def _float_ids(s: Sampled, config: WorkerConfig, rng: random.Random) -> np.ndarray | None:
    return _padded(s.rows).astype(np.float32)


def _past_max_model_len(s: Sampled, config: WorkerConfig, rng: random.Random) -> np.ndarray | None:
    """A row that kept tokens up to max_model_len with a draft to spare keeps that draft too, and one more token:
    every check before the length passes (the drafts' prefix, at most 1 + k tokens)."""
    full = [b for b, t in enumerate(s.takes) if t and s.known[b] + len(s.rows[b]) == config.max_model_len]
    spare = [b for b in full if len(s.rows[b]) < 1 + len(s.drafts[b])]
    if not spare:
        return None
    b = rng.choice(spare)
    rows = [list(r) for r in s.rows]
    rows[b] = [*s.drafts[b][: len(rows[b])], rng.randrange(config.vocab_size)]
    return _padded(rows)


def _padded(rows: Rows, extra: int = 0) -> np.ndarray:
    padded = pad_accepted([list(r) for r in rows])
    if extra:
        padded = np.concatenate([padded, np.full((padded.shape[0], extra), PLACEHOLDER_TOKEN_ID)], axis=1)
    return padded


# every fault, with the class record_sampled raises for it
SAMPLED_FAULTS: dict[str, tuple[type[ScheduleError], Maker]] = {
    "no token for a row that samples": (InconsistentSchedulerOutputError, _no_token),
    "a token after the placeholder": (InconsistentSchedulerOutputError, _gap),
    "more than 1 + k tokens": (InconsistentSchedulerOutputError, _too_many),
    "a token outside the vocabulary": (TokenIdError, _out_of_vocabulary),
    "-1 in the one-id-per-row form": (TokenIdError, _negative_one_id_per_row),
    "accepted tokens that are not the drafts": (InconsistentSchedulerOutputError, _not_the_drafts),
    "a row count other than num_reqs": (InconsistentSchedulerOutputError, _wrong_row_count),
    "ids of three dimensions": (InconsistentSchedulerOutputError, _three_dimensions),
    "ids of a float dtype": (InconsistentSchedulerOutputError, _float_ids),
    "kept tokens past max_model_len": (ModelLengthError, _past_max_model_len),
}


def break_sampled(
    name: str, sampled: Sampled, config: WorkerConfig, rng: random.Random
) -> tuple[np.ndarray, type[ScheduleError]] | None:
    """The fault `name` of SAMPLED_FAULTS made from a valid step's accepted tokens, with its class; or None."""
    cls, make = SAMPLED_FAULTS[name]
    if not sampled.rows:
        return None  # an empty step: no ids to break (and an empty float array is a harmless "no ids")
    ids = make(sampled, config, rng)
    return None if ids is None else (ids, cls)


def stale_batch(
    batch: BatchInputs, to_numpy: Callable[[Any], np.ndarray], asarray: Callable[[np.ndarray], Any], rng: random.Random
) -> BatchInputs | None:
    """A copy of the prepared batch with the same request ids but other rows or lengths: record_sampled refuses it
    (its ids would land in rows the step did not prepare). None for a batch with one row and one token."""
    rows, seq_lens = to_numpy(batch.index_mapping), to_numpy(batch.seq_lens)
    if rows.size >= 2 and rng.random() < 0.5:
        return dataclasses.replace(batch, index_mapping=asarray(np.roll(rows, 1).copy()))
    if rows.size:
        return dataclasses.replace(batch, seq_lens=asarray((seq_lens + 1).astype(seq_lens.dtype)))
    return None
