"""Recorded traces of a pool's calls: the file format, recording, loading and replaying.

``with pool.recording(path): ...`` writes every call made on the pool inside
the block to ``path``; ``python -m hostpool_nb.replay PATH`` replays it on a
fresh pool and checks every result and error; :func:`load` gives the
operations to Python code; ``python -m bench --trace PATH`` times the
workload against the original algorithm.

File format (version 1)
-----------------------
An uncompressed ``.npz`` archive (``numpy.load(path)`` reads it; no pickle)
with four arrays, each a stored (not compressed) ``.npy`` member whose
header declares exactly the bytes it holds (:func:`load` checks both before
reading a byte of data):

``header``, one record
    ``version`` (int32), ``pool`` (the class, e.g. ``"LogicalHostPool"``),
    ``size``, ``page_size`` (int64), ``merge`` (``"fifo"`` or
    ``"sorted"``), ``track`` (bool), ``ops`` and ``data`` (the lengths of
    the next two arrays, so a truncated file is caught).
``ops``, one fixed-size record per call, in the order the calls changed the pool
    ``op`` (uint8: see :data:`OPS`), ``error`` (uint8: 0 for none, else an
    index into :data:`ERRORS`), ``unreadable`` (bool: the call's argument
    is not in the record, see below), ``arg`` (int64: ``need_size`` for alloc,
    the number of sizes for alloc_many, the number of slots for free, the
    snapshot number for backup and restore), ``result`` (int64: the number
    of slots returned, freed or merged; -1 for ``None``), ``offset``
    (int64: where the call's numbers start in ``data``) and ``message``
    (int32: the error's text, an index into ``messages``; -1 for none).
``data``, int64
    The numbers of every call, back to back: alloc's returned slots;
    alloc_many's sizes then its slots; free's slots (flattened, as the pool
    read them).
``messages``, unicode
    The error texts.

A call whose argument the record cannot hold (not integers, such as a float
array given to ``free``, or integers beyond int64) and a call that failed
for a reason the record does not hold (a ``TypeError`` for an unhashable
``tag``) are recorded with their error and ``unreadable`` set; replay
checks nothing for them and says how many it skipped. A ``restore`` of a
snapshot taken before the recording began is recorded the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import operator
import os
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._convert import as_slots
from ._errors import AlignmentError, DoubleFreeError, HostPoolError, PartialPageError, SlotRangeError
from ._pool import LogicalHostPool
from ._tracking import HISTORY_MARK

VERSION = 1
OPS = ("", "alloc", "alloc_many", "free", "clear", "merge", "free_group_begin", "free_group_end", "backup", "restore")
ERRORS = ("", "TypeError", "HostPoolError", "AlignmentError", "PartialPageError", "SlotRangeError", "DoubleFreeError")
_ERROR_CLASSES: dict[str, type[Exception]] = {
    "TypeError": TypeError,
    "HostPoolError": HostPoolError,
    "AlignmentError": AlignmentError,
    "PartialPageError": PartialPageError,
    "SlotRangeError": SlotRangeError,
    "DoubleFreeError": DoubleFreeError,
}
OP_DTYPE = np.dtype(
    [
        ("op", "u1"),
        ("error", "u1"),
        ("unreadable", "?"),
        ("arg", "<i8"),
        ("result", "<i8"),
        ("offset", "<i8"),
        ("message", "<i4"),
    ]
)
HEADER_DTYPE = np.dtype(
    [
        ("version", "<i4"),
        ("pool", "<U32"),
        ("size", "<i8"),
        ("page_size", "<i8"),
        ("merge", "<U8"),
        ("track", "?"),
        ("ops", "<i8"),
        ("data", "<i8"),
    ]
)


class TraceError(HostPoolError):
    """A trace file that is not one this version wrote, or is damaged."""


@dataclass(frozen=True)
class Operation:
    """One recorded call.

    ``name`` is the method (``"alloc"``, ``"free"``, ...); ``arg`` its
    number (see the module docstring), ``sizes`` alloc_many's sizes and
    ``slots`` free's input or the slots an allocation returned (``None``
    when it returned ``None``); ``result`` the count it returned;
    ``error`` the exception's class name and ``message`` its text, when
    it raised.
    """

    index: int
    name: str
    arg: int
    result: int
    unreadable: bool
    sizes: NDArray[np.int64] | None
    slots: NDArray[np.int64] | None
    error: str | None
    message: str | None

    @property
    def replayable(self) -> bool:
        """Whether the record holds what the call needs (its argument; the snapshot it restored)."""
        return not self.unreadable


@dataclass(frozen=True)
class Trace:
    """A loaded trace: the pool's parameters and the operations, in order."""

    pool: str
    size: int
    page_size: int
    merge: str
    track: bool
    operations: tuple[Operation, ...]

    def __len__(self) -> int:
        return len(self.operations)

    @property
    def replayable(self) -> int:
        """How many operations the record holds enough of to replay."""
        return sum(op.replayable for op in self.operations)


# -- recording ------------------------------------------------------------------


class Recorder:
    """Collects a pool's calls while a ``recording()`` block runs, then writes the file."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
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
                np.savez(f, header=header, ops=ops, data=data, messages=messages)
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
    calls = _Calls(pool.lock, rec, method)
    wrapper = getattr(calls, name, None)
    return wrapper if wrapper is not None else calls.simple(_OP_OF.get(name, name))


class _Calls:
    """Recording wrappers: each holds the pool's lock around the call and its record."""

    def __init__(self, lock: Any, rec: Recorder, method: Any) -> None:
        self.lock, self.rec, self.method = lock, rec, method

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


# -- loading --------------------------------------------------------------------


_MEMBERS = ("header", "ops", "data", "messages")
_ZIP_MAGIC = b"PK\x03\x04"
_NPY_MAGIC = b"\x93NUMPY"


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a trace file; raise :class:`TraceError` saying what is wrong with a damaged one.

    Nothing is read beyond what the file holds: each array's declared size
    is checked against its stored bytes before it is read, compressed
    members are refused (the format is uncompressed), and nothing is
    unpickled. A missing file is a ``FileNotFoundError``; any other file
    that cannot be opened or read (a directory, a symlink loop, no
    permission) is a :class:`TraceError`.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - opened apart from the with below, so an OSError here is told apart
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise TraceError(f"{path} cannot be read as a trace: {exc.strerror or exc}") from None
    with f:
        try:
            magic = f.read(len(_NPY_MAGIC))
            f.seek(0)
        except OSError as exc:
            raise TraceError(f"{path} cannot be read as a trace: {exc.strerror or exc}") from None
        if magic.startswith(_NPY_MAGIC):
            raise TraceError(f"{path} is not a hostpool_nb trace (a single .npy array, not an .npz archive)")
        if not magic.startswith(_ZIP_MAGIC):
            raise TraceError(f"{path} is not a hostpool_nb trace (not a readable .npz archive: no zip signature)")
        try:
            archive = zipfile.ZipFile(f)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise TraceError(f"{path} is not a hostpool_nb trace (not a readable .npz archive: {exc})") from None
        with archive:
            for name in _MEMBERS:
                if name + ".npy" not in archive.NameToInfo:
                    raise TraceError(f"{path} is not a hostpool_nb trace: it has no {name!r} array")
            arrays = {name: _read_member(archive, name, path) for name in _MEMBERS}
    return _check(path, arrays["header"], arrays["ops"], arrays["data"], arrays["messages"])


def _read_member(archive: zipfile.ZipFile, name: str, path: Any) -> NDArray[Any]:
    """One ``.npy`` member, read only after its header's size matched its stored bytes."""
    info = archive.NameToInfo[name + ".npy"]
    where = f"{path} is damaged: its {name!r} array"
    if info.compress_type != zipfile.ZIP_STORED:
        raise TraceError(f"{where} is compressed; a trace's arrays are stored uncompressed")
    try:
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(member)
            else:
                raise TraceError(f"{where} is in .npy format {version}, which traces do not use")
            if dtype.hasobject:
                raise TraceError(f"{where} cannot be read (it holds Python objects, which only pickle reads)")
            count = 1
            for dim in shape:
                count *= int(dim)
            want = count * dtype.itemsize
            stored = info.file_size - member.tell()
            if want != stored:
                raise TraceError(f"{where} declares {count} entries ({want} bytes) but holds {stored} bytes")
            raw = bytearray(member.read(want))  # writable: replay hands slices to the pool
    except TraceError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise TraceError(f"{where} cannot be read ({exc})") from None
    if len(raw) != want:
        raise TraceError(f"{where} is truncated: {len(raw)} of {want} bytes")
    arr: NDArray[Any] = np.frombuffer(raw, dtype=dtype, count=count)
    return arr.reshape(shape, order="F" if fortran else "C")


def _check(path: Any, header: Any, ops: Any, data: Any, messages: Any) -> Trace:  # noqa: PLR0912 - one check each
    where = f"{path} is damaged"
    if header.dtype != HEADER_DTYPE or header.shape != (1,):
        raise TraceError(f"{path} is not a hostpool_nb trace (its header has dtype {header.dtype})")
    h = header[0]
    if int(h["version"]) != VERSION:
        raise TraceError(f"{path} is a version {int(h['version'])} trace; this hostpool_nb reads version {VERSION}")
    if ops.dtype != OP_DTYPE or ops.ndim != 1 or data.dtype != np.int64 or data.ndim != 1:
        raise TraceError(f"{where}: its ops or data array has the wrong type")
    if messages.ndim != 1 or messages.dtype.kind != "U":
        raise TraceError(f"{where}: its messages array has the wrong type")
    if ops.shape[0] != int(h["ops"]) or data.shape[0] != int(h["data"]):
        raise TraceError(
            f"{where}: the header says {int(h['ops'])} operations and {int(h['data'])} numbers, "
            f"the file holds {ops.shape[0]} and {data.shape[0]} (truncated?)"
        )
    size, page_size, merge = int(h["size"]), int(h["page_size"]), str(h["merge"])
    if page_size < 1 or size < 0 or size % page_size or merge not in ("fifo", "sorted"):
        raise TraceError(f"{where}: the pool it records is not a pool (size={size}, page_size={page_size}, {merge})")
    result: list[Operation] = []
    backups = 0  # snapshots numbered so far: a restore names one of them
    for i, rec in enumerate(ops.tolist()):
        op, error, unreadable, arg, res, offset, message = rec
        if not 0 < op < len(OPS) or error >= len(ERRORS) or not -1 <= message < messages.shape[0]:
            raise TraceError(f"{where}: operation {i} has an unknown code (op {op}, error {error})")
        name = OPS[op]
        if name == "backup" and not error:
            if arg != backups:
                raise TraceError(f"{where}: operation {i} (backup) is snapshot {arg}, expected {backups}")
            backups += 1
        if name == "restore" and not unreadable and not 0 <= arg < backups:
            raise TraceError(f"{where}: operation {i} (restore) names snapshot {arg}, of {backups} taken before it")
        served = not error and res >= 0  # alloc and alloc_many returned slots (maybe none)
        count = 0
        if not unreadable:
            if name == "alloc" and served:
                count = res
            elif name == "alloc_many":
                count = arg + (res if served else 0)
            elif name == "free":
                count = arg
        if count < 0 or offset < 0 or offset + count > data.shape[0]:
            raise TraceError(f"{where}: operation {i} ({name}) points outside the data ({offset}+{count})")
        numbers = data[offset : offset + count]
        sizes = slots = None
        if not unreadable and name == "alloc_many":
            sizes, slots = numbers[:arg], (numbers[arg:] if served else None)
        elif not unreadable and (name == "free" or (name == "alloc" and served)):
            slots = numbers
        result.append(
            Operation(
                index=i,
                name=name,
                arg=int(arg),
                result=int(res),
                unreadable=bool(unreadable),
                sizes=sizes,
                slots=slots,
                error=ERRORS[error] if error else None,
                message=str(messages[message]) if message >= 0 else None,
            )
        )
    return Trace(str(h["pool"]), size, page_size, merge, bool(h["track"]), tuple(result))


# -- replaying ------------------------------------------------------------------


@dataclass(frozen=True)
class Divergence:
    """The first operation whose replay differs from the record."""

    index: int
    name: str
    expected: str
    got: str

    def __str__(self) -> str:
        return f"operation {self.index} ({self.name}): expected {self.expected}, got {self.got}"


def replay(trace: Trace) -> tuple[int, int, Divergence | None]:
    """Replay ``trace`` on a fresh pool; return (replayed, skipped, first divergence or None)."""
    # Untracked: a tracking pool's error texts end with the call sites of
    # the recording, which a replay cannot have; they are compared without.
    pool = LogicalHostPool(trace.size, trace.page_size, merge=trace.merge)
    backups: dict[int, Any] = {}
    skipped = 0
    for op in trace.operations:
        if not op.replayable:
            skipped += 1
            continue
        got_value, got_exc = _run(pool, op, backups)
        divergence = _compare(op, got_value, got_exc)
        if divergence is not None:
            return op.index - skipped, skipped, divergence
    return len(trace.operations) - skipped, skipped, None


def _run(pool: Any, op: Operation, backups: dict[int, Any]) -> tuple[Any, BaseException | None]:
    calls = {
        "alloc": lambda: pool.alloc(op.arg),
        "alloc_many": lambda: pool.alloc_many(op.sizes),
        "free": lambda: pool.free(op.slots),
        "backup": lambda: backups.__setitem__(op.arg, pool.backup_state()),
        "restore": lambda: pool.restore_state(backups[op.arg]),
    }
    call = calls.get(op.name) or getattr(pool, op.name)  # clear, merge, free_group_begin/end
    try:
        return call(), None
    except Exception as exc:  # noqa: BLE001 - every error is compared with the record
        return None, exc


def _without_history(message: str) -> str:
    """A tracking pool's error text without the history it appends (``; it was allocated at ...``,
    ``; it was never allocated by this pool``): a replay's untracked pool has none."""
    cut = message.find(HISTORY_MARK)
    return message if cut < 0 else message[:cut]


def _same_slots(want: NDArray[np.int64] | None, got: Any) -> bool:
    if want is None or got is None:
        return want is None and got is None
    return bool(np.array_equal(np.asarray(got), want))


_SHOWN = 8  # slots shown of an array in a divergence report


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    arr = np.asarray(value).reshape(-1)
    head = ", ".join(str(v) for v in arr[:_SHOWN].tolist())
    return f"{arr.shape[0]} slots [{head}{', ...' if arr.shape[0] > _SHOWN else ''}]"


def _compare(op: Operation, value: Any, exc: BaseException | None) -> Divergence | None:
    if op.error is not None or exc is not None:
        want = f"{op.error}: {_without_history(op.message or '')}" if op.error else "no error"
        got = f"{type(exc).__name__}: {exc}" if exc is not None else "no error"
        return None if want == got else Divergence(op.index, op.name, want, got)
    if op.name in ("alloc", "alloc_many"):
        want_slots = op.slots if op.result >= 0 else None
        got_slots = value if op.name == "alloc" or value is None else value[0]
        if not _same_slots(want_slots, got_slots):
            return Divergence(op.index, op.name, _describe(want_slots), _describe(got_slots))
    if op.name in ("free", "merge") and value != op.result:
        return Divergence(op.index, op.name, f"{op.result}", f"{value}")
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m hostpool_nb.replay PATH``: 0 if every operation matches, 1 at the first divergence."""
    ap = argparse.ArgumentParser(
        prog="python -m hostpool_nb.replay",
        description="Replay a trace recorded with pool.recording(path) on a fresh pool, checking every result.",
    )
    ap.add_argument("path", help="the trace file")
    args = ap.parse_args(argv)
    try:
        trace = load(args.path)
    except FileNotFoundError:
        print(f"python -m hostpool_nb.replay: error: no such file: {args.path}", file=sys.stderr)
        return 2
    except TraceError as exc:
        print(f"python -m hostpool_nb.replay: error: {exc}", file=sys.stderr)
        return 2
    try:
        done, skipped, divergence = replay(trace)
    except (HostPoolError, MemoryError) as exc:  # the recorded pool cannot be built here
        print(
            f"python -m hostpool_nb.replay: error: {args.path}: cannot build the recorded pool: {exc}", file=sys.stderr
        )
        return 2
    pool = f"{trace.pool}(size={trace.size}, page_size={trace.page_size}, merge={trace.merge!r}, track={trace.track})"
    if divergence is not None:
        print(f"{args.path}: {pool}: DIVERGES at {divergence} (after {done} matching operations)")
        return 1
    note = f"; {skipped} not replayable (their input was not numbers), skipped" if skipped else ""
    print(f"{args.path}: {pool}: all {done} operations match{note}")
    return 0


__all__ = ["OPS", "Divergence", "Operation", "Trace", "TraceError", "load", "replay"]
