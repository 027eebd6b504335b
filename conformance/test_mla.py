"""MLA models through the differential suite, once per backend: an mla group alone or beside a windowed attention
group (conformance/scheduler/mla.py), its latent cache written and read by both backends (conformance/mla_compare.py).

The Hypothesis suites draw MLA configs among the others (conformance.strategies.scenarios); the seeds here make
sure every shape runs on every backend whatever Hypothesis draws, and the controls show the comparison fails
on a backend whose MLA kernels are wrong.
"""

from __future__ import annotations

import random
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import spec
from conformance.backends import BackendHandle
from conformance.differential import DifferentialRun, MismatchError, drive
from conformance.scenario import Scenario, random_scenario
from conformance.scheduler.mla import has_mla_group, with_mla_groups
from spec.types import KVCacheGroup, WorkerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conformance/pytest_plugin.py

# seeds whose random_scenario(seed, spec_decode=True, mla=True) is an MLA model: alone (36: block size 1, a NoPE
# latent in float16), beside a windowed group (1: an fp8 cache; 20: the window's group first; 40: fp8 e5m2)
SEEDS = (1, 20, 36, 40)
SLOW_SEEDS = (20, 40)  # the Triton interpreter's budget: a few steps of two


def _scenario(seed: int) -> Scenario:
    return random_scenario(seed, spec_decode=True, mla=True)


def test_the_seeds_cover_both_shapes_fp8_and_a_nope_latent() -> None:
    scenarios = [_scenario(seed) for seed in SEEDS]
    assert all(has_mla_group(s.config) and s.attention is not None for s in scenarios)
    kinds = [tuple(g.kind for g in s.config.kv_groups) for s in scenarios]
    assert ("mla",) in kinds and ("mla", "attention") in kinds and ("attention", "mla") in kinds
    assert all(g.sliding_window for s in scenarios for g in s.config.kv_groups if g.kind == "attention")
    assert {s.attention.kv_cache_dtype for s in scenarios if s.attention} >= {"auto", "fp8_e4m3", "fp8_e5m2"}
    assert any(g.qk_rope_head_dim == 0 for s in scenarios for g in s.config.kv_groups if g.kind == "mla")


def test_with_mla_groups_gives_valid_configs() -> None:
    """Every drawn shape is a config spec accepts, with room for one request in every group; non-decoder groups
    stay, after the decoder's."""
    groups = (KVCacheGroup(4, 11), KVCacheGroup(2, 30, kind="cross_attention"))
    base = WorkerConfig(3, 40, 32, 100, groups, max_encoder_len=20)
    shapes = set()
    for seed in range(40):
        config = with_mla_groups(base, random.Random(seed))
        kinds = tuple(g.kind for g in config.kv_groups)
        shapes.add(kinds)
        assert kinds[-1] == "cross_attention" and kinds.count("mla") == 1
        for g in config.kv_groups[:-1]:
            assert g.num_blocks >= -(-config.max_model_len // g.block_size) + 1
    assert shapes == {("mla", "cross_attention"), ("mla", "attention", "cross_attention"),
                      ("attention", "mla", "cross_attention")}  # fmt: skip


def test_mla_scenarios_agree_on_every_step(backend: BackendHandle) -> None:
    steps = 0
    for seed in SLOW_SEEDS if backend.slow else SEEDS:
        run = DifferentialRun(_scenario(seed), backend)
        drive(run, 8 if backend.slow else 200)
        steps += run.steps
    assert steps >= (8 if backend.slow else 100)


def _broken(name: str, **kernels: Callable[..., Any]) -> BackendHandle:
    """spec with some MLA kernels replaced."""
    module = types.SimpleNamespace(
        RequestStatePool=spec.RequestStatePool, write_kv=spec.write_kv, paged_attention=spec.paged_attention,
        write_mla_kv=spec.write_mla_kv, mla_decode_attention=spec.mla_decode_attention,
        mla_prefill_attention=spec.mla_prefill_attention,
    )  # fmt: skip
    for key, fn in kernels.items():
        setattr(module, key, fn)
    return BackendHandle(name, module)


def _swapped_write(cache: np.ndarray, kv_c: np.ndarray, k_pe: np.ndarray, slots: np.ndarray, **kw: Any) -> None:
    """The RoPE part stored first, then the latent: each entry a rotation of the right one."""
    whole = np.concatenate([k_pe, kv_c], axis=1)  # [T, R + L]
    spec.write_mla_kv(cache, whole[:, : kv_c.shape[1]], whole[:, kv_c.shape[1] :], slots, **kw)


def _no_rope_decode(q_latent: np.ndarray, q_pe: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
    """The absorbed form without the RoPE part's logits (a kernel that drops q_pe . k_pe)."""
    return np.asarray(spec.mla_decode_attention(q_latent, np.zeros_like(q_pe), *args, **kwargs))


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (_broken("swapped-write", write_mla_kv=_swapped_write), r"write_mla_kv\[0\]: latent cache differs"),
        (_broken("no-rope-decode", mla_decode_attention=_no_rope_decode), r"mla_decode_attention\[0\]"),
    ],
    ids=["swapped-write", "no-rope-decode"],
)
def test_a_wrong_mla_kernel_is_caught(broken: BackendHandle, message: str) -> None:
    """Controls: seed 11 is an MLA model alone, rope part 4 wide (so a swap moves values), float32, auto cache."""
    scenario = _scenario(11)
    assert [g.kind for g in scenario.config.kv_groups] == ["mla"] and scenario.config.kv_groups[0].qk_rope_head_dim
    run = DifferentialRun(scenario, broken)
    with pytest.raises(MismatchError, match=message):
        drive(run, 200)
