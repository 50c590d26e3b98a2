"""Every misuse in the table of docs/behaviour.md, section 1, and the inputs that are fine.

Each bad call must raise the documented type, with a message naming the
offending value, and leave the pool's state exactly as it was. Setup for the
free cases: size 64, page_size 16; pages 0 and 1 held by the caller, page 2
freed (on the release list), page 3 never allocated.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np
import pytest

from hostpool_nb import (
    AlignmentError,
    DoubleFreeError,
    HostPoolError,
    LogicalHostPool,
    PartialPageError,
    SlotRangeError,
)
from hostpool_nb._core import pool as _pool
from hostpool_nb._kernels import layout as L

PS = 16
SIZE = 64


def page(p: int) -> list[int]:
    return list(range(p * PS, (p + 1) * PS))


@pytest.fixture
def pool() -> LogicalHostPool:
    pool = LogicalHostPool(SIZE, PS)
    held = pool.alloc(3 * PS)
    assert held is not None
    assert held.tolist() == page(0) + page(1) + page(2)
    assert pool.free(held[2 * PS :]) == PS
    assert pool.available_size() == 2 * PS
    return pool


def exact(text: str) -> str:
    return "^" + re.escape(text) + "$"


def assert_names(message: str, needles: list[str]) -> None:
    """Each needle is in ``message``: a substring, or a regex if it starts with ``^``."""
    for needle in needles:
        if needle.startswith("^"):
            assert re.search(needle, message), message
        else:
            assert needle in message, message


def test_error_hierarchy() -> None:
    assert issubclass(HostPoolError, ValueError)
    for cls in (AlignmentError, DoubleFreeError, PartialPageError, SlotRangeError):
        assert issubclass(cls, HostPoolError)
        assert issubclass(cls, ValueError)


class _Unconvertible:
    """An array-like whose conversion fails, as a meta-device tensor's does."""

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise RuntimeError("no data here")


class _Count:
    """Something with ``__index__``, as torch and JAX arrays have."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value})"


class _ArrayWithIndex(_Count):
    """A one-element array that also offers ``__index__`` (torch.tensor([[16]]))."""

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.array([[self.value]], dtype=dtype)


class _DlpackWithIndex(_Count):
    """An array known only by the DLPack protocol, plus ``__index__``."""

    def __dlpack__(self) -> Any:
        raise NotImplementedError


class _BrokenIndex:
    def __index__(self) -> int:
        raise RuntimeError("broken __index__")

    def __repr__(self) -> str:
        return "_BrokenIndex()"


# -- free -------------------------------------------------------------------

FREE_CASES = [
    # The table of docs/behaviour.md: the same page freed twice (page 2 was freed in the fixture).
    pytest.param(page(2), DoubleFreeError, ["page 2", "32..47", "not allocated"], id="double-free"),
    pytest.param(page(0) + page(0), DoubleFreeError, ["page 0", "0..15", "twice"], id="twice-in-one-call"),
    pytest.param(page(0) + page(1) + page(0), DoubleFreeError, ["page 0", "indices[32]"], id="twice-apart"),
    pytest.param(page(3), DoubleFreeError, ["page 3", "48..63"], id="never-allocated"),
    # A valid page first: its release must be rolled back.
    pytest.param(page(0) + page(3), DoubleFreeError, ["page 3", "indices[16]"], id="valid-then-unallocated"),
    # The table of docs/behaviour.md: slot outside [0, size).
    pytest.param(list(range(-PS, 0)), SlotRangeError, ["-16", "[0, 64)"], id="negative-slot"),
    pytest.param(list(range(SIZE, SIZE + PS)), SlotRangeError, ["64", "[0, 64)"], id="slot-at-size"),
    pytest.param(page(0) + [10**6 + j for j in range(PS)], SlotRangeError, ["1000000"], id="slot-far-out"),
    # Exact: "9223372036854775808" alone would also match "-9223372036854775808".
    pytest.param(
        np.full(PS, 2**63, dtype=np.uint64),
        SlotRangeError,
        [exact("free got slot 9223372036854775808 at indices[0] (flattened), outside the int64 range")],
        id="uint64-huge",
    ),
    pytest.param(
        np.array([*page(0), *([2**63 + 5] * PS)], dtype=np.uint64),
        SlotRangeError,
        [exact(f"free got slot {2**63 + 5} at indices[{PS}] (flattened), outside the int64 range")],
        id="uint64-huge-later",
    ),
    # 2**63 - 1 fits int64: an ordinary slot out of the pool's range, reported as such,
    # and a larger value after it is the first one beyond int64.
    pytest.param(
        np.full(PS, 2**63 - 1, dtype=np.uint64),
        SlotRangeError,
        [exact("free got slot 9223372036854775807 at indices[0] (flattened), outside [0, 64)")],
        id="uint64-int64-max",
    ),
    pytest.param(
        np.array([2**63 - 1] * PS + [2**63] * PS, dtype=np.uint64),
        SlotRangeError,
        [exact(f"free got slot 9223372036854775808 at indices[{PS}] (flattened), outside the int64 range")],
        id="uint64-max-then-huge",
    ),
    # -2**63 fits int64; the Python int after it does not.
    pytest.param(
        [-(2**63)] + [2**64] * (PS - 1),
        SlotRangeError,
        [exact(f"free got slot {2**64} at indices[1] (flattened), outside the int64 range")],
        id="int64-min-then-huge",
    ),
    # The table of docs/behaviour.md: 16 slots straddling two pages; partial and unordered pages.
    pytest.param(list(range(8, 24)), PartialPageError, ["slot 8", "page_size=16"], id="straddle"),
    pytest.param(page(0)[:8] + page(1)[:8], PartialPageError, ["slot 16", "expected 8"], id="two-half-pages"),
    pytest.param(page(0)[::-1], PartialPageError, ["slot 15"], id="reversed-page"),
    pytest.param([0, 2, 1, *page(0)[3:]], PartialPageError, ["slot 2", "expected 1", "page 0"], id="swapped"),
    pytest.param([*page(0)[:15], 15 + 100], PartialPageError, ["slot 115", "expected 15"], id="bad-last-slot"),
    pytest.param(page(1) + page(0)[1:] + [0], PartialPageError, ["indices[16]", "slot 1,"], id="rotated-second-page"),
    # Alignment of the flattened length, with sglang's exact message.
    pytest.param(
        page(0)[:8],
        AlignmentError,
        [exact("LogicalHostPool free must be page-aligned, got len(indices)=8, page_size=16")],
        id="misaligned-length",
    ),
    pytest.param(
        np.arange(24).reshape(2, 12),
        AlignmentError,
        [exact("LogicalHostPool free must be page-aligned, got len(indices)=24, page_size=16")],
        id="misaligned-2d",
    ),
    # Non-integer data : TypeError naming the dtype.
    pytest.param(np.arange(PS, dtype=np.float64), TypeError, ["float64"], id="float64"),
    pytest.param(np.arange(PS, dtype=np.float32), TypeError, ["float32"], id="float32"),
    pytest.param([float(s) for s in page(0)], TypeError, ["float64"], id="float-list"),
    pytest.param(np.ones(PS, dtype=bool), TypeError, ["bool"], id="bool"),
    pytest.param([True] * PS, TypeError, ["bool"], id="bool-list"),
    # numpy reads [0, True, 2, ...] as the int64 page 0: a bool among ints, in a list, tuple or nested list.
    pytest.param([0, True, *range(2, PS)], TypeError, ["a bool among them"], id="bool-among-ints"),
    pytest.param((0, np.True_, *range(2, PS)), TypeError, ["a bool among them"], id="numpy-bool-in-tuple"),
    pytest.param([[0, True, *range(2, PS)]], TypeError, ["a bool among them"], id="bool-in-nested-list"),
    pytest.param([0, np.array(True), *range(2, PS)], TypeError, ["a bool among them"], id="0d-bool-array-in-list"),
    pytest.param([[0], [np.array(False)]], TypeError, ["a bool among them"], id="0d-bool-array-nested"),
    pytest.param(np.arange(PS).astype(object), TypeError, ["object"], id="object"),
    pytest.param(np.array([str(s) for s in page(0)]), TypeError, ["<U2"], id="str-array"),
    pytest.param(np.arange(PS) + 0j, TypeError, ["complex128"], id="complex"),
    pytest.param(np.arange(PS).astype("timedelta64[s]"), TypeError, ["timedelta64"], id="timedelta"),
    pytest.param("0123456789abcdef", TypeError, ["str"], id="str"),
    pytest.param(b"0123456789abcdef", TypeError, ["bytes"], id="bytes"),
    # A bytearray would otherwise pass as uint8 slot ids, unlike bytes.
    pytest.param(bytearray(range(16)), TypeError, ["bytearray"], id="bytearray"),
    # Scalars and shapes numpy cannot make an array of.
    pytest.param(0, TypeError, ["scalar 0"], id="int-scalar"),
    pytest.param(np.int64(5), TypeError, ["scalar", "5"], id="numpy-scalar"),
    pytest.param(np.array(7), TypeError, ["scalar", "7"], id="0d-array"),
    pytest.param(None, TypeError, ["None"], id="none"),
    pytest.param([page(0), page(1)[:3]], TypeError, ["list"], id="ragged"),
    # A masked array would otherwise free its masked entries too.
    pytest.param(np.ma.array(page(0), mask=[False] * 15 + [True]), TypeError, ["masked", "compressed()"], id="masked"),
    # Whatever an __array__ raises is the caller's argument failing to convert.
    pytest.param(_Unconvertible(), TypeError, ["_Unconvertible", "no data here"], id="array-raises"),
]


@pytest.mark.parametrize(("indices", "error", "needles"), FREE_CASES)
def test_bad_free(
    pool: LogicalHostPool, indices: Any, error: type, needles: list[str], snapshot: Any, unchanged: Any
) -> None:
    before = snapshot(pool)
    available = pool.available_size()
    with pytest.raises(error) as info:
        pool.free(indices)
    assert type(info.value) is error
    if issubclass(error, HostPoolError):
        assert isinstance(info.value, ValueError)
    assert_names(str(info.value), needles)
    unchanged(pool, before)
    assert pool.available_size() == available
    # The held pages are still held: freeing them now works.
    assert pool.free(page(0) + page(1)) == 2 * PS
    assert pool.available_size() == SIZE


def test_free_after_clear(pool: LogicalHostPool, snapshot: Any, unchanged: Any) -> None:
    pool.clear()
    assert pool.available_size() == SIZE
    before = snapshot(pool)
    for p in range(SIZE // PS):  # held, released and never-allocated pages alike
        with pytest.raises(DoubleFreeError, match=rf"page {p} \(slots {p * PS}\.\.{p * PS + PS - 1}\)"):
            pool.free(page(p))
        unchanged(pool, before)
    # clear() restored ascending order.
    assert pool.alloc(SIZE).tolist() == list(range(SIZE))


def test_free_python_ints_beyond_int64_are_range_errors(pool: LogicalHostPool, snapshot: Any, unchanged: Any) -> None:
    """Out-of-range slots given as Python ints are a SlotRangeError, whatever their size.

    Like ``np.full(16, 2**63, dtype=np.uint64)`` (a SlotRangeError naming the
    slot), a list holding a slot beyond the int64 range is a slot outside
    ``[0, size)`` (a ValueError subclass).
    """
    # The last list mixes signs: numpy infers float64 for it, but every entry
    # is a Python int, and the first slot is out of range.
    for bad in ([2**64] * PS, [-(2**63) - 1] * PS, [2**63] * PS, [2**63] + [-1] * (PS - 1)):
        before = snapshot(pool)
        with pytest.raises(SlotRangeError) as info:
            pool.free(bad)
        assert str(info.value) == f"free got slot {bad[0]} at indices[0] (flattened), outside the int64 range"
        unchanged(pool, before)
    # numpy ints beside one Python int beyond int64: dtype object, same error.
    mixed = [np.int64(1)] * (PS - 1) + [2**64]
    before = snapshot(pool)
    with pytest.raises(SlotRangeError, match=rf"{2**64} at indices\[{PS - 1}\]"):
        pool.free(mixed)
    unchanged(pool, before)


# -- alloc ----------------------------------------------------------------------

ALLOC_CASES = [
    # The table of docs/behaviour.md: alloc(-16) with page 16, size 64 corrupted the original.
    pytest.param(-16, HostPoolError, ["need_size=-16"], id="negative-aligned"),
    pytest.param(-(2**70), HostPoolError, [str(-(2**70))], id="negative-huge"),
    pytest.param(
        -8,
        AlignmentError,
        [exact("LogicalHostPool allocation must be page-aligned, got need_size=-8, page_size=16")],
        id="negative-misaligned",
    ),
    pytest.param(
        8,
        AlignmentError,
        [exact("LogicalHostPool allocation must be page-aligned, got need_size=8, page_size=16")],
        id="misaligned",
    ),
    pytest.param(
        SIZE + 8,
        AlignmentError,  # alignment is checked before capacity
        [exact("LogicalHostPool allocation must be page-aligned, got need_size=72, page_size=16")],
        id="misaligned-over-capacity",
    ),
    pytest.param(16.0, TypeError, ["need_size", "16.0"], id="float"),
    pytest.param(np.float64(16), TypeError, ["need_size", "16.0"], id="numpy-float"),
    pytest.param("16", TypeError, ["need_size", "'16'"], id="str"),
    pytest.param(None, TypeError, ["need_size", "None"], id="none"),
    pytest.param(True, TypeError, ["need_size", "True"], id="bool"),
    pytest.param(np.bool_(True), TypeError, ["need_size", "True"], id="numpy-bool"),
    pytest.param(np.array(16), TypeError, ["need_size", "array(16)"], id="0d-array"),
    pytest.param([16], TypeError, ["need_size", "[16]"], id="list"),
    pytest.param(16 + 0j, TypeError, ["need_size", "16+0j"], id="complex"),
    # Arrays of any library are refused even when their __index__ would
    # read a one-element array as a count (torch.tensor([[16]]) does).
    pytest.param(np.array([[16]]), TypeError, ["need_size", "array([[16]])"], id="2d-array"),
    pytest.param(_ArrayWithIndex(16), TypeError, ["need_size", "_ArrayWithIndex(16)", "int(x)"], id="array-like-index"),
    pytest.param(_DlpackWithIndex(16), TypeError, ["need_size", "_DlpackWithIndex(16)"], id="dlpack-index"),
    pytest.param(_BrokenIndex(), TypeError, ["need_size", "_BrokenIndex()"], id="index-raises"),
]


@pytest.mark.parametrize(("need", "error", "needles"), ALLOC_CASES)
def test_bad_alloc(
    pool: LogicalHostPool, need: Any, error: type, needles: list[str], snapshot: Any, unchanged: Any
) -> None:
    before = snapshot(pool)
    with pytest.raises(error) as info:
        pool.alloc(need)
    assert type(info.value) is error
    assert_names(str(info.value), needles)
    unchanged(pool, before)


@pytest.mark.parametrize("need", [SIZE, 3 * PS, 2**70], ids=["size", "available+16", "huge"])
def test_alloc_over_capacity_returns_none(pool: LogicalHostPool, need: int, snapshot: Any, refused: Any) -> None:
    before = snapshot(pool)
    assert pool.alloc(need) is None
    refused(pool, before)


def test_refused_huge_alloc_allocates_nothing(snapshot: Any, refused: Any, all_kernels: None) -> None:
    """A request the pool cannot serve is refused before its output is allocated.

    With 2**40 slots of 2**20 pages and one page held, ``alloc(2**40)`` once
    asked numpy for 8 TiB (a MemoryError) before checking capacity.
    """
    import tracemalloc

    pool = LogicalHostPool(2**40, 2**20)
    held = pool.alloc(2**20)
    assert held is not None
    before = snapshot(pool)
    needs = (2**40, 2**40 - 2**20 + 2**20, 2**39 * 2, 2**70)
    for times, need in enumerate(needs, 1):
        tracemalloc.start()
        try:
            assert pool.alloc(need) is None
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 16, f"a refused alloc({need}) allocated {peak} bytes"
        refused(pool, before, times)
    tracemalloc.start()
    try:
        assert pool.alloc_many([2**30, 2**40 - 2**30]) is None  # the batch total is refused alike
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 16, f"a refused alloc_many allocated {peak} bytes"
    refused(pool, before, len(needs) + 1)
    # A request that fits is still served.
    assert pool.alloc(2**20) is not None


@pytest.mark.parametrize("kind", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64])
def test_alloc_accepts_numpy_integers(pool: LogicalHostPool, kind: type) -> None:
    out = pool.alloc(kind(PS))
    # The FIFO order of docs/behaviour.md: the free list (page 3) before the release list (page 2).
    assert out is not None
    assert out.tolist() == page(3)
    assert pool.alloc(kind(PS)).tolist() == page(2)
    assert pool.available_size() == 0
    pool.check_invariants()


# -- constructor ----------------------------------------------------------------

CTOR_CASES = [
    # The table of docs/behaviour.md: page_size=0 was a ZeroDivisionError in the original.
    pytest.param(SIZE, 0, HostPoolError, ["page_size=0"], id="page-size-0"),
    pytest.param(SIZE, -1, HostPoolError, ["page_size=-1"], id="page-size-negative"),
    pytest.param(-16, PS, HostPoolError, ["size=-16"], id="size-negative"),
    pytest.param(-15, PS, HostPoolError, ["size=-15"], id="size-negative-misaligned"),
    pytest.param(-1, 1, HostPoolError, [exact("size must be non-negative, got size=-1")], id="size-minus-one"),
    pytest.param(
        20,
        PS,
        AlignmentError,
        [exact("LogicalHostPool size must be page-aligned, got size=20, page_size=16")],
        id="size-misaligned",
    ),
    pytest.param(
        1, 2, AlignmentError, [exact("LogicalHostPool size must be page-aligned, got size=1, page_size=2")], id="size-1"
    ),
    pytest.param(64.0, PS, TypeError, ["size", "64.0"], id="float-size"),
    pytest.param(SIZE, 16.0, TypeError, ["page_size", "16.0"], id="float-page-size"),
    pytest.param(True, 1, TypeError, ["size", "True"], id="bool-size"),
    pytest.param(SIZE, True, TypeError, ["page_size", "True"], id="bool-page-size"),
    pytest.param("64", PS, TypeError, ["size", "'64'"], id="str-size"),
    pytest.param(SIZE, None, TypeError, ["page_size", "None"], id="none-page-size"),
    pytest.param(np.array(64), PS, TypeError, ["size", "array(64)"], id="0d-array-size"),
    pytest.param(SIZE, np.float32(16), TypeError, ["page_size", "16.0"], id="numpy-float-page-size"),
]


@pytest.mark.parametrize(("size", "page_size", "error", "needles"), CTOR_CASES)
def test_bad_constructor(size: Any, page_size: Any, error: type, needles: list[str]) -> None:
    with pytest.raises(error) as info:
        LogicalHostPool(size, page_size)
    assert type(info.value) is error
    assert_names(str(info.value), needles)


def test_pool_too_large_to_address_is_a_host_pool_error() -> None:
    """numpy's "Maximum allowed dimension exceeded" would not say what is wrong."""
    for size, page_size in ((2**63 - 1, 1), (2**62, 2)):
        with pytest.raises(HostPoolError, match=rf"size={size}, page_size={page_size}\) is too large") as info:
            LogicalHostPool(size, page_size)
        assert type(info.value) is HostPoolError


def _no_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the pool's state allocation fail as numpy does when memory runs out."""

    def refuse(shape: Any, dtype: Any = None) -> Any:
        raise MemoryError(f"Unable to allocate {shape} words")

    monkeypatch.setattr(_pool.np, "zeros", refuse)


def test_pool_too_large_for_memory_is_a_memory_error_naming_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    # The largest pool allowed (2**31 - 1 pages) needs 10 GiB of metadata:
    # the allocation is made to fail rather than tried.
    _no_memory(monkeypatch)
    pages = L.MAX_PAGES
    words = L.state_length(pages)
    with pytest.raises(MemoryError) as info:
        LogicalHostPool(pages * 4, 4)
    assert str(info.value).startswith(
        f"LogicalHostPool(size={pages * 4}, page_size=4) needs {words * 8 / 2**30:.3g} GiB of metadata "
        f"for its {pages} pages (5 bytes per page): "
    )
    assert isinstance(info.value.__cause__, MemoryError)


def test_too_many_pages_is_decided_at_max_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring holds int32 page ids: 2**31 - 1 pages pass the check, one more is a HostPoolError."""
    _no_memory(monkeypatch)  # a pool that passes the check fails allocating, without taking 10 GiB
    for page_size in (1, 16, 3):
        with pytest.raises(MemoryError):
            LogicalHostPool(L.MAX_PAGES * page_size, page_size)
        size = (L.MAX_PAGES + 1) * page_size
        with pytest.raises(HostPoolError) as info:
            LogicalHostPool(size, page_size)
        assert type(info.value) is HostPoolError
        assert str(info.value) == (
            f"LogicalHostPool(size={size}, page_size={page_size}) is too large: it has {L.MAX_PAGES + 1} pages, "
            f"at most {L.MAX_PAGES} (2**31 - 1) are supported; use a larger page_size"
        )
    assert L.MAX_PAGES == 2**31 - 1


def test_too_large_is_decided_at_the_addressable_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the metadata cannot be addressed (a 32-bit platform), a HostPoolError says so.

    On 64 bits the page limit comes first, so the platform's limit is
    lowered to 2**31 - 1 (a 32-bit ``sys.maxsize``) to reach it.
    """
    monkeypatch.setattr(_pool, "sys", type("Sys32", (), {"maxsize": 2**31 - 1}))
    lo, hi = 1, L.MAX_PAGES  # state_length(pages) * 8 <= maxsize exactly for pages <= lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if L.state_length(mid) * 8 <= 2**31 - 1 else (lo, mid)
    _no_memory(monkeypatch)
    with pytest.raises(MemoryError):
        LogicalHostPool(lo, 1)
    with pytest.raises(HostPoolError) as info:
        LogicalHostPool(hi, 1)
    assert str(info.value) == (
        f"LogicalHostPool(size={hi}, page_size=1) is too large: its {hi} pages need "
        f"{L.state_length(hi) * 8} bytes of metadata (5 per page), more than this platform can address"
    )


def test_page_size_beyond_int64_is_a_value_error() -> None:
    """A page_size the pool cannot represent is caller misuse: ValueError, not OverflowError.

    docs/behaviour.md, section 2: misuse by the caller is ValueError/TypeError with the
    offending value in the message.
    """
    for size, page_size in ((0, 2**63), (2**63, 2**63)):
        with pytest.raises(ValueError, match=str(page_size)):
            LogicalHostPool(size, page_size)


def test_numpy_integer_constructor_arguments() -> None:
    pool = LogicalHostPool(np.int64(64), np.uint8(16))
    assert type(pool.size) is int
    assert type(pool.page_size) is int
    assert (pool.size, pool.page_size, pool.available_size()) == (64, 16, 64)


# -- inputs that are fine ----------------------------------------------------------


def test_2d_indices_free_whole_rows(pool: LogicalHostPool) -> None:
    """The table of docs/behaviour.md: shape (2, 16) is 32 slots, two pages, flattened in C order."""
    assert pool.alloc(2 * PS).tolist() == page(3) + page(2)  # now everything is held
    indices = np.array([page(3), page(0)])
    assert indices.shape == (2, PS)
    assert pool.free(indices) == 2 * PS
    assert pool.available_size() == 2 * PS
    pool.check_invariants()
    assert pool.alloc(2 * PS).tolist() == page(3) + page(0)  # release order = row order


@pytest.mark.parametrize(
    "dtype", ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", ">i8", ">u2"]
)
def test_any_integer_dtype(pool: LogicalHostPool, dtype: str) -> None:
    indices = np.array(page(1) + page(0), dtype=dtype)
    assert pool.free(indices) == 2 * PS
    assert pool.available_size() == SIZE
    pool.check_invariants()
    assert pool.alloc(SIZE).tolist() == page(3) + page(2) + page(1) + page(0)


@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_readonly_input(pool: LogicalHostPool, dtype: str) -> None:
    indices = np.array(page(1), dtype=dtype)
    indices.flags.writeable = False
    assert pool.free(indices) == PS
    assert indices.tolist() == page(1)
    pool.check_invariants()
    assert pool.available_size() == 3 * PS


def _layouts() -> list[Any]:
    rows = np.array([page(1), page(0)], dtype=np.int64)  # C-order flattening: page 1, page 0
    wide = np.zeros((2, 2 * PS), dtype=np.int64)
    wide[:, ::2] = rows
    unaligned = np.zeros(2 * PS * 8 + 1, dtype=np.uint8)[1:].view(np.int64)
    unaligned[:] = rows.reshape(-1)
    return [
        pytest.param(np.asfortranarray(rows), id="fortran"),
        pytest.param(np.ascontiguousarray(rows.T).T, id="transposed"),
        pytest.param(wide[:, ::2], id="strided"),
        pytest.param(np.ascontiguousarray(rows.reshape(-1)[::-1])[::-1], id="negative-stride"),
        pytest.param(rows.reshape(2, 4, 4), id="3d"),
        pytest.param(unaligned, id="unaligned"),
        pytest.param(tuple(rows.reshape(-1).tolist()), id="tuple"),
        pytest.param([np.int32(s) for s in rows.reshape(-1)], id="list-of-numpy-ints"),
    ]


@pytest.mark.parametrize("indices", _layouts())
def test_any_layout_flattened_in_c_order(pool: LogicalHostPool, indices: Any) -> None:
    assert pool.free(indices) == 2 * PS
    pool.check_invariants()
    # Released after page 2, in C order: page 1 then page 0.
    assert pool.alloc(SIZE).tolist() == page(3) + page(2) + page(1) + page(0)


class _HasArray:
    def __init__(self, values: list[int]) -> None:
        self.values = values

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.array(self.values, dtype=np.int16 if dtype is None else dtype)


def test_object_with_array_protocol(pool: LogicalHostPool) -> None:
    assert pool.free(_HasArray(page(0))) == PS
    pool.check_invariants()
    assert pool.available_size() == 3 * PS
    with pytest.raises(DoubleFreeError, match="page 0"):
        pool.free(_HasArray(page(0)))


@pytest.mark.parametrize(
    "empty",
    [[], (), [[]], np.empty(0, dtype=np.int64), np.empty((0, PS), dtype=np.int32), np.empty((3, 0), dtype=np.uint8)],
    ids=["list", "tuple", "nested-list", "int64", "2d-int32", "3x0-uint8"],
)
def test_empty_free_changes_nothing(pool: LogicalHostPool, empty: Any, snapshot: Any, unchanged: Any) -> None:
    before = snapshot(pool)
    assert pool.free(empty) == 0
    unchanged(pool, before)


def test_empty_float_array_is_still_a_type_error(pool: LogicalHostPool, snapshot: Any, unchanged: Any) -> None:
    before = snapshot(pool)
    with pytest.raises(TypeError, match="float64"):
        pool.free(np.empty(0))
    unchanged(pool, before)


@pytest.mark.parametrize("ps", [1, 3, PS])
def test_zero_size_pool(ps: int, snapshot: Any, unchanged: Any) -> None:
    pool = LogicalHostPool(0, ps)
    pool.check_invariants()
    assert pool.available_size() == 0
    out = pool.alloc(0)
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.int64
    assert out.shape == (0,)
    assert pool.alloc(ps) is None
    assert pool.free([]) == 0
    before = snapshot(pool)
    for slots in (np.arange(ps), np.arange(5000 * ps)):  # one page, and more than a block of pages
        with pytest.raises(SlotRangeError, match=r"free got slot 0 at indices\[0\] \(flattened\), outside \[0, 0\)"):
            pool.free(slots)
        unchanged(pool, before)
    pool.clear()
    pool.check_invariants()
    assert pool.available_size() == 0


# -- docs/behaviour.md, section 1: attributes and data-plane hooks ------------------------------------


@pytest.mark.parametrize("layout", [None, "page_first", ("any", "object")])
def test_attributes(layout: Any) -> None:
    pool = LogicalHostPool(SIZE, PS) if layout is None else LogicalHostPool(SIZE, PS, layout=layout)
    expected_layout = "layer_first" if layout is None else layout
    assert pool.layout == expected_layout
    assert (pool.size, pool.logical_size, pool.page_size) == (SIZE, SIZE, PS)
    assert pool.device == "cpu"
    assert isinstance(pool.dtype, np.dtype)
    assert pool.dtype == np.dtype(np.uint8)
    assert (pool.layer_num, pool.start_layer, pool.end_layer, pool.size_per_token) == (0, 0, 0, 0)
    for name in ("layer_num", "start_layer", "end_layer", "size_per_token"):
        assert type(getattr(pool, name)) is int
    assert pool.kv_buffer is None
    assert pool.allocator is None
    assert pool.can_use_write_back_jit is True
    assert type(pool.lock) is type(threading.RLock())
    # An RLock: the owner may take it again (a plain Lock would deadlock here).
    with pool.lock:
        assert pool.lock.acquire(blocking=False)
        pool.lock.release()
        assert pool.alloc(PS) is not None  # state changes re-enter the lock


def test_layout_keyword_positional() -> None:
    assert LogicalHostPool(SIZE, PS, "page_first").layout == "page_first"


def test_data_plane_hooks(pool: LogicalHostPool, snapshot: Any, unchanged: Any) -> None:
    before = snapshot(pool)
    slots = np.array(page(0))
    assert pool.backup_from_device_all_layer(object(), slots, slots, "kernel") is None
    assert pool.load_to_device_per_layer(object(), slots, slots, 0, "direct") is None
    assert pool.load_to_device_per_layer(object(), slots, slots, 3, "direct", is_draft=True) is None
    for data_page in (pool.get_data_page(0), pool.get_data_page(5, flat=False), pool.get_dummy_flat_data_page()):
        assert isinstance(data_page, np.ndarray)
        assert data_page.dtype == np.uint8
        assert data_page.size == 0
    assert pool.set_from_flat_data_page(0, np.empty(0, dtype=np.uint8)) is None
    assert pool.get_page_buffer_meta(slots) is None
    assert pool.get_ksize_per_token() == 0
    assert type(pool.get_ksize_per_token()) is int
    assert pool.destroy() is None
    unchanged(pool, before)


def test_the_hooks_of_later_sglang_revisions(pool: LogicalHostPool, snapshot: Any, unchanged: Any) -> None:
    """What a newer sglang's HostPoolGroup reads on every host pool, on the class and the instance."""
    before = snapshot(pool)
    for owner in (LogicalHostPool, pool):
        assert owner.shared_allocation_domain is None
        assert owner.stores_page_envelope is False
        assert owner.storage_format_tag is None
    host, device = np.array(page(0)), np.arange(PS, dtype=np.int32)
    pair = pool.prepare_transfer_indices(host, device, "kernel")
    assert type(pair) is tuple
    assert pair[0] is host
    assert pair[1] is device
    assert pool.backup_from_device_all_layer_physical(object(), host, device, "kernel") is None
    assert pool.load_to_device_per_layer_physical(object(), host, device, 2, "direct") is None
    assert pool.load_to_device_per_layer_physical(object(), host, device, 2, "direct", is_draft=True) is None
    assert pool.get_page_buffer_element_size() is None
    assert pool.get_page_buffer_element_size(split_factor=4) is None
    unchanged(pool, before)


# -- every error family at several page sizes, exact messages ---------------------


def _family_pool(ps: int) -> tuple[LogicalHostPool, int]:
    """Six pages: 0, 1, 3 and 4 held, 2 released, 5 free."""
    pool = LogicalHostPool(6 * ps, ps)
    held = pool.alloc(5 * ps)
    assert held is not None
    assert pool.free(held[2 * ps : 3 * ps]) == ps
    return pool, 6 * ps


def _pg(p: int, ps: int) -> list[int]:
    return list(range(p * ps, (p + 1) * ps))


def _text(p: int, ps: int) -> str:
    return f"page {p} (slots {p * ps}..{p * ps + ps - 1})"


def _free_family(ps: int) -> list[tuple[str, list[int], type, str]]:
    """(id, indices, error, exact message) for every way a free can fail at page size ``ps``."""
    size = 6 * ps
    not_alloc = "is not allocated: it was freed already, freed by clear(), or never allocated"
    cases = [
        (
            "range-low",
            [-1, *_pg(0, ps)[1:]],
            SlotRangeError,
            f"free got slot -1 at indices[0] (flattened), outside [0, {size})",
        ),
        (
            "range-high-after-valid",
            _pg(0, ps) + [size + j for j in range(ps)],
            SlotRangeError,
            f"free got slot {size} at indices[{ps}] (flattened), outside [0, {size})",
        ),
        ("released", _pg(2, ps), DoubleFreeError, f"{_text(2, ps)}, freed at indices[0] (flattened), {not_alloc}"),
        (
            "never-allocated",
            _pg(5, ps),
            DoubleFreeError,
            f"{_text(5, ps)}, freed at indices[0] (flattened), {not_alloc}",
        ),
        (
            "valid-then-free",
            _pg(3, ps) + _pg(5, ps),
            DoubleFreeError,
            f"{_text(5, ps)}, freed at indices[{ps}] (flattened), {not_alloc}",
        ),
        (
            "twice-in-one-call",
            _pg(0, ps) + _pg(1, ps) + _pg(0, ps),
            DoubleFreeError,
            f"{_text(0, ps)} is freed twice in one call (again at indices[{2 * ps}], flattened)",
        ),
        (
            "twice-adjacent",
            _pg(4, ps) + _pg(4, ps),
            DoubleFreeError,
            f"{_text(4, ps)} is freed twice in one call (again at indices[{ps}], flattened)",
        ),
    ]
    if ps > 1:
        whole = f"each run of {ps} entries must be one page's slots in ascending order"
        cases.extend(
            (
                f"misaligned-{first}",
                list(range(first, first + ps)),
                PartialPageError,
                f"free takes whole pages: indices[0] (flattened) is slot {first}, which is not the first "
                f"slot of a page (a multiple of page_size={ps}); {whole}",
            )
            for first in (1, ps - 1, ps + 1, 3 * ps + ps // 2)  # every offset class a mask could get wrong
            if first % ps
        )
        bad = _pg(1, ps)
        bad[-1] += 1
        cases += [
            (
                "partial-last",
                _pg(0, ps) + bad,
                PartialPageError,
                f"free takes whole pages: indices[{2 * ps - 1}] (flattened) is slot {bad[-1]}, expected "
                f"{bad[-1] - 1} to continue {_text(1, ps)} in ascending order",
            ),
            (
                "short",
                _pg(0, ps)[:-1],
                AlignmentError,
                f"LogicalHostPool free must be page-aligned, got len(indices)={ps - 1}, page_size={ps}",
            ),
        ]
    return cases


_FAMILY = [
    pytest.param(ps, indices, error, message, id=f"p{ps}-{name}")
    for ps in (1, 2, 3, 6, 16)
    for name, indices, error, message in _free_family(ps)
]


@pytest.mark.parametrize(("ps", "indices", "error", "message"), _FAMILY)
def test_free_error_families_at_every_page_size(
    ps: int, indices: list[int], error: type, message: str, snapshot: Any, unchanged: Any
) -> None:
    """Each failed check, at page sizes 1, 2, 3, 6 and 16, with its exact message and no change.

    Page sizes that are not powers of two (3, 6) take the division path of
    the kernels, page size 1 its own kernels; a message check at one page
    size alone would not see a bug in the others.
    """
    pool, size = _family_pool(ps)
    before = snapshot(pool)
    for form in (indices, np.array(indices, dtype=np.int64)):
        with pytest.raises(error) as info:
            pool.free(form)
        assert type(info.value) is error
        assert str(info.value) == message
        unchanged(pool, before)
    # Nothing was released on the way: the held pages can still be freed, once.
    assert pool.free(_pg(0, ps) + _pg(1, ps) + _pg(3, ps) + _pg(4, ps)) == 4 * ps
    assert pool.available_size() == size


@pytest.mark.parametrize("ps", [1, 2, 3, 6, 16])
def test_alloc_errors_at_every_page_size(ps: int, snapshot: Any, unchanged: Any, refused: Any) -> None:
    pool, _size = _family_pool(ps)
    before = snapshot(pool)
    with pytest.raises(HostPoolError) as info:
        pool.alloc(-ps)
    assert type(info.value) is HostPoolError
    assert str(info.value) == f"need_size must be non-negative, got need_size={-ps}"
    unchanged(pool, before)
    if ps > 1:
        for need in (1, ps + 1, 2 * ps - 1, -1):
            with pytest.raises(AlignmentError) as info:
                pool.alloc(need)
            assert str(info.value) == (
                f"LogicalHostPool allocation must be page-aligned, got need_size={need}, page_size={ps}"
            )
            unchanged(pool, before)
    assert pool.alloc(3 * ps) is None  # two pages available
    refused(pool, before)
    # FIFO: the free page 5, then the released page 2.
    assert pool.alloc(2 * ps).tolist() == _pg(5, ps) + _pg(2, ps)


# -- tags of a tracking pool -------------------------------------------------------


class _ReprRaises:
    def __hash__(self) -> int:
        return 3

    def __repr__(self) -> str:
        raise ZeroDivisionError("no repr")


class _HashRaises:
    def __hash__(self) -> int:
        raise ZeroDivisionError("no hash")


BAD_TAGS = [
    pytest.param(lambda: [1], "tag must be hashable, got list [1]", id="list"),
    pytest.param(lambda: {"a": 1}, "tag must be hashable, got dict {'a': 1}", id="dict"),
    pytest.param(
        lambda: memoryview(bytearray(b"ab")),
        "tag must be hashable, got memoryview <memory at",
        id="writable-memoryview",
    ),
    pytest.param(_HashRaises, "tag must be hashable, got _HashRaises <", id="hash-raises"),
    pytest.param(
        _ReprRaises,
        "tag must have a repr, got a _ReprRaises whose repr raised ZeroDivisionError('no repr')",
        id="repr-raises",
    ),
]


@pytest.mark.parametrize(("make_tag", "message"), BAD_TAGS)
@pytest.mark.parametrize("call", ["alloc", "alloc_many"])
def test_an_unusable_tag_is_a_type_error_before_anything_changes(
    make_tag: Any, message: str, call: str, snapshot: Any, unchanged: Any
) -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    held = pool.alloc(PS)
    assert held is not None
    before = snapshot(pool)
    table = pool._tracker.table()
    tag = make_tag()
    method = (lambda: pool.alloc(PS, tag=tag)) if call == "alloc" else (lambda: pool.alloc_many([PS, PS], tag=tag))
    with pytest.raises(TypeError) as info:
        method()
    assert type(info.value) is TypeError
    assert str(info.value).startswith(message)
    unchanged(pool, before)
    assert pool._tracker.table() == table


def _kernel_boundaries() -> list[int]:
    from hostpool_nb._core import pool as _pool
    from hostpool_nb._kernels import pool as _kernels
    from hostpool_nb._kernels import short as _short_kernels

    edges = (_short_kernels.SHORT_SLOTS, _kernels.GIL_SLOTS, _pool._PRECHECK_SLOTS)
    return sorted({n + d for n in edges for d in (0, 1)})


@pytest.mark.parametrize("merge", ["fifo", "sorted"])
@pytest.mark.parametrize("need", _kernel_boundaries())
def test_alloc_and_free_at_each_kernel_boundary(need: int, merge: str, snapshot: Any, refused: Any) -> None:
    """Either side of each length where ``alloc`` and ``free`` change kernel or check capacity first.

    Served in FIFO order (a sorted pool merges first), refused when one slot
    short with nothing changed but the counters, freed whole.
    """
    pool = LogicalHostPool(need, 1, merge=merge)
    first = pool.alloc(need)
    assert first is not None
    assert np.array_equal(first, np.arange(need))
    before = snapshot(pool)
    assert pool.alloc(1) is None
    refused(pool, before)
    assert pool.free(first[::-1].copy()) == need  # released in reverse: a sorted pool's merge puts them back in order
    before = snapshot(pool)
    assert pool.alloc(need + 1) is None
    refused(pool, before)
    again = pool.alloc(need)
    assert again is not None
    assert np.array_equal(again, np.arange(need) if merge == "sorted" else np.arange(need)[::-1])
    assert pool.available_size() == 0
    pool.check_invariants()
