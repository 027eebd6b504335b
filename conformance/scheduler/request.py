"""One request as the scheduler model tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conformance.scheduler.workload import WorkloadRequest


class Status(enum.Enum):
    WAITING = "waiting"  # arrived, holds no row yet
    RUNNING = "running"  # holds a row and blocks
    PREEMPTED = "preempted"  # holds a row but no blocks; resumes with resumed=True
    FINISHED = "finished"


@dataclass
class SchedRequest:
    spec: WorkloadRequest
    num_groups: int
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)  # prompt, then sampled
    num_computed: int = 0  # tokens whose KV is in the cache
    num_output: int = 0
    blocks: list[list[int]] = field(default_factory=list)  # per group: what it holds, null where released
    pool_tables: list[list[int]] = field(default_factory=list)  # per group: the pool's table for its row
    num_hashed: list[int] = field(default_factory=list)  # per group: full blocks already registered
    hashes: list[list[int]] = field(default_factory=list)  # per group: chained hashes of its full blocks
    # async scheduling, between a step's update and the next schedule: the drafts it rejected, which the next
    # output still counts as tokens, and the drafts it verified (the next step may not draft: spec/async_steps.py)
    phantom: int = 0
    unverified: int = 0
    proposed: list[int] = field(default_factory=list)  # drafts on the device: the drafter's ids at its last sample

    def __post_init__(self) -> None:
        self.tokens = list(self.spec.prompt_token_ids)
        self.blocks = [[] for _ in range(self.num_groups)]
        self.pool_tables = [[] for _ in range(self.num_groups)]
        self.num_hashed = [0] * self.num_groups
        self.hashes = [[] for _ in range(self.num_groups)]

    @property
    def req_id(self) -> str:
        return self.spec.req_id

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def holds_row(self) -> bool:
        return self.status in (Status.RUNNING, Status.PREEMPTED)

    def block_hashes(self, group: int, block_size: int) -> list[int]:
        """Chained hashes of every full block of its known tokens: hash(parent hash, block tokens)."""
        chain = self.hashes[group]
        for j in range(len(chain), self.num_tokens // block_size):
            parent = chain[-1] if chain else 0
            block = tuple(self.tokens[j * block_size : (j + 1) * block_size])
            chain.append(hash((parent, block, self.mrope_key(j * block_size, (j + 1) * block_size))))
        return chain

    def mrope_key(self, start: int, end: int) -> tuple[tuple[int, ...], ...] | None:
        """A multimodal request's M-RoPE positions of tokens start..end (spec/mrope.py), part of its block hashes:
        KV computed at other positions is other KV (vLLM keys such blocks by their images too). None for text."""
        table, delta = self.spec.mrope_positions, self.spec.mrope_position_delta
        if table is None:
            return None
        prompt_len = len(table[0])
        return tuple(tuple(row[p] if p < prompt_len else p + delta for p in range(start, end)) for row in table)
