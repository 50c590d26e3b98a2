"""Fork safety: no process is forked while a pool call is in flight.

A child process inherits a copy of every lock as it was at the fork. A pool
whose lock another thread held then would hang the child's first call
forever, and a fork in the middle of a kernel would hand the child a
half-written state. So, as the ``logging`` module does for its handlers,
``os.register_at_fork`` takes every live pool's lock before a fork (in the
order the pools were made, so two forks cannot deadlock each other), which
waits for the calls in flight to end, and releases them afterwards in the
parent and in the child. In the child the forking thread, the only one
there, is the owner of each of those locks, so it can release them, and a
pool's state is whatever its last complete call left.

A fork waits for calls in flight, so a thread that holds ``pool.lock`` for
long (``with pool.lock: ...``) delays it. The kernels' compile lock is
taken last (:func:`hold_last`), so a fork also waits for a compile in flight
(a child would inherit numba's compiler lock held), and a call that compiles
under its pool's lock cannot deadlock against the forking thread.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from typing import Any

_registry_lock = threading.Lock()
# Creation number -> object with a ``lock`` attribute; an entry goes when its pool does.
_live: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_numbers = itertools.count()
_held: list[Any] = []
_last: list[Any] = []  # locks taken after every pool's


def register(obj: Any) -> None:
    """Hold ``obj.lock`` across every later fork, for as long as ``obj`` lives."""
    with _registry_lock:
        _live[next(_numbers)] = obj


def hold_last(lock: Any) -> None:
    """Hold ``lock`` across every later fork, taken after every pool's lock."""
    with _registry_lock:
        _last.append(lock)


def _before_fork() -> None:
    _registry_lock.acquire()
    for lock in [obj.lock for _, obj in sorted(_live.items())] + _last:
        lock.acquire()
        _held.append(lock)


def _after_fork() -> None:
    while _held:
        _held.pop().release()
    _registry_lock.release()


if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)
