"""The model kinds slotmap knows: every feature (spec/feature.py), in the order the core calls their hooks."""

from __future__ import annotations

from spec.cross_attention import CrossAttention
from spec.feature import Feature
from spec.mamba import Mamba
from spec.mrope import MRope
from spec.types import WorkerConfig


def features_for(config: WorkerConfig) -> tuple[Feature, ...]:
    """The config's features, each a fresh instance (its per-row state empty), in a fixed order."""
    return tuple(kind(config) for kind in known_features() if kind.configured(config))


def known_features() -> tuple[type[Feature], ...]:
    """Every feature the project knows, in the order their checks run."""
    return (CrossAttention, MRope, Mamba)
