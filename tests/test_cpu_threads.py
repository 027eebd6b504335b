"""fast's CPU kernels and Numba's threading layer (fast.cpu.threads): TBB where the wheel is installed, and
kernels launched from several Python threads at once.

Each check runs in a fresh interpreter: the layer is fixed at the process's first parallel launch, and a
layer that cannot take concurrent launches (workqueue) aborts the whole process, which a subprocess reports
as a failed exit instead of killing the test run.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fast.cpu.threads import TBB_LIBRARY

ROOT = Path(__file__).resolve().parents[1]

# Two batches (decode rows for fast.cpu.decode; soft-capped rows of several queries for fast.cpu.attention's
# kernel), each computed alone first, then by 2 Python threads x 20 calls at once on 2 torch threads: every
# concurrent result must equal the serial one bit for bit (rows do not depend on which worker computes them).
CONCURRENT = textwrap.dedent(
    """
    import threading
    import numba, torch
    import fast

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)

    def batch(counts, softcap):
        block_size, kv_heads, heads, dim = 16, 2, 8, 32
        seq_lens = [400 + 7 * i + n for i, n in enumerate(counts)]
        need = [-(-s // block_size) for s in seq_lens]
        table = torch.zeros(len(counts), max(need), dtype=torch.int32)
        ids = 1 + torch.randperm(sum(need), generator=gen)
        at = 0
        for b, n in enumerate(need):
            table[b, :n] = ids[at : at + n].to(torch.int32)
            at += n
        shape = (sum(need) + 1, block_size, kv_heads, dim)
        key, value = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        query = torch.randn(sum(counts), heads, dim, generator=gen)
        starts = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        return (query, key, value, table, torch.tensor(seq_lens, dtype=torch.int32), starts), dict(
            scale=dim ** -0.5, sliding_window=None, softcap=softcap)

    batches = [batch([1] * 16, None), batch([5, 1, 9, 1] * 2, 20.0)]
    expected = [fast.paged_attention(*args, **kw) for args, kw in batches]
    results, errors = [[], []], []

    def work(i):
        try:
            args, kw = batches[i]
            for _ in range(20):
                results[i].append(fast.paged_attention(*args, **kw))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a kernel call did not return"
    assert not errors, errors
    for i in range(2):
        assert len(results[i]) == 20
        assert all(torch.equal(r, expected[i]) for r in results[i]), f"batch {i}: a concurrent result differs"
    print("layer", numba.threading_layer())
    """
)


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"} | env
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def _has_tbb_wheel() -> bool:
    try:
        importlib.metadata.version("tbb")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.parametrize("layer", ["chosen by fast", "omp"])
def test_concurrent_kernel_calls_from_two_python_threads(layer: str) -> None:
    """Safe on the layer fast.cpu.threads leads Numba to, and on the OpenMP fallback of platforms without TBB."""
    done = _run(CONCURRENT, NUMBA_NUM_THREADS="2", **({"NUMBA_THREADING_LAYER": layer} if layer == "omp" else {}))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split()[-1] == ("tbb" if layer != "omp" and _has_tbb_wheel() else "omp"), done.stdout


@pytest.mark.skipif(not _has_tbb_wheel(), reason="the tbb wheel is not installed (pyproject.toml: x86-64 only)")
def test_tbb_wheel_is_found_although_the_loader_does_not_search_its_directory() -> None:
    code = "import fast.cpu.threads as t; print(t.load_tbb())"
    done = _run(code, LD_LIBRARY_PATH="")
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip()
    assert path != "None" and Path(path).name == TBB_LIBRARY, done.stdout
