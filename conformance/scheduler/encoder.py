"""Encoder-decoder models (spec/cross_attention.py): a cross_attention group beside the decoder's, and requests
that carry an encoder output of 1..max_encoder_len tokens.

The scheduler allocates each request's cdiv(encoder_len, block_size) cross blocks when it admits it (and
again when it resumes one after a preemption, which freed them), and turns prefix caching off for such
a model, as vLLM does: there is no cache of encoder outputs, so every request starts at position 0.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from conformance.scheduler.workload import Workload
from spec.types import KVCacheGroup, WorkerConfig

ENCODER_DECODER_SHARE = 0.3  # of the scenarios that may be encoder-decoder, the share that is
BLOCK_SIZES = (1, 2, 3, 4, 5, 8, 16, 17)


def with_encoder(config: WorkerConfig, workload: Workload, rng: random.Random) -> tuple[WorkerConfig, Workload]:
    """`config` with a cross_attention group (at a random index) and `workload` with an encoder length per request."""
    # up to twice the decoder's length: Whisper's encoder output (1500 frames) is longer than its decoder (448)
    max_encoder_len = rng.randint(1, 2 * config.max_model_len)
    block_size = rng.choice(BLOCK_SIZES)
    least = math.ceil(max_encoder_len / block_size) + 1  # one request's longest encoder output, and the null block
    num_blocks = rng.choice((least, least + rng.randint(1, 8), least * config.max_num_reqs + 1))
    groups = list(config.kv_groups)
    groups.insert(rng.randint(0, len(groups)), KVCacheGroup(block_size, num_blocks, kind="cross_attention"))
    config = replace(config, kv_groups=tuple(groups), max_encoder_len=max_encoder_len)
    requests = tuple(replace(r, encoder_len=rng.randint(1, max_encoder_len)) for r in workload.requests)
    return config, replace(workload, requests=requests)


def with_small_encoder(config: WorkerConfig, workload: Workload, rng: random.Random) -> tuple[WorkerConfig, Workload]:
    """A readable variant for `slotmap explain`: the cross group last, block size 4, 1..12 encoder tokens a request,
    blocks for every row's longest."""
    blocks = config.max_num_reqs * math.ceil(12 / 4) + 1
    groups = (*config.kv_groups, KVCacheGroup(4, blocks, kind="cross_attention"))
    config = replace(config, kv_groups=groups, max_encoder_len=12)
    requests = tuple(replace(r, encoder_len=rng.randint(1, 12)) for r in workload.requests)
    return config, replace(workload, requests=requests)
