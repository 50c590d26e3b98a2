"""The scheduler API (commit c42b45d): every bad argument, and the semantics a state machine does not show.

Bad inputs, in the style of ``tests/core/test_bad_inputs.py``: each row gives the
input, the exception type and its exact message (ours, so exact) or a
precise needle; after every error the pool must be exactly as before
(``unchanged``), after every ``None`` changed only in its refusal counters
(``refused``). Covered: ``alloc_many`` sizes at page sizes 1, 3 and 16,
``restore_state`` (wrong type, other shape, tampered contents),
``LogicalHostPool(merge=...)``, ``free_group_end()`` without a group, and
tampered or foreign-format pickles.

Semantics: ``PoolState`` is immutable; copies (``copy.deepcopy``, pickle)
are independent pools with their own lock and identical future behaviour,
also when loaded by a later process; free groups release in order, survive
a raising body and hold their pages back from other threads; the sorted
merge order on concrete pages; ``repr`` and ``stats()`` after known calls.

Setup of the bad-input pools (``family_pool``): six pages, pages 0, 1, 3
and 4 held by the caller, page 2 released, page 5 free, so two pages are
available and a refused batch is told apart from an empty pool.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import re
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hostpool_nb
from hostpool_nb import AlignmentError, DoubleFreeError, HostPoolError, LogicalHostPool, PoolState, PoolStats
from hostpool_nb._diagnostics.snapshot import FORMAT
from hostpool_nb._kernels import layout as L
from hostpool_nb._kernels.layout import owner_flags
from tests.conftest import JIT_DISABLED, one_entry_per_page, take_snapshot
from tests.scheduler_ops import run_ops, summary
from tests.torch_adapter.test_torch_missing import run_child

# State lengths of the 6-page rich pool and of a 12-page one (the layout decides them).
_W6 = L.state_length(6)
_W12 = L.state_length(12)

INT64_MAX = 2**63 - 1
PAGE_SIZES = [1, 3, 16]


# -- helpers ------------------------------------------------------------------


def pg(p: int, ps: int) -> list[int]:
    """The slots of page ``p``, ascending."""
    return list(range(p * ps, (p + 1) * ps))


def pages_of(*pages: int, ps: int) -> list[int]:
    return [s for p in pages for s in pg(p, ps)]


def family_pool(ps: int, merge: str = "fifo") -> LogicalHostPool:
    """Six pages: 0, 1, 3 and 4 held, 2 released, 5 free (two pages available)."""
    pool = LogicalHostPool(6 * ps, ps, merge=merge)
    held = pool.alloc(5 * ps)
    assert held is not None
    assert held.tolist() == pages_of(0, 1, 2, 3, 4, ps=ps)
    assert pool.free(held[2 * ps : 3 * ps]) == ps
    assert pool.available_size() == 2 * ps
    return pool


def rich_pool(ps: int = 16, merge: str = "fifo") -> LogicalHostPool:
    """Every list in use: page 5 free, 2 released, 4 pending in an open free group; 0, 1, 3 held."""
    pool = family_pool(ps, merge)
    pool.free_group_begin()
    assert pool.free(pg(4, ps)) == ps
    stats = pool.stats()
    assert (stats.free_pages, stats.released_pages, stats.pending_pages, stats.allocated_pages) == (1, 1, 1, 3)
    return pool


def exact(text: str) -> str:
    return "^" + re.escape(text) + "$"


def assert_message(message: str, needles: list[str]) -> None:
    """Each needle is in ``message``: a substring, or a regex if it starts with ``^``."""
    for needle in needles:
        if needle.startswith("^"):
            assert re.search(needle, message), message
        else:
            assert needle in message, message


def free_held_and_drain(pool: LogicalHostPool, ps: int) -> None:
    """After a failed or refused call on a ``family_pool``: the held pages are still held, once."""
    assert pool.free(pages_of(0, 1, 3, 4, ps=ps)) == 4 * ps
    assert pool.available_size() == 6 * ps
    # FIFO: the free page 5, the released page 2, then the pages freed just now.
    assert pool.alloc(6 * ps).tolist() == pages_of(5, 2, 0, 1, 3, 4, ps=ps)


def misaligned(value: int, ps: int) -> bool:
    return value % ps != 0


def alignment(pos: int, value: int, ps: int) -> tuple[type, str]:
    return AlignmentError, f"LogicalHostPool allocation must be page-aligned, got sizes[{pos}]={value}, page_size={ps}"


def negative(pos: int, value: int) -> tuple[type, str]:
    return HostPoolError, f"sizes[{pos}] must be non-negative, got sizes[{pos}]={value}"


def first_error(sizes: list[int], ps: int) -> tuple[type, str] | None:
    """The error ``alloc_many(sizes)`` must raise: the first bad position, alignment before sign."""
    for pos, s in enumerate(sizes):
        if misaligned(s, ps):
            return alignment(pos, s, ps)
        if s < 0:
            return negative(pos, s)
    return None


def forms(sizes: list[int]) -> list[Any]:
    """The same sizes as a list, a tuple, and every numpy integer array that holds them exactly."""
    out: list[Any] = [list(sizes), tuple(sizes)]
    for dtype in (np.int64, np.int32, np.uint64, np.dtype(">i8")):
        info = np.iinfo(dtype)
        if all(info.min <= s <= info.max for s in sizes):
            out.append(np.array(sizes, dtype=dtype))
    if all(0 <= s < 2**64 for s in sizes):
        out.append([np.uint64(s) for s in sizes])  # numpy scalars, beyond int64 too
    return out


# -- alloc_many: sizes of the wrong kind -------------------------------------------


class _Unconvertible:
    """An array-like whose conversion fails, as a meta-device tensor's does."""

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise RuntimeError("no data here")


_SEQ = "sizes must be a 1-D sequence or array of integers, got"

SIZES_TYPE_CASES = [
    # Elements of the wrong kind, named by position.
    pytest.param([1.0], [exact("sizes[0] must be an integer, got float 1.0")], id="float-first"),
    pytest.param([16, 32, 16.0], [exact("sizes[2] must be an integer, got float 16.0")], id="float-later"),
    pytest.param([16, float("nan")], [exact("sizes[1] must be an integer, got float nan")], id="nan"),
    pytest.param([True], [exact("sizes[0] must be an integer, got bool True")], id="bool-first"),
    pytest.param([0, 16, False], [exact("sizes[2] must be an integer, got bool False")], id="bool-later"),
    pytest.param([np.True_], [exact(f"sizes[0] must be an integer, got bool {np.True_!r}")], id="numpy-bool"),
    pytest.param([16, "16"], [exact("sizes[1] must be an integer, got str '16'")], id="str-element"),
    pytest.param([16, None], [exact("sizes[1] must be an integer, got NoneType None")], id="none-element"),
    pytest.param([16, 16, 1j], [exact("sizes[2] must be an integer, got complex 1j")], id="complex-element"),
    pytest.param(
        [np.float64(16)], [exact(f"sizes[0] must be an integer, got float64 {np.float64(16)!r}")], id="numpy-float"
    ),
    pytest.param(
        [np.array(16)],
        [
            exact(
                "sizes[0] must be an integer, got ndarray array(16); "
                "pass a Python int (e.g. int(x)) for a count held in an array"
            )
        ],
        id="0d-array-element",
    ),
    # Nesting: a 2-D list is a list whose elements are not integers.
    pytest.param([[16], [16]], [exact("sizes[0] must be an integer, got list [16]")], id="nested-list"),
    pytest.param([16, (16, 16)], [exact("sizes[1] must be an integer, got tuple (16, 16)")], id="nested-tuple"),
    # Arrays of the wrong shape or dtype.
    pytest.param(
        np.zeros((2, 2), dtype=np.int64), [exact("sizes must be 1-D, got an array of shape (2, 2)")], id="2d-array"
    ),
    pytest.param(
        np.full((1, 1), 16, dtype=np.int64), [exact("sizes must be 1-D, got an array of shape (1, 1)")], id="1x1-array"
    ),
    pytest.param(
        np.empty((0, 3), dtype=np.int32), [exact("sizes must be 1-D, got an array of shape (0, 3)")], id="0x3"
    ),
    pytest.param(np.array(16), [exact("sizes must be 1-D, got an array of shape ()")], id="0d-array"),
    pytest.param(np.array([16.0]), [exact("sizes must hold integers, got dtype float64")], id="float64-array"),
    pytest.param(
        np.array([16], dtype=np.float32), [exact("sizes must hold integers, got dtype float32")], id="float32"
    ),
    pytest.param(np.empty(0), [exact("sizes must hold integers, got dtype float64")], id="empty-float-array"),
    pytest.param(np.array([True, False]), [exact("sizes must hold integers, got dtype bool")], id="bool-array"),
    pytest.param(np.array([16], dtype=object), [exact("sizes must hold integers, got dtype object")], id="object"),
    pytest.param(np.array([16 + 0j]), [exact("sizes must hold integers, got dtype complex128")], id="complex-array"),
    pytest.param(np.array(["16"]), [exact("sizes must hold integers, got dtype <U2")], id="str-array"),
    pytest.param(
        np.array([16], dtype="timedelta64[s]"),
        [exact("sizes must hold integers, got dtype timedelta64[s]")],
        id="timedelta-array",
    ),
    # Not a sequence or array at all.
    pytest.param(16, [exact(f"{_SEQ} int 16; wrap a single size in a list")], id="int-scalar"),
    pytest.param(np.int64(16), [exact(f"{_SEQ} int64 {np.int64(16)!r}; wrap a single size in a list")], id="np-int"),
    pytest.param(None, [exact(f"{_SEQ} NoneType None")], id="none"),
    pytest.param(16.0, [exact(f"{_SEQ} float 16.0")], id="float-scalar"),
    pytest.param("16", [exact(f"{_SEQ} str '16'")], id="str"),
    pytest.param("", [exact(f"{_SEQ} str ''")], id="empty-str"),
    pytest.param(b"\x10", [exact(_SEQ + r" bytes b'\x10'")], id="bytes"),
    pytest.param(bytearray(b"\x10"), [exact(_SEQ + r" bytearray bytearray(b'\x10')")], id="bytearray"),
    pytest.param({0: 16}, [exact(f"{_SEQ} dict {{0: 16}}")], id="dict"),
    pytest.param({16}, [exact(f"{_SEQ} set {{16}}")], id="set"),
    pytest.param(iter([16]), [f"{_SEQ} list_iterator <list_iterator object at "], id="iterator"),
    # A masked array would allocate its masked sizes too.
    pytest.param(np.ma.array([16, 32], mask=[False, True]), ["masked", "compressed()"], id="masked"),
    pytest.param(_Unconvertible(), [exact("sizes must be a 1-D array of integers, got _Unconvertible: no data here")]),
]


@pytest.mark.parametrize(("sizes", "needles"), SIZES_TYPE_CASES)
def test_alloc_many_rejects_sizes_of_the_wrong_kind(
    sizes: Any, needles: list[str], snapshot: Any, unchanged: Any
) -> None:
    pool = family_pool(16)
    before = snapshot(pool)
    with pytest.raises(TypeError) as info:
        pool.alloc_many(sizes)
    assert type(info.value) is TypeError
    assert_message(str(info.value), needles)
    unchanged(pool, before)
    free_held_and_drain(pool, 16)


def test_alloc_many_masked_array_error_names_sizes() -> None:
    pool = family_pool(16)
    with pytest.raises(TypeError) as info:
        pool.alloc_many(np.ma.array([16, 32], mask=[False, True]))
    message = str(info.value)
    assert message.startswith("sizes must not be a masked array"), message
    assert "free" not in message, message


def test_alloc_many_accepts_a_range() -> None:
    pool = family_pool(16)
    got = pool.alloc_many(range(0, 32, 16))  # sizes [0, 16]
    assert got is not None
    assert got[0].tolist() == pg(5, 16)
    assert got[1].tolist() == [0, 0, 16]


# -- alloc_many: misaligned and negative sizes, exact texts at every page size --------------


def _q(ps: int) -> int:
    """A multiple of ``ps`` near 2**62: three of them overflow int64 when summed."""
    return 2**62 // ps * ps


def _big(ps: int) -> int:
    """The smallest multiple of ``ps`` beyond int64: a valid size no array of int64 holds."""
    return (2**63 + ps - 1) // ps * ps


def _size_errors(ps: int) -> list[tuple[str, list[int]]]:
    """(id, sizes) whose first bad position is the error; ``first_error`` computes it."""
    cases = [
        ("negative-first", [-ps]),
        ("negative-later", [0, ps, -2 * ps]),
        ("negative-after-zero", [0, -ps, ps]),
        ("minus-one-later", [ps, -1]),  # alignment first for ps > 1, sign for ps == 1
        ("int64-min", [-(2**63)]),  # a multiple of 1 and 16 (negative), not of 3 (misaligned)
        ("negative-beyond-int64", [ps, -(2**64) * ps]),
        ("negative-after-big", [_big(ps), -ps]),
        ("negative-after-overflowing-sum", [_q(ps)] * 3 + [-ps]),
    ]
    if ps > 1:
        cases += [
            ("misaligned-first", [ps + 1]),
            ("misaligned-one", [1]),
            ("misaligned-last-offset", [ps, 0, 2 * ps, 2 * ps - 1]),
            ("misaligned-before-negative", [ps, 1, -ps]),
            ("negative-before-misaligned", [ps, -ps, 1]),
            ("int64-max", [INT64_MAX]),
            ("misaligned-beyond-int64", [_big(ps) + 1]),
            ("misaligned-after-big", [2**70 * ps, ps + 1]),
            ("misaligned-below-uint64-max", [(2**64 - 1) // ps * ps - 1]),
            ("misaligned-after-overflowing-sum", [_q(ps)] * 3 + [ps + 1]),
        ]
    return cases


_SIZE_ERRORS = [pytest.param(ps, sizes, id=f"p{ps}-{name}") for ps in PAGE_SIZES for name, sizes in _size_errors(ps)]


@pytest.mark.parametrize(("ps", "sizes"), _SIZE_ERRORS)
def test_alloc_many_bad_sizes_exact_texts(ps: int, sizes: list[int], snapshot: Any, unchanged: Any) -> None:
    """``alloc``'s errors naming the first bad position, in every form the sizes can take.

    Page size 3 takes the kernels' division path, 16 the mask path and 1
    has no misalignment at all; sizes beyond int64 take the pool's Python
    path, so each row runs in every form that can hold its values.
    """
    expected = first_error(sizes, ps)
    assert expected is not None
    error, message = expected
    pool = family_pool(ps)
    before = snapshot(pool)
    for form in forms(sizes):
        with pytest.raises(error) as info:
            pool.alloc_many(form)
        assert type(info.value) is error
        assert str(info.value) == message, type(form)
        unchanged(pool, before)
    free_held_and_drain(pool, ps)


def test_alloc_many_error_texts_spelled_out() -> None:
    """``first_error`` above, checked against literal texts: the expectations are not circular."""
    assert first_error([16, 0, 32, 31], 16) == (
        AlignmentError,
        "LogicalHostPool allocation must be page-aligned, got sizes[3]=31, page_size=16",
    )
    assert first_error([3, -3, 1], 3) == (HostPoolError, "sizes[1] must be non-negative, got sizes[1]=-3")
    assert first_error([-(2**63)], 3) == (
        AlignmentError,
        "LogicalHostPool allocation must be page-aligned, got sizes[0]=-9223372036854775808, page_size=3",
    )
    assert first_error([-(2**63)], 16) == (
        HostPoolError,
        "sizes[0] must be non-negative, got sizes[0]=-9223372036854775808",
    )
    assert first_error([1, -1], 1) == (HostPoolError, "sizes[1] must be non-negative, got sizes[1]=-1")
    pool = family_pool(16)
    with pytest.raises(AlignmentError) as info:
        pool.alloc_many(np.array([16, 0, 32, 31]))
    assert str(info.value) == "LogicalHostPool allocation must be page-aligned, got sizes[3]=31, page_size=16"


# -- alloc_many: sizes that are valid but cannot be served -------------------------


def _refusals(ps: int) -> list[tuple[str, list[int]]]:
    cases = [
        ("one-page-too-many", [3 * ps]),
        ("batch-too-many", [ps, ps, ps]),
        ("zeros-and-too-many", [0, 2 * ps, 0, ps]),
        ("beyond-int64", [_big(ps)]),
        ("far-beyond-int64", [0, 2**70 * ps]),
        ("largest-uint64-multiple", [(2**64 - 1) // ps * ps]),
        ("int64-max-multiple-plus-one-page", [INT64_MAX // ps * ps, ps]),
        ("sum-overflows-int64", [_q(ps)] * 3),
        ("sum-overflows-after-fitting", [ps, _q(ps), _q(ps), _q(ps), 0]),
    ]
    if ps == 1:
        cases.append(("int64-max", [INT64_MAX]))
    return cases


_REFUSALS = [pytest.param(ps, sizes, id=f"p{ps}-{name}") for ps in PAGE_SIZES for name, sizes in _refusals(ps)]


@pytest.mark.parametrize(("ps", "sizes"), _REFUSALS)
def test_alloc_many_refuses_what_does_not_fit(ps: int, sizes: list[int], snapshot: Any, refused: Any) -> None:
    """``None``, all or nothing: no page is taken, only the refusal is counted."""
    assert first_error(sizes, ps) is None
    pool = family_pool(ps)
    before = snapshot(pool)
    for times, form in enumerate(forms(sizes), 1):
        assert pool.alloc_many(form) is None, type(form)
        refused(pool, before, times)
    free_held_and_drain(pool, ps)


def test_refused_overflowing_batch_allocates_nothing(snapshot: Any, refused: Any, all_kernels: None) -> None:
    """Totals beyond the pool, beyond int64 when summed, beyond int64 per size: microseconds, no memory.

    The pool is huge (2**40 slots) and wholly free, so an allocation of the
    saturated total would be a terabyte.
    """
    ps = 2**24
    pool = LogicalHostPool(2**40, ps)
    before = snapshot(pool)
    batches: list[Any] = [
        [2**62] * 3,  # each fits int64, the sum does not
        [2**40, ps],  # one page more than the pool
        np.array([2**40 - ps, ps, ps], dtype=np.int64),
        [ps, 2**63],  # beyond int64: the Python path
        np.array([2**63, 2**63], dtype=np.uint64),
    ]
    for times, sizes in enumerate(batches, 1):
        tracemalloc.start()
        try:
            assert pool.alloc_many(sizes) is None
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 16, f"a refused alloc_many({sizes!r}) allocated {peak} bytes"
        refused(pool, before, times)
    assert pool.available_size() == 2**40
    slots, offsets = pool.alloc_many([0, 0])  # a batch that fits is still answered
    assert (slots.shape, offsets.tolist()) == ((0,), [0, 0, 0])


@pytest.mark.parametrize(
    "ps",
    [
        pytest.param(1, id="p1"),
        pytest.param(3, id="p3"),
        pytest.param(16, id="p16"),
    ],
)
@pytest.mark.parametrize(
    "make_sizes",
    [
        pytest.param(lambda ps: [ps, 4 * ps], id="one-page-over"),
        pytest.param(lambda ps: [8 * ps], id="twice-the-pool"),
        pytest.param(lambda ps: [_q(ps)] * 3, id="sum-overflows-int64"),
    ],
)
def test_batch_beyond_the_pool_is_refused_when_every_page_is_free(
    ps: int, make_sizes: Any, snapshot: Any, refused: Any
) -> None:
    """A 4-page pool, all free: a batch of more than 4 pages is ``None``, as ``alloc`` of its total is.

    Repro: ``LogicalHostPool(64, 16).alloc_many([16, 64])`` returns 65 slots
    (the 4 pages and one uninitialized value) with offsets ``[0, 16, 16]``,
    and the pool is left with every page allocated.
    """
    sizes = make_sizes(ps)
    pool = LogicalHostPool(4 * ps, ps)
    before = snapshot(pool)
    assert pool.alloc(5 * ps) is None
    refused(pool, before)
    assert pool.alloc_many(sizes) is None
    refused(pool, before, 2)


# -- alloc_many: what it returns ----------------------------------------------------------


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_alloc_many_returns_what_alloc_of_the_total_would(ps: int) -> None:
    """Same slots as ``alloc(sum)`` on a copy, offsets the prefix sums, caller-owned arrays."""
    pool = family_pool(ps)
    assert pool.free(pg(0, ps)) == ps  # released after page 2: free 5, then released 2, 0
    twin = copy.deepcopy(pool)
    sizes = [ps, 0, 2 * ps]
    got = pool.alloc_many(sizes)
    assert got is not None
    slots, offsets = got
    want = twin.alloc(3 * ps)
    assert slots.tolist() == want.tolist() == pages_of(5, 2, 0, ps=ps)
    assert offsets.tolist() == [0, ps, ps, 3 * ps]
    for arr, length in ((slots, 3 * ps), (offsets, 4)):
        assert type(arr) is np.ndarray
        assert arr.dtype == np.int64
        assert arr.shape == (length,)
        assert arr.flags.c_contiguous
        assert arr.flags.writeable
        assert arr.flags.owndata
        assert not np.shares_memory(arr, pool._st)
    assert not np.shares_memory(slots, offsets)
    assert take_snapshot(pool)[0].tolist() == take_snapshot(twin)[0].tolist()
    # Caller-owned: scribbling on them changes nothing in the pool.
    before = take_snapshot(pool)
    slots[:] = -1
    offsets[:] = 99
    for old, new in zip(before, take_snapshot(pool), strict=True):
        assert np.array_equal(old, new)
    assert pool.free(pages_of(5, 2, 0, ps=ps)) == 3 * ps
    pool.check_invariants()


@pytest.mark.parametrize(
    "empty", [[], (), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.uint8)], ids=["list", "tuple", "i8", "u1"]
)
def test_alloc_many_of_nothing_returns_two_empty_arrays(empty: Any, snapshot: Any) -> None:
    pool = family_pool(16)
    before = snapshot(pool)
    got = pool.alloc_many(empty)
    assert got is not None
    slots, offsets = got
    assert (slots.dtype, slots.shape) == (np.int64, (0,))
    assert (offsets.dtype, offsets.tolist()) == (np.int64, [0])
    # Answered with slots (none): one more call counted, no failure, nothing else moved.
    header = before[0].copy()
    header[L.H_ALLOC_CALLS] += 1
    assert take_snapshot(pool)[0].tolist() == header.tolist()
    assert pool.available_size() == 32


def test_alloc_many_of_zero_sizes_on_a_full_pool() -> None:
    pool = LogicalHostPool(32, 16)
    assert pool.alloc(32) is not None
    slots, offsets = pool.alloc_many([0, 0, 0])
    assert slots.tolist() == []
    assert offsets.tolist() == [0, 0, 0, 0]
    assert pool.alloc_many([0, 16]) is None


def test_alloc_many_leaves_read_only_and_strided_sizes_alone() -> None:
    pool = LogicalHostPool(96, 16)
    sizes = np.array([16, 32], dtype=np.int32)
    sizes.flags.writeable = False
    slots, offsets = pool.alloc_many(sizes)
    assert offsets.tolist() == [0, 16, 48]
    assert not np.shares_memory(offsets, sizes)
    strided = np.array([16, -5, 16, -5], dtype=np.int64)[::2]
    assert pool.alloc_many(strided)[1].tolist() == [0, 16, 32]
    assert sizes.tolist() == [16, 32]
    assert slots.tolist() == list(range(48))


# -- restore_state ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "name"),
    [
        pytest.param(None, "NoneType", id="none"),
        pytest.param(rich_pool().backup_state()._words, "ndarray", id="its-array"),
        pytest.param({"size": 96}, "dict", id="dict"),
        pytest.param(rich_pool(), "LogicalHostPool", id="a-pool"),
        pytest.param(rich_pool().stats(), "PoolStats", id="stats"),
        pytest.param(pickle.dumps(rich_pool().backup_state()), "bytes", id="pickled-bytes"),
    ],
)
def test_restore_state_of_a_non_state_is_a_type_error(state: Any, name: str, snapshot: Any, unchanged: Any) -> None:
    pool = rich_pool()
    before = snapshot(pool)
    with pytest.raises(TypeError) as info:
        pool.restore_state(state)
    assert type(info.value) is TypeError
    assert str(info.value) == f"state must be a PoolState from backup_state(), got {name}"
    unchanged(pool, before)


@pytest.mark.parametrize(
    ("size", "ps", "merge"),
    [(192, 16, "fifo"), (48, 16, "fifo"), (96, 8, "fifo"), (96, 32, "fifo"), (96, 16, "sorted"), (0, 16, "fifo")],
    ids=["larger", "smaller", "smaller-pages", "larger-pages", "sorted", "empty"],
)
def test_restore_state_from_another_shape(size: int, ps: int, merge: str, snapshot: Any, unchanged: Any) -> None:
    pool = rich_pool()
    before = snapshot(pool)
    other = LogicalHostPool(size, ps, merge=merge).backup_state()
    with pytest.raises(HostPoolError) as info:
        pool.restore_state(other)
    assert type(info.value) is HostPoolError
    assert str(info.value) == (
        f"the state is from a pool with size={size}, page_size={ps}, merge={merge!r}; "
        "this pool has size=96, page_size=16, merge='fifo'"
    )
    unchanged(pool, before)
    # The other way round, too.
    target = LogicalHostPool(size, ps, merge=merge)
    target_before = snapshot(target)
    with pytest.raises(
        HostPoolError,
        match=exact(
            f"the state is from a pool with size=96, page_size=16, merge='fifo'; "
            f"this pool has size={size}, page_size={ps}, merge={merge!r}"
        ),
    ):
        target.restore_state(pool.backup_state())
    unchanged(target, target_before)


def _ring(w: np.ndarray, i: int) -> int:
    """Ring position of the ``i``-th listed page (free, then released, then pending) of a 6-page state."""
    return (int(w[L.H_HEAD]) + i) % 6


def _flags(w: np.ndarray) -> np.ndarray:
    return owner_flags(w, 6)


def _set(index: int, value: int, *also: int) -> Any:
    """Set header word ``index`` (and the words ``also``, e.g. a list's entry count with its page count)."""

    def tamper(w: np.ndarray) -> np.ndarray:
        w[[index, *also]] = value
        return w

    return tamper


def _set_ring(i: int, value: int) -> Any:
    def tamper(w: np.ndarray) -> np.ndarray:
        one_entry_per_page(w)[_ring(w, i)] = value
        return w

    return tamper


def _set_flag(page: int, value: int) -> Any:
    def tamper(w: np.ndarray) -> np.ndarray:
        _flags(w)[page] = value
        return w

    return tamper


# The rich state: 6 pages of 16; listed: page 5 (free), 2 (released), 4
# (pending, group depth 1); 0, 1 and 3 held. Counters: 1 alloc call, 2
# free calls, peak 5 pages, no merge.
_INV = "the state fails the pool's invariants: "
_STATS = (
    "{'merges': %d, 'alloc_calls': %d, 'failed_allocs': %d, 'free_calls': 2, 'peak_allocated_pages': 5, 'clears': 0}"
)

TAMPERED_CASES = [
    pytest.param(
        _set(L.H_NFREE, 6), "counters out of range: head=1 nfree=6 nrel=1 npend=1 pages=6", id="nfree-too-large"
    ),
    pytest.param(
        _set(L.H_NREL, -1), "counters out of range: head=1 nfree=1 nrel=-1 npend=1 pages=6", id="nrel-negative"
    ),
    pytest.param(
        _set(L.H_HEAD, 6), "counters out of range: head=6 nfree=1 nrel=1 npend=1 pages=6", id="head-past-ring"
    ),
    pytest.param(
        _set(L.H_HEAD, -1), "counters out of range: head=-1 nfree=1 nrel=1 npend=1 pages=6", id="head-negative"
    ),
    pytest.param(
        _set(L.H_NPAGES, 7), "header says (pages, page_size, shift) = (7, 16, 4), pool has (6, 16, 4)", id="pages"
    ),
    pytest.param(
        _set(L.H_PAGE_SIZE, 8), "header says (pages, page_size, shift) = (6, 8, 4), pool has (6, 16, 4)", id="page-size"
    ),
    pytest.param(
        _set(L.H_PAGE_SHIFT, -1), "header says (pages, page_size, shift) = (6, 16, -1), pool has (6, 16, 4)", id="shift"
    ),
    pytest.param(_set(L.H_GROUP_DEPTH, 0), "free groups out of range: depth=0 with 1 pending pages", id="no-group"),
    pytest.param(_set(L.H_GROUP_DEPTH, -1), "free groups out of range: depth=-1 with 1 pending pages", id="depth-neg"),
    pytest.param(_set(L.H_SORTED, 2), "merge order word is 2, expected 0 (fifo) or 1 (sorted)", id="merge-word-2"),
    pytest.param(_set(L.H_SORTED, 1), "its merge order word is 1, but it says merge='fifo'", id="merge-word-sorted"),
    pytest.param(
        _set_ring(1, 5), "page 5 is listed 2 times; page 2 has owner flag 0 but is listed 0 times", id="page-twice"
    ),
    pytest.param(_set_ring(1, 6), "a listed page id is out of range", id="page-id-at-n"),
    pytest.param(_set_ring(2, -1), "a listed page id is out of range", id="pending-page-id-negative"),
    pytest.param(_set_flag(1, L.OWNER_FREE), "page 1 has owner flag 0 but is listed 0 times", id="held-flagged-free"),
    pytest.param(
        _set_flag(4, L.OWNER_FREE), "page 4 has owner flag 0 but is listed 1 times (as pending)", id="pending-free"
    ),
    pytest.param(_set_flag(5, L.OWNER_ALLOCATED), "page 5 has owner flag 1 but is listed 1 times", id="free-held"),
    pytest.param(_set_flag(2, L.OWNER_PENDING), "page 2 has owner flag 2 but is listed 1 times", id="released-pend"),
    pytest.param(_set_flag(3, 7), "page 3 has owner flag 7 but is listed 0 times", id="flag-7"),
    pytest.param(_set(L.H_NPEND, 0, L.H_EPEND), "page 4 has owner flag 2 but is listed 0 times", id="pending-dropped"),
    pytest.param(_set(L.H_MERGES, -1), "statistics out of range: " + _STATS % (-1, 1, 0), id="merges-negative"),
    pytest.param(_set(L.H_FAILED_ALLOCS, 2), "statistics out of range: " + _STATS % (0, 1, 2), id="failed-over-calls"),
    pytest.param(_set(L.H_PEAK, 2), "peak of 2 pages is below the 3 held now", id="peak-below-held"),
    pytest.param(lambda w: w[:-1], f"state array has length {_W6 - 1}, expected {_W6}", id="truncated"),
    pytest.param(lambda w: np.append(w, 0), f"state array has length {_W6 + 1}, expected {_W6}", id="extended"),
]


@pytest.mark.parametrize(("tamper", "problem"), TAMPERED_CASES)
def test_restore_state_refuses_a_tampered_state(tamper: Any, problem: str, snapshot: Any, unchanged: Any) -> None:
    """``PoolState(size, page_size, merge, words)`` from a modified copy of a real snapshot."""
    pool = rich_pool()
    good = pool.backup_state()
    assert good._words.shape == (_W6,)
    words = tamper(good._words.copy())
    state = PoolState(96, 16, "fifo", words)
    # The pool is elsewhere when it refuses: nothing must move it.
    pool.free_group_end()
    before = snapshot(pool)
    with pytest.raises(HostPoolError) as info:
        pool.restore_state(state)
    assert type(info.value) is HostPoolError
    assert str(info.value) == _INV + problem
    unchanged(pool, before)
    pool.restore_state(good)  # the untampered snapshot is still accepted
    assert pool.stats() == rich_pool().stats()


def test_restore_state_refuses_a_2d_state(snapshot: Any, unchanged: Any) -> None:
    pool = rich_pool()
    before = snapshot(pool)
    with pytest.raises(HostPoolError) as info:  # refused as it is made, before any pool sees it
        PoolState(96, 16, "fifo", pool.backup_state()._words.reshape(1, -1))
    assert str(info.value) == (
        f"the PoolState holds a int64 array of shape (1, {_W6}), not a pool's state words (a 1-D int64 array)"
    )
    unchanged(pool, before)


def test_restore_state_refuses_an_unsorted_free_list_for_a_sorted_pool(snapshot: Any, unchanged: Any) -> None:
    pool = LogicalHostPool(96, 16, merge="sorted")
    held = pool.alloc(96)
    for p in (4, 1, 3):
        pool.free(held[p * 16 : (p + 1) * 16])
    assert pool.merge() == 48
    words = pool.backup_state()._words.copy()
    ids = one_entry_per_page(words)
    i, j = _ring(words, 0), _ring(words, 1)
    assert ids[[i, j, _ring(words, 2)]].tolist() == [1, 3, 4]
    ids[i], ids[j] = ids[j], ids[i]
    before = snapshot(pool)
    with pytest.raises(HostPoolError) as info:
        pool.restore_state(PoolState(96, 16, "sorted", words))
    assert str(info.value) == _INV + "the free list of a sorted pool is not ascending"
    unchanged(pool, before)


# -- LogicalHostPool(merge=...) and free_group_end() ---------------------------------


@pytest.mark.parametrize(
    "merge",
    [None, "FIFO", "Sorted", "lifo", "", "sorted ", 1, 0, True, b"fifo", ["fifo"]],
    ids=["none", "FIFO", "Sorted", "lifo", "empty", "trailing-space", "one", "zero", "true", "bytes", "list"],
)
def test_bad_merge_order(merge: Any) -> None:
    with pytest.raises(HostPoolError) as info:
        LogicalHostPool(64, 16, merge=merge)
    assert type(info.value) is HostPoolError
    assert str(info.value) == f"merge must be 'fifo' or 'sorted', got merge={merge!r}"


def test_merge_is_keyword_only_and_named_in_repr() -> None:
    with pytest.raises(TypeError):
        LogicalHostPool(64, 16, "layer_first", "sorted")  # type: ignore[misc]
    for merge in ("fifo", "sorted"):
        pool = LogicalHostPool(64, 16, merge=merge)
        assert pool.merge_order == merge
        assert f"merge={merge!r}" in repr(pool)
    assert LogicalHostPool(64, 16).merge_order == "fifo"


_NO_GROUP = "free_group_end() without a free group: none was begun, or clear() ended it"


def _no_group_setups() -> list[Any]:
    def fresh(pool: LogicalHostPool) -> None:
        pass

    def ended(pool: LogicalHostPool) -> None:
        pool.free_group_begin()
        pool.free(pg(0, 16))
        pool.free_group_end()

    def nested_ended(pool: LogicalHostPool) -> None:
        pool.free_group_begin()
        pool.free_group_begin()
        pool.free_group_end()
        pool.free_group_end()

    def cleared(pool: LogicalHostPool) -> None:
        pool.free_group_begin()
        pool.free(pg(0, 16))
        pool.clear()

    def cleared_nested(pool: LogicalHostPool) -> None:
        pool.free_group_begin()
        pool.free_group_begin()
        pool.free(pg(1, 16))
        pool.clear()

    def after_with(pool: LogicalHostPool) -> None:
        with pool.free_group():
            pool.free(pg(0, 16))

    def cleared_in_with(pool: LogicalHostPool) -> None:
        with pool.free_group(), pool.free_group():
            pool.free(pg(0, 16))
            pool.clear()

    return [
        pytest.param(f, id=f.__name__.replace("_", "-"))
        for f in (fresh, ended, nested_ended, cleared, cleared_nested, after_with, cleared_in_with)
    ]


@pytest.mark.parametrize("setup", _no_group_setups())
def test_free_group_end_without_a_group(setup: Any, snapshot: Any, unchanged: Any) -> None:
    pool = family_pool(16)
    setup(pool)
    assert int(pool._st[L.H_GROUP_DEPTH]) == 0
    before = snapshot(pool)
    for _ in range(2):
        with pytest.raises(HostPoolError) as info:
            pool.free_group_end()
        assert type(info.value) is HostPoolError
        assert str(info.value) == _NO_GROUP
        unchanged(pool, before)


# -- pickles: tampered, or of another format ------------------------------------------


class _Pickled:
    """Pickles as the given reduce tuple: a way to write a tampered pickle."""

    def __init__(self, reduced: tuple[Any, ...]) -> None:
        self.reduced = reduced

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduced


def tampered_pickle(pool: LogicalHostPool, **changes: Any) -> bytes:
    """``pickle.dumps(pool)`` with keys of its saved dict replaced (``...``: deleted)."""
    reduced = pool.__reduce_ex__(1)  # (copyreg._reconstructor, (cls, object, None), saved dict)
    saved = dict(reduced[2])
    assert set(saved) == {"format", "size", "page_size", "layout", "merge", "state", "sites"}
    for key, value in changes.items():
        if value is ...:
            del saved[key]
        else:
            saved[key] = value
    return pickle.dumps(_Pickled((reduced[0], reduced[1], saved)))


def _words_with(index: int, value: int) -> np.ndarray:
    words = rich_pool().__getstate__()["state"]
    words[index] = value
    return words


def _format_text(version: Any, what: str = "LogicalHostPool") -> str:
    by = {2: "hostpool_nb before its ring held int32 page ids"}.get(version, "no hostpool_nb this one knows")
    if type(version) is int and version > FORMAT:
        by = "a newer hostpool_nb"
    elif type(version) is not int:
        by = "no hostpool_nb"
    return (
        f"this {what} was pickled in state format {version!r}, written by {by}; this hostpool_nb reads format "
        f"{FORMAT} and converts format 3 (pickle it again with the same hostpool_nb version that loads it)"
    )


_PICKLED = "the pickled LogicalHostPool"


def _pickled_inv(problem: str) -> list[str]:
    return [exact(f"{_PICKLED} fails the pool's invariants: {problem}")]


PICKLE_CASES = [
    pytest.param({"format": FORMAT + 1}, [exact(_format_text(FORMAT + 1))], id="next-format"),
    pytest.param({"format": 0}, [exact(_format_text(0))], id="format-0"),
    pytest.param({"format": "1"}, [exact(_format_text("1"))], id="format-str"),
    pytest.param({"format": ...}, [exact(_format_text(None))], id="no-format"),
    pytest.param(
        {"state": _words_with(L.H_NFREE, 6)},
        _pickled_inv("counters out of range: head=1 nfree=6 nrel=1 npend=1 pages=6"),
        id="state-counters",
    ),
    pytest.param(
        {"state": _set_ring(1, 5)(rich_pool().__getstate__()["state"])},
        _pickled_inv("page 5 is listed 2 times; page 2 has owner flag 0 but is listed 0 times"),
        id="state-page-twice",
    ),
    pytest.param(
        {"state": _words_with(L.H_SORTED, 1)},
        _pickled_inv("its merge order word is 1, but it says merge='fifo'"),
        id="state-merge-word",
    ),
    pytest.param(
        {"merge": "sorted"},
        _pickled_inv("its merge order word is 0, but it says merge='sorted'"),
        id="merge-sorted",
    ),
    pytest.param(
        {"size": 192},
        _pickled_inv(f"state array has length {_W6}, expected {_W12}"),
        id="size-larger",
    ),
    pytest.param(
        {"page_size": 8},
        _pickled_inv(f"state array has length {_W6}, expected {_W12}"),
        id="page-size-smaller",
    ),
    pytest.param(
        {"size": 48, "page_size": 8},
        _pickled_inv("header says (pages, page_size, shift) = (6, 16, 4), pool has (6, 8, 3)"),
        id="same-pages-other-page-size",
    ),
    pytest.param(
        {"state": _words_with(L.H_NFREE, 1).astype(np.int32)},
        [exact(f"{_PICKLED} holds a int32 array of shape ({_W6},), not a pool state")],
        id="state-int32",
    ),
    pytest.param({"state": None}, [exact(f"{_PICKLED} holds a NoneType, not a pool state")], id="state-none"),
    pytest.param(
        {"merge": "lifo"},
        [exact(f"{_PICKLED} has merge='lifo', not 'fifo' or 'sorted'")],
        id="merge-lifo",
    ),
    pytest.param(
        {"merge": None},
        [exact(f"{_PICKLED} has merge=None, not 'fifo' or 'sorted'")],
        id="merge-none",
    ),
    pytest.param(
        {"page_size": 0},
        [exact(f"{_PICKLED} has size=96, page_size=0: not a pool's shape")],
        id="page-size-0",
    ),
    pytest.param(
        {"size": "96"},
        [exact(f"{_PICKLED} has size='96', page_size=16: not a pool's shape")],
        id="size-str",
    ),
    pytest.param({"size": ...}, [exact(f"{_PICKLED} lacks size")], id="no-size"),
    pytest.param({"state": ..., "layout": ...}, [exact(f"{_PICKLED} lacks layout, state")], id="no-state-layout"),
    pytest.param(
        {"state": _words_with(L.H_NFREE, 1).tolist()},
        [exact(f"{_PICKLED} holds a list, not a pool state")],
        id="state-list",
    ),
]


@pytest.mark.parametrize(("changes", "needles"), PICKLE_CASES)
def test_tampered_pickle_is_refused(changes: dict[str, Any], needles: list[str]) -> None:
    pool = rich_pool()
    data = tampered_pickle(pool, **changes)
    with pytest.raises(HostPoolError) as info:
        pickle.loads(data)
    assert_message(str(info.value), needles)
    # The same through __setstate__ on a fresh object: refused, and the object is left without a state.
    saved = pool.__getstate__()
    for key, value in changes.items():
        if value is ...:
            del saved[key]
        else:
            saved[key] = value
    fresh = LogicalHostPool.__new__(LogicalHostPool)
    with pytest.raises(HostPoolError):
        fresh.__setstate__(saved)
    assert not hasattr(fresh, "_st")


def test_untampered_pickle_through_the_same_route_loads() -> None:
    """The tampering helper itself produces a loadable pickle when nothing is changed."""
    pool = rich_pool()
    loaded = pickle.loads(tampered_pickle(pool))
    assert type(loaded) is LogicalHostPool
    assert loaded.stats() == pool.stats()
    assert pickle.loads(tampered_pickle(pool, layout=("any", 1))).layout == ("any", 1)


@pytest.mark.parametrize("version", [FORMAT + 1, 0, None])
def test_pool_state_pickle_of_another_format(version: Any) -> None:
    state = rich_pool().backup_state()
    reduced = state.__reduce__()
    assert reduced[1][0] == FORMAT
    data = pickle.dumps(_Pickled((reduced[0], (version, *reduced[1][1:]))))
    with pytest.raises(HostPoolError) as info:
        pickle.loads(data)
    assert str(info.value) == _format_text(version, "PoolState")
    loaded = pickle.loads(pickle.dumps(state))
    assert type(loaded) is PoolState
    assert np.array_equal(loaded._words, state._words)


# -- PoolState is immutable ---------------------------------------------------------------


def test_pool_state_is_frozen_and_read_only() -> None:
    pool = rich_pool()
    state = pool.backup_state()
    assert (state.size, state.page_size, state.merge) == (96, 16, "fifo")
    assert (
        repr(state) == "PoolState(size=96, page_size=16, merge='fifo', free_pages=1, released_pages=1, pending_pages=1)"
    )
    for name, value in (("size", 32), ("page_size", 1), ("merge", "sorted"), ("_words", np.zeros(3, dtype=np.int64))):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(state, name, value)
    assert not state._words.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        state._words[L.H_NFREE] = 6
    assert not np.shares_memory(state._words, pool._st)
    # Built from a caller's array, it keeps a copy of its own.
    words = pool.backup_state()._words.copy()
    mine = PoolState(96, 16, "fifo", words)
    words[L.H_NFREE] = 6
    assert int(mine._words[L.H_NFREE]) == 1
    pool.restore_state(mine)
    pool.check_invariants()


def test_restore_state_is_unaffected_by_later_changes() -> None:
    pool = rich_pool()
    twin, pristine = copy.deepcopy(pool), copy.deepcopy(pool)
    state = pool.backup_state()
    # Everything changes: the group ends, pages move, counters grow, a clear.
    pool.free_group_end()
    assert pool.alloc(48) is not None
    pool.free(pages_of(0, 1, ps=16))
    pool.merge()
    pool.clear()
    assert pool.alloc_many([16, 80]) is not None
    pool.restore_state(state)
    for a, b in zip(take_snapshot(pool), take_snapshot(twin), strict=True):
        assert np.array_equal(a, b)
    assert pool.stats() == twin.stats()
    pool.check_invariants()
    assert run_ops(pool, 7, [0, 1, 3]) == run_ops(twin, 7, [0, 1, 3])
    # The same snapshot, again, and into a fresh pool of the same shape.
    fresh = LogicalHostPool(96, 16)
    for target in (pool, fresh):
        target.restore_state(state)
        assert run_ops(target, 8, [0, 1, 3]) == run_ops(copy.deepcopy(pristine), 8, [0, 1, 3])


# -- copies: independent, own lock, identical future -------------------------------------


def _copies() -> list[Any]:
    return [
        pytest.param(copy.deepcopy, id="deepcopy"),
        pytest.param(copy.copy, id="copy"),
        pytest.param(lambda p: pickle.loads(pickle.dumps(p)), id="pickle"),
        pytest.param(lambda p: pickle.loads(pickle.dumps(p, protocol=2)), id="pickle-2"),
    ]


@pytest.mark.parametrize("make_copy", _copies())
@pytest.mark.parametrize("merge", ["fifo", "sorted"])
def test_copy_is_an_independent_pool_with_its_own_lock(make_copy: Any, merge: str) -> None:
    pool = rich_pool(merge=merge)
    clone = make_copy(pool)
    assert type(clone) is LogicalHostPool
    assert clone is not pool
    assert clone.lock is not pool.lock
    assert type(clone.lock) is type(threading.RLock())
    assert not np.shares_memory(clone._st, pool._st)
    assert (clone.size, clone.page_size, clone.layout, clone.merge_order) == (96, 16, "layer_first", merge)
    assert clone.stats() == pool.stats()
    assert repr(clone) == repr(pool)
    clone.check_invariants()
    # A change in one leaves the other as it was.
    before = take_snapshot(pool)
    assert clone.alloc(32) is not None
    clone.free_group_end()
    for a, b in zip(before, take_snapshot(pool), strict=True):
        assert np.array_equal(a, b)
    assert pool.available_size() == 32
    assert clone.available_size() == 16
    # Its own lock: the clone works while another thread holds the original's.
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with pool.lock:
            taken.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert taken.wait(10)
        result: list[Any] = []
        worker = threading.Thread(target=lambda: result.append(clone.alloc(16)))
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), "the copy waited for the original's lock"
        assert result[0] is not None
    finally:
        release.set()
        holder.join(10)


@pytest.mark.parametrize("make_copy", _copies())
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("merge", ["fifo", "sorted"])
def test_copy_has_identical_future_behaviour(make_copy: Any, ps: int, merge: str) -> None:
    pool = family_pool(ps, merge)
    pool.free_group_begin()
    pool.free(pg(4, ps))
    clone = make_copy(pool)
    seed = 1000 * ps + len(merge)
    # The copy first: its calls must not show in the original's answers.
    from_clone = run_ops(clone, seed, [0, 1, 3])
    from_pool = run_ops(pool, seed, [0, 1, 3])
    assert from_clone == from_pool
    counts = summary(from_pool)
    assert min(counts.values()) > 0, counts  # slots, None and errors all happened
    pool.check_invariants()
    clone.check_invariants()


# -- free groups ---------------------------------------------------------------------


def test_free_group_releases_at_the_outermost_end_in_the_order_freed() -> None:
    ps = 4
    pool = LogicalHostPool(8 * ps, ps)
    assert pool.alloc(6 * ps).tolist() == pages_of(0, 1, 2, 3, 4, 5, ps=ps)
    assert pool.free(pg(5, ps)) == ps  # released before the group
    pool.free_group_begin()
    assert pool.free(pages_of(3, 0, ps=ps)) == 2 * ps  # validated now, counted now
    pool.free_group_begin()
    assert pool.free(pg(4, ps)) == ps
    with pytest.raises(DoubleFreeError) as info:
        pool.free(pg(0, ps))  # pending is not allocated
    assert str(info.value) == (
        "page 0 (slots 0..3), freed at indices[0] (flattened), is not allocated: "
        "it was freed already, freed by clear(), or never allocated"
    )
    pool.free_group_end()  # inner: nothing released
    assert pool.available_size() == 3 * ps
    assert pool.stats().pending_pages == 3
    # Pages 6, 7 free, 5 released; 3, 0, 4 pending: an allocation takes only the first three.
    assert pool.alloc(4 * ps) is None
    assert pool.alloc(ps).tolist() == pg(6, ps)
    pool.free_group_end()
    stats = pool.stats()
    assert (stats.free_pages, stats.released_pages, stats.pending_pages) == (1, 4, 0)
    assert pool.alloc(5 * ps).tolist() == pages_of(7, 5, 3, 0, 4, ps=ps)
    pool.check_invariants()


def test_free_group_with_a_raising_body_applies_its_frees() -> None:
    ps = 16
    pool = LogicalHostPool(4 * ps, ps)
    assert pool.alloc(4 * ps) is not None

    def failing_body() -> None:
        with pool.free_group():
            assert pool.free(pg(2, ps)) == ps
            assert pool.free(pg(0, ps)) == ps
            assert pool.available_size() == 0
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        failing_body()
    assert pool.stats().pending_pages == 0
    assert pool.available_size() == 2 * ps
    with pytest.raises(HostPoolError, match=exact(_NO_GROUP)):
        pool.free_group_end()  # the with-block ended its group
    # A free failing inside the body: the earlier one is still released, the error propagates.

    def failing_free() -> None:
        with pool.free_group():
            assert pool.free(pg(3, ps)) == ps
            pool.free(pg(2, ps))

    with pytest.raises(DoubleFreeError, match=r"^page 2 \(slots 32\.\.47\)"):
        failing_free()
    assert pool.alloc(3 * ps).tolist() == pages_of(2, 0, 3, ps=ps)
    pool.check_invariants()


def test_free_group_block_after_clear_leaves_the_pool_alone() -> None:
    pool = LogicalHostPool(64, 16)
    assert pool.alloc(64) is not None
    with pool.free_group():
        pool.free(pg(1, 16))
        pool.clear()  # ends the group, every page free in ascending order
        pool.free_group_begin()  # a group of the caller's own, begun after the clear
        pool.free(pool.alloc(16))  # page 0, pending
        assert pool.available_size() == 48
    # The block did not end the caller's group.
    assert pool.stats().pending_pages == 1
    assert pool.available_size() == 48
    pool.free_group_end()
    assert pool.alloc(64).tolist() == list(range(16, 64)) + list(range(16))


def test_free_group_holds_pages_back_from_other_threads() -> None:
    """One thread keeps a group open; another allocates meanwhile and never gets a pending page."""
    ps = 16
    pool = LogicalHostPool(4 * ps, ps)
    held = pool.alloc(3 * ps)  # pages 0, 1, 2; page 3 free
    freed, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def scheduler() -> None:
        try:
            with pool.free_group():
                pool.free(held[: 2 * ps])  # pages 0 and 1, pending
                freed.set()
                assert done.wait(10)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=scheduler)
    thread.start()
    try:
        assert freed.wait(10)
        assert pool.available_size() == ps
        assert pool.alloc(2 * ps) is None
        assert pool.alloc_many([ps, ps]) is None
        assert pool.alloc(ps).tolist() == pg(3, ps)  # the free page, never a pending one
        assert pool.alloc(ps) is None
        stats = pool.stats()
        assert (stats.pending_pages, stats.allocated_pages) == (2, 2)
    finally:
        done.set()
        thread.join(10)
    assert not thread.is_alive()
    assert errors == []
    assert pool.alloc(2 * ps).tolist() == pages_of(0, 1, ps=ps)
    pool.check_invariants()


# -- sorted merge order --------------------------------------------------------------


def test_sorted_merge_order_on_concrete_pages() -> None:
    ps = 2
    fifo, srt = LogicalHostPool(8 * ps, ps), LogicalHostPool(8 * ps, ps, merge="sorted")
    for pool in (fifo, srt):
        assert pool.alloc(6 * ps).tolist() == list(range(6 * ps))  # pages 6, 7 free
        pool.free(pg(5, ps))
        pool.free(pg(1, ps))
    # Three pages needed, two free: a merge. FIFO: 6, 7, then 5 as released.
    # Sorted: every available page ascending, 1 5 6 7.
    assert fifo.alloc(3 * ps).tolist() == pages_of(6, 7, 5, ps=ps)
    assert srt.alloc(3 * ps).tolist() == pages_of(1, 5, 6, ps=ps)
    assert srt.alloc(ps).tolist() == pg(7, ps)
    srt.check_invariants()


def test_sorted_merge_leaves_pending_pages_alone() -> None:
    ps = 2
    pool = LogicalHostPool(8 * ps, ps, merge="sorted")
    everything = pool.alloc(8 * ps)
    for p in (6, 1, 4):
        pool.free(everything[p * ps : (p + 1) * ps])
    pool.free_group_begin()
    pool.free(pg(3, ps))
    pool.free(pg(0, ps))
    assert pool.merge() == 3 * ps  # the released pages only
    assert pool.merge() == 0
    stats = pool.stats()
    assert (stats.free_pages, stats.released_pages, stats.pending_pages, stats.merges) == (3, 0, 2, 1)
    pool.check_invariants()  # includes: the free list ascends
    assert pool.alloc(4 * ps) is None  # pending pages are not available
    assert pool.alloc(3 * ps).tolist() == pages_of(1, 4, 6, ps=ps)
    pool.free_group_end()  # 3 then 0 released: sorted at the next merge, not before
    pool.free(pg(6, ps))
    assert pool.alloc(3 * ps).tolist() == pages_of(0, 3, 6, ps=ps)
    pool.check_invariants()


def test_merge_returns_an_int() -> None:
    pool = LogicalHostPool(64, 16)
    assert pool.free(pool.alloc(32)) == 32
    moved, nothing = pool.merge(), pool.merge()
    assert (moved, nothing) == (32, 0)
    assert type(moved) is int
    assert type(nothing) is int


def test_fifo_merge_keeps_the_release_order() -> None:
    pool = LogicalHostPool(64, 16)
    everything = pool.alloc(64)
    pool.free(everything[32:48])
    pool.free(everything[:16])
    assert pool.merge() == 32
    assert pool.stats().merges == 1
    assert pool.alloc(32).tolist() == pg(2, 16) + pg(0, 16)


# -- repr and stats ------------------------------------------------------------------


def test_repr_shows_usage() -> None:
    pool = LogicalHostPool(48, 16)
    assert repr(pool) == (
        "LogicalHostPool(size=48, page_size=16, merge='fifo': 0/3 pages allocated (0.0%), "
        "available=48, pending_pages=0)"
    )
    held = pool.alloc(32)
    assert repr(pool) == (
        "LogicalHostPool(size=48, page_size=16, merge='fifo': 2/3 pages allocated (66.7%), "
        "available=16, pending_pages=0)"
    )
    with pool.free_group():
        pool.free(held[:16])
        assert repr(pool) == (
            "LogicalHostPool(size=48, page_size=16, merge='fifo': 1/3 pages allocated (33.3%), "
            "available=16, pending_pages=1)"
        )
    assert repr(LogicalHostPool(0, 4, merge="sorted")) == (
        "LogicalHostPool(size=0, page_size=4, merge='sorted': 0/0 pages allocated (0.0%), available=0, pending_pages=0)"
    )

    class MyPool(LogicalHostPool):
        pass

    mine = MyPool(16, 16)
    mine.alloc(16)
    assert repr(mine) == (
        "MyPool(size=16, page_size=16, merge='fifo': 1/1 pages allocated (100.0%), available=0, pending_pages=0)"
    )


def _stats(**values: int) -> PoolStats:
    base = {"size": 16, "page_size": 4, "num_pages": 4}
    return PoolStats(**base, **values)


def test_stats_after_a_known_sequence() -> None:
    ps = 4
    pool = LogicalHostPool(4 * ps, ps)
    zero = {"merges": 0, "alloc_calls": 0, "failed_allocs": 0, "free_calls": 0, "peak_allocated_pages": 0}
    assert pool.stats() == _stats(
        free_pages=4, released_pages=0, pending_pages=0, allocated_pages=0, available_size=16, **zero
    )
    a = pool.alloc(2 * ps)  # pages 0, 1
    assert pool.alloc(0).tolist() == []  # answered: counted
    assert pool.alloc(4 * ps) is None  # refused: counted, failed
    with pytest.raises(AlignmentError):
        pool.alloc(3)  # raised: not counted
    slots, _ = pool.alloc_many([ps, ps])  # pages 2, 3
    assert pool.alloc_many([ps]) is None
    with pytest.raises(AlignmentError):
        pool.alloc_many([ps, 1])
    assert pool.stats() == _stats(
        free_pages=0,
        released_pages=0,
        pending_pages=0,
        allocated_pages=4,
        available_size=0,
        merges=0,
        alloc_calls=5,
        failed_allocs=2,
        free_calls=0,
        peak_allocated_pages=4,
    )
    assert pool.stats().usage == 1.0
    assert pool.free(a[:ps]) == ps  # page 0 released
    assert pool.free([]) == 0  # nothing freed: not counted
    with pytest.raises(DoubleFreeError):
        pool.free(a[:ps])  # raised: not counted
    with pool.free_group():
        assert pool.free(a[ps:]) == ps  # page 1 pending: counted
        assert pool.stats() == _stats(
            free_pages=0,
            released_pages=1,
            pending_pages=1,
            allocated_pages=2,
            available_size=4,
            merges=0,
            alloc_calls=5,
            failed_allocs=2,
            free_calls=2,
            peak_allocated_pages=4,
        )
        assert pool.stats().usage == 0.5
    again = pool.alloc(ps)  # needs a merge (the first): pages 0 and 1 join the free list
    assert again.tolist() == pg(0, ps)
    assert pool.merge() == 0  # nothing released: not counted
    assert pool.free(again) == ps
    assert pool.merge() == ps  # page 0: the second merge
    pool.clear()  # counters survive
    assert pool.alloc_many([2**70 * ps]) is None  # beyond int64: refused, counted
    stats = pool.stats()
    assert stats == _stats(
        free_pages=4,
        released_pages=0,
        pending_pages=0,
        allocated_pages=0,
        available_size=16,
        merges=2,
        alloc_calls=7,
        failed_allocs=3,
        free_calls=3,
        peak_allocated_pages=4,
    )
    assert stats.usage == 0.0
    assert all(type(v) is int for v in dataclasses.astuple(stats))
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.merges = 0  # type: ignore[misc]
    assert slots.tolist() == pages_of(2, 3, ps=ps)


def test_pool_state_and_stats_are_exported() -> None:
    assert hostpool_nb.PoolStats is PoolStats
    assert hostpool_nb.PoolState is PoolState
    assert {"PoolState", "PoolStats"} <= set(hostpool_nb.__all__)
    assert LogicalHostPool(0, 1).stats().usage == 0.0


# -- backup_state cost --------------------------------------------------------------


def test_backup_state_makes_one_copy(all_kernels: None) -> None:
    pool = LogicalHostPool(2**18, 1)
    nbytes = pool._st.nbytes
    pool.backup_state()
    tracemalloc.start()
    try:
        state = pool.backup_state()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert state._words.nbytes == nbytes
    assert peak < 1.5 * nbytes, f"backup_state peaked at {peak / nbytes:.2f}x the state's {nbytes} bytes"


# -- pickles load in a later process ---------------------------------------------------

_CHILD = """
import dataclasses, json, pickle, sys
from pathlib import Path

from tests.scheduler_ops import run_ops

folder = Path({folder!r})
spec = json.loads((folder / "spec.json").read_text())
result = {{}}
for name in spec["pools"]:
    with open(folder / (name + ".pool"), "rb") as f:
        pool = pickle.load(f)
    with open(folder / (name + ".state"), "rb") as f:
        state = pickle.load(f)
    pool.check_invariants()
    entry = {{
        "type": type(pool).__module__ + "." + type(pool).__qualname__,
        "dtype": str(pool.dtype),
        "lock": type(pool.lock).__name__,
        "stats": list(dataclasses.astuple(pool.stats())),
        "ops": run_ops(pool, spec["seed"], spec["held"]),
        "state": [type(state).__name__, state.size, state.page_size, state.merge],
    }}
    pool.check_invariants()
    fresh = type(pool)(state.size, state.page_size, merge=state.merge)
    fresh.restore_state(state)
    fresh.check_invariants()
    entry["restored_ops"] = run_ops(fresh, spec["seed"], spec["held"])
    entry["torch_loaded"] = "torch" in sys.modules
    result[name] = entry
print(json.dumps(result))
"""


def _save_pools(folder: Path, pools: dict[str, Any], seed: int, held: list[int]) -> dict[str, Any]:
    """Pickle each pool and a snapshot of it; return what the child must report."""
    expected = {}
    for name, pool in pools.items():
        state = pool.backup_state()
        (folder / f"{name}.pool").write_bytes(pickle.dumps(pool))
        (folder / f"{name}.state").write_bytes(pickle.dumps(state))
        stats = list(dataclasses.astuple(pool.stats()))
        ops = json.loads(json.dumps(run_ops(copy.deepcopy(pool), seed, held)))
        expected[name] = {
            "type": type(pool).__module__ + "." + type(pool).__qualname__,
            "dtype": str(pool.dtype),
            "lock": "RLock",
            "stats": stats,
            "ops": ops,
            "state": ["PoolState", pool.size, pool.page_size, pool.merge_order],
            "restored_ops": ops,
            "torch_loaded": type(pool).__module__ == "hostpool_nb.torch",  # a core pickle never needs torch
        }
    (folder / "spec.json").write_text(json.dumps({"pools": list(pools), "seed": seed, "held": held}))
    return expected


def _loaded_in_child(folder: Path) -> dict[str, Any]:
    """What a fresh interpreter, which has imported nothing yet, reports on the pickles."""
    return run_child(_CHILD.format(folder=str(folder)))


@pytest.mark.slow
def test_pickles_load_in_a_later_process(tmp_path: Path) -> None:
    pools = {"fifo": rich_pool(16, "fifo"), "sorted": rich_pool(3, "sorted")}
    for pool in pools.values():
        pool.free_group_begin()  # depth 2: the child must end both groups to release page 4
    expected = _save_pools(tmp_path, pools, seed=4242, held=[0, 1, 3])
    assert expected["fifo"]["type"] == "hostpool_nb.LogicalHostPool"  # its public path: pickles name it
    assert min(summary(expected["fifo"]["ops"]).values()) > 0
    got = _loaded_in_child(tmp_path)
    assert got == expected
    # The originals were not touched by pickling: they still answer the same.
    assert json.loads(json.dumps(run_ops(pools["fifo"], 4242, [0, 1, 3]))) == got["fifo"]["ops"]


@pytest.mark.slow
@pytest.mark.torch
def test_torch_pickles_load_in_a_later_process(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import hostpool_nb.torch as hpt

    pools = {}
    for name, ps, merge in (("fifo", 16, "fifo"), ("sorted", 1, "sorted")):
        pool = hpt.LogicalHostPool(6 * ps, ps, merge=merge)
        held = pool.alloc(5 * ps)
        pool.free(held[2 * ps : 3 * ps])
        pool.free_group_begin()
        pool.free(held[4 * ps :])
        pools[name] = pool
    expected = _save_pools(tmp_path, pools, seed=99, held=[0, 1, 3])
    assert expected["fifo"]["type"] == "hostpool_nb.torch.LogicalHostPool"
    assert expected["fifo"]["dtype"] == "torch.uint8"
    got = _loaded_in_child(tmp_path)  # unpickling imports hostpool_nb.torch, and torch
    assert got == expected


def test_child_process_sees_the_same_jit_setting() -> None:
    """The later-process tests run the kernels as this process does (run_child passes the environment)."""
    code = "import json, os; print(json.dumps(os.environ.get('NUMBA_DISABLE_JIT') == '1'))"
    assert run_child(code) is JIT_DISABLED


def test_run_ops_is_deterministic_and_sensitive() -> None:
    """The helper behind the identical-behaviour checks: same pool state, same answers; other state, others."""
    a, b = family_pool(16), family_pool(16)
    assert run_ops(a, 5, [0, 1, 3, 4]) == run_ops(b, 5, [0, 1, 3, 4])
    c, d = family_pool(16), family_pool(16)
    d.free(pg(4, 16))  # one page moved to the release list
    assert run_ops(c, 5, [0, 1, 3]) != run_ops(d, 5, [0, 1, 3])
