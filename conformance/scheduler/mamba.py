"""Hybrid models in the reference scheduler: the mamba groups' blocks (spec/mamba.py), as vLLM's MambaManager holds.

A mamba group's table grows like an attention group's, one block per block_size tokens (or one block when
block_size >= max_model_len), plus num_speculative_blocks blocks past the last for the drafts' states. Prefix
caching keeps the state after each full block in that block only if a step ended exactly at the block's end
(vLLM's "align" mode cuts chunks there): the scheduler then never lets a step cross a mamba block boundary, and
registers a full mamba block for reuse like any other. With drafts a block's end state may have been written
to a speculative column (vLLM copies it back after the step, a model's job); the scheduler then caches no mamba
block, so a hybrid drafting run has no prefix hits.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from conformance.scheduler.knobs import SchedulerKnobs
from spec.mamba import MAMBA
from spec.types import KVCacheGroup, WorkerConfig

MAMBA_SHARE = 0.3  # of the random scenarios, the share of hybrid models (an extra mamba group)


def speculative_blocks(group: KVCacheGroup) -> int:
    return group.num_speculative_blocks if group.kind == MAMBA else 0


def caches_states(knobs: SchedulerKnobs) -> bool:
    """Whether full mamba blocks are registered for prefix hits: with prefix caching, and without drafts."""
    return knobs.enable_prefix_caching and knobs.spec_tokens == 0


def chunk_limit(groups: tuple[KVCacheGroup, ...], num_computed: int, want: int, knobs: SchedulerKnobs) -> int:
    """`want` cut so that the step ends at or before the next boundary of every mamba group whose states are cached."""
    if not caches_states(knobs):
        return want
    for group in groups:
        if group.kind == MAMBA:
            want = min(want, group.block_size - num_computed % group.block_size)
    return want


def with_mamba_group(config: WorkerConfig, knobs: SchedulerKnobs, rng: random.Random) -> WorkerConfig:
    """The config with a mamba group added: one state block per request, or one per block_size tokens (align mode).

    Speculative blocks as vLLM sizes them: one per draft token the scheduler may send (knobs.spec_tokens).
    """
    aligned = math.lcm(*(g.block_size for g in config.kv_groups))  # vLLM's align mode: the attention block size
    draw = rng.random()
    if draw < 0.4:
        block_size = config.max_model_len + rng.randint(0, 8)  # one state block per request (no prefix caching)
    elif draw < 0.7 and aligned < config.max_model_len:
        block_size = aligned
    else:
        block_size = rng.choice([b for b in (1, 2, 4, 8, 16, 32) if b < config.max_model_len] or [1])
    spec = knobs.spec_tokens
    per_request = math.ceil(config.max_model_len / block_size) + spec
    roomy = rng.random() < 0.7
    num_blocks = per_request * (config.max_num_reqs if roomy else 1) + 1 + rng.randint(0, 4)
    group = KVCacheGroup(block_size, num_blocks, kind=MAMBA, num_speculative_blocks=spec)
    return replace(config, kv_groups=(*config.kv_groups, group))


def with_small_mamba_group(config: WorkerConfig, spec_tokens: int, block_size: int = 8) -> WorkerConfig:
    """A mamba group last, in align mode, roomy for every row, a speculative block per draft (`slotmap explain`)."""
    per_request = math.ceil(config.max_model_len / block_size) + spec_tokens
    group = KVCacheGroup(block_size, config.max_num_reqs * per_request + 1, kind=MAMBA,
                         num_speculative_blocks=spec_tokens)  # fmt: skip
    return replace(config, kv_groups=(*config.kv_groups, group))
