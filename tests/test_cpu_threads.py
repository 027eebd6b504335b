"""fast's CPU kernels on several threads (fast.cpu.threads): the shares a call is split into, and kernels
launched from several Python threads at once, each call itself split over 2 threads.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import fast
import fast.cpu.threads
from fast.cpu.threads import MAX_SHARE_COST, MIN_SHARE_COST, shares


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

    def spy(costs: np.ndarray, threads: int) -> list[slice]:
        parts = shares(costs, threads)
        split.append(len(parts))
        return parts

    monkeypatch.setattr(fast.cpu.threads, "shares", spy)
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
    assert max(split) >= 2, split  # the calls were split: shares were handed to the pool too
