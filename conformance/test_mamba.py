"""Mamba state groups (spec/mamba.py) on the backend under test.

A worked hybrid run whose state indices are written out by hand from the rule; every refusal of the rule
with nothing changed; hybrid scenarios (align mode with prefix caching, drafts, preemption) through the
differential machinery; and the seeded hybrid runs exercising what the rule distinguishes.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np
import pytest

import spec
from conformance.backends import BackendHandle
from conformance.differential import DifferentialRun, drive
from conformance.scenario import random_scenario
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, make_workload
from shadow.compare import batch_differences
from spec.drafts import pad_accepted
from spec.errors import (
    BlockIdError,
    BlockTableOverflowError,
    DuplicateSlotError,
    MissingBlockError,
    NullBlockError,
    ScheduleError,
)
from spec.protocol import StatePool
from spec.types import NULL_BLOCK_ID, CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

# an attention group of 4-token blocks and a mamba group of 8-token state blocks with 2 speculative blocks
CONFIG = WorkerConfig(
    4, 64, 64, 100, (KVCacheGroup(4, 64), KVCacheGroup(8, 32, kind="mamba", num_speculative_blocks=2))
)
PROMPT = tuple(range(1, 11))


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


def _step(pool: StatePool, handle: BackendHandle, out: SchedulerOutput, sampled: list[Any]) -> dict[str, Any]:
    pool.apply(out)
    batch = pool.prepare(out, pad_to=24)
    got = handle.batch_to_numpy(batch)
    pool.record_sampled(batch, handle.asarray(np.array(sampled)))
    return got


def _worked_run() -> list[tuple[SchedulerOutput, list[Any]]]:
    """A prefills 10 tokens; then A verifies 2 drafts beside a new B; then A (one draft kept) decodes beside
    C, a prefix hit of 8 tokens whose state is cached in A's first state block (5)."""
    first = SchedulerOutput(
        new_requests=(NewRequest("A", PROMPT, ((1, 2, 3), (5, 6, 7))),), num_scheduled_tokens={"A": 10}
    )
    second = SchedulerOutput(
        new_requests=(NewRequest("B", (7, 7, 7, 7, 7), ((20, 21), (9,))),),
        cached_requests=(CachedRequest("A", 10, ((4,), (8,))),),
        num_scheduled_tokens={"B": 5, "A": 3},
        scheduled_spec_decode_tokens={"A": (40, 41)},
    )
    third = SchedulerOutput(
        new_requests=(NewRequest("C", PROMPT, ((1, 2, 30), (5, 13, 14, 15)), 8),),
        cached_requests=(CachedRequest("A", 12, ((), ())), CachedRequest("B", 5, ((), ()))),
        num_scheduled_tokens={"A": 1, "B": 1, "C": 2},
    )
    return [(first, [50]), (second, [[40, 60, -1], [50, -1, -1]]), (third, [1, 2, 3])]  # A keeps draft 40


def test_state_indices_follow_the_rule(backend: BackendHandle) -> None:
    pool, ref = backend.make_pool(CONFIG), spec.RequestStatePool(CONFIG)
    ref_handle = BackendHandle("spec", spec)
    expected = [
        # (req_ids, written [num_reqs, 3], read [num_reqs], is_prefilling, num_accepted_tokens)
        (("A",), [[6, -1, -1]], [-1], [True], [1]),  # w = 9 // 8 = 1; no prior state
        # B (5 tokens) sorts after A (3): A writes entries 1..3 (its 2 drafts' states), reads entry 9 // 8 = 1
        (("A", "B"), [[6, 7, 8], [9, -1, -1]], [6, -1], [False, True], [1, 1]),
        # A kept one draft: a = 12 - (13 - 1 - 2) = 2, so it reads entry 1 + 2 - 1 = 2 (block 7), writes 12 // 8
        (("A", "B", "C"), [[6, -1, -1], [9, -1, -1], [13, -1, -1]], [7, 9, 5], [False, False, True], [2, 1, 1]),
    ]
    for (out, sampled), (req_ids, written, read, prefilling, accepted) in zip(_worked_run(), expected, strict=True):
        got = _step(pool, backend, out, sampled)
        want = _step(ref, ref_handle, out, sampled)
        assert got["req_ids"] == req_ids
        assert got["mamba_state_indices"][0] is None and got["mamba_prev_state_indices"][0] is None
        assert got["mamba_state_indices"][1].tolist() == written
        assert got["mamba_state_indices"][1].dtype == np.int32
        assert got["mamba_prev_state_indices"][1].tolist() == read
        assert got["is_prefilling"].tolist() == prefilling
        assert got["num_accepted_tokens"].tolist() == accepted
        assert (got["slot_mappings"][1] == -1).all()  # no token writes KV to a mamba group
        assert batch_differences(want, got) == []


def test_a_model_without_mamba_group_has_no_state_fields(backend: BackendHandle) -> None:
    config = WorkerConfig(2, 32, 32, 100, (KVCacheGroup(4, 16),))
    got = _step(backend.make_pool(config), backend, SchedulerOutput(
        new_requests=(NewRequest("A", (1, 2, 3), ((1,),)),), num_scheduled_tokens={"A": 3}), [5])  # fmt: skip
    assert [got[f] for f in ("mamba_state_indices", "mamba_prev_state_indices", "is_prefilling")] == [None] * 3
    assert got["num_accepted_tokens"] is None


def test_speculative_blocks_are_part_of_the_table_width() -> None:
    assert CONFIG.max_blocks_per_req(0) == 16 and CONFIG.max_blocks_per_req(1) == 8 + 2  # vllm-ascend PR #11466
    with pytest.raises(ValueError, match="num_speculative_blocks"):
        KVCacheGroup(4, 16, num_speculative_blocks=1)  # an attention group keeps none
    with pytest.raises(ValueError, match="num_speculative_blocks"):
        KVCacheGroup(4, 16, kind="mamba", num_speculative_blocks=-1)


def test_context_parallelism_does_not_shard_a_mamba_group() -> None:
    """The CP transform splits a group's KV by position; a mamba group's states are per request: replicated."""
    from spec.context_parallel import ContextParallel

    with pytest.raises(ValueError, match="holds Mamba states"):
        ContextParallel(2, 0, sharded_groups=(1,)).check_config(CONFIG)
    ContextParallel(2, 0, sharded_groups=(0,)).check_config(CONFIG)  # the attention group may be


def test_attention_layouts_of_a_mamba_group_are_refused() -> None:
    """vLLM's flash-attention metadata and SGLang's req_to_token describe KV per token: not a mamba group's."""
    import fast.interop
    import spec.interop

    pool = spec.RequestStatePool(CONFIG)
    out, _ = _worked_run()[0]
    pool.apply(out)
    batch = pool.prepare(out)
    for interop in (spec.interop, fast.interop):
        for layout in (interop.flash_attn_metadata, interop.sglang_layout):
            with pytest.raises(ValueError, match="holds Mamba states"):
                layout(batch, CONFIG, 1)
    assert spec.interop.flash_attn_metadata(batch, CONFIG, 0).slot_mapping.tolist() == list(range(4, 14))


def _after_two_steps(handle: BackendHandle) -> StatePool:
    pool = handle.make_pool(CONFIG)
    for out, sampled in _worked_run()[:2]:
        _step(pool, handle, out, sampled)
    return pool


def _new(req_id: str, mamba: tuple[int, ...], computed: int = 0, n: int = 2) -> SchedulerOutput:
    return SchedulerOutput(
        new_requests=(NewRequest(req_id, PROMPT, ((30, 31, 32), mamba), computed),), num_scheduled_tokens={req_id: n}
    )


FAULTS: dict[str, tuple[type[ScheduleError], str, SchedulerOutput]] = {
    "the null block as the state written": (NullBlockError, "written", _new("X", (NULL_BLOCK_ID,))),
    "the null block as the cached state read": (NullBlockError, "read", _new("X", (NULL_BLOCK_ID, 13), 8)),
    "a prefix hit inside a state block": (MissingBlockError, "no state to start from", _new("X", (13, 14), 4)),
    "a state block twice in one table": (BlockIdError, "appears twice", _new("X", (13, 13), 8)),
    "a continuing request moved back past its kept states": (MissingBlockError, "no state to start from",
        SchedulerOutput(cached_requests=(CachedRequest("A", 9, ((), ())),), num_scheduled_tokens={"A": 1})),
    "more drafts than speculative blocks": (BlockTableOverflowError, "speculative blocks",
        SchedulerOutput(cached_requests=(CachedRequest("A", 12, ((), (16,))),), num_scheduled_tokens={"A": 4},
                        scheduled_spec_decode_tokens={"A": (1, 2, 3)})),
    "a table without the speculative blocks": (MissingBlockError, "the state needs entry",
        SchedulerOutput(new_requests=(NewRequest("X", PROMPT, ((30, 31, 32), (13, 14, 15))),),
                        num_scheduled_tokens={"X": 12}, scheduled_spec_decode_tokens={"X": (1, 2)})),
    "two requests writing one state block": (DuplicateSlotError, "also written",
        SchedulerOutput(new_requests=(NewRequest("X", PROMPT, ((30,), (13,))), NewRequest("Y", PROMPT, ((31,), (13,)))),
                        num_scheduled_tokens={"X": 2, "Y": 2})),
    # A writes state blocks 6 and 7 (columns 1 and 2: its state and its draft's), B 9 and, for its draft, 7: no
    # token position of either lies in block 7, so only the speculative states collide
    "two drafting requests writing one speculative state block": (DuplicateSlotError, "also written",
        SchedulerOutput(cached_requests=(CachedRequest("A", 12, ((), ())), CachedRequest("B", 5, ((), (7,)))),
                        num_scheduled_tokens={"A": 2, "B": 2}, scheduled_spec_decode_tokens={"A": (1,), "B": (2,)})),
}  # fmt: skip


@pytest.mark.parametrize("name", FAULTS)
def test_bad_mamba_inputs_are_refused_and_change_nothing(backend: BackendHandle, name: str) -> None:
    cls, words, out = FAULTS[name]
    pool = _after_two_steps(backend)
    before = pool.snapshot()
    with pytest.raises(cls, match=words) as caught:
        pool.apply(out)
    assert type(caught.value) is cls
    assert pool.snapshot() == before
    with pytest.raises(cls):  # spec refuses it the same way
        _after_two_steps(BackendHandle("spec", spec)).apply(out)


def _prefix_caching_scenario(spec_tokens: int = 0) -> object:
    """Requests sharing a 24-token prefix on a hybrid model in align mode (mamba blocks of 8 tokens)."""
    config = WorkerConfig(
        3, 48, 40, 200, (KVCacheGroup(4, 80), KVCacheGroup(8, 40, kind="mamba", num_speculative_blocks=spec_tokens))
    )
    workload = make_workload(3, config, num_requests=6, max_arrival_step=8, num_prefixes=1, max_new_tokens=6)
    knobs = SchedulerKnobs(enable_prefix_caching=True, spec_tokens=spec_tokens, max_chunk=12)
    return dataclasses.replace(random_scenario(0), config=config, workload=workload, knobs=knobs, attention=None)


def test_a_hybrid_prefix_hit_reads_the_state_cached_at_its_block_end(backend: BackendHandle) -> None:
    scenario = _prefix_caching_scenario()
    run = DifferentialRun(scenario, backend)  # type: ignore[arg-type]
    drive(run, 60 if backend.slow else 400)
    assert run.sched.stats.prefix_hit_tokens > 0, "the scenario must reuse cached mamba states"


def test_hybrid_scenarios_agree_with_spec(backend: BackendHandle) -> None:
    seeds = [s for s in range(40) if _is_hybrid(random_scenario(s, spec_decode=True, hybrid=True))]
    for seed in seeds[: 2 if backend.slow else 8]:
        run = DifferentialRun(random_scenario(seed, spec_decode=True, hybrid=True), backend)
        drive(run, 10 if backend.slow else 200)


def _is_hybrid(scenario: object) -> bool:
    return any(g.kind == "mamba" for g in scenario.config.kv_groups)  # type: ignore[attr-defined]


def test_seeded_hybrid_runs_exercise_what_the_rule_distinguishes() -> None:
    seen: collections.Counter[str] = collections.Counter()
    for seed in range(50):  # resumptions are rare: a hybrid seed's pool is roomy, or shared (one block pool); 49 has
        scenario = random_scenario(seed, spec_decode=True, hybrid=True)
        if not _is_hybrid(scenario):
            continue
        sched = ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, seed=scenario.seed)
        pool = spec.RequestStatePool(scenario.config)
        g = next(i for i, group in enumerate(scenario.config.kv_groups) if group.kind == "mamba")
        one_block = scenario.config.kv_groups[g].block_size >= scenario.config.max_model_len
        seen["one state block per request" if one_block else "align mode"] += 1
        rng = np.random.default_rng(seed)
        while not sched.done():
            out = sched.schedule()
            pool.apply(out)
            batch = pool.prepare(out)
            written, read = batch.mamba_state_indices[g], batch.mamba_prev_state_indices[g]
            seen["a row without prior state"] += int((read == -1).sum())
            seen["a row reading its state where it writes"] += int(((read == written[:, 0]) & (read >= 0)).sum())
            seen["a row moving its state to the next block"] += int(((read != written[:, 0]) & (read >= 0)).sum())
            seen["a speculative state written"] += int((written[:, 1:] >= 0).sum())
            if batch.num_accepted_tokens is not None:
                seen["a state read after an accepted draft"] += int((batch.num_accepted_tokens > 1).sum())
            seen["a resumed request"] += sum(c.resumed for c in out.cached_requests)
            takes = sched.sampling_req_ids(out)
            kept = sched.rejection_step(out, {r: int(rng.integers(scenario.config.vocab_size)) for r in takes})
            pool.record_sampled(batch, pad_accepted([list(kept.get(r, (0,))) for r in batch.req_ids]))
            sched.update(out, kept)
    missing = [f for f in ("one state block per request", "align mode", "a row without prior state",
                           "a row reading its state where it writes", "a row moving its state to the next block",
                           "a speculative state written", "a state read after an accepted draft", "a resumed request")
               if not seen[f]]  # fmt: skip
    assert not missing, f"no seeded hybrid run has: {missing} ({dict(seen)})"
