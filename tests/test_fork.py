"""A fork never hangs the parent, and a child gets each pool consistent or with a clear error.

Every program runs in a child interpreter with a timeout, and each of its
forked children is waited for with one, so a hang fails the test instead
of the run. ``_fork.WAIT_S`` (how long a fork waits for calls in flight
on other threads) is shortened in the programs, as the bound is what is
under test, not its length.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from tests.conftest import run_child

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")

# The harness: make the pools, start the thread, fork `forks` times. Each
# child uses every pool once: "usable" when the call works and the pool
# passes check_invariants(), "refused" when it raises PoolForkedError, and
# exit 3 for anything else. The parent records how long each fork took.
_HARNESS = textwrap.dedent(
    """
    import copy, json, os, pickle, signal, sys, threading, time, warnings
    warnings.simplefilter("ignore")  # 3.12+: a fork of a multi-threaded process warns
    import numpy as np
    from hostpool_nb import EnvelopePagePool, HostPagePool, InterleavedPagePool, LogicalHostPool, PoolForkedError, _fork
    from hostpool_nb.paged import PagedTokenToKVPoolAllocator
    from tests.host_standins import FastLRU
    args = json.loads(sys.argv[1])
    _fork.WAIT_S = args["wait"]

    def use(pool):
        try:
            if isinstance(pool, LogicalHostPool):
                pool.free(pool.alloc(pool.page_size))
            elif isinstance(pool, PagedTokenToKVPoolAllocator):
                pool.free(pool.alloc(pool.page_size))
            elif isinstance(pool, InterleavedPagePool):
                pool.free(pool.alloc(pool.page_size, 1))
            elif isinstance(pool, EnvelopePagePool):
                pool.free("a", pool.alloc("a", 2))
            elif isinstance(pool, FastLRU):
                with pool._lock:
                    pass
                pool.free(pool.alloc(1))
                pool = pool._host_pages
            else:
                pool.free(pool.alloc(1))
            pool.check_invariants()
            return "usable"
        except PoolForkedError as exc:
            assert "was in use by another thread when the process forked" in str(exc), exc
            return "refused"

    PROGRAM

    def child():
        try:
            seen = [use(p) for p in pools]
            fresh = LogicalHostPool(64, 16)  # a pool made in the child works, whatever the parent's were doing
            fresh.free(fresh.alloc(16))
            os._exit(10 + seen.count("usable"))
        except BaseException:
            os._exit(3)

    threads = [threading.Thread(target=f, daemon=True) for f in workers]
    for t in threads:
        t.start()
    if "taken" in globals():
        taken.wait(10)
    time.sleep(0.05)
    usable, took, outcomes = [], [], []
    for _ in range(args["forks"]):
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            child()
        took.append(time.monotonic() - started)
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                outcomes.append("ok" if code >= 10 else code)
                usable.append(code - 10)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                outcomes.append("hang")
                break
            time.sleep(0.001)
    stop.set()
    print(json.dumps({"outcomes": sorted(set(map(str, outcomes))), "usable": usable, "longest": max(took),
                      "pools": len(pools)}))
    """
)


def run(program: str, forks: int, wait: float = 0.05, timeout: float = 600) -> dict[str, object]:
    source = _HARNESS.replace("PROGRAM", textwrap.dedent(program).strip())
    return run_child(source, {"forks": forks, "wait": wait}, timeout=timeout)


_COPIER = """
    pool = LogicalHostPool(1024, 16)
    pool.free(pool.alloc(512))
    stop = threading.Event()
    def copier():  # makes a pool while it holds a pool's lock: a copy, an unpickling, a constructor
        while not stop.is_set():
            with pool.lock:
                copy.deepcopy(pool)
                pickle.loads(pickle.dumps(pool))
                LogicalHostPool(64, 16)
    workers = [copier]
    pools = [pool]
"""


@pytest.mark.slow
def test_a_thread_that_makes_pools_under_a_pools_lock_never_hangs_a_fork() -> None:
    got = run(_COPIER, forks=300)
    assert got["outcomes"] == ["ok"]  # no child hung, crashed or met another error
    assert got["longest"] < 0.05 + 5  # each fork waited its bound at most (and the machine's own time)


_NESTED = """
    a = LogicalHostPool(1024, 16)
    b = LogicalHostPool(1024, 16)  # made after a: the order a fork would take their locks in
    host = HostPagePool(64)
    paged = PagedTokenToKVPoolAllocator(1024, 16, None)
    classed = InterleavedPagePool(1024, 16, 4)
    stop = threading.Event()
    def nested():  # holds b while it calls a, the host pool while it calls the paged one, and so on
        while not stop.is_set():
            with b.lock:
                a.free(a.alloc(16))
            with host.lock:
                paged.free(paged.alloc(16))
            with paged.lock:
                classed.free(classed.alloc(32, 3))
    workers = [nested]
    pools = [a, b, host, paged, classed]
"""


@pytest.mark.slow
def test_a_thread_that_nests_two_pools_locks_never_hangs_a_fork() -> None:
    got = run(_NESTED, forks=300)
    assert got["outcomes"] == ["ok"]
    assert got["longest"] < 0.05 + 5
    # Most forks land between two of the thread's holds: the children get usable pools.
    usable = got["usable"]
    assert isinstance(usable, list)
    assert sum(u == 5 for u in usable) > len(usable) // 2, usable


_HELD = """
    held = [LogicalHostPool(64, 16), HostPagePool(8), PagedTokenToKVPoolAllocator(64, 16, None), FastLRU(8)]
    held.append(InterleavedPagePool(64, 16, 2))
    held.append(EnvelopePagePool(256, {"a": (2, 16, "up")}))
    idle = LogicalHostPool(64, 16)
    stop = threading.Event()
    taken = threading.Event()
    def holder():  # holds every lock but idle's for as long as the parent runs
        locks = [p.lock if not isinstance(p, FastLRU) else p._lock for p in held]
        for lock in locks:
            lock.acquire()
        taken.set()
        stop.wait()
    workers = [holder]
    pools = held + [idle]
"""


@pytest.mark.slow
def test_a_pool_whose_lock_another_thread_holds_at_the_fork_refuses_every_call_in_the_child() -> None:
    got = run(_HELD, forks=3)
    assert got["outcomes"] == ["ok"]
    assert got["usable"] == [1, 1, 1]  # only idle: each held pool raised PoolForkedError in the child
    assert 0.05 <= got["longest"] < 0.05 + 5  # the fork waited its bound for them, then went on


_CONCURRENT_FORKS = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time, warnings
    warnings.simplefilter("ignore")  # 3.12+: a fork of a multi-threaded process warns
    from hostpool_nb import HostPagePool, LogicalHostPool, PoolForkedError, _fork
    from hostpool_nb.paged import PagedTokenToKVPoolAllocator
    args = json.loads(sys.argv[1])
    _fork.WAIT_S = args["wait"]
    pools = [LogicalHostPool(1024, 16), LogicalHostPool(256, 1), HostPagePool(64)]
    pools.append(PagedTokenToKVPoolAllocator(1024, 16, None))

    def use(pool):
        if isinstance(pool, HostPagePool):
            pool.free(pool.alloc(1))
        else:
            pool.free(pool.alloc(pool.page_size))

    stop = threading.Event()
    def worker(mine):  # calls in flight on other threads while the forks happen
        while not stop.is_set():
            for pool in mine:
                use(pool)
    workers = [threading.Thread(target=worker, args=(pools[i:] + pools[:i],), daemon=True) for i in range(3)]
    outcomes = []
    def forker():
        for _ in range(args["forks"]):
            pid = os.fork()
            if pid == 0:
                try:
                    for pool in pools:
                        try:
                            use(pool)
                        except PoolForkedError:
                            pass  # in use by another thread at the fork: refused, as documented
                    os._exit(0)
                except BaseException:
                    os._exit(3)
            deadline = time.monotonic() + 30
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    outcomes.append(os.waitstatus_to_exitcode(status))
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    outcomes.append("hang")
                    break
                time.sleep(0.001)
    forkers = [threading.Thread(target=forker) for _ in range(args["threads"])]
    for t in workers + forkers:
        t.start()
    for t in forkers:
        t.join(120)
    hung = sum(t.is_alive() for t in forkers)
    stop.set()
    for t in workers:
        t.join(10)
    after = [None]
    def last_call():  # the parent's pools after every fork: usable, not left locked
        for pool in pools:
            use(pool)
            pool.check_invariants()
        after[0] = "usable"
    check = threading.Thread(target=last_call, daemon=True)
    check.start()
    check.join(10)
    print(json.dumps({"hung forkers": hung, "outcomes": sorted(set(map(str, outcomes))), "forks": len(outcomes),
                      "after": after[0], "stuck workers": sum(t.is_alive() for t in workers)}))
    """
)


@pytest.mark.slow
def test_threads_forking_at_once_never_hang_the_parent() -> None:
    """Six threads fork sixty times each while three threads use four pools: every fork returns, in both."""
    got = run_child(_CONCURRENT_FORKS, {"forks": 60, "threads": 6, "wait": 0.05}, timeout=400)
    assert got == {"hung forkers": 0, "outcomes": ["0"], "forks": 360, "after": "usable", "stuck workers": 0}


# -- the waits' bounds, one at a time ------------------------------------------------------------

_HELD_FOR = """
    stop = threading.Event()
    taken = threading.Event()
    leaf = threading.Lock()  # a lock whose holder never waits for a pool's (as the compile lock)
    _fork.hold(leaf)
    pools = [LogicalHostPool(64, 16) for _ in SECONDS]
    def holder():  # each pool's lock held for its SECONDS (the leaf for LEAF), from just before the fork
        for pool in pools:
            pool.lock.acquire()
        if LEAF:
            leaf.acquire()
        started = time.monotonic()
        taken.set()
        todo = sorted([(s, p.lock) for s, p in zip(SECONDS, pools)] + ([(LEAF, leaf)] if LEAF else []),
                      key=lambda x: x[0])
        for seconds, lock in todo:
            time.sleep(max(0.0, started + seconds - time.monotonic()))
            lock.release()
    workers = [holder]
"""


def _held_for(seconds: list[float], leaf: float, wait: float) -> dict[str, object]:
    program = _HELD_FOR.replace("SECONDS", repr(seconds)).replace("LEAF", repr(leaf))
    return run(program, forks=1, wait=wait)


@pytest.mark.slow
def test_a_wait_for_a_leaf_lock_moves_the_forks_deadline_on_by_that_wait() -> None:
    """A compile in flight keeps its caller's pool as long: the fork's bound for pools starts again after it."""
    # WAIT_S 0.5, the leaf busy for 1 s: the deadline is about 1.5 s. The pool freed at 1.2 s is the child's;
    # the one held for 4 s is refused, and the fork does not wait for it.
    got = _held_for([1.2, 4.0], leaf=1.0, wait=0.5)
    assert got["outcomes"] == ["ok"]
    assert got["usable"] == [1]  # 0: the leaf's wait was counted against WAIT_S; 2: the deadline went too far
    assert 1.0 <= got["longest"] < 2.8


@pytest.mark.slow
def test_a_fork_waits_for_a_busy_pool_no_longer_than_its_bound() -> None:
    """With every pool busy for seconds, a fork with WAIT_S 0.05 returns well within a second."""
    got = _held_for([5.0], leaf=0.0, wait=0.05)
    assert got["outcomes"] == ["ok"]
    assert got["usable"] == [0]
    assert got["longest"] < 0.8  # no single wait for a lock outlasts the deadline


_MADE_DURING = """
    stop = threading.Event()
    taken = threading.Event()
    _fork._ORDERED_WAIT_S = 0.5  # the in-order attempt waits for a's lock, and so sees b, made meanwhile
    a = LogicalHostPool(64, 16)
    pools = [a]
    def holds_a():
        with a.lock:
            taken.set()
            time.sleep(0.25)
    def makes_b():  # after the fork listed the pools, before it took the registry: b is made since the list
        taken.wait(10)
        time.sleep(0.1)
        b = LogicalHostPool(64, 16)
        b.lock.acquire()
        pools.append(b)
        stop.wait()
    workers = [holds_a, makes_b]
"""


@pytest.mark.slow
def test_a_pool_made_while_a_fork_waits_in_order_and_busy_gives_every_lock_back() -> None:
    """The in-order attempt finds a pool made since it listed them, busy: it lets go of all it took and the
    fork goes on by polling; the child gets a (freed meanwhile) and refuses b (held throughout)."""
    got = run(_MADE_DURING, forks=1, wait=1.0)
    assert got["outcomes"] == ["ok"]  # a lock kept by the failed attempt hangs the child's b, or the parent
    assert got["pools"] == 2
    assert got["usable"] == [1]
    assert got["longest"] < 3.0


def test_dead_followers_are_swept_when_the_list_doubles_past_the_last_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """register() drops the dead followers when there are more than twice (plus 64) those alive at the last
    sweep: O(1) a registration on average, and a list that cannot grow without bound."""
    import gc

    from hostpool_nb import _fork

    class Obj:
        lock = None

    monkeypatch.setattr(_fork, "_followers", [])
    monkeypatch.setattr(_fork, "_followed_at", [0])
    monkeypatch.setattr(_fork, "_live", __import__("weakref").WeakValueDictionary())
    pool = Obj()
    alive = []

    def follow(n: int, keep: bool) -> None:
        for _ in range(n):
            obj = Obj()
            _fork.follow(obj, "lock", pool)
            if keep:
                alive.append(obj)
        gc.collect()

    def registered() -> tuple[int, int]:
        _fork.register(Obj())
        return len(_fork._followers), _fork._followed_at[0]

    follow(64, keep=False)
    assert registered() == (64, 0)  # 64 is not more than 2 * 0 + 64
    follow(1, keep=False)
    assert registered() == (0, 0)  # 65 is: every one was dead
    follow(70, keep=True)
    assert registered() == (70, 70)  # swept, all alive: the next sweep at more than 2 * 70 + 64
    follow(134, keep=False)
    assert registered() == (204, 70)
    follow(1, keep=False)
    assert registered() == (70, 70)
