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

import logging
import queue
import random
import threading
from typing import Any

import numpy as np
import pytest

from hostpool_nb import HostPagePool, PageDoubleFreeError, PageStateError, StaleFreeError
from tests.host_standins import FastLRU, FastQueue, StandInLRU, StandInQueue, pd_metrics


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
    for view, array in ((fast._allocated, pages.allocated), (fast._generation, pages.generation)):
        assert np.shares_memory(np.asarray(view), array)  # a view of the pool's array, not a copy
        assert view.readonly
    assert np.shares_memory(np.asarray(fast._lock_ref), pages.lock_ref)
    got = fast.alloc(2).tolist()
    fast.inc_lock_ref(got[1])
    # An element reads as the original's lists give it: a Python bool or int.
    assert (type(fast._allocated[got[0]]), type(fast._generation[got[0]]), type(fast._lock_ref[got[1]])) == (
        bool,
        int,
        int,
    )
    assert (fast._allocated[got[0]], fast._generation[got[0]], fast._lock_ref[got[1]]) == (True, 1, 1)
    with pytest.raises(TypeError):
        fast._allocated[got[0]] = False  # read-only: the pool's kernels are its only writers
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
    gens = fast._host_pages.generation[first].copy()  # the pool's numpy arrays take an index array
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


# -- the host class's side effects --------------------------------------------------------------


def _lock_is_free(lock: Any) -> bool:
    """Whether another thread can take ``lock`` now (it is an RLock: this thread always could)."""
    got: list[bool] = []

    def take() -> None:
        got.append(lock.acquire(blocking=False))
        if got[-1]:
            lock.release()

    t = threading.Thread(target=take)
    t.start()
    t.join(10)
    return got == [True]


@pytest.mark.parametrize("make", [StandInQueue, FastQueue], ids=["original", "mixin"])
def test_the_pd_metrics_count_every_reserve_and_release_after_the_lock(make: Any) -> None:
    with pd_metrics() as metrics:
        pool = make(4, pool_name="prefill")
        locked_during: list[bool] = []
        metrics.on_call = lambda name: locked_during.append(not _lock_is_free(pool._lock))
        a, b = pool.reserve(), pool.reserve()
        assert metrics.used_buffers("prefill") == 2
        pool.release(a)
        pool.release(b)
        assert dict(metrics.counts) == {("host_pool_alloc", "prefill"): 2, ("host_pool_free", "prefill"): 2}
        assert [c[0] for c in metrics.calls] == ["host_pool_alloc"] * 2 + ["host_pool_free"] * 2
        assert metrics.used_buffers("prefill") == 0
        assert locked_during == [False] * 4  # each after the pool's lock was let go
        # A failed call reports nothing; a metrics backend that raises fails nothing.
        with pytest.raises(RuntimeError, match="double free of buffer_id"):
            pool.release(a)
        assert len(metrics.calls) == 4
        metrics.fail = True
        assert pool.reserve() == 2
        pool.release(2)
        assert pool.available_size() == 4


@pytest.mark.parametrize("make", [StandInLRU, FastLRU], ids=["original", "mixin"])
def test_an_lru_pool_reports_no_pd_metrics(make: Any) -> None:
    with pd_metrics() as metrics:
        pool = make(4)
        pool.release(pool.reserve())
        pool.free(pool.alloc(2))
        assert metrics.calls == []


@pytest.mark.parametrize(
    ("make", "call"),
    [(StandInQueue, "reserve"), (FastQueue, "reserve"), (StandInLRU, "alloc"), (FastLRU, "alloc")],
    ids=["original-reserve", "mixin-reserve", "original-alloc", "mixin-alloc"],
)
def test_an_exhausted_call_logs_once_a_second_under_the_lock(make: Any, call: str, caplog: Any) -> None:
    pool = make(2, pool_name="stage")
    assert pool.alloc(2) is not None if call == "alloc" else [pool.reserve(), pool.reserve()] == [0, 1]
    held: list[bool] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(not _lock_is_free(pool._lock))

    seen = Seen()
    logging.getLogger().addHandler(seen)
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                assert (pool.alloc(1) if call == "alloc" else pool.reserve()) is None
    finally:
        logging.getLogger().removeHandler(seen)
    lines = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 1  # three exhausted calls within a second: one line
    assert "stage" in lines[0].getMessage()
    assert lines[0].name == "hostpool_nb.originals.host_tier"  # where the host class's reserve is defined
    assert held == [True]
    assert pool._exhaust_count == 3


def test_a_generator_that_releases_a_page_while_free_reads_it_frees_and_forgets_the_right_pages() -> None:
    """The input is read whole before the pool: each freed page is forgotten once, none twice, none missed."""
    for make in (StandInLRU, FastLRU):
        pool = make(8)
        pages = pool.alloc(4).tolist()
        for p in pages:
            pool._slots[p] = f"kv {p}"
            pool._pending[p] = [1]
        dropped: list[int] = []
        original_drop = pool._drop_pending

        def counting(page: int, original_drop: Any = original_drop, dropped: list[int] = dropped) -> None:
            dropped.append(page)
            original_drop(page)

        pool._drop_pending = counting

        def evicting(pool: Any = pool, pages: list[int] = pages) -> Any:
            pool.release(pages[3])  # an eviction callback run while the list is produced
            yield pages[0]
            yield pages[1]

        pool.free(evicting())
        assert dropped == [pages[3], pages[0], pages[1]], make.__name__
        assert [pool._slots[p] for p in pages] == [None, None, f"kv {pages[2]}", None]
        assert pages[2] in pool._pending
        assert not any(p in pool._pending for p in (pages[0], pages[1], pages[3]))
        assert pool.available_size() == 7


def test_a_mixin_free_staged_across_the_end_of_the_ring_returns_and_clears_every_page() -> None:
    pool = FastLRU(8)
    first = pool.alloc(6).tolist()
    assert pool.free(first) == 6  # the free list now starts at ring position 6: a free of 5 wraps
    held = pool.alloc(7).tolist()
    for p in held:
        pool._slots[p] = f"kv {p}"
    assert pool._host_pages.free_listed(held[:1]).tolist() == held[:1]
    freed = pool._host_pages.free_listed(held[1:3])
    assert freed.tolist() == held[1:3]
    pool._host_pages.alloc(3)  # held back: the next free is staged from ring position 3
    assert pool.free(held[3:]) == 4
    assert [pool._slots[p] for p in held[3:]] == [None] * 4
    pool._host_pages.check_invariants()


def test_a_drop_pending_that_raises_still_frees_and_forgets_every_page() -> None:
    pool = FastLRU(4)
    pages = pool.alloc(3).tolist()
    for p in pages:
        pool._slots[p] = "kv"

    def broken(page: int) -> None:
        if page == pages[0]:
            raise KeyError(page)

    pool._drop_pending = broken
    with pytest.raises(KeyError):
        pool.free(pages)
    assert pool._slots[:3] == [None] * 3
    assert pool.available_size() == 4
    # release is the same: the page is freed and its payload cleared, then the error.
    page = pool.reserve()
    assert page is not None
    pool._slots[page] = "kv"
    pool._drop_pending = lambda p: broken(pages[0])
    with pytest.raises(KeyError):
        pool.release(page)
    assert pool._slots[page] is None
    assert pool.available_size() == 4
    pool._host_pages.check_invariants()


def test_the_mixins_require_allocated_refuses_the_pool_size_itself_with_the_originals_text() -> None:
    pool = FastLRU(8)
    pool.alloc(8)
    with pytest.raises(ValueError, match=r"^buffer_id=8 outside pool range \[0, 8\)$"):
        pool._require_allocated(8)  # the fast path's bound: one past the last page
    with pytest.raises(ValueError, match=r"^buffer_id=-1 outside pool range \[0, 8\)$"):
        pool._require_allocated(-1)
    pool._require_allocated(7)


def test_a_host_pools_own_exhaustion_line_says_how_many_pages_were_asked_for(caplog: Any) -> None:
    pool = HostPagePool(2)
    pool.alloc(2)
    with caplog.at_level(logging.INFO, logger="hostpool_nb"):
        assert pool.reserve() is None
    assert [r.getMessage() for r in caplog.records] == ["HostPagePool exhausted: 1 pages asked for, 0 free"]


def test_a_corrupted_host_pool_says_so_as_a_runtime_error() -> None:
    from hostpool_nb._kernels import layout as _layout

    pool = HostPagePool(4)
    pool._st[_layout.HP_NFREE] = 3  # four pages free, the header says three
    with pytest.raises(RuntimeError) as info:
        pool.check_invariants()
    assert str(info.value).startswith("HostPagePool state is corrupted: ")
    assert not isinstance(info.value, ValueError)
