"""The differential run's checks of a step beyond its batch: a DP rank's dummy batch, the DBO split, and misuse.

conformance/differential.py's Pair calls these on the steps conformance/scheduler/step_shapes.py shapes:

- `compare_dummy`: both backends' dummy batch of a peer's count (spec/dummy.py) agree field by field, and writing
  random keys through its slot mappings changes no byte of either KV cache (a dummy step writes nothing).
- `compare_splits`: both backends split their batches at the same points (spec/ubatch.py; the candidate from the
  host's query lengths, as an engine splits without reading the device); every field of every micro-batch agrees,
  or both refuse with the same argument (a record that cannot be split).
- `probe_misuse` (the invalid suite): malformed capture sizes, pad_to with graphs and a split past the batch are
  refused by both with the same error, and the pool and the batch are left as they were.

A candidate without `dummy_batch` or `split_batch` (an optional part of a backend, conformance/backends.py) has
only spec's dummy batch checked, and no split compared.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from conformance.backends import BackendHandle, dummy_batch_of, split_batch_of
from conformance.mismatch import MismatchError, fp8_arguments
from conformance.mismatch import PairView as Pair
from shadow.compare import batch_differences, copy_batch
from spec.dummy import dummy_batch
from spec.errors import ScheduleError
from spec.graphs import CapturedGraphs
from spec.types import BatchInputs, SchedulerOutput
from spec.ubatch import UbatchSplitError, host_query_lens, split_batch

COUNTS: collections.Counter[str] = collections.Counter()  # what the checks ran: for tests that each one ran

BAD_CAPTURE_SIZES = {"unsorted": (8, 4), "non-positive": (0, 4), "duplicated": (4, 4, 8)}


def compare_dummy(pair: Pair, num_tokens: int, graphs: CapturedGraphs | None) -> None:

    ref = dummy_batch(pair.config, num_tokens, graphs)
    make = dummy_batch_of(pair.cand.handle)
    if make is not None:
        cand = make(pair.config, num_tokens, graphs)
        problems = batch_differences(pair.ref.handle.batch_to_numpy(ref), pair.cand.handle.batch_to_numpy(cand))
        if problems:
            raise MismatchError("dummy batch differs:\n  " + "\n  ".join(problems))
    COUNTS["dummy"] += 1
    if pair.attention is None or ref.num_tokens_padded == 0:
        return
    for g, group in enumerate(pair.config.kv_groups):
        if group.kind != "attention":
            continue
        before = [np.array(c) for c in pair.ref.caches[g]]
        slots = ref.slot_mappings[g], pair.cand.handle.asarray(np.asarray(ref.slot_mappings[g]))
        n = ref.num_tokens_padded
        fp8 = fp8_arguments(pair.attention, np.asarray), fp8_arguments(pair.attention, pair.cand.handle.asarray)
        pair.write_random_kv(g, n, n, *slots, f"write_kv[{g}] (dummy batch)", *fp8)
        if any(not np.array_equal(b, c) for b, c in zip(before, pair.ref.caches[g], strict=True)):
            raise MismatchError(f"write_kv[{g}] of a dummy batch changed the KV cache: its slots are not all PAD")


def _split(handle: BackendHandle, split: Callable[..., Any], batch: BatchInputs, point: int | None,
           lens: np.ndarray | None) -> Any:  # fmt: skip
    try:
        return split(batch, point) if lens is None else split(batch, point, query_lens_np=lens)
    except UbatchSplitError as exc:
        return exc
    except Exception as exc:
        raise MismatchError(f"split_batch at {point}: {handle.name} raised {exc!r}, not a UbatchSplitError") from exc


def compare_splits(
    pair: Pair, out: SchedulerOutput, ref_batch: BatchInputs, cand_batch: BatchInputs, points: Sequence[int | None]
) -> None:

    split = split_batch_of(pair.cand.handle)
    if split is None:
        return
    lens = host_query_lens(out, cand_batch)  # [num_reqs] the host's counts, in the candidate's batch order
    for point in points:
        want = _split(pair.ref.handle, split_batch, ref_batch, point, None)
        got = _split(pair.cand.handle, split, cand_batch, point, lens)
        if isinstance(want, UbatchSplitError) or isinstance(got, UbatchSplitError):
            same = isinstance(want, UbatchSplitError) and isinstance(got, UbatchSplitError)
            if not same or want.argument != got.argument:
                raise MismatchError(f"split_batch at {point}: reference {want!r}, candidate {got!r}")
            COUNTS["split refused"] += 1
            continue
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            problems = batch_differences(
                pair.ref.handle.microbatch_to_numpy(w), pair.cand.handle.microbatch_to_numpy(g)
            )
            if problems:
                raise MismatchError(f"micro-batch {i} of the split at {point} differs:\n  " + "\n  ".join(problems))
        COUNTS["split"] += 1


def probe_misuse(
    pair: Pair,
    out: SchedulerOutput,
    graphs: CapturedGraphs | None,
    batches: tuple[BatchInputs, BatchInputs] | None,  # the step's prepared batches (after prepare), or None
    rng: random.Random,
) -> None:
    """Before prepare (batches None): bad capture sizes and pad_to with graphs; after: a split past the batch."""

    sides = (pair.ref, pair.cand)
    if batches is None:
        if graphs is None:
            return
        for what, sizes in BAD_CAPTURE_SIZES.items():
            for side in sides:
                make = getattr(side.handle.module, "CapturedGraphs", None)
                if make is None:
                    continue
                try:
                    make(sizes, max_num_reqs=1)
                except ValueError as exc:
                    if "capture_sizes" not in str(exc):
                        raise MismatchError(f"{what} capture sizes: {side.handle.name} says {exc}") from exc
                else:
                    raise MismatchError(f"{what} capture sizes {sizes}: {side.handle.name} accepted them")
            COUNTS[f"capture sizes {what}"] += 1
        before = pair.ref.pool.snapshot()
        pad_to = out.total_num_scheduled_tokens + rng.randint(0, 4)
        raised: list[type[BaseException] | None] = []
        for side in sides:
            try:
                side.pool.prepare(out, pad_to, graphs=graphs)
                raised.append(None)
            except ScheduleError as exc:
                raised.append(type(exc))
        if raised[0] is None or raised[0] is not raised[1]:
            raise MismatchError(f"prepare with pad_to and graphs: reference raised {raised[0]}, candidate {raised[1]}")
        pair.compare_snapshots("after prepare with pad_to and graphs", expected=before)
        COUNTS["pad_to with graphs"] += 1
        return
    ref_batch, cand_batch = batches
    split = split_batch_of(pair.cand.handle)
    if split is None or ref_batch.num_reqs == 0:
        return
    kept = [copy_batch(side.handle.batch_to_numpy(b)) for side, b in zip(sides, batches, strict=True)]
    point = ref_batch.num_tokens_padded + rng.randint(0, 3)  # the second half would have no token
    lens = host_query_lens(out, cand_batch)
    for side, fn, batch, host in ((pair.ref, split_batch, ref_batch, None),
                                  (pair.cand, split, cand_batch, lens)):  # fmt: skip
        result = _split(side.handle, fn, batch, point, host)
        if not isinstance(result, UbatchSplitError) or result.argument != "split_point":
            raise MismatchError(f"split_batch at {point} past the batch: {side.handle.name} gave {result!r}")
    for side, batch, copy in zip(sides, batches, kept, strict=True):
        if problems := batch_differences(copy, side.handle.batch_to_numpy(batch)):
            raise MismatchError(f"a refused split changed {side.handle.name}'s batch: " + "; ".join(problems))
    COUNTS["split past the batch"] += 1
