"""Every way a scheduler output (or a sampled token) can be invalid, one class each.

Both backends raise the same class for the same input, and raise it before changing anything.
"""

from __future__ import annotations


class ScheduleError(ValueError):
    """An invalid input to the pool. `req_id` and `field` say where; the pool is unchanged."""

    def __init__(self, req_id: str | None, field: str, detail: str) -> None:
        self.req_id = req_id
        self.field = field
        self.detail = detail
        who = f"request {req_id!r}" if req_id is not None else "scheduler output"
        super().__init__(f"{who}: {field}: {detail}")


class InconsistentSchedulerOutputError(ScheduleError):
    """The output contradicts itself: scheduled set != new + cached, new and finished at once, ..."""


class UnknownRequestError(ScheduleError):
    """A cached or finished request that holds no row."""


class DuplicateRequestError(ScheduleError):
    """A new request whose req_id already holds a row."""


class PoolFullError(ScheduleError):
    """More live requests than `max_num_reqs` rows."""


class BlockIdError(ScheduleError):
    """A block id outside [0, num_blocks), repeated in one table, or the null block misused."""


class NullBlockError(BlockIdError):
    """A scheduled token would write to, or attend through, the null block."""


class BlockTableOverflowError(ScheduleError):
    """More blocks than `max_blocks_per_req` for a group."""


class MissingBlockError(ScheduleError):
    """A scheduled token's position lies past the blocks the request holds."""


class DuplicateSlotError(ScheduleError):
    """Two tokens of one step would write the same KV slot."""


class TokenBudgetError(ScheduleError):
    """More scheduled tokens than `max_num_batched_tokens`."""


class ModelLengthError(ScheduleError):
    """A request would hold more than `max_model_len` tokens."""


class UnknownTokenError(ScheduleError):
    """A scheduled position past the request's known tokens (its input id does not exist yet)."""


class TokenIdError(ScheduleError):
    """A token id outside [0, vocab_size)."""


ALL_ERRORS: tuple[type[ScheduleError], ...] = (
    InconsistentSchedulerOutputError,
    UnknownRequestError,
    DuplicateRequestError,
    PoolFullError,
    BlockIdError,
    NullBlockError,
    BlockTableOverflowError,
    MissingBlockError,
    DuplicateSlotError,
    TokenBudgetError,
    ModelLengthError,
    UnknownTokenError,
    TokenIdError,
)
