"""What every pool whose state is int64 arrays changed only by kernels shares, written once.

Each kind (``LogicalHostPool``, ``HostPagePool``, the paged allocators)
subclasses :class:`ArrayStatePool` and supplies its layout's pieces:

- ``_kind``: its name in messages, and ``_format``: the key of
  :data:`~hostpool_nb._diagnostics.snapshot.FORMATS` its pickles carry;
- ``_state_class``: what ``backup_state`` returns and ``restore_state``
  takes; ``_snapshot()`` makes one (under the lock), ``_checked(state)``
  checks one and returns what to load (a ``HostPoolError`` if it cannot
  be this pool's, before the lock), and ``_load(checked)`` loads it with a
  kernel (under the lock);
- ``_corruption()``: what ``check_invariants`` reports (under the lock),
  or ``None``;
- ``_pickled()`` (under the lock) and ``_unpickled(saved, what)``: the
  fields of its pickle besides the format, and how a fresh object takes
  them, checked as ``restore_state`` checks a snapshot.

The base makes the lock and registers it with the fork handlers, and
writes each public step of the protocol once: the type check, the order
of checks and lock, the format check, the messages.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar, TypeVar, cast

import numpy as np
from numpy.typing import NDArray

from .._diagnostics.snapshot import FORMATS, check_format
from .._errors import HostPoolError
from .._fork import register as register_fork_lock
from .._kernels import layout as _layout

#: The classes a trace names its pool by: a subclass records (and replays) as the one of these it derives from.
RECORDED_KINDS = (
    "LogicalHostPool",
    "PagedTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "SWATokenToKVPoolAllocator",
)


def recorded_kind(pool: Any) -> str:
    """The kind a trace of ``pool`` names: its class, or the nearest base among :data:`RECORDED_KINDS`."""
    for cls in type(pool).__mro__:
        if cls.__name__ in RECORDED_KINDS:
            return cls.__name__
    return type(pool).__name__


_M = TypeVar("_M", bound=Callable[..., Any])


def handed_off(method: _M) -> _M:
    """``method`` beginning with the recording hand-off (see :class:`Recordable`): for the calls off the hot paths.

    The hot paths write the three lines out, where a call more would cost
    more than the check; every other recorded method takes this.
    """
    name = method.__name__

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self._recording
        if rec is not None and rec.takes():
            return getattr(rec, name)(*args, **kwargs)
        return method(self, *args, **kwargs)

    return cast("_M", call)


class ArrayStatePool:
    """The protocol: one lock, registered for forks; snapshots, pickles and the invariants, checked the same way."""

    _kind: ClassVar[str] = ""
    _format: ClassVar[str] = ""
    _state_class: ClassVar[type] = object
    lock: Any
    # While the pool records (``_diagnostics/recording.py``), what its recorded methods hand their calls to; else None.
    _recording: Any = None

    def _make_lock(self) -> None:
        """The pool's ``threading.RLock``, taken across every fork (``_fork.py``)."""
        self.lock = threading.RLock()
        register_fork_lock(self)

    # -- what each kind supplies ------------------------------------------------------

    def _snapshot(self) -> Any:
        raise NotImplementedError

    def _checked(self, state: Any) -> Any:
        raise NotImplementedError

    def _load(self, checked: Any) -> None:
        raise NotImplementedError

    def _corruption(self) -> str | None:
        raise NotImplementedError

    def _pickled(self) -> dict[str, Any]:
        raise NotImplementedError

    def _unpickled(self, saved: dict[str, Any], what: str) -> None:
        raise NotImplementedError

    # -- the protocol ------------------------------------------------------------------

    @handed_off
    def backup_state(self) -> Any:
        """An immutable snapshot of the pool's state, taken under its lock; ``restore_state`` puts it back."""
        with self.lock:
            return self._snapshot()

    @handed_off
    def restore_state(self, state: Any) -> None:
        """Put the pool back in the state of a snapshot from ``backup_state``.

        Parameters
        ----------
        state
            A snapshot from ``backup_state()`` of a pool of the same kind
            and shape.

        Raises
        ------
        TypeError
            If ``state`` is not this kind's snapshot.
        HostPoolError
            If it is from a pool of another shape, or its contents fail
            the invariants; the pool is then unchanged.
        """
        if not isinstance(state, self._state_class):
            name = self._state_class.__name__
            raise TypeError(f"state must be a {name} from backup_state(), got {type(state).__name__}")
        checked = self._checked(state)  # before the lock: a refused state costs the pool nothing
        with self.lock:
            self._load(checked)

    def check_invariants(self) -> None:
        """Verify the state, independently of the kernels; raise ``RuntimeError`` if it is broken. O(pages)."""
        with self.lock:
            found = self._corruption()
        if found is not None:
            raise RuntimeError(found)

    def __getstate__(self) -> dict[str, Any]:
        """What pickle and ``copy.deepcopy`` keep: the format, and the kind's fields as of one moment."""
        with self.lock:
            fields = self._pickled()
        return {"format": FORMATS[self._format], **fields}

    def __setstate__(self, saved: Any) -> None:
        """Rebuild a pickled pool, with a lock of its own; a damaged pickle is a ``HostPoolError``.

        Every field is checked as the constructor checks its arguments, and
        the state as ``restore_state`` checks a snapshot: a damaged pickle
        is an error saying what is wrong, not a pool that fails later.
        """
        what = f"the pickled {type(self).__name__}"
        if not isinstance(saved, dict):
            raise HostPoolError(f"{what} holds a {type(saved).__name__}, not a pool's state")
        if check_format(saved.get("format"), self._format, type(self).__name__):
            saved = self._upgraded(saved)
        with unrecorded():  # a constructor called on the way records nothing: the state is not loaded yet
            self._unpickled(saved, what)
        if isinstance(self, Recordable):
            self._record_if_asked()

    def _upgraded(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A pickle's fields in an older format (``snapshot.CONVERTS``), converted (kinds that have one)."""
        return saved

    def _corrupt(self, op: str, status: int) -> RuntimeError:
        """The error for a kernel that failed where the state allows no failure: a bug in the pool."""
        code, pos = _layout.decode_status(status)
        return RuntimeError(
            f"{self._kind or type(self).__name__} state is corrupted: {op} kernel failed with code {code} at {pos}; "
            "please report this with the calls that led to it"
        )


#: The environment variable that makes every recordable pool record its calls into a folder (``_diagnostics/live.py``).
RECORD_ENV = "HOSTPOOL_NB_RECORD"
_parts = threading.local()  # depth > 0 while pools are built that HOSTPOOL_NB_RECORD does not record


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """``HOSTPOOL_NB_RECORD`` records no pool built inside the block (in this thread).

    The pools that are parts of another (a sliding-window allocator's
    sides: the whole is recorded), a constructor called on the way to
    loading a state, and the tools' own pools (replay's, the bench's), which
    would time the recording otherwise.
    """
    _parts.depth = getattr(_parts, "depth", 0) + 1
    try:
        yield
    finally:
        _parts.depth -= 1


class Recordable:
    """``pool.recording(path)``, for the kinds whose calls a trace can hold (``trace.CALLS``).

    Each supplies ``_recorded`` (the methods whose calls a trace holds),
    ``_trace_shape()`` (the trace header's fields but the version and the
    lengths) and ``_trace_start()`` (the ``start`` array: the state the
    recording begins from), both called under the lock. Each method of
    ``_recorded`` is decorated with :func:`handed_off`, or (a hot path,
    where a call more costs more than the check) begins (or, on a path that
    a recording turns off, branches) with::

        rec = self._recording
        if rec is not None and rec.takes():
            return rec.<method>(<its arguments>)

    so that while a recording runs every call reaches it, however the
    method was looked up (a method bound before the recording began too),
    and the recording's own call to the method does its work.
    """

    _recorded: ClassVar[tuple[str, ...]] = ()

    def _trace_shape(self) -> dict[str, Any]:
        raise NotImplementedError

    def _recording_changed(self) -> None:
        """Under the lock, when a recording begins or ends: a kind with a hot path that skips the check adjusts it."""

    def _kernel_calls(self) -> list[tuple[Any, str]]:
        """Every kernel this pool may call, as ``(Entries, name)``: what ``hostpool_nb.warmup.load`` loads."""
        raise NotImplementedError

    def _record_if_asked(self) -> None:
        """At the end of building (or unpickling) the pool: record it if ``HOSTPOOL_NB_RECORD`` names a folder."""
        folder = os.environ.get(RECORD_ENV)
        if folder and not getattr(_parts, "depth", 0):
            from .._diagnostics.live import record  # noqa: PLC0415 - the trace machinery only when asked for

            record(self, folder)

    def _trace_start(self) -> NDArray[np.int64]:
        raise NotImplementedError

    def recording(self, path: Any) -> AbstractContextManager[None]:
        """``with pool.recording(path): ...``: write every call made in the block to ``path``.

        The trace (``hostpool_nb.trace`` documents its format: a ``.npz``
        archive, readable with ``numpy.load``) holds the pool's parameters,
        the state the block began from, and each call's arguments, results
        and errors, in order; ``python -m hostpool_nb.replay path`` checks
        that a fresh pool does the same, and ``python -m bench --trace
        path`` times the workload against the original algorithm. Calls are
        serialised while recording.

        Parameters
        ----------
        path : str or os.PathLike
            The file to write; its folder must exist. It is checked before
            the block runs.
        """
        from .._diagnostics.recording import recording  # noqa: PLC0415 - keeps the trace machinery out of `import hostpool_nb`

        return recording(self, path)


def start_words(states: list[tuple[int, NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]]) -> NDArray[np.int64]:
    """A trace's ``start`` array: per rank ``[depth, free, released, pending]`` then those lists' page ids."""
    parts: list[NDArray[np.int64]] = []
    for depth, free, released, pending in states:
        counts = [depth, free.shape[0], released.shape[0], pending.shape[0]]
        parts += [np.array(counts, dtype=np.int64), free, released, pending]
    return np.concatenate(parts).astype(np.int64)
