"""The scheduler model itself: allocator invariants, no leaks, valid outputs, and every feature exercised.

The spec pool is the judge of validity (it rejects any invalid output); expected values for the
allocator come from the scheduler's own request tables, counted independently of the allocator.
"""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import HealthCheck, given, settings

import spec
from conformance.driving import sampled_array
from conformance.scenario import Scenario, random_scenario
from conformance.scheduler import BlockAllocator, ReferenceScheduler, SchedulerKnobs, Workload, WorkloadRequest
from conformance.scheduler.request import Status
from conformance.strategies import scenarios
from spec.types import NULL_BLOCK_ID, CachedRequest, KVCacheGroup, SchedulerOutput, WorkerConfig


def _run(
    scenario: Scenario, check_each_step: bool = True, max_steps: int = 2000
) -> tuple[ReferenceScheduler, list[SchedulerOutput]]:
    """Drive the scheduler against the spec pool to the end, checking invariants after every step."""
    sched = ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, seed=scenario.seed)
    pool = spec.RequestStatePool(scenario.config)
    rng = random.Random(scenario.seed)
    outs: list[SchedulerOutput] = []
    while not sched.done():
        assert len(outs) < max_steps, "the workload does not drain"
        out = sched.schedule()
        outs.append(out)
        pool.apply(out)  # raises on any invalid output
        batch = pool.prepare(out, sched.pad_to(out))
        takes = sched.sampling_req_ids(out)
        sampled = {r: rng.randrange(scenario.config.vocab_size) for r in batch.req_ids}
        kept = sched.rejection_step(out, {r: t for r, t in sampled.items() if r in takes})
        pool.record_sampled(batch, sampled_array([kept.get(r, t) for r, t in sampled.items()]))
        sched.update(out, kept)
        assert pool.snapshot() == sched.expected_snapshot()
        if check_each_step:
            _check_allocators(sched)
    assert pool.snapshot() == ()
    return sched, outs


def _check_allocators(sched: ReferenceScheduler) -> None:
    for alloc in {id(a): a for a in sched.allocators}.values():  # one allocator for every group with one pool
        groups = [g for g, a in enumerate(sched.allocators) if a is alloc]
        holders: collections.Counter[int] = collections.Counter()
        group_of: dict[int, int] = {}  # block -> the group holding it
        for req in sched.requests.values():
            for g in groups:
                real = [b for b in req.blocks[g] if b != NULL_BLOCK_ID]
                assert len(real) == len(set(real)), f"{req.req_id} holds a block twice"
                holders.update(real)
                for b in real:
                    assert group_of.setdefault(b, g) == g, f"block {b} held in groups {group_of[b]} and {g}"
                if req.status is not Status.RUNNING:
                    assert not real, f"{req.req_id} is {req.status} but holds blocks"
        assert alloc.num_free + alloc.num_used == alloc.num_usable  # free + used = total
        assert dict(holders) == alloc.ref_count  # ref counts match the tables
        for block, n in holders.items():
            assert n == 1 or block in alloc.hash_of, f"block {block} in {n} tables but not a cached prefix block"
            assert 0 < block < alloc.num_blocks


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_allocator_invariants_hold_and_nothing_leaks(scenario: Scenario) -> None:
    sched, _ = _run(scenario)
    for alloc in sched.allocators:
        assert alloc.num_used == 0 and alloc.num_free == alloc.num_usable
    assert all(r.status is Status.FINISHED for r in sched.requests.values())


def test_seeded_runs_exercise_every_feature() -> None:
    seen: collections.Counter[str] = collections.Counter()
    for seed in range(70):  # full prefix hits are rare: the first seeds with one are 65 and 69
        scenario = random_scenario(seed, spec_decode=True, encoder_decoder=True, multimodal=True, async_scheduling=True)
        sched, outs = _run(scenario, check_each_step=False)
        stats = sched.stats
        seen.update(
            preemption=stats.preemptions,
            resumption=stats.resumptions,
            prefix_hit=stats.prefix_hit_tokens,
            full_prefix_hit=stats.full_prefix_hits,
            window_release=stats.window_releases,
            window_reuse=stats.window_reuses,
            null_lookahead=stats.null_lookaheads,
            stop_token=stats.stopped_by_token,
            abort=stats.aborted,
            padded=stats.padded_steps,
            drafts=stats.drafts_scheduled,
            all_drafts_accepted=stats.all_drafts_accepted,
            no_draft_accepted=stats.no_draft_accepted,
            drafts_on_prefill=stats.drafts_on_prefill,
            drafts_crossing_blocks=stats.drafts_crossing_blocks,
            drafts_on_admission=stats.drafts_on_admission,
            drafts_on_retaken_row=stats.drafts_on_retaken_row,
            drafts_to_the_end=stats.drafts_to_the_end,
            optimistic_count=stats.optimistic_counts,  # async scheduling: a step sent counting rejected drafts
            encoder_write=stats.encoder_writes,
            encoder_rewrite=stats.encoder_rewrites,
        )
        multimodal: dict[str, int] = {}  # req_id -> prompt length of the requests with an M-RoPE table
        for out in outs:
            _count_multimodal(seen, multimodal, out)
            tokens = list(out.num_scheduled_tokens.values())
            seen["mixed decode and prefill"] += 1 in tokens and any(n > 1 for n in tokens)
            seen["new request with computed tokens"] += any(r.num_computed_tokens > 0 for r in out.new_requests)
            tables = [*(r.block_ids for r in out.new_requests), *(r.new_block_ids or () for r in out.cached_requests)]
            seen["null block in a table"] += any(NULL_BLOCK_ID in ids for table in tables for ids in table)
            seen["chunked prefill"] += any(
                isinstance(r, CachedRequest) and not r.resumed and out.num_scheduled_tokens[r.req_id] > 1
                for r in out.cached_requests
            )
            seen["finished and new in one step"] += bool(out.finished_req_ids) and bool(out.new_requests)
            drafting = {r for r, d in out.scheduled_spec_decode_tokens.items() if d}
            seen["drafts and plain decodes in one step"] += bool(drafting) and any(
                n == 1 and r not in drafting for r, n in out.num_scheduled_tokens.items()
            )
    missing = [
        f
        for f in (
            "preemption",
            "resumption",
            "prefix_hit",
            "full_prefix_hit",
            "window_release",
            "window_reuse",
            "null_lookahead",
            "stop_token",
            "abort",
            "padded",
            "mixed decode and prefill",
            "new request with computed tokens",
            "null block in a table",
            "chunked prefill",
            "finished and new in one step",
            "drafts",
            "all_drafts_accepted",
            "no_draft_accepted",
            "drafts_on_prefill",
            "drafts_crossing_blocks",
            "drafts_on_admission",
            "drafts_on_retaken_row",
            "drafts_to_the_end",
            "drafts and plain decodes in one step",
            "multimodal request",
            "multimodal prompt in chunks",
            "multimodal decode beside a prefill",
            "multimodal request resumed",
            "encoder_write",
            "encoder_rewrite",
        )
        if not seen[f]
    ]
    assert not missing, f"never exercised: {missing} ({dict(seen)})"


def _count_multimodal(seen: collections.Counter[str], multimodal: dict[str, int], out: SchedulerOutput) -> None:
    """The M-RoPE situations of one output (spec/mrope.py): a table admitted, a later chunk of its prompt, its
    decode row beside a prefill row, its resumption (the row's table recomputed)."""
    tables = {r.req_id: len(r.prompt_token_ids) for r in out.new_requests if r.mrope_positions is not None}
    multimodal.update(tables)
    seen["multimodal request"] += bool(tables)
    cached = [c for c in out.cached_requests if c.req_id in multimodal]
    seen["multimodal prompt in chunks"] += any(
        not c.resumed and c.num_computed_tokens < multimodal[c.req_id] for c in cached
    )
    counts = out.num_scheduled_tokens
    seen["multimodal decode beside a prefill"] += any(
        c.num_computed_tokens >= multimodal[c.req_id] and any(n > 1 for r, n in counts.items() if r != c.req_id)
        for c in cached
    )
    seen["multimodal request resumed"] += any(c.resumed for c in cached)


def test_same_seed_same_schedule() -> None:
    scenario = random_scenario(7)
    assert _run(scenario)[1] == _run(scenario)[1]


def test_preempted_request_keeps_its_row_and_resumes_with_a_replaced_table() -> None:
    # 4 usable blocks of 4 tokens; two 8-token prompts that each grow to 14 tokens cannot both fit
    config = WorkerConfig(2, 16, 64, 50, (KVCacheGroup(4, 5),))
    prompts = [tuple(range(1, 9)), tuple(range(11, 19))]
    workload = Workload(tuple(WorkloadRequest(f"r{i}", 0, p, 6) for i, p in enumerate(prompts)))
    sched, outs = _run(Scenario(config, workload, SchedulerKnobs(enable_prefix_caching=False), None, 0))
    assert sched.stats.preemptions >= 1
    first = next(i for i, out in enumerate(outs) if any(c.resumed for c in out.cached_requests))
    resumed = next(c for c in outs[first].cached_requests if c.resumed)
    assert resumed.num_computed_tokens == 0 and resumed.new_block_ids is not None
    assert len(resumed.new_block_ids[0]) == -(-outs[first].num_scheduled_tokens[resumed.req_id] // 4)
    # between its preemption and its resumption the request is neither scheduled nor finished: it keeps its row
    last_run = max(i for i in range(first) if resumed.req_id in outs[i].num_scheduled_tokens)
    for out in outs[last_run + 1 : first]:
        assert resumed.req_id not in out.num_scheduled_tokens and resumed.req_id not in out.finished_req_ids


def test_allocator_hands_out_distinct_blocks_in_every_order() -> None:
    for order in ("ascending", "descending", "random"):
        alloc = BlockAllocator(101, order, seed=5)
        blocks = alloc.allocate(100)
        assert sorted(blocks) == list(range(1, 101))  # never the null block, each once
        with pytest.raises(RuntimeError):
            alloc.allocate(1)
        for b in blocks:
            alloc.release(b)
        assert alloc.num_free == 100 and alloc.num_used == 0


def test_allocator_is_lazy_for_huge_groups_and_reaches_high_ids() -> None:
    num_blocks = 2**31 // 16 + 3
    alloc = BlockAllocator(num_blocks, "descending")
    assert alloc.allocate(2) == [num_blocks - 1, num_blocks - 2]
    assert alloc.num_free == num_blocks - 3


def test_allocator_evicts_cached_hash_on_reuse() -> None:
    alloc = BlockAllocator(4, "ascending", reuse_freed_first=True)
    a, b, c = alloc.allocate(3)
    alloc.register(a, 111)
    for blk in (a, b, c):
        alloc.release(blk)
    assert alloc.lookup(111) == a
    alloc.touch(a)  # a prefix hit revives a freed block
    assert alloc.ref_count[a] == 1 and alloc.num_free == 2
    alloc.release(a)
    assert alloc.allocate(1) == [b]  # freed order is b, c, a: the longest free goes first
    assert alloc.allocate(1) == [c]
    assert alloc.allocate(1) == [a] and alloc.lookup(111) is None  # reused: no longer a cached prefix


def test_drafts_roll_back_and_keep_their_blocks() -> None:
    """After a step whose drafts were partly rejected, the next output's num_computed_tokens is known - 1,
    and the blocks allocated for rejected drafts stay in the request's table."""
    config = WorkerConfig(2, 64, 64, 50, (KVCacheGroup(2, 80),))
    workload = Workload((WorkloadRequest("r", 0, (1, 2, 3), 40),))
    sched = ReferenceScheduler(config, workload, SchedulerKnobs(spec_tokens=4, acceptance_rate=0.5), seed=3)
    pool = spec.RequestStatePool(config)
    rejected, table = 0, 0
    while not sched.done():
        out = sched.schedule()
        pool.apply(out)
        batch = pool.prepare(out)
        kept = sched.rejection_step(out, dict.fromkeys(sched.sampling_req_ids(out), 7))
        pool.record_sampled(batch, sampled_array([kept.get(r, 7) for r in batch.req_ids]))
        sched.update(out, kept)
        assert pool.snapshot() == sched.expected_snapshot()
        req = sched.requests["r"]
        if "r" in kept and req.status is Status.RUNNING:
            assert req.num_computed == req.num_tokens - 1  # rolled back past every rejected draft
            rejected += len(out.scheduled_spec_decode_tokens.get("r", ())) - (len(kept["r"]) - 1)
            assert len(req.blocks[0]) >= table  # a rollback frees nothing
            table = len(req.blocks[0])
    assert rejected > 0 and sched.stats.drafts_accepted > 0
