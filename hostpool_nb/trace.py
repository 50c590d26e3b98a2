"""Recorded traces of a pool's calls: the file format and its loader.

``with pool.recording(path): ...`` writes every call made on the pool inside
the block to ``path``; :func:`load` reads it back as :class:`Operation`
records, :func:`arrays` as the arrays unpacked; ``python -m
hostpool_nb.replay PATH`` replays it on a fresh pool. The format, field by
field, is in docs/diagnostics.md ("The trace format").
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._errors import HostPoolError

#: The trace format this version writes.
VERSION = 4
#: The trace formats :func:`load` reads.
READS = (1, 2, 3, 4)
_WITH_START = 2  # the first version whose traces hold the state they began from
_WITH_RANKS = 3  # the first whose header and ops hold the ranks of an allocator (dp_size, strict, a rank per op)
_PACKED = 4  # the first whose arrays are runs, compressed, and whose ops say how arguments came
_START_HEADER = 4  # the start array's counts per rank: group depth, free, released, pending
#: The calls a trace records, by their number in the file (an operation's ``ops`` field).
OPS = (
    "",
    "alloc",
    "alloc_many",
    "free",
    "clear",
    "merge",
    "free_group_begin",
    "free_group_end",
    "backup",
    "restore",
    "alloc_extend",
    "alloc_decode",
    "merge_and_sort_free",
    "free_swa",
    "available_size",  # from version 4: the calls that change nothing but an engine makes most
    "full_available_size",
    "swa_available_size",
)
#: How a recorded call's array argument came (an operation's ``kind``, from version 4), as replay passes it.
KINDS = (
    "int64 array",  # or no array argument
    "int32 array",
    "list",
    "other",  # a tuple, another dtype, a tensor: replayed as an int64 array
)
#: The exceptions a recorded call may have raised, by their number in the file ("" for none).
ERRORS = (
    "",
    "TypeError",
    "HostPoolError",
    "AlignmentError",
    "PartialPageError",
    "SlotRangeError",
    "DoubleFreeError",
    "PagedOnlyError",  # appended: a number, once written, keeps its meaning
    "HostKVAlignmentError",  # sglang's host pools' books (hostpool_nb.integrations.sglang)
    "HostKVDoubleFreeError",
    "HostKVSlotRangeError",
)
_GROUPS_AND_SNAPSHOTS = ("clear", "free_group_begin", "free_group_end", "backup", "restore", "available_size")
#: The calls a trace of each pool kind may hold (a call its kind lacks makes the trace damaged).
CALLS = {
    "LogicalHostPool": ("alloc", "alloc_many", "free", "merge", *_GROUPS_AND_SNAPSHOTS),
    "PagedTokenToKVPoolAllocator": (
        "alloc",
        "alloc_extend",
        "alloc_decode",
        "free",
        "merge_and_sort_free",
        *_GROUPS_AND_SNAPSHOTS,
    ),
    "TokenToKVPoolAllocator": ("alloc", "free", *_GROUPS_AND_SNAPSHOTS),
    "SWATokenToKVPoolAllocator": (
        "alloc",
        "alloc_extend",
        "alloc_decode",
        "free",
        "free_swa",
        "merge_and_sort_free",
        "full_available_size",
        "swa_available_size",
        *_GROUPS_AND_SNAPSHOTS,
    ),
}
#: The kinds of the books sglang's host pools keep under ``hostpool_nb.integrations.sglang``, one per
#: bookkeeping (host pools with sglang's errors); a trace's ``strict`` says whether they refused double
#: frees. Replayed with torch.
HOST_KV_BOOKS = ("HostKVBooks/HostKVCache", "HostKVBooks/Mamba", "HostKVBooks/DeepSeekV4Paged")
CALLS.update(dict.fromkeys(HOST_KV_BOOKS, CALLS["LogicalHostPool"]))
SWA = "SWATokenToKVPoolAllocator"
#: The pool kinds whose calls name a ``dp_rank`` (sglang-jax's allocators).
RANKED = ("PagedTokenToKVPoolAllocator", "TokenToKVPoolAllocator", SWA)
_OP_FIELDS = [
    ("op", "u1"),
    ("error", "u1"),
    ("unreadable", "?"),
    ("arg", "<i8"),
    ("result", "<i8"),
    ("offset", "<i8"),
    ("message", "<i4"),
]
_HEADER_FIELDS = [
    ("version", "<i4"),
    ("pool", "<U32"),
    ("size", "<i8"),
    ("page_size", "<i8"),
    ("merge", "<U8"),
    ("track", "?"),
    ("ops", "<i8"),
    ("data", "<i8"),
]
#: One operation's record in the file (version 4).
OP_DTYPE = np.dtype([*_OP_FIELDS, ("rank", "<i4"), ("kind", "u1")])
OP_DTYPE_3 = np.dtype([*_OP_FIELDS, ("rank", "<i4")])
_KIND_FIELD = OP_DTYPE.names.index("kind") if OP_DTYPE.names else -1
#: The file's header record (version 3), the pool's kind and constructor arguments.
HEADER_DTYPE = np.dtype(
    [*_HEADER_FIELDS, ("dp_size", "<i8"), ("strict", "?"), ("debug_mode", "?"), ("size_swa", "<i8")]
)
OP_DTYPE_2 = np.dtype(_OP_FIELDS)  # versions 1 and 2
HEADER_DTYPE_2 = np.dtype(_HEADER_FIELDS)


class TraceError(HostPoolError):
    """A trace file that is not one this version wrote, or is damaged.

    Examples
    --------
    >>> import os, tempfile
    >>> from hostpool_nb.trace import load
    >>> path = os.path.join(tempfile.mkdtemp(), "not.trace")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(b"not a trace")
    >>> load(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hostpool_nb.trace.TraceError: ...
    """


@dataclass(frozen=True)
class Operation:
    """One recorded call.

    ``name`` is the method (``"alloc"``, ``"free"``, ...); ``arg`` its
    number (see the module docstring), ``sizes`` alloc_many's sizes and
    ``slots`` free's input or the slots an allocation returned (``None``
    when it returned ``None``); ``result`` the count it returned;
    ``error`` the exception's class name and ``message`` its text, when
    it raised. ``rank`` is the ``dp_rank`` an allocator's call named (0
    for a host pool, -1 for ``clear()`` of every rank) and ``batch``
    alloc_extend's ``(prefix_lens, seq_lens, last_loc)`` or
    alloc_decode's ``(seq_lens, last_loc)``. ``state`` is, for an
    allocator's ``restore`` of a snapshot taken before the recording began
    (``arg`` -1), the lists it restored, per rank (a sliding-window
    allocator's: every rank's full side, then every rank's SWA side, and
    ``mappings`` each rank's mapping).

    Examples
    --------
    >>> import os, tempfile
    >>> from hostpool_nb import LogicalHostPool
    >>> from hostpool_nb.trace import load
    >>> path = os.path.join(tempfile.mkdtemp(), "serve.trace")
    >>> pool = LogicalHostPool(64, 16)
    >>> with pool.recording(path):
    ...     slots = pool.alloc(32)
    ...     freed = pool.free(slots[:16])
    >>> trace = load(path)
    >>> op = trace.operations[1]
    >>> op.name, op.result, op.slots.tolist() == list(range(16)), op.error
    ('free', 16, True, None)
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
    rank: int = 0
    batch: tuple[NDArray[np.int64], ...] | None = None
    state: tuple[StartState, ...] | None = None
    mappings: tuple[NDArray[np.int64], ...] | None = None
    kind: str = KINDS[0]

    @property
    def replayable(self) -> bool:
        """Whether the record holds what the call needs (its argument; the snapshot it restored)."""
        return not self.unreadable


@dataclass(frozen=True)
class StartState:
    """A pool (or one rank of an allocator) as a recording found it: its lists' page ids, in order, and
    the free groups open (an allocator's: 1 inside a group, else 0).

    Examples
    --------
    A recording begun on a pool that already holds a page starts from it:

    >>> import os, tempfile
    >>> from hostpool_nb import LogicalHostPool, trace
    >>> pool = LogicalHostPool(64, 16)
    >>> held = pool.alloc(16)
    >>> path = os.path.join(tempfile.mkdtemp(), "held.trace")
    >>> with pool.recording(path):
    ...     freed = pool.free(held)
    >>> start = trace.load(path).start
    >>> start.free, start.released.size, start.group_depth
    (array([1, 2, 3]), 0, 0)
    >>> start.fresh  # a new pool's would be: every page free, in order
    False
    """

    free: NDArray[np.int64]
    released: NDArray[np.int64]
    pending: NDArray[np.int64]
    group_depth: int

    @property
    def fresh(self) -> bool:
        """Whether this is a new host pool's state (every page free, ascending from 0, nothing open)."""
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

    ``starts`` holds a :class:`StartState` per rank (one for a host pool);
    it is ``None`` for a version 1 trace: it began on a fresh pool.
    ``dp_size``, ``strict`` and ``debug_mode`` are an allocator's
    constructor arguments (1, false, false for a host pool).

    Examples
    --------
    An allocator of two data-parallel ranks, one call on the second:

    >>> import os, tempfile
    >>> from hostpool_nb.paged import PagedTokenToKVPoolAllocator
    >>> from hostpool_nb.trace import load
    >>> a = PagedTokenToKVPoolAllocator(64, 4, None, dp_size=2)
    >>> path = os.path.join(tempfile.mkdtemp(), "paged.trace")
    >>> with a.recording(path):
    ...     slots = a.alloc(8, dp_rank=1)
    >>> trace = load(path)
    >>> trace.pool, trace.size, trace.page_size, trace.dp_size, len(trace.starts)
    ('PagedTokenToKVPoolAllocator', 64, 4, 2, 2)
    >>> [(op.name, op.rank) for op in trace.operations]
    [('alloc', 1)]
    """

    pool: str
    size: int
    page_size: int
    merge: str
    track: bool
    operations: tuple[Operation, ...]
    starts: tuple[StartState, ...] | None = None
    dp_size: int = 1
    strict: bool = False
    debug_mode: bool = False
    size_swa: int = 0
    swa_starts: tuple[StartState, ...] | None = None
    mappings: tuple[NDArray[np.int64], ...] | None = None

    @property
    def start(self) -> StartState | None:
        """The state the recording began from (rank 0's, for an allocator), or ``None`` for a fresh pool."""
        return None if self.starts is None else self.starts[0]

    @property
    def ranked(self) -> bool:
        """Whether it records one of the paged allocators, whose calls name a ``dp_rank``."""
        return self.pool in RANKED

    @property
    def pages_per_rank(self) -> int:
        """Pages of each rank (of the host pool; of the full side), as the recorded constructor computes them."""
        return _pages_per_rank(self.pool, self.size, self.page_size, self.dp_size)

    @property
    def swa_pages_per_rank(self) -> int:
        """Pages of each rank of a sliding-window allocator's SWA side."""
        return _pages_per_rank(self.pool, self.size_swa, self.page_size, self.dp_size)

    @property
    def mapping_length(self) -> int:
        """The length of each rank's full-to-SWA mapping of a sliding-window allocator."""
        return self.size // self.dp_size + self.page_size

    def __len__(self) -> int:
        return len(self.operations)

    @property
    def replayable(self) -> int:
        """How many operations the record holds enough of to replay."""
        return sum(op.replayable for op in self.operations)


def _pages_per_rank(kind: str, size: int, page_size: int, dp_size: int) -> int:
    if page_size == 1 and kind in RANKED:  # the token allocator, and the sliding-window one's token sides
        return size // dp_size
    return size // page_size // dp_size


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
    return _check(path, arrays(path))


def arrays(path: str | os.PathLike[str]) -> dict[str, NDArray[Any]]:
    """The arrays of a trace file as numbers: a version 4 trace's members unpacked, an older one's as stored.

    ``header``, ``ops`` (one record per call: :data:`OP_DTYPE`, or an older
    version's), ``data`` (int64), ``messages`` (str) and, from version 2 on,
    ``start`` (int64): what the module docstring describes. Read as
    :func:`load` reads them (nothing unpickled, every size checked before
    anything that size is made), without :func:`load`'s checks of what they
    mean.

    Raises
    ------
    FileNotFoundError
        If there is no such file.
    TraceError
        If the file is not a trace, or its arrays cannot be read.
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
            total = os.fstat(f.fileno()).st_size
        except OSError as exc:
            raise TraceError(f"{path} cannot be read as a trace: {exc.strerror or exc}") from None
        try:
            archive = zipfile.ZipFile(f)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise TraceError(  # it begins as a zip archive: damaged, most often cut short (a copy that stopped)
                f"{path} is a damaged trace: it begins as an .npz (zip) archive, but the directory that ends one "
                f"is not in its {total:,} bytes: the file was cut short, or changed since it was written ({exc})"
            ) from None
        with archive:
            names = _MEMBERS + (("start",) if "start.npy" in archive.NameToInfo else ())
            for name in _MEMBERS:
                if name + ".npy" not in archive.NameToInfo:
                    raise TraceError(f"{path} is not a hostpool_nb trace: it has no {name!r} array")
            members = {name: _read_member(archive, name, path, total) for name in names}
    return _unpacked(path, members)


def write_arrays(path: str | os.PathLike[str], arrays: dict[str, NDArray[Any]]) -> None:
    """Write ``arrays`` (as :func:`arrays` gives them) as a trace file of the version their header names.

    For tools that make or edit traces (and tests of damaged ones): a version
    4 header's arrays are packed as :func:`load` expects, an older one's
    stored as they are. Nothing is checked.
    """
    header = arrays.get("header")
    fields = dict(arrays)
    if (
        isinstance(header, np.ndarray)
        and header.dtype == HEADER_DTYPE
        and header.shape == (1,)
        and int(header[0]["version"]) >= _PACKED
    ):
        for name in ("data", "start"):
            if name in arrays:
                fields[name] = _pack_runs(_runs_of(np.asarray(arrays[name], dtype=np.int64).reshape(-1)))
        if "ops" in arrays:
            fields["ops"] = _pack_records(np.asarray(arrays["ops"]))
        if "messages" in arrays:
            fields["messages"] = _pack_text([str(m) for m in np.asarray(arrays["messages"]).reshape(-1)])
    with open(path, "wb") as f:
        np.savez(f, **fields)  # type: ignore[arg-type]  # numpy's stubs type the keywords as savez's own


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


def _runs_of(numbers: NDArray[np.int64]) -> NDArray[np.int64]:
    """``numbers`` as runs of consecutive integers: ``(first, length)`` pairs, flattened (int64).

    What a version-4 trace stores of a call's numbers: an allocation's
    slots, a free's, a start state's lists are mostly runs.
    """
    n = numbers.shape[0]
    if n == 0:
        return np.empty(0, dtype=np.int64)
    firsts = np.flatnonzero(numbers[1:] - numbers[:-1] != 1) + 1  # int64 wraps alike both ways
    pairs = np.empty((firsts.shape[0] + 1, 2), dtype=np.int64)
    pairs[0, 0] = numbers[0]
    pairs[1:, 0] = numbers[firsts]
    ends = np.append(firsts, n)
    pairs[:, 1] = ends - np.insert(firsts, 0, 0)
    return pairs.reshape(-1)


def _pack_runs(runs: NDArray[np.int64]) -> NDArray[np.uint8]:
    """Runs (:func:`_runs_of`, concatenated) as a version-4 trace stores them: each run's first number less where
    the run before ended, then its length, little-endian int64, compressed with zlib."""
    pairs = runs.reshape(-1, 2)
    gaps = pairs.copy()
    gaps[1:, 0] -= pairs[:-1, 0] + pairs[:-1, 1]  # a run that continues the last one: 0
    return _deflated(gaps.astype("<i8").tobytes())


def _pack_text(messages: list[str]) -> NDArray[np.uint8]:
    """Error messages as a version-4 trace stores them: one JSON string a line, UTF-8, compressed with zlib."""
    return _deflated("".join(json.dumps(m) + "\n" for m in messages).encode())


def _pack_records(ops: NDArray[Any]) -> NDArray[np.uint8]:
    """The operations' records (:data:`OP_DTYPE`) as a version-4 trace stores them, compressed with zlib."""
    return _deflated(ops.astype(OP_DTYPE).tobytes())


def _deflated(raw: bytes) -> NDArray[np.uint8]:
    return np.frombuffer(zlib.compress(raw, _LEVEL), dtype=np.uint8)


_LEVEL = 6  # zlib's default: level 1 halves the time a trace takes to write, for a fifth more bytes
_MOST_INFLATION = 1032  # zlib expands at most about this much: a stream claiming more is not zlib's


def _inflated(where: str, name: str, packed: NDArray[Any], most: int) -> bytes:
    """A packed member's bytes, at most ``most`` of them (a bound from the header: nothing larger is made)."""
    if packed.dtype != np.uint8 or packed.ndim != 1:
        raise TraceError(f"{where}: its {name!r} array is not the compressed bytes a version 4 trace holds")
    blob = packed.tobytes()
    most = min(most, _MOST_INFLATION * len(blob) + 64)
    unzip = zlib.decompressobj()
    try:
        raw = unzip.decompress(blob, most)
    except zlib.error as exc:
        raise TraceError(f"{where}: its {name!r} array cannot be decompressed ({exc})") from None
    if not unzip.eof or unzip.unconsumed_tail or unzip.unused_data:
        raise TraceError(f"{where}: its {name!r} array holds more than its header declares, or is cut short")
    return raw


def _expanded(where: str, name: str, packed: NDArray[Any], count: int | None, most: int = 0) -> NDArray[np.int64]:
    """The numbers of a packed runs member (:func:`_pack_runs`): ``count`` of them, or (``None``) at most ``most``."""
    bound = most if count is None else count
    raw = _inflated(where, name, packed, 16 * bound)
    if len(raw) % 16:
        raise TraceError(f"{where}: its {name!r} array does not hold whole runs ({len(raw)} bytes)")
    pairs = np.frombuffer(raw, dtype="<i8").astype(np.int64).reshape(-1, 2)
    lengths = pairs[:, 1]
    held = int(lengths.sum()) if lengths.shape[0] else 0
    if lengths.shape[0] and int(lengths.min()) < 1:
        raise TraceError(f"{where}: its {name!r} array holds a run of {int(lengths.min())} numbers")
    if held != count if count is not None else held > most:
        declared = f"the {count} numbers its header declares" if count is not None else f"at most {most} numbers"
        raise TraceError(f"{where}: its {name!r} array's runs hold {held} numbers, not {declared}")
    count = held
    ends = np.cumsum(pairs[:, 0] + lengths)  # int64 wraps as the writer's subtraction did
    offsets = np.cumsum(lengths) - lengths
    numbers: NDArray[np.int64] = np.repeat(ends - lengths - offsets, lengths) + np.arange(count, dtype=np.int64)
    return numbers


def _unpacked(path: Any, arrays: dict[str, NDArray[Any]]) -> dict[str, NDArray[Any]]:
    """A version-4 trace's members as the arrays earlier versions stored (any other version's as they are)."""
    header = arrays["header"]
    if header.dtype != HEADER_DTYPE or header.shape != (1,) or int(header[0]["version"]) < _PACKED:
        return arrays
    where = f"{path} is damaged"
    n_ops, n_data = int(header[0]["ops"]), int(header[0]["data"])
    if n_ops < 0 or n_data < 0:
        raise TraceError(f"{where}: the header says {n_ops} operations and {n_data} numbers")
    ops = np.frombuffer(_inflated(where, "ops", arrays["ops"], n_ops * OP_DTYPE.itemsize), dtype=OP_DTYPE)
    if ops.shape[0] != n_ops:
        raise TraceError(f"{where}: the header says {n_operations(n_ops)}, the file holds {ops.shape[0]}")
    text = _inflated(where, "messages", arrays["messages"], 1 << 40)
    try:
        messages = [json.loads(line) for line in text.decode().splitlines()]
    except (UnicodeDecodeError, ValueError):
        messages = None
    if messages is None or not all(isinstance(m, str) for m in messages):
        raise TraceError(f"{where}: its 'messages' array is not a text a line")
    unpacked = {**arrays, "ops": ops.copy(), "data": _expanded(where, "data", arrays["data"], n_data)}
    unpacked["messages"] = np.array(messages or [""], dtype=np.str_)
    if "start" in arrays:  # its length is not in the header: bounded by what the pool's start can hold
        unpacked["start"] = _expanded(where, "start", arrays["start"], None, _start_bound(header[0]))
    return unpacked


def _start_bound(h: Any) -> int:
    """The most numbers a start state of the header's pool holds (its checks come later: this bounds the memory)."""
    size, page_size, dp, size_swa = (max(int(h[f]), 1) for f in ("size", "page_size", "dp_size", "size_swa"))
    # Per rank and side, its counts and each page listed at most twice (free or released, and pending); a
    # sliding-window allocator's mappings, size // dp_size + page_size numbers a rank.
    return 2 * dp * _START_HEADER + 2 * (size + size_swa) + size + dp * page_size


def n_operations(n: int) -> str:
    return f"{n} operation" + ("" if n == 1 else "s")


def _check(path: Any, arrays: dict[str, NDArray[Any]]) -> Trace:
    header, ops, data, messages = (arrays[name] for name in _MEMBERS)
    where = f"{path} is damaged"
    if header.dtype not in (HEADER_DTYPE, HEADER_DTYPE_2) or header.shape != (1,):
        raise TraceError(f"{path} is not a hostpool_nb trace (its header has dtype {header.dtype})")
    h = header[0]
    version = int(h["version"])
    if version not in READS:
        raise TraceError(
            f"{path} is a version {version} trace; this hostpool_nb reads versions "
            f"{', '.join(map(str, READS))} (replay it with the hostpool_nb that recorded it)"
        )
    ranked_format = version >= _WITH_RANKS
    if (header.dtype == HEADER_DTYPE) != ranked_format:
        raise TraceError(f"{where}: a version {version} trace, its header has the fields of another version")
    if (version >= _WITH_START) != ("start" in arrays):
        holds = "has no" if version >= _WITH_START else "has a"
        raise TraceError(f"{where}: a version {version} trace, it {holds} 'start' array")
    op_dtype = OP_DTYPE if version >= _PACKED else OP_DTYPE_3 if ranked_format else OP_DTYPE_2
    if ops.dtype != op_dtype or ops.ndim != 1 or data.dtype != np.int64 or data.ndim != 1:
        raise TraceError(f"{where}: its ops or data array has the wrong type")
    if messages.ndim != 1 or messages.dtype.kind != "U":
        raise TraceError(f"{where}: its messages array has the wrong type")
    if ops.shape[0] != int(h["ops"]) or data.shape[0] != int(h["data"]):
        raise TraceError(
            f"{where}: the header says {int(h['ops'])} operations and {int(h['data'])} numbers, "
            f"the file holds {ops.shape[0]} and {data.shape[0]} (truncated?)"
        )
    kind, size, page_size, merge = str(h["pool"]), int(h["size"]), int(h["page_size"]), str(h["merge"])
    dp_size = int(h["dp_size"]) if ranked_format else 1
    ranked = kind in RANKED
    whole = ranked or (page_size > 0 and not size % page_size)  # an allocator's last partial page is no page
    if page_size < 1 or size < 0 or not whole or dp_size < 1 or merge not in ("fifo", "sorted"):
        of_ranks = f", dp_size={dp_size}" if ranked else ""
        raise TraceError(
            f"{where}: the pool it records is not a pool (size={size}, page_size={page_size}{of_ranks}, {merge})"
        )
    if not ranked and dp_size != 1:
        raise TraceError(f"{where}: it records a {kind} of dp_size={dp_size}; only the allocators have ranks")
    ranks = ops["rank"] if ranked_format else np.zeros(ops.shape[0], dtype=np.int32)
    strict, debug_mode = (bool(h["strict"]), bool(h["debug_mode"])) if ranked_format else (False, False)
    size_swa = int(h["size_swa"]) if ranked_format else 0
    if size_swa < 0 or (size_swa > 0) != (kind == SWA):
        raise TraceError(f"{where}: it records a {kind} with size_swa={size_swa}")
    trace = Trace(kind, size, page_size, merge, bool(h["track"]), (), None, dp_size, strict, debug_mode, size_swa)
    trace = dataclasses.replace(trace, operations=tuple(_operations(where, trace, arrays, ranks)))
    if "start" not in arrays:
        return trace
    if kind == SWA:
        return _swa_starts(where, arrays["start"], trace)
    return dataclasses.replace(trace, starts=_starts(where, arrays["start"], trace))


_ALLOCATING = ("alloc", "alloc_many", "alloc_extend", "alloc_decode")  # their record ends with the slots returned


def _arguments(name: str, arg: int, head: int | None) -> int:
    """How many numbers of ``data`` a call's arguments take (``head``: alloc_extend's first, its request count)."""
    if name in ("alloc_many", "free", "free_swa"):
        return arg
    if name == "alloc_extend":
        return -1 if head is None or head < 0 else 1 + 3 * head
    return 2 * arg if name == "alloc_decode" else 0


def _split(name: str, numbers: NDArray[np.int64], n_args: int, served: bool) -> tuple[Any, Any, Any]:
    """A call's numbers as (alloc_many's sizes, its slots, alloc_extend's or alloc_decode's arrays)."""
    args, slots = numbers[:n_args], (numbers[n_args:] if served else None)
    if name == "alloc_many":
        return args, slots, None
    if name in ("free", "free_swa"):
        return None, args, None
    if name == "alloc_extend":
        n = (n_args - 1) // 3
        return None, slots, (args[1 : 1 + n], args[1 + n : 1 + 2 * n], args[1 + 2 * n :])
    if name == "alloc_decode":
        half = n_args // 2
        return None, slots, (args[:half], args[half:])
    return None, slots, None


def _operations(where: str, shape: Trace, arrays: dict[str, Any], ranks: Any) -> list[Operation]:
    """Every record of ``ops`` as an :class:`Operation`, each checked against the data it points into.

    ``shape`` is the trace's header (no operations yet); ``ranks`` each operation's rank.
    """
    kind, dp_size = shape.pool, shape.dp_size
    ops, data, messages = arrays["ops"], arrays["data"], arrays["messages"]
    result: list[Operation] = []
    backups = 0  # snapshots numbered so far: a restore names one of them
    calls = CALLS.get(kind)  # None: a kind this version does not replay, whose calls are not checked
    lowest_clear = -1 if kind in RANKED else 0  # an allocator's clear() of every rank
    n_data = data.shape[0]
    for i, (rec, rank) in enumerate(zip(ops.tolist(), ranks.tolist(), strict=True)):
        op, error, unreadable, arg, res, offset, message = rec[:7]
        given = rec[_KIND_FIELD] if len(rec) > _KIND_FIELD else 0  # version 4: how the call's array argument came
        if not 0 < op < len(OPS) or error >= len(ERRORS) or not -1 <= message < messages.shape[0]:
            raise TraceError(f"{where}: operation {i} has an unknown code (op {op}, error {error})")
        name = OPS[op]
        if calls is not None and name not in calls:
            raise TraceError(f"{where}: operation {i} is a call of {name}, which a {kind} does not have")
        if not (lowest_clear if name == "clear" else 0) <= rank < dp_size:
            raise TraceError(f"{where}: operation {i} ({name}) names rank {rank}, of dp_size={dp_size}")
        if name == "backup" and not error:
            if arg != backups:
                raise TraceError(f"{where}: operation {i} (backup) is snapshot {arg}, expected {backups}")
            backups += 1
        whole = name == "restore" and arg == -1 and kind in RANKED  # an earlier snapshot, its lists recorded
        if name == "restore" and not unreadable and not whole and not 0 <= arg < backups:
            raise TraceError(f"{where}: operation {i} (restore) names snapshot {arg}, of {backups} taken before it")
        served = not unreadable and not error and res >= 0 and name in _ALLOCATING  # it returned slots
        head = int(data[offset]) if name == "alloc_extend" and 0 <= offset < n_data else None
        if name == "alloc_extend" and not unreadable and head is not None and head < 0:
            raise TraceError(f"{where}: operation {i} (alloc_extend) declares {head} requests")
        n_args = 0 if unreadable else res if whole else _arguments(name, arg, head)
        count = n_args + (res if served else 0)
        if n_args < 0 or count < 0 or offset < 0 or offset + count > n_data:
            raise TraceError(f"{where}: operation {i} ({name}) points outside the data ({offset}+{count})")
        sizes, slots, batch = (
            (None, None, None) if unreadable else _split(name, data[offset : offset + count], n_args, served)
        )
        state = mappings = None
        if whole and not unreadable:
            words = data[offset : offset + count]
            if kind == SWA:  # both sides' lists, then the mappings
                restored = _swa_starts(f"{where}: operation {i} (restore)", words, shape)
                state = (*restored.starts, *restored.swa_starts)  # type: ignore[misc]  # both parsed
                mappings = restored.mappings
            else:
                state = _starts(f"{where}: operation {i} (restore)", words, shape)
            slots = None
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
                rank=int(rank),
                batch=batch,
                state=state,
                mappings=mappings,
                kind=KINDS[given] if given < len(KINDS) else KINDS[-1],  # a later kind: an array, replayed as int64
            )
        )
    return result


def _swa_starts(where: str, words: NDArray[Any], trace: Trace) -> Trace:
    """A sliding-window allocator's ``start``: per rank its full side's state, its SWA side's, its mapping."""
    if words.dtype != np.int64 or words.ndim != 1:
        raise TraceError(f"{where}: its start array is not a pool's state (dtype {words.dtype}, shape {words.shape})")
    full: list[StartState] = []
    swa: list[StartState] = []
    mappings: list[NDArray[np.int64]] = []
    at, m = 0, trace.mapping_length
    for r in range(trace.dp_size):
        for side, pages, into in (("full", trace.pages_per_rank, full), ("SWA", trace.swa_pages_per_rank, swa)):
            state, at = _one_start(where, f" of rank {r}'s {side} side", words, at, (True, pages))
            into.append(state)
        mapping = words[at : at + m]
        if mapping.shape[0] != m or (m and (int(mapping.min()) < 0 or int(mapping.max()) > _INT32_MAX)):
            raise TraceError(f"{where}: its start state of rank {r} has no mapping of {m} int32 slots")
        mappings.append(mapping)
        at += m
    if at != words.shape[0]:
        raise TraceError(f"{where}: its start array holds {words.shape[0] - at} numbers after the last rank's state")
    if len({s.group_depth for s in full}) > 1:
        raise TraceError(f"{where}: its start state's ranks disagree on whether a free group is open")
    return dataclasses.replace(trace, starts=tuple(full), swa_starts=tuple(swa), mappings=tuple(mappings))


_INT32_MAX = 2**31 - 1


def _one_start(
    where: str, of: str, words: NDArray[np.int64], at: int, shape: tuple[bool, int]
) -> tuple[StartState, int]:
    """The state at ``words[at:]`` and where it ends: an allocator's rank's when ``shape[0]``, of ``shape[1]`` pages.

    ``of`` names the state in errors (" of rank 1", "" for a host pool's).
    """
    ranked, num_pages = shape
    if words.shape[0] - at < _START_HEADER:
        raise TraceError(f"{where}: its start array ends before the state{of} (shape {words.shape})")
    depth, nfree, nrel, npend = (int(v) for v in words[at : at + _START_HEADER])
    at += _START_HEADER
    left = words.shape[0] - at
    total = nfree + nrel + npend
    # An allocator's pages can be pending and free at once (freed again after another rank's clear()).
    too_many = nfree + nrel > num_pages or npend > num_pages if ranked else total > num_pages
    if min(depth, nfree, nrel, npend) < 0 or too_many or total > left or (not ranked and total != left):
        lists = f"{total} pages as" if ranked else f"{left} pages as"
        raise TraceError(
            f"{where}: its start state{of} lists {lists} {nfree} free, {nrel} released and "
            f"{npend} pending, of a pool of {num_pages} pages"
        )
    listed = words[at : at + total]
    if ranked:  # the lists, and the pending pages, each name a page once
        _check_listed(where + f": its start state{of}", listed[: nfree + nrel], ranked, num_pages)
        _check_listed(where + f": its start state{of}", listed[nfree + nrel :], ranked, num_pages)
    else:
        _check_listed(where + f": its start state{of}", listed, ranked, num_pages)
    if npend and not depth and not ranked:  # an allocator's clear() leaves other ranks' pending
        raise TraceError(f"{where}: its start state has pending pages outside a free group")
    if ranked and depth not in (0, 1):
        raise TraceError(f"{where}: its start state{of} is {depth} free groups deep; an allocator's do not nest")
    return StartState(listed[:nfree], listed[nfree : nfree + nrel], listed[nfree + nrel :], depth), at + total


def _starts(where: str, words: NDArray[Any], trace: Trace) -> tuple[StartState, ...]:
    """The ``start`` array as a :class:`StartState` per rank, its counts and page ids checked for the pool."""
    if words.dtype != np.int64 or words.ndim != 1 or words.shape[0] < _START_HEADER:
        raise TraceError(f"{where}: its start array is not a pool's state (dtype {words.dtype}, shape {words.shape})")
    ranked = trace.ranked
    num_pages = trace.pages_per_rank
    starts: list[StartState] = []
    at = 0
    for r in range(trace.dp_size):
        state, at = _one_start(where, f" of rank {r}" if ranked else "", words, at, (ranked, num_pages))
        starts.append(state)
    if at != words.shape[0]:
        raise TraceError(f"{where}: its start array holds {words.shape[0] - at} numbers after the last rank's state")
    if len({s.group_depth for s in starts}) > 1:
        raise TraceError(f"{where}: its start state's ranks disagree on whether a free group is open")
    return tuple(starts)


def _check_listed(where: str, listed: NDArray[np.int64], ranked: bool, num_pages: int) -> None:
    """The page ids of a start state: each the pool's (an allocator's from 1: page 0 pads), none twice."""
    if listed.shape[0]:
        low, high = int(listed.min()), int(listed.max())
        if ranked and (low < 1 or high > num_pages):
            raise TraceError(f"{where} lists a page outside the rank's pages 1..{num_pages}")
        if not ranked and (low < 0 or high >= num_pages):
            raise TraceError(f"{where} lists a page outside the pool's {num_pages}")
    if np.unique(listed).shape[0] != listed.shape[0]:
        raise TraceError(f"{where} lists a page twice")


_SHOWN = 8  # slots shown of an array in a report


def describe_slots(value: Any) -> str:
    """``N slots [a, b, ...]`` (the first few of a flattened array), or ``None``: for reports of a difference."""
    if value is None:
        return "None"
    arr = np.asarray(value).reshape(-1)
    head = ", ".join(str(v) for v in arr[:_SHOWN].tolist())
    return f"{arr.shape[0]} slots [{head}{', ...' if arr.shape[0] > _SHOWN else ''}]"


__all__ = [
    "CALLS",
    "ERRORS",
    "HEADER_DTYPE",
    "HOST_KV_BOOKS",
    "KINDS",
    "OPS",
    "OP_DTYPE",
    "RANKED",
    "READS",
    "VERSION",
    "Operation",
    "StartState",
    "Trace",
    "TraceError",
    "arrays",
    "describe_slots",
    "load",
    "write_arrays",
]
