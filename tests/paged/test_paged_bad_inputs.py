"""hostpool_nb.paged: every misuse of every method, the constructors, the import, forwarding, attributes.

Each bad call must raise the documented type with its exact message and
leave every rank as it was: lists, owner flags and the free group buffer
(``tests/paged_model.py``'s ``capture``), and the lock free. The setup is
a paged allocator of 2 ranks of 8 pages of 4 slots (size 67: 3 spare
slots), each rank's slots 4..35 (page 0, slots 0..3, is the padding page):

- rank 0: requests of 6 and 3 tokens (pages 1, 2 and 3), two pages held
  by ``alloc`` (4 and 5), of which page 4 was freed (on the release list);
  the free list is 6, 7, 8;
- rank 1: pages 1, 2 and 3 held; free list 4..8;

once outside any free group and once inside one, in which rank 1's page 2
was freed (pending). The token allocator's setup is alike (2 ranks of 8
slots, see ``token``).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostpool_nb import AlignmentError, DoubleFreeError, HostPoolError, PagedOnlyError, SlotRangeError
from hostpool_nb._kernels import layout as L
from hostpool_nb._kernels.layout import owner_flags, ring_ids
from hostpool_nb.originals import paged as oracle_mod
from hostpool_nb.paged import PagedState, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from tests.conftest import RaisingEq, one_entry_per_page
from tests.paged_model import assert_unchanged, capture, compare, pending_pages

ROOT = Path(__file__).resolve().parents[2]
PS = 4
SIZE = 2 * 8 * PS + 3
SHAPE = ("paged", SIZE, PS, 2)
RANGE0 = "outside rank 0's pages 1..8 (slots 4..35)"


def make_paged(group: bool, **kw: Any) -> PagedTokenToKVPoolAllocator:
    a = PagedTokenToKVPoolAllocator(SIZE, PS, None, dp_size=2, **kw)
    assert a.alloc_extend([0, 0], [6, 3], [-1, -1], 9).tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14]
    assert a.alloc(8).tolist() == list(range(16, 24))
    assert a.free(list(range(16, 20))) == 1
    assert a.alloc(12, dp_rank=1).tolist() == list(range(4, 16))
    if group:
        a.free_group_begin()
        assert a.free(np.arange(8, 12), dp_rank=1) == 1
    assert [f.tolist() for f in a.free_pages] == [[6, 7, 8], [4, 5, 6, 7, 8]]
    assert [r.tolist() for r in a.release_pages] == [[4], []]
    assert a.is_not_in_free_group is not group
    return a


@pytest.fixture(params=[False, True], ids=["outside a group", "in a group"])
def paged(request: pytest.FixtureRequest) -> PagedTokenToKVPoolAllocator:
    return make_paged(request.param)


@pytest.fixture(params=[False, True], ids=["outside a group", "in a group"])
def token(request: pytest.FixtureRequest) -> TokenToKVPoolAllocator:
    """2 ranks of 8 slots (size 17): rank 0 holds 1, 3, 5, its free list is 6, 7, 8, 2, 4; rank 1 holds 1, 2, 3."""
    t = TokenToKVPoolAllocator(17, None, dp_size=2)
    assert t.alloc(5).tolist() == [1, 2, 3, 4, 5]
    assert t.free([2, 4]) == 2
    assert t.alloc(3, dp_rank=1).tolist() == [1, 2, 3]
    if request.param:
        t.free_group_begin()
        assert t.free([2], dp_rank=1) == 1  # pending: slot 2 of rank 1 stays allocated
    assert [s.tolist() for s in t.free_slots] == [[6, 7, 8, 2, 4], [4, 5, 6, 7, 8]]
    return t


def check_error(alloc: Any, call: Callable[[Any], Any], error: type[BaseException], message: str) -> None:
    """``call(alloc)`` raises exactly ``error`` with exactly ``message``, and changes nothing."""
    before = capture(alloc)
    with pytest.raises(error) as info:
        call(alloc)
    assert type(info.value) is error
    assert str(info.value) == message
    assert_unchanged(alloc, before)


def _ne(name: str, got: str) -> str:
    """as_count's message for a non-integer count."""
    return f"{name} must be an integer, got {got}"


def _slots_hold(dtype: str) -> str:
    """as_slots' message for slot ids that are no integers."""
    return (
        f"free_index must hold integers, got dtype {dtype}; "
        "convert with .astype(np.int64) if the values are whole slot ids"
    )


def _dp(value: int) -> str:
    return f"dp_rank must be in [0, 2), got dp_rank={value}"


class _RaisingIndex:
    """A list element whose ``__index__`` raises something other than ``TypeError``."""

    def __index__(self) -> int:
        raise ZeroDivisionError("no index here")

    def __repr__(self) -> str:
        return "_RaisingIndex()"


_EQ_RAISES = "must hold integers, got RaisingEq (comparing it raised)"


# -- dp_rank, for every method that takes one -------------------------------------------

_RANKED_CALLS: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("free", lambda a, r: a.free([4], dp_rank=r)),
    ("alloc", lambda a, r: a.alloc(4, dp_rank=r)),
    ("alloc_extend", lambda a, r: a.alloc_extend([0], [1], [-1], 1, dp_rank=r)),
    ("alloc_decode", lambda a, r: a.alloc_decode([1], [-1], dp_rank=r)),
    ("merge_and_sort_free", lambda a, r: a.merge_and_sort_free(r)),
    ("available_size", lambda a, r: a.available_size(r)),
    ("clear", lambda a, r: a.clear(r)),
]
_BAD_RANKS = [
    pytest.param(2, HostPoolError, _dp(2), id="2"),
    pytest.param(-1, HostPoolError, _dp(-1), id="-1"),
    pytest.param(np.int64(7), HostPoolError, _dp(7), id="numpy-7"),
    pytest.param(2**70, HostPoolError, _dp(2**70), id="huge"),
    pytest.param(1.0, TypeError, _ne("dp_rank", "float 1.0"), id="float"),
    pytest.param(True, TypeError, _ne("dp_rank", "bool True"), id="bool"),
    pytest.param("0", TypeError, _ne("dp_rank", "str '0'"), id="str"),
    pytest.param(
        np.array(0),
        TypeError,
        _ne("dp_rank", "ndarray array(0); pass a Python int (e.g. int(x)) for a count held in an array"),
        id="0d-array",
    ),
]


@pytest.mark.parametrize(("rank", "error", "message"), _BAD_RANKS)
@pytest.mark.parametrize(("method", "call"), _RANKED_CALLS, ids=[m for m, _ in _RANKED_CALLS])
def test_bad_dp_rank(
    paged: PagedTokenToKVPoolAllocator, method: str, call: Any, rank: Any, error: type, message: str
) -> None:
    check_error(paged, lambda a: call(a, rank), error, message)


def test_bad_dp_rank_none() -> None:
    # None is "every rank" for clear() only; elsewhere it is no rank.
    a = make_paged(False)
    for _, call in _RANKED_CALLS[:-1]:
        check_error(a, lambda a, call=call: call(a, None), TypeError, _ne("dp_rank", "NoneType None"))


@pytest.mark.parametrize("rank", [2, -1, 1.0, True])
def test_token_bad_dp_rank(token: TokenToKVPoolAllocator, rank: Any) -> None:
    message = _dp(rank) if type(rank) is int else _ne("dp_rank", f"{type(rank).__name__} {rank!r}")
    error = HostPoolError if type(rank) is int else TypeError
    for call in (
        lambda t: t.free([1], dp_rank=rank),
        lambda t: t.alloc(1, dp_rank=rank),
        lambda t: t.available_size(rank),
        lambda t: t.clear(rank),
        lambda t: t.merge_and_sort_free(rank),
    ):
        check_error(token, call, error, message)


@pytest.mark.parametrize(
    "args",
    [(), ([0], [1], [-1], 1), ("x", None), ([0], [1], [-1], 1, 5)],
    ids=["none", "a batch", "garbage", "a bad rank"],
)
@pytest.mark.parametrize("name", ["alloc_extend", "alloc_decode"])
def test_token_batch_calls_are_a_paged_allocators(token: TokenToKVPoolAllocator, name: str, args: Any) -> None:
    """Whatever they are given: the original's NotImplementedError (and a HostPoolError), nothing changed."""
    message = (
        f"{name} is only for paged allocator: TokenToKVPoolAllocator at page size 1 hands out single slots; "
        "use alloc(n)"
    )
    check_error(token, lambda t: getattr(t, name)(*args), PagedOnlyError, message)
    assert issubclass(PagedOnlyError, NotImplementedError)


# -- free -------------------------------------------------------------------------

PAGED_FREE_CASES = [
    # The padding page 0, first or after valid slots (whose page must not be freed).
    pytest.param(
        [0],
        SlotRangeError,
        "free got slot 0 at free_index[0] (flattened), in the padding page 0, which is never allocated",
        id="slot-0",
    ),
    pytest.param(
        [4, 5, 12, 3],
        SlotRangeError,
        "free got slot 3 at free_index[3] (flattened), in the padding page 0, which is never allocated",
        id="valid-then-page-0",
    ),
    # Beyond the rank's pages (slot 36 is page 9; the spare slots 64..66 too), and negative slots.
    pytest.param([36], SlotRangeError, f"free got slot 36 at free_index[0] (flattened), {RANGE0}", id="page-9"),
    pytest.param([4, 66], SlotRangeError, f"free got slot 66 at free_index[1] (flattened), {RANGE0}", id="spare"),
    pytest.param([-1], SlotRangeError, f"free got slot -1 at free_index[0] (flattened), {RANGE0}", id="negative"),
    pytest.param(
        np.array([4, 2**40]), SlotRangeError, f"free got slot {2**40} at free_index[1] (flattened), {RANGE0}", id="far"
    ),
    pytest.param(
        np.array([4, 2**63], dtype=np.uint64),
        SlotRangeError,
        f"free got slot {2**63} at free_index[1] (flattened), outside the int64 range",
        id="uint64-beyond-int64",
    ),
    pytest.param(
        [4, 2**64],
        SlotRangeError,
        f"free got slot {2**64} at free_index[1] (flattened), outside the int64 range",
        id="python-int-beyond-int64",
    ),
    # Not integers: floats, bools, strings, None, scalars, ragged lists; the 2-D ones too.
    pytest.param(
        [4.0],
        TypeError,
        _slots_hold("float64"),
        id="float-list",
    ),
    pytest.param(
        np.array([[4.0, 5.0]]),
        TypeError,
        _slots_hold("float64"),
        id="float-2d",
    ),
    pytest.param(
        np.array([True]),
        TypeError,
        _slots_hold("bool"),
        id="bool-array",
    ),
    pytest.param(
        [True, False],
        TypeError,
        _slots_hold("bool"),
        id="bool-list",
    ),
    pytest.param("4", TypeError, "free_index must be an array of integer slot ids, got str", id="str"),
    pytest.param(
        np.array(["4"]),
        TypeError,
        _slots_hold("<U1"),
        id="str-array",
    ),
    pytest.param(
        None,
        TypeError,
        "free_index must be an array of integer slot ids, got a scalar None; wrap it in a list",
        id="none",
    ),
    pytest.param(
        4, TypeError, "free_index must be an array of integer slot ids, got a scalar 4; wrap it in a list", id="int"
    ),
    pytest.param([4, _RaisingIndex()], TypeError, _slots_hold("object"), id="index-raises"),
]


@pytest.mark.parametrize(("slots", "error", "message"), PAGED_FREE_CASES)
def test_bad_free(paged: PagedTokenToKVPoolAllocator, slots: Any, error: type, message: str) -> None:
    check_error(paged, lambda a: a.free(slots), error, message)


def test_bad_free_names_the_rank(paged: PagedTokenToKVPoolAllocator) -> None:
    message = "free got slot 36 at free_index[0] (flattened), outside rank 1's pages 1..8 (slots 4..35)"
    check_error(paged, lambda a: a.free([36], dp_rank=1), SlotRangeError, message)


def test_bad_free_ragged(paged: PagedTokenToKVPoolAllocator) -> None:
    # numpy's own words follow the colon; they vary between numpy versions.
    before = capture(paged)
    with pytest.raises(TypeError) as info:
        paged.free([[4], [5, 6]])
    assert type(info.value) is TypeError
    assert str(info.value).startswith("free_index must be an array of integer slot ids, got list: ")
    assert_unchanged(paged, before)


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        # Page 4 was released in the setup; page 8 was never handed out.
        pytest.param(
            range(16, 20), "page 4 (slots 16..19) of rank 0, freed at free_index[0] (flattened)", id="released"
        ),
        pytest.param([33], "page 8 (slots 32..35) of rank 0, freed at free_index[0] (flattened)", id="never-allocated"),
        # A held page first: it must stay held.
        pytest.param([4, 5, 20, 34], "page 8 (slots 32..35) of rank 0, freed at free_index[3] (flattened)", id="late"),
    ],
)
@pytest.mark.parametrize("group", [False, True], ids=["outside a group", "in a group"])
def test_strict_double_free(group: bool, slots: Any, message: str) -> None:
    a = make_paged(group, strict=True)
    check_error(a, lambda a: a.free(list(slots)), DoubleFreeError, message + ", is not allocated: it was freed already")


def test_strict_free_of_a_page_pending_in_the_group() -> None:
    a = make_paged(True, strict=True)
    message = "page 2 (slots 8..11) of rank 1, freed at free_index[1] (flattened), was already freed in this free group"
    check_error(a, lambda a: a.free([4, 10], dp_rank=1), DoubleFreeError, message)
    # Without strict the same free is fine: page 1 is made pending, page 2 stays pending once.
    b = make_paged(True)
    assert b.free([4, 10], dp_rank=1) == 1
    b.free_group_end()
    assert sorted(b.release_pages[1].tolist()) == [1, 2]


def test_strict_repeats_within_one_call_are_one_free() -> None:
    # Callers free token ranges that share pages: one call naming a page twice frees it once.
    a = make_paged(False, strict=True)
    assert a.free([4, 5, 6, 4, 7]) == 1
    assert a.release_pages[0].tolist() == [4, 1]


TOKEN_FREE_CASES = [
    pytest.param(
        [0],
        SlotRangeError,
        "free got slot 0 at free_index[0] (flattened), in the padding page 0, which is never allocated",
        id="slot-0",
    ),
    pytest.param(
        [1, 9],
        SlotRangeError,
        "free got slot 9 at free_index[1] (flattened), outside rank 0's pages 1..8 (slots 1..8)",
        id="beyond",
    ),
    # Slot 2 was freed in the setup (across calls); slot 7 was never handed out.
    pytest.param(
        [1, 2],
        DoubleFreeError,
        "slot 2 of rank 0, freed at free_index[1] (flattened), is not allocated: it was freed already",
        id="twice-across-calls",
    ),
    pytest.param(
        [7],
        DoubleFreeError,
        "slot 7 of rank 0, freed at free_index[0] (flattened), is not allocated: it was freed already",
        id="never-allocated",
    ),
    pytest.param(
        np.array([[3.0]]),
        TypeError,
        _slots_hold("float64"),
        id="float-2d",
    ),
    pytest.param(
        [True],
        TypeError,
        _slots_hold("bool"),
        id="bool",
    ),
    pytest.param("1", TypeError, "free_index must be an array of integer slot ids, got str", id="str"),
    pytest.param(
        None,
        TypeError,
        "free_index must be an array of integer slot ids, got a scalar None; wrap it in a list",
        id="none",
    ),
]


@pytest.mark.parametrize(("slots", "error", "message"), TOKEN_FREE_CASES)
def test_token_bad_free(token: TokenToKVPoolAllocator, slots: Any, error: type, message: str) -> None:
    check_error(token, lambda t: t.free(slots), error, message)


def test_token_double_free_in_one_call(token: TokenToKVPoolAllocator) -> None:
    if token.is_not_in_free_group:
        message = "slot 1 of rank 0 is freed twice in one call (again at free_index[2] (flattened))"
    else:  # inside a group, the slot was already freed (earlier in this call) in this group
        message = "slot 1 of rank 0, freed at free_index[2] (flattened), was already freed in this free group"
    check_error(token, lambda t: t.free([1, 3, 1]), DoubleFreeError, message)


def test_token_double_free_in_a_group(token: TokenToKVPoolAllocator) -> None:
    token.free_group_begin()
    assert token.free([3]) == 1
    message = "slot 3 of rank 0, freed at free_index[1] (flattened), was already freed in this free group"
    check_error(token, lambda t: t.free([5, 3]), DoubleFreeError, message)
    if pending_pages(token, 1):  # the fixture's group (this begin continued it): slot 2 of rank 1 is pending
        message = "slot 2 of rank 1, freed at free_index[0] (flattened), was already freed in this free group"
        check_error(token, lambda t: t.free([2], dp_rank=1), DoubleFreeError, message)


@pytest.mark.parametrize("kind", ["token", "strict paged"])
def test_double_free_of_a_page_pending_after_a_clear_of_another_rank(kind: str) -> None:
    if kind == "token":
        a: Any = TokenToKVPoolAllocator(16, None, dp_size=2)
        assert a.alloc(2, dp_rank=1).tolist() == [1, 2]
        slots = [1]
    else:
        a = PagedTokenToKVPoolAllocator(64, 4, None, dp_size=2, strict=True)
        assert a.alloc(8, dp_rank=1).tolist() == list(range(4, 12))
        slots = [4, 5, 6, 7]
    a.free_group_begin()
    assert a.free(slots, dp_rank=1) == 1
    a.clear(0)  # leaves the group; rank 1's free stays pending until the next free_group_end()
    assert a.is_not_in_free_group
    before = capture(a)
    with pytest.raises(DoubleFreeError, match=r"^(slot|page) 1 .*of rank 1, .*in a free group that clear\(\) ended"):
        a.free(slots, dp_rank=1)
    assert_unchanged(a, before)


def test_token_free_of_ints_and_bools_is_a_type_error() -> None:
    t = TokenToKVPoolAllocator(8, None)
    assert t.alloc(5).tolist() == [1, 2, 3, 4, 5]
    before = capture(t)
    with pytest.raises(TypeError):
        t.free([5, True])  # frees slots 5 and 1
    assert_unchanged(t, before)


# -- alloc -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("need", "error", "message"),
    [
        pytest.param(3, AlignmentError, "alloc must be page-aligned, got need_size=3, page_size=4", id="misaligned"),
        pytest.param(-3, AlignmentError, "alloc must be page-aligned, got need_size=-3, page_size=4", id="neg-misal"),
        pytest.param(-4, HostPoolError, "need_size must be non-negative, got need_size=-4", id="negative"),
        pytest.param(4.0, TypeError, _ne("need_size", "float 4.0"), id="float"),
        pytest.param(True, TypeError, _ne("need_size", "bool True"), id="bool"),
        pytest.param("4", TypeError, _ne("need_size", "str '4'"), id="str"),
        pytest.param(None, TypeError, _ne("need_size", "NoneType None"), id="none"),
        pytest.param([4], TypeError, _ne("need_size", "list [4]"), id="list"),
        pytest.param(
            np.array([[4]]),
            TypeError,
            _ne("need_size", "ndarray array([[4]]); pass a Python int (e.g. int(x)) for a count held in an array"),
            id="2d",
        ),
    ],
)
def test_bad_alloc(paged: PagedTokenToKVPoolAllocator, need: Any, error: type, message: str) -> None:
    check_error(paged, lambda a: a.alloc(need), error, message)


@pytest.mark.parametrize(
    ("need", "error", "message"),
    [
        pytest.param(-1, HostPoolError, "need_size must be non-negative, got need_size=-1", id="negative"),
        pytest.param(2.0, TypeError, _ne("need_size", "float 2.0"), id="float"),
        pytest.param(False, TypeError, _ne("need_size", "bool False"), id="bool"),
        pytest.param("2", TypeError, _ne("need_size", "str '2'"), id="str"),
        pytest.param(None, TypeError, _ne("need_size", "NoneType None"), id="none"),
    ],
)
def test_token_bad_alloc(token: TokenToKVPoolAllocator, need: Any, error: type, message: str) -> None:
    check_error(token, lambda t: t.alloc(need), error, message)


# -- alloc_extend and alloc_decode --------------------------------------------------------


def _must_hold(name: str, dtype: str) -> str:
    return f"{name} must hold integers, got dtype {dtype}"


EXTEND_CASES = [
    # Lengths: each argument shorter, then longer.
    pytest.param(
        ([0], [1, 2], [-1], 1),
        HostPoolError,
        "prefix_lens, seq_lens and last_loc must have the same length, got 1, 2 and 1",
        id="seq-longer",
    ),
    pytest.param(
        ([0, 0], [1, 1], [-1], 2),
        HostPoolError,
        "prefix_lens, seq_lens and last_loc must have the same length, got 2, 2 and 1",
        id="last-shorter",
    ),
    pytest.param(
        ([], [1], [-1], 1),
        HostPoolError,
        "prefix_lens, seq_lens and last_loc must have the same length, got 0, 1 and 1",
        id="prefix-empty",
    ),
    # Negative prefix, shrinking request: the position named is the request's.
    pytest.param(
        ([0, -1], [1, 1], [-1, -1], 3),
        HostPoolError,
        "prefix_lens[1] must be non-negative, got prefix_lens[1]=-1",
        id="negative-prefix",
    ),
    pytest.param(
        ([0], [-1], [-1], 0),
        HostPoolError,
        "seq_lens[0]=-1 is below prefix_lens[0]=0: a request cannot shrink",
        id="negative-seq",
    ),
    pytest.param(
        ([6, 3], [7, 1], [9, 14], 1),
        HostPoolError,
        "seq_lens[1]=1 is below prefix_lens[1]=3: a request cannot shrink",
        id="seq-below-prefix",
    ),
    # extend_num_tokens: fewer, more, negative.
    pytest.param(
        ([0], [5], [-1], 4),
        HostPoolError,
        "extend_num_tokens=4 is not the sum of seq_lens - prefix_lens (5)",
        id="total-short",
    ),
    pytest.param(
        ([0, 6], [5, 7], [-1, 9], 7),
        HostPoolError,
        "extend_num_tokens=7 is not the sum of seq_lens - prefix_lens (6)",
        id="total-long",
    ),
    pytest.param(
        ([0], [5], [-1], -1),
        HostPoolError,
        "extend_num_tokens must be non-negative, got extend_num_tokens=-1",
        id="total-negative",
    ),
    # Types of the batch arguments.
    pytest.param(([0.0], [1], [-1], 1), TypeError, _must_hold("prefix_lens", "float64"), id="float-list"),
    pytest.param(([0], np.array([1.0]), [-1], 1), TypeError, _must_hold("seq_lens", "float64"), id="float-array"),
    pytest.param(([0], [1], np.array([True]), 1), TypeError, _must_hold("last_loc", "bool"), id="bool-array"),
    pytest.param((["0"], [1], [-1], 1), TypeError, _must_hold("prefix_lens", "<U1"), id="str-element"),
    pytest.param(([None], [1], [-1], 1), TypeError, _must_hold("prefix_lens", "object"), id="none-element"),
    pytest.param(
        ([0], [1], "x", 1), TypeError, "last_loc must be a 1-D sequence or array of integers, got str", id="str"
    ),
    pytest.param((None, [1], [-1], 1), TypeError, "prefix_lens must be 1-D, got NoneType of shape ()", id="none"),
    pytest.param((0, [1], [-1], 1), TypeError, "prefix_lens must be 1-D, got int of shape ()", id="scalar"),
    pytest.param(([0], [[1]], [-1], 1), TypeError, "seq_lens must be 1-D, got list of shape (1, 1)", id="2d-list"),
    pytest.param(
        ([0], [1], np.array([[-1]]), 1), TypeError, "last_loc must be 1-D, got ndarray of shape (1, 1)", id="2d-array"
    ),
    # int64 arrays whose strides are not one 8-byte step: 2-D ones are refused as 2-D, whatever their strides.
    pytest.param(
        ([0, 0], np.broadcast_to(np.array([1, 1]), (2, 2)), [-1, -1], 2),
        TypeError,
        "seq_lens must be 1-D, got ndarray of shape (2, 2)",
        id="2d-broadcast",
    ),
    pytest.param(
        (np.zeros((2, 0), dtype=np.int64), [1], [-1], 1),
        TypeError,
        "prefix_lens must be 1-D, got ndarray of shape (2, 0)",
        id="2d-empty",
    ),
    # Types of extend_num_tokens.
    pytest.param(([0], [1], [-1], 1.0), TypeError, _ne("extend_num_tokens", "float 1.0"), id="total-float"),
    pytest.param(([0], [1], [-1], True), TypeError, _ne("extend_num_tokens", "bool True"), id="total-bool"),
    pytest.param(([0], [1], [-1], None), TypeError, _ne("extend_num_tokens", "NoneType None"), id="total-none"),
    pytest.param(([0], [1], [-1], "1"), TypeError, _ne("extend_num_tokens", "str '1'"), id="total-str"),
    pytest.param(
        ([0], [1], [-1], np.array(1)),
        TypeError,
        _ne("extend_num_tokens", "ndarray array(1); pass a Python int (e.g. int(x)) for a count held in an array"),
        id="total-0d-array",
    ),
    pytest.param(
        ([0], [2**70], [-1], 1), HostPoolError, "seq_lens holds a value beyond the int64 range", id="beyond-int64"
    ),
    # An element whose __index__ raises is not an integer, whatever it raises.
    pytest.param(([_RaisingIndex()], [1], [-1], 1), TypeError, _must_hold("prefix_lens", "object"), id="index-raises"),
    pytest.param(
        ([0, 0], [1, _RaisingIndex()], [-1, -1], 2), TypeError, _must_hold("seq_lens", "object"), id="index-raises-2nd"
    ),
    pytest.param(
        ([0], (1,), (_RaisingIndex(),), 1), TypeError, _must_hold("last_loc", "object"), id="tuple-index-raises"
    ),
    pytest.param(([RaisingEq(0)], [1], [-1], 1), TypeError, "prefix_lens " + _EQ_RAISES, id="eq-raises"),
]


@pytest.mark.parametrize(("args", "error", "message"), EXTEND_CASES)
def test_bad_alloc_extend(paged: PagedTokenToKVPoolAllocator, args: tuple[Any, ...], error: type, message: str) -> None:
    check_error(paged, lambda a: a.alloc_extend(*args), error, message)


@pytest.mark.parametrize("total", [2**50, 2**62])
def test_huge_extend_num_tokens_is_a_host_pool_error(paged: PagedTokenToKVPoolAllocator, total: int) -> None:
    message = f"extend_num_tokens={total} is not the sum of seq_lens - prefix_lens (1)"
    check_error(paged, lambda a: a.alloc_extend([0], [1], [-1], total), HostPoolError, message)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        pytest.param(lambda a: a.alloc_extend([True, False], [2, 1], [-1, -1], 2), "prefix_lens", id="extend-bools"),
        pytest.param(lambda a: a.alloc_extend([0], [True], [-1], 1), "seq_lens", id="extend-bool"),
        pytest.param(lambda a: a.alloc_decode([1, True], [-1, -1]), "seq_lens", id="decode-ints-and-bools"),
        pytest.param(lambda a: a.alloc_decode([1, np.array(True)], [-1, -1]), "seq_lens", id="decode-0d-bool-array"),
        pytest.param(lambda a: a.alloc_decode([1, 1], [-1, np.array(True)]), "last_loc", id="decode-0d-bool-last"),
    ],
)
def test_bool_lists_are_type_errors(call: Callable[[Any], Any], name: str) -> None:
    a = make_paged(False)
    check_error(a, call, TypeError, _must_hold(name, "bool") + " (a bool among the integers)")


_ELEMENTS = st.one_of(
    st.integers(-3, 3), st.integers(-(2**63), 2**63 - 1), st.integers(2**63, 2**70), st.booleans(), st.just(1.0)
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(_ELEMENTS, max_size=6), st.sampled_from(["list", "tuple", "array"])), min_size=1, max_size=3
    )
)
def test_batch_arguments_packed_at_once_convert_as_one_by_one(args: list[tuple[list[Any], str]]) -> None:
    """as_int_vectors (lists and tuples packed into one buffer) gives what as_int_vector gives per argument.

    The same arrays (int64, C-contiguous, one per argument), or the same error: the first bad argument's.
    """
    from hostpool_nb._convert import as_int_vector, as_int_vectors

    def given_as(values: list[Any], kind: str) -> Any:
        if kind == "array":
            try:
                return np.array(values)
            except OverflowError:
                return values
        return tuple(values) if kind == "tuple" else values

    values = tuple(given_as(v, kind) for v, kind in args)
    names = tuple(f"arg{i}" for i in range(len(values)))

    def outcome(convert: Callable[[], Any]) -> Any:
        try:
            return [(a.tolist(), a.dtype.str, a.flags.c_contiguous) for a in convert()]
        except (TypeError, HostPoolError) as exc:
            return type(exc).__name__, str(exc)

    one_by_one = outcome(lambda: tuple(as_int_vector(v, n) for v, n in zip(values, names, strict=True)))
    assert outcome(lambda: as_int_vectors(values, names)) == one_by_one


DECODE_CASES = [
    pytest.param(
        ([1, 2], [-1]), HostPoolError, "seq_lens and last_loc must have the same length, got 2 and 1", id="lengths"
    ),
    pytest.param(
        ([1, 0], [-1, -1]),
        HostPoolError,
        "seq_lens[1] must be at least 1 (it counts the new token), got 0",
        id="seq-0",
    ),
    pytest.param(
        (np.array([-5]), [-1]),
        HostPoolError,
        "seq_lens[0] must be at least 1 (it counts the new token), got -5",
        id="seq-negative",
    ),
    pytest.param(([1.0], [-1]), TypeError, _must_hold("seq_lens", "float64"), id="float"),
    pytest.param(([1], np.array([False])), TypeError, _must_hold("last_loc", "bool"), id="bool-array"),
    pytest.param(([1], ["x"]), TypeError, _must_hold("last_loc", "<U1"), id="str-element"),
    pytest.param((None, [-1]), TypeError, "seq_lens must be 1-D, got NoneType of shape ()", id="none"),
    pytest.param(([1], np.array([[-1]])), TypeError, "last_loc must be 1-D, got ndarray of shape (1, 1)", id="2d"),
    pytest.param((7, [9]), TypeError, "seq_lens must be 1-D, got int of shape ()", id="scalar"),
    pytest.param(([_RaisingIndex()], [-1]), TypeError, _must_hold("seq_lens", "object"), id="index-raises"),
    pytest.param(([1], [3, _RaisingIndex()]), TypeError, _must_hold("last_loc", "object"), id="index-raises-2nd"),
    pytest.param(([RaisingEq(1)], [-1]), TypeError, "seq_lens " + _EQ_RAISES, id="eq-raises"),
]


@pytest.mark.parametrize(("args", "error", "message"), DECODE_CASES)
def test_bad_alloc_decode(paged: PagedTokenToKVPoolAllocator, args: tuple[Any, ...], error: type, message: str) -> None:
    check_error(paged, lambda a: a.alloc_decode(*args), error, message)


def _extend_rule(i: int, last: int, prefix: int) -> str:
    return (
        f"debug_mode: request {i}: last_loc[{i}]={last} does not continue prefix_lens[{i}]={prefix} "
        "(expected (last_loc + 1) % page_size == prefix_lens % page_size, page_size=4)"
    )


def _decode_rule(i: int, last: int, seq: int) -> str:
    return (
        f"debug_mode: request {i}: last_loc[{i}]={last} does not continue seq_lens[{i}]={seq} "
        "(expected (last_loc + 2) % page_size == seq_lens % page_size, page_size=4)"
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        # Rank 0's requests: 6 tokens ending at slot 9, 3 tokens ending at slot 14.
        pytest.param(
            lambda a: a.alloc_extend([0, 6], [1, 7], [-1, 10], 2), _extend_rule(1, 10, 6), id="extend-off-by-one"
        ),
        pytest.param(lambda a: a.alloc_extend([0], [1], [0], 1), _extend_rule(0, 0, 0), id="extend-new-not-minus-1"),
        pytest.param(
            lambda a: a.alloc_extend([3, 6], [3, 6], [13, 9], 0), _extend_rule(0, 13, 3), id="extend-empty-extension"
        ),
        pytest.param(lambda a: a.alloc_decode([7, 4], [9, 15], 0), _decode_rule(1, 15, 4), id="decode-second"),
        pytest.param(lambda a: a.alloc_decode([1], [0]), _decode_rule(0, 0, 1), id="decode-new-not-minus-1"),
    ],
)
@pytest.mark.parametrize("group", [False, True], ids=["outside a group", "in a group"])
def test_debug_mode_violations(group: bool, call: Callable[[Any], Any], message: str) -> None:
    a = make_paged(group, debug_mode=True)
    check_error(a, call, HostPoolError, message)
    # Without debug_mode nothing checks last_loc: the call is served.
    b = make_paged(group)
    assert call(b) is not None


# -- restore_state ------------------------------------------------------------------


def _tampered(a: PagedTokenToKVPoolAllocator, change: Callable[[np.ndarray], None], rank: int = 0) -> PagedState:
    """A backup of ``a`` whose words of ``rank`` went through ``change``."""
    state = a.backup_state()
    words = [np.array(w) for w in state._ranks]
    change(words[rank])
    return PagedState(*SHAPE, tuple(words))


_FULL = "counters at or beyond 4611686018427387904 (2**62), more than a pool's calls reach: "


def _saturated(word: int, name: str, rank: int = 0) -> Any:
    """A RESTORE_CASES row: a counter word of ``rank`` at the int64 maximum, where its next step would wrap."""
    return pytest.param(
        lambda a: _tampered(a, lambda w: w.__setitem__(word, 2**63 - 1), rank),
        HostPoolError,
        f"the state of rank {rank} fails the invariants: " + _FULL + f"{name}={2**63 - 1}",
        id=f"saturated-{name}-rank-{rank}",
    )


def _ring(words: np.ndarray) -> np.ndarray:
    return one_entry_per_page(words)


def _owner(words: np.ndarray) -> np.ndarray:
    return owner_flags(words, 9)


def _swap_free(words: np.ndarray) -> None:
    ring, head = _ring(words), int(words[L.H_HEAD])
    ring[head % 9], ring[(head + 1) % 9] = ring[(head + 1) % 9], ring[head % 9]


def _repeat_free(words: np.ndarray) -> None:
    ring, head = _ring(words), int(words[L.H_HEAD])
    ring[(head + 1) % 9] = ring[head % 9]


def _padding_listed(words: np.ndarray) -> None:
    ring, head = _ring(words), int(words[L.H_HEAD])
    page = int(ring[head % 9])
    ring[head % 9] = 0
    _owner(words)[0] = L.OWNER_FREE
    _owner(words)[page] = L.OWNER_ALLOCATED


_INVARIANTS = "the state of rank 0 fails the invariants: "
RESTORE_CASES = [
    pytest.param(lambda a: None, TypeError, "state must be a PagedState from backup_state(), got NoneType", id="none"),
    pytest.param(
        lambda a: oracle_mod.PagedTokenToKVPoolAllocator(SIZE, PS, None, dp_size=2).backup_state(),
        TypeError,
        "state must be a PagedState from backup_state(), got tuple",
        id="the-original's-state",
    ),
    pytest.param(
        lambda a: a.backup_state()._ranks,
        TypeError,
        "state must be a PagedState from backup_state(), got tuple",
        id="its-words",
    ),
    pytest.param(
        lambda a: TokenToKVPoolAllocator(SIZE, None, dp_size=2).backup_state(),
        HostPoolError,
        f"the state is from ('token', {SIZE}, 1, 2) (kind, size, page_size, dp_size); this is {SHAPE}",
        id="token-allocator",
    ),
    pytest.param(
        lambda a: PagedTokenToKVPoolAllocator(SIZE + 1, PS, None, dp_size=2).backup_state(),
        HostPoolError,
        f"the state is from ('paged', {SIZE + 1}, 4, 2) (kind, size, page_size, dp_size); this is {SHAPE}",
        id="other-size",
    ),
    pytest.param(
        lambda a: PagedTokenToKVPoolAllocator(SIZE, 2, None, dp_size=2).backup_state(),
        HostPoolError,
        f"the state is from ('paged', {SIZE}, 2, 2) (kind, size, page_size, dp_size); this is {SHAPE}",
        id="other-page-size",
    ),
    pytest.param(
        lambda a: PagedTokenToKVPoolAllocator(SIZE, PS, None, dp_size=1).backup_state(),
        HostPoolError,
        f"the state is from ('paged', {SIZE}, 4, 1) (kind, size, page_size, dp_size); this is {SHAPE}",
        id="other-dp-size",
    ),
    # Tampered states of the right shape.
    pytest.param(
        lambda a: _tampered(a, _swap_free),
        HostPoolError,
        _INVARIANTS + "the free list of a sorted pool is not ascending",
        id="unsorted-free-list",
    ),
    pytest.param(
        lambda a: _tampered(a, _repeat_free),
        HostPoolError,
        _INVARIANTS + "page 6 is listed 2 times; page 7 has owner flag 0 but is listed 0 times; "
        "the free list of a sorted pool is not ascending",
        id="page-listed-twice",
    ),
    pytest.param(
        lambda a: _tampered(a, lambda w: _owner(w).__setitem__(1, L.OWNER_FREE)),
        HostPoolError,
        _INVARIANTS + "page 1 has owner flag 0 but is listed 0 times",
        id="held-page-flagged-free",
    ),
    pytest.param(
        lambda a: _tampered(a, _padding_listed),
        HostPoolError,
        _INVARIANTS + "the padding page 0 has owner flag 0, expected 1",
        id="padding-page-listed",
    ),
    pytest.param(
        lambda a: _tampered(a, lambda w: w.__setitem__(L.H_NFREE, 20)),
        HostPoolError,
        _INVARIANTS + "counters out of range: head=0 nfree=20 nrel=1 npend=0 pages=9",
        id="counter",
    ),
    pytest.param(
        lambda a: _tampered(a, lambda w: w.__setitem__(L.H_SORTED, 0)),
        HostPoolError,
        _INVARIANTS + "merge order word is 0, expected 1",
        id="merge-order",
    ),
    pytest.param(
        lambda a: PagedState(*SHAPE, (a.backup_state()._ranks[0][:-1], a.backup_state()._ranks[1])),
        HostPoolError,
        _INVARIANTS + f"state array has length {L.state_length(9) - 1}, expected {L.state_length(9)}",
        id="truncated",
    ),
    pytest.param(
        # 8 slots per rank: state words as long as a rank of 8 pages.
        lambda a: dataclasses.replace(
            TokenToKVPoolAllocator(17, None, dp_size=2).backup_state(), kind="paged", size=SIZE, page_size=PS
        ),
        HostPoolError,
        _INVARIANTS + "header says (pages, page_size, shift) = (9, 1, 0), pool has (9, 4, 2)",
        id="relabelled-token-state",
    ),
    # Another kind's state of exactly this shape.
    pytest.param(
        lambda a: dataclasses.replace(a.backup_state(), kind="token"),
        HostPoolError,
        f"the state is from ('token', {SIZE}, 4, 2) (kind, size, page_size, dp_size); this is {SHAPE}",
        id="same-shape-other-kind",
    ),
    # Rank counts other than dp_size: none restored, not some.
    pytest.param(
        lambda a: PagedState(*SHAPE, a.backup_state()._ranks[:1]),
        HostPoolError,
        "the state holds 1 ranks; this allocator has dp_size=2",
        id="one-rank-of-two",
    ),
    pytest.param(
        lambda a: PagedState(*SHAPE, a.backup_state()._ranks * 2),
        HostPoolError,
        "the state holds 4 ranks; this allocator has dp_size=2",
        id="four-ranks-of-two",
    ),
    # Only rank 1 tampered: every rank is checked, not just the first.
    pytest.param(
        lambda a: _tampered(a, lambda w: _owner(w).__setitem__(1, L.OWNER_FREE), rank=1),
        HostPoolError,
        "the state of rank 1 fails the invariants: page 1 has owner flag 0 but is listed 0 times",
        id="rank-1-tampered",
    ),
    # Counters that the next call would wrap, on either rank; a spare header word.
    _saturated(L.H_ALLOC_CALLS, "alloc_calls"),
    _saturated(L.H_MERGES, "merges"),
    _saturated(L.H_FREE_CALLS, "free_calls"),
    _saturated(L.H_CLEARS, "clears", rank=1),
    _saturated(L.H_PEAK, "peak_allocated_pages", rank=1),
    pytest.param(
        lambda a: _tampered(a, lambda w: w.__setitem__(L.HEADER - 1, 7)),
        HostPoolError,
        _INVARIANTS + f"spare header word {L.HEADER - 1} is not zero",
        id="spare-header-word",
    ),
    # A group depth with nothing pending: the core's groups are unused in a rank.
    pytest.param(
        lambda a: _tampered(a, lambda w: w.__setitem__(L.H_GROUP_DEPTH, 1)),
        HostPoolError,
        _INVARIANTS + "a rank's core pending list and group depth must stay empty",
        id="group-depth-1",
    ),
]


@pytest.mark.parametrize(("make_state", "error", "message"), RESTORE_CASES)
def test_bad_restore_state(paged: PagedTokenToKVPoolAllocator, make_state: Any, error: type, message: str) -> None:
    state = make_state(paged)
    check_error(paged, lambda a: a.restore_state(state), error, message)


def test_token_restore_of_a_paged_state(token: TokenToKVPoolAllocator) -> None:
    message = f"the state is from {SHAPE} (kind, size, page_size, dp_size); this is ('token', 17, 1, 2)"
    state = make_paged(False).backup_state()
    check_error(token, lambda t: t.restore_state(state), HostPoolError, message)
    check_error(
        token, lambda t: t.restore_state([]), TypeError, "state must be a PagedState from backup_state(), got list"
    )


def test_a_state_restores_many_times_and_is_immutable() -> None:
    a = make_paged(False)
    state = a.backup_state()
    for row in state._ranks:
        assert not row.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            row[0] = 1
    expected = capture(a)
    for _ in range(2):
        assert a.alloc(16) is not None
        assert a.free([4]) == 1
        a.restore_state(state)
        assert capture(a) == expected


# -- constructors -------------------------------------------------------------------

_INT32 = "do not fit the int32 arrays alloc_extend and alloc_decode return"


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        pytest.param((64, 0), {}, HostPoolError, "page_size must be at least 1, got page_size=0", id="page-size-0"),
        pytest.param((64, -4), {}, HostPoolError, "page_size must be at least 1, got page_size=-4", id="page-size-neg"),
        pytest.param((64, 4), {"dp_size": 0}, HostPoolError, "dp_size must be at least 1, got dp_size=0", id="dp-0"),
        pytest.param((-4, 4), {}, HostPoolError, "size must be non-negative, got size=-4", id="size-negative"),
        pytest.param((64.0, 4), {}, TypeError, _ne("size", "float 64.0"), id="size-float"),
        pytest.param((64, "4"), {}, TypeError, _ne("page_size", "str '4'"), id="page-size-str"),
        pytest.param((64, 4), {"dp_size": True}, TypeError, _ne("dp_size", "bool True"), id="dp-bool"),
        pytest.param((64, 4), {"dp_size": None}, TypeError, _ne("dp_size", "NoneType None"), id="dp-none"),
        pytest.param((None, 4), {}, TypeError, _ne("size", "NoneType None"), id="size-none"),
        # Slot ids beyond int32: (pages_per_rank + 1) * page_size - 1 > 2**31 - 1.
        pytest.param(
            (2**31, 1), {}, HostPoolError, f"slot ids of 2147483648 pages of 1 slots per rank {_INT32}", id="int32"
        ),
        pytest.param(
            (2**32, 1),
            {"dp_size": 2},
            HostPoolError,
            f"slot ids of 2147483648 pages of 1 slots per rank {_INT32}",
            id="int32-per-rank",
        ),
        pytest.param(
            (2**31, 2**16), {}, HostPoolError, f"slot ids of 32768 pages of 65536 slots per rank {_INT32}", id="pages"
        ),
    ],
)
def test_bad_paged_constructor(args: tuple[Any, ...], kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error) as info:
        PagedTokenToKVPoolAllocator(args[0], args[1], None, **kwargs)
    assert type(info.value) is error
    assert str(info.value) == message


def test_the_largest_paged_pool_of_int32_slots() -> None:
    # 32767 pages of 65536 slots: its last slot is 2**31 - 1 exactly, returned as int32.
    a = PagedTokenToKVPoolAllocator(2**31 - 2**16, 2**16, None)
    assert a.pages_per_rank == 2**15 - 1
    firsts = a.alloc_decode([1] * a.pages_per_rank, [-1] * a.pages_per_rank)
    assert firsts.dtype == np.int32
    assert firsts[-1] == 2**31 - 2**16
    tail = a.alloc_extend([1], [2**16], [int(firsts[-1])], 2**16 - 1)
    assert tail.dtype == np.int32
    assert int(tail[-1]) == 2**31 - 1
    assert a.free(tail) == 1
    a.check_invariants()


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        pytest.param((8,), {"dp_size": 0}, HostPoolError, "dp_size must be at least 1, got dp_size=0", id="dp-0"),
        pytest.param((-1,), {}, HostPoolError, "size must be non-negative, got size=-1", id="size-negative"),
        pytest.param((8.0,), {}, TypeError, _ne("size", "float 8.0"), id="size-float"),
        pytest.param((8,), {"dp_size": "2"}, TypeError, _ne("dp_size", "str '2'"), id="dp-str"),
        pytest.param(
            (2**31,), {}, HostPoolError, "2147483648 slots per rank do not fit the int32 arrays alloc returns", id="i32"
        ),
        pytest.param(
            (2**32,),
            {"dp_size": 2},
            HostPoolError,
            "2147483648 slots per rank do not fit the int32 arrays alloc returns",
            id="int32-per-rank",
        ),
    ],
)
def test_bad_token_constructor(args: tuple[Any, ...], kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error) as info:
        TokenToKVPoolAllocator(args[0], None, **kwargs)
    assert type(info.value) is error
    assert str(info.value) == message


# -- what is fine ---------------------------------------------------------------------


def test_accepted_forms_match_the_oracle() -> None:
    """Tuples, integer arrays of any width, numpy scalars, 2-D slot arrays: as the original reads them."""
    a = PagedTokenToKVPoolAllocator(SIZE, PS, None, dp_size=2)
    o = oracle_mod.PagedTokenToKVPoolAllocator(SIZE, PS, None, dp_size=2)
    calls: list[Callable[[Any], Any]] = [
        lambda x: x.alloc_extend((0, 0), (5, 2), (-1, -1), np.int16(7), dp_rank=np.uint8(1)),
        lambda x: x.alloc_extend(np.array([5], np.int16), np.array([6], np.uint32), np.array([8], np.int8), 1, 1),
        lambda x: x.alloc_decode([np.int32(6), np.int64(3)], (9, 13), dp_rank=1),
        lambda x: x.alloc(np.uint16(8)),
        lambda x: x.free(np.array([[4, 5], [8, 11]], dtype=np.uint8)),
        lambda x: x.free(np.array([4, 99, 9], dtype=">i8")[::2], dp_rank=1),
        lambda x: x.alloc(np.int64(16), dp_rank=np.int32(1)),
        lambda x: x.free((np.int16(8),), dp_rank=1),
        lambda x: x.free([], dp_rank=1),
        lambda x: x.free(np.empty((0, 3), np.int32)),
    ]
    freed = []
    for call in calls:
        got, want = call(a), call(o)
        if want is None:
            assert type(got) is int  # free: the pages it freed
            freed.append(got)
        else:
            assert got.dtype == want.dtype
            assert got.tolist() == want.tolist()
        compare(a, o)
    assert freed == [2, 2, 0, 0, 0]


@pytest.mark.parametrize("ps", [3, 5, 6])
def test_decode_at_a_page_size_that_is_no_power_of_two_matches_the_oracle(ps: int) -> None:
    """Which requests start a page is ``(seq - 1) % page_size == 0``: checked at odd and even ``seq`` alike.

    At a power-of-two page size an even ``seq`` never starts a page either
    way, so only other page sizes tell ``seq - 1`` from a bit flip of ``seq``.
    """
    a = PagedTokenToKVPoolAllocator(128 * ps, ps, None)
    o = oracle_mod.PagedTokenToKVPoolAllocator(128 * ps, ps, None)
    lens = list(range(1, 3 * ps + 1))  # every position in a page, at odd and even lengths
    n = len(lens)
    for x in (o, a):  # a request of each length, then another: decode them in an order of page ids
        x.alloc_extend([0] * n, lens, [-1] * n, sum(lens))
        got = x.alloc_extend([0] * n, lens, [-1] * n, sum(lens))
        assert got is not None
    last_loc = got[np.cumsum(lens) - 1].tolist()  # the last slot of each request of the second batch
    compare(a, o)
    for k, last in zip(lens, last_loc, strict=True):  # one request a call: a batch's counts could even out
        want = o.alloc_decode([k + 1], [last])
        assert a.alloc_decode([k + 1], [last]).tolist() == want.tolist()
        compare(a, o)


# -- import, forwarding, attributes ---------------------------------------------------------


@pytest.mark.slow
def test_import_loads_neither_torch_nor_jax() -> None:
    code = (
        "import json, sys\n"
        "import hostpool_nb.paged as p\n"
        "a = p.PagedTokenToKVPoolAllocator(64, 4, None, dp_size=2)\n"
        "a.free(a.alloc_extend([0], [5], [-1], 5), dp_rank=0)\n"  # the kernels run without them too
        "t = p.TokenToKVPoolAllocator(8, None)\n"
        "t.free(t.alloc(3))\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'jaxlib'))\n"
        "print(json.dumps({'heavy': heavy, 'file': p.__file__}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert Path(result["file"]).resolve() == (ROOT / "hostpool_nb" / "paged" / "__init__.py").resolve()


class StubCache:
    """A kvcache that records the calls forwarded to it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def get_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("get_cpu_copy", args, kwargs))
        return ("copy", len(self.calls))

    def load_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("load_cpu_copy", args, kwargs))
        return ("loaded", len(self.calls))


@pytest.mark.parametrize("kind", ["paged", "token"])
def test_kvcache_forwarding(kind: str) -> None:
    for module in (oracle_mod, sys.modules[PagedTokenToKVPoolAllocator.__module__]):
        cache = StubCache()
        if kind == "paged":
            a = module.PagedTokenToKVPoolAllocator(64, 4, cache, dp_size=2)
        else:
            a = module.TokenToKVPoolAllocator(64, cache, dp_size=2)
        assert a.get_kvcache() is cache
        indices = np.arange(4, 12)
        got = [a.get_cpu_copy(indices), a.load_cpu_copy("kv", indices)]  # the original's (kv_cache_cpu, indices)
        assert got == [("copy", 1), ("loaded", 2)]
        assert [(name, len(args), sorted(kw)) for name, args, kw in cache.calls] == [
            ("get_cpu_copy", 1, []),
            ("load_cpu_copy", 2, []),
        ]
        assert cache.calls[0][1][0] is indices  # passed on as is, not copied
    # hostpool_nb's pass on whatever they are given: a KV pool with more parameters keeps them.
    cache = StubCache()
    assert a.get_kvcache() is not cache
    a._kvcache = cache
    assert (a.load_cpu_copy("kv", indices, layer=3), a.get_cpu_copy()) == (("loaded", 1), ("copy", 2))
    assert [(name, len(args), sorted(kw)) for name, args, kw in cache.calls] == [
        ("load_cpu_copy", 2, ["layer"]),
        ("get_cpu_copy", 0, []),
    ]
    # A kvcache without the method: the AttributeError goes through, as in the original.
    with pytest.raises(AttributeError):
        PagedTokenToKVPoolAllocator(64, 4, object()).get_cpu_copy()


@pytest.mark.parametrize(
    ("size", "page_size", "dp_size"),
    [(64, 4, 1), (67, 4, 2), (100, 16, 3), (1000, 64, 3), (7, 8, 1), (0, 1, 1), (5, 1, 3)],
)
@pytest.mark.parametrize("debug_mode", [False, True])
def test_attributes_match_the_oracle(size: int, page_size: int, dp_size: int, debug_mode: bool) -> None:
    a = PagedTokenToKVPoolAllocator(size, page_size, None, debug_mode=debug_mode, dp_size=dp_size)
    o = oracle_mod.PagedTokenToKVPoolAllocator(size, page_size, None, debug_mode=debug_mode, dp_size=dp_size)
    names = ("size", "page_size", "dp_size", "size_per_rank", "num_pages", "pages_per_rank", "debug_mode")
    for name in names:
        assert getattr(a, name) == getattr(o, name), name
        assert type(getattr(a, name)) is type(getattr(o, name)), name
    assert a.is_not_in_free_group is True
    compare(a, o)
    for arr in (*a.free_pages, *a.release_pages):
        assert not arr.flags.writeable  # read-only copies: writing one cannot change the allocator
    t = TokenToKVPoolAllocator(size, None, dp_size=dp_size)
    u = oracle_mod.TokenToKVPoolAllocator(size, None, dp_size=dp_size)
    for name in ("size", "page_size", "dp_size", "size_per_rank"):
        assert getattr(t, name) == getattr(u, name), name
    compare(t, u)
    assert all(not arr.flags.writeable for arr in t.free_slots)


def test_extend_far_beyond_the_rank_is_refused_without_allocating_its_output(all_kernels: None) -> None:
    """2**40 tokens, consistent with extend_num_tokens: None at once, no 8 TiB output array."""
    import tracemalloc

    alloc = PagedTokenToKVPoolAllocator(64 * 10, 64, None)
    available = alloc.available_size()
    tracemalloc.start()
    try:
        got = alloc.alloc_extend([0], [2**40], [-1], 2**40)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got is None
    assert peak < 1 << 20
    assert alloc.available_size() == available


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("bad", ["held", "padding", "negative", "cap", "beyond"])
def test_alloc_stops_unchanged_at_a_corrupt_listed_page(ps: int, bad: str) -> None:
    """A listed page that is not free (impossible through the API): RuntimeError, the rank as it was."""
    alloc = PagedTokenToKVPoolAllocator(ps * 12, ps, None)
    held = alloc.alloc(2 * ps)  # pages 1 and 2
    assert held is not None
    st = alloc._st[0]
    cap = int(st[L.H_NPAGES])
    head = int(st[L.H_HEAD])
    value = {"held": 1, "padding": 0, "negative": -1, "cap": cap, "beyond": cap + 5}[bad]
    ring = one_entry_per_page(st)
    victim = head + 3  # the 4th page the next allocation takes
    old = int(ring[victim])
    ring[victim] = value
    before = st.copy()
    with pytest.raises(RuntimeError, match=r"alloc kernel failed with code 7 at 3"):
        alloc.alloc(5 * ps)
    assert np.array_equal(st, before)  # the three pages taken before it are free again
    ring[victim] = old
    alloc.check_invariants()
    out = alloc.alloc(5 * ps)
    assert out is not None
    assert (out[::ps] // ps).tolist() == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("cls", ["paged", "token"])
def test_check_invariants_names_the_corrupted_rank(cls: str) -> None:
    alloc = (
        PagedTokenToKVPoolAllocator(16 * 8, 16, None, dp_size=2)
        if cls == "paged"
        else TokenToKVPoolAllocator(8, None, dp_size=2)
    )
    alloc.check_invariants()
    ring = ring_ids(alloc._st[1], int(alloc._st[1][L.H_NPAGES]))
    ring[0] = ring[1]  # a page listed twice on rank 1
    name = type(alloc).__name__
    with pytest.raises(RuntimeError, match=rf"^{name} rank 1 is corrupted: \S"):
        alloc.check_invariants()


def test_extend_one_page_beyond_the_rank_is_refused_not_corrupt() -> None:
    """Tokens needing pages_per_rank + 2 pages: no output is made, and the kernel refuses (None)."""
    alloc = PagedTokenToKVPoolAllocator(16 * 10, 16, None)
    before = alloc.available_size()
    tokens = (alloc.pages_per_rank + 1) * 16 + 1
    assert alloc.alloc_extend([0], [tokens], [-1], tokens) is None
    assert alloc.available_size() == before
    alloc.check_invariants()


@pytest.mark.parametrize("version", [0, 4, 99, "1"])
def test_a_paged_state_pickle_of_another_format_is_refused(version: Any) -> None:
    import pickle

    state = PagedTokenToKVPoolAllocator(16 * 4, 16, None).backup_state()
    load, (fmt, fields) = state.__reduce__()
    assert pickle.loads(pickle.dumps(state)).page_size == 16
    if version == fmt:
        return
    with pytest.raises(
        HostPoolError, match=rf"pickled in state format {version!r}, written by .*; this hostpool_nb reads format {fmt}"
    ):
        load(version, fields)


def test_a_paged_state_repr_is_short() -> None:
    state = PagedTokenToKVPoolAllocator(16 * 4096, 16, None).backup_state()
    text = repr(state)
    assert text.startswith("PagedState(kind=")
    assert "array" not in text  # the lists are not printed
    assert len(text) < 120


@pytest.mark.parametrize("ps", [3, 6])
def test_free_at_a_page_size_that_is_no_power_of_two(ps: int) -> None:
    """The division path of free's page lookup: pages 1..4 of a page size 3 or 6 pool."""
    alloc = PagedTokenToKVPoolAllocator(ps * 5, ps, None, strict=True)
    out = alloc.alloc(4 * ps)
    assert out is not None
    assert (out[::ps] // ps).tolist() == [1, 2, 3, 4]
    assert alloc.free(out[ps : 3 * ps]) == 2  # pages 2 and 3
    assert alloc.free(out[3 * ps :][::-1]) == 1  # page 4, its slots in any order
    with pytest.raises(DoubleFreeError, match=rf"^page 2 \(slots {2 * ps}\.\.{3 * ps - 1}\) of rank 0"):
        alloc.free(out[ps : ps + 1])
    with pytest.raises(SlotRangeError, match=rf"slot {ps - 1} .*padding page 0"):
        alloc.free([ps - 1])
    alloc.merge_and_sort_free()
    assert alloc.free_pages[0].tolist() == [2, 3, 4, 5]
    alloc.check_invariants()


# -- gaps planted bugs went through ------------------------------------------------------------------


@pytest.mark.parametrize("call", ["extend", "decode"])
def test_a_uint64_length_of_2_63_is_beyond_the_int64_range(call: str) -> None:
    a = PagedTokenToKVPoolAllocator(64, 16, None)
    before = a.backup_state()
    lens = np.array([2**63], dtype=np.uint64)
    run = (lambda: a.alloc_extend([0], lens, [-1], 1)) if call == "extend" else (lambda: a.alloc_decode(lens, [1]))
    with pytest.raises(HostPoolError) as info:
        run()
    assert str(info.value) == f"seq_lens holds {2**63}, beyond the int64 range"
    assert [s.tolist() for s in a.backup_state()._ranks] == [s.tolist() for s in before._ranks]


@pytest.mark.parametrize("kind", ["logical", "paged", "host"])
def test_a_uint64_free_beyond_int64_names_the_first_such_entry(kind: str) -> None:
    from hostpool_nb import HostPagePool, LogicalHostPool

    ids = np.array([3, 2**63 + 7, 2**64 - 1], dtype=np.uint64)  # two beyond int64: the first is named
    if kind == "host":
        host = HostPagePool(8)
        host.alloc(4)
        with pytest.raises(SlotRangeError) as info:
            host.free(ids)
        assert str(info.value) == f"page id={2**63 + 7} outside pool range [0, 8)"
        return
    pool: Any = LogicalHostPool(64, 1) if kind == "logical" else PagedTokenToKVPoolAllocator(64, 16, None)
    name = "indices" if kind == "logical" else "free_index"
    with pytest.raises(SlotRangeError) as info:
        pool.free(ids)
    assert str(info.value) == f"free got slot {2**63 + 7} at {name}[1] (flattened), outside the int64 range"


def test_the_free_group_view_is_a_new_list_each_time() -> None:
    a = PagedTokenToKVPoolAllocator(64, 16, None)
    held = a.alloc(32)
    a.free_group_begin()
    a.free(held[:16])
    seen = a.free_group
    seen[0].clear()
    seen.append([np.arange(3)])
    assert a.free_group is not seen
    assert [[f.tolist() for f in rank] for rank in a.free_group] == [[list(range(16, 32))]]


def test_writes_to_an_array_after_its_free_in_a_group_change_nothing() -> None:
    a = PagedTokenToKVPoolAllocator(64, 16, None)
    held = a.alloc(48)
    mine = held[:16].copy()
    a.free_group_begin()
    assert a.free(mine) == 1
    mine[:] = held[16:32]  # the caller reuses its array: the group still frees what it was given
    a.free_group_end()
    assert a.free_pages[0].tolist() == [4]
    assert sorted(a.release_pages[0].tolist()) == [1]
    a.free(held[16:48])  # pages 2 and 3 are still allocated
    a.check_invariants()


def test_a_free_that_raises_inside_a_group_leaves_its_pending_frees_as_they_were() -> None:
    a = PagedTokenToKVPoolAllocator(64, 16, None, strict=True)
    held = a.alloc(48)
    a.free_group_begin()
    a.free(held[:16])
    pending = [[f.tolist() for f in rank] for rank in a.free_group]
    with pytest.raises(DoubleFreeError):
        a.free(np.concatenate([held[16:32], held[:16]]))  # page 2, then page 1 again: refused whole
    assert [[f.tolist() for f in rank] for rank in a.free_group] == pending
    a.free_group_end()
    assert sorted(a.release_pages[0].tolist()) == [1]  # page 2 stays allocated
    a.free(held[16:48])
    a.check_invariants()


# -- pickles of the allocators: the same checks on load as restore_state -------------------------------


def _grouped(kind: str) -> Any:
    """An allocator on two ranks with an open free group holding a pending free on rank 1."""
    a: Any = (
        PagedTokenToKVPoolAllocator(128, 16, {"kv": 1}, dp_size=2)
        if kind == "paged"
        else TokenToKVPoolAllocator(16, {"kv": 1}, dp_size=2)
    )
    held = a.alloc(32 if kind == "paged" else 3, dp_rank=1)
    a.free_group_begin()
    a.free(held[: 16 if kind == "paged" else 2], dp_rank=1)
    return a


@pytest.mark.parametrize("kind", ["paged", "token"])
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_an_allocator_pickles_with_its_ranks_and_open_group(kind: str, how: str) -> None:
    import copy
    import pickle

    a = _grouped(kind)
    b = pickle.loads(pickle.dumps(a)) if how == "pickle" else copy.deepcopy(a)
    assert type(b) is type(a)
    assert b.lock is not a.lock
    assert b.get_kvcache() == {"kv": 1}
    assert (b.size, b.page_size, b.dp_size, b.strict) == (a.size, a.page_size, a.dp_size, a.strict)
    assert not b.is_not_in_free_group
    assert [[f.tolist() for f in r] for r in b.free_group] == [[f.tolist() for f in r] for r in a.free_group]
    for x in (a, b):  # the same calls give the same results on both
        x.free_group_end()
    assert [s.tolist() for s in b.backup_state()._ranks] == [s.tolist() for s in a.backup_state()._ranks]
    got = [x.alloc(16 if kind == "paged" else 2, dp_rank=1) for x in (a, b)]
    assert got[0].tolist() == got[1].tolist()
    b.check_invariants()


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_group_that_ignored_a_free_page_pickles_and_loads(how: str) -> None:
    """A free in a group naming a page already free (ignored, not strict) keeps its slots as given: a pickle of
    that state loads (it was refused: the kept frees named a page not pending)."""
    import copy
    import pickle

    a = PagedTokenToKVPoolAllocator(64, 4, None)
    held = a.alloc(8)
    assert held is not None
    a.free(held[:4])
    a.free_group_begin()
    assert a.free(held) == 1  # page 1 was free already: ignored; page 2 pending
    b = pickle.loads(pickle.dumps(a)) if how == "pickle" else copy.deepcopy(a)
    b.check_invariants()
    assert [[f.tolist() for f in r] for r in b.free_group] == [[held.tolist()]]
    for x in (a, b):
        x.free_group_end()
    assert b.free_pages[0].tolist() == a.free_pages[0].tolist()
    assert sorted(b.release_pages[0].tolist()) == sorted(a.release_pages[0].tolist()) == [1, 2]


def _damaged(kind: str, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    saved = _grouped(kind).__getstate__()
    change(saved)
    return saved


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda saved: saved.__setitem__(key, value)


def _tamper_rank(saved: dict[str, Any]) -> None:
    words = saved["ranks"][1].copy()
    words[L.H_NFREE] += 1
    saved["ranks"] = (saved["ranks"][0], words)


def _tamper_group(saved: dict[str, Any]) -> None:
    gp = saved["groups"][1].copy()
    gp[L.GP_COUNT] = 0  # the pending page's mark stays: buffer and marks disagree
    saved["groups"] = (saved["groups"][0], gp)


def _drop_kept(saved: dict[str, Any]) -> None:
    saved["group_frees"] = [[], []]  # a page pending, but no free of it kept


@pytest.mark.parametrize("kind", ["paged", "token"])
@pytest.mark.parametrize(
    ("change", "needle"),
    [
        pytest.param(lambda s: s.pop("ranks"), "lacks ranks", id="missing"),
        pytest.param(_set("args", [1]), "holds constructor arguments of type list", id="args-not-dict"),
        pytest.param(lambda s: s["args"].__setitem__("size", -4), "has arguments no allocator takes", id="bad-size"),
        pytest.param(lambda s: s["args"].__setitem__("dp_size", 1), "the state holds 2 ranks", id="other-dp"),
        pytest.param(_tamper_rank, "the state of rank 1 fails the invariants", id="rank"),
        pytest.param(_set("ranks", ([1, 2], [3])), "the state of rank 0 is a list", id="rank-list"),
        pytest.param(_set("groups", 7), "as sequences", id="groups-not-sequence"),
        pytest.param(_tamper_group, "the free group of rank 1 fails the invariants", id="group"),
        pytest.param(_drop_kept, "the frees it keeps for free_group do not name every page pending", id="kept"),
        pytest.param(_set("in_group", 1), "holds in_group=1, not a bool", id="in-group-not-bool"),
        pytest.param(
            lambda s: s.__setitem__("groups", s["groups"][:1]), "holds free groups for 1 ranks", id="groups-short"
        ),
        pytest.param(
            lambda s: s.__setitem__("groups", (*s["groups"], s["groups"][0])),
            "holds free groups for 3 ranks",
            id="groups-long",
        ),
        pytest.param(lambda s: s.__setitem__("group_frees", s["group_frees"][:1]), "for 2 ranks", id="frees-short"),
        pytest.param(
            lambda s: s.__setitem__("groups", (s["groups"][0][:-1], s["groups"][1])),
            "its group buffer is not an int64 array of",
            id="group-buffer-short",
        ),
        pytest.param(
            lambda s: s.__setitem__("groups", (s["groups"][0], s["groups"][1].astype(np.int32))),
            "its group buffer is not an int64 array of",
            id="group-buffer-int32",
        ),
        pytest.param(_set("format", 99), "pickled in state format 99", id="format"),
    ],
)
def test_a_damaged_allocator_pickle_is_refused(kind: str, change: Any, needle: str) -> None:
    cls = PagedTokenToKVPoolAllocator if kind == "paged" else TokenToKVPoolAllocator
    blank = cls.__new__(cls)
    with pytest.raises(HostPoolError) as info:
        blank.__setstate__(_damaged(kind, change))
    assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize("kind", ["paged", "token"])
@pytest.mark.parametrize("size", [2**25, 2**31 - 1, 2**40])
def test_a_pickle_declaring_another_size_is_refused_before_anything_is_built(kind: str, size: int) -> None:
    """A damaged size is checked against the pickled arrays first: no allocator of that size is built."""
    import pickle
    import tracemalloc

    cls = PagedTokenToKVPoolAllocator if kind == "paged" else TokenToKVPoolAllocator
    saved = _grouped(kind).__getstate__()
    saved["args"]["size"] = size
    data = pickle.dumps(saved)
    tracemalloc.start()
    try:
        blank = cls.__new__(cls)
        with pytest.raises(HostPoolError, match=r"declares size=\d+, .* but the state of rank 0 has shape"):
            blank.__setstate__(pickle.loads(data))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak:,} bytes allocated before the pickle was refused"


def test_a_size_of_no_whole_pages_is_served_as_the_original_and_the_repr_says_what_is_left_out() -> None:
    a = PagedTokenToKVPoolAllocator(1000, 16, None)
    o = oracle_mod.PagedTokenToKVPoolAllocator(1000, 16, None)
    assert a.available_size() == o.available_size() == 992  # the original's: 62 whole pages
    assert repr(a) == (
        "PagedTokenToKVPoolAllocator(size=1000, page_size=16, dp_size=1: 62 pages a rank, 8 slots of size in no "
        "rank's pages, available=992)"
    )
    a.alloc(64)
    assert repr(a).endswith("62 pages a rank, 8 slots of size in no rank's pages, available=928)")
    token = TokenToKVPoolAllocator(10, None, dp_size=3, track=True)
    assert repr(token) == (
        "TokenToKVPoolAllocator(size=10, page_size=1, dp_size=3: 3 slots a rank, 1 slot of size in no rank's "
        "slots, available=[3, 3, 3], tracking)"
    )
    whole = PagedTokenToKVPoolAllocator(1024, 16, None, dp_size=2)
    assert (
        repr(whole)
        == "PagedTokenToKVPoolAllocator(size=1024, page_size=16, dp_size=2: 32 pages a rank, available=[512, 512])"
    )
