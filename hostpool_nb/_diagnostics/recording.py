"""Recording a pool's calls into a trace (``pool.recording(path)``); the format is ``trace.py``'s.

While a block records, ``pool._recording`` holds a :class:`_Calls`, and
each recorded method of the pool hands its call there (however the method
was looked up: one bound before the block too), which holds the pool's
lock for the whole call and appends the call's arguments, result and
error; the file is written when the block ends. Nothing here imports a
pool class, so the pools can import this module without a circle: a kind
that records supplies ``_recorded`` (the methods it records), the check at
the top of each (``_core.protocol.Recordable``), ``_trace_shape()`` (the
header's fields) and ``_trace_start()`` (the ``start`` array), and its
calls name a ``dp_rank`` if it has ``dp_size``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import operator
import os
import threading
import weakref
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._convert import as_slots
from .._errors import HostPoolError
from ..trace import _LEVEL, ERRORS, HEADER_DTYPE, KINDS, OP_DTYPE, OPS, VERSION, _pack_runs, _runs_of

_names = itertools.count()


class Recorder:
    """Collects a pool's calls while it records, packing them as it goes, and writes the file.

    The calls since the last :meth:`pack` are kept as they came (records,
    runs of numbers, messages); packing compresses them into the trace's
    streams (``_Streams``) and drops them, so a recording holds about what
    its file holds and the calls since its last write. Snapshots taken
    while recording are numbered and held weakly: one the caller dropped
    is never restored, and no later object can take its number.
    """

    def __init__(self, pool: Any) -> None:
        """Start recording ``pool``: under its lock, so the state it starts from is one call's."""
        self.shape = pool._trace_shape()
        self.start = _runs_of(pool._trace_start())  # a 1M-slot pool's free list: one run
        self.ops: list[tuple[int, int, bool, int, int, int, int, int, int]] = []  # since the last pack
        self.data: list[NDArray[np.int64]] = []  # each call's numbers as runs (trace._runs_of), since the last pack
        self.messages: list[str] = []  # since the last pack
        self.calls = self.numbers = self.runs = self.texts = 0  # everything recorded, packed or not
        self.chars = 0  # the messages' characters
        self.backups: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # snapshot -> number
        self.n_backups = 0
        self._streams = _Streams(self.start)
        self._packing = threading.Lock()  # one packer at a time (a live recording's writer, the block's end)

    def _numbers(self, *arrays: Any) -> int:
        offset = self.numbers
        for a in arrays:
            arr = np.asarray(a, dtype=np.int64).reshape(-1)
            runs = _runs_of(arr)
            self.data.append(runs)
            self.numbers += arr.shape[0]
            self.runs += runs.shape[0] // 2
        return offset

    def add(  # noqa: PLR0913 - a record's fields
        self,
        op: str,
        arg: int | None,
        result: int,
        numbers: tuple[Any, ...] | None = (),
        exc: BaseException | None = None,
        *,
        rank: int | None = 0,
        kind: int = 0,
    ) -> None:
        """Append one call; ``arg``, ``numbers`` or ``rank`` ``None`` (or a ``TypeError``): not replayable.

        ``kind``: how its array argument came (an index into ``trace.KINDS``).
        """
        unreadable = arg is None or numbers is None or rank is None
        offset = self._numbers(*(() if unreadable or numbers is None else numbers))
        error, message = 0, -1
        if exc is not None:
            name = type(exc).__name__
            error = ERRORS.index(name) if name in ERRORS else ERRORS.index("HostPoolError")
            message = self.texts
            text = str(exc)
            self.messages.append(text)
            self.texts += 1
            self.chars += len(text)
            unreadable = unreadable or isinstance(exc, TypeError)  # the record holds only numbers
        arg = -1 if arg is None else arg
        self.ops.append((OPS.index(op), error, unreadable, arg, result, offset, message, rank or 0, kind))
        self.calls += 1

    def backup(self, state: Any) -> int:
        """Number a snapshot taken while recording (its place among them), held weakly."""
        number = self.n_backups
        self.backups[state] = number
        self.n_backups += 1
        return number

    def take(self) -> tuple[list[Any], list[Any], list[str]]:
        """The calls since the last pack, to :meth:`pack`; the record starts a new batch. Under the pool's lock."""
        batch = (self.ops, self.data, self.messages)
        self.ops, self.data, self.messages = [], [], []
        return batch

    def pack(self, batch: tuple[list[Any], list[Any], list[str]]) -> None:
        """Compress a batch from :meth:`take` into the streams: outside the pool's lock (zlib lets go of the GIL)."""
        with self._packing:
            self._streams.add(*batch)

    def write(self, path: str | os.PathLike[str], tmp: str | None = None) -> int:
        """Write every call packed so far, atomically: into ``tmp`` (a new file beside ``path``), then a rename.

        Returns the file's size. A recording that has ended packs what it
        holds first (``finish``).
        """
        with self._packing:
            arrays = self._streams.arrays(self.shape)
        target = Path(path)
        if tmp is None:
            tmp = temporary_beside(target)
        try:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stubs type the keywords as savez's own
                size = f.tell()
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return size

    def finish(self, path: str | os.PathLike[str], tmp: str | None = None) -> int:
        """Pack what is left and write the file: the recording has ended, nothing is added any more."""
        self.pack(self.take())
        return self.write(path, tmp)


class _Streams:
    """A trace's compressed arrays as they grow: the records, the numbers' runs and the messages, each a zlib
    stream that :meth:`arrays` closes on a copy, so that the next batch goes on where this one ended."""

    def __init__(self, start: NDArray[np.int64]) -> None:
        self.start = _pack_runs(start)
        self.streams = {name: zlib.compressobj(_LEVEL) for name in ("ops", "data", "messages")}
        self.chunks: dict[str, list[bytes]] = {name: [] for name in self.streams}
        self.calls = self.numbers = 0
        self.end = 0  # where the last run ended: the next run's first number is stored less it

    def add(self, ops: list[Any], data: list[NDArray[np.int64]], messages: list[str]) -> None:
        if ops:
            self._feed("ops", np.array(ops, dtype=OP_DTYPE).tobytes())
            self.calls += len(ops)
        if data:
            pairs = np.concatenate(data).reshape(-1, 2)
            if pairs.shape[0]:
                gaps = pairs.copy()
                gaps[0, 0] -= self.end
                gaps[1:, 0] -= pairs[:-1, 0] + pairs[:-1, 1]
                self.end = int(pairs[-1, 0] + pairs[-1, 1])
                self.numbers += int(pairs[:, 1].sum())
                self._feed("data", gaps.astype("<i8").tobytes())
        if messages:
            self._feed("messages", "".join(json.dumps(m) + "\n" for m in messages).encode())

    def _feed(self, name: str, raw: bytes) -> None:
        chunk = self.streams[name].compress(raw)
        if chunk:
            self.chunks[name].append(chunk)

    def arrays(self, shape: dict[str, Any]) -> dict[str, NDArray[Any]]:
        """The file's arrays now: the header, and each stream closed on a copy of its compressor."""
        fields = {**shape, "version": VERSION, "ops": self.calls, "data": self.numbers}
        header = np.array([tuple(fields[name] for name in HEADER_DTYPE.names or ())], dtype=HEADER_DTYPE)
        packed = {
            name: np.frombuffer(b"".join(self.chunks[name]) + stream.copy().flush(), dtype=np.uint8)
            for name, stream in self.streams.items()
        }
        return {"header": header, **packed, "start": self.start}


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

    While recording, every call of a recorded method of ``pool`` (however
    it was looked up) is made under the pool's lock for the whole call, so
    the record's order is the order the calls changed the pool. The file
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
        tmp = temporary_beside(target)
    except OSError as exc:
        raise HostPoolError(f"cannot record to {path}: {exc.strerror or exc}") from None
    try:
        rec = start(pool, Recorder)
    except BaseException:  # recording already, or not from this state: nothing is left behind
        os.unlink(tmp)
        raise
    writer = os.getpid()  # a child forked inside the block ends it too, and must not write the parent's file
    try:
        yield
    except BaseException as exc:
        _stop(pool)
        if os.getpid() == writer:
            try:
                rec.finish(target, tmp)
            except Exception as lost:  # noqa: BLE001 - the block's own exception is the one to raise
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"hostpool_nb: the trace {path} could not be written: {lost!r}")
        raise
    _stop(pool)
    if os.getpid() == writer:
        rec.finish(target, tmp)


def temporary_beside(target: Path) -> str:
    """A new empty file in ``target``'s folder, made with the permissions a new file gets (the umask's)."""
    for _ in range(100):
        name = target.parent / f"{target.name}.{os.getpid()}.{next(_names):x}.tmp"
        try:
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return str(name)
    raise FileExistsError(f"no new temporary file name beside {target}")


def start(pool: Any, recorder: type[Recorder]) -> Recorder:
    """Begin recording ``pool`` into a new ``recorder``: its state and its recorded methods, in one hold of its lock.

    ``HostPoolError`` if it is recording already (recordings do not nest).
    """
    with pool.lock:  # checked and installed in one hold: two threads cannot both start recording
        if is_recording(pool):
            raise HostPoolError("this pool is already recording: recordings do not nest")
        rec = recorder(pool)
        pool._recording = (_RankedCalls if hasattr(pool, "dp_size") else _Calls)(pool, rec)
        pool._recording_changed()
    return rec


def is_recording(pool: Any) -> bool:
    """Whether ``pool`` is recording."""
    return pool._recording is not None


def _stop(pool: Any) -> None:
    with pool.lock:
        pool._recording = None
        pool._recording_changed()


class _Calls:
    """A recording's calls: the pool's recorded methods hand each call here while it records.

    Each recorded method of the pool begins by looking at ``pool._recording``
    (``None`` but while a recording runs): if it is one of these and the
    calling thread is not inside one of its calls already, the call comes
    here, whatever way the method was looked up (a method bound before the
    recording began too). Each method here holds the pool's lock for the
    whole call, makes it as :attr:`owner` (so the pool's method lets it
    through to its own work) and records its arguments, result or error.
    """

    def __init__(self, pool: Any, rec: Recorder) -> None:
        self.pool, self.rec = pool, rec
        self.owner: int | None = None  # the thread inside a recorded call (under the pool's lock)

    def takes(self) -> bool:
        """Whether a call of the pool's on this thread comes here: it is not one this recording makes itself."""
        return self.owner != threading.get_ident()

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The pool's own method ``name``, called as the recording's owner: not recorded twice."""
        before, self.owner = self.owner, threading.get_ident()
        try:
            return getattr(self.pool, name)(*args, **kwargs)
        finally:
            self.owner = before

    @property
    def lock(self) -> Any:
        """The pool's lock, read at each call: a fork may replace it in a child (``_fork.py``)."""
        return self.pool.lock

    def _served(  # noqa: PLR0913, PLR0917 - a record's fields
        self, op: str, arg: int | None, numbers: tuple[Any, ...] | None, out: Any, rank: int | None, kind: int = 0
    ) -> None:
        """Record an allocation that returned ``out`` (slots, or ``None``)."""
        slots = _slots_of(out)
        if slots is None:
            self.rec.add(op, arg, -1, numbers, rank=rank, kind=kind)
        else:
            numbers = None if numbers is None else (*numbers, slots)
            self.rec.add(op, arg, slots.shape[0], numbers, rank=rank, kind=kind)

    def _freeing(self, op: str, free_index: Any, args: tuple[Any, ...], rank: int | None) -> Any:
        """A call that frees ``free_index`` (free, free_swa): the slots as read, then its count or its error."""
        with self.lock:
            try:
                slots: NDArray[np.int64] | None = _slots_of_input(free_index)
            except Exception:  # noqa: BLE001 - unreadable input: the pool decides, the record skips it
                slots = None
            arg, numbers = (None, ()) if slots is None else (slots.shape[0], (slots,))
            kind = kind_of(free_index)
            try:
                n = self._call(op, free_index, *args)
            except Exception as exc:
                self.rec.add(op, arg, 0, numbers, exc, rank=rank, kind=kind)
                raise
            self.rec.add(op, arg, n, numbers, rank=rank, kind=kind)
            return n

    def _sized(self, op: str, *args: Any, rank: int | None = 0) -> Any:
        """available_size and the sliding-window allocator's per side: nothing changes, the answer is recorded."""
        with self.lock:
            try:
                size = self._call(op, *args)
            except Exception as exc:
                self.rec.add(op, 0, 0, (), exc, rank=rank)
                raise
            self.rec.add(op, 0, size if type(size) is int else -1, rank=rank)
            return size

    def available_size(self) -> Any:
        return self._sized("available_size")

    def alloc(self, need_size: Any, *, tag: Any = None) -> Any:
        with self.lock:
            arg = _int_or_none(need_size)
            try:
                out = self._call("alloc", need_size, tag=tag)
            except Exception as exc:
                self.rec.add("alloc", arg, 0, (), exc)
                raise
            self._served("alloc", arg, (), out, 0)
            return out

    def alloc_many(self, sizes: Any, *, tag: Any = None) -> Any:
        with self.lock:
            known = _sizes_or_none(sizes)
            arg, numbers = (None, ()) if known is None else (known.shape[0], (known,))
            try:
                got = self._call("alloc_many", sizes, tag=tag)
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
        return self._freeing("free", indices, (), 0)

    def backup_state(self) -> Any:
        with self.lock:
            state = self._call("backup_state")
            self.rec.add("backup", self.rec.backup(state), 0)
            return state

    def restore_state(self, state: Any) -> Any:
        with self.lock:
            number = self._number_of(state)  # None: taken before the recording began
            try:
                self._call("restore_state", state)
            except Exception as exc:
                self.rec.add("restore", number, 0, (), exc)
                raise
            self.rec.add("restore", number, 0)

    def _number_of(self, state: Any) -> int | None:
        """The number of a snapshot taken while recording (and still alive), or ``None``."""
        try:
            return self.rec.backups.get(state)
        except TypeError:  # not a snapshot (unhashable, or not weakly referable): the pool says what it is
            return None

    def _simple(self, op: str) -> Any:
        """clear, merge, free_group_begin, free_group_end: no argument, an int or nothing back."""
        with self.lock:
            try:
                value = self._call(op)
            except Exception as exc:
                self.rec.add(op, 0, 0, (), exc)
                raise
            self.rec.add(op, 0, value if isinstance(value, int) else 0)
            return value

    def clear(self) -> Any:
        return self._simple("clear")

    def merge(self) -> Any:
        return self._simple("merge")

    def free_group_begin(self) -> Any:
        return self._simple("free_group_begin")

    def free_group_end(self) -> Any:
        return self._simple("free_group_end")


class _RankedCalls(_Calls):
    """The paged allocators' recording wrappers: their calls name a ``dp_rank``, and the batch calls."""

    def _rank(self, dp_rank: Any) -> int | None:
        """The rank as recorded: an int in ``[0, dp_size)``, else ``None`` (the call is not replayable)."""
        r = _int_or_none(dp_rank)
        return r if r is not None and 0 <= r < self.pool.dp_size else None

    def alloc(self, need_size: Any, dp_rank: Any = 0, *, tag: Any = None) -> Any:
        with self.lock:
            arg, rank = _int_or_none(need_size), self._rank(dp_rank)
            try:
                out = self._call("alloc", need_size, dp_rank, tag=tag)
            except Exception as exc:
                self.rec.add("alloc", arg, 0, (), exc, rank=rank)
                raise
            self._served("alloc", arg, (), out, rank)
            return out

    def alloc_extend(  # noqa: PLR0913 - the allocator's arguments
        self,
        prefix_lens: Any,
        seq_lens: Any,
        last_loc: Any,
        extend_num_tokens: Any,
        dp_rank: Any = 0,
        *,
        tags: Any = None,
    ) -> Any:
        with self.lock:
            lens = _same_length(prefix_lens, seq_lens, last_loc)
            numbers = None if lens is None else (np.array([lens[0].shape[0]]), *lens)
            arg, rank = _int_or_none(extend_num_tokens), self._rank(dp_rank)
            kind = kind_of(seq_lens)
            try:
                out = self._call("alloc_extend", prefix_lens, seq_lens, last_loc, extend_num_tokens, dp_rank, tags=tags)
            except Exception as exc:
                self.rec.add("alloc_extend", arg, 0, numbers, exc, rank=rank, kind=kind)
                raise
            self._served("alloc_extend", arg, numbers, out, rank, kind)
            return out

    def alloc_decode(self, seq_lens: Any, last_loc: Any, dp_rank: Any = 0, *, tags: Any = None) -> Any:
        with self.lock:
            lens = _same_length(seq_lens, last_loc)
            arg = None if lens is None else lens[0].shape[0]
            rank, kind = self._rank(dp_rank), kind_of(seq_lens)
            try:
                out = self._call("alloc_decode", seq_lens, last_loc, dp_rank, tags=tags)
            except Exception as exc:
                self.rec.add("alloc_decode", arg, 0, lens, exc, rank=rank, kind=kind)
                raise
            self._served("alloc_decode", arg, lens, out, rank, kind)
            return out

    def free(self, free_index: Any, dp_rank: Any = 0) -> Any:
        return self._freeing("free", free_index, (dp_rank,), self._rank(dp_rank))

    def free_swa(self, free_index: Any, dp_rank: Any = 0) -> Any:
        return self._freeing("free_swa", free_index, (dp_rank,), self._rank(dp_rank))

    def available_size(self, dp_rank: Any = 0) -> Any:  # an allocator's takes a rank
        return self._sized("available_size", dp_rank, rank=self._rank(dp_rank))

    def full_available_size(self, dp_rank: Any = 0) -> Any:
        return self._sized("full_available_size", dp_rank, rank=self._rank(dp_rank))

    def swa_available_size(self, dp_rank: Any = 0) -> Any:
        return self._sized("swa_available_size", dp_rank, rank=self._rank(dp_rank))

    def merge_and_sort_free(self, dp_rank: Any = 0) -> None:
        with self.lock:
            self._ranked("merge_and_sort_free", self._rank(dp_rank), dp_rank)

    def restore_state(self, state: Any) -> None:
        """A snapshot taken while recording is named by its number; an earlier one is recorded whole."""
        with self.lock:
            number = self._number_of(state)
            words = self.pool._trace_state(state) if number is None else None
            numbers = () if number is not None else None if words is None else (words,)
            arg = -1 if number is None else number
            result = 0 if words is None else words.shape[0]
            try:
                self._call("restore_state", state)
            except Exception as exc:
                # Refused, nothing changed: what made it refuse (a state of another shape or tracking) is not
                # in the record, which holds lists only, so replay skips the call rather than restore them.
                self.rec.add("restore", arg, result, None, exc)
                raise
            self.rec.add("restore", arg, result, numbers)

    def clear(self, dp_rank: Any = None) -> None:
        with self.lock:
            self._ranked("clear", -1 if dp_rank is None else self._rank(dp_rank), dp_rank)  # -1: every rank

    def _ranked(self, op: str, rank: int | None, dp_rank: Any) -> None:
        """merge_and_sort_free, clear: the call, recorded with its rank and nothing else (under the lock)."""
        try:
            self._call(op, dp_rank)
        except Exception as exc:
            self.rec.add(op, 0, 0, (), exc, rank=rank)
            raise
        self.rec.add(op, 0, 0, rank=rank)


_KIND = {np.dtype(np.int64): KINDS.index("int64 array"), np.dtype(np.int32): KINDS.index("int32 array")}


def kind_of(value: Any) -> int:
    """How a call's array argument came, as ``trace.KINDS`` numbers it: replay passes it the same way."""
    if type(value) is list:
        return KINDS.index("list")
    if type(value) is np.ndarray:
        return _KIND.get(value.dtype, KINDS.index("other"))
    return KINDS.index("other")


def _same_length(*vectors: Any) -> tuple[NDArray[np.int64], ...] | None:
    """The batch call's per-request arrays as int64, if each is readable and all are one length; else ``None``."""
    arrays = [_sizes_or_none(v) for v in vectors]
    if any(a is None for a in arrays) or len({a.shape[0] for a in arrays}) != 1:  # type: ignore[union-attr]
        return None
    return tuple(arrays)  # type: ignore[arg-type]  # none is None


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
    """A call's per-request numbers as int64, as the pool read them (``__index__`` too), or ``None``: unreadable."""
    if type(sizes) is list or type(sizes) is tuple:  # the pool packs each element through __index__: so does this
        values = [_int_or_none(v) for v in sizes]
        return None if any(v is None for v in values) else np.array(values, dtype=np.int64)
    try:
        arr = np.asarray(sizes.numpy() if hasattr(sizes, "numpy") and not isinstance(sizes, np.ndarray) else sizes)
    except Exception:  # noqa: BLE001 - unreadable: recorded as such
        return None
    return _int64_or_none(arr)


def _int64_or_none(arr: NDArray[Any]) -> NDArray[np.int64] | None:
    """A vector of integers as int64, or ``None``: not a vector of integers, or beyond int64 (astype would wrap)."""
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        return None
    if arr.size and arr.dtype.kind == "u" and int(arr.max()) >= 2**63:
        return None
    try:
        return np.array(arr, dtype=np.int64)
    except (OverflowError, ValueError):
        return None


def _slots_of_input(indices: Any) -> NDArray[np.int64] | None:
    value = indices.numpy() if hasattr(indices, "numpy") and not isinstance(indices, np.ndarray) else indices
    slots: NDArray[np.int64] = as_slots(value).copy()
    return slots
