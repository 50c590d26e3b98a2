"""Threaded stress: one pool, several threads allocating and freeing at once.

Each thread records the slots it holds in a shared per-slot owner table
(guarded by a test lock, not the pool's): a slot handed out must be unowned
in the table, so no slot is ever held by two threads at once; a thread
unmarks its slots just before freeing them. Afterwards every slot is free
again and the pool's bookkeeping agrees with the threads'.
"""

from __future__ import annotations

import random
import sys
import threading

import numpy as np
import pytest

from hostpool_nb import LogicalHostPool

THREADS = 4
OPS = 2000
PAGES = 32
MAX_PAGES_PER_ALLOC = 6
FREE_OWNER = -1


@pytest.mark.parametrize("page_size", [1, 16])
def test_no_slot_has_two_owners(page_size: int) -> None:
    size = PAGES * page_size
    pool = LogicalHostPool(size, page_size)
    owner = np.full(size, FREE_OWNER, dtype=np.int64)
    table_lock = threading.Lock()
    barrier = threading.Barrier(THREADS)
    failures: list[str] = []
    allocated = [0] * THREADS  # slots each thread was given
    freed = [0] * THREADS  # slots each thread gave back (free's return values)
    successes = [0] * THREADS
    refusals = [0] * THREADS  # alloc returned None: the pool was short
    loop_frees = [0] * THREADS  # frees during the random phase
    frees = [0] * THREADS  # all frees, including the final clean-up

    def fail(message: str) -> None:
        failures.append(message)
        barrier.abort()

    def worker(tid: int) -> None:
        rng = random.Random(1000 * page_size + tid)
        mine: list[np.ndarray] = []

        def give_back(arr: np.ndarray) -> None:
            with table_lock:
                if not (owner[arr] == tid).all():
                    fail(f"thread {tid} lost slots {arr[owner[arr] != tid].tolist()}")
                owner[arr] = FREE_OWNER
            freed[tid] += pool.free(arr)
            frees[tid] += 1

        try:
            barrier.wait()
            for _ in range(OPS):
                if failures:
                    return
                if mine and rng.random() < 0.45:
                    give_back(mine.pop(rng.randrange(len(mine))))
                    loop_frees[tid] += 1
                    continue
                out = pool.alloc(rng.randint(0, MAX_PAGES_PER_ALLOC) * page_size)
                if out is None:
                    refusals[tid] += 1
                    continue
                with table_lock:
                    taken = owner[out]
                    if (taken != FREE_OWNER).any():
                        holders = sorted(set(taken.tolist()) - {FREE_OWNER})
                        fail(f"thread {tid} got slots already held by threads {holders}")
                    owner[out] = tid
                successes[tid] += 1
                allocated[tid] += len(out)
                mine.append(out)
                available = pool.available_size()
                if not (0 <= available <= size - len(out) and available % page_size == 0):
                    fail(f"available_size() {available} inconsistent")
            while mine:
                give_back(mine.pop())
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:  # noqa: BLE001 - surface anything else to the test thread
            fail(f"thread {tid}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(THREADS)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so their calls interleave
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert failures == []
    # Every thread gave back exactly what it was given, and everything is free.
    assert allocated == freed
    assert (owner == FREE_OWNER).all()
    assert pool.available_size() == size
    pool.check_invariants()
    for tid in range(THREADS):
        # Each operation was a successful alloc, a refused alloc, or a free ...
        assert successes[tid] + refusals[tid] + loop_frees[tid] == OPS
        # ... and every successful allocation was freed exactly once.
        assert frees[tid] == successes[tid] > OPS // 10
    # The threads competed for the pool: some allocations had to be refused.
    assert sum(refusals) > 0
    # And the pool still works as new: every slot once, page-aligned.
    out = pool.alloc(size)
    assert sorted(out.tolist()) == list(range(size))
