"""The shadow checker's reproduction: a script that replays the recorded steps through a fresh checker.

It is written with `shadow.private_files` (a private directory unless the caller named one, a new
file never replacing anything) and raises the same report at the same step when run from the
repository root.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import numpy as np

from shadow.inputs import ShadowStep
from spec.types import WorkerConfig

IMPORTS = (
    "from shadow.checker import ShadowStep, replay\n"
    "from shadow.inputs import UnreadableOutput\n"
    "from spec.interop.vllm import VllmCachedRequestData, VllmNewRequestData, VllmSchedulerOutput\n"
    "from spec.types import CachedRequest, CachedRequestColumns, KVCacheGroup, NewRequest, SchedulerOutput\n"
    "from spec.types import WorkerConfig\n"
    "from shadow.compare_padding import EnginePadding\n"
    "from spec.graphs import BatchDescriptor, CapturedGraphs\n"
    "from spec.padding_profiles import PaddingProfile\n"
)


def reproduction(
    config: WorkerConfig, steps: Sequence[ShadowStep], options: Mapping[str, object], target: tuple[int, int]
) -> str:
    """The script's text: `replay(config, steps, **options, target=target)` over every step so far."""
    with np.printoptions(threshold=sys.maxsize):  # a repr must hold every entry, never "..."
        body = [
            '"""Written by shadow.checker: replays an engine\'s steps through spec and raises the same report."""',
            "import numpy as np",
            "from numpy import array, bool_, int8, int16, int32, int64, uint8, uint16, uint32, uint64  # noqa: F401",
            "",
            IMPORTS,
            f"config = {config!r}",
            "steps = [",
            *(
                f"    ShadowStep({s.sched!r}, {tuple(s.req_ids)!r}, {_arrays(s.arrays)}, {_array(s.sampled)}, "
                f"{s.proposed!r}, {s.padding!r}),"
                for s in steps
            ),
            "]",
            f"replay(config, steps, {', '.join(f'{k}={v!r}' for k, v in options.items())}, target={target!r})",
            "",
        ]
    return "\n".join(body)


def _arrays(arrays: Mapping[str, np.ndarray]) -> str:
    return "{" + ", ".join(f"{k!r}: {_array(v)}" for k, v in arrays.items()) + "}"


def _array(a: np.ndarray | None) -> str:
    return "None" if a is None else f"np.array({a.tolist()!r}, {str(a.dtype)!r}).reshape({a.shape!r})"
