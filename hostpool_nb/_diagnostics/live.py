"""Recording every pool a process builds, from the environment: ``HOSTPOOL_NB_RECORD=<folder>``.

Each recordable pool records from the moment it is built (or unpickled)
into a trace of its own in that folder, written as it goes by a thread (a
process killed with ``SIGKILL`` leaves all but its last second or so), up
to ``HOSTPOOL_NB_RECORD_MB``; what it writes, when, and what a fork or a
full bound does: docs/diagnostics.md ("Recording an engine you do not
edit"). Each write packs the calls since the last one and drops them, and
is atomic (a new file, then a rename); the folder is resolved once.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, cast

from .._errors import HostPoolError
from ..trace import OP_DTYPE
from .recording import Recorder, _stop, start

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
    if not 0 < mb <= _MOST_MB:  # nan, inf and 1e400 (inf) too
        raise HostPoolError(
            f"{LIMIT_ENV} must be a positive number of megabytes, at most {_MOST_MB:g}, got {LIMIT_ENV}={value!r}"
        )
    return int(mb * (1 << 20))


_MOST_MB = 1e9  # a petabyte: a larger bound is a typo (an exponent, inf)


def megabytes(limit: int) -> str:
    """A bound in bytes as the megabytes it was set in: ``256``, ``0.05``."""
    return f"{round(limit / (1 << 20), 4):g}"  # rounded: the bytes were rounded down from what was set


def record(pool: Any, folder: str) -> None:
    """Record ``pool`` from now on into a new trace in ``folder`` (``Recordable._record_if_asked``).

    Its first write, the state the recording begins from, comes now: a process that ends at once leaves a
    trace, and a start state that alone passes the bound records nothing (a WARNING says why).
    """
    limit = limit_bytes()
    where = resolved(folder)
    path = _claim(where, folder, pool)
    recording = LiveRecording(pool, path, limit)
    if not recording.begin():
        return
    with _lock:
        _recordings.append(recording)
        _Flusher.ensure()
        _flush_when_a_worker_ends()
    _log.warning(
        "hostpool_nb: recording every call of this %s into %s (%s=%s; up to %s MB)",
        type(pool).__name__,
        path,
        ENV,
        folder,
        megabytes(limit),
    )


_folders: dict[str, Path] = {}  # HOSTPOOL_NB_RECORD's value -> the folder it named the first time


def resolved(folder: str) -> Path:
    """The folder ``folder`` names, ``~`` expanded, as it named it the first time: a later chdir moves no trace."""
    found = _folders.get(folder)
    if found is None:
        found = _folders[folder] = Path(folder).expanduser().absolute()
    return found


def _claim(folder: Path, said: str, pool: Any) -> Path:
    """A new trace file in ``folder`` (made if missing) for ``pool``: created here, so no other pool takes it.

    ``said`` is the folder as the variable gave it, for the errors.
    """
    if folder.exists() and not folder.is_dir():
        raise HostPoolError(f"{ENV}={said!r}: {folder} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HostPoolError(f"{ENV}={said!r}: cannot make the folder {folder} ({exc.strerror or exc})") from None
    kind = pool._trace_shape()["pool"].replace("/", "-")  # HostKVBooks/<bookkeeping>: one file name
    while True:
        path = folder / f"{kind}-{_started}-pid{os.getpid()}-{next(_numbers)}.trace"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        except OSError as exc:
            raise HostPoolError(f"{ENV}={said!r}: cannot write in {folder} ({exc.strerror or exc})") from None
        os.close(fd)
        return path


_finalized: set[int] = set()  # the processes whose multiprocessing exit writes every trace


def _flush_when_a_worker_ends() -> None:
    """Under ``_lock``: a multiprocessing worker (fork, forkserver) ends with ``os._exit``, which runs no exit
    handler but multiprocessing's own finalizers: one of those writes every trace of the process."""
    pid = os.getpid()
    if pid in _finalized:
        return
    _finalized.add(pid)
    from multiprocessing import util  # noqa: PLC0415 - only in a process that records

    util.Finalize(None, flush_all, exitpriority=100)


class _BoundedRecorder(Recorder):
    """A recorder that stops taking calls once the trace would pass ``limit`` bytes."""

    def __init__(self, pool: Any) -> None:
        super().__init__(pool)
        self.limit = 0
        self.full = False
        self.on_full: Any = None
        # The file's bytes at its last write, and what the record held when that write's calls were taken.
        self.written = 0
        self.written_holds = self.holds()

    def holds(self) -> tuple[int, int, int, int]:
        """What the record holds now: (calls, runs, messages, characters). Under the pool's lock."""
        return self.calls, self.runs, self.texts, self.chars

    def size(self) -> int:
        """A bound on the trace file's bytes, were it written now: the last write's, and what came since.

        What came since is counted as it is before compression (the records,
        16 bytes a run of numbers, the messages as JSON: 6 bytes a character
        at most), with what zlib adds to what it cannot shrink, a few bytes
        a thousand; before the first write, the start state and 4 KB for
        the archive's headers.
        """
        calls, runs, texts, chars = self.written_holds
        body = (self.calls - calls) * OP_DTYPE.itemsize + (self.runs - runs) * 16
        body += (self.chars - chars) * 6 + (self.texts - texts) * 4
        if not self.written:
            body += self.start.shape[0] * 8
        return int(self.written or 4096) + body + body // 500 + 256

    def add(self, *args: Any, **kwargs: Any) -> None:
        if self.full:
            return
        pending = len(self.ops), len(self.data), len(self.messages)
        counts = self.calls, self.numbers, self.runs, self.texts, self.chars
        super().add(*args, **kwargs)
        if self.size() <= self.limit:
            return
        # The call that would pass the bound is not recorded: the trace ends with the one before.
        del self.ops[pending[0] :], self.data[pending[1] :], self.messages[pending[2] :]
        self.calls, self.numbers, self.runs, self.texts, self.chars = counts
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
        self._flushing = threading.Lock()  # one write at a time: each packs the calls after the last one's
        self._written = -1  # the calls the file holds (-1: not written yet)
        self.write_seconds = 0.0
        rec = cast(_BoundedRecorder, start(pool, _BoundedRecorder))
        rec.limit = limit
        rec.on_full = self._full
        self.rec = rec

    def begin(self) -> bool:
        """Write the trace of no call; ``False`` (nothing recorded, the file gone) if that alone passes the bound.

        A first write that fails (a full disk) is said and tried again later, as every write.
        """
        if not self.flush(force=True) or self.rec.written <= self.rec.limit:
            return True
        pool = self._pool()
        if pool is not None:
            _stop(pool)
        with contextlib.suppress(OSError):
            self.path.unlink()
        _log.warning(
            "hostpool_nb: not recording this %s: the state it begins from alone takes %.3g MB, over %s=%s MB",
            self.rec.shape["pool"],
            self.rec.written / (1 << 20),
            LIMIT_ENV,
            megabytes(self.rec.limit),
        )
        return False

    def _full(self) -> None:
        """Called under the pool's lock by the call that would pass the bound: stop recording the pool."""
        pool = self._pool()
        if pool is not None:
            _stop(pool)
        _log.warning(
            "hostpool_nb: stopped recording into %s at %d calls: the trace reached %s=%s MB",
            self.path,
            self.rec.calls,
            LIMIT_ENV,
            megabytes(self.rec.limit),
        )

    def flush(self, force: bool = False) -> bool:
        """Write the trace if it has new calls (in this process only); whether it wrote."""
        if os.getpid() != self.pid:
            return False
        with self._flushing:
            with self._lock:
                if self.rec.calls == self._written and not force:
                    return False
                holds = self.rec.holds()
                batch = self.rec.take()
            began = time.monotonic()
            try:
                self.rec.pack(batch)  # the lock let go: the pool goes on serving while this compresses
                size = self.rec.write(self.path)
            except OSError as exc:  # a full disk, a folder removed: say so, keep serving, try again later
                _log.warning("hostpool_nb: could not write the trace %s: %s", self.path, exc)
                return False
            with self._lock:  # the bound counts from this write on
                self.rec.written, self.rec.written_holds = size, holds
            self.write_seconds = time.monotonic() - began
            self._written = holds[0]
        return True

    def done(self) -> bool:
        """Whether nothing more will come: its pool is gone or full, and what it holds is written."""
        return (self._pool() is None or self.rec.full) and self.rec.calls == self._written


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
