"""What to drive, independent of any engine: scheduler knobs, a workload seed and the workload's shape.

The engine's own config (block size, blocks, rows, max_model_len, vocabulary) comes from the runner when the
drive starts (`worker_config_from_vllm`), so one plan drives any model. `scheduler_blocks` lets the scheduler
use only the first blocks of the runner's pool (few blocks: preemption), whatever the engine was built with.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from conformance.scheduler import SchedulerKnobs, Workload
from conformance.vllm_drive.workload import lookup_workload
from spec.types import WorkerConfig


@dataclass(frozen=True)
class DrivePlan:
    knobs: SchedulerKnobs = field(default_factory=SchedulerKnobs)
    seed: int = 0  # the workloads' and schedulers' seed: round r uses round_seed(r), drawn from (seed, r)
    num_requests: int = 8
    max_arrival_step: int = 8
    max_prompt_len: int | None = None  # None: up to max_model_len less the request's new tokens
    max_new_tokens: int = 24
    num_prefixes: int = 2
    random_share: float = 0.25  # of the prompt bodies, the share of random tokens (the rest repeat a motif)
    scheduler_blocks: int | None = None  # the scheduler's pool: blocks 0..n-1 of the runner's (None: all of them)

    def round_seed(self, round_index: int) -> int:
        """Round r's seed: independent of other plans' rounds (seeds s and s + 1 share none of their rounds)."""
        return (
            self.seed if round_index == 0 else random.Random(f"drive {self.seed} round {round_index}").randrange(2**32)
        )

    def workload(self, config: WorkerConfig, round_index: int, tag: str) -> Workload:
        return lookup_workload(self.round_seed(round_index), config, tag=tag, num_requests=self.num_requests,
                               max_arrival_step=self.max_arrival_step, max_prompt_len=self.max_prompt_len,
                               max_new_tokens=self.max_new_tokens, num_prefixes=self.num_prefixes,
                               random_share=self.random_share)  # fmt: skip

    def scheduler_config(self, runner_config: WorkerConfig) -> WorkerConfig:
        """The runner's config, its pool cut to scheduler_blocks (block ids stay valid for the runner)."""
        n = self.scheduler_blocks
        if n is None:
            return runner_config
        most, least = min(g.num_blocks for g in runner_config.kv_groups), len(runner_config.kv_groups) + 1
        if not least <= n <= most:  # one block for each group, besides the null block: any request can start
            raise ValueError(f"scheduler_blocks: {least} .. {most} (the runner's blocks), got {n}")
        return replace(runner_config, kv_groups=tuple(replace(g, num_blocks=n) for g in runner_config.kv_groups))
