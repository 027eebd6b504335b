"""Threads for fast's CPU kernels: serial compiled kernels, each run on a cost-balanced share of the work.

The kernels are single-threaded Numba functions that release the GIL (`nogil=True`). `run_shares` cuts a
call's work items into contiguous shares of about equal cost, a few per thread torch uses
(`torch.get_num_threads()`), and hands them out one at a time to the calling thread and to a process-wide
pool of Python threads; it returns when every share is done. Items write disjoint output rows, so the
result does not depend on the split: it is bit for bit the result of one thread.

Why not Numba's `parallel=True` (prange), which the kernels used before:
- Code loaded from Numba's disk cache was 2.6-3x slower than the code the same process compiles. A
  parallel function's cached object is the outer module, with the loop body linked in and optimised a
  second time; measured on decode 64 x 1024 (fp32, L2-resident blocks, one thread): 19-24 ms freshly
  compiled, 59-76 ms from the cache, with 2x the stack spills in the hot loop. A serial function's cached
  code is the code it ran: 19 ms either way.
- Its threading layers: OpenMP (omppool) loads a second libgomp beside torch's, which stalls torch's parallel
  regions after a Numba call; workqueue aborts when two Python threads launch at once; TBB needs a wheel the
  dynamic loader does not find. A pool of Python threads needs none of them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

# a share of fewer query-head x key products (about 17 ns each at one thread) does not repay the hand-off to a
# pool thread (tens of microseconds)
MIN_SHARE_COST = 1 << 15
SHARES_PER_THREAD = 4  # shares a call is cut into per thread, so that a thread that starts late takes fewer

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def shares(costs: np.ndarray, threads: int) -> list[slice]:  # costs: [num_items] int64, the items' work
    """Contiguous slices of the items, at most `threads` of them, of about equal summed cost."""
    total = int(costs.sum())
    parts = max(1, min(threads, costs.shape[0], total // MIN_SHARE_COST))
    if parts == 1:
        return [slice(0, costs.shape[0])]
    ends = np.searchsorted(np.cumsum(costs), total * np.arange(1, parts) / parts, side="right")
    bounds = [0, *sorted(set(ends.tolist())), costs.shape[0]]
    return [slice(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def run_shares(work: Callable[[np.ndarray], None], items: np.ndarray, costs: np.ndarray) -> None:
    """work(items[share]) for every share of the items (`costs`: [num_items], their work), handed out one at a
    time to this thread and to the pool's; all are finished on return, and a share's error is raised here."""
    threads = torch.get_num_threads()
    call = _Call(work, items, shares(costs, threads * SHARES_PER_THREAD))
    if len(call.parts) > 1:
        pool = _executor(threads - 1)
        for _ in range(min(threads, len(call.parts)) - 1):
            pool.submit(call.run)
    call.run()
    call.wait()


class _Call:
    """One call's shares, handed out in order to whichever thread asks next.

    A pool thread that wakes after the calling thread has taken the last share finds nothing left and
    returns: the call waits only for shares that were taken. On this 2-core VM a sleeping thread took up
    to milliseconds to wake, so with one share per thread fixed in advance a call waited for its latest
    thread (decode 64 x 1024, window 256: no faster at two threads than at one).
    """

    def __init__(self, work: Callable[[np.ndarray], None], items: np.ndarray, parts: list[slice]) -> None:
        self.work, self.items, self.parts = work, items, parts
        self.taken = self.done = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.finished = threading.Condition(self.lock)

    def run(self) -> None:
        while True:
            with self.lock:
                if self.taken == len(self.parts) or self.error is not None:
                    return
                part = self.parts[self.taken]
                self.taken += 1
            try:
                self.work(self.items[part])
            except BaseException as exc:
                with self.lock:
                    self.error = exc
            finally:
                with self.lock:
                    self.done += 1
                    self.finished.notify_all()

    def wait(self) -> None:
        with self.lock:
            while self.done < self.taken:
                self.finished.wait()
        if self.error is not None:
            raise self.error


def _executor(workers: int) -> ThreadPoolExecutor:
    """The process's pool, grown to at least `workers` threads (a pool is never shrunk: idle threads sleep)."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            old, _pool, _pool_size = _pool, ThreadPoolExecutor(max(1, workers), "slotmap-cpu"), max(1, workers)
            if old is not None:
                old.shutdown(wait=False)
        return _pool
