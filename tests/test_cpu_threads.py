"""fast's CPU kernels on several threads (fast.cpu.threads): the shares a call is split into, shares run at once on
torch's OpenMP team, a failure on a team thread reported to the caller, and kernels launched from several Python
threads at once, each call itself split over 2 threads.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch
from numba import njit

import fast
import fast.cpu.threads
from fast.cpu.threads import MAX_SHARE_COST, MIN_SHARE_COST, fetch_add, run_shares, share_bounds


def shares(costs: np.ndarray, threads: int) -> list[slice]:
    bounds = share_bounds(costs, threads).tolist()
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def _batch(counts: list[int], softcap: float | None, gen: torch.Generator) -> tuple[tuple[torch.Tensor, ...], dict]:
    block_size, kv_heads, heads, dim = 16, 2, 8, 32
    seq_lens = [1600 + 7 * i + n for i, n in enumerate(counts)]  # enough work per call for 2 shares
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
    args = (query, key, value, table, torch.tensor(seq_lens, dtype=torch.int32), starts)
    return args, {"scale": dim**-0.5, "sliding_window": None, "softcap": softcap}


@pytest.fixture
def two_torch_threads() -> object:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_shares_cover_the_items_once_in_order_and_balance_their_cost() -> None:
    costs = np.array([5, 1, 1, 1, 1, 1, 9, 1, 1, 3], np.int64) * MIN_SHARE_COST
    for threads in (1, 2, 3, 4, 16):
        parts = shares(costs, threads)
        assert len(parts) <= threads
        assert [i for s in parts for i in range(s.start, s.stop)] == list(range(costs.size))
        if threads == 2:
            sums = [int(costs[s].sum()) for s in parts]
            assert sums == [10 * MIN_SHARE_COST, 14 * MIN_SHARE_COST], sums  # the split nearest the half
    assert shares(np.full(40, MIN_SHARE_COST // 32, np.int64), 2) == [slice(0, 40)]  # too little to hand off
    assert shares(np.zeros(0, np.int64), 2) == [slice(0, 0)]
    # much work: shares of at most about MAX_SHARE_COST, so that the threads finish together
    assert shares(np.full(100, MAX_SHARE_COST // 2, np.int64), 2) == [slice(i, i + 2) for i in range(0, 100, 2)]
    assert len(shares(np.full(3, 10 * MAX_SHARE_COST, np.int64), 2)) == 3  # never more shares than items


@pytest.mark.usefixtures("two_torch_threads")
def test_concurrent_kernel_calls_from_two_python_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two batches (decode rows for fast.cpu.decode; soft-capped rows of several queries for fast.cpu.attention's
    kernel), each computed alone on one thread first, then by 2 Python threads x 20 calls at once, every call split
    over 2 torch threads: each result equals the one-thread result bit for bit (a row does not depend on which
    thread computes it)."""
    gen = torch.Generator().manual_seed(0)
    batches = [_batch([1] * 16, None, gen), _batch([5, 1, 9, 1] * 2, 20.0, gen)]
    torch.set_num_threads(1)
    expected = [fast.paged_attention(*args, **kw) for args, kw in batches]
    torch.set_num_threads(2)
    split: list[int] = []

    def spy(costs: np.ndarray, threads: int) -> np.ndarray:
        bounds = share_bounds(costs, threads)
        split.append(bounds.shape[0] - 1)
        return bounds

    monkeypatch.setattr(fast.cpu.threads, "share_bounds", spy)
    results: list[list[torch.Tensor]] = [[], []]
    errors: list[BaseException] = []

    def work(i: int) -> None:
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
    assert max(split) >= 2, split  # the calls were split: shares ran on an OpenMP team


@njit(nogil=True, cache=True)
def _meet(arrivals: np.ndarray, seen: np.ndarray, share: np.ndarray) -> None:  # pragma: no cover - compiled
    """Each share (one item) arrives, then waits, bounded, until another share has arrived: on a team of two
    threads both see 2; run one share after the other, the first gives up and sees 1."""
    fetch_add(arrivals, 0, 1)
    count = 1
    for _ in range(1 << 30):  # seconds
        count = fetch_add(arrivals, 0, 0)  # an atomic read: a plain one may be hoisted out of the loop
        if count >= 2:
            break
    seen[share[0]] = count


@njit(nogil=True, cache=True)
def _wait_for(arrivals: np.ndarray, seen: np.ndarray, share: np.ndarray) -> None:  # pragma: no cover - compiled
    """A first job's share: waits, bounded, until a share of the second job (_meet_second) has arrived, and notes
    the second job's arrivals it saw."""
    count = 0
    for _ in range(1 << 30):  # seconds
        count = fetch_add(arrivals, 1, 0)
        if count >= 1:
            break
    seen[share[0]] = count
    fetch_add(arrivals, 0, 1)


@njit(nogil=True, cache=True)
def _arrive(arrivals: np.ndarray, seen: np.ndarray, share: np.ndarray) -> None:  # pragma: no cover - compiled
    """A second job's share: arrives, and notes the first job's shares finished before it."""
    fetch_add(arrivals, 1, 1)
    seen[share[0]] = fetch_add(arrivals, 0, 0)


@njit(nogil=True, cache=True)
def _fail_after(bad: int, share: np.ndarray, done: np.ndarray) -> None:  # pragma: no cover - compiled
    for i in share:
        if i == bad:
            raise ValueError("planted failure")
        done[i] += 10


@njit(nogil=True, cache=True)
def _fail_on(bad: int, share: np.ndarray, done: np.ndarray) -> None:  # pragma: no cover - compiled
    for i in share:
        if i == bad:
            raise ValueError("planted failure")
        done[i] += 1


@pytest.mark.usefixtures("two_torch_threads")
def test_shares_run_at_once_on_two_openmp_threads() -> None:
    """Two shares of one call run at the same time (each waits until the other has started), so the team has two
    threads; every item is run once."""
    arrivals, seen = np.zeros(1, np.int64), np.zeros(2, np.int64)
    run_shares((_meet, (arrivals, seen), np.arange(2, dtype=np.int64), (), np.full(2, MIN_SHARE_COST, np.int64)))
    assert arrivals[0] == 2
    assert seen.tolist() == [2, 2]


@pytest.mark.usefixtures("two_torch_threads")
def test_a_share_that_raises_on_the_team_is_reported_to_the_caller() -> None:
    done = np.zeros(8, np.int64)
    items, costs = np.arange(8, dtype=np.int64), np.full(8, MIN_SHARE_COST, np.int64)
    run_shares((_fail_on, (-1,), items, (done,), costs))
    assert done.tolist() == [1] * 8  # every item once
    with pytest.raises(RuntimeError, match="_fail_on failed"):
        run_shares((_fail_on, (5,), items, (done,), costs))
    # in a call of two jobs, the job whose share raised is named
    with pytest.raises(RuntimeError, match="_fail_after failed"):
        run_shares((_fail_on, (-1,), items, (done,), costs), (_fail_after, (5,), items, (done,), costs))


@pytest.mark.usefixtures("two_torch_threads")
def test_two_jobs_run_at_once_one_thread_on_each() -> None:
    """Two jobs of 4 shares each: one thread starts on each, so the first job's first share, which waits for a share
    of the second, sees one arrive (two threads both on the first job's shares would wait it out); every share of
    both runs once, by its own kernel."""
    costs = np.full(4, MIN_SHARE_COST, np.int64)
    arrivals, first_seen, second_seen = np.zeros(2, np.int64), np.full(4, -1, np.int64), np.full(4, -1, np.int64)
    run_shares((_wait_for, (arrivals, first_seen), np.arange(4, dtype=np.int64), (), costs),
               (_arrive, (arrivals, second_seen), np.arange(4, dtype=np.int64), (), costs))  # fmt: skip
    assert arrivals.tolist() == [4, 4]
    assert first_seen[0] >= 1, first_seen
    assert second_seen[0] == 0, second_seen  # the second job started before the first job's first share ended
    assert (first_seen >= 1).all() and (second_seen >= 0).all()


@pytest.mark.usefixtures("two_torch_threads")
def test_two_jobs_every_item_once_and_small_jobs_on_the_calling_thread() -> None:
    done = np.zeros(8, np.int64)
    items, costs = np.arange(8, dtype=np.int64), np.full(8, MIN_SHARE_COST, np.int64)
    run_shares((_fail_on, (-1,), items[:5], (done,), costs[:5]), (_fail_after, (-1,), items[5:], (done,), costs[5:]))
    assert done.tolist() == [1] * 5 + [10] * 3
    # no items in one job; then two one-share jobs too small to hand off: all run, on the calling thread alone
    run_shares((_fail_on, (-1,), items[:0], (done,), costs[:0]), (_fail_after, (-1,), items, (done,), costs))
    assert done.tolist() == [11] * 5 + [20] * 3
    arrivals, seen = np.zeros(1, np.int64), np.zeros(2, np.int64)
    tiny = np.ones(1, np.int64)
    run_shares((_meet, (arrivals, seen), np.zeros(1, np.int64), (), tiny),
               (_meet, (arrivals, seen), np.ones(1, np.int64), (), tiny))  # fmt: skip
    assert seen.tolist() == [1, 2]  # one after the other: the first share waited alone, and gave up
