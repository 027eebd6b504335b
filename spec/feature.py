"""Model-kind features: the one protocol through which M-RoPE, cross-attention and Mamba reach the pipeline.

The core (spec/validate.py, spec/state.py, spec/pool.py) is a plain decoder's pipeline. What a model kind
adds (fields of a new request, per-row state, rules for a group of its own, fields of the batch) comes
through a `Feature`, one file per kind: spec/mrope.py, spec/cross_attention.py, spec/mamba.py (and fast's
counterparts of the same names). The core calls the hooks below, in this order, for the features the config
has, and never asks which feature it is calling:

    validate   check 1   Feature.check_request_fields   (every known feature: refuses its fields on a model without it)
               ...       feature.read                    what its checks and its plan need of each request
               check 7   Feature.check_request_lengths  (every known feature)
               9 .. 13   GroupRules of its groups        (spec/group_rules.py: the table rules of a group it owns)
               plan      feature.plan                    its part of the StepPlan, frozen (plan.features[name])
    commit               feature.commit                  its per-row state, after the core's commit
    prepare              feature.prepare                 its record of the batch (BatchInputs.features)
               graphs    feature.pad                     its record's padded request rows (spec/padding.py)

A model without features (a plain decoder) runs none of the per-pool hooks: `spec.model_kinds.features_for`
gives it none. The class-level checks run for every known feature, since a request may bring, say, an
M-RoPE table to a model without M-RoPE, which check 1 refuses.

A feature instance belongs to one pool (its `features`) and keeps its per-row state (M-RoPE tables, encoder
lengths, each row's last step for its mamba read) itself; the core's `PoolState` holds none of it.
Asynchronous scheduling is not a feature (it is a mode of the pool, spec/async_steps.py), and drafts are in
the core, as in vLLM's input batch.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from spec.group_rules import ATTENTION_RULES, GroupRules
from spec.request import ScheduledRequest
from spec.types import BatchInputs, NewRequest, SchedulerOutput, WorkerConfig

if TYPE_CHECKING:
    from spec.state import PoolState, StepPlan

F = TypeVar("F", bound="Feature")


class Feature(abc.ABC):
    """One model kind's part of the pipeline. A subclass overrides the hooks it needs; the rest do nothing."""

    name: ClassVar[str]  # the key of its part in StepPlan.features
    # A bulk planner (fast/validate.py) may plan the decoder's part of a step and then call `plan`: the feature's
    # checks are all on the fields of new requests (left to plan_step when given) and it owns no group, or its
    # fast form reads those fields and checks its groups' rules itself (fast/feature.py, FastFeature.plan_in_bulk)
    plans_in_bulk: ClassVar[bool] = False

    # ---- asked of every feature the project knows, configured or not ----------------------------------------
    @classmethod
    @abc.abstractmethod
    def configured(cls, config: WorkerConfig) -> bool:
        """The config turns the feature on (a group of its kind, or a flag)."""

    @classmethod
    def check_request_fields(cls, new_requests: Sequence[NewRequest], config: WorkerConfig) -> None:
        """Check 1 (InconsistentSchedulerOutputError): the feature's fields of each new request, well formed."""
        return  # a kind without this part: nothing to do

    @classmethod
    def check_request_lengths(cls, new_requests: Sequence[NewRequest], config: WorkerConfig) -> None:
        """Check 7 (ModelLengthError): the lengths the feature's fields give, within the model's."""
        return  # a kind without this part: nothing to do

    @classmethod
    def fields_given(cls, new_requests: Sequence[NewRequest]) -> bool:
        """Some new request sets one of the feature's fields (away from its default, which every request may
        leave): a planner that reads no feature fields leaves such a step to plan_step."""
        return False

    # ---- a configured feature -----------------------------------------------------------------------------
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config

    def group_rules(self) -> dict[int, GroupRules]:
        """The KV groups whose table rules (checks 9 to 13, slots) are the feature's, by group index."""
        return {}

    def read(self, state: PoolState, sched: SchedulerOutput, scheduled: list[ScheduledRequest]) -> None:
        """Before check 7: what the feature's checks and plan need of each scheduled request, read from the pool
        state as it is before the step and kept until the next read. Raises nothing: the checks decide."""
        return  # a kind without this part: nothing to do

    def plan(self, state: PoolState, sched: SchedulerOutput, new_rows: np.ndarray, plan: StepPlan) -> Any:
        """After check 13: the feature's part of the step, frozen (StepPlan.features[name]); None: nothing to keep.

        `new_rows` [k] are the new requests' rows, in `sched.new_requests` order; `plan` is the core's plan."""
        return None

    def commit(self, state: PoolState, plan: StepPlan) -> None:
        """After the core's commit: the feature's per-row state. A freed row's state goes with it."""
        return  # a kind without this part: nothing to do

    @abc.abstractmethod
    def prepare(self, state: PoolState, plan: StepPlan, batch: BatchInputs, order: np.ndarray | None) -> Any:
        """The feature's record of the batch (one entry of BatchInputs.features), from the core's batch.

        `order` [num_reqs] batch_idx -> index in the plan's scheduler order (None: the same order)."""

    @abc.abstractmethod
    def pad(self, record: Any, num_reqs_padded: int, pad_rows: Callable[[str, Any, int, Any], Any]) -> Any:
        """The feature's record with its request rows padded to `num_reqs_padded` (spec/padding.py): what a padded
        row of a FULL graph holds in each of its fields. `pad_rows(key, array, rows, value)` is the backend's row
        padder (spec.padding.pad_rows; fast's keeps a buffer per key); token-indexed fields are already padded."""


def group_rules(config: WorkerConfig, features: Sequence[Feature]) -> tuple[GroupRules, ...]:
    """Per KV group, its table rules: a feature's for the groups it owns, the decoder's own (attention) otherwise."""
    owned: dict[int, GroupRules] = {}
    for feature in features:
        owned.update(feature.group_rules())
    return tuple(owned.get(g, ATTENTION_RULES) for g in range(len(config.kv_groups)))


def in_batch_order(values: np.ndarray, order: np.ndarray | None) -> np.ndarray:
    """An array in the plan's scheduler order, in batch order (`order` as in Feature.prepare)."""
    return values if order is None else values[order]


def find(features: Sequence[Feature], kind: type[F]) -> F | None:
    """The instance of a feature class among a pool's features, or None where its config lacks the feature."""
    return next((f for f in features if isinstance(f, kind)), None)
