"""Multimodal requests for a model with M-RoPE (spec/mrope.py): plausible position tables, as a processor makes them.

A prompt is laid out as Qwen2-VL's processor lays it out: runs of text (three equal rows, one position
a token), and image or video blocks of t x h x w tokens, whose rows are the grid coordinates offset by the
position the block starts at; text after a block continues from the block's largest position + 1. The
delta is vLLM's: `max(table) + 1 - prompt_len` (past the prompt, position p is p + delta on every row).
"""

from __future__ import annotations

import random
from dataclasses import replace

from conformance.scheduler.workload import Workload

Table = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]

MULTIMODAL_SHARE = 0.6  # of a multimodal workload's requests, the share that carries an image or video


def position_table(prompt_len: int, rng: random.Random) -> tuple[Table, int]:
    """A `[3, prompt_len]` table of text runs and grid blocks, and its delta."""
    rows: tuple[list[int], list[int], list[int]] = ([], [], [])
    start = 0  # the position the next text token or block starts at
    while len(rows[0]) < prompt_len:
        room = prompt_len - len(rows[0])
        grid = (rng.randint(1, 2), rng.randint(1, 4), rng.randint(1, 4))  # t x h x w (t > 1: a video)
        if room >= 2 and grid[0] * grid[1] * grid[2] <= room and rng.random() < 0.5:
            for ti in range(grid[0]):
                for hi in range(grid[1]):
                    for wi in range(grid[2]):
                        rows[0].append(start + ti)
                        rows[1].append(start + hi)
                        rows[2].append(start + wi)
            start += max(grid)
        else:
            for p in range(start, start + rng.randint(1, room)):
                for row in rows:
                    row.append(p)
            start = rows[0][-1] + 1
    delta = max(max(row) for row in rows) + 1 - prompt_len
    return (tuple(rows[0]), tuple(rows[1]), tuple(rows[2])), delta


def with_position_tables(workload: Workload, seed: int, share: float = MULTIMODAL_SHARE) -> Workload:
    """`workload` with a table and delta on about `share` of its requests (the others stay text requests)."""
    rng = random.Random(seed)
    requests = []
    for request in workload.requests:
        if rng.random() < share:
            table, delta = position_table(len(request.prompt_token_ids), rng)
            request = replace(request, mrope_positions=table, mrope_position_delta=delta)
        requests.append(request)
    return Workload(tuple(requests))
