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
from numba import njit

# a share of fewer query-head x key products (about 17 ns each at one thread) does not repay the hand-off to a
# pool thread (tens of microseconds)
MIN_SHARE_COST = 1 << 15
SHARES_PER_THREAD = 4  # shares a call is cut into per thread, so that a thread that starts late takes fewer
# a share of more products is cut further: on a 2-core VM one thread may run at 0.8x the other's speed, and the
# call waits for the last share (prefill 4 x 512 on 512 at 2 threads, shares of 20 ms: 15 ms idle at the end)
MAX_SHARE_COST = 1 << 20

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def shares(costs: np.ndarray, threads: int) -> list[slice]:  # costs: [num_items] int64, the items' work
    """Contiguous slices of the items of about equal summed cost: `threads` of them, fewer when there is too little
    work (MIN_SHARE_COST per share), more when there is much (MAX_SHARE_COST), at most one per item."""
    bounds = _share_bounds(costs, threads, MIN_SHARE_COST, MAX_SHARE_COST).tolist()
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


@njit(cache=True, nogil=True)
def _share_bounds(  # pragma: no cover - compiled
    costs: np.ndarray, threads: int, min_share_cost: int, max_share_cost: int
) -> np.ndarray:
    """[num_shares + 1] item indices: share k is items [bounds[k], bounds[k + 1]), none empty (one, [0, 0), for
    no items). Share k ends after the last item whose cumulative cost is within k / parts of the total: compiled
    because this runs on every call, and NumPy's version cost 0.1 ms on a cold cache."""
    num_items = costs.shape[0]
    total = costs.sum()
    wanted = max(threads, (total + max_share_cost - 1) // max_share_cost)
    parts = max(1, min(wanted, num_items, total // min_share_cost))
    bounds = np.empty(parts + 1, np.int64)
    bounds[0] = count = 0
    cumulative, k = 0, 1
    for i in range(num_items):
        cumulative += costs[i]
        while k < parts and cumulative > total * k / parts:
            if i > bounds[count]:  # item i starts share k (targets within one item add one share)
                count += 1
                bounds[count] = i
            k += 1
    if num_items > bounds[count] or count == 0:
        count += 1
        bounds[count] = num_items
    return bounds[: count + 1]


def run_shares(work: Callable[[np.ndarray], None], items: np.ndarray, costs: np.ndarray) -> None:
    """work(items[share]) for every share of the items (`costs`: [num_items], their work), handed out one at a
    time to this thread and to the pool's; all are finished on return, and a share's error is raised here."""
    threads = torch.get_num_threads()
    if threads == 1:  # nobody to hand a share to: one call of the kernel
        work(items)
        return
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
