"""Why the bulk planner left a step to spec's plan_step: every way out of fast/validate.py, named and counted.

The fast pool plans a step with `plan_bulk_step` (compiled passes over all requests) and, where that
returns a `Fallback`, with spec's plan_step, which raises spec's exact error or accepts the step. The
fallback is a second path, so it is named: each member below is one reason, `pool.fallbacks` counts them
(a collections.Counter), and the host benchmarks record the counts beside their times.

Two kinds of reason: the step has a shape the bulk planner does not model (a resumed request, a feature's
groups, NumPy scalars for counts, ...), where a valid step costs plan_step's Python walk; or one of the bulk
checks failed (`failed_check`), where plan_step then raises the error the bulk check cannot name (or accepts:
a few bulk checks are stricter than spec's, such as a null placeholder appended to a windowed table).
"""

from __future__ import annotations

import enum


class Fallback(enum.Enum):
    """One reason the bulk planner hands a step to spec's plan_step."""

    # shapes the bulk planner does not model
    FEATURE = "a model-kind feature the bulk planner does not plan (`plans_in_bulk` false: spec's own, not fast's)"
    FEATURE_FIELDS = "a new request brings the fields of a feature the model lacks (check 1 refuses them)"
    CONTAINERS = "the output's containers or requests are not the plain dict, list, tuple, set and dataclasses"
    CACHED_REQUESTS = (
        "a resumed request without a whole table per group, or cached requests' fields of types read one by one"
    )
    REQUEST_KEYS = "no request scheduled, or num_scheduled_tokens' ids and counts not plain str and int"
    DRAFTS = "drafts not a dict of plain int ids, out of the vocabulary, or of unscheduled requests"
    BLOCK_IDS = "new block ids not lists or tuples of plain ints, one per group"
    # checks the bulk planner makes; plan_step names the error
    REQUEST_SET = "check 1: the scheduled requests are not the cached and the new ones, each once"
    BUDGET = "check 5: a count below 1, or more tokens than max_num_batched_tokens"
    UNKNOWN_REQUEST = "check 2: a cached request the pool does not hold, or its num_computed_tokens not ints"
    ROWS = "checks 2-4: a finished request scheduled or unknown, a new one already held, or no free row"
    PROGRESS = "checks 7-8: a cached request's positions past its known tokens (or its drafts)"
    NEW_REQUESTS = "checks 6-12 of a new request: its prompt, its tokens, its progress or its tables"
    TABLES = "checks 9-12 of a cached request's table in some group"
    SHARED_BLOCK = "check 13: a block written by two requests (plan_step compares their slots)"
    ONE_POOL = "check 9 with one block pool: an id held in two groups"
    ASYNC_RULES = "check 8 under async scheduling: drafts after unread drafts, placeholders, a resumption (5, 7, 8)"
    FEATURE_RULES = "checks 9-13 of a feature's own group: a mamba state not stored, past the table, null or shared"

    @property
    def failed_check(self) -> bool:
        """The bulk planner models the step and one of its checks failed (else: a shape it does not model)."""
        return self in _CHECKS


_CHECKS = frozenset(
    {
        Fallback.REQUEST_SET,
        Fallback.BUDGET,
        Fallback.UNKNOWN_REQUEST,
        Fallback.ROWS,
        Fallback.PROGRESS,
        Fallback.NEW_REQUESTS,
        Fallback.TABLES,
        Fallback.SHARED_BLOCK,
        Fallback.ONE_POOL,
        Fallback.ASYNC_RULES,
        Fallback.FEATURE_RULES,
    }
)
