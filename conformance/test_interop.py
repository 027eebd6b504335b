"""Engine layouts on every backend: FlashInfer's, SGLang's and vLLM's forms of each step equal spec's.

The reference scheduler drives spec and the backend under test through the same steps (new,
continuing, chunked, preempted and resumed requests, prefix hits, window releases, padding, aborts);
each step's batch is turned into every layout of spec.interop by spec and by the backend's own interop
module, and the two must be equal (values, dtypes, shapes). FlashInfer's paged attention, reading the
CSR layout, must equal spec's block-table attention within conformance.tolerance's rule.

A backend's interop functions are `handle.module.interop` (spec's module has one, and fast's handle
carries fast.interop in its kernel mode). A third-party backend without one is skipped: the layouts
are an optional part of the interface (docs/porting.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import spec
import spec.interop
from conformance.backends import INTEROP_FUNCTIONS, BackendHandle
from conformance.scenario import AttentionSpec, Scenario, random_scenario
from conformance.scheduler import ReferenceScheduler, SchedulerKnobs, SchedulerStats, make_workload
from conformance.tolerance import assert_attention_close, spec_in_dtype
from shadow.compare import array_difference
from spec.interop import V2RowPolicy, host_counts
from spec.types import BatchInputs, KVCacheGroup, SchedulerOutput, WorkerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py


def interop_of(handle: BackendHandle) -> Any:
    """The backend's interop functions (`module.interop`: spec's module, fast's handle in its kernel mode)."""
    own = getattr(handle.module, "interop", None)
    if own is None:
        pytest.skip(f"backend {handle.name!r} has no `interop` attribute with {', '.join(INTEROP_FUNCTIONS)}")
    return own


def _stress_scenario(seed: int) -> Scenario:
    """Few blocks (preemption), a windowed group, shared prefixes, padding buckets and aborts."""
    config = WorkerConfig(4, 48, 40, 97, (KVCacheGroup(4, 22), KVCacheGroup(3, 30, sliding_window=7)))
    knobs = SchedulerKnobs(max_chunk=9, pad_buckets=(8, 16, 32, 64), abort_prob=0.05, shuffle_order=True,
                           reuse_freed_first=True)  # fmt: skip
    workload = make_workload(seed, config, num_requests=8, max_arrival_step=6, num_prefixes=2, max_new_tokens=10)
    attention = AttentionSpec(num_kv_heads=2, num_queries_per_kv=2, head_dim=4, dtype="float32", softcap=5.0)
    return Scenario(config, workload, knobs, attention, seed)


def _scenarios(backend: BackendHandle) -> list[Scenario]:
    if backend.slow:  # the Triton interpreter is ~1000x slower: one small stress run
        return [_stress_scenario(1)]
    return [_stress_scenario(s) for s in range(3)] + [random_scenario(s) for s in range(6)]


def _drive(scenario: Scenario, backend: BackendHandle, max_steps: int) -> Iterator[tuple[SchedulerOutput, Any, Any]]:
    """(output, spec batch, backend batch) per step; spec's pool and the backend's see the same steps."""
    sched = ReferenceScheduler(scenario.config, scenario.workload, scenario.knobs, seed=scenario.seed)
    ref_pool, pool = spec.RequestStatePool(scenario.config), backend.make_pool(scenario.config)
    rng = np.random.default_rng(scenario.seed)
    _STATS.append(sched.stats)  # filled in as the run goes
    for _ in range(max_steps):
        if sched.done():
            return
        out = sched.schedule()
        pad_to = sched.pad_to(out)
        ref_pool.apply(out)
        pool.apply(out)
        ref_batch, batch = ref_pool.prepare(out, pad_to), pool.prepare(out, pad_to)
        yield out, ref_batch, batch
        sampled = rng.integers(scenario.config.vocab_size, size=ref_batch.num_reqs)
        ref_pool.record_sampled(ref_batch, sampled)
        pool.record_sampled(batch, backend.asarray(sampled))
        takes = set(sched.sampling_req_ids(out))
        sched.update(out, {r: int(t) for r, t in zip(ref_batch.req_ids, sampled, strict=True) if r in takes})


_STATS: list[SchedulerStats] = []


def _assert_same(where: str, want: Any, got: Any, backend: BackendHandle) -> None:
    if dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            _assert_same(f"{where}.{f.name}", getattr(want, f.name), getattr(got, f.name), backend)
    elif isinstance(want, np.ndarray):
        problem = array_difference(where, want, backend.to_numpy(got))
        assert not problem, problem
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def test_layouts_equal_spec_on_every_step(backend: BackendHandle) -> None:
    interop = interop_of(backend)
    _STATS.clear()
    steps = 0
    for scenario in _scenarios(backend):
        config = scenario.config
        ref_rows, rows = V2RowPolicy(config.max_num_reqs), V2RowPolicy(config.max_num_reqs)
        for out, ref_batch, batch in _drive(scenario, backend, 12 if backend.slow else 200):
            ref_rows.apply(out)
            rows.apply(out)
            host = host_counts(out, ref_batch.req_ids)
            for g, group in enumerate(config.kv_groups):
                where = f"scenario seed {scenario.seed}, step {steps}, group {g}"
                want = spec.interop.paged_kv_layout(ref_batch, g, group.block_size, host)
                _assert_same(f"{where}: paged_kv", want, interop.paged_kv_layout(batch, g, group.block_size, host),
                             backend)  # fmt: skip
                _assert_same(f"{where}: paged_kv (no host counts)", want,
                             interop.paged_kv_layout(batch, g, group.block_size), backend)  # fmt: skip
                _assert_same(f"{where}: sglang", spec.interop.sglang_layout(ref_batch, config, g),
                             interop.sglang_layout(batch, config, g), backend)  # fmt: skip
                for compatible in (False, True):
                    policy = {"row_policy": (ref_rows, rows)} if compatible else {}
                    want_fa = spec.interop.flash_attn_metadata(
                        ref_batch, config, g, vllm_compatible=compatible, host=host,
                        **{k: v[0] for k, v in policy.items()},
                    )  # fmt: skip
                    got_fa = interop.flash_attn_metadata(
                        batch, config, g, vllm_compatible=compatible, host=host, **{k: v[1] for k, v in policy.items()}
                    )
                    _assert_same(f"{where}: flash_attn (vllm_compatible={compatible})", want_fa, got_fa, backend)
            steps += 1
    total = SchedulerStats()
    for s in _STATS:
        for f in ("preemptions", "resumptions", "prefix_hit_tokens", "window_releases", "padded_steps", "finished"):
            setattr(total, f, getattr(total, f) + getattr(s, f))
    if not backend.slow:  # the small interpreter run covers fewer kinds of step
        kinds = {f: getattr(total, f) for f in ("preemptions", "resumptions", "prefix_hit_tokens", "window_releases",
                                                "padded_steps", "finished")}  # fmt: skip
        assert all(kinds.values()), f"the scenarios no longer drive every kind of step: {kinds}"
    assert steps > 0


def test_flashinfer_attention_equals_block_table_attention(backend: BackendHandle) -> None:
    interop = interop_of(backend)
    scenario = _stress_scenario(2)
    att = scenario.attention
    assert att is not None
    rng = np.random.default_rng(0)
    config = scenario.config
    shapes = [(g.num_blocks, g.block_size, att.num_kv_heads, att.head_dim) for g in config.kv_groups]
    caches = [np.zeros(shape, att.dtype) for shape in shapes]
    value_caches = [np.zeros_like(c) for c in caches]
    max_steps = 6 if backend.slow else 60
    for step, (_, ref_batch, _batch) in enumerate(_drive(scenario, backend, max_steps)):
        t = ref_batch.num_tokens_padded
        query = rng.standard_normal((t, att.num_heads, att.head_dim)).astype(att.dtype)
        for g, group in enumerate(config.kv_groups):
            key = rng.standard_normal((t, att.num_kv_heads, att.head_dim)).astype(att.dtype)
            value = rng.standard_normal((t, att.num_kv_heads, att.head_dim)).astype(att.dtype)
            spec.write_kv(caches[g], value_caches[g], key, value, ref_batch.slot_mappings[g])
            kwargs: dict[str, Any] = {"scale": att.scale, "sliding_window": group.sliding_window}
            kwargs["softcap"] = att.softcap
            table_args = (ref_batch.block_tables[g], ref_batch.seq_lens, ref_batch.query_start_loc)
            q64, k64, v64 = (np.asarray(a, np.float64) for a in (query, caches[g], value_caches[g]))
            ref64 = spec.paged_attention(q64, k64, v64, *table_args, **kwargs)
            low = spec_in_dtype(spec.paged_attention, att.dtype, (query, caches[g], value_caches[g]), *table_args,
                                **kwargs)  # fmt: skip
            layout = spec.interop.paged_kv_layout(ref_batch, g, group.block_size)
            on_backend = _layout_on(backend, layout)
            to = backend.asarray
            got = interop.paged_attention(to(query), to(caches[g]), to(value_caches[g]), on_backend, **kwargs)
            got_np = np.asarray(backend.to_numpy(got), np.float64)
            n = ref_batch.num_tokens
            assert np.all(got_np[n:] == 0), f"step {step}, group {g}: padding rows are not zero"
            try:
                assert_attention_close(got_np[:n], ref64[:n], low[:n], att.dtype)
            except AssertionError as exc:
                raise AssertionError(f"step {step}, group {g} (window {group.sliding_window}): {exc}") from exc


def _layout_on(backend: BackendHandle, layout: spec.interop.PagedKVLayout) -> spec.interop.PagedKVLayout:
    return spec.interop.PagedKVLayout(*(backend.asarray(getattr(layout, f.name)) for f in dataclasses.fields(layout)))


def test_flashinfer_attention_reads_only_its_pages() -> None:
    """A layout whose pages point elsewhere gives other values: the entry really reads the CSR form."""
    config = WorkerConfig(2, 16, 16, 50, (KVCacheGroup(4, 9),))
    pool = spec.RequestStatePool(config)
    out = SchedulerOutput(
        new_requests=(spec.NewRequest("a", (1, 2, 3, 4, 5, 6), ((3, 5),)), spec.NewRequest("b", (7, 8, 9), ((2,),))),
        num_scheduled_tokens={"a": 6, "b": 3},
    )
    pool.apply(out)
    batch: BatchInputs = pool.prepare(out)
    rng = np.random.default_rng(1)
    key, value = rng.standard_normal((2, 9, 4, 1, 2))
    query = rng.standard_normal((9, 2, 2))
    layout = spec.interop.paged_kv_layout(batch, 0, 4)
    assert layout.paged_kv_indptr.tolist() == [0, 1, 3] and layout.paged_kv_indices.tolist() == [2, 3, 5]
    assert layout.paged_kv_last_page_len.tolist() == [3, 2]
    args = (batch.block_tables[0], batch.seq_lens, batch.query_start_loc)
    want = spec.paged_attention(query, key, value, *args, scale=0.5)
    np.testing.assert_allclose(spec.interop.paged_attention(query, key, value, layout, scale=0.5), want, rtol=1e-12)
    moved = dataclasses.replace(layout, paged_kv_indices=np.array([2, 3, 6], np.int32))
    assert not np.allclose(spec.interop.paged_attention(query, key, value, moved, scale=0.5), want)
    with pytest.raises(ValueError, match="max_num_pages"):
        spec.interop.paged_attention(query, key, value, layout, scale=0.5, max_num_pages=1)


@pytest.mark.parametrize("block_size", [1, 3, 16, 17, 48, 128, 200, 256])
def test_vllm_table_width_is_the_least_multiple_of_128_tokens(block_size: int) -> None:
    config = WorkerConfig(2, 1000, 64, 50, (KVCacheGroup(block_size, 8),))
    width, least = spec.interop.vllm_table_width(config, 0), config.max_blocks_per_req(0)
    assert width >= least and width * block_size % 128 == 0
    assert not any(w * block_size % 128 == 0 for w in range(least, width))  # no smaller width fits the rule


def test_v2_row_policy_hands_out_the_most_recently_freed_row() -> None:
    policy = V2RowPolicy(4)
    new = [spec.NewRequest(r, (1,), ((1,),)) for r in "abcd"]
    policy.apply(SchedulerOutput(new_requests=tuple(new[:3])))
    assert [policy.row_of[r] for r in "abc"] == [0, 1, 2]  # a fresh pool: lowest first, like slotmap
    policy.apply(SchedulerOutput(finished_req_ids=frozenset({"a"})))
    policy.apply(SchedulerOutput(finished_req_ids=frozenset({"c"})))
    policy.apply(SchedulerOutput(new_requests=(new[3],)))
    assert policy.row_of["d"] == 2  # slotmap's pool would give row 0, the lowest free one
    assert policy.index_mapping(["b", "d"]).tolist() == [1, 2]


def test_sglang_puts_the_encoder_first_and_finds_each_rows_last_token(backend: BackendHandle) -> None:
    """Encoder-decoder scenarios (spec/cross_attention.py): the backend's layout equals spec's, and each row's
    last_loc is its last token's slot: column encoder_len + seq_len - 1, not seq_len - 1 (SGLang PR #39040)."""
    interop = interop_of(backend)
    drawn = [random_scenario(seed, encoder_decoder=True) for seed in range(40)]
    scenarios = [s for s in drawn if any(g.kind == "cross_attention" for g in s.config.kv_groups)]
    scenarios = scenarios[: 2 if backend.slow else 8]
    assert scenarios
    for scenario in scenarios:
        config = scenario.config
        decoder = [g for g, group in enumerate(config.kv_groups) if group.kind == "attention"]
        for _out, ref_batch, batch in _drive(scenario, backend, 8 if backend.slow else 60):
            last = np.asarray(ref_batch.query_start_loc)[1:] - 1  # [num_reqs] flat index of each row's last token
            for g in decoder:
                want = spec.interop.sglang_layout(ref_batch, config, g)
                _assert_same(f"seed {scenario.seed}, group {g}: sglang", want, interop.sglang_layout(batch, config, g),
                             backend)  # fmt: skip
                assert want.last_loc.tolist() == np.asarray(ref_batch.slot_mappings[g])[last].tolist()
