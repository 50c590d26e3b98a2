"""Fork safety: a fork never hangs the parent, and no child runs on a half-written pool.

A child process inherits a copy of every lock as it was at the fork. A pool
whose lock another thread held then would hang the child's first call
forever, and a fork in the middle of a kernel would hand the child a
half-written state. So, before every ``os.fork``, the handler registered
here takes every live pool's lock, so that no call is in flight while the
process is copied, and releases them afterwards in the parent and in the
child (where the forking thread, the only one left, owns them).

Taking many locks while other threads take them in any order could
deadlock (the forking thread holding ``a`` and waiting for ``b`` while a
thread holds ``b`` and waits for ``a``), so the handler never waits while
it holds a lock: it tries each lock without blocking and, when one is
busy, lets go of every lock it took, yields to the other threads and tries
again. It does so for at most :data:`WAIT_S` seconds; a pool whose lock it
still could not take then is in use by another thread, and its state may
be half-written: in the child its lock is replaced by one that raises
:class:`~hostpool_nb.PoolForkedError` on first use. The kernels' compile
lock is waited for without a bound (its holder compiles and never waits
for a pool), so that no child inherits numba's compiler mid-compile.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import weakref
from typing import Any

from ._errors import PoolForkedError

# How long a fork waits for calls in flight on other threads before it gives
# their pools to the child as unusable.
WAIT_S = 1.0
# The first pause between two attempts; each pause doubles, up to the last.
_FIRST_PAUSE_S = 10e-6
_LAST_PAUSE_S = 1e-3
_SWITCH_S = 5e-6
# How long a wait for one lock may hold the others, at first (see _in_order); each round doubles it.
_ORDERED_WAIT_S = 0.02

_registry_lock = threading.Lock()  # held only to read or write _live: its holders never wait
# Creation number -> object with a ``lock`` attribute; an entry goes when its pool does.
_live: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_numbers = itertools.count()
_leaves: list[Any] = []  # locks whose holders never wait for a pool's: waited for without a bound
_followers: list[tuple[weakref.ref[Any], str, weakref.ref[Any]]] = []  # see follow()
_followed_at = [0]  # how many followers were alive at the last sweep


class _Fork(threading.local):
    """What the handler holds across one fork, for the handlers after it: the forking thread's own.

    The before-fork handler and the after-fork handlers of one fork run in
    the thread that forks (in the child, the only one left), while other
    threads may fork at the same time: so each thread keeps its own record,
    and no thread's cleanup can wipe another's.
    """

    def __init__(self) -> None:
        self.held: list[Any] = []
        self.missed: list[Any] = []  # the pools whose locks were busy for all of WAIT_S
        self.keep: list[Any] = []  # every pool the handler looked at, alive until the fork is done


_this_fork = _Fork()


def register(obj: Any) -> None:
    """Take ``obj.lock`` across every later fork, for as long as ``obj`` lives."""
    with _registry_lock:
        _live[next(_numbers)] = obj
        if len(_followers) > 2 * _followed_at[0] + 64:  # drop the dead now and then: O(1) a call on average
            _followers[:] = [f for f in _followers if f[0]() is not None]
            _followed_at[0] = len(_followers)


def follow(obj: Any, attr: str, pool: Any) -> None:
    """Keep ``obj.<attr>`` the lock of ``pool`` (a registered pool) in a child process too.

    For an object that keeps its pool's lock under a name of its own
    (``HostKVPoolMixin._lock``): when a fork leaves the pool's lock unusable
    in the child, the object's is replaced as well.
    """
    with _registry_lock:
        _followers.append((weakref.ref(obj), attr, weakref.ref(pool)))


def hold(lock: Any) -> None:
    """Take ``lock`` across every later fork, waiting for it without a bound.

    For a lock whose holder never waits for a pool's lock (the compile
    lock): waiting for it cannot deadlock.
    """
    with _registry_lock:
        _leaves.append(lock)


def _try_all(locks: list[Any]) -> tuple[list[Any], list[Any]]:
    """Take each of ``locks`` that is free, without blocking; ``(taken, busy)``."""
    taken: list[Any] = []
    busy: list[Any] = []
    for lock in locks:
        (taken if lock.acquire(blocking=False) else busy).append(lock)
    return taken, busy


def _release(locks: list[Any]) -> None:
    for lock in reversed(locks):
        lock.release()


def _before_fork() -> None:
    # A compile in flight holds its caller's pool for seconds: the time spent waiting for the compile
    # lock does not count against WAIT_S (see _take_leaves).
    deadline = [time.monotonic() + WAIT_S]
    interval = sys.getswitchinterval()
    try:
        pools, held, busy = _take_everything(deadline)
    finally:
        sys.setswitchinterval(interval)
    _this_fork.held = held
    _this_fork.missed = [p for p in pools if p.lock in busy]
    _this_fork.keep = pools


def _take_everything(deadline: list[float]) -> tuple[list[Any], list[Any], list[Any]]:
    """(pools, locks held, busy locks): in order first (what gets a fork in between a busy thread's calls), then
    all at once (what gets one past a thread that nests pools' locks); each round waits twice as long, as calls
    may be long ones. At the deadline, polling gives up with whatever it holds."""
    wait = _ORDERED_WAIT_S
    while True:
        got = _in_order(deadline, wait) or _by_polling(deadline, time.monotonic() + wait)
        if got is not None:
            return got
        wait *= 2


def _take_leaves(leaves: list[Any], deadline: list[float]) -> None:
    """Take each leaf lock, waiting as long as it takes (its holder never waits for a pool); the deadline moves on
    by the time waited, as a compile in flight keeps its caller's pool for that long."""
    for leaf in leaves:
        if not leaf.acquire(blocking=False):
            started = time.monotonic()
            leaf.acquire()
            deadline[0] += time.monotonic() - started


def _listed() -> tuple[list[Any], list[Any]]:
    with _registry_lock:
        return list(_live.values()), list(_leaves)


def _made_since(pools: list[Any]) -> list[Any]:
    """The pools made since ``pools`` was listed; call with ``_registry_lock`` held, so none is being made."""
    listed = {id(p) for p in pools}
    return [p for p in _live.values() if id(p) not in listed]


def _in_order(deadline: list[float], wait: float) -> tuple[list[Any], list[Any], list[Any]] | None:
    """Every lock in the order the pools were made, each waited for at most ``wait`` seconds.

    Waiting while holding the earlier ones is what lets a fork in between
    a thread's calls through: the thread's next call waits for the fork.
    A thread that holds one pool's lock and waits for another's could
    deadlock with it, so a wait that runs out gives everything back
    (``None``), for :func:`_by_polling` to go on.
    """
    pools, leaves = _listed()
    taken: list[Any] = []
    for lock in [p.lock for p in pools] + [_registry_lock]:
        if not lock.acquire(timeout=max(0.0, min(wait, deadline[0] - time.monotonic()))):
            _release(taken)
            return None
        taken.append(lock)
    _take_leaves(leaves, deadline)  # their holders never wait for a pool's lock, so this wait ends
    taken += leaves
    made = _made_since(pools)
    more, busy = _try_all([p.lock for p in made])
    if busy:
        _release(taken + more)
        return None
    return pools + made, taken + more, []


def _by_polling(deadline: list[float], until: float) -> tuple[list[Any], list[Any], list[Any]] | None:
    """Every lock at once, holding none while waiting, until ``until`` (``None`` then); at the deadline, whichever
    are free then."""
    pause = _FIRST_PAUSE_S
    while True:
        pools, leaves = _listed()
        started = deadline[0]
        _take_leaves(leaves, deadline)  # holding nothing, so this wait ends
        until += deadline[0] - started  # a wait for a compile does not count
        last = time.monotonic() + pause > deadline[0]
        taken, busy = _try_all([_registry_lock] + [p.lock for p in pools])
        if _registry_lock in taken:  # no pool can be made now: take those made since the list was read
            made = _made_since(pools)
            pools += made
            more, late = _try_all([p.lock for p in made])
            taken += more
            busy += late
        if not busy or last:
            return pools, leaves + taken, busy
        _release(taken + leaves)
        if time.monotonic() + pause > until:
            return None
        # A thread that holds a busy lock in a loop of its own is preempted
        # sooner while this one waits, so an attempt lands between two of
        # its holds more often.
        sys.setswitchinterval(_SWITCH_S)
        time.sleep(pause)
        pause = min(pause * 2, _LAST_PAUSE_S)


def _after_in_parent() -> None:
    _release(_this_fork.held)
    _this_fork.held, _this_fork.missed, _this_fork.keep = [], [], []


def _after_in_child() -> None:
    global _registry_lock  # noqa: PLW0603 - a fresh one, whatever the parent's was doing
    for pool in _this_fork.missed:
        pool.lock = _Forked(type(pool).__name__)
    for obj_ref, attr, pool_ref in _followers:
        obj, pool = obj_ref(), pool_ref()
        if obj is not None and pool is not None and isinstance(pool.lock, _Forked):
            setattr(obj, attr, pool.lock)
    _followers[:] = [f for f in _followers if f[0]() is not None]
    held = [lock for lock in _this_fork.held if lock is not _registry_lock]
    _release(held)
    _registry_lock = threading.Lock()
    _this_fork.held, _this_fork.missed, _this_fork.keep = [], [], []


class _Forked:
    """A child's lock for a pool that was in use by another thread at the fork: every use raises."""

    def __init__(self, kind: str) -> None:
        self._kind = kind

    def _refuse(self) -> PoolForkedError:
        return PoolForkedError(
            f"this {self._kind} was in use by another thread when the process forked, so its state may be "
            "half-written; make a new pool in the child (or fork before other threads use the pool)"
        )

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        raise self._refuse()

    def release(self) -> None:
        raise self._refuse()

    def __enter__(self) -> bool:
        raise self._refuse()

    def __exit__(self, *exc: object) -> None:
        raise self._refuse()

    def __repr__(self) -> str:
        return f"<hostpool_nb lock of a {self._kind} in use by another thread at the fork: unusable>"


if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
