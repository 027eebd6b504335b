"""DCP with real ranks: 2 and 4 processes over torch.distributed (gloo), each with its own pool (cp_ranks.py)."""

from __future__ import annotations

import pytest

from conformance.cp_ranks import run_ranks


@pytest.mark.parametrize(("world_size", "interleave"), [(2, 1), (4, 2)])
def test_ranks_as_processes_merge_to_single_rank_attention(world_size: int, interleave: int) -> None:
    assert run_ranks(world_size, interleave, backend="fast", seed=world_size) >= 6
