"""`slotmap explain --cp N`: one step's tokens on each rank of decode context parallelism (spec.context_parallel).

The step's pool is the rank-agnostic one: each sharded group's block is the virtual block of bs * N tokens,
so the pool's block size must be a multiple of N (groups with a sliding window are replicated). For every
token the table gives its virtual slot (the pool's), the rank holding it and its slot there; per batch row,
each rank's local sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.table import Table

from slotmap.pictures.steps import StepView
from spec.context_parallel import ContextParallel, cp_slot_mapping, local_seq_lens
from spec.types import PAD_SLOT_ID


@dataclass(frozen=True)
class RankToken:
    flat_idx: int
    req_id: str | None  # None: padding
    position: int
    slots: tuple[tuple[int, ...], ...]  # per group, per rank: the slot in that rank's cache, or PAD_SLOT_ID


@dataclass(frozen=True)
class RankExplanation:
    world_size: int
    interleave: int
    sharded: tuple[int, ...]  # the sharded groups; the others are replicated
    block_sizes: tuple[int, ...]  # per group: tokens per block of a rank's cache
    pool_slots: tuple[tuple[int, ...], ...]  # per group: [T] the pool's (virtual) slots
    tokens: tuple[RankToken, ...]
    req_ids: tuple[str, ...]  # batch_idx -> req_id
    seq_lens: tuple[int, ...]  # batch_idx -> seq_len
    local_seq_lens: tuple[tuple[int, ...], ...]  # per rank: batch_idx -> local seq_len of the sharded groups


def explain_ranks(view: StepView, world_size: int, interleave: int = 1) -> RankExplanation:
    """Every rank's slots and lengths of the step; ValueError (from ContextParallel) when the split does not fit."""
    config, batch = view.config, view.batch
    sharded = tuple(g for g, group in enumerate(config.kv_groups) if group.sliding_window is None)
    cps = [ContextParallel(world_size, r, interleave, sharded) for r in range(world_size)]
    cps[0].check_config(config)
    per_group = []
    for g in range(len(config.kv_groups)):
        if g in sharded:
            bs = cps[0].block_size(config, g)
            per_group.append([
                cp_slot_mapping(batch["positions"], batch["query_start_loc"], batch["block_tables"][g], bs, cp)
                for cp in cps
            ])  # fmt: skip
        else:
            per_group.append([np.asarray(batch["slot_mappings"][g])] * world_size)
    rows = np.repeat(np.arange(len(batch["req_ids"])), np.diff(batch["query_start_loc"]))
    tokens = tuple(
        RankToken(
            t,
            batch["req_ids"][rows[t]] if t < len(rows) else None,
            int(batch["positions"][t]),
            tuple(tuple(int(s[t]) for s in ranks) for ranks in per_group),
        )
        for t in range(int(batch["num_tokens_padded"]))
    )
    return RankExplanation(
        world_size, interleave, sharded, tuple(cps[0].block_size(config, g) for g in range(len(config.kv_groups))),
        tuple(tuple(int(s) for s in batch["slot_mappings"][g]) for g in range(len(config.kv_groups))), tokens,
        tuple(batch["req_ids"]), tuple(int(n) for n in batch["seq_lens"]),
        tuple(tuple(int(n) for n in local_seq_lens(np.asarray(batch["seq_lens"]), cp)) for cp in cps),
    )  # fmt: skip


def render_ranks(ex: RankExplanation, console: Console) -> None:
    console.rule(f"decode context parallelism: {ex.world_size} ranks, interleave {ex.interleave}")
    for g, block_size in enumerate(ex.block_sizes):
        kind = "sharded" if g in ex.sharded else "replicated (the pool's slots on every rank)"
        table = Table(title=f"KV group {g}, {kind}: position → slot on each rank (block size {block_size} per rank)")
        for col in ("flat idx", "req_id", "position", "pool slot", *(f"rank {r}" for r in range(ex.world_size))):
            table.add_column(col, justify="right")
        for t in ex.tokens:
            cells = ["-" if s == PAD_SLOT_ID else str(s) for s in t.slots[g]]
            table.add_row(
                str(t.flat_idx), t.req_id or "pad", str(t.position), str(ex.pool_slots[g][t.flat_idx]), *cells
            )
        console.print(table)
    lens = Table(title="local seq_lens of the sharded groups: batch_idx → KV entries on each rank")
    for col in ("batch_idx", "req_id", "seq_len", *(f"rank {r}" for r in range(ex.world_size))):
        lens.add_column(col, justify="right")
    for b, req_id in enumerate(ex.req_ids):
        lens.add_row(str(b), req_id, str(ex.seq_lens[b]), *(str(ranks[b]) for ranks in ex.local_seq_lens))
    console.print(lens)
    console.print(f"-: PAD_SLOT_ID ({PAD_SLOT_ID}) on that rank, which write_kv skips")
