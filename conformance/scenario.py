"""A scenario: one config, workload and scheduler setting for the differential suite to run.

`random_scenario(seed)` draws one with Python's random (for `slotmap check`); conformance.strategies
draws the same type from Hypothesis. Both use the ranges below, so the two explore the same space.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from conformance.scheduler import SchedulerKnobs, Workload, make_workload
from conformance.scheduler.encoder import ENCODER_DECODER_SHARE, with_encoder
from conformance.scheduler.mamba import MAMBA_SHARE, with_mamba_group
from conformance.scheduler.mla import MLA_SHARE, with_mla_groups
from conformance.scheduler.mrope import with_position_tables
from conformance.scheduler.step_shapes import with_step_shapes_draw
from spec.types import KVCacheGroup, WorkerConfig

BLOCK_SIZES = (1, 2, 3, 4, 5, 7, 8, 12, 16, 17, 24, 31, 32, 48, 63, 64)  # powers of two and not
MAX_MODEL_LEN = 160
KV_CACHE_ELEMENT_LIMIT = 1 << 21  # larger caches ("huge num_blocks") skip the KV and attention comparisons
HUGE_SLOTS = 1 << 31  # a huge group's slots reach past int32
MAX_BLOCKS = 1 << 31  # block ids are int32 (spec.types.BLOCK_ID_DTYPE)
ATTENTION_DTYPES = ("float32", "float16")
KV_CACHE_DTYPES = ("auto", "auto", "fp8_e4m3", "fp8_e5m2")  # half the scenarios with attention read an fp8 cache
KV_SCALES = (0.004, 0.37, 1.0, 2.5)  # 0.004 saturates e4m3 (448 * 0.004 = 1.8 < keys' largest |N(0, 1)|)
SPEC_TOKENS = (0, 0, 1, 2, 3, 5)  # most drafts per request per step; 0 (no speculative decoding) a third of the time
ACCEPTANCE_RATES = (0.0, 0.5, 0.8, 1.0)
MROPE_SHARE = 0.3  # of the scenarios, the share whose model uses M-RoPE (and whose requests carry tables)
ASYNC_SHARE = 0.3  # of the scenarios with async_scheduling on offer, the share that schedule one step ahead
RESUME_AT_ONCE = (0.0, 0.3, 0.7)  # async: chance a request whose drafts' verdict is unread is resumed at once
IDLE_STEPS = (0.0, 0.3, 0.7)  # async: chance an output with rows to release schedules nothing
ABORT_AFTER_SAMPLE = (0.0, 0.05, 0.15)  # async: chance a request is aborted before its last sample is read
ONE_POOL_SHARE = 0.5  # of the scenarios with several KV groups, the share whose groups share one block pool (vLLM's)


@dataclass(frozen=True)
class AttentionSpec:
    """KV cache and attention shapes for a scenario; every group of the config uses them."""

    num_kv_heads: int
    num_queries_per_kv: int  # GQA group size
    head_dim: int
    dtype: str  # float32 or float16: the queries', and the caches' with kv_cache_dtype "auto"
    softcap: float | None = None
    kv_cache_dtype: str = "auto"  # or "fp8_e4m3" / "fp8_e5m2": caches of uint8 codes (spec/fp8.py)
    k_scale: tuple[float, ...] = (1.0,)  # one value (per tensor) or num_kv_heads values (per KV head)
    v_scale: tuple[float, ...] = (1.0,)

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.num_queries_per_kv

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def cache_dtype(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else "uint8"


@dataclass(frozen=True)
class Scenario:
    config: WorkerConfig
    workload: Workload
    knobs: SchedulerKnobs
    attention: AttentionSpec | None  # None: the caches would be too large, compare pool and batch only
    seed: int  # the scheduler's and the random keys/values/samples'


def min_blocks(config_max_model_len: int, block_size: int) -> int:
    """The fewest blocks with which one request can always run alone: every table entry distinct, plus null."""
    return math.ceil(config_max_model_len / block_size) + 1


def cache_elements(config: WorkerConfig, attention: AttentionSpec) -> int:
    per_slot = attention.num_kv_heads * attention.head_dim  # an mla group's slot holds one latent entry instead
    return sum(g.num_blocks * g.block_size * (g.latent_width or per_slot) for g in config.kv_groups)


def random_scenario(
    seed: int,
    spec_decode: bool = False,
    encoder_decoder: bool = False,
    hybrid: bool = False,
    multimodal: bool = False,
    async_scheduling: bool = False,
    mla: bool = False,
    padded: bool = False,
) -> Scenario:
    """The scenario of `seed`; with `spec_decode` its scheduler also drafts (speculative decoding), in the
    same ranges as conformance.strategies. Without, a seed gives the scenario it gave before drafts existed,
    for code that speaks only plain decoding (the vLLM conversion, the shadow checker's engine). With
    `encoder_decoder`, some seeds' models are encoder-decoders (conformance/scheduler/encoder.py); with `hybrid`,
    some seeds' models have a mamba group too (conformance/scheduler/mamba.py); with `multimodal`, some seeds'
    models use M-RoPE and some requests carry position tables (conformance/scheduler/mrope.py); with
    `async_scheduling`, some seeds' steps are scheduled one ahead of their samples (spec/async_steps.py); with
    `mla`, some seeds' models keep their decoder's KV in a latent mla group (conformance/scheduler/mla.py); with
    `padded`, some seeds' steps run captured graphs, a DP peer's padding or dummy batches, or DBO splits
    (conformance/scheduler/step_shapes.py)."""
    rng = random.Random(seed)
    max_model_len = rng.randint(2, MAX_MODEL_LEN)
    max_num_reqs = rng.randint(1, 8)
    groups = []
    for _ in range(rng.randint(1, 3)):
        block_size = rng.choice(BLOCK_SIZES)
        least = min_blocks(max_model_len, block_size)
        size = rng.choice(("tiny", "small", "roomy", "huge"))
        num_blocks = {
            "tiny": least,
            "small": least + rng.randint(1, 8),
            "roomy": least * max_num_reqs + 1,
            "huge": min(HUGE_SLOTS // block_size + rng.randint(1, 1000), MAX_BLOCKS),
        }[size]
        window = rng.randint(1, max_model_len) if rng.random() < 0.3 else None
        groups.append(KVCacheGroup(block_size, num_blocks, window))
    config = WorkerConfig(max_num_reqs, max_model_len, rng.randint(1, 256), rng.randint(2, 1000), tuple(groups))
    knobs = SchedulerKnobs(
        token_budget=rng.choice((None, rng.randint(1, config.max_num_batched_tokens))),
        max_running=rng.choice((None, rng.randint(1, max_num_reqs))),
        max_chunk=rng.choice((None, rng.randint(1, 32))),
        enable_prefix_caching=rng.random() < 0.8,
        allocation_order=rng.choice(("ascending", "descending", "random")),
        reuse_freed_first=rng.random() < 0.5,
        pad_buckets=rng.choice(((), (8, 16, 32, 64, 128, 256), (rng.randint(1, 300),))),
        abort_prob=rng.choice((0.0, 0.0, 0.05)),
        shuffle_order=rng.random() < 0.5,
    )
    workload = make_workload(
        rng.randrange(2**32),
        config,
        num_requests=rng.randint(1, 12),
        max_arrival_step=rng.randint(0, 12),
        num_prefixes=rng.randint(0, 3),
        max_new_tokens=rng.randint(1, 24),
    )
    attention: AttentionSpec | None = AttentionSpec(
        rng.randint(1, 2), rng.randint(1, 2), rng.choice((2, 4, 8)), rng.choice(ATTENTION_DTYPES),
        rng.choice((None, None, 5.0)),
    )  # fmt: skip
    drawn_attention = attention
    if attention is not None and cache_elements(config, attention) > KV_CACHE_ELEMENT_LIMIT:
        attention = None
    scenario_seed = rng.randrange(2**32)
    spec_tokens, acceptance_rate = rng.choice(SPEC_TOKENS), rng.choice(ACCEPTANCE_RATES)  # drawn last: see above
    if spec_decode:
        knobs = replace(knobs, spec_tokens=spec_tokens, acceptance_rate=acceptance_rate,
                        drafts_on_admission=rng.random() < 0.5)  # fmt: skip
    knobs = replace(knobs, null_lookahead=rng.random() < 0.5)  # drawn last: earlier seeds' draws stay as they were
    knobs = with_vllm_form_draw(knobs, random.Random(f"vllm form {seed}"))  # its own source: the same scenario
    knobs = with_resume_draw(knobs, random.Random(f"resume {seed}"))  # its own source too; used only under async
    if attention is not None:  # drawn after everything else, for the same reason
        attention = with_fp8_draw(attention, rng)
    # a multimodal model (spec/mrope.py), for callers that speak M-RoPE (vLLM's scheduler output carries no
    # positions: the conversion and the shadow checker's engine cover text models); drawn either way, so a seed
    # gives the same scenario with and without
    if rng.random() < MROPE_SHARE and multimodal:
        config = replace(config, uses_mrope=True)
        workload = with_position_tables(workload, rng.randrange(2**32))
    if mla:  # its own random source, and before the groups below are added (they follow the decoder's)
        mla_rng = random.Random(f"mla {seed}")
        if mla_rng.random() < MLA_SHARE:  # spec/mla_cache.py
            config = with_mla_groups(config, mla_rng)
            if attention is None and drawn_attention is not None:  # the groups it was too large for are gone
                attention = with_fp8_draw(drawn_attention, mla_rng)
            if attention is not None and cache_elements(config, attention) > KV_CACHE_ELEMENT_LIMIT:
                attention = None
    if encoder_decoder:  # its own random source: the draws above are the seed's with or without it
        encoder_rng = random.Random(f"encoder-decoder {seed}")
        if encoder_rng.random() < ENCODER_DECODER_SHARE:  # spec/cross_attention.py
            config, workload = with_encoder(config, workload, encoder_rng)
            if attention is not None and cache_elements(config, attention) > KV_CACHE_ELEMENT_LIMIT:
                attention = None
    if hybrid:  # its own random source too
        hybrid_rng = random.Random(f"hybrid {seed}")
        if hybrid_rng.random() < MAMBA_SHARE:  # spec/mamba.py
            config = with_mamba_group(config, knobs, hybrid_rng)
    if async_scheduling and random.Random(f"async {seed}").random() < ASYNC_SHARE:  # own source too
        config = replace(config, async_scheduling=True)
    if len(config.kv_groups) > 1 and random.Random(f"one pool {seed}").random() < ONE_POOL_SHARE:  # own source
        config = with_one_block_pool(config)
        if attention is not None and cache_elements(config, attention) > KV_CACHE_ELEMENT_LIMIT:
            attention = None
    if spec_decode and not config.async_scheduling:  # its own source: the draws above stay the seed's
        knobs = replace(knobs, drafts_to_the_end=random.Random(f"to the end {seed}").random() < 0.5)
    if padded:  # its own source, drawn last: the drafts (1 + K) and the config are the seed's
        knobs = with_step_shapes_draw(knobs, config, random.Random(f"step shapes {seed}"))
    return Scenario(config, workload, knobs, attention, scenario_seed)


def with_one_block_pool(config: WorkerConfig) -> WorkerConfig:
    """config with its groups drawing from one block pool (vLLM's form): as many real blocks as they had together."""
    pooled = min(sum(g.num_blocks - 1 for g in config.kv_groups) + 1, MAX_BLOCKS)
    groups = tuple(replace(g, num_blocks=pooled) for g in config.kv_groups)
    return replace(config, kv_groups=groups, one_block_pool=True)


def with_resume_draw(knobs: SchedulerKnobs, rng: random.Random) -> SchedulerKnobs:
    """knobs with drawn chances of async scheduling's neighbours of a resumption (spec/async_steps.py, rule 7)."""
    return replace(knobs, resume_at_once=rng.choice(RESUME_AT_ONCE), idle_steps=rng.choice(IDLE_STEPS),
                   abort_after_sample=rng.choice(ABORT_AFTER_SAMPLE))  # fmt: skip


def with_vllm_form_draw(knobs: SchedulerKnobs, rng: random.Random) -> SchedulerKnobs:
    """knobs with drawn forms of vLLM's output (conformance/scheduler/vllm_form.py), each on about half the time."""
    return replace(knobs, zero_new_blocks=rng.random() < 0.5, common_prefix_blocks=rng.random() < 0.5,
                   model_runner_v2=rng.random() < 0.5, pipeline_parallel=rng.random() < 0.5)  # fmt: skip


def with_fp8_draw(attention: AttentionSpec, rng: random.Random) -> AttentionSpec:
    """attention with a drawn cache dtype and scales: an fp8 cache half the time, per tensor or per KV head."""
    kv_cache_dtype = rng.choice(KV_CACHE_DTYPES)
    if kv_cache_dtype == "auto":
        return replace(attention, kv_cache_dtype="auto", k_scale=(1.0,), v_scale=(1.0,))
    heads = rng.choice((1, attention.num_kv_heads))
    k_scale = tuple(rng.choice(KV_SCALES) for _ in range(heads))
    v_scale = tuple(rng.choice(KV_SCALES) for _ in range(heads))
    return replace(attention, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)


def vllm_stress_scenario(seed: int) -> Scenario:
    """Few blocks (preemption and resumption), a windowed group, prefixes, chunked prefill, aborts; every field
    of vLLM's output sent (conformance/scheduler/vllm_form.py), in model runner v1's form (even seeds) and v2's
    (odd), with pipeline parallelism from seed 2 on, where every request also starts with the same prefix, so
    running requests share blocks (common-prefix claims)."""
    config = WorkerConfig(4, 48, 40, 97, (KVCacheGroup(4, 22), KVCacheGroup(3, 30, sliding_window=7)))
    knobs = SchedulerKnobs(max_chunk=9, abort_prob=0.05, shuffle_order=True, reuse_freed_first=True,
                           zero_new_blocks=True, common_prefix_blocks=True, model_runner_v2=seed % 2 == 1,
                           pipeline_parallel=seed >= 2)  # fmt: skip
    one_prefix = seed >= 2
    workload = make_workload(seed, config, num_requests=8, max_arrival_step=6, num_prefixes=1 if one_prefix else 2,
                             max_new_tokens=10, shared_prefix_prob=1.0 if one_prefix else 0.5)  # fmt: skip
    return Scenario(config, workload, knobs, None, seed)
