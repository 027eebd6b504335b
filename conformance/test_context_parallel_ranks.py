"""DCP with real ranks: 2 and 4 processes over torch.distributed (gloo), each with its own pool (cp_ranks.py); an
mla group over 2 of them."""

from __future__ import annotations

import pytest

from conformance.cp_ranks import run_ranks


@pytest.mark.parametrize(("world_size", "interleave"), [(2, 1), (4, 2)])
def test_ranks_as_processes_merge_to_single_rank_attention(world_size: int, interleave: int) -> None:
    assert run_ranks(world_size, interleave, backend="fast", seed=world_size) >= 6


def test_mla_ranks_as_processes_merge_to_single_rank_decode() -> None:
    """An mla group sharded over 2 processes, interleave 2: each holds its latents, the partial absorbed decodes
    all-gathered and merged equal spec's single-rank mla_decode_attention (conformance/mla_context_parallel.py)."""
    assert run_ranks(2, 2, backend="fast", seed=7, max_steps=8, mla=True) >= 6
