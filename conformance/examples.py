"""The source articles' worked example as scheduler outputs, shared by tests, `slotmap demo` and docs.

Rows 0-5 hold six short requests; A lands on row 6 with blocks [81, 44], B on row 7 with [37, 12].
Step 1 prefills B's 31 prompt tokens and the first 16 of A's 24; B samples token `B_SAMPLED`.
Step 2 schedules B:1 and A:8, the step the articles draw.
"""

from __future__ import annotations

from dataclasses import dataclass

from spec.types import CachedRequest, KVCacheGroup, NewRequest, SchedulerOutput, WorkerConfig

BLOCK_SIZE = 16
A_PROMPT = tuple(range(100, 124))  # 24 tokens
B_PROMPT = tuple(range(200, 231))  # 31 tokens
B_SAMPLED = 777
FILLERS = tuple(f"R{i}" for i in range(6))


@dataclass(frozen=True)
class WorkedExample:
    config: WorkerConfig
    step1: SchedulerOutput
    step2: SchedulerOutput

    def sampled_after_step1(self, req_ids: tuple[str, ...]) -> list[int]:
        """What the model 'samples' in step 1, per batch row: B gets B_SAMPLED."""
        return [B_SAMPLED if r == "B" else 1 for r in req_ids]


def worked_example() -> WorkedExample:
    config = WorkerConfig(
        max_num_reqs=8,
        max_model_len=64,
        max_num_batched_tokens=128,
        vocab_size=1024,
        kv_groups=(KVCacheGroup(block_size=BLOCK_SIZE, num_blocks=128),),
    )
    fillers = tuple(NewRequest(r, (1, 2, 3, 4), ((i + 1,),)) for i, r in enumerate(FILLERS))
    step1 = SchedulerOutput(
        new_requests=(*fillers, NewRequest("A", A_PROMPT, ((81, 44),)), NewRequest("B", B_PROMPT, ((37, 12),))),
        num_scheduled_tokens={**{r: 4 for r in FILLERS}, "A": 16, "B": 31},
    )
    step2 = SchedulerOutput(
        cached_requests=(CachedRequest("B", 31), CachedRequest("A", 16)),
        num_scheduled_tokens={"B": 1, "A": 8},
    )
    return WorkedExample(config, step1, step2)
