"""Attention over the encoder's KV on torch tensors: spec/encoder_attention.py's cross_attention.

It reuses fast's paged attention (fast/attention.py: the Triton kernel, the interpreter on CPU tensors, and
the compiled CPU kernel in host mode): a query that sees all L encoder keys is a causal query at position
L - 1 of a row of length L. So every token becomes a row of its own, with one query, its request's cross
blocks and seq_len L. No device->host copy is needed to build those rows: tokens past query_start_loc[-1]
and rows with L = 0 are computed against one key and then zeroed. A prefill row's queries are then one
program (or work item) each rather than tiles of several: the same keys are read once per query.
"""

from __future__ import annotations

import torch

from fast.attention import paged_attention
from spec.encoder_attention import check_cross_attention_inputs


def cross_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim] the decoder's queries
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] the cross group's cache
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks] batch_idx -> the request's cross blocks
    encoder_seq_lens: torch.Tensor,  # [num_reqs] L of each row
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    *,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    check_cross_attention_inputs(query, key_cache, value_cache, block_table, encoder_seq_lens, query_start_loc, scale)
    num_tokens, num_reqs = query.shape[0], encoder_seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return torch.zeros_like(query)
    device = query.device
    tokens = torch.arange(num_tokens, device=device)  # [T]
    ends = query_start_loc[1:].to(torch.int64)  # [num_reqs]
    row = torch.searchsorted(ends, tokens, right=True).clamp(max=num_reqs - 1)  # [T] token -> its batch row
    lens = encoder_seq_lens.to(torch.int64)[row]  # [T] the keys each token reads
    real = (tokens < ends[-1]) & (lens > 0)  # [T] a token of a row with an encoder (others stay zero)
    out = paged_attention(
        query,
        key_cache,
        value_cache,
        block_table.index_select(0, row),  # [T, max_blocks] each token's request's cross blocks
        lens.clamp(min=1).to(encoder_seq_lens.dtype),  # [T] seq_len L: a query at position L - 1 sees all L keys
        torch.arange(num_tokens + 1, device=device, dtype=query_start_loc.dtype),  # [T + 1] one query per row
        scale=scale,
    )
    return torch.where(real[:, None, None], out, torch.zeros((), dtype=out.dtype, device=device))
