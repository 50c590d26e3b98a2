"""HostKVPoolMixin on stand-ins of sglang-jax's host pools, and HostPagePool under threads.

The stand-ins (``tests/host_standins.py``) are the original bookkeeping
with transfer-like methods. With the mixin, the same calls must give the
same ids and results as the plain stand-in, the per-page hooks must run for
every page freed, and the transfer methods must keep working unchanged,
also while other threads allocate and free: a transfer keeps its payload
only for the allocation it began for. The thread tests run as well with
``NUMBA_DISABLE_JIT=1`` (the CI's second run).
"""

from __future__ import annotations

import queue
import random
import threading
from typing import Any

import numpy as np
import pytest

from hostpool_nb import HostPagePool, PageDoubleFreeError, PageStateError, StaleFreeError
from tests.host_standins import FastLRU, FastQueue, StandInLRU, StandInQueue


def books(pool: Any) -> tuple[list[bool], list[int], list[int], list[Any], dict[int, Any]]:
    return (
        [bool(a) for a in pool._allocated],
        [int(g) for g in pool._generation],
        [int(k) for k in pool._lock_ref],
        list(pool._slots),
        {k: list(v) for k, v in pool._pending.items() if v},
    )


def test_the_mixin_gives_the_originals_results_call_for_call() -> None:
    rng = random.Random(7)
    plain, fast = StandInLRU(24), FastLRU(24)
    held: list[int] = []
    for step in range(600):
        op = rng.choice(["reserve", "alloc", "free", "release", "pin", "unpin", "transfer", "store"])
        if op == "reserve":
            got = (plain.reserve(), fast.reserve())
            assert got[0] == got[1]
            held += [got[0]] if got[0] is not None else []
        elif op == "alloc":
            need = rng.randint(1, 6)
            a, b = plain.alloc(need), fast.alloc(need)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype == np.int64
                assert a.tolist() == b.tolist()
                held += a.tolist()
        elif op in ("free", "release") and held:
            pages = rng.sample(held, min(len(held), rng.randint(1, 4)))
            unpinned = [p for p in pages if plain._lock_ref[p] == 0]
            if op == "release":
                freed = unpinned[:1]
                for pool in (plain, fast):
                    for page in freed:
                        pool.release(page)
            else:
                form = rng.choice([list, np.array])
                assert plain.free(form(unpinned)) is None
                assert fast.free(form(unpinned)) == len(unpinned)
                freed = unpinned
            held = [p for p in held if p not in freed]
        elif op in ("pin", "unpin") and held:
            page = rng.choice(held)
            if op == "pin":
                plain.inc_lock_ref(page)
                fast.inc_lock_ref(page)
            elif plain._lock_ref[page] > 0:
                plain.dec_lock_ref(page)
                fast.dec_lock_ref(page)
        elif op == "transfer" and held:
            page = rng.choice(held)
            assert plain.start_transfer(page) == fast.start_transfer(page)
        elif op == "store":
            for pool in (plain, fast):
                for page, gens in list(pool._pending.items()):
                    for g in list(gens):
                        pool.finish_transfer(page, g, f"data {page}")
        assert books(plain) == books(fast), f"step {step}: {op}"
        assert plain.available_size() == fast.available_size()
        assert (plain._peak_used, plain._exhaust_count) == (fast._peak_used, fast._exhaust_count)
    fast._host_pages.check_invariants()


def test_the_mixin_takes_the_host_classes_lock_and_arrays() -> None:
    fast = FastLRU(8)
    pages = fast._host_pages
    assert fast._lock is pages.lock
    assert fast._allocated is pages.allocated
    assert fast._generation is pages.generation
    assert fast._lock_ref is pages.lock_ref
    assert fast.total_size() == 8
    q = FastQueue(4)
    assert [q.reserve() for _ in range(5)] == [0, 1, 2, 3, None]
    assert q._exhaust_count == 1
    q.release(2)
    assert q.reserve() == 2
    q.release(3)
    with pytest.raises(RuntimeError, match="double free of buffer_id=3") as info:
        q.release(3)
    assert isinstance(info.value, PageDoubleFreeError)
    with pytest.raises(ValueError, match=r"buffer_id=9 outside pool range \[0, 4\)"):
        q.release(9)


def test_a_failed_free_through_the_mixin_frees_nothing_and_keeps_the_payloads() -> None:
    fast = FastLRU(8)
    pages = fast.alloc(4).tolist()
    for p in pages:
        fast._slots[p] = f"kv {p}"
    fast.inc_lock_ref(pages[2])
    before = books(fast)
    with pytest.raises(RuntimeError, match=rf"free of locked page id={pages[2]} \(lock_ref=1\)"):
        fast.free(pages)  # the original frees pages[0] and pages[1] first
    assert books(fast) == before
    fast.dec_lock_ref(pages[2])
    assert fast.free(pages) == 4
    assert fast._slots[:4] == [None] * 4


def test_generations_through_the_mixin_catch_a_stale_free() -> None:
    fast = FastLRU(2)
    first = fast.alloc(1)
    gens = fast._generation[first].copy()
    assert fast.free(first, generations=gens) == 1
    again = fast.alloc(2)  # page 0 comes back, page 1 is new
    assert sorted(again.tolist()) == [0, 1]
    with pytest.raises(StaleFreeError):
        fast.free(first, generations=gens)  # the first owner's stale copy
    assert bool(fast._allocated[0])


# -- threads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [HostPagePool, FastQueue], ids=["HostPagePool", "mixin"])
def test_pd_staging_reserve_on_one_thread_release_on_another(make: Any) -> None:
    """Prefill reserves a slot per request; the acknowledgement releases it from another thread."""
    pool = make(16)
    handed: queue.Queue[int | None] = queue.Queue(maxsize=8)
    owners: dict[int, int] = {}
    guard = threading.Lock()
    errors: list[BaseException] = []
    requests = 3000

    def prefill() -> None:
        try:
            sent = 0
            while sent < requests:
                slot = pool.reserve()
                if slot is None:
                    continue  # all in flight: try again
                with guard:
                    assert slot not in owners, f"slot {slot} handed to two requests"
                    owners[slot] = sent
                handed.put(slot)
                sent += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            handed.put(None)

    def acknowledge() -> None:
        try:
            while (slot := handed.get()) is not None:
                with guard:
                    del owners[slot]
                pool.release(slot)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=prefill), threading.Thread(target=acknowledge)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert owners == {}
    assert pool.available_size() == 16
    (pool if isinstance(pool, HostPagePool) else pool._host_pages).check_invariants()


def test_hicache_transfers_keep_only_their_own_allocation_while_others_allocate_and_free() -> None:
    """Transfers check the generation under the lock while two threads churn allocations."""
    pool = FastLRU(32)
    stop = threading.Event()
    errors: list[BaseException] = []
    kept = [0, 0]  # transfers kept, dropped

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        try:
            while not stop.is_set():
                if mine and (rng.random() < 0.5 or len(mine) > 12):
                    batch, mine = mine[:4], mine[4:]
                    pool.free(batch)
                else:
                    got = pool.alloc(rng.randint(1, 4))
                    if got is not None:
                        mine += got.tolist()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def transfers(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                page = rng.randrange(32)
                with pool._lock:
                    if not pool._allocated[page]:
                        continue
                gen = pool.start_transfer(page)
                payload = ("loaded", page, gen)
                if pool.finish_transfer(page, gen, payload):
                    kept[0] += 1
                else:
                    kept[1] += 1
                with pool._lock:  # what a kept transfer wrote belongs to the page's current allocation, or is gone
                    slot = pool._slots[page]
                    if slot is not None:
                        assert bool(pool._allocated[page])
                        assert slot[0] == int(pool._generation[page])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(s,)) for s in (1, 2)]
    threads += [threading.Thread(target=transfers, args=(s,)) for s in (3, 4)]
    for t in threads:
        t.start()
    threading.Event().wait(1.5)
    stop.set()
    for t in threads:
        t.join(60)
    assert errors == []
    assert kept[0] > 0
    with pool._lock:
        for page in range(32):
            if not pool._allocated[page]:
                assert pool._slots[page] is None, f"free page {page} kept a payload"
                assert not pool._pending.get(page), f"free page {page} kept a staged transfer"
    pool._host_pages.check_invariants()


def test_a_double_free_race_frees_once() -> None:
    """Two threads free the same pages: one succeeds, the other gets the error; nothing is freed twice."""
    for _ in range(50):
        pool = HostPagePool(64)
        pages = pool.alloc(64)
        outcomes: list[str] = []
        barrier = threading.Barrier(2)

        def free(
            pool: HostPagePool = pool, pages: Any = pages, barrier: Any = barrier, outcomes: list[str] = outcomes
        ) -> None:
            barrier.wait(10)
            try:
                pool.free(pages)
                outcomes.append("freed")
            except PageStateError:
                outcomes.append("refused")

        threads = [threading.Thread(target=free) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(outcomes) == ["freed", "refused"]
        assert pool.available_size() == 64
        pool.check_invariants()


def test_the_plain_stand_ins_behave_as_specified() -> None:
    """The stand-ins judge the mixin, so they are checked against the texts of docs/behaviour.md, section 4 too."""
    q = StandInQueue(2)
    assert (q.reserve(), q.reserve(), q.reserve()) == (0, 1, None)
    q.release(0)
    with pytest.raises(RuntimeError, match="double free of buffer_id=0"):
        q.release(0)
    lru = StandInLRU(4)
    with pytest.raises(ValueError, match="need_pages must be positive, got 0"):
        lru.alloc(0)
    held = lru.alloc(3)
    lru.inc_lock_ref(int(held[1]))
    with pytest.raises(RuntimeError, match=r"free of locked page id=1 \(lock_ref=1\)"):
        lru.free(held)
    assert lru._free_list == [3, 0]  # not atomic: page 0 was freed before the error
