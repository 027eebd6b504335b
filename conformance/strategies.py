"""Every Hypothesis strategy of the conformance suite: configs, workloads, scheduler knobs, scenarios, breakages.

Ranges are shared with conformance.scenario.random_scenario (used by `slotmap check`).
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from hypothesis import strategies as st

from conformance.scenario import (
    ACCEPTANCE_RATES,
    ATTENTION_DTYPES,
    BLOCK_SIZES,
    HUGE_SLOTS,
    KV_CACHE_ELEMENT_LIMIT,
    MAX_BLOCKS,
    MAX_MODEL_LEN,
    SPEC_TOKENS,
    AttentionSpec,
    Scenario,
    cache_elements,
    min_blocks,
    with_fp8_draw,
    with_one_block_pool,
    with_resume_draw,
)
from conformance.scheduler import RequestShape, SchedulerKnobs, Workload, WorkloadShape, build_workload
from conformance.scheduler.allocator import ALLOCATION_ORDERS
from conformance.scheduler.encoder import with_encoder
from conformance.scheduler.mamba import with_mamba_group
from conformance.scheduler.mla import with_mla_groups
from conformance.scheduler.mrope import with_position_tables
from conformance.scheduler.step_shapes import with_step_shapes_draw
from spec.errors import ALL_ERRORS, ScheduleError
from spec.types import KVCacheGroup, WorkerConfig


@st.composite
def kv_groups(draw: st.DrawFn, max_model_len: int, max_num_reqs: int, allow_huge: bool = True) -> KVCacheGroup:
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    least = min_blocks(max_model_len, block_size)
    sizes = ["tiny", "small", "roomy", "huge"] if allow_huge else ["tiny", "small", "roomy"]
    size = draw(st.sampled_from(sizes))
    if size == "tiny":
        num_blocks = least
    elif size == "small":
        num_blocks = least + draw(st.integers(1, 8))
    elif size == "roomy":
        num_blocks = least * max_num_reqs + 1
    else:  # slots past int32: block ids near 2**31 / block_size (the KV caches are then not allocated)
        num_blocks = min(HUGE_SLOTS // block_size + draw(st.integers(1, 1000)), MAX_BLOCKS)
    window = draw(st.none() | st.integers(1, max_model_len))
    return KVCacheGroup(block_size, num_blocks, window)


@st.composite
def configs(
    draw: st.DrawFn, max_groups: int = 3, allow_huge: bool = True, max_model_len: int = MAX_MODEL_LEN
) -> WorkerConfig:
    model_len = draw(st.integers(2, max_model_len))
    max_num_reqs = draw(st.integers(1, 8))
    groups = draw(st.lists(kv_groups(model_len, max_num_reqs, allow_huge), min_size=1, max_size=max_groups))
    return WorkerConfig(
        max_num_reqs=max_num_reqs,
        max_model_len=model_len,
        max_num_batched_tokens=draw(st.integers(1, 256)),
        vocab_size=draw(st.integers(2, 1000)),
        kv_groups=tuple(groups),
    )


@st.composite
def workloads(draw: st.DrawFn, config: WorkerConfig, max_requests: int = 12) -> Workload:
    longest = config.max_model_len - 1
    aligned = math.lcm(*(g.block_size for g in config.kv_groups))
    prefix_lens = draw(st.lists(st.integers(1, max(1, longest)), max_size=3))
    # some prefixes are whole blocks in every group, so prompts equal to them can be fully cached
    prefix_lens = [n // aligned * aligned if n >= aligned and draw(st.booleans()) else n for n in prefix_lens]
    shapes = []
    for _ in range(draw(st.integers(1, max_requests))):
        prefix = draw(st.none() | st.integers(0, len(prefix_lens) - 1)) if prefix_lens else None
        whole = prefix is not None and draw(st.booleans())
        prompt_len = prefix_lens[prefix] if whole and prefix is not None else draw(st.integers(1, max(1, longest)))
        shapes.append(
            RequestShape(
                arrival_step=draw(st.integers(0, 12)),
                prompt_len=prompt_len,
                max_new_tokens=draw(st.integers(1, 24)),
                prefix=prefix,
                prefix_len=prefix_lens[prefix] if prefix is not None else 0,
                num_stop_tokens=draw(st.integers(0, 2)),
            )
        )
    token_seed = draw(st.integers(0, 2**32 - 1))
    return build_workload(WorkloadShape(tuple(shapes), tuple(prefix_lens), token_seed), config)


@st.composite
def scheduler_knobs(draw: st.DrawFn, config: WorkerConfig) -> SchedulerKnobs:
    buckets = st.sampled_from([(), (8, 16, 32, 64, 128, 256)]) | st.tuples(st.integers(1, 300))
    return SchedulerKnobs(
        token_budget=draw(st.none() | st.integers(1, config.max_num_batched_tokens)),
        max_running=draw(st.none() | st.integers(1, config.max_num_reqs)),
        max_chunk=draw(st.none() | st.integers(1, 32)),
        enable_prefix_caching=draw(st.booleans()),
        allocation_order=draw(st.sampled_from(ALLOCATION_ORDERS)),
        reuse_freed_first=draw(st.booleans()),
        pad_buckets=draw(buckets),
        abort_prob=draw(st.sampled_from([0.0, 0.05])),
        shuffle_order=draw(st.booleans()),
        spec_tokens=draw(st.sampled_from(SPEC_TOKENS)),
        acceptance_rate=draw(st.sampled_from(ACCEPTANCE_RATES)),
        drafts_on_admission=draw(st.booleans()),
        null_lookahead=draw(st.booleans()),
    )


def attention_specs() -> st.SearchStrategy[AttentionSpec]:
    plain = st.builds(
        AttentionSpec,
        num_kv_heads=st.integers(1, 2),
        num_queries_per_kv=st.integers(1, 2),
        head_dim=st.sampled_from([2, 4, 8]),
        dtype=st.sampled_from(ATTENTION_DTYPES),
        softcap=st.none() | st.just(5.0),
    )
    return st.tuples(plain, st.randoms(use_true_random=False)).map(lambda drawn: with_fp8_draw(*drawn))


@st.composite
def scenarios(
    draw: st.DrawFn,
    max_groups: int = 3,
    max_requests: int = 12,
    allow_huge: bool = True,
    max_model_len: int = MAX_MODEL_LEN,
    encoder_decoder: bool = True,
    hybrid: bool = True,
    mla: bool = True,
) -> Scenario:
    config = draw(configs(max_groups, allow_huge, max_model_len))
    if mla and draw(st.integers(0, 3)) == 0:  # an MLA model (spec/mla_cache.py): a latent group, maybe a windowed one
        config = with_mla_groups(config, random.Random(draw(st.integers(0, 2**32 - 1))))
    workload = draw(workloads(config, max_requests))
    if draw(st.booleans()):  # a multimodal model (spec/mrope.py): position tables on some requests
        config = replace(config, uses_mrope=True)
        workload = with_position_tables(workload, draw(st.integers(0, 2**32 - 1)))
    if encoder_decoder and draw(st.integers(0, 2)) == 0:  # an encoder-decoder model (spec/cross_attention.py)
        config, workload = with_encoder(config, workload, random.Random(draw(st.integers(0, 2**32 - 1))))
    knobs = draw(scheduler_knobs(config))
    if hybrid and draw(st.integers(0, 2)) == 0:  # a hybrid model: a mamba group too (spec/mamba.py)
        config = with_mamba_group(config, knobs, random.Random(draw(st.integers(0, 2**32 - 1))))
    if draw(st.integers(0, 3)) == 0:  # steps scheduled one ahead of the samples (spec/async_steps.py), hybrid too
        config = replace(config, async_scheduling=True)
        knobs = with_resume_draw(knobs, random.Random(draw(st.integers(0, 2**32 - 1))))  # rule 7's neighbours
    if len(config.kv_groups) > 1 and draw(st.booleans()):  # vLLM's one block pool for all groups, or one per group
        config = with_one_block_pool(config)
    # captured graphs, a DP peer, DBO splits (conformance/scheduler/step_shapes.py), each on a share of scenarios
    knobs = with_step_shapes_draw(knobs, config, random.Random(draw(st.integers(0, 2**32 - 1))))
    attention: AttentionSpec | None = draw(attention_specs())
    if attention is not None and cache_elements(config, attention) > KV_CACHE_ELEMENT_LIMIT:
        attention = None
    return Scenario(config, workload, knobs, attention, draw(st.integers(0, 2**32 - 1)))


def error_classes() -> st.SearchStrategy[type[ScheduleError]]:
    return st.sampled_from(ALL_ERRORS)


@st.composite
def breakages(draw: st.DrawFn) -> tuple[type[ScheduleError], random.Random]:
    """Which error class to provoke in a step, and the randomness the mutation uses to do it."""
    return draw(error_classes()), draw(st.randoms(use_true_random=False))
