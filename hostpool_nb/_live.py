"""Recording every pool a process builds, from the environment: ``HOSTPOOL_NB_RECORD=<folder>``.

An engine builds its allocators itself, so a user cannot wrap them in
``pool.recording(path)``. With ``HOSTPOOL_NB_RECORD`` set, every pool and
allocator whose calls a trace can hold (``LogicalHostPool``, its torch
adapter, sglang-jax's three device allocators) records from the moment it
is built (or unpickled) into a trace of its own in that folder, named
``<kind>-<start time>-pid<pid>-<n>.trace`` (``n`` counts the pools of the
process), and says so in one WARNING line on the ``hostpool_nb`` logger.
A sliding-window allocator's sub-allocators are part of its trace, not
traces of their own.

The trace is written as the pool goes, so that a process that is killed
(engines end their workers with ``SIGKILL``) leaves a readable trace of all
but its last second or so: a thread rewrites each trace that has new calls
every second (more seldom when a write takes long: at most a tenth of the
time goes to writing), and again when the process exits. Each write is
atomic (a new file, then a rename). A trace stops growing at
``HOSTPOOL_NB_RECORD_MB`` megabytes (256 by default): the pool goes on
unrecorded, a WARNING line says so, and the trace holds every call up to
then, so a long-running server cannot fill a disk. In a child process
made by ``fork`` the inherited pools stop recording (the parent's traces
are the parent's).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, cast

from ._errors import HostPoolError
from ._recording import Recorder, _stop, start
from .trace import OP_DTYPE

#: The environment variable naming the folder every pool records into.
ENV = "HOSTPOOL_NB_RECORD"
#: The environment variable bounding each trace, in megabytes.
LIMIT_ENV = "HOSTPOOL_NB_RECORD_MB"
DEFAULT_MB = 256
# Seconds between two writes of a trace with new calls, at least; and the share of time writes may take.
_INTERVAL_S = 1.0
_WRITE_SHARE = 0.1

_log = logging.getLogger("hostpool_nb")
_lock = threading.Lock()
_recordings: list[LiveRecording] = []
_numbers = itertools.count(1)
_started = time.strftime("%Y%m%dT%H%M%S")


def limit_bytes() -> int:
    """The bound on each trace, from :data:`LIMIT_ENV`; a value it cannot mean is a ``HostPoolError``."""
    value = os.environ.get(LIMIT_ENV, "").strip()
    if not value:
        return DEFAULT_MB << 20
    try:
        mb = float(value)
    except ValueError:
        mb = -1.0
    if not mb > 0:
        raise HostPoolError(f"{LIMIT_ENV} must be a positive number of megabytes, got {LIMIT_ENV}={value!r}")
    return int(mb * (1 << 20))


def megabytes(limit: int) -> str:
    """A bound in bytes as the megabytes it was set in: ``256``, ``0.05``."""
    return f"{limit / (1 << 20):.4g}"  # four figures: the bytes were rounded down from what was set


def record(pool: Any, folder: str) -> None:
    """Record ``pool`` from now on into a new trace in ``folder`` (``Recordable._record_if_asked``)."""
    limit = limit_bytes()
    path = _claim(Path(folder), pool)
    recording = LiveRecording(pool, path, limit)
    with _lock:
        _recordings.append(recording)
        _Flusher.ensure()
    _log.warning(
        "hostpool_nb: recording every call of this %s into %s (%s=%s; up to %s MB)",
        type(pool).__name__,
        path,
        ENV,
        folder,
        megabytes(limit),
    )


def _claim(folder: Path, pool: Any) -> Path:
    """A new trace file in ``folder`` (made if missing) for ``pool``: created here, so no other pool takes it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HostPoolError(f"{ENV}={str(folder)!r}: cannot make the folder ({exc.strerror or exc})") from None
    kind = pool._trace_shape()["pool"]
    while True:
        path = folder / f"{kind}-{_started}-pid{os.getpid()}-{next(_numbers)}.trace"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        except OSError as exc:
            raise HostPoolError(f"{ENV}={str(folder)!r}: cannot write there ({exc.strerror or exc})") from None
        os.close(fd)
        return path


class _BoundedRecorder(Recorder):
    """A recorder that stops taking calls once the trace would pass ``limit`` bytes."""

    def __init__(self, pool: Any) -> None:
        super().__init__(pool)
        self.limit = 0
        self.full = False
        self._chars = 0  # the messages' characters (at most six bytes each, as JSON, before compression)
        self.on_full: Any = None
        # The file's bytes at its last write, and what the record held then: (calls, runs, messages, characters).
        self.written = 0
        self.written_holds = (0, 0, 0, 0)

    def holds(self) -> tuple[int, int, int, int]:
        """What the record holds now, as :attr:`written_holds` counts it (under the pool's lock)."""
        return len(self.ops), self.runs, len(self.messages), self._chars

    def size(self) -> int:
        """A bound on the trace file's bytes, were it written now: the last write's, and what came since.

        What came since is counted as it is before compression (the records,
        16 bytes a run of numbers, the messages as JSON), with what zlib adds
        to what it cannot shrink, a few bytes a thousand; before the first
        write, the start state too, and 4 KB for the archive's own headers.
        """
        calls, runs, messages, chars = self.written_holds
        if not self.written:
            runs -= self.start.shape[0] // 2
        body = (len(self.ops) - calls) * OP_DTYPE.itemsize + (self.runs - runs) * 16
        body += (self._chars - chars) * 6 + (len(self.messages) - messages) * 4
        return int(self.written or 4096) + body + body // 500 + 256

    def add(self, *args: Any, **kwargs: Any) -> None:
        if self.full:
            return
        ops, data, messages = self.mark()  # the record holds what it held: the call that passes the bound goes
        data_len, runs = self.data_len, self.runs
        super().add(*args, **kwargs)
        self._chars += sum(len(m) for m in self.messages[messages:])
        if self.size() <= self.limit:
            return
        # The call that would pass the bound is not recorded: the trace ends with the one before.
        del self.ops[ops:], self.data[data:]
        self._chars -= sum(len(m) for m in self.messages[messages:])
        del self.messages[messages:]
        self.data_len, self.runs = data_len, runs
        self.full = True
        if self.on_full is not None:
            self.on_full()


class LiveRecording:
    """One pool's trace, written as it grows: by the flusher thread, at the bound and at exit."""

    def __init__(self, pool: Any, path: Path, limit: int) -> None:
        self.path = path
        self.pid = os.getpid()
        self._pool = weakref.ref(pool)
        self._lock = pool.lock  # guards the record's lists while the pool lives
        self._written = (-1, -1, -1)
        self.write_seconds = 0.0
        rec = cast(_BoundedRecorder, start(pool, _BoundedRecorder))
        rec.limit = limit
        rec.on_full = self._full
        self.rec = rec

    def _full(self) -> None:
        """Called under the pool's lock by the call that would pass the bound: stop recording the pool."""
        pool = self._pool()
        if pool is not None:
            _stop(pool)
        _log.warning(
            "hostpool_nb: stopped recording into %s at %d calls: the trace reached %s=%s MB",
            self.path,
            len(self.rec.ops),
            LIMIT_ENV,
            megabytes(self.rec.limit),
        )

    def flush(self) -> bool:
        """Write the trace if it has new calls (in this process only); whether it wrote."""
        if os.getpid() != self.pid:
            return False
        with self._lock:
            upto, holds = self.rec.mark(), self.rec.holds()
        if upto == self._written:
            return False
        began = time.monotonic()
        try:
            self.rec.write(self.path, upto=upto)
            written = self.path.stat().st_size
        except OSError as exc:  # a full disk, a folder removed: say so, keep serving, try again later
            _log.warning("hostpool_nb: could not write the trace %s: %s", self.path, exc)
            return False
        with self._lock:  # the bound counts from this write on
            self.rec.written, self.rec.written_holds = written, holds
        self.write_seconds = time.monotonic() - began
        self._written = upto
        return True

    def done(self) -> bool:
        """Whether nothing more will come: its pool is gone or full, and what it holds is written."""
        return (self._pool() is None or self.rec.full) and self.rec.mark() == self._written


class _Flusher:
    """The daemon thread that writes every live trace with new calls, about once a second."""

    thread: threading.Thread | None = None

    @classmethod
    def ensure(cls) -> None:
        """Under ``_lock``: start the thread in this process, if it is not running."""
        if cls.thread is None or not cls.thread.is_alive():
            cls.thread = threading.Thread(target=cls.run, name="hostpool_nb trace writer", daemon=True)
            cls.thread.start()

    @classmethod
    def run(cls) -> None:
        pause = _INTERVAL_S
        while True:
            time.sleep(pause)
            spent = flush_all()
            pause = max(_INTERVAL_S, spent / _WRITE_SHARE)


def flush_all() -> float:
    """Write every live trace with new calls; forget those that are done. The seconds it took."""
    with _lock:
        recordings = list(_recordings)
    spent = 0.0
    for recording in recordings:
        if recording.flush():
            spent += recording.write_seconds
    with _lock:
        _recordings[:] = [r for r in _recordings if not r.done()]
    return spent


def _forget_in_child() -> None:
    """After a fork, in the child: its inherited pools stop recording; the traces are the parent's."""
    global _lock  # noqa: PLW0603 - a fresh one, whatever the parent's threads were doing
    _lock = threading.Lock()
    for recording in _recordings:
        pool = recording._pool()
        if pool is not None:
            pool._recording = None  # no lock: the child's only thread is this one
            pool._recording_changed()
    _recordings.clear()
    _Flusher.thread = None


atexit.register(flush_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
