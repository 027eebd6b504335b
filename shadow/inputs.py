"""The shadow checker's inputs in its own terms: copied arrays, accepted tokens per engine row, spec's pool
read per request, and a scheduler output without the requests the checker no longer follows.

Everything here costs in proportion to the step (its requests, its tokens), never to the tokens held.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

import spec
from spec.interop.vllm import VllmConversionError, VllmSchedulerOutput
from spec.types import PAD_SLOT_ID, PLACEHOLDER_TOKEN_ID, SchedulerOutput, is_integral

TOKEN_FIELDS = ("positions", "input_ids")  # per flat token; group fields are slot_mapping[g]
REQUEST_FIELDS = ("num_scheduled_tokens", "seq_lens")  # per batch row
# vLLM's SpecDecodeMetadata, plus logits_indices: [num_reqs + num_drafts] with drafts, [num_reqs] without
DRAFT_FIELDS = (
    "draft_token_ids",  # [num_drafts]
    "num_draft_tokens",  # [num_reqs]
    "cu_num_draft_tokens",  # [num_reqs]
    "cu_num_sampled_tokens",  # [num_reqs]
    "target_logits_indices",  # [num_drafts] rows of logits[logits_indices]
    "bonus_logits_indices",  # [num_reqs] rows of logits[logits_indices]
)
GROUPED = re.compile(r"^(block_table|slot_mapping)(?:\[(\d+)\])?$")
KNOWN_FIELDS = frozenset((*TOKEN_FIELDS, *REQUEST_FIELDS, *DRAFT_FIELDS, "logits_indices", "query_start_loc"))


@dataclass(frozen=True)
class UnreadableOutput:
    """An engine output that could not be read (a field missing or malformed): replaying it fails the same way."""

    req_id: str | None
    field: str
    detail: str

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise VllmConversionError(self.req_id, self.field, self.detail)


Record = SchedulerOutput | VllmSchedulerOutput | UnreadableOutput  # a step's scheduler output as the checker keeps it


@dataclass
class ShadowStep:
    """One engine step as the reproduction replays it."""

    sched: Record | None  # slotmap's output, a copy of the vLLM one, or what made it unreadable
    req_ids: tuple[str, ...]  # the engine's batch_idx -> req_id
    arrays: dict[str, np.ndarray]  # the engine's fields, copied (padding the comparison ignores trimmed)
    sampled: Any = None  # [num_reqs, width] accepted tokens in the engine's order (-1 after each row's); None: none
    proposed: dict[str, tuple[int, ...]] | None = None  # req_id -> the drafter's ids on the device (async); None: none
    padding: Any = None  # shadow.compare_padding.EnginePadding: the graphs the engine ran it on; None: not padded


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy copy that owns its memory: an engine reuses its buffers, and a view would change under the record."""
    if hasattr(x, "detach"):  # torch, any device; `.cpu()` of a CPU tensor is the tensor itself, hence the copy
        return np.array(x.detach().cpu().numpy(), copy=True)
    return np.array(x, copy=True)


def copy_arrays(arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for name, value in arrays.items():
        if name not in KNOWN_FIELDS and not GROUPED.match(name):
            raise ValueError(f"arrays: unknown field {name!r} (see shadow.checker's docstring)")
        out[name] = to_numpy(value)
    return out


def compact(arrays: dict[str, np.ndarray], num_tokens: int | None, num_reqs: int, width: int) -> dict[str, np.ndarray]:
    """The arrays without what the comparison ignores, so a long run's record (and script) stays small.

    Positions and input ids past the engine's `num_tokens` are undefined; slots there are kept only if one
    is not PAD_SLOT_ID (that is a divergence); table rows past the batch and columns past `width` (the
    most blocks a compared request holds) are never read.
    """
    out = dict(arrays)
    for name, a in arrays.items():
        m = GROUPED.match(name)
        if num_tokens is not None and a.ndim == 1 and (name in TOKEN_FIELDS or (m and m.group(1) == "slot_mapping")):
            if name in TOKEN_FIELDS or not np.any(a[num_tokens:] != PAD_SLOT_ID):
                out[name] = a[:num_tokens].copy()
        elif m and m.group(1) == "block_table" and a.ndim == 2:
            out[name] = a[:num_reqs, :width].copy()
    return out


def engine_rows(sampled: object, req_ids: Sequence[str]) -> np.ndarray:
    """[len(req_ids), width] int64 accepted tokens in the engine's batch order, PLACEHOLDER_TOKEN_ID after each row's.

    `sampled` is req_id -> token or tokens (1 .. k + 1 accepted), an array `[num_reqs]` (one token per row)
    or `[num_reqs, width]` padded with -1 (vLLM's sampler output), or a list of per-row lists (vLLM's
    `sampled_token_ids`, an empty list where a row sampled nothing). A row without tokens is -1 throughout.
    """
    n = len(req_ids)
    if isinstance(sampled, Mapping):
        index = {r: e for e, r in enumerate(req_ids)}
        rows: list[list[int]] = [[] for _ in range(n)]
        for req_id, tokens in sampled.items():
            if req_id not in index:
                raise ValueError(f"sampled: request {req_id!r} is not in this step's batch")
            rows[index[req_id]] = _token_list(tokens, req_id)
        return _pad(rows)
    if isinstance(sampled, (list, tuple)) and any(isinstance(r, (list, tuple, np.ndarray)) for r in sampled):
        if len(sampled) != n:
            raise ValueError(f"sampled: {len(sampled)} rows for the {n} requests of this step's batch")
        return _pad([_token_list(r, req_ids[e]) for e, r in enumerate(sampled)])
    array = to_numpy(sampled)
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"sampled: dtype {array.dtype}: needs integer token ids")
    if array.ndim not in (1, 2) or array.shape[0] != n:
        raise ValueError(f"sampled: shape {array.shape}, needs [{n}] or [{n}, width] (this step's batch)")
    return (array[:, None] if array.ndim == 1 else array).astype(np.int64)


def _token_list(tokens: object, req_id: str) -> list[int]:
    values = [tokens] if is_integral(tokens) else tokens
    if not isinstance(values, Sequence) and not hasattr(values, "__array__"):
        raise ValueError(f"sampled: request {req_id!r}: {tokens!r} is not a token or a list of tokens")
    out = np.asarray(values).reshape(-1)
    if out.size and out.dtype.kind not in "iu":
        raise ValueError(f"sampled: request {req_id!r}: {tokens!r} are not integer token ids")
    return [int(t) for t in out]


def _pad(rows: list[list[int]]) -> np.ndarray:
    out = np.full((len(rows), max((len(r) for r in rows), default=0) or 1), PLACEHOLDER_TOKEN_ID, np.int64)
    for e, tokens in enumerate(rows):
        out[e, : len(tokens)] = tokens
    return out


class PoolView:
    """The few facts the checker reads of spec's pool, request by request (never a whole snapshot)."""

    def __init__(self, pool: spec.RequestStatePool) -> None:
        self.pool = pool

    def holds(self, req_id: str) -> bool:
        return req_id in self.pool.state.row_of

    def num_tokens(self, req_id: str) -> int:
        return int(self.pool.state.num_known_tokens[self.pool.row_of(req_id)])

    def num_blocks(self, req_id: str, group: int) -> int:
        return int(self.pool.state.num_blocks[group, self.pool.row_of(req_id)])

    def tokens(self, req_id: str, start: int, stop: int) -> np.ndarray:
        return self.pool.token_ids[self.pool.row_of(req_id), start:stop]

    def held(self) -> Iterator[str]:
        return iter(self.pool.state.row_of)

    def count(self) -> int:
        return len(self.pool.state.row_of)


class HeldTokens(Mapping[str, Sequence[int]]):
    """req_id -> the tokens spec's pool holds, for from_vllm's checks: a lookup reads only what is asked."""

    def __init__(self, view: PoolView) -> None:
        self.view = view

    def __getitem__(self, req_id: str) -> Sequence[int]:
        if not self.view.holds(req_id):
            raise KeyError(req_id)
        return _HeldRow(self.view, req_id)

    def __contains__(self, req_id: object) -> bool:
        return isinstance(req_id, str) and self.view.holds(req_id)

    def __iter__(self) -> Iterator[str]:
        return self.view.held()

    def __len__(self) -> int:
        return self.view.count()


class _HeldRow(Sequence[int]):
    def __init__(self, view: PoolView, req_id: str) -> None:
        self.view, self.req_id, self.n = view, req_id, view.num_tokens(req_id)

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            start, stop, stride = index.indices(self.n)
            return tuple(self.view.tokens(self.req_id, start, stop)[::stride].tolist())
        if not -self.n <= index < self.n:
            raise IndexError(index)
        i = index % self.n
        return int(self.view.tokens(self.req_id, i, i + 1)[0])

    def __iter__(self) -> Iterator[int]:
        return iter(self.view.tokens(self.req_id, 0, self.n).tolist())


def without(sched: SchedulerOutput, lost: Container[str], holds: Container[str]) -> SchedulerOutput:
    """`sched` less the requests in `lost`; those spec still holds are finished instead (their rows freed)."""
    if not any(r in lost for r in _named(sched)):
        return sched
    keep = [r for r in sched.num_scheduled_tokens if r not in lost]
    finishing = {r for r in _named(sched) if r in lost and r in holds}
    return SchedulerOutput(
        new_requests=tuple(r for r in sched.new_requests if r.req_id not in lost),
        cached_requests=tuple(r for r in sched.cached_requests if r.req_id not in lost),
        num_scheduled_tokens={r: sched.num_scheduled_tokens[r] for r in keep},
        finished_req_ids=frozenset(r for r in sched.finished_req_ids if r not in lost) | finishing,
        scheduled_spec_decode_tokens={
            r: t for r, t in sched.scheduled_spec_decode_tokens.items() if r not in lost and r in keep
        },
    )


def finishing(lost: set[str], holds: Container[str]) -> SchedulerOutput:
    """An output that only frees the rows spec holds for `lost` requests (the last resort of a refused step)."""
    return SchedulerOutput(finished_req_ids=frozenset(r for r in lost if r in holds))


def _named(sched: SchedulerOutput) -> Iterator[str]:
    yield from (r.req_id for r in sched.new_requests)
    yield from (r.req_id for r in sched.cached_requests)
    yield from sched.num_scheduled_tokens
    yield from sched.finished_req_ids


def referenced(record: Record | None, req_ids: Sequence[str]) -> set[str]:
    """Every request a step names (new, cached, scheduled) and the engine's batch: who a refusal may concern."""
    names = set(req_ids)
    if isinstance(record, VllmSchedulerOutput):
        names.update(record.num_scheduled_tokens)
        names.update(r.req_id for r in record.scheduled_new_reqs)
        names.update(record.scheduled_cached_reqs.req_ids)
    elif isinstance(record, SchedulerOutput):  # as the caller built it: possibly malformed, so read with care
        if isinstance(record.num_scheduled_tokens, Mapping):
            names.update(r for r in record.num_scheduled_tokens if isinstance(r, str))
        for req in (*_items(record.new_requests), *_items(record.cached_requests)):
            req_id = getattr(req, "req_id", None)
            if isinstance(req_id, str):
                names.add(req_id)
    return names


def _items(value: object) -> tuple[object, ...]:
    return tuple(value) if isinstance(value, (tuple, list, Sequence)) else ()


def record_facts(record: Record | None) -> tuple[dict[str, int], dict[str, int], frozenset[str]]:
    """(req_id -> scheduled tokens, req_id -> drafts, finished ids) as the engine was told: its own layout."""
    if not isinstance(record, (SchedulerOutput, VllmSchedulerOutput)):
        return {}, {}, frozenset()
    drafts = {r: len(t) for r, t in _mapping(record.scheduled_spec_decode_tokens).items() if _sized(t)}
    finished = record.finished_req_ids
    return (
        {r: n for r, n in _mapping(record.num_scheduled_tokens).items() if isinstance(n, int)},
        drafts,
        frozenset(r for r in finished if isinstance(r, str))
        if isinstance(finished, (set, frozenset, list, tuple))
        else frozenset(),
    )


def _mapping(value: object) -> Mapping[Any, Any]:
    return value if isinstance(value, Mapping) else {}


def _sized(value: object) -> bool:
    return isinstance(value, Sized) and len(value) > 0
