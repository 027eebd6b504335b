"""What the differential suite's parts share without importing its driver: the counters, the mismatch error, the
fp8 keywords of a scenario, and the view of a Pair its per-step comparers read (conformance/mla_compare.py,
sparse_compare.py, padded_steps.py). conformance/differential.py imports them; they never import it."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from conformance.scenario import AttentionSpec
from spec.types import PoolSnapshot, WorkerConfig

COUNTS: collections.Counter[str] = collections.Counter()  # steps, requests, invalid; also per candidate


class MismatchError(AssertionError):
    def __init__(self, message: str, repro: str = "") -> None:
        super().__init__(message + (f"\n\nreproduction:\n{repro}" if repro else ""))
        self.message = message
        self.repro = repro


def fp8_arguments(att: AttentionSpec, asarray: Callable[[np.ndarray], Any]) -> dict[str, Any]:
    """write_kv's and paged_attention's fp8 keywords for a scenario ({} for an "auto" cache): a per-tensor
    scale as a number, per-KV-head scales as a float32 array of the backend."""
    if att.kv_cache_dtype == "auto":
        return {}

    def scale(values: tuple[float, ...]) -> Any:
        return values[0] if len(values) == 1 else asarray(np.array(values, np.float32))

    return {"kv_cache_dtype": att.kv_cache_dtype, "k_scale": scale(att.k_scale), "v_scale": scale(att.v_scale)}


class PairView(Protocol):
    """What the per-step comparers read of conformance.differential.Pair: its two sides (each a backend `handle`,
    its `pool`, attention `caches` and mla `latents`), the config and attention scenario, and the random streams."""

    ref: Any
    cand: Any
    config: WorkerConfig
    attention: AttentionSpec | None
    kv_rng: np.random.Generator
    sparse_rng: np.random.Generator

    def compare_snapshots(self, when: str, expected: PoolSnapshot | None = None) -> None: ...

    def write_random_kv(
        self,
        g: int,
        num_kv: int,
        num_queries: int,
        ref_slots: np.ndarray,
        cand_slots: Any,
        what: str,
        fp8: dict[str, Any],
        cand_fp8: dict[str, Any],
    ) -> np.ndarray: ...
