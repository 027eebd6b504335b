"""How each step is prepared beyond what its scheduler output says: captured graphs, data-parallel peers, DBO.

None of these changes what is scheduled; they change what `prepare` is asked for and what is done with its batch:

- a graph step is prepared with `graphs=` (spec/graphs.py, spec/padding.py) in place of the padding bucket;
- a DP step has a peer rank with more tokens: a step with tokens is padded to the peer's count
  (`prepare(sched, pad_to=peer)`), a step with none runs a dummy batch of the peer's count (spec/dummy.py),
  sometimes dispatched to the captured graphs;
- a DBO step's batch is split in two micro-batches (spec/ubatch.py), at the default point and at a drawn one.

The draws come from their own random source (`StepShaper`), so a seed schedules what it scheduled before.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from conformance.scheduler.knobs import SchedulerKnobs
from spec.graphs import GRAPH_MODES, CapturedGraphs
from spec.padding_profiles import PROFILES
from spec.types import SchedulerOutput, WorkerConfig

GRAPHS_SHARE = 0.3  # of the scenarios, the share that capture graphs
DP_SHARE = 0.25  # ... that have a data-parallel peer
DBO_SHARE = 0.25  # ... that split some batches in two
STEP_CHANCES = (0.3, 0.6)  # the chance per step, in a scenario that has the feature
MAX_PEER_EXTRA = 16  # a peer runs 1 .. this many tokens more than this rank


@dataclass(frozen=True)
class StepShape:
    """What one step's prepare is asked for, and what is done with its batch."""

    pad_to: int | None  # the padding bucket, or a DP peer's larger count
    graphs: CapturedGraphs | None  # prepare(graphs=...) instead of pad_to
    dummy: tuple[int, CapturedGraphs | None] | None  # a step with no token: the peer's count, and its graphs
    split: bool  # split the batch in two micro-batches
    split_draw: float  # [0, 1): where the drawn split point lies in [1, num_tokens_padded - 1]

    def split_points(self, num_reqs: int, num_tokens_padded: int) -> tuple[int | None, ...]:
        """The default split (None) and the drawn one; () where a batch cannot be split (no request, one token)."""
        if not self.split or num_reqs == 0 or num_tokens_padded < 2:
            return ()
        return None, 1 + int(self.split_draw * (num_tokens_padded - 1))


class StepShaper:
    """Draws each step's StepShape from the knobs, with its own random source."""

    def __init__(self, knobs: SchedulerKnobs, seed: int) -> None:
        self.knobs = knobs
        self.rng = random.Random(f"step shapes {seed}")

    def shape(self, out: SchedulerOutput, bucket: int | None) -> StepShape:
        """`bucket`: the scheduler's pad_to for the step (pad_buckets), kept unless a draw replaces it."""
        knobs, rng, total = self.knobs, self.rng, out.total_num_scheduled_tokens
        graph_step, peer, split, split_draw = rng.random(), rng.random(), rng.random(), rng.random()
        pad_to, graphs, dummy = bucket, None, None
        if knobs.graphs is not None and graph_step < knobs.graph_steps:
            pad_to, graphs = None, knobs.graphs
        elif peer < knobs.dp_peer_steps:
            extra = rng.randint(1, MAX_PEER_EXTRA)
            if total:
                pad_to = max(bucket or total, total + extra)
            else:  # this rank has nothing: it runs the peer's count, on the peer's graph where one was captured
                dummy = (extra, knobs.graphs if rng.random() < 0.5 else None)
        return StepShape(pad_to, graphs, dummy, total > 0 and split < knobs.ubatch_steps, split_draw)


def draw_graphs(config: WorkerConfig, knobs: SchedulerKnobs, rng: random.Random) -> CapturedGraphs:
    """Captured graphs for a scenario: sizes around its decode steps (rows of 1 + K tokens, K = its drafts), often
    a multiple of 1 + K, sometimes the step budget; a mode, a FULL graph's request rows, a padding profile."""
    uq = 1 + knobs.spec_tokens
    sizes = {rng.randint(1, 2 * uq * config.max_num_reqs) for _ in range(rng.randint(1, 4))}
    if rng.random() < 0.7:
        sizes.add(uq * rng.randint(1, config.max_num_reqs))
    if rng.random() < 0.5:
        sizes.add(config.max_num_batched_tokens)
    return CapturedGraphs(
        tuple(sorted(sizes)),
        max_num_reqs=rng.randint(1, config.max_num_reqs),
        mode=rng.choice(GRAPH_MODES[1:] * 3 + GRAPH_MODES[:1]),  # NONE now and then: it dispatches nothing
        uniform_decode_query_len=uq,
        profile=rng.choice(sorted(PROFILES.values(), key=lambda p: p.name)),
    )


def with_step_shapes_draw(knobs: SchedulerKnobs, config: WorkerConfig, rng: random.Random) -> SchedulerKnobs:
    """knobs with graphs, a DP peer and DBO each drawn on a share of the scenarios (after the drafts: 1 + K)."""
    graphs = draw_graphs(config, knobs, rng) if rng.random() < GRAPHS_SHARE else None
    return replace(
        knobs,
        graphs=graphs,
        graph_steps=rng.choice(STEP_CHANCES) if graphs is not None else 0.0,
        dp_peer_steps=rng.choice(STEP_CHANCES) if rng.random() < DP_SHARE else 0.0,
        ubatch_steps=rng.choice(STEP_CHANCES) if rng.random() < DBO_SHARE else 0.0,
    )
