"""The model kinds in fast: each spec feature's fast form (fast/feature.py), in spec's order."""

from __future__ import annotations

from collections.abc import Callable

from fast.cross_attention import FastCrossAttention
from fast.feature import FastFeature, Placement
from fast.mamba import FastMamba
from fast.mrope import FastMRope
from spec.cross_attention import CrossAttention
from spec.feature import Feature
from spec.mamba import Mamba
from spec.model_kinds import known_features
from spec.mrope import MRope
from spec.types import WorkerConfig

FAST_FORM: dict[type[Feature], Callable[[WorkerConfig, Placement], FastFeature]] = {
    CrossAttention: FastCrossAttention,
    MRope: FastMRope,
    Mamba: FastMamba,
}


def fast_features_for(config: WorkerConfig, placement: Placement) -> tuple[FastFeature, ...]:
    """The config's features in spec's order, each in its fast form."""
    return tuple(FAST_FORM[kind](config, placement) for kind in known_features() if kind.configured(config))
