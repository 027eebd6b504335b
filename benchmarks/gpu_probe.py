"""What a GPU step costs beyond time: fast's kernel launches, CUDA kernels and host syncs per apply + prepare.

Needs a CUDA device (run by scripts/gpu-check); writes JSON for slotmap/bench/gpu.py:

    python -m benchmarks.gpu_probe OUT_JSON

Triton launches are counted by wrapping fast.runtime.Kernel.__getitem__ (every fast kernel is launched as
`kernel[grid](...)`), host syncs by torch.cuda.set_sync_debug_mode("warn") (torch warns on every call that
waits for the device), CUDA kernels (Triton's and torch's copies) by the profiler.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import providers
from benchmarks.reference import started
from benchmarks.workloads import KERNEL_WORKLOADS, LAYER_WORKLOADS, StepStream, Workload

PROBED = ("decode-256", "mixed-64+2x512")


def _workload(name: str) -> Workload:
    for w in (*KERNEL_WORKLOADS, *LAYER_WORKLOADS):
        if w.name == name:
            return w
    raise ValueError(f"no workload named {name!r}")


def count_launches(fn: Callable[[], Any]) -> Counter[str]:
    """Triton launches `fn` makes, per kernel (all of fast's kernels launch through fast.runtime.Kernel)."""
    from fast.runtime import Kernel

    counts: Counter[str] = Counter()
    original = Kernel.__getitem__

    def counting(self: Kernel, grid: Any) -> Any:
        counts[self.fn.__name__] += 1
        return original(self, grid)

    Kernel.__getitem__ = counting  # type: ignore[method-assign]
    try:
        fn()
    finally:
        Kernel.__getitem__ = original  # type: ignore[method-assign]
    return counts


def _count_syncs(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _count_cuda_kernels(fn: Callable[[], Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def probe_step(name: str) -> dict[str, int]:
    """Three consecutive steady-state steps of the workload, each counted one way (counting perturbs timing)."""
    provider = providers.get("fast-cuda")
    stream = StepStream(_workload(name))
    pool = started(provider, stream)

    def counted(count: Callable[[Callable[[], Any]], Any]) -> tuple[Any, Any]:
        sched = stream.next()
        batches: list[Any] = []
        on_apply = count(lambda: pool.apply(sched))
        on_prepare = count(lambda: batches.append(pool.prepare(sched)))
        pool.record_sampled(batches[0], provider.asarray(stream.sampled(batches[0].num_reqs)))
        return on_apply, on_prepare

    apply_launches, prepare_launches = counted(count_launches)
    apply_syncs, prepare_syncs = counted(_count_syncs)
    apply_kernels, prepare_kernels = counted(_count_cuda_kernels)
    return {
        "apply_launches": sum(apply_launches.values()),
        "prepare_launches": sum(prepare_launches.values()),
        "host_syncs": apply_syncs + prepare_syncs,
        "cuda_kernels": apply_kernels + prepare_kernels,
    }


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("gpu_probe: no CUDA device; the probe measures GPU steps only", file=sys.stderr)
        return 2
    import triton

    out = {
        "device": torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
        "steps": {name: probe_step(name) for name in PROBED},
    }
    Path(argv[0]).write_text(json.dumps(out, indent=2))
    print(json.dumps(out["steps"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
