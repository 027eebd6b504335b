"""MLA models in the reference scheduler's scenarios (spec/mla_cache.py): the decoder's KV in a latent (mla) group.

Two shapes, as vLLM builds them from a model's layers:
- every layer MLA (DeepSeek-V2/V3/R1, Kimi K2): one mla group, no other decoder group;
- MLA beside a sliding-window attention group (the DeepSeek-V3.2-style hybrids the brief of issue 40 names):
  an mla group and a windowed attention group, in either order.

An mla group's table and slots are an attention group's without a window (spec/types.py refuses one), so the
scheduler allocates it as a full-attention group (vLLM's MLAAttentionSpec is a FullAttentionSpec, served by its
FullAttentionManager). Block sizes stand for vLLM's MLA kernels' (FlashMLA and FlashInfer-MLA 64, CUTLASS MLA
128, Triton MLA any) scaled down to the tests' sequence lengths; the latent widths (kv_lora_rank 512 and
qk_rope_head_dim 64 in DeepSeek's config) likewise, with a NoPE latent (rope 0) among them.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from spec.types import KVCacheGroup, WorkerConfig

MLA_SHARE = 0.25  # of the scenarios that may be MLA models, the share that is
MLA_BLOCK_SIZES = (1, 2, 4, 8, 16)  # 64 and 128 scaled to max_model_len <= 160; 1 and 2 for per-token edges
KV_LORA_RANKS = (1, 4, 8)
ROPE_DIMS = (0, 2, 4)  # even (RoPE rotates pairs); 0: a NoPE latent, which vLLM allows


def with_mla_groups(config: WorkerConfig, rng: random.Random) -> WorkerConfig:
    """`config` with its self-attention groups replaced by an mla group, alone or beside a windowed attention group.

    Other groups (cross_attention, mamba) follow the decoder's, in their order. Each new group has room for one
    request at least (every table entry distinct, plus the null block), often for every row.
    """
    others = tuple(g for g in config.kv_groups if g.kind != "attention")
    mla = KVCacheGroup(
        (block_size := rng.choice(MLA_BLOCK_SIZES)),
        _num_blocks(config, block_size, rng),
        kind="mla",
        kv_lora_rank=rng.choice(KV_LORA_RANKS),
        qk_rope_head_dim=rng.choice(ROPE_DIMS),
    )
    decoder: tuple[KVCacheGroup, ...] = (mla,)
    if rng.random() < 0.5:  # a hybrid: sliding-window attention layers beside the MLA layers
        block_size = rng.choice(MLA_BLOCK_SIZES)
        window = rng.randint(1, config.max_model_len)
        windowed = KVCacheGroup(block_size, _num_blocks(config, block_size, rng), sliding_window=window)
        decoder = (mla, windowed) if rng.random() < 0.5 else (windowed, mla)
    return replace(config, kv_groups=(*decoder, *others))


def has_mla_group(config: WorkerConfig) -> bool:
    return any(g.kind == "mla" for g in config.kv_groups)


def _num_blocks(config: WorkerConfig, block_size: int, rng: random.Random) -> int:
    least = math.ceil(config.max_model_len / block_size) + 1  # conformance.scenario.min_blocks
    return rng.choice((least, least + rng.randint(1, 8), least * config.max_num_reqs + 1))
