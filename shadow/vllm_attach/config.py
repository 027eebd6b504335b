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
    entries); its block 0 is vLLM's null block, as slotmap's. A group that is neither
    full attention nor sliding-window attention (Mamba state, chunked local attention, cross or
    encoder-only attention, MLA's compressed caches) is refused: slotmap's slot and table rules are those
    of token-to-slot paged attention only.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # only when attached

    groups = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        kv_spec = group.kv_cache_spec
        kind = type(kv_spec).__name__
        window: int | None
        if type(kv_spec) is SlidingWindowSpec:  # not SlidingWindowMLASpec
            window = int(kv_spec.sliding_window)
        elif type(kv_spec) is FullAttentionSpec:  # subclasses (cross, encoder-only, MLA) address KV otherwise
            if kv_spec.attention_chunk_size is not None:
                raise UnsupportedVllmConfigError(f"kv_cache_groups[{g}]: {kind} with chunked local attention")
            window = None if kv_spec.sliding_window is None else int(kv_spec.sliding_window)
        else:
            raise UnsupportedVllmConfigError(
                f"kv_cache_groups[{g}]: {kind} (layers {group.layer_names[:2]}...): slotmap models full and "
                "sliding-window attention groups only"
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
