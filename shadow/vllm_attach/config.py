"""slotmap's WorkerConfig for a running vLLM, read from vLLM's own config objects."""

from __future__ import annotations

from typing import Any

from spec.types import KVCacheGroup, WorkerConfig


class UnsupportedVllmConfigError(ValueError):
    """A vLLM configuration slotmap cannot model (names the setting and why)."""


def worker_config_from_vllm(vllm_config: Any, kv_cache_config: Any) -> WorkerConfig:
    """The WorkerConfig of the model runner built from `vllm_config` (VllmConfig) and `kv_cache_config` (KVCacheConfig).

    One KVCacheGroup per vLLM KV cache group, in vLLM's order (group g is `block_table[g]` and
    `slot_mapping[g]` of the shadow checker). vLLM has one block pool for all groups, so every group gets
    `kv_cache_config.num_blocks` and `one_block_pool` is on (an id a group holds is in no other group's live
    entries); its block 0 is vLLM's null block, as slotmap's. An MLA group (`MLAAttentionSpec`: one latent
    vector per token, `head_size = kv_lora_rank + qk_rope_head_dim`, one "KV head") is a
    `KVCacheGroup(kind="mla")` with the widths its layers declare: its slots are an attention group's. Any
    other group (Mamba state, chunked local attention, cross or encoder-only attention, a windowed MLA
    group, DeepSeek-V4's sparse or padded MLA caches) is refused: slotmap's slot and table rules are those
    of token-to-slot paged attention only.
    """
    from vllm.v1.kv_cache_interface import (  # only when attached
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        kv_spec = group.kv_cache_spec
        kind = type(kv_spec).__name__
        window: int | None
        if type(kv_spec) is MLAAttentionSpec:
            groups.append(mla_group(vllm_config, kv_cache_config, g))
            continue
        if type(kv_spec) is SlidingWindowSpec:  # not SlidingWindowMLASpec
            window = int(kv_spec.sliding_window)
        elif type(kv_spec) is FullAttentionSpec:  # its subclasses (MLA's above, sinks, RSWA...): refused
            if kv_spec.attention_chunk_size is not None:
                raise UnsupportedVllmConfigError(f"kv_cache_groups[{g}]: {kind} with chunked local attention")
            window = None if kv_spec.sliding_window is None else int(kv_spec.sliding_window)
        else:
            raise UnsupportedVllmConfigError(
                f"kv_cache_groups[{g}]: {kind} (layers {group.layer_names[:2]}...): slotmap models full attention, "
                "sliding-window attention and MLA groups only"
            )
        groups.append(KVCacheGroup(int(kv_spec.block_size), int(kv_cache_config.num_blocks), window))
    if not groups:
        raise UnsupportedVllmConfigError("kv_cache_config.kv_cache_groups: empty (an attention-free model)")
    model, sched = vllm_config.model_config, vllm_config.scheduler_config
    return WorkerConfig(
        max_num_reqs=int(sched.max_num_seqs),
        max_model_len=int(model.max_model_len),
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        vocab_size=int(model.get_vocab_size()),
        kv_groups=tuple(groups),
        one_block_pool=True,
    )


def mla_group(vllm_config: Any, kv_cache_config: Any, g: int) -> KVCacheGroup:
    """Group g, an `MLAAttentionSpec` group, as an mla KVCacheGroup. The spec has only the sum of the two
    widths (its head_size), so kv_lora_rank and qk_rope_head_dim are read from the group's layers (vLLM's
    MLAAttention, in the forward context by layer name), which must agree with each other and with it."""
    group = kv_cache_config.kv_cache_groups[g]
    kv_spec = group.kv_cache_spec
    where = f"kv_cache_groups[{g}]: MLAAttentionSpec"
    # DeepSeek-V4's compressed and sparse caches (padded pages, several tokens a state); a window or chunk
    odd = dict(alignment=kv_spec.alignment, model_version=kv_spec.model_version, sliding_window=kv_spec.sliding_window,
               attention_chunk_size=kv_spec.attention_chunk_size)  # fmt: skip
    if any(v is not None for v in odd.values()) or kv_spec.tokens_per_state != 1:
        raise UnsupportedVllmConfigError(f"{where} with {odd}, tokens_per_state={kv_spec.tokens_per_state}")
    if kv_spec.num_kv_heads != 1:
        raise UnsupportedVllmConfigError(f"{where} with num_kv_heads={kv_spec.num_kv_heads}: one latent per token")
    layers = vllm_config.compilation_config.static_forward_context
    widths = {(int(layers[n].kv_lora_rank), int(layers[n].qk_rope_head_dim)) for n in group.layer_names}
    if len(widths) != 1:
        raise UnsupportedVllmConfigError(f"{where}: its layers' (kv_lora_rank, qk_rope_head_dim) differ: {widths}")
    ((rank, rope),) = widths
    if rank + rope != kv_spec.head_size:
        raise UnsupportedVllmConfigError(f"{where}: head_size {kv_spec.head_size} != kv_lora_rank {rank} + rope {rope}")
    return KVCacheGroup(int(kv_spec.block_size), int(kv_cache_config.num_blocks), None, kind="mla",
                        kv_lora_rank=rank, qk_rope_head_dim=rope)  # fmt: skip
