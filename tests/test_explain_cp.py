"""`slotmap explain --cp N`: each rank's slots of a step, checked against the round-robin definition."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conformance.backends import load_backend
from conformance.context_parallel import owner_slot
from slotmap.cli import app
from slotmap.pictures.ranks import explain_ranks
from slotmap.pictures.steps import seeded_step, worked_example_step
from spec.context_parallel import ContextParallel
from spec.types import PAD_SLOT_ID

WIDE = {"COLUMNS": "200"}


@pytest.mark.parametrize(("world_size", "interleave"), [(2, 1), (2, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize("seeded", [False, True], ids=["worked-example", "seed-1"])
def test_each_token_is_on_its_round_robin_rank_and_replicated_groups_keep_the_pool_slots(
    world_size: int, interleave: int, seeded: bool
) -> None:
    spec = load_backend("spec")
    view = seeded_step(spec, 1, 4) if seeded else worked_example_step(spec)
    ex = explain_ranks(view, world_size, interleave)
    rows = {r: b for b, r in enumerate(view.batch["req_ids"])}
    assert ex.sharded == tuple(g for g, grp in enumerate(view.config.kv_groups) if grp.sliding_window is None)
    for t in ex.tokens:
        for g, per_rank in enumerate(t.slots):
            if t.req_id is None:
                assert set(per_rank) == {PAD_SLOT_ID}
            elif g in ex.sharded:
                table = view.batch["block_tables"][g][rows[t.req_id]]
                owner, slot = owner_slot(
                    t.position, table, ex.block_sizes[g], ContextParallel(world_size, 0, interleave)
                )
                assert per_rank == tuple(slot if r == owner else PAD_SLOT_ID for r in range(world_size))
            else:
                assert per_rank == (ex.pool_slots[g][t.flat_idx],) * world_size
    assert [sum(ranks[b] for ranks in ex.local_seq_lens) for b in range(len(ex.req_ids))] == list(ex.seq_lens)


def test_cli_explain_cp_prints_every_rank() -> None:
    result = CliRunner().invoke(app, ["explain", "--seed", "1", "--cp", "2"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "decode context parallelism: 2 ranks" in result.output
    assert "KV group 0, sharded" in result.output and "KV group 1, replicated" in result.output
    assert "rank 1" in result.output and "local seq_lens" in result.output


def test_cli_explain_cp_refuses_a_block_size_the_ranks_cannot_split() -> None:
    result = CliRunner().invoke(app, ["explain", "--cp", "3"], env=WIDE)  # the worked example's blocks hold 16
    assert result.exit_code == 2
    assert "block_size 16" in result.output
