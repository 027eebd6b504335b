"""A shadow checker for an engine that already exists: spec runs beside it and compares every step.

    checker = ShadowChecker(config)                       # the engine's WorkerConfig-equivalent
    # in the engine's step, after its model runner built its inputs:
    checker.check(scheduler_output, {"input_ids": ..., "positions": ..., "slot_mapping": ...}, req_ids)
    # after sampling (req_id -> token; the rows that sampled):
    checker.record_sampled(sampled)

`scheduler_output` is slotmap's `SchedulerOutput` or a vLLM-shaped one (converted by
`spec.interop.from_vllm`, which also checks a resumed request's `all_token_ids` against the tokens
spec holds). `req_ids` is the engine's own batch order (batch_idx -> req_id), and every array is in the
engine's conventions: its order, its padding, its table width. Arrays may be NumPy, torch (any
device) or anything `np.asarray` reads. Fields (vLLM's names; `[g]` for KV cache group g, bare for 0):
`query_start_loc`, `num_scheduled_tokens`, `positions`, `input_ids`, `seq_lens`, `logits_indices`,
`block_table[g]`, `slot_mapping[g]`. Row numbers (`index_mapping`) are the engine's own business and
are not compared.

Comparison is per request: request r's tokens are found through the engine's query_start_loc (or,
without one, laid out in the engine's order) and compared with spec's tokens of r; `logits_indices`
relative to the request's first token; `block_table` over the entries r's table holds (entries past
them are undefined). Undefined by convention, so ignored: positions and input ids of padding tokens,
table entries past a request's blocks, table rows past the batch. Defined and checked: padding slots
are PAD_SLOT_ID (a padded token must not write KV).

The first divergence raises `ShadowMismatchError` naming the step, request and field, after writing a
runnable reproduction script (`.repro_path`): it replays every step so far through a fresh checker
and fails the same way. The checker keeps a NumPy copy of every step's arrays for that script.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import spec
from spec.interop.vllm import from_vllm
from spec.types import PAD_SLOT_ID, BatchInputs, SchedulerOutput, WorkerConfig

TOKEN_FIELDS = ("positions", "input_ids")  # per flat token; group fields are slot_mapping[g]
REQUEST_FIELDS = ("num_scheduled_tokens", "seq_lens", "logits_indices")  # per batch row
_GROUPED = re.compile(r"^(block_table|slot_mapping)(?:\[(\d+)\])?$")


class ShadowMismatchError(AssertionError):
    """The engine's array differs from spec's for one request (req_id None: the batch as a whole)."""

    def __init__(self, step: int, req_id: str | None, field: str, detail: str, repro_path: Path | None) -> None:
        self.step, self.req_id, self.field, self.detail, self.repro_path = step, req_id, field, detail, repro_path
        who = f"request {req_id!r}" if req_id is not None else "batch"
        where = f"\nreproduction: python {repro_path}" if repro_path is not None else ""
        super().__init__(f"step {step}: {who}: {field}: {detail}{where}")


@dataclass(frozen=True)
class ShadowStep:
    """One engine step as the reproduction replays it."""

    sched: SchedulerOutput  # slotmap's form (converted if the engine sent a vLLM-shaped one)
    req_ids: tuple[str, ...]  # the engine's batch_idx -> req_id
    arrays: dict[str, np.ndarray]  # the engine's fields, as NumPy
    sampled: dict[str, int]  # req_id -> sampled token (filled by record_sampled)


class ShadowChecker:
    def __init__(self, config: WorkerConfig, repro_dir: str | Path | None = None, write_repro: bool = True) -> None:
        self.config = config
        self.pool = spec.RequestStatePool(config)
        self.steps: list[ShadowStep] = []
        self.repro_dir = Path(repro_dir) if repro_dir is not None else Path(tempfile.gettempdir()) / "slotmap-shadow"
        self.write_repro = write_repro
        self._batch: BatchInputs | None = None

    @property
    def step_index(self) -> int:
        return len(self.steps)

    def check(self, sched: object, arrays: Mapping[str, Any], req_ids: Sequence[str]) -> None:
        """Run spec on `sched` and compare the engine's arrays with it, request by request."""
        if self._batch is not None:
            raise RuntimeError("record_sampled() the previous step before checking the next one")
        if not isinstance(sched, SchedulerOutput):
            known = {row.req_id: row.token_ids for row in self.pool.snapshot()}
            sched = from_vllm(sched, known_token_ids=known)
        numpy_arrays = {name: _to_numpy(value) for name, value in arrays.items()}
        for name in numpy_arrays:
            if name not in (*TOKEN_FIELDS, *REQUEST_FIELDS, "query_start_loc") and not _GROUPED.match(name):
                raise ValueError(f"arrays: unknown field {name!r} (see conformance.shadow's docstring)")
        step = ShadowStep(sched, tuple(req_ids), numpy_arrays, {})
        self.pool.apply(sched)  # a ScheduleError here is the scheduler's fault, not the model runner's
        self.steps.append(step)
        self._batch = self.pool.prepare(sched)
        problem = _first_difference(self._batch, self.pool.snapshot(), step, len(self.config.kv_groups))
        if problem is not None:
            req_id, field, detail = problem
            path = self._write_reproduction() if self.write_repro else None
            raise ShadowMismatchError(len(self.steps) - 1, req_id, field, detail, path)

    def record_sampled(self, sampled: Mapping[str, int]) -> None:
        """The engine's sampled tokens (req_id -> token); every request that reached its last token needs one."""
        batch = self._batch
        if batch is None:
            raise RuntimeError("check() a step before recording its samples")
        held = {row.req_id: len(row.token_ids) for row in self.pool.snapshot()}
        tokens = []
        for req_id, seq_len in zip(batch.req_ids, np.asarray(batch.seq_lens).tolist(), strict=True):
            if seq_len == held[req_id] and req_id not in sampled:
                raise ValueError(f"sampled: request {req_id!r} reached its last token but has no sampled token")
            tokens.append(int(sampled.get(req_id, 0)))  # rows mid-prefill discard theirs
        self.pool.record_sampled(batch, np.array(tokens, np.int64))
        self.steps[-1].sampled.update({r: int(t) for r, t in sampled.items()})
        self._batch = None

    def _write_reproduction(self) -> Path:
        self.repro_dir.mkdir(parents=True, exist_ok=True)
        path = self.repro_dir / f"shadow_repro_step{len(self.steps) - 1}.py"
        path.write_text(reproduction(self.config, self.steps))
        return path


def replay(config: WorkerConfig, steps: Sequence[ShadowStep]) -> None:
    """Feed recorded steps to a fresh checker (no new script written); raises at the first divergence."""
    checker = ShadowChecker(config, write_repro=False)
    for step in steps:
        checker.check(step.sched, step.arrays, step.req_ids)
        checker.record_sampled(step.sampled)


def reproduction(config: WorkerConfig, steps: Sequence[ShadowStep]) -> str:
    def arrays(a: dict[str, np.ndarray]) -> str:
        return "{" + ", ".join(f"{k!r}: np.array({v.tolist()!r}, {str(v.dtype)!r})" for k, v in a.items()) + "}"

    lines = [
        '"""Written by conformance.shadow: replays an engine\'s steps through spec; the last one diverges."""',
        "import numpy as np",
        "",
        "from conformance.shadow import ShadowStep, replay",
        "from spec.types import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig",
        "",
        f"config = {config!r}",
        "steps = [",
        *(f"    ShadowStep({s.sched!r}, {s.req_ids!r}, {arrays(s.arrays)}, {s.sampled!r})," for s in steps),
        "]",
        "replay(config, steps)",
        "",
    ]
    return "\n".join(lines)


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch, any device: the checker is a debugging tool, a copy per step is its cost
        return x.detach().cpu().numpy()
    return np.array(x)  # a copy: the engine may reuse its buffers


def _first_difference(
    batch: BatchInputs, snapshot: spec.PoolSnapshot, step: ShadowStep, num_groups: int
) -> tuple[str | None, str, str] | None:
    """(req_id, field, detail) of the first divergence, requests in spec's batch order; None if none."""
    a = step.arrays
    scheduled = list(batch.req_ids)
    if sorted(step.req_ids) != sorted(scheduled):
        missing, extra = set(scheduled) - set(step.req_ids), set(step.req_ids) - set(scheduled)
        req = sorted(missing or extra)[0] if missing or extra else None
        return req, "req_ids", f"engine batch {list(step.req_ids)}, scheduled {sorted(scheduled)}"
    engine_idx = {r: e for e, r in enumerate(step.req_ids)}  # req_id -> the engine's batch_idx
    qsl, num_scheduled = np.asarray(batch.query_start_loc), np.asarray(batch.num_scheduled_tokens)
    if "query_start_loc" in a:
        engine_qsl = a["query_start_loc"].astype(np.int64)
        if engine_qsl.shape[0] < len(step.req_ids) + 1:
            return None, "query_start_loc", f"{engine_qsl.shape[0]} entries for {len(step.req_ids)} requests"
    else:  # no offsets given: the engine's tokens lie end to end in its own order
        counts = [int(num_scheduled[scheduled.index(r)]) for r in step.req_ids]
        engine_qsl = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    by_group = {(m.group(1), int(m.group(2) or 0)): name for name in a if (m := _GROUPED.match(name))}
    for (_kind, g), name in by_group.items():
        if g >= num_groups:
            return None, name, f"group {g}, the config has {num_groups}"
    blocks_held = {row.req_id: [len(t) for t in row.block_ids] for row in snapshot}

    for b, req_id in enumerate(scheduled):
        e = engine_idx[req_id]
        start, n = int(qsl[b]), int(num_scheduled[b])
        e_start, e_n = int(engine_qsl[e]), int(engine_qsl[e + 1] - engine_qsl[e])
        if e_n != n:
            return req_id, "query_start_loc", f"{e_n} tokens at engine batch index {e}, spec schedules {n}"
        mine = {
            "num_scheduled_tokens": n,
            "seq_lens": int(np.asarray(batch.seq_lens)[b]),
            "logits_indices": int(np.asarray(batch.logits_indices)[b]) - start,  # relative to its first token
        }
        for name in REQUEST_FIELDS:
            if name in a:
                got = int(a[name][e]) - (e_start if name == "logits_indices" else 0)
                if got != mine[name]:
                    what = " (relative to the request's first token)" if name == "logits_indices" else ""
                    return req_id, name, f"{got}{what}, spec {mine[name]}"
        token_fields = [(name, np.asarray(getattr(batch, name))) for name in TOKEN_FIELDS if name in a]
        token_fields += [
            (name, np.asarray(batch.slot_mappings[g])) for (kind, g), name in by_group.items() if kind == "slot_mapping"
        ]
        for name, want in token_fields:
            got_tokens = a[name][e_start : e_start + n].astype(np.int64)
            want_tokens = want[start : start + n].astype(np.int64)
            if not np.array_equal(got_tokens, want_tokens):
                t = int(np.flatnonzero(got_tokens != want_tokens)[0]) if got_tokens.shape == want_tokens.shape else 0
                return req_id, name, f"its token {t}: {got_tokens.tolist()}, spec {want_tokens.tolist()}"
        for (kind, g), name in by_group.items():
            if kind != "block_table":
                continue
            k = blocks_held[req_id][g]
            row = a[name][e] if a[name].ndim == 2 and a[name].shape[0] > e else np.zeros(0)
            got_row, want_row = row[:k].astype(np.int64), np.asarray(batch.block_tables[g])[b, :k].astype(np.int64)
            if not np.array_equal(got_row, want_row):
                return req_id, name, f"first {k} entries {got_row.tolist()}, spec {want_row.tolist()}"

    for (kind, _g), name in by_group.items():
        padding = a[name][batch.num_tokens :] if kind == "slot_mapping" else np.zeros(0)
        if np.any(padding != PAD_SLOT_ID):
            where = batch.num_tokens + int(np.flatnonzero(padding != PAD_SLOT_ID)[0])
            return None, name, f"padding token {where} has slot {int(a[name][where])}, not PAD_SLOT_ID"
    return None
