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
    from hostpool_nb import HostPagePool, LogicalHostPool, PoolForkedError, _fork
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
    stop = threading.Event()
    def nested():  # holds b while it calls a, and the host pool while it calls the paged one
        while not stop.is_set():
            with b.lock:
                a.free(a.alloc(16))
            with host.lock:
                paged.free(paged.alloc(16))
    workers = [nested]
    pools = [a, b, host, paged]
"""


@pytest.mark.slow
def test_a_thread_that_nests_two_pools_locks_never_hangs_a_fork() -> None:
    got = run(_NESTED, forks=300)
    assert got["outcomes"] == ["ok"]
    assert got["longest"] < 0.05 + 5
    # Most forks land between two of the thread's holds: the children get usable pools.
    usable = got["usable"]
    assert isinstance(usable, list)
    assert sum(u == 4 for u in usable) > len(usable) // 2, usable


_HELD = """
    held = [LogicalHostPool(64, 16), HostPagePool(8), PagedTokenToKVPoolAllocator(64, 16, None), FastLRU(8)]
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
