"""The apply and prepare kernels past one tile, through Triton's interpreter, against spec exactly.

Every loop of both kernels runs at least two full tiles plus a ragged tail, the sizes derived from the
kernels' own tile constants (so a smaller tile cannot silently shrink the coverage, and a larger one grows
the case with it):

- apply_writes: a prompt copy of 2 * BLOCK + ragged tokens, a table range of as many block ids (block size 1),
  and the num_computed scatter over more than 2 * BLOCK rows (its programs are tiled over the grid);
- prepare: one request's tokens over 2 * BLOCK_TOKENS + ragged, the gathered table width over
  2 * BLOCK_COLS + ragged columns, and a padding tail of 2 * BLOCK_TOKENS + ragged tokens;
- the batch holds 16+ requests tied on num_scheduled_tokens, listed out of id order, so an unstable or
  id-based batch sort would reorder them.

A planted bug (a kernel loop that stops after its first tile) fails these tests; see the closing note of
the commit that added them. Small head dims are irrelevant here (no attention); the requests are long.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import BackendHandle, load_backend
from fast.kernels.apply_writes import BLOCK as APPLY_BLOCK
from fast.kernels.prepare import BLOCK_COLS, BLOCK_TOKENS
from fast.runtime import HAVE_TRITON
from shadow.compare import batch_differences, copy_batch
from spec.types import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed on this platform"),
]

RAGGED = 37  # a tail that fills no tile of any kernel here
LONG_PROMPT = 2 * max(APPLY_BLOCK, BLOCK_TOKENS) + RAGGED  # tokens of the long request: prompt copy, its tokens
NUM_SHORT = 2 * APPLY_BLOCK + RAGGED  # short requests: the computed scatter's rows cross 2 tiles + a tail
SHORT_PROMPT = 3  # every short request schedules this many tokens in step 1: all tied
MAX_MODEL_LEN = LONG_PROMPT + 2 * BLOCK_COLS  # block size 1: the table is this wide
PAD = 2 * BLOCK_TOKENS + RAGGED
GROUPS = (KVCacheGroup(1, 4 * (LONG_PROMPT + NUM_SHORT * 8)), KVCacheGroup(3, 2 * (LONG_PROMPT + NUM_SHORT * 8)))


def _crosses(size: int, tile: int) -> bool:
    """At least two full tiles and a ragged tail."""
    return size >= 2 * tile and size % tile != 0


def test_case_crosses_every_tile() -> None:
    assert _crosses(LONG_PROMPT, APPLY_BLOCK), "apply: prompt copy and table range (block size 1)"
    assert _crosses(NUM_SHORT + 1, APPLY_BLOCK), "apply: num_computed scatter over the batch's rows"
    assert _crosses(LONG_PROMPT, BLOCK_TOKENS), "prepare: one request's tokens"
    assert _crosses(MAX_MODEL_LEN // GROUPS[0].block_size, BLOCK_COLS), "prepare: gathered table columns"
    assert _crosses(PAD, BLOCK_TOKENS), "prepare: padding tail"
    assert NUM_SHORT >= 16


class _Blocks:
    """Disjoint block ids per group, handed out in order (the kernels do not care where they lie)."""

    def __init__(self) -> None:
        self.next = [1] * len(GROUPS)

    def take(self, tokens_before: int, tokens_after: int) -> tuple[tuple[int, ...], ...]:
        out = []
        for g, group in enumerate(GROUPS):
            n = -(-tokens_after // group.block_size) - -(-tokens_before // group.block_size)
            out.append(tuple(range(self.next[g], self.next[g] + n)))
            self.next[g] += n
        return tuple(out)


def _steps() -> list[SchedulerOutput]:
    rng = np.random.default_rng(0)
    blocks = _Blocks()
    ids = [f"s{i:04d}" for i in rng.permutation(NUM_SHORT)]  # scheduler order is not id order
    long_prompt = tuple(int(t) for t in rng.integers(0, 1000, LONG_PROMPT))
    new = [NewRequest("long", long_prompt, blocks.take(0, LONG_PROMPT))]
    lengths = {"long": LONG_PROMPT}
    for req_id in ids:
        prompt = tuple(int(t) for t in rng.integers(0, 1000, SHORT_PROMPT + 2))  # 2 tokens left for step 2
        new.append(NewRequest(req_id, prompt, blocks.take(0, SHORT_PROMPT)))
        lengths[req_id] = SHORT_PROMPT
    # the long request in the middle of the list: it sorts last, the tied short ones keep their order around it
    new.insert(len(new) // 2, new.pop(0))
    # num_scheduled_tokens in the same order (the scheduler's): not sorted, so the batch order must sort it
    first = SchedulerOutput(new_requests=tuple(new), num_scheduled_tokens={r.req_id: lengths[r.req_id] for r in new})
    # step 2: every request decodes one token (all tied), the long one's table grows past its prompt
    cached = tuple(
        CachedRequest(r.req_id, lengths[r.req_id], blocks.take(lengths[r.req_id], lengths[r.req_id] + 1)) for r in new
    )
    second = SchedulerOutput(cached_requests=cached, num_scheduled_tokens={r.req_id: 1 for r in new})
    return [first, second]


def _run(handle: BackendHandle) -> list[dict]:
    config = WorkerConfig(NUM_SHORT + 1, MAX_MODEL_LEN, LONG_PROMPT + NUM_SHORT * SHORT_PROMPT, 1000, GROUPS)
    pool = handle.make_pool(config)
    batches = []
    for step in _steps():
        pool.apply(step)
        batch = pool.prepare(step, pad_to=sum(step.num_scheduled_tokens.values()) + PAD)
        batches.append(copy_batch(handle.batch_to_numpy(batch)))  # a later prepare may reuse the buffers
        sampled = np.arange(len(batch.req_ids), dtype=np.int64) % 1000
        pool.record_sampled(batch, handle.asarray(sampled))
    snapshot = pool.snapshot()
    batches.append({"snapshot": snapshot})
    return batches


def test_long_requests_and_tied_batches_match_spec() -> None:
    want, got = _run(load_backend("spec")), _run(load_backend("fast-interpret"))
    for step, (w, g) in enumerate(zip(want[:-1], got[:-1], strict=True)):
        problems = batch_differences(w, g)
        assert not problems, f"step {step}: " + "\n".join(problems)
    assert got[-1]["snapshot"] == want[-1]["snapshot"]
