"""Recorded traces of a pool's calls: the file format and its loader.

``with pool.recording(path): ...`` (``_recording.py``) writes every call made
on the pool inside the block to ``path``; :func:`load` reads it back as
:class:`Operation` records; ``python -m hostpool_nb.replay PATH`` replays it
on a fresh pool, checking every result and error, and ``--time`` also times
it against the original algorithm (``hostpool_nb.replay``).

File format (version 2)
-----------------------
An uncompressed ``.npz`` archive (``numpy.load(path)`` reads it; no pickle)
with five arrays, each a stored (not compressed) ``.npy`` member whose
header declares exactly the bytes it holds (:func:`load` checks both, and
that the file holds that many bytes, before reading a byte of data):

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
``start``, int64
    The pool as the recording found it, so that a recording can begin at
    any point of a pool's life: ``[group depth, free, released, pending]``
    (page counts), then the page ids of the free list, the release list
    and the pending list, each in its order. Replay starts from it.

Version 1 (no ``start``: the recording began on a fresh pool) is read as
well.

A call whose argument the record cannot hold (not integers, such as a float
array given to ``free``, or integers beyond int64) and a call that failed
for a reason the record does not hold (a ``TypeError`` for an unhashable
``tag``) are recorded with their error and ``unreadable`` set; replay
checks nothing for them and says how many it skipped. A ``restore`` of a
snapshot taken before the recording began is recorded the same way.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._errors import HostPoolError

VERSION = 2
READS = (1, 2)  # the versions load() reads
_WITH_START = 2  # the first version whose traces hold the state they began from
_START_HEADER = 4  # the start array's counts: group depth, free, released, pending
OPS = ("", "alloc", "alloc_many", "free", "clear", "merge", "free_group_begin", "free_group_end", "backup", "restore")
ERRORS = ("", "TypeError", "HostPoolError", "AlignmentError", "PartialPageError", "SlotRangeError", "DoubleFreeError")
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
class StartState:
    """The pool as a recording found it: its lists' page ids, in order, and the free groups open."""

    free: NDArray[np.int64]
    released: NDArray[np.int64]
    pending: NDArray[np.int64]
    group_depth: int

    @property
    def fresh(self) -> bool:
        """Whether this is a new pool's state: every page free, ascending, nothing open."""
        f = self.free
        return (
            self.group_depth == 0
            and self.released.shape[0] == 0
            and self.pending.shape[0] == 0
            and bool(np.array_equal(f, np.arange(f.shape[0])))
        )


@dataclass(frozen=True)
class Trace:
    """A loaded trace: the pool's parameters, the state it started from and the operations, in order.

    ``start`` is ``None`` for a version 1 trace: it began on a fresh pool.
    """

    pool: str
    size: int
    page_size: int
    merge: str
    track: bool
    operations: tuple[Operation, ...]
    start: StartState | None = None

    def __len__(self) -> int:
        return len(self.operations)

    @property
    def replayable(self) -> int:
        """How many operations the record holds enough of to replay."""
        return sum(op.replayable for op in self.operations)


_MEMBERS = ("header", "ops", "data", "messages")  # and "start", from version 2 on
_ZIP_MAGIC = b"PK\x03\x04"
_ENCRYPTED = 0x1  # bit 0 of a zip member's general purpose flags
_NPY_MAGIC = b"\x93NUMPY"


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a trace file; raise :class:`TraceError` saying what is wrong with a damaged one.

    Nothing is read beyond what the file holds: each array's declared size
    is checked against its stored bytes before it is read, compressed
    members are refused (the format is uncompressed), and nothing is
    unpickled.

    Parameters
    ----------
    path : str or os.PathLike
        The trace file, as ``pool.recording(path)`` wrote it.

    Returns
    -------
    Trace
        The recorded pool's parameters and its operations, in order.

    Raises
    ------
    FileNotFoundError
        If there is no such file.
    TraceError
        If the file cannot be opened or read (a directory, a symlink loop,
        no permission), or is not a trace, or is damaged; the message names
        the file and the problem.
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
        try:
            total = os.fstat(f.fileno()).st_size
        except OSError as exc:
            raise TraceError(f"{path} cannot be read as a trace: {exc.strerror or exc}") from None
        with archive:
            names = _MEMBERS + (("start",) if "start.npy" in archive.NameToInfo else ())
            for name in _MEMBERS:
                if name + ".npy" not in archive.NameToInfo:
                    raise TraceError(f"{path} is not a hostpool_nb trace: it has no {name!r} array")
            arrays = {name: _read_member(archive, name, path, total) for name in names}
    return _check(path, arrays)


def _read_member(archive: zipfile.ZipFile, name: str, path: Any, total: int) -> NDArray[Any]:
    """One ``.npy`` member, read only after its header's size matched its stored bytes and the file's.

    ``total`` is the file's size: every size the archive declares is a
    number from the file, so each is bounded by what the file really holds
    before anything that size is allocated.
    """
    info = archive.NameToInfo[name + ".npy"]
    where = f"{path} is damaged: its {name!r} array"
    if info.compress_type != zipfile.ZIP_STORED:
        raise TraceError(f"{where} is compressed; a trace's arrays are stored uncompressed")
    if info.flag_bits & _ENCRYPTED:
        raise TraceError(f"{where} is encrypted; a trace's arrays are stored in the clear")
    if info.file_size > total - info.header_offset:
        raise TraceError(
            f"{where} declares {info.file_size} bytes, but the file holds {total} bytes in all (truncated?)"
        )
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
    except (OSError, ValueError, RuntimeError, NotImplementedError, zipfile.BadZipFile, EOFError) as exc:
        # RuntimeError, NotImplementedError: zipfile's for flags and methods it does not support
        raise TraceError(f"{where} cannot be read ({exc})") from None
    if len(raw) != want:
        raise TraceError(f"{where} is truncated: {len(raw)} of {want} bytes")
    arr: NDArray[Any] = np.frombuffer(raw, dtype=dtype, count=count)
    return arr.reshape(shape, order="F" if fortran else "C")


def _check(path: Any, arrays: dict[str, NDArray[Any]]) -> Trace:
    header, ops, data, messages = (arrays[name] for name in _MEMBERS)
    where = f"{path} is damaged"
    if header.dtype != HEADER_DTYPE or header.shape != (1,):
        raise TraceError(f"{path} is not a hostpool_nb trace (its header has dtype {header.dtype})")
    h = header[0]
    version = int(h["version"])
    if version not in READS:
        raise TraceError(
            f"{path} is a version {version} trace; this hostpool_nb reads versions "
            f"{', '.join(map(str, READS))} (replay it with the hostpool_nb that recorded it)"
        )
    if (version >= _WITH_START) != ("start" in arrays):
        holds = "has no" if version >= _WITH_START else "has a"
        raise TraceError(f"{where}: a version {version} trace, it {holds} 'start' array")
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
    result = _operations(where, ops, data, messages)
    start = _start(where, arrays["start"], size // page_size) if "start" in arrays else None
    return Trace(str(h["pool"]), size, page_size, merge, bool(h["track"]), tuple(result), start)


def _operations(where: str, ops: Any, data: Any, messages: Any) -> list[Operation]:
    """Every record of ``ops`` as an :class:`Operation`, each checked against the data it points into."""
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
    return result


def _start(where: str, words: NDArray[Any], num_pages: int) -> StartState:
    """The ``start`` array as a :class:`StartState`, its counts and page ids checked for the recorded pool."""
    if words.dtype != np.int64 or words.ndim != 1 or words.shape[0] < _START_HEADER:
        raise TraceError(f"{where}: its start array is not a pool's state (dtype {words.dtype}, shape {words.shape})")
    depth, nfree, nrel, npend = (int(v) for v in words[:_START_HEADER])
    listed = words[_START_HEADER:]
    if min(depth, nfree, nrel, npend) < 0 or nfree + nrel + npend != listed.shape[0] or listed.shape[0] > num_pages:
        raise TraceError(
            f"{where}: its start state lists {listed.shape[0]} pages as {nfree} free, {nrel} released and "
            f"{npend} pending, of a pool of {num_pages} pages"
        )
    if listed.shape[0] and (int(listed.min()) < 0 or int(listed.max()) >= num_pages):
        raise TraceError(f"{where}: its start state lists a page outside the pool's {num_pages}")
    if np.unique(listed).shape[0] != listed.shape[0]:
        raise TraceError(f"{where}: its start state lists a page twice")
    if npend and not depth:
        raise TraceError(f"{where}: its start state has pending pages outside a free group")
    return StartState(listed[:nfree], listed[nfree : nfree + nrel], listed[nfree + nrel :], depth)


_SHOWN = 8  # slots shown of an array in a report


def describe_slots(value: Any) -> str:
    """``N slots [a, b, ...]`` (the first few of a flattened array), or ``None``: for reports of a difference."""
    if value is None:
        return "None"
    arr = np.asarray(value).reshape(-1)
    head = ", ".join(str(v) for v in arr[:_SHOWN].tolist())
    return f"{arr.shape[0]} slots [{head}{', ...' if arr.shape[0] > _SHOWN else ''}]"


__all__ = [
    "ERRORS",
    "OPS",
    "READS",
    "VERSION",
    "Operation",
    "StartState",
    "Trace",
    "TraceError",
    "describe_slots",
    "load",
]
