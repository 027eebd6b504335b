"""The features on torch tensors: spec/feature.py's protocol, with each feature's prepare on the device.

A fast feature is its spec feature (the same checks, plan and per-row state, so fast's host mirror validates
and commits exactly as spec does) whose record of the batch is built from device tensors: fast/mrope.py,
fast/cross_attention.py, fast/mamba.py. fast/pool.py calls them as spec's pool does and never names one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from spec.feature import Feature

if TYPE_CHECKING:
    from fast.state import DeviceState
    from spec.state import PoolState, StepPlan
    from spec.types import SchedulerOutput


@dataclass(frozen=True)
class Placement:
    """Where a fast pool's features keep their tensors and how they launch (fixed for the pool's life)."""

    dev: DeviceState  # the pool's device state: its device, its tables
    host_mode: bool  # CPU tensors sharing the host mirror's memory, compiled loops (fast/pool.py)
    interpret: bool  # Triton kernels through the interpreter

    @property
    def device(self) -> torch.device:
        return self.dev.device


class FastFeature(Feature):
    """A spec feature's fast form (a subclass of both), built with the pool's placement."""

    placement: Placement
    # its `plan_in_bulk` reads and checks the feature's fields of new requests (else a step whose new requests
    # bring them goes to plan_step, which checks them)
    reads_fields_in_bulk: ClassVar[bool] = False

    def own_tables(self) -> frozenset[int]:
        """The groups whose tables `plan_in_bulk` checks by the feature's own rules, where the decoder's tokens'
        positions say nothing (the encoder's KV): the bulk planner checks only their ids and width."""
        return frozenset()

    def plan_in_bulk(self, state: PoolState, sched: SchedulerOutput, new_rows: np.ndarray, plan: StepPlan,
                     marks: np.ndarray | None) -> Any:  # fmt: skip
        """fast's bulk planner's `plan` (fast/validate.py), for a feature with `plans_in_bulk`: its part of the
        plan, or the fast.fallback.Fallback that leaves the step to spec's plan_step. A feature with groups of its
        own checks their rules here (`marks`: the planner's scratch map over block ids, None for a pool too large
        for one); by default the feature's plan, made without reading the output again."""
        return self.plan(state, sched, new_rows, plan)
