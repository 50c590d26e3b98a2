"""Recording a pool's calls into a trace (``pool.recording(path)``); the format is ``trace.py``'s.

While a block records, each recorded method of the pool is replaced, on the
instance, by a wrapper that holds the pool's lock for the whole call and
appends the call's arguments, result and error; the file is written when
the block ends. Nothing here imports a pool class, so the pools can import
this module without a circle.
"""

from __future__ import annotations

import contextlib
import operator
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import _layout
from ._convert import as_slots
from ._errors import HostPoolError
from .trace import ERRORS, HEADER_DTYPE, OP_DTYPE, OPS, VERSION


class Recorder:
    """Collects a pool's calls while a ``recording()`` block runs, then writes the file."""

    def __init__(self, pool: Any) -> None:
        """Start recording ``pool``: under its lock, so the state it starts from is one call's."""
        self.pool = pool
        st = pool._st
        counts = [int(st[h]) for h in (_layout.H_GROUP_DEPTH, _layout.H_NFREE, _layout.H_NREL, _layout.H_NPEND)]
        self.start = np.concatenate([np.array(counts, dtype=np.int64), _layout.listed(st).astype(np.int64)])
        self.ops: list[tuple[int, int, bool, int, int, int, int]] = []
        self.data: list[NDArray[np.int64]] = []
        self.data_len = 0
        self.messages: list[str] = []
        self.backups: list[Any] = []  # snapshots taken while recording: their number is their place

    def _numbers(self, *arrays: Any) -> int:
        offset = self.data_len
        for a in arrays:
            arr = np.asarray(a, dtype=np.int64).reshape(-1).copy()
            self.data.append(arr)
            self.data_len += arr.shape[0]
        return offset

    def add(
        self,
        op: str,
        arg: int | None,
        result: int,
        numbers: tuple[Any, ...] = (),
        exc: BaseException | None = None,
    ) -> None:
        """Append one call; ``arg=None`` (or a ``TypeError``) marks it as not replayable."""
        offset = self._numbers(*numbers)
        error, message = 0, -1
        unreadable = arg is None
        if exc is not None:
            name = type(exc).__name__
            error = ERRORS.index(name) if name in ERRORS else ERRORS.index("HostPoolError")
            message = len(self.messages)
            self.messages.append(str(exc))
            unreadable = unreadable or isinstance(exc, TypeError)  # the record holds only numbers
        self.ops.append((OPS.index(op), error, unreadable, -1 if arg is None else arg, result, offset, message))

    def write(self, path: str | os.PathLike[str], tmp: str | None = None) -> None:
        """Write the trace atomically: into ``tmp`` (a new file in the same folder), then a rename."""
        pool = self.pool
        header = np.array(
            [
                (
                    VERSION,
                    type(pool).__name__,
                    pool.size,
                    pool.page_size,
                    pool.merge_order,
                    pool.track,
                    len(self.ops),
                    self.data_len,
                )
            ],
            dtype=HEADER_DTYPE,
        )
        ops = np.array(self.ops, dtype=OP_DTYPE)
        data = np.concatenate(self.data) if self.data else np.empty(0, dtype=np.int64)
        messages = np.array(self.messages if self.messages else [""], dtype=np.str_)
        target = Path(path)
        if tmp is None:
            fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
            os.close(fd)
        try:
            with open(tmp, "wb") as f:
                np.savez(f, header=header, ops=ops, data=data, messages=messages, start=self.start)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _slots_of(value: Any) -> NDArray[np.int64] | None:
    """What a recorded call returned or took, as int64 numbers (torch tensors too)."""
    if value is None:
        return None
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        value = value.numpy()
    return np.asarray(value, dtype=np.int64).reshape(-1)


@contextlib.contextmanager
def recording(pool: Any, path: str | os.PathLike[str]) -> Iterator[None]:
    """Record every call on ``pool`` inside the block; write ``path`` when it ends.

    While recording, each recorded method of ``pool`` is replaced (on the
    instance) by a wrapper that holds the pool's lock for the whole call,
    so the record's order is the order the calls changed the pool. The file
    is written when the block ends, also when it raises. Everything that
    can be checked before the block runs is: ``path`` must name a file in a
    directory that exists and takes a new file (the temporary file the
    trace is written to is made then), and the pool must not be recording.
    """
    target = Path(path)
    if not target.parent.is_dir():
        raise HostPoolError(f"cannot record to {path}: directory {target.parent} does not exist")
    if str(path) == "" or target.is_dir():
        raise HostPoolError(f"cannot record to {str(path)!r}: it is a directory, not a file name")
    try:
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise HostPoolError(f"cannot record to {path}: {exc.strerror or exc}") from None
    os.close(fd)
    with pool.lock:  # checked and installed in one hold: two threads cannot both start recording
        if any(name in vars(pool) for name in _RECORDED):
            os.unlink(tmp)
            raise HostPoolError("this pool is already recording: recordings do not nest")
        rec = Recorder(pool)
        for name in _RECORDED:
            setattr(pool, name, _wrap(pool, rec, name, getattr(pool, name)))
    try:
        yield
    except BaseException as exc:
        _stop(pool)
        try:
            rec.write(target, tmp)
        except Exception as lost:  # noqa: BLE001 - the block's own exception is the one to raise
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"hostpool_nb: the trace {path} could not be written: {lost!r}")
        raise
    _stop(pool)
    rec.write(target, tmp)


def _stop(pool: Any) -> None:
    with pool.lock:
        for name in _RECORDED:
            vars(pool).pop(name, None)


_RECORDED = (
    "alloc",
    "alloc_many",
    "free",
    "clear",
    "merge",
    "free_group_begin",
    "free_group_end",
    "backup_state",
    "restore_state",
)
_OP_OF = {"backup_state": "backup", "restore_state": "restore"}


def _wrap(pool: Any, rec: Recorder, name: str, method: Any) -> Any:
    """The recording stand-in for one of ``pool``'s methods (see :class:`_Calls`)."""
    calls = _Calls(pool, rec, method)
    wrapper = getattr(calls, name, None)
    return wrapper if wrapper is not None else calls.simple(_OP_OF.get(name, name))


class _Calls:
    """Recording wrappers: each holds the pool's lock around the call and its record."""

    def __init__(self, pool: Any, rec: Recorder, method: Any) -> None:
        self.pool, self.rec, self.method = pool, rec, method

    @property
    def lock(self) -> Any:
        """The pool's lock, read at each call: a fork may replace it in a child (``_fork.py``)."""
        return self.pool.lock

    def alloc(self, need_size: Any, *, tag: Any = None) -> Any:
        with self.lock:
            try:
                out = self.method(need_size, tag=tag)
            except Exception as exc:
                self.rec.add("alloc", _int_or_none(need_size), 0, (), exc)
                raise
            slots = _slots_of(out)
            if slots is None:
                self.rec.add("alloc", _int_or_none(need_size), -1)
            else:
                self.rec.add("alloc", _int_or_none(need_size), slots.shape[0], (slots,))
            return out

    def alloc_many(self, sizes: Any, *, tag: Any = None) -> Any:
        with self.lock:
            known = _sizes_or_none(sizes)
            arg, numbers = (None, ()) if known is None else (known.shape[0], (known,))
            try:
                got = self.method(sizes, tag=tag)
            except Exception as exc:
                self.rec.add("alloc_many", arg, 0, numbers, exc)
                raise
            slots = None if got is None else _slots_of(got[0])
            if slots is None:
                self.rec.add("alloc_many", arg, -1, numbers)
            else:
                self.rec.add("alloc_many", arg, slots.shape[0], (*numbers, slots))
            return got

    def free(self, indices: Any) -> Any:
        with self.lock:
            try:
                slots: NDArray[np.int64] | None = _slots_of_input(indices)
            except Exception:  # noqa: BLE001 - unreadable input: the pool decides, the record skips it
                slots = None
            arg, numbers = (None, ()) if slots is None else (slots.shape[0], (slots,))
            try:
                n = self.method(indices)
            except Exception as exc:
                self.rec.add("free", arg, 0, numbers, exc)
                raise
            self.rec.add("free", arg, n, numbers)
            return n

    def backup_state(self) -> Any:
        with self.lock:
            state = self.method()
            self.rec.backups.append(state)  # kept alive, so no later object can take its identity
            self.rec.add("backup", len(self.rec.backups) - 1, 0)
            return state

    def restore_state(self, state: Any) -> Any:
        with self.lock:
            number = next((i for i, s in enumerate(self.rec.backups) if s is state), None)  # None: taken before
            try:
                self.method(state)
            except Exception as exc:
                self.rec.add("restore", number, 0, (), exc)
                raise
            self.rec.add("restore", number, 0)

    def simple(self, op: str) -> Any:
        """clear, merge, free_group_begin, free_group_end: no argument, an int or nothing back."""

        def call() -> Any:
            with self.lock:
                try:
                    value = self.method()
                except Exception as exc:
                    self.rec.add(op, 0, 0, (), exc)
                    raise
                self.rec.add(op, 0, value if isinstance(value, int) else 0)
                return value

        return call


def _int_or_none(value: Any) -> int | None:
    """A count as recorded: an integer within int64 (``__index__``, so a 0-d integer tensor too), else ``None``."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        v = operator.index(value)
    except Exception:  # noqa: BLE001 - not an integer: not replayable
        return None
    return v if -(2**63) <= v < 2**63 else None


def _sizes_or_none(sizes: Any) -> NDArray[np.int64] | None:
    try:
        arr = np.asarray(sizes.numpy() if hasattr(sizes, "numpy") and not isinstance(sizes, np.ndarray) else sizes)
    except Exception:  # noqa: BLE001 - unreadable: recorded as such
        return None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        return None
    if arr.size and arr.dtype.kind == "u" and int(arr.max()) >= 2**63:
        return None  # beyond int64: astype would wrap it
    try:
        return np.array(arr, dtype=np.int64)
    except (OverflowError, ValueError):
        return None


def _slots_of_input(indices: Any) -> NDArray[np.int64] | None:
    value = indices.numpy() if hasattr(indices, "numpy") and not isinstance(indices, np.ndarray) else indices
    slots: NDArray[np.int64] = as_slots(value).copy()
    return slots
