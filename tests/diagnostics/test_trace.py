"""Recorded traces: ``pool.recording(path)``, ``hostpool_nb.trace.load``, and replaying them.

What is recorded for every kind of call, the file format as numpy reads it,
record -> replay round trips on random workloads, the divergence report on
deliberately altered traces, and clear errors (exit status 2, no traceback)
for damaged files. The command line is run as a subprocess once per outcome;
the other cases call ``replay.main``, which is what ``python -m
hostpool_nb.replay`` runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hostpool_nb import DoubleFreeError, HostPoolError, LogicalHostPool
from hostpool_nb import replay as R
from hostpool_nb import trace as T
from hostpool_nb._diagnostics import report


@pytest.fixture(autouse=True)
def short_traces_are_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests time traces of a few calls, to test how timing works: the minimum it asks for is lifted
    (its own tests set it back)."""
    monkeypatch.setattr(R, "MIN_TIMED", 1)


REPO = Path(__file__).resolve().parents[2]
PROG = "python -m hostpool_nb.replay"

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
        ("dp_size", "<i8"),
        ("strict", "?"),
        ("debug_mode", "?"),
        ("size_swa", "<i8"),
    ]
)
OP_DTYPE = np.dtype(
    [
        ("op", "u1"),
        ("error", "u1"),
        ("unreadable", "?"),
        ("arg", "<i8"),
        ("result", "<i8"),
        ("offset", "<i8"),
        ("message", "<i4"),
        ("rank", "<i4"),
        ("kind", "u1"),
    ]
)
# Versions 1 and 2: the header without the allocators' fields, the ops without a rank.
HEADER_DTYPE_2 = np.dtype(HEADER_DTYPE.descr[:8])
OP_DTYPE_2 = np.dtype(OP_DTYPE.descr[:7])
NOT_ALLOCATED = "is not allocated: it was freed already, freed by clear(), or never allocated"


def as_tuple(op: T.Operation) -> tuple[Any, ...]:
    """An operation as plain values: (name, arg, result, sizes, slots, error, message)."""
    sizes = None if op.sizes is None else op.sizes.tolist()
    slots = None if op.slots is None else op.slots.tolist()
    return (op.name, op.arg, op.result, sizes, slots, op.error, op.message)


def arrays(path: Path) -> dict[str, np.ndarray]:
    """The trace's arrays as numbers (a version 4 trace's unpacked), writable."""
    return {k: v.copy() for k, v in T.arrays(path).items()}


def rewrite(src: Path, dst: Path, **changes: Any) -> Path:
    """``dst``: the trace ``src`` with some arrays replaced (``None`` drops one), in the version its header names."""
    got = arrays(src)
    for key, value in changes.items():
        if value is None:
            del got[key]
        else:
            got[key] = value
    T.write_arrays(dst, got)
    return dst


def as_version(src: Path, dst: Path, version: int, **changes: Any) -> Path:
    """``dst``: the host pool's trace ``src`` as version 1, 2 or 3 wrote it (``start`` dropped for 1).

    Versions 1 to 3 stored their arrays as they are; 1 and 2 had the header without the allocators' fields
    and the ops without a rank, 3 the ops without a kind.
    """
    got = arrays(src)
    header_dtype, op_dtype = (HEADER_DTYPE, T.OP_DTYPE_3) if version == 3 else (HEADER_DTYPE_2, OP_DTYPE_2)
    header = np.zeros(1, dtype=header_dtype)
    for name in header_dtype.names:
        header[name] = got["header"][name]
    header["version"] = version
    ops = np.zeros(got["ops"].shape[0], dtype=op_dtype)
    for name in op_dtype.names:
        ops[name] = got["ops"][name]
    return rewrite(src, dst, header=header, ops=ops, **({"start": None} if version == 1 else {}), **changes)


def run_main(path: Path, capsys: Any, *options: str) -> tuple[int, str, str]:
    code = R.main([str(path), *options])
    out, err = capsys.readouterr()
    return code, out, err


# -- a known trace ----------------------------------------------------------------


def record_every_kind(pool: LogicalHostPool, path: Path) -> None:
    """One call of every kind the recording sees, with its errors."""
    before = pool.backup_state()  # from before the recording: not replayable
    with pool.recording(path):
        a = pool.alloc(32)
        assert a is not None
        assert pool.alloc(64) is None
        assert pool.alloc_many([16, 0]) is not None
        assert pool.alloc_many([16]) is not None
        assert pool.alloc_many([16]) is None
        for bad in ([15], [-16], [[16]], "x"):
            with pytest.raises((TypeError, HostPoolError)):
                pool.alloc_many(bad)
        with pytest.raises(TypeError):
            pool.alloc(None)  # type: ignore[arg-type]
        with pytest.raises(HostPoolError):
            pool.alloc(8)
        assert pool.free(a[:16].astype(np.int32).reshape(2, 8)) == 16
        for bad in (a[:16], a[16:20], np.arange(16, 32, dtype=np.float64), np.arange(64, 80)):
            with pytest.raises((TypeError, HostPoolError)):
                pool.free(bad)
        assert pool.merge() == 16
        assert pool.merge() == 0
        state = pool.backup_state()
        with pool.free_group():
            assert pool.free(a[16:].tolist()) == 16
        pool.free_group_begin()
        pool.free_group_end()
        with pytest.raises(HostPoolError):
            pool.free_group_end()
        pool.restore_state(state)
        pool.restore_state(before)
        with pytest.raises(TypeError):
            pool.restore_state("x")
        pool.clear()


EVERY_KIND = [
    ("alloc", 32, 32, None, list(range(32)), None, None),
    ("alloc", 64, -1, None, None, None, None),
    ("alloc_many", 2, 16, [16, 0], list(range(32, 48)), None, None),
    ("alloc_many", 1, 16, [16], list(range(48, 64)), None, None),
    ("alloc_many", 1, -1, [16], None, None, None),
    (
        "alloc_many",
        1,
        0,
        [15],
        None,
        "AlignmentError",
        "LogicalHostPool allocation must be page-aligned, got sizes[0]=15, page_size=16",
    ),
    ("alloc_many", 1, 0, [-16], None, "HostPoolError", "sizes[0] must be non-negative, got sizes[0]=-16"),
    ("alloc_many", -1, 0, None, None, "TypeError", "sizes[0] must be an integer, got list [16]"),
    ("alloc_many", -1, 0, None, None, "TypeError", "sizes must be a 1-D sequence or array of integers, got str 'x'"),
    ("alloc", -1, 0, None, None, "TypeError", "need_size must be an integer, got NoneType None"),
    (
        "alloc",
        8,
        0,
        None,
        None,
        "AlignmentError",
        "LogicalHostPool allocation must be page-aligned, got need_size=8, page_size=16",
    ),
    ("free", 16, 16, None, list(range(16)), None, None),
    (
        "free",
        16,
        0,
        None,
        list(range(16)),
        "DoubleFreeError",
        f"page 0 (slots 0..15), freed at indices[0] (flattened), {NOT_ALLOCATED}",
    ),
    (
        "free",
        4,
        0,
        None,
        [16, 17, 18, 19],
        "AlignmentError",
        "LogicalHostPool free must be page-aligned, got len(indices)=4, page_size=16",
    ),
    (
        "free",
        -1,
        0,
        None,
        None,
        "TypeError",
        "indices must hold integers, got dtype float64; "
        "convert with .astype(np.int64) if the values are whole slot ids",
    ),
    (
        "free",
        16,
        0,
        None,
        list(range(64, 80)),
        "SlotRangeError",
        "free got slot 64 at indices[0] (flattened), outside [0, 64)",
    ),
    ("merge", 0, 16, None, None, None, None),
    ("merge", 0, 0, None, None, None, None),
    ("backup", 0, 0, None, None, None, None),
    ("free_group_begin", 0, 0, None, None, None, None),
    ("free", 16, 16, None, list(range(16, 32)), None, None),
    ("free_group_end", 0, 0, None, None, None, None),
    ("free_group_begin", 0, 0, None, None, None, None),
    ("free_group_end", 0, 0, None, None, None, None),
    (
        "free_group_end",
        0,
        0,
        None,
        None,
        "HostPoolError",
        "free_group_end() without a free group: none was begun, or clear() ended it",
    ),
    ("restore", 0, 0, None, None, None, None),
    ("restore", -1, 0, None, None, None, None),
    ("restore", -1, 0, None, None, "TypeError", "state must be a PoolState from backup_state(), got str"),
    ("clear", 0, 0, None, None, None, None),
]


def test_every_kind_of_call_is_recorded(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16)
    path = tmp_path / "every.npz"
    record_every_kind(pool, path)
    trace = T.load(path)
    assert (trace.pool, trace.size, trace.page_size, trace.merge, trace.track) == (
        "LogicalHostPool",
        64,
        16,
        "fifo",
        False,
    )
    assert len(trace) == len(EVERY_KIND)
    assert [op.index for op in trace.operations] == list(range(len(EVERY_KIND)))
    for op, want in zip(trace.operations, EVERY_KIND, strict=True):
        assert as_tuple(op) == want, op.index
        for arr in (op.sizes, op.slots):
            assert arr is None or arr.dtype == np.int64
    # Nothing is left of the recording on the pool, and nothing else in the folder.
    assert not {"alloc", "free", "clear", "backup_state"} & set(vars(pool))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["every.npz"]
    # Unreadable inputs (alloc(None), free of floats, two of alloc_many and of restore), and the
    # restore of a snapshot from before the recording, are skipped.
    done, skipped, divergence = R.replay(trace)
    assert (done, skipped, divergence) == (len(EVERY_KIND) - 6, 6, None)


def test_the_file_is_an_npz_numpy_reads_without_pickle(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16, merge="sorted", track=True)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        a = pool.alloc(32, tag="x")
        assert a is not None
        assert pool.alloc_many([16, 16]) is not None
        assert pool.free(a) == 32
        with pytest.raises(DoubleFreeError) as info:
            pool.free(a)
    with zipfile.ZipFile(path) as zf:
        assert sorted(zf.namelist()) == ["data.npy", "header.npy", "messages.npy", "ops.npy", "start.npy"]
        assert {info.compress_type for info in zf.infolist()} == {zipfile.ZIP_STORED}
    with np.load(path, allow_pickle=False) as archive:
        assert sorted(archive.files) == ["data", "header", "messages", "ops", "start"]
        stored = {k: archive[k] for k in archive.files}
    # Version 4: each array but the header compressed with zlib; the numbers as runs (first less the last run's
    # end, length), int64; the messages one JSON string a line.
    assert {k for k, v in stored.items() if v.dtype == np.uint8} == {"ops", "data", "messages", "start"}
    runs = np.frombuffer(zlib.decompress(stored["data"].tobytes()), dtype="<i8").reshape(-1, 2)
    # 0..31, then 16 and 16, 32..63, and 0..31 twice
    assert runs.tolist() == [[0, 32], [-16, 1], [-1, 1], [15, 32], [-64, 32], [-32, 32]]
    assert zlib.decompress(stored["messages"].tobytes()).decode() == json.dumps(str(info.value)) + "\n"
    assert np.frombuffer(zlib.decompress(stored["start"].tobytes()), dtype="<i8").reshape(-1, 2)[:, 1].sum() == 8
    assert np.frombuffer(zlib.decompress(stored["ops"].tobytes()), dtype=OP_DTYPE).shape == (4,)
    # trace.arrays unpacks them.
    header, ops, data, messages, start = (T.arrays(path)[k] for k in ("header", "ops", "data", "messages", "start"))
    assert header.dtype == HEADER_DTYPE
    assert header.shape == (1,)
    assert header[0].tolist() == (4, "LogicalHostPool", 64, 16, "sorted", True, 4, 130, 1, False, False, 0)
    # The pool as the recording found it: no group, 4 free pages, none released or pending; the free list.
    assert start.dtype == np.dtype("<i8")
    assert start.tolist() == [0, 4, 0, 0, 0, 1, 2, 3]
    assert ops.dtype == OP_DTYPE
    assert ops.shape == (4,)
    assert data.dtype == np.dtype("<i8")
    assert data.shape == (130,)
    assert messages.dtype.kind == "U"
    assert messages.shape == (1,)
    assert T.OPS == (
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
        "available_size",
        "full_available_size",
        "swa_available_size",
    )
    assert T.KINDS == ("int64 array", "int32 array", "list", "other")
    assert T.ERRORS == (
        "",
        "TypeError",
        "HostPoolError",
        "AlignmentError",
        "PartialPageError",
        "SlotRangeError",
        "DoubleFreeError",
        "PagedOnlyError",
        "HostKVAlignmentError",
        "HostKVDoubleFreeError",
        "HostKVSlotRangeError",
    )
    assert ops.tolist() == [
        (1, 0, False, 32, 32, 0, -1, 0, 0),
        (2, 0, False, 2, 32, 32, -1, 0, 0),
        (3, 0, False, 32, 32, 66, -1, 0, 0),
        (3, 6, False, 32, 0, 98, 0, 0, 0),
    ]
    assert data[0:32].tolist() == list(range(32))
    assert data[32:34].tolist() == [16, 16]
    assert data[34:66].tolist() == list(range(32, 64))
    assert data[66:98].tolist() == data[98:130].tolist() == list(range(32))
    # The message keeps the tracking pool's history; replay compares it without.
    assert str(messages[0]).startswith(f"page 0 (slots 0..15), freed at indices[0] (flattened), {NOT_ALLOCATED}; ")
    assert "; it was allocated at " in str(messages[0])
    assert R.replay(T.load(path)) == (4, 0, None)


def test_an_empty_recording(tmp_path: Path, capsys: Any) -> None:
    pool = LogicalHostPool(0, 4)
    path = tmp_path / "empty.npz"
    with pool.recording(path):
        pass
    trace = T.load(path)
    assert (len(trace), trace.size, trace.page_size) == (0, 0, 4)
    assert arrays(path)["data"].shape == (0,)
    code, out, err = run_main(path, capsys)
    assert (code, err) == (0, "")
    assert out == f"{path}: LogicalHostPool(size=0, page_size=4, merge='fifo', track=False): all 0 operations match\n"


# -- recording: when and where --------------------------------------------------


def test_recording_into_a_missing_directory_fails_before_anything(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16)
    path = tmp_path / "no" / "such" / "t.npz"
    ran = []
    with pytest.raises(HostPoolError) as info, pool.recording(path):
        ran.append(True)
    assert str(info.value) == f"cannot record to {path}: directory {path.parent} does not exist"
    assert ran == []
    assert not set(LogicalHostPool._recorded) & set(vars(pool))
    assert not (tmp_path / "no").exists()
    # The pool still works, and can record later.
    with pool.recording(tmp_path / "ok.npz"):
        assert pool.alloc(16) is not None
    assert len(T.load(tmp_path / "ok.npz")) == 1


def test_recordings_do_not_nest(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16)
    outer, inner = tmp_path / "outer.npz", tmp_path / "inner.npz"
    with pool.recording(outer):
        assert pool.alloc(16) is not None
        with pytest.raises(HostPoolError) as info, pool.recording(inner):
            pytest.fail("the nested block ran")
        assert str(info.value) == "this pool is already recording: recordings do not nest"
        assert pool.alloc(16) is not None  # still recorded by the outer one
    assert not inner.exists()
    assert [as_tuple(op)[:3] for op in T.load(outer).operations] == [("alloc", 16, 16), ("alloc", 16, 16)]
    # Another pool records on its own at the same time.
    other = LogicalHostPool(32, 16)
    with pool.recording(outer), other.recording(inner):
        assert other.alloc(32) is not None
        pool.clear()
    assert [op.name for op in T.load(outer).operations] == ["clear"]
    assert [op.name for op in T.load(inner).operations] == ["alloc"]


def record_then_raise(pool: LogicalHostPool, path: Path, exc: BaseException | None) -> None:
    """Record an alloc, then leave the block with ``exc`` (or with the pool's error for a bad free)."""
    with pool.recording(path):
        assert pool.alloc(32) is not None
        if exc is not None:
            raise exc
        pool.free(np.arange(32, 48))  # page 2 was never allocated: the error leaves the block


def test_the_file_is_written_when_the_block_raises(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16)
    path = tmp_path / "t.npz"
    with pytest.raises(DoubleFreeError):
        record_then_raise(pool, path, None)
    trace = T.load(path)
    assert [(op.name, op.error) for op in trace.operations] == [("alloc", None), ("free", "DoubleFreeError")]
    # The pool is no longer recording: later calls are not in the file.
    assert not set(LogicalHostPool._recorded) & set(vars(pool))
    assert pool.alloc(16) is not None
    assert len(T.load(path)) == 2


def test_the_file_is_written_when_the_block_raises_another_error(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16)
    path = tmp_path / "t.npz"
    with pytest.raises(KeyError, match="boom"):
        record_then_raise(pool, path, KeyError("boom"))
    assert [as_tuple(op)[:3] for op in T.load(path).operations] == [("alloc", 32, 32)]


@pytest.mark.torch
def test_torch_adapter_calls_are_recorded_as_numbers(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from hostpool_nb.torch import LogicalHostPool as TorchPool

    pool = TorchPool(64, 16, track=True)
    path = tmp_path / "torch.npz"
    with pool.recording(path):
        a = pool.alloc(torch.tensor(32), tag="t")
        b = pool.alloc_many(torch.tensor([16, 0], dtype=torch.int32))
        assert isinstance(a, torch.Tensor)
        assert b is not None
        assert pool.free(a.reshape(2, 16)) == 32
        with pytest.raises(DoubleFreeError):
            pool.free(a[:16].to(torch.int16))
        with pytest.raises(TypeError):
            pool.free(a.double())
    trace = T.load(path)
    assert trace.pool == "LogicalHostPool"
    assert trace.track is True
    got = [as_tuple(op) for op in trace.operations]
    assert got[:3] == [
        ("alloc", 32, 32, None, list(range(32)), None, None),
        ("alloc_many", 2, 16, [16, 0], list(range(32, 48)), None, None),
        ("free", 32, 32, None, list(range(32)), None, None),
    ]
    assert got[3][:6] == ("free", 16, 0, None, list(range(16)), "DoubleFreeError")
    assert got[4][:3] == ("free", -1, 0)
    assert got[4][5] == "TypeError"
    assert R.replay(trace) == (4, 1, None)


# -- round trips on random workloads ----------------------------------------------

CALLS = st.one_of(
    # alloc(0) is left out: its replay diverges (test_alloc_of_nothing_replays).
    st.tuples(st.just("alloc"), st.integers(1, 5)),
    st.tuples(st.just("alloc_misaligned"), st.integers(1, 3)),
    st.tuples(st.just("alloc_many"), st.lists(st.integers(0, 3), max_size=4)),
    st.tuples(st.just("alloc_many_bad"), st.lists(st.integers(0, 3), min_size=1, max_size=3)),
    st.tuples(st.just("free"), st.integers(0, 1 << 16)),
    st.tuples(st.just("free_page"), st.integers(0, 1 << 16)),
    st.tuples(st.just("free_partial"), st.integers(0, 1 << 16)),
    st.tuples(st.just("free_out_of_range"), st.integers(0, 3)),
    st.tuples(st.just("clear"), st.just(0)),
    st.tuples(st.just("merge"), st.just(0)),
    st.tuples(st.just("begin"), st.just(0)),
    st.tuples(st.just("end"), st.just(0)),
    st.tuples(st.just("group"), st.integers(0, 1 << 16)),
    st.tuples(st.just("backup"), st.just(0)),
    st.tuples(st.just("restore"), st.integers(0, 1 << 16)),
)


def run_workload(pool: LogicalHostPool, calls: list[tuple[str, Any]], tags: bool) -> list[tuple[str, Any, Any]]:
    """Make ``calls`` on ``pool``; return what each recorded call did: (name, error class, slots)."""
    ps, pages = pool.page_size, pool.size // pool.page_size
    seen: list[np.ndarray] = []  # every allocation so far, freed or not: frees pick among them
    states: list[Any] = []
    log: list[tuple[str, Any, Any]] = []

    def call(name: str, fn: Any) -> Any:
        try:
            value = fn()
        except (TypeError, ValueError) as exc:
            log.append((name, type(exc).__name__, None))
            return None
        slots = value[0] if name == "alloc_many" and value is not None else value
        log.append((name, None, slots.tolist() if name.startswith("alloc") and slots is not None else None))
        if name.startswith("alloc") and slots is not None and slots.shape[0]:
            seen.append(slots)
        return value

    for i, (kind, n) in enumerate(calls):
        tag = (i, kind) if tags and i % 2 else None
        if kind == "alloc":
            call("alloc", lambda n=n, tag=tag: pool.alloc(n * ps, tag=tag))
        elif kind == "alloc_misaligned":
            call("alloc", lambda n=n: pool.alloc(n * ps + 1) if ps > 1 else pool.alloc(n))
        elif kind == "alloc_many":
            call("alloc_many", lambda n=n, tag=tag: pool.alloc_many([k * ps for k in n], tag=tag))
        elif kind == "alloc_many_bad":
            call("alloc_many", lambda n=n: pool.alloc_many([*(k * ps for k in n), -ps]))
        elif kind in ("free", "free_page", "free_partial", "group") and seen:
            arr = seen[n % len(seen)]
            if kind == "free_page":
                arr = arr[:ps]
            elif kind == "free_partial" and ps == 1:
                arr = arr[::-1]  # pages in another order: still valid
            elif kind == "free_partial":
                arr = arr[1 : ps + 1] if arr.shape[0] > ps else arr[: ps - 1]  # a partial page, or misaligned
            if kind == "group":
                with pool.free_group():
                    call("free", lambda arr=arr: pool.free(arr))
                log[-1:-1] = [("free_group_begin", None, None)]
                log.append(("free_group_end", None, None))
            else:
                call("free", lambda arr=arr: pool.free(arr))
        elif kind == "free_out_of_range":
            call("free", lambda n=n: pool.free(np.arange((pages + n) * ps, (pages + n + 1) * ps)))
        elif kind == "clear":
            call("clear", pool.clear)
        elif kind == "merge":
            call("merge", pool.merge)
        elif kind == "begin":
            call("free_group_begin", pool.free_group_begin)
        elif kind == "end":
            call("free_group_end", pool.free_group_end)
        elif kind == "backup":
            states.append(pool.backup_state())
            log.append(("backup", None, None))
        elif kind == "restore" and states:
            call("restore", lambda n=n: pool.restore_state(states[n % len(states)]))
    return log


@given(
    page_size=st.sampled_from([1, 2, 3, 16]),
    pages=st.integers(0, 6),
    merge=st.sampled_from(["fifo", "sorted"]),
    track=st.booleans(),
    calls=st.lists(CALLS, max_size=40),
)
def test_record_then_replay_round_trip(
    tmp_path_factory: Any, page_size: int, pages: int, merge: str, track: bool, calls: list[tuple[str, Any]]
) -> None:
    path = tmp_path_factory.getbasetemp() / "round-trip.npz"
    pool = LogicalHostPool(pages * page_size, page_size, merge=merge, track=track)
    with pool.recording(path):
        log = run_workload(pool, calls, tags=track)
    trace = T.load(path)
    assert (trace.size, trace.page_size, trace.merge, trace.track) == (pages * page_size, page_size, merge, track)
    recorded = []
    for op in trace.operations:
        slots = op.slots.tolist() if op.name.startswith("alloc") and op.slots is not None else None
        recorded.append((op.name, op.error, slots))
    assert recorded == log
    assert R.replay(trace) == (len(log), 0, None)


# -- the command line ----------------------------------------------------------


def small_trace(path: Path, track: bool = False) -> Path:
    """Five operations on a pool of 4 pages of 4 slots, the last two an error and a merge."""
    pool = LogicalHostPool(16, 4, track=track)
    with pool.recording(path):
        a = pool.alloc(8)  # 0: slots 0..7
        assert a is not None
        assert pool.free(a[:4]) == 4  # 1
        b = pool.alloc(12)  # 2: pages 2, 3, 0
        assert b is not None
        assert b.tolist() == [*range(8, 16), *range(4)]
        with pytest.raises(DoubleFreeError):
            pool.free(np.concatenate([a[4:], a[4:]]))  # 3: page 1 twice
        assert pool.merge() == 0  # 4
    return path


SMALL_POOL = "LogicalHostPool(size=16, page_size=4, merge='fifo', track=False)"
TWICE = "page 1 (slots 4..7) is freed twice in one call (again at indices[4], flattened)"


def test_replay_command_line(tmp_path: Path, capsys: Any) -> None:
    """Exit 0 and 2 from real ``python -m hostpool_nb.replay`` processes (run at once); exit 1 in-process."""
    good = small_trace(tmp_path / "good.npz")
    broken = tmp_path / "broken.npz"
    broken.write_bytes(good.read_bytes()[:100])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "hostpool_nb.replay", str(p)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in (good, broken)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        # A first compile that takes long says so (a WARNING line), however fast or busy the machine: not an error.
        err = "".join(line for line in err.splitlines(keepends=True) if "compiling numba kernels" not in line)
        results.append((proc.returncode, out, err))
    assert results[0] == (0, f"{good}: {SMALL_POOL}: all 5 operations match\n", "")
    code, out, err = results[1]
    assert (code, out) == (2, "")
    # One line: the error, no traceback.
    assert re.fullmatch(
        re.escape(f"{PROG}: error: {broken} is a damaged trace: it begins as an .npz (zip) archive, but the ")
        + r"[^\n]+ the file was cut short, or changed since it was written \([^\n]+\)\n",
        err,
    ), err
    # Exit 1 (main() is what the module runs): a slot of operation 2 changed.
    data = arrays(good)["data"].copy()
    data[13] = 99  # operation 2's second slot (after 8 for operation 0 and 4 for operation 1)
    bad = rewrite(good, tmp_path / "bad.npz", data=data)
    assert run_main(bad, capsys) == (
        1,
        f"{bad}: {SMALL_POOL}: DIVERGES at operation 2 (alloc): "
        "expected 12 slots [8, 99, 10, 11, 12, 13, 14, 15, ...], "
        "got 12 slots [8, 9, 10, 11, 12, 13, 14, 15, ...] (after 2 matching operations)\n",
        "",
    )


def test_replay_trace_api(tmp_path: Path) -> None:
    trace = T.load(small_trace(tmp_path / "t.npz"))
    assert len(trace) == 5
    assert [op.name for op in trace.operations] == ["alloc", "free", "alloc", "free", "merge"]
    assert trace.operations[3].message == TWICE
    assert R.replay(trace) == (5, 0, None)


def test_replay_of_a_tracking_pool_ignores_the_sites_in_messages(tmp_path: Path, capsys: Any) -> None:
    path = small_trace(tmp_path / "t.npz", track=True)
    trace = T.load(path)
    message = trace.operations[3].message
    assert message is not None
    assert message.startswith(TWICE + "; it was allocated at ")
    assert message.endswith(" (allocation #1)")
    code, out, err = run_main(path, capsys)
    assert (code, err) == (0, "")
    assert out == f"{path}: {SMALL_POOL.replace('track=False', 'track=True')}: all 5 operations match\n"


def test_replay_reports_skipped_operations(tmp_path: Path, capsys: Any) -> None:
    pool = LogicalHostPool(16, 4)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        assert pool.alloc(4) is not None
        with pytest.raises(TypeError):
            pool.free(np.zeros(4))
        with pytest.raises(TypeError):
            pool.alloc_many([[4]])
    code, out, err = run_main(path, capsys)
    assert (code, err) == (0, "")
    assert out == (
        f"{path}: LogicalHostPool(size=16, page_size=4, merge='fifo', track=False): the one operation matches; "
        "2 not replayable (what they were given is not in the record), skipped\n"
    )


# -- divergence reports ----------------------------------------------------------


def test_divergence_a_changed_slot(tmp_path: Path, capsys: Any) -> None:
    good = small_trace(tmp_path / "good.npz")
    data = arrays(good)["data"].copy()
    assert data[:8].tolist() == list(range(8))
    data[1] = 5
    bad = rewrite(good, tmp_path / "bad.npz", data=data)
    assert R.replay(T.load(bad)) == (
        0,
        0,
        R.Divergence(0, "alloc", "8 slots [0, 5, 2, 3, 4, 5, 6, 7]", "8 slots [0, 1, 2, 3, 4, 5, 6, 7]"),
    )
    code, out, err = run_main(bad, capsys)
    assert (code, err) == (1, "")
    assert out == (
        f"{bad}: {SMALL_POOL}: DIVERGES at operation 0 (alloc): expected 8 slots [0, 5, 2, 3, 4, 5, 6, 7], "
        "got 8 slots [0, 1, 2, 3, 4, 5, 6, 7] (after 0 matching operations)\n"
    )


def test_divergence_a_changed_result_count(tmp_path: Path, capsys: Any) -> None:
    good = small_trace(tmp_path / "good.npz")
    ops = arrays(good)["ops"].copy()
    assert ops["result"][1] == 4
    ops["result"][1] = 8  # free returned 8?
    bad = rewrite(good, tmp_path / "bad.npz", ops=ops)
    code, out, err = run_main(bad, capsys)
    assert (code, err) == (1, "")
    assert (
        out == f"{bad}: {SMALL_POOL}: DIVERGES at operation 1 (free): expected 8, got 4 (after 1 matching operations)\n"
    )
    # An allocation recorded as refused that the pool serves.
    ops = arrays(good)["ops"].copy()
    ops["result"][0] = -1
    bad2 = rewrite(good, tmp_path / "bad2.npz", ops=ops)
    code, out, _ = run_main(bad2, capsys)
    assert code == 1
    assert out == (
        f"{bad2}: {SMALL_POOL}: DIVERGES at operation 0 (alloc): expected None, "
        "got 8 slots [0, 1, 2, 3, 4, 5, 6, 7] (after 0 matching operations)\n"
    )


def test_divergence_a_dropped_operation(tmp_path: Path, capsys: Any) -> None:
    good = small_trace(tmp_path / "good.npz")
    got = arrays(good)
    ops = np.delete(got["ops"], 1)  # the free: the 12-slot allocation no longer fits
    header = got["header"].copy()
    header["ops"] = 4
    bad = rewrite(good, tmp_path / "bad.npz", ops=ops, header=header)
    code, out, err = run_main(bad, capsys)
    assert (code, err) == (1, "")
    assert out == (
        f"{bad}: {SMALL_POOL}: DIVERGES at operation 1 (alloc): expected 12 slots [8, 9, 10, 11, 12, 13, 14, 15, ...], "
        "got None (after 1 matching operations)\n"
    )


def test_divergence_a_changed_error(tmp_path: Path, capsys: Any) -> None:
    good = small_trace(tmp_path / "good.npz")
    assert arrays(good)["messages"].tolist() == [TWICE]
    bad = rewrite(good, tmp_path / "bad.npz", messages=np.array(["page 1 is freed twice"]))
    code, out, err = run_main(bad, capsys)
    assert (code, err) == (1, "")
    assert out == (
        f"{bad}: {SMALL_POOL}: DIVERGES at operation 3 (free): expected DoubleFreeError: page 1 is freed twice, "
        f"got DoubleFreeError: {TWICE} (after 3 matching operations)\n"
    )
    ops = arrays(good)["ops"].copy()
    ops["error"][3] = T.ERRORS.index("SlotRangeError")
    bad2 = rewrite(good, tmp_path / "bad2.npz", ops=ops)
    code, out, _ = run_main(bad2, capsys)
    assert code == 1
    assert f"DIVERGES at operation 3 (free): expected SlotRangeError: {TWICE}, got DoubleFreeError: {TWICE}" in out
    # An error recorded where the pool raises none, and the reverse.
    ops = arrays(good)["ops"].copy()
    ops["error"][4], ops["message"][4] = T.ERRORS.index("HostPoolError"), 0
    bad3 = rewrite(good, tmp_path / "bad3.npz", ops=ops)
    code, out, _ = run_main(bad3, capsys)
    assert code == 1
    assert f"DIVERGES at operation 4 (merge): expected HostPoolError: {TWICE}, got no error" in out
    ops = arrays(good)["ops"].copy()
    ops["error"][3], ops["message"][3] = 0, -1
    bad4 = rewrite(good, tmp_path / "bad4.npz", ops=ops)
    code, out, _ = run_main(bad4, capsys)
    assert code == 1
    assert f"DIVERGES at operation 3 (free): expected no error, got DoubleFreeError: {TWICE}" in out


# -- damaged files -----------------------------------------------------------------


def damaged(good: Path, tmp_path: Path, case: str) -> tuple[Path, str]:
    """A damaged copy of ``good`` (small_trace: 5 ops, 32 numbers) and the exact TraceError text.

    The damage to a stored array's type or length is made to a version 3 copy, which stores them as they are.
    """
    if case in STORED_AS_THEY_ARE:
        good = as_version(good, tmp_path / "good-3.npz", 3)
    got = arrays(good)
    bad = tmp_path / f"{case}.npz"
    where = f"{bad} is damaged"
    if case == "wrong-header-dtype":
        rewrite(good, bad, header=np.zeros(1, dtype=np.int64))
        return bad, f"{bad} is not a hostpool_nb trace (its header has dtype int64)"
    if case == "two-headers":
        rewrite(good, bad, header=np.concatenate([got["header"], got["header"]]))
        return bad, f"{bad} is not a hostpool_nb trace (its header has dtype {HEADER_DTYPE})"
    if case == "wrong-ops-dtype":
        rewrite(good, bad, ops=got["ops"]["arg"].copy())
        return bad, f"{where}: its ops or data array has the wrong type"
    if case == "wrong-data-dtype":
        rewrite(good, bad, data=got["data"].astype(np.float64))
        return bad, f"{where}: its ops or data array has the wrong type"
    if case == "big-endian-data":
        rewrite(good, bad, data=got["data"].astype(">i8"))
        return bad, f"{where}: its ops or data array has the wrong type"
    if case == "2d-data":
        rewrite(good, bad, data=got["data"].reshape(4, 8))
        return bad, f"{where}: its ops or data array has the wrong type"
    if case in ("ops-count", "data-count"):
        header = got["header"].copy()
        header["ops" if case == "ops-count" else "data"] += 1
        rewrite(good, bad, header=header)
        ops, data = (6, 32) if case == "ops-count" else (5, 33)
        return (
            bad,
            f"{where}: the header says {ops} operations and {data} numbers, the file holds 5 and 32 (truncated?)",
        )
    if case == "fewer-ops":
        rewrite(good, bad, ops=got["ops"][:3])
        return bad, f"{where}: the header says 5 operations and 32 numbers, the file holds 3 and 32 (truncated?)"
    if case in ("op-code-high", "op-code-zero", "error-code", "message-index"):
        ops = got["ops"].copy()
        field, value = {
            "op-code-high": ("op", len(T.OPS)),  # one past the last known
            "op-code-zero": ("op", 0),
            "error-code": ("error", len(T.ERRORS)),
            "message-index": ("message", 1),
        }[case]
        ops[field][2] = value
        rewrite(good, bad, ops=ops)
        op, error = int(ops["op"][2]), int(ops["error"][2])
        return bad, f"{where}: operation 2 has an unknown code (op {op}, error {error})"
    if case in ("offset-past-end", "offset-negative", "count-past-end"):
        ops = got["ops"].copy()
        if case == "offset-past-end":
            ops["offset"][2] = 30  # operation 2 has 12 numbers
            text = "(30+12)"
        elif case == "offset-negative":
            ops["offset"][2] = -1
            text = "(-1+12)"
        else:
            ops["result"][2] = 40
            text = f"({int(ops['offset'][2])}+40)"
        rewrite(good, bad, ops=ops)
        return bad, f"{where}: operation 2 (alloc) points outside the data {text}"
    if case == "version":
        header = got["header"].copy()
        header["version"] = 5
        rewrite(good, bad, header=header)
        return bad, (
            f"{bad} is a version 5 trace; this hostpool_nb reads versions 1, 2, 3, 4 "
            "(replay it with the hostpool_nb that recorded it)"
        )
    if case == "not-a-pool":
        header = got["header"].copy()
        header["page_size"] = 0
        rewrite(good, bad, header=header)
        return bad, f"{where}: the pool it records is not a pool (size=16, page_size=0, fifo)"
    if case == "unknown-merge":
        header = got["header"].copy()
        header["merge"] = "lifo"
        rewrite(good, bad, header=header)
        return bad, f"{where}: the pool it records is not a pool (size=16, page_size=4, lifo)"
    raise AssertionError(case)


STORED_AS_THEY_ARE = ("wrong-ops-dtype", "wrong-data-dtype", "big-endian-data", "2d-data")
STORED_AS_THEY_ARE += ("ops-count", "data-count", "fewer-ops")
DAMAGED = [
    "wrong-header-dtype",
    "two-headers",
    "wrong-ops-dtype",
    "wrong-data-dtype",
    "big-endian-data",
    "2d-data",
    "ops-count",
    "data-count",
    "fewer-ops",
    "op-code-high",
    "op-code-zero",
    "error-code",
    "message-index",
    "offset-past-end",
    "offset-negative",
    "count-past-end",
    "version",
    "not-a-pool",
    "unknown-merge",
]


@pytest.mark.parametrize("case", DAMAGED)
def test_damaged_trace(case: str, tmp_path: Path, capsys: Any) -> None:
    good = small_trace(tmp_path / "good.npz")
    bad, text = damaged(good, tmp_path, case)
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert str(info.value) == text
    assert isinstance(info.value, HostPoolError)
    code, out, err = run_main(bad, capsys)
    assert (code, out, err) == (2, "", f"{PROG}: error: {text}\n")


def unreadable(good: Path, tmp_path: Path, case: str) -> Path:
    bad = tmp_path / f"{case}.npz"
    raw = good.read_bytes()
    if case == "truncated-half":
        bad.write_bytes(raw[: len(raw) // 2])
    elif case == "truncated-end":
        bad.write_bytes(raw[:-10])
    elif case == "empty-file":
        bad.write_bytes(b"")
    elif case == "text-file":
        bad.write_text("op,arg\nalloc,16\n")
    elif case == "garbage":
        bad.write_bytes(bytes(range(256)) * 4)
    else:
        raise AssertionError(case)
    return bad


UNREADABLE = ["truncated-half", "truncated-end", "empty-file", "text-file", "garbage"]


@pytest.mark.parametrize("case", UNREADABLE)
def test_unreadable_file(case: str, tmp_path: Path, capsys: Any) -> None:
    bad = unreadable(small_trace(tmp_path / "good.npz"), tmp_path, case)
    size = bad.stat().st_size
    prefix = (  # what begins as an archive is called damaged, with what it most likely is: cut short
        f"{bad} is a damaged trace: it begins as an .npz (zip) archive, but the directory that ends one is not in "
        f"its {size:,} bytes: the file was cut short, or changed since it was written ("
        if case.startswith("truncated")
        else f"{bad} is not a hostpool_nb trace (not a readable .npz archive: "
    )
    # A truncated archive leaks its file handle (test_a_damaged_archive_is_closed): ignored here,
    # where the error (which holds the handle) is dropped.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        with pytest.raises(T.TraceError) as info:
            T.load(bad)
        text = str(info.value)
        del info
        code, out, err = run_main(bad, capsys)
    assert text.startswith(prefix), text
    assert text.endswith(")"), text
    assert (code, out, err) == (2, "", f"{PROG}: error: {text}\n")


def leaked_files(path: Path) -> list[str]:
    """The ResourceWarnings of loading ``path`` (a TraceError): file handles left open."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(T.TraceError):
            T.load(path)
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


@pytest.mark.parametrize("case", ["empty-file", "text-file", "garbage"])
def test_an_unreadable_file_is_closed(case: str, tmp_path: Path) -> None:
    assert leaked_files(unreadable(small_trace(tmp_path / "good.npz"), tmp_path, case)) == []


@pytest.mark.parametrize("case", ["truncated-half", "truncated-end"])
def test_a_damaged_archive_is_closed(case: str, tmp_path: Path) -> None:
    assert leaked_files(unreadable(small_trace(tmp_path / "good.npz"), tmp_path, case)) == []


def test_an_array_that_cannot_be_read_without_pickle(tmp_path: Path, capsys: Any) -> None:
    good = as_version(small_trace(tmp_path / "good.npz"), tmp_path / "good-3.npz", 3)  # arrays stored as they are
    bad = rewrite(good, tmp_path / "bad.npz", messages=np.array([TWICE, None], dtype=object))
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert str(info.value).startswith(f"{bad} is damaged: its 'messages' array cannot be read (")
    assert run_main(bad, capsys)[0] == 2


@pytest.mark.parametrize("missing", ["header", "ops", "data", "messages"])
def test_a_missing_array(missing: str, tmp_path: Path, capsys: Any) -> None:
    good = small_trace(tmp_path / "good.npz")
    bad = rewrite(good, tmp_path / "bad.npz", **{missing: None})
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert str(info.value).startswith(f"{bad} is not a hostpool_nb trace: it has no '{missing}")
    code, out, err = run_main(bad, capsys)
    assert (code, out, err) == (2, "", f"{PROG}: error: {info.value}\n")


def test_a_missing_array_is_named_plainly(tmp_path: Path) -> None:
    good = small_trace(tmp_path / "good.npz")
    bad = rewrite(good, tmp_path / "bad.npz", data=None)
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert str(info.value) == f"{bad} is not a hostpool_nb trace: it has no 'data' array"


def test_a_missing_file(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "nothing.npz"
    with pytest.raises(FileNotFoundError):
        T.load(path)
    assert run_main(path, capsys) == (2, "", f"{PROG}: error: no such file: {path}\n")


# -- bugs found while writing these tests, fixed since ---------------------------------


def test_a_npy_file_is_a_trace_error(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "x.npy"
    np.save(path, np.arange(3))
    with pytest.raises(T.TraceError):
        T.load(path)


def test_a_0d_messages_array_is_a_trace_error(tmp_path: Path) -> None:
    good = as_version(small_trace(tmp_path / "good.npz"), tmp_path / "good-3.npz", 3)  # arrays stored as they are
    bad = rewrite(good, tmp_path / "bad.npz", messages=np.array(TWICE))
    with pytest.raises(T.TraceError):
        T.load(bad)


def test_a_header_with_an_impossible_pool_size(tmp_path: Path, capsys: Any) -> None:
    good = small_trace(tmp_path / "good.npz")
    header = arrays(good)["header"].copy()
    header["size"], header["page_size"] = 2**62, 1
    bad = rewrite(good, tmp_path / "bad.npz", header=header)
    assert run_main(bad, capsys)[0] == 2


@pytest.mark.parametrize("need_size", [16.0, "16", np.float64(16.0)], ids=["float", "str", "np.float64"])
def test_a_non_integer_need_size_replays(need_size: Any, tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        with pytest.raises(TypeError):
            pool.alloc(need_size)
        assert pool.alloc(16) is not None
    done, _, divergence = R.replay(T.load(path))
    assert divergence is None
    assert done >= 1


@pytest.mark.parametrize("need_size", [-16, -1])
def test_a_negative_need_size_is_replayed(need_size: int, tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16)
    path = tmp_path / "t.npz"
    with pool.recording(path), pytest.raises(HostPoolError):
        pool.alloc(need_size)
    assert R.replay(T.load(path)) == (1, 0, None)


def test_huge_uint64_sizes_replay(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        assert pool.alloc_many(np.array([2**63], dtype=np.uint64)) is None
    _done, _skipped, divergence = R.replay(T.load(path))
    assert divergence is None


def test_an_unhashable_tag_on_a_tracking_pool_replays(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16, track=True)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        with pytest.raises(TypeError):
            pool.alloc(16, tag=[1])
        assert pool.alloc(16, tag="ok") is not None
    _done, _, divergence = R.replay(T.load(path))
    assert divergence is None


def test_alloc_of_nothing_replays(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        got = pool.alloc(0)
        assert got is not None
        assert got.shape == (0,)
    trace = T.load(path)
    assert trace.operations[0].slots is not None
    assert R.replay(trace) == (1, 0, None)


def test_a_large_trace_loads_and_replays(tmp_path: Path) -> None:
    """Counts beyond Python's cached small ints: 4,096-slot allocations and frees."""
    path = tmp_path / "large.npz"
    pool = LogicalHostPool(1 << 16, 16)
    with pool.recording(path):
        a = pool.alloc(4096)
        b = pool.alloc(8192)
        assert a is not None
        assert b is not None
        pool.free(b)
        pool.free(a)
    trace = T.load(path)
    assert [(op.name, op.arg, op.result) for op in trace.operations] == [
        ("alloc", 4096, 4096),
        ("alloc", 8192, 8192),
        ("free", 8192, 8192),
        ("free", 4096, 4096),
    ]
    assert R.replay(trace) == (4, 0, None)


@pytest.mark.parametrize("need", [-(2**63), 2**63 - 1])
def test_the_int64_extremes_are_recorded_as_numbers(tmp_path: Path, need: int) -> None:
    path = tmp_path / "edge.npz"
    pool = LogicalHostPool(64, 16)
    with pool.recording(path), pytest.raises(HostPoolError):
        pool.alloc(need)
    (op,) = T.load(path).operations
    assert (op.arg, op.unreadable, op.error) == (need, False, "AlignmentError" if need % 16 else "HostPoolError")


@pytest.mark.parametrize("form", ["list", "tuple"])
def test_frees_of_python_sequences_are_recorded_as_numbers(tmp_path: Path, form: str) -> None:
    path = tmp_path / "seq.npz"
    pool = LogicalHostPool(64, 16)
    with pool.recording(path):
        slots = pool.alloc(32)
        assert slots is not None
        pool.free(list(slots.tolist()) if form == "list" else tuple(slots.tolist()))
    op = T.load(path).operations[1]
    assert (op.name, op.unreadable, op.arg) == ("free", False, 32)
    assert op.slots is not None
    assert op.slots.tolist() == slots.tolist()


def test_uint64_sizes_below_2_63_are_recorded_as_numbers(tmp_path: Path) -> None:
    path = tmp_path / "u64.npz"
    pool = LogicalHostPool(64, 16)
    with pool.recording(path):
        assert pool.alloc_many(np.array([16, 2**62], dtype=np.uint64)) is None
    (op,) = T.load(path).operations
    assert op.unreadable is False
    assert op.sizes is not None
    assert op.sizes.tolist() == [16, 2**62]


# -- timing a trace (python -m hostpool_nb.replay --time) ------------------------------------------


def test_replay_time_times_the_pool_and_the_original(tmp_path: Path, capsys: Any) -> None:
    path = small_trace(tmp_path / "t.npz")
    assert R.main([str(path), "--time", "--repeats", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("all 5 operations match")
    assert out[1].strip().startswith("hostpool_nb:")
    assert re.search(
        r": +[0-9.]+ (µs|ns|ms) per operation \(median of 2, [0-9.]+ (µs|ns|ms)-[0-9.]+ (µs|ns|ms)\)$", out[1]
    )
    assert out[2].strip().startswith("original on numpy:")
    assert re.search(r" per operation \(median of 2, .*\): [0-9.,]+x numpy \(repeats [0-9.,]+x-[0-9.,]+x\)$", out[2])
    timed = [line.split("original on ")[1].split(":")[0] for line in out if "original on " in line]
    legend = ", ".join(f"x {name}" for name in timed)  # only the originals timed: torch's only with torch
    assert f"  {legend} = the original's time / hostpool_nb's (above 1x: hostpool_nb is faster)" in out


@pytest.mark.parametrize(
    ("ours", "theirs", "said"),
    [
        ([1.0, 1.0, 1.0], [2.0, 2.1, 2.05], None),
        ([1.0, 1.0, 1.0], [0.8, 1.1, 1.4], "fall either side of 1x: they cannot say which is faster"),
        ([1.0, 1.0, 1.0], [1.5, 2.0, 2.5], "spread 1.67-fold: the ratio is only known to lie between 1.5x and 2.5x"),
    ],
)
def test_replay_time_says_when_its_repeats_spread_too_wide(ours: list[float], theirs: list[float], said: Any) -> None:
    """One trace said 0.79x, 1.11x and 1.36x in three runs, each printing only its median."""
    timing = R.TraceTiming(
        {"hostpool_nb": float(np.median(ours)), "numpy": float(np.median(theirs))},
        {"hostpool_nb": ours, "numpy": theirs},
        ["timed"],
    )
    lines = report.timing_lines(timing, 3)
    low, high = min(theirs), max(theirs)
    assert f"(repeats {report.shown_ratio(low)}-{report.shown_ratio(high)})" in lines[1]
    if said is None:
        assert not any("narrow it" in line for line in lines)
    else:
        assert any(said in line for line in lines), lines


def test_a_sorted_pool_is_timed_alone_and_says_why(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16, merge="sorted")
    path = tmp_path / "t.npz"
    with pool.recording(path):
        pool.free(pool.alloc(32))
    timing = R.time_trace(T.load(path), repeats=1, with_torch=False)
    assert list(timing.per_op) == ["hostpool_nb"]
    assert (
        timing.notes[1]
        == "the original algorithm is not timed: the pool merges 'sorted'; the original merges in FIFO order only"
    )


def test_the_original_replays_a_free_group_at_its_end(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        held = pool.alloc(48)
        with pool.free_group():
            pool.free(held[:16])
            assert pool.alloc(16) is not None  # the pending page is not handed out in the group
        assert pool.alloc(16) is not None  # it is now
    trace = T.load(path)
    steps = R._original_steps(trace, lambda a: a)
    assert [(code, op.name) for code, _, op in steps] == [(0, "alloc"), (0, "alloc"), (1, "free"), (0, "alloc")]
    timing = R.time_trace(trace, repeats=1, with_torch=False)  # the original gives the recorded slots
    assert set(timing.per_op) == {"hostpool_nb", "numpy"}


def test_replay_time_refuses_zero_repeats(tmp_path: Path, capsys: Any) -> None:
    path = small_trace(tmp_path / "t.npz")
    with pytest.raises(SystemExit) as info:
        R.main([str(path), "--time", "--repeats", "0"])
    assert info.value.code == 2
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


# -- what replay builds: the recorded kind, within a memory bound, from the state the recording began in ----------


def test_a_trace_of_a_pool_kind_replay_does_not_build_is_exit_2(tmp_path: Path, capsys: Any) -> None:
    good = small_trace(tmp_path / "good.npz")
    header = arrays(good)["header"].copy()
    header["pool"] = "HostPagePool"
    bad = rewrite(good, tmp_path / "host.npz", header=header)
    builds = ", ".join(R.REPLAYS)
    with pytest.raises(T.TraceError) as info:
        R.replay(T.load(bad))
    assert str(info.value) == f"it records a HostPagePool; replay builds {builds} only"
    code, out, err = run_main(bad, capsys)
    assert (code, out) == (2, "")
    why = f"it records a HostPagePool; replay builds {builds} only"
    assert err == f"{PROG}: error: {bad}: cannot build the recorded pool: {why}\n"


def test_a_trace_of_a_huge_pool_is_refused_with_what_it_would_need(tmp_path: Path, capsys: Any) -> None:
    good = small_trace(tmp_path / "good.npz")
    header = arrays(good)["header"].copy()
    header["size"], header["page_size"] = 2**31 - 1, 1  # 2**31 - 1 pages, from a file of a kilobyte
    bad = rewrite(good, tmp_path / "huge.npz", header=header)
    assert bad.stat().st_size < 4096
    need = R.pool_bytes(T.load(bad))
    assert need > 2**33  # about 10 GiB of metadata
    code, out, err = run_main(bad, capsys)
    assert (code, out) == (2, "")
    assert f"needs {need:,} bytes to replay, more than the {R.MAX_POOL_BYTES:,} allowed; raise --max-pool-bytes" in err
    assert err.count("\n") == 1
    # The bound is the caller's: a small trace refused under a smaller one, replayed under the default.
    assert R.main([str(good), "--max-pool-bytes", "100"]) == 2
    assert "more than the 100 allowed" in capsys.readouterr().err
    assert R.main([str(good)]) == 0


def test_a_trace_whose_allocation_returns_more_than_the_bound_is_refused(tmp_path: Path, capsys: Any) -> None:
    """The pool's state is small (16K pages of 64 slots), the array its one alloc returns is not (8 MB)."""
    path = tmp_path / "big.npz"
    pool = LogicalHostPool(1 << 20, 64)
    with pool.recording(path):
        pool.free(pool.alloc(1 << 20))
    trace = T.load(path)
    bound = R.pool_bytes(trace) + 1000  # the pool fits; its allocation's result does not
    assert bound < 8 << 20
    code, out, err = run_main(path, capsys, "--max-pool-bytes", str(bound))
    assert (code, out) == (2, "")
    assert (
        f"operation 0 (alloc) returned 1,048,576 slots: replaying it takes 8,388,608 bytes, more than the {bound:,}"
        in err
    )
    assert err.count("\n") == 1
    assert R.main([str(path)]) == 0  # under the default bound it replays


def test_readmes_recording_example_replays_as_written(tmp_path: Path, capsys: Any) -> None:
    """The allocation happens before the recording: the trace starts from the pool the block found."""
    path = tmp_path / "serve.trace"
    pool = LogicalHostPool(size=1 << 16, page_size=64, track=True)
    held = pool.alloc(128, tag="request 7")
    with pool.recording(path):
        pool.free(held)
    trace = T.load(path)
    assert trace.start is not None
    assert not trace.start.fresh
    assert R.replay(trace) == (1, 0, None)
    assert R.main([str(path), "--time", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "the one operation matches" in out
    assert "original on numpy" in out  # the original is timed from the same start
    R.MIN_TIMED = 100  # as a user runs it (the fixture puts it back): one call is too few to time
    assert R.main([str(path), "--time", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == [
        "  not timed: 1 operation is too few to time (a pool's first calls, on memory not touched yet, would be "
        "most of it); record a stretch of 100 or more"
    ]


@pytest.mark.parametrize("merge", ["fifo", "sorted"])
@pytest.mark.parametrize("track", [False, True])
def test_a_recording_begun_mid_life_replays_every_result(merge: str, track: bool, tmp_path: Path) -> None:
    pool = LogicalHostPool(16 * 8, 16, merge=merge, track=track)
    a, b, c = pool.alloc(48), pool.alloc(32), pool.alloc(16)
    pool.free(a[16:32])  # on the release list when the recording begins
    pool.free_group_begin()
    pool.free(c)  # pending, in an open group
    path = tmp_path / "mid.npz"
    with pool.recording(path):
        pool.free_group_end()
        got = pool.alloc(16 * 4)  # needs the released and pending pages: a merge, in the pool's order
        assert got is not None
        pool.free(b)
        with pytest.raises(DoubleFreeError):
            pool.free(b)
        pool.free(got)
    trace = T.load(path)
    assert trace.start is not None
    assert (trace.start.group_depth, trace.start.pending.tolist()) == (1, [5])
    assert (trace.start.free.tolist(), trace.start.released.tolist()) == ([6, 7], [1])
    assert R.replay(trace) == (5, 0, None)
    assert R.time_trace(trace, repeats=1).per_op["hostpool_nb"] > 0


def test_a_version_1_trace_replays_from_a_fresh_pool(tmp_path: Path) -> None:
    good = small_trace(tmp_path / "good.npz")
    old = as_version(good, tmp_path / "v1.npz", 1)
    trace = T.load(old)
    assert trace.start is None
    assert R.replay(trace) == (5, 0, None)
    # A version 1 trace has no start; a version 2 one must.
    with pytest.raises(T.TraceError, match="a version 2 trace, it has no 'start' array"):
        T.load(as_version(good, tmp_path / "v2.npz", 2, start=None))


def test_a_version_2_trace_replays_as_recorded(tmp_path: Path) -> None:
    good = small_trace(tmp_path / "good.npz")
    trace = T.load(as_version(good, tmp_path / "v2.npz", 2))
    assert [as_tuple(op) for op in trace.operations] == [as_tuple(op) for op in T.load(good).operations]
    assert {op.rank for op in trace.operations} == {0}
    assert (trace.dp_size, trace.strict, trace.debug_mode) == (1, False, False)
    assert R.replay(trace) == (5, 0, None)


@pytest.mark.parametrize("version", [2, 3])
def test_a_header_of_another_versions_fields_is_damage(version: int, tmp_path: Path) -> None:
    good = small_trace(tmp_path / "good.npz")
    if version == 3:  # version 3's number on version 2's fields
        bad = as_version(good, tmp_path / "bad.npz", 2)
        header = arrays(bad)["header"].copy()
        header["version"] = 3
        rewrite(bad, bad, header=header)
    else:  # version 2's number on version 3's fields
        header = arrays(good)["header"].copy()
        header["version"] = 2
        bad = rewrite(good, tmp_path / "bad.npz", header=header)
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert (
        str(info.value) == f"{bad} is damaged: a version {version} trace, its header has the fields of another version"
    )


@pytest.mark.parametrize(
    ("start", "problem"),
    [
        ([0, 3, 0, 0, 0, 1], "its start state lists 2 pages as 3 free"),
        ([0, 2, 0, 0, 0, 9], "its start state lists a page outside the pool's 4"),
        ([0, 2, 0, 0, 1, 1], "its start state lists a page twice"),
        ([0, 1, 0, 1, 0, 1], "its start state has pending pages outside a free group"),
        ([0, 1], "its start array is not a pool's state"),
    ],
    ids=["counts", "range", "twice", "pending", "short"],
)
def test_a_damaged_start_state_is_a_trace_error(start: list[int], problem: str, tmp_path: Path) -> None:
    good = small_trace(tmp_path / "good.npz")
    bad = rewrite(good, tmp_path / "bad.npz", start=np.array(start, dtype=np.int64))
    with pytest.raises(T.TraceError, match=re.escape(problem)):
        T.load(bad)


def test_a_start_state_the_pool_cannot_be_in_is_a_trace_error(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16, merge="sorted")
    path = tmp_path / "t.npz"
    with pool.recording(path):
        pool.free(pool.alloc(32))
    bad = rewrite(path, tmp_path / "bad.npz", start=np.array([0, 2, 0, 0, 3, 1], dtype=np.int64))
    with pytest.raises(T.TraceError, match="the trace's start state is not one the recorded pool can be in"):
        R.replay(T.load(bad))  # a sorted pool's free list descending


def test_a_restore_of_the_snapshot_after_the_last_one_taken_is_damage(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        pool.restore_state(pool.backup_state())
    got = arrays(path)
    got["ops"]["arg"][1] = 1  # exactly as many snapshots were taken before it: snapshot 1 does not exist
    bad = rewrite(path, tmp_path / "bad.npz", ops=got["ops"])
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert str(info.value) == f"{bad} is damaged: operation 1 (restore) names snapshot 1, of 1 taken before it"


_FORK_IN_BLOCK = """
import json, os, sys
from hostpool_nb import LogicalHostPool
pool = LogicalHostPool(1024, 16)
path = json.loads(sys.argv[1])["path"]
import time
with pool.recording(path):
    pool.alloc(16)
    pid = os.fork()
    if pid == 0:
        pool.alloc(16)
        pool.alloc(16)
        time.sleep(1)  # the parent's block ends first
        sys.exit(0)  # leaves the block in the child: its calls are not the parent's trace
    pool.alloc(32)
os.waitpid(pid, 0)
print(json.dumps({"ok": True}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_child_forked_inside_a_recording_block_does_not_write_the_parents_trace(tmp_path: Path) -> None:
    from tests.conftest import run_child

    path = tmp_path / "t.npz"
    assert run_child(_FORK_IN_BLOCK, {"path": str(path)}, timeout=120) == {"ok": True}
    trace = T.load(path)
    assert [(op.name, op.arg) for op in trace.operations] == [("alloc", 16), ("alloc", 32)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]  # no temporary file of the child's left


def test_a_trace_gets_the_permissions_a_new_file_gets(tmp_path: Path) -> None:
    """Traces are handed to others: not 0600 (a temporary file's), but what the umask gives a new file."""
    umask = os.umask(0o022)
    try:
        pool = LogicalHostPool(1024, 16)
        with pool.recording(tmp_path / "t.npz"):
            pool.alloc(16)
    finally:
        os.umask(umask)
    assert (tmp_path / "t.npz").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("where", ["alloc", "free"])
def test_timing_checks_every_answer_of_the_original_against_the_record(where: str, tmp_path: Path) -> None:
    """Before the original algorithm is timed on a trace, each of its allocations and frees is compared with the
    record: one that answers otherwise is where its timing stops, said with the operation."""
    pool = LogicalHostPool(256, 16)
    with pool.recording(tmp_path / "t.trace"):
        held = [pool.alloc(32) for _ in range(4)]
        for slots in held[::-1]:
            pool.free(slots)
        pool.alloc(64)
    trace = T.load(tmp_path / "t.trace")
    steps = R._original_steps(trace, lambda a: a)
    assert R._check_original(R._original_at_start(trace, "numpy"), steps, "numpy") is None
    original = R._original_at_start(trace, "numpy")
    calls = {"alloc": 0, "free": 0}

    def answer(name: str, real: Any) -> Any:
        def call(arg: Any) -> Any:
            calls[name] += 1
            got = real(arg)
            if name == where and calls[name] == 3:  # the third call answers otherwise
                return got[::-1].copy() if name == "alloc" else got + 1
            return got

        return call

    original.alloc, original.free = answer("alloc", original.alloc), answer("free", original.free)
    index, said = R._check_original(original, steps, "numpy")  # type: ignore[misc]
    at = [op.index for op in trace.operations if op.name == where][2]
    assert index == at
    assert said.startswith(f"the original (numpy) diverges at operation {at} ({where})")


# -- version 4: runs, compressed; the calls that change nothing; how arguments came ---------------------


def test_a_version_3_trace_replays_as_recorded(tmp_path: Path) -> None:
    good = small_trace(tmp_path / "good.npz")
    old = as_version(good, tmp_path / "v3.npz", 3)
    assert arrays(old)["data"].dtype == np.dtype("<i8")  # stored as it is, as version 3 stored it
    trace = T.load(old)
    assert [as_tuple(op) for op in trace.operations] == [as_tuple(op) for op in T.load(good).operations]
    assert {op.kind for op in trace.operations} == {"int64 array"}
    assert R.replay(trace) == (5, 0, None)


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40), st.lists(st.integers(1, 5), max_size=8))
def test_runs_hold_any_numbers_exactly(numbers: list[int], stretches: list[int]) -> None:
    """Runs (first less the last run's end, length) give back any int64 numbers, wrapping at either end."""
    for n in stretches:  # and stretches that count up, across int64's end too
        numbers += [(numbers[-1] if numbers else 2**63 - 3) + k for k in range(1, n + 1)]
    x = ((np.array(numbers, dtype=object) + 2**63) % 2**64 - 2**63).astype(np.int64)
    runs = T._runs_of(x)
    assert int(runs[1::2].sum()) == x.shape[0]
    assert T._expanded("where", "data", T._pack_runs(runs), x.shape[0]).tolist() == x.tolist()


def _kv_workload(pool: LogicalHostPool, calls: int, seed: int) -> None:
    """The KV-cache workload a trace's size is judged on: allocations of 64 to 2,496 slots, random frees."""
    rng = np.random.default_rng(seed)
    held: list[Any] = []
    for _ in range(calls):
        if held and (rng.random() < 0.45 or pool.available_size() < 2496 + pool.page_size):
            j = int(rng.integers(len(held)))
            held[j], held[-1] = held[-1], held[j]
            pool.free(held.pop())
        else:
            slots = pool.alloc(max(int(rng.integers(64, 2497)) // pool.page_size, 1) * pool.page_size)
            if slots is not None:
                held.append(slots)


MOST_BYTES_A_CALL = 330  # what a trace may cost a call on that workload (a version 3 trace: 10 to 13 KB)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_a_trace_of_a_kv_cache_workload_costs_at_most_330_bytes_a_call(page_size: int, tmp_path: Path) -> None:
    pool = LogicalHostPool(1 << 20, page_size)
    path = tmp_path / "kv.trace"
    with pool.recording(path):
        _kv_workload(pool, 3000, seed=page_size)
    trace = T.load(path)
    assert len(trace) == 3000 + sum(op.name == "available_size" for op in trace.operations)
    assert path.stat().st_size / 3000 <= MOST_BYTES_A_CALL
    assert R.replay(trace)[2] is None  # and it still replays exactly


def test_the_calls_that_change_nothing_are_recorded_and_compared(tmp_path: Path, capsys: Any) -> None:
    pool = LogicalHostPool(64, 16)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        held = pool.alloc(32)
        assert pool.available_size() == 32
        pool.free(held)
    trace = T.load(path)
    assert [(op.name, op.result) for op in trace.operations] == [("alloc", 32), ("available_size", 32), ("free", 32)]
    assert R.replay(trace) == (3, 0, None)
    got = arrays(path)
    got["ops"]["result"][1] = 48
    bad = rewrite(path, tmp_path / "bad.npz", ops=got["ops"])
    assert R.main([str(bad)]) == 1
    assert "DIVERGES at operation 1 (available_size): expected 48, got 32" in capsys.readouterr().out


def test_each_argument_is_replayed_as_it_was_given(tmp_path: Path) -> None:
    """Lists, int32 arrays and int64 arrays are recorded as such, and replay gives them so."""
    from hostpool_nb.paged import PagedTokenToKVPoolAllocator

    a = PagedTokenToKVPoolAllocator(256, 4, None)
    path = tmp_path / "t.npz"
    with a.recording(path):
        out = a.alloc_extend([0, 0], [6, 3], [-1, -1], 9)
        assert out is not None
        a.free(out[:6].astype(np.int32))
        a.free(np.array(out[6:], dtype=np.int64))
        assert a.free((20, 21)) == 0  # a tuple of slots on free pages, as the original ignores them
    trace = T.load(path)
    assert [op.kind for op in trace.operations] == ["list", "int32 array", "int64 array", "other"]
    plan = R._ranked_plan(trace, True, None)
    given = [args[0] for _, args, _ in plan]
    assert type(given[0]) is list
    assert given[1].dtype == np.int32
    assert given[2].dtype == np.int64
    assert R.replay(trace) == (4, 0, None)


def _packed_damage(good: Path, tmp_path: Path, case: str) -> tuple[Path, str]:
    stored = {k: v.copy() for k, v in np.load(good).items()}
    bad = tmp_path / f"{case}.npz"
    where = f"{bad} is damaged"
    if case == "not-zlib":
        stored["data"] = np.frombuffer(b"not zlib at all", dtype=np.uint8)
        text = f"{where}: its 'data' array cannot be decompressed (Error -3 while decompressing data: "
        text += "incorrect header check)"
    elif case == "runs-short":
        stored["data"] = T._pack_runs(np.array([0, 31], dtype=np.int64))
        text = f"{where}: its 'data' array's runs hold 31 numbers, not the 32 numbers its header declares"
    elif case == "empty-run":
        stored["data"] = T._pack_runs(np.array([0, 32, 5, 0], dtype=np.int64))
        text = f"{where}: its 'data' array holds a run of 0 numbers"
    elif case == "bomb":  # a stream that inflates past what the header declares: never inflated whole
        stored["data"] = np.frombuffer(zlib.compress(bytes(1 << 24)), dtype=np.uint8)
        text = f"{where}: its 'data' array holds more than its header declares, or is cut short"
    elif case == "ops-not-bytes":
        stored["ops"] = np.zeros(3, dtype=np.int64)
        text = f"{where}: its 'ops' array is not the compressed bytes a version 4 trace holds"
    elif case == "messages-not-a-list":
        stored["messages"] = np.frombuffer(zlib.compress(b'{"a": 1}\n'), dtype=np.uint8)
        text = f"{where}: its 'messages' array is not a text a line"
    else:
        raise AssertionError(case)
    np.savez(bad, **stored)
    return bad, text


@pytest.mark.parametrize(
    "case", ["not-zlib", "runs-short", "empty-run", "bomb", "ops-not-bytes", "messages-not-a-list"]
)
def test_a_damaged_version_4_trace(case: str, tmp_path: Path, capsys: Any) -> None:
    bad, text = _packed_damage(small_trace(tmp_path / "good.npz"), tmp_path, case)
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert str(info.value) == text
    assert run_main(bad, capsys) == (2, "", f"{PROG}: error: {text}\n")
