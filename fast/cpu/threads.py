"""Threads for fast's CPU kernels: serial compiled kernels, each run on a cost-balanced share of the work, on the
OpenMP threads torch itself uses.

The kernels are single-threaded Numba functions. `run_shares` cuts a call's work items into contiguous shares of
about equal cost, a few per thread torch uses (`torch.get_num_threads()`), and runs them in one OpenMP parallel
region of the libgomp torch has loaded (`GOMP_parallel`, the entry point a C compiler emits for
`#pragma omp parallel`): every thread of the team, the calling one included, takes the next share left (an atomic
counter) until none is, all of it compiled, without the GIL. A call may hand it two kernels' items (decode rows and
prompt items) for one region: the threads start on alternate kernels, each keeping to its kernel's shares until
none is left. Items write disjoint output rows, so the result does not depend on the split: it is bit for bit the
result of one thread.

Why torch's team: after each of torch's parallel regions (and vLLM's CPU ops', which use the same libgomp) its
idle workers spin for milliseconds before they sleep. A thread of fast's own beside them shares a core with a
spinning worker; on 2 cores fast's two-thread call that followed one ran at about one thread's speed (decode 64 x
1024, window 256: 7.14 ms at two threads, 6.92 at one, against 4.75 ms with no torch region before it). In the
region, the spinning worker is the one that takes fast's shares, at once. Why compiled throughout: on this VM a
thread that sleeps (on a lock, or waiting for the GIL) took milliseconds to be woken, and a pool of Python threads
woke one each time it handed out a share or took the GIL back between shares.

Why not Numba's `parallel=True` (prange), which the kernels used before:
- Code loaded from Numba's disk cache was 2.6-3x slower than the code the same process compiles. A
  parallel function's cached object is the outer module, with the loop body linked in and optimised a
  second time; measured on decode 64 x 1024 (fp32, L2-resident blocks, one thread): 19-24 ms freshly
  compiled, 59-76 ms from the cache, with 2x the stack spills in the hot loop. A serial function's cached
  code is the code it ran: 19 ms either way. Here the kernel is called, not inlined, by the share loop.
- Its threading layers: OpenMP (omppool) loads a second libgomp beside torch's, which stalls torch's parallel
  regions after a Numba call; workqueue aborts when two Python threads launch at once; TBB needs a wheel the
  dynamic loader does not find. torch's own libgomp needs none of them, and each Python thread that calls in
  gets a team of its own (libgomp's pools are per calling thread).
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable
from typing import Any, cast

import llvmlite.binding as llvm
import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# a share of fewer query-head x key products (about 17 ns each at one thread) does not repay the hand-off to
# another thread (tens of microseconds)
MIN_SHARE_COST = 1 << 15
SHARES_PER_THREAD = 4  # shares a call is cut into per thread, so that a thread that starts late takes fewer
# a share of more products is cut further: on a 2-core VM one thread may run at 0.8x the other's speed, and the
# call waits for the last share (prefill 4 x 512 on 512 at 2 threads, shares of 20 ms: 15 ms idle at the end)
MAX_SHARE_COST = 1 << 20


def _find_gomp_parallel() -> int | None:
    """The address of GOMP_parallel in the OpenMP runtime torch loaded (libgomp; LLVM's and Intel's runtimes
    export it too), or None when torch was built without OpenMP: fast's kernels then run on the calling thread."""
    if not torch.backends.openmp.is_available():
        return None
    try:
        return ctypes.cast(ctypes.CDLL(None).GOMP_parallel, ctypes.c_void_p).value
    except AttributeError:  # a runtime loaded privately, not into the process's global symbols
        return None


_GOMP_PARALLEL = _find_gomp_parallel()
if _GOMP_PARALLEL is not None:  # the compiled region's call resolves to torch's runtime, cached code included
    llvm.add_symbol("GOMP_parallel", _GOMP_PARALLEL)


def team_threads() -> int:
    """Threads a call's shares run on: torch's intra-op count, 1 where there is no OpenMP runtime to run them."""
    return torch.get_num_threads() if _GOMP_PARALLEL is not None else 1


def share_bounds(costs: np.ndarray, threads: int) -> np.ndarray:  # costs: [num_items] int64, the items' work
    """[num_shares + 1] item indices: contiguous shares of the items of about equal summed cost, `threads` of them,
    fewer when there is too little work (MIN_SHARE_COST per share), more when there is much (MAX_SHARE_COST), at
    most one per item; share k is items [bounds[k], bounds[k + 1])."""
    return _share_bounds(costs, threads, MIN_SHARE_COST, MAX_SHARE_COST)


Job = tuple[Any, tuple[Any, ...], np.ndarray, tuple[Any, ...], np.ndarray]
"""One kernel's work in a call: (kernel, before, items, after, costs); kernel(*before, items[share], *after) runs a
share, `costs` ([num_items] int64) are the items' work."""


def run_shares(first: Job, second: Job | None = None) -> None:
    """Every item of one job, or of two, run by its kernel in shares (`kernel` a compiled (njit) function); all are
    finished on return. At one thread (or one share in all) each kernel is called once, on all its items, on this
    thread.

    Two jobs share one parallel region: the team's first thread to arrive starts on the first job's shares, the
    next on the second's, and so on, each thread keeping to its job until no share of it is left, then taking the
    other's. A call of memory-bound decode rows beside FLOP-bound prompt items so runs one thread on each at once,
    instead of both threads on the decode rows and their shared memory bandwidth first (decode 64 x 1024 takes
    0.79x its one-thread time at two threads, not 0.5x), and the call has one barrier and one uneven end, not two.
    """
    kernel, before, items, after, costs = first
    # one job: the second is the first's kernel with no items (the same types, so the same compiled region)
    jobs = (first, second if second is not None else (kernel, before, items[:0], after, costs[:0]))
    threads = team_threads()
    bounds = [share_bounds(job[4], threads * SHARES_PER_THREAD) if job[2].shape[0] and threads > 1 else _NO_SHARES
              for job in jobs]  # fmt: skip
    num_shares = bounds[0].shape[0] + bounds[1].shape[0] - 2
    # two jobs of one share each: handed off only when each is worth a hand-off (share_bounds' rule for one job)
    one_each = bounds[0].shape[0] == bounds[1].shape[0] == 2
    if num_shares <= 1 or (one_each and min(int(c.sum()) for *_, c in jobs) < MIN_SHARE_COST):
        for kernel, before, items, after, _ in jobs:
            if items.shape[0]:
                kernel(*before, items, *after)
        return
    (k0, before0, items0, after0, _), (k1, before1, items1, after1, _) = jobs
    failed = _run_team(min(threads, num_shares), bounds[0], k0, items0, before0, after0,
                       bounds[1], k1, items1, before1, after1)  # fmt: skip
    if failed >= 0:
        raise RuntimeError(f"fast.cpu.threads: a share of {jobs[failed][0].__name__} failed on an OpenMP thread")


_NO_SHARES = np.zeros(1, np.int64)  # [1]: the bounds of a job without items


@njit(cache=True, nogil=True)
def _share_bounds(  # pragma: no cover - compiled
    costs: np.ndarray, threads: int, min_share_cost: int, max_share_cost: int
) -> np.ndarray:
    """share_bounds' work (none empty; one, [0, 0), for no items). Share k ends after the last item whose
    cumulative cost is within k / parts of the total: compiled because this runs on every call, and NumPy's
    version cost 0.1 ms on a cold cache."""
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


@njit(cache=True, nogil=True)
def _run_team(  # pragma: no cover - compiled
    threads: int,
    bounds0: np.ndarray,  # [num_shares + 1] int64 item indices of the first job's shares (share_bounds)
    kernel0: Any,
    items0: np.ndarray,  # [num_items, ...] its work items
    before0: tuple[Any, ...],  # its kernel's arguments before the items
    after0: tuple[Any, ...],  # and after them
    bounds1: np.ndarray,  # the second job's, the same way (no shares: [1])
    kernel1: Any,
    items1: np.ndarray,
    before1: tuple[Any, ...],
    after1: tuple[Any, ...],
) -> int:
    """Every share of both jobs run once by a team of `threads` OpenMP threads; the job one of them raised in (the
    first seen), or -1."""
    state = np.zeros(4, np.int64)  # [4]: the next share of job 0 and of job 1, threads arrived, 1 + the failed job
    shares = (state, bounds0, kernel0, items0, before0, after0, bounds1, kernel1, items1, before1, after1)
    _parallel(threads, _take_shares, shares)
    return state[3] - 1


@njit(cache=True, nogil=True)
def _take_shares(  # pragma: no cover - compiled
    state: np.ndarray,  # [4] int64: the next share of each job, threads arrived, 1 + the failed job (0: none)
    bounds0: np.ndarray,  # [num_shares + 1] int64
    kernel0: Any,
    items0: np.ndarray,
    before0: tuple[Any, ...],
    after0: tuple[Any, ...],
    bounds1: np.ndarray,
    kernel1: Any,
    items1: np.ndarray,
    before1: tuple[Any, ...],
    after1: tuple[Any, ...],
) -> None:
    """One team thread's part: the next share not yet taken of its job (by arrival: the first, third, ... thread
    the first job's, the others the second's) until none is left, then the other job's the same way (a thread that
    joins late takes fewer, or none). An error stops this thread's part: no exception can leave an OpenMP thread."""
    job = fetch_add(state, 2, 1) % 2
    left = 2  # jobs this thread has not yet found exhausted
    while left > 0 and state[3] == 0:
        k = fetch_add(state, job, 1)
        if k >= (bounds0.shape[0] if job == 0 else bounds1.shape[0]) - 1:
            left -= 1  # no share of this job is left: the other's, if it has
            job = 1 - job
            continue
        try:
            if job == 0:
                _call(kernel0, before0, items0[bounds0[k] : bounds0[k + 1]], after0)
            else:
                _call(kernel1, before1, items1[bounds1[k] : bounds1[k + 1]], after1)
        except Exception:  # reported to the caller through the state
            state[3] = 1 + job
            return


@njit(cache=True, nogil=True)
def _call(kernel: Any, before: tuple[Any, ...], share: np.ndarray, after: tuple[Any, ...]) -> None:  # pragma: no cover
    kernel(*before, share, *after)  # apart from _take_shares: Numba cannot unpack arguments at a try's start


_region_names = itertools.count()


def _parallel_typer(typingctx: Any, threads: Any, body: Any, args: Any) -> Any:  # pragma: no cover - compiled
    """body(*args) on each thread of an OpenMP team of `threads` (the calling thread one of them), returning when
    all have: GOMP_parallel(region, &args, threads, 0), where region is a function this emits that loads the
    arguments from the caller's frame and calls body. body must not raise (its status is not read)."""
    if not isinstance(body, types.Dispatcher) or not isinstance(args, types.BaseTuple):
        return None
    call = body.get_call_type(typingctx, tuple(cast(Any, args)), {})  # compiles body for these argument types
    if call is None:
        return None

    def codegen(context: Any, builder: Any, sig: Any, llargs: Any) -> Any:
        count, _, packed = llargs
        module, byte_ptr, i32 = builder.module, ir.IntType(8).as_pointer(), ir.IntType(32)
        packed_type = context.get_value_type(args)
        region = ir.Function(
            module, ir.FunctionType(ir.VoidType(), [byte_ptr]), f"slotmap_omp_region_{next(_region_names)}"
        )
        region.linkage = "internal"
        rb = ir.IRBuilder(region.append_basic_block())
        loaded = rb.load(rb.bitcast(region.args[0], packed_type.as_pointer()))
        compiled = body.dispatcher.overloads[tuple(call.args)]
        context.add_linking_libs([compiled.library])
        callee = context.declare_function(module, compiled.fndesc)
        # the arguments are borrowed from the caller's frame, which outlives the region: no reference counting
        context.call_conv.call_function(rb, callee, compiled.fndesc.restype, compiled.fndesc.argtypes,
                                        [rb.extract_value(loaded, i) for i in range(len(args))])  # fmt: skip
        rb.ret_void()
        frame = cgutils.alloca_once(builder, packed_type)
        builder.store(packed, frame)
        gomp = cgutils.get_or_insert_function(
            module, ir.FunctionType(ir.VoidType(), [region.type, byte_ptr, i32, i32]), "GOMP_parallel"
        )
        builder.call(gomp, [region, builder.bitcast(frame, byte_ptr), builder.trunc(count, i32), ir.Constant(i32, 0)])
        return context.get_dummy_value()

    return types.none(threads, body, args), codegen


_parallel = cast(Callable[..., Any], intrinsic(_parallel_typer))


def _fetch_add_typer(typingctx: Any, array: Any, index: Any, value: Any) -> Any:  # pragma: no cover - compiled
    """array[index] += value atomically (relaxed order: a counter, no data published by it); the old value."""
    if not (isinstance(array, types.Array) and array.dtype == types.int64 and array.ndim == 1):
        return None

    def codegen(context: Any, builder: Any, sig: Any, llargs: Any) -> Any:
        view, at, amount = llargs
        arr = context.make_array(sig.args[0])(context, builder, view)
        at = context.cast(builder, at, sig.args[1], types.intp)
        amount = context.cast(builder, amount, sig.args[2], types.int64)
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], arr, [at])
        return builder.atomic_rmw("add", ptr, amount, "monotonic")

    return types.int64(array, index, value), codegen


fetch_add = cast(Callable[..., int], intrinsic(_fetch_add_typer))
