"""HostPagePool: every misuse of every method, with its exact error, and the pool left as it was.

The setup is a pool of 8 pages: pages 0, 2, 3 and 4 held (2 pinned once),
the free list 5, 6, 7, 1 (page 1 was released), every held page at
generation 1. Each bad call must raise exactly the documented class with
exactly the documented text (the originals' where they have one), leave
every word of the state but its scratch as it was, and free the lock.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

from hostpool_nb import (
    HostPagePool,
    HostPageState,
    HostPoolError,
    LockRefUnderflowError,
    PageDoubleFreeError,
    PageNotAllocatedError,
    PageStateError,
    PinnedPageError,
    SlotRangeError,
    StaleFreeError,
)
from hostpool_nb._kernels import layout as L
from tests.conftest import RaisingEq
from tests.host_model import state_of, words_of

N = 8
BIG = 2**70


def make_pool() -> HostPagePool:
    pool = HostPagePool(N)
    assert pool.reserve() == 0
    assert pool.reserve() == 1
    assert pool.alloc(3).tolist() == [2, 3, 4]
    pool.release(1)
    pool.inc_lock_ref(2)
    assert state_of(pool)[0] == [5, 6, 7, 1]
    return pool


@pytest.fixture
def pool() -> HostPagePool:
    return make_pool()


def check_error(pool: HostPagePool, call: Any, error: type[BaseException], message: str) -> None:
    before = words_of(pool)
    with pytest.raises(error) as info:
        call(pool)
    assert type(info.value) is error, f"{type(info.value).__name__}, not {error.__name__}"
    assert str(info.value) == message
    assert np.array_equal(words_of(pool), before), "the call raised and changed the state"
    pool.check_invariants()
    assert pool.lock.acquire(timeout=5)
    pool.lock.release()


class _RaisingIndex:
    def __index__(self) -> int:
        raise ZeroDivisionError("no index")

    def __repr__(self) -> str:
        return "_RaisingIndex()"


def _int(name: str, got: str) -> str:
    return f"{name} must be an integer, got {got}"


def _range(what: str, value: int) -> str:
    return f"{what}={value} outside pool range [0, {N})"


def test_the_error_classes_are_the_originals_too() -> None:
    """Code that catches the originals' exceptions still catches these."""
    for cls in (PageDoubleFreeError, StaleFreeError, PinnedPageError, PageNotAllocatedError, LockRefUnderflowError):
        assert issubclass(cls, PageStateError)
        assert issubclass(cls, RuntimeError)
        assert issubclass(cls, HostPoolError)
    assert issubclass(SlotRangeError, ValueError)
    assert not issubclass(SlotRangeError, RuntimeError)


RELEASE_CASES = [
    pytest.param(lambda p: p.release(-1), SlotRangeError, _range("buffer_id", -1), id="negative"),
    pytest.param(lambda p: p.release(N), SlotRangeError, _range("buffer_id", N), id="at-size"),
    pytest.param(lambda p: p.release(BIG), SlotRangeError, _range("buffer_id", BIG), id="huge"),
    pytest.param(lambda p: p.release(1), PageDoubleFreeError, "double free of buffer_id=1", id="already-free"),
    pytest.param(lambda p: p.release(6), PageDoubleFreeError, "double free of buffer_id=6", id="never-handed-out"),
    pytest.param(lambda p: p.release(2), PinnedPageError, "release of locked buffer_id=2 (lock_ref=1)", id="pinned"),
    pytest.param(
        lambda p: p.release(3, generation=0),
        StaleFreeError,
        "stale release of buffer_id=3: it was handed out again since generation 0 (its generation is 1)",
        id="stale",
    ),
    pytest.param(
        lambda p: p.release(1, generation=1), PageDoubleFreeError, "double free of buffer_id=1", id="free-with-gen"
    ),
    pytest.param(lambda p: p.release(3.0), TypeError, _int("buffer_id", "float 3.0"), id="float"),
    pytest.param(lambda p: p.release(True), TypeError, _int("buffer_id", "bool True"), id="bool"),
    pytest.param(lambda p: p.release("3"), TypeError, _int("buffer_id", "str '3'"), id="str"),
    pytest.param(lambda p: p.release(None), TypeError, _int("buffer_id", "NoneType None"), id="none"),
    pytest.param(
        lambda p: p.release(np.array(3)),
        TypeError,
        _int("buffer_id", "ndarray array(3); pass a Python int (e.g. int(x)) for a count held in an array"),
        id="0d-array",
    ),
    pytest.param(lambda p: p.release([3]), TypeError, _int("buffer_id", "list [3]"), id="list"),
    pytest.param(lambda p: p.release(3, generation=1.5), TypeError, _int("generation", "float 1.5"), id="gen-float"),
    pytest.param(lambda p: p.release(3, generation=True), TypeError, _int("generation", "bool True"), id="gen-bool"),
    # As free's generations=: beyond int64 is a HostPoolError, not the kernel call's OverflowError.
    pytest.param(
        lambda p: p.release(3, generation=2**63),
        HostPoolError,
        f"generation holds {2**63}, beyond the int64 range",
        id="gen-beyond-int64",
    ),
    pytest.param(
        lambda p: p.release(3, generation=-(2**63) - 1),
        HostPoolError,
        f"generation holds {-(2**63) - 1}, beyond the int64 range",
        id="gen-below-int64",
    ),
]


@pytest.mark.parametrize(("call", "error", "message"), RELEASE_CASES)
def test_bad_release(pool: HostPagePool, call: Any, error: type, message: str) -> None:
    check_error(pool, call, error, message)


ALLOC_CASES = [
    pytest.param(0, HostPoolError, "need_pages must be positive, got 0", id="zero"),
    pytest.param(-1, HostPoolError, "need_pages must be positive, got -1", id="negative"),
    pytest.param(-BIG, HostPoolError, f"need_pages must be positive, got {-BIG}", id="negative-huge"),
    pytest.param(1.0, TypeError, _int("need_pages", "float 1.0"), id="float"),
    pytest.param(True, TypeError, _int("need_pages", "bool True"), id="bool"),
    pytest.param("1", TypeError, _int("need_pages", "str '1'"), id="str"),
    pytest.param(None, TypeError, _int("need_pages", "NoneType None"), id="none"),
    pytest.param([1], TypeError, _int("need_pages", "list [1]"), id="list"),
]


@pytest.mark.parametrize(("need", "error", "message"), ALLOC_CASES)
def test_bad_alloc(pool: HostPagePool, need: Any, error: type, message: str) -> None:
    check_error(pool, lambda p: p.alloc(need), error, message)


@pytest.mark.parametrize("need", [5, 9, BIG])
def test_an_alloc_beyond_the_free_pages_is_none_and_counted(pool: HostPagePool, need: int) -> None:
    before = pool.stats()
    books = state_of(pool)
    assert pool.alloc(need) is None
    assert state_of(pool) == books
    after = pool.stats()
    assert (after.alloc_calls, after.exhausted_calls) == (before.alloc_calls + 1, before.exhausted_calls + 1)


def test_reserve_of_a_full_pool_is_none_and_counted() -> None:
    pool = HostPagePool(2)
    assert pool.alloc(2) is not None
    books = state_of(pool)
    assert pool.reserve() is None
    assert state_of(pool) == books
    assert pool.stats().exhausted_calls == 1


def _holds(dtype: str) -> str:
    return f"host_page_ids must hold integers, got dtype {dtype}"


FREE_CASES = [
    pytest.param([-1], SlotRangeError, _range("page id", -1), id="negative"),
    pytest.param([3, N], SlotRangeError, _range("page id", N), id="valid-then-at-size"),
    pytest.param([3, BIG], SlotRangeError, _range("page id", BIG), id="python-int-beyond-int64"),
    pytest.param(np.array([3, 2**63], dtype=np.uint64), SlotRangeError, _range("page id", 2**63), id="uint64-huge"),
    pytest.param([1], PageDoubleFreeError, "double free of page id=1", id="already-free"),
    pytest.param([3, 3, 6], PageDoubleFreeError, "double free of page id=6", id="repeats-then-free"),
    pytest.param(
        np.array([4, 2], dtype=np.int32), PinnedPageError, "free of locked page id=2 (lock_ref=1)", id="pinned"
    ),
    pytest.param([3, 1, 2], PageDoubleFreeError, "double free of page id=1", id="first-error-in-order"),
    pytest.param([3.0], TypeError, _holds("float64"), id="float-list"),
    pytest.param(np.array([3.0]), TypeError, _holds("float64"), id="float-array"),
    pytest.param(np.array([True]), TypeError, _holds("bool"), id="bool-array"),
    pytest.param(
        [3, True], TypeError, "host_page_ids must hold integers, got dtype bool (a bool among the integers)", id="bool"
    ),
    pytest.param(
        np.array([[3, 4]]), TypeError, "host_page_ids must be 1-D, got ndarray of shape (1, 2)", id="2d-array"
    ),
    pytest.param([[3], [4]], TypeError, "host_page_ids must be 1-D, got list of shape (2, 1)", id="nested-list"),
    pytest.param(
        3,
        TypeError,
        "host_page_ids must be a sequence or 1-D array of page ids, got int 3; wrap a single page in a list",
        id="int",
    ),
    pytest.param("34", TypeError, "host_page_ids must be a sequence or 1-D array of page ids, got str '34'", id="str"),
    pytest.param(None, TypeError, "host_page_ids must be a sequence or 1-D array of page ids, got NoneType", id="none"),
    pytest.param([3, _RaisingIndex()], TypeError, _holds("object"), id="index-raises"),
    pytest.param(np.array(["3"]), TypeError, _holds("<U1"), id="str-array"),
    pytest.param(
        [3, RaisingEq(1)],
        TypeError,
        "host_page_ids must hold integers, got RaisingEq (comparing it raised)",
        id="eq-raises",
    ),
]


@pytest.mark.parametrize(("pages", "error", "message"), FREE_CASES)
def test_bad_free(pool: HostPagePool, pages: Any, error: type, message: str) -> None:
    check_error(pool, lambda p: p.free(pages), error, message)


GENERATION_CASES = [
    pytest.param(
        [3, 4],
        [1],
        HostPoolError,
        "generations must have one entry per page: got 1 for 2 pages",
        id="too-few",
    ),
    pytest.param(
        [3, 4],
        [1, 0],
        StaleFreeError,
        "stale free of page id=4: it was handed out again since generation 0 (its generation is 1)",
        id="stale",
    ),
    pytest.param(
        [3, 3],
        [1, 2],
        StaleFreeError,
        "stale free of page id=3: it was handed out again since generation 2 (its generation is 1)",
        id="stale-repeat",
    ),
    pytest.param([3], [1.0], TypeError, "generations must hold integers, got dtype float64", id="float"),
    pytest.param([3], np.array([[1]]), TypeError, "generations must be 1-D, got ndarray of shape (1, 1)", id="2d"),
    pytest.param([3], [BIG], HostPoolError, f"generations holds {BIG}, beyond the int64 range", id="huge"),
    pytest.param([1], [1], PageDoubleFreeError, "double free of page id=1", id="free-page"),
]


@pytest.mark.parametrize(("pages", "gens", "error", "message"), GENERATION_CASES)
def test_bad_generations(pool: HostPagePool, pages: Any, gens: Any, error: type, message: str) -> None:
    check_error(pool, lambda p: p.free(pages, generations=gens), error, message)


PIN_CASES = [
    pytest.param("inc", -1, SlotRangeError, _range("buffer_id", -1), id="inc-negative"),
    pytest.param("dec", N, SlotRangeError, _range("buffer_id", N), id="dec-at-size"),
    pytest.param("inc", BIG, SlotRangeError, _range("buffer_id", BIG), id="inc-huge"),
    pytest.param("inc", 1, PageNotAllocatedError, "buffer_id=1 is not allocated (in free-list)", id="inc-free"),
    pytest.param("dec", 6, PageNotAllocatedError, "buffer_id=6 is not allocated (in free-list)", id="dec-free"),
    pytest.param("dec", 3, LockRefUnderflowError, "dec_lock_ref underflow on buffer_id=3", id="underflow"),
    pytest.param("inc", [3, 1], PageNotAllocatedError, "buffer_id=1 is not allocated (in free-list)", id="array"),
    pytest.param(
        "dec", np.array([2, 2]), LockRefUnderflowError, "dec_lock_ref underflow on buffer_id=2", id="array-repeat"
    ),
    pytest.param("inc", [3, BIG], SlotRangeError, _range("buffer_id", BIG), id="array-huge"),
    pytest.param("inc", 3.0, TypeError, _int("buffer_id", "float 3.0"), id="float"),
    pytest.param("dec", True, TypeError, _int("buffer_id", "bool True"), id="bool"),
    pytest.param("inc", None, TypeError, _int("buffer_id", "NoneType None"), id="none"),
    pytest.param("inc", [3.0], TypeError, "buffer_id must hold integers, got dtype float64", id="float-list"),
    pytest.param("inc", np.array([[3]]), TypeError, "buffer_id must be 1-D, got ndarray of shape (1, 1)", id="2d"),
    pytest.param(
        "inc",
        [3, RaisingEq(1)],
        TypeError,
        "buffer_id must hold integers, got RaisingEq (comparing it raised)",
        id="eq-raises",
    ),
]


@pytest.mark.parametrize(("which", "arg", "error", "message"), PIN_CASES)
def test_bad_pin(pool: HostPagePool, which: str, arg: Any, error: type, message: str) -> None:
    check_error(pool, lambda p: (p.inc_lock_ref if which == "inc" else p.dec_lock_ref)(arg), error, message)


@pytest.mark.parametrize(
    ("page", "error", "message"),
    [
        (9, SlotRangeError, _range("buffer_id", 9)),
        (N, SlotRangeError, _range("buffer_id", N)),  # the size itself is outside, with the original's text
        (7, PageNotAllocatedError, "buffer_id=7 is not allocated (in free-list)"),
        (1.5, TypeError, _int("buffer_id", "float 1.5")),
    ],
)
def test_bad_require_allocated(pool: HostPagePool, page: Any, error: type, message: str) -> None:
    check_error(pool, lambda p: p.require_allocated(page), error, message)


CTOR_CASES = [
    pytest.param(0, HostPoolError, "pool_size must be positive, got 0", id="zero"),
    pytest.param(-3, HostPoolError, "pool_size must be positive, got -3", id="negative"),
    pytest.param(2**31, HostPoolError, f"pool_size must be at most {2**31 - 1} (2**31 - 1), got {2**31}", id="huge"),
    pytest.param(8.0, TypeError, _int("pool_size", "float 8.0"), id="float"),
    pytest.param(True, TypeError, _int("pool_size", "bool True"), id="bool"),
    pytest.param(None, TypeError, _int("pool_size", "NoneType None"), id="none"),
]


@pytest.mark.parametrize(("size", "error", "message"), CTOR_CASES)
def test_bad_constructor(size: Any, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        HostPagePool(size)
    assert type(info.value) is error
    assert str(info.value) == message


# -- snapshots and pickles ------------------------------------------------------------------


def _tampered(pool: HostPagePool, change: Any) -> HostPageState:
    words = pool.backup_state()._words.copy()
    change(words)
    return HostPageState(N, words)


def _offset(which: int) -> int:
    return L.host_offsets(N)[which]


_FAILS = "the state fails the pool's invariants: "
RESTORE_CASES = [
    pytest.param(
        lambda p: None, TypeError, "state must be a HostPageState from backup_state(), got NoneType", id="none"
    ),
    pytest.param(
        lambda p: HostPagePool(N + 1).backup_state(),
        HostPoolError,
        f"the state is from a pool of {N + 1} pages; this one has {N}",
        id="other-size",
    ),
    pytest.param(
        lambda p: HostPageState(N, np.zeros(3, dtype=np.int64)),
        HostPoolError,
        _FAILS + f"state must be a 1-D int64 array of length {L.host_state_length(N)}, got int64 (3,)",
        id="short",
    ),
    pytest.param(
        lambda p: _tampered(p, lambda w: w.__setitem__(L.HP_ALLOC_CALLS, 2**63 - 1)),
        HostPoolError,
        _FAILS + "counters at or beyond 4611686018427387904 (2**62), more than a pool's calls reach: "
        "alloc_calls=9223372036854775807",
        id="saturated-counter",
    ),
    pytest.param(
        lambda p: _tampered(p, lambda w: w.__setitem__(_offset(1) + 3, -1)),
        HostPoolError,
        _FAILS + "a generation is out of range",
        id="negative-generation",
    ),
    pytest.param(
        lambda p: _tampered(p, lambda w: w.__setitem__(_offset(1) + 3, 2**63 - 1)),
        HostPoolError,
        _FAILS + "page 3's generation is at or beyond 4611686018427387904 (2**62), more than a pool's calls reach",
        id="saturated-generation",
    ),
    pytest.param(
        lambda p: _tampered(p, lambda w: w.__setitem__(_offset(2) + 6, 1)),
        HostPoolError,
        _FAILS + "free page 6 is pinned; 2 pages are pinned, the header says 1",
        id="free-page-pinned",
    ),
    pytest.param(
        lambda p: _tampered(p, lambda w: w[_offset(3) :].view(np.uint8).__setitem__(6, 1)),
        HostPoolError,
        _FAILS + "page 6 has allocated flag 1 but is listed 1 times",
        id="listed-page-allocated",
    ),
    pytest.param(
        lambda p: _tampered(p, lambda w: w[_offset(4) :].view(np.uint8).__setitem__(0, 1)),
        HostPoolError,
        _FAILS + "a page is marked outside a call",
        id="marked",
    ),
    pytest.param(
        lambda p: _tampered(p, lambda w: w.__setitem__(L.HP_HEADER - 1, 3)),
        HostPoolError,
        _FAILS + f"spare header word {L.HP_HEADER - 1} is not zero",
        id="spare-word",
    ),
    pytest.param(
        lambda p: _tampered(p, lambda w: w.__setitem__(L.HP_NFREE, N + 1)),
        HostPoolError,
        _FAILS + f"header out of range: pages={N} head=5 nfree={N + 1}, pool has {N} pages",
        id="nfree",
    ),
]


@pytest.mark.parametrize(("make_state", "error", "message"), RESTORE_CASES)
def test_bad_restore_state(pool: HostPagePool, make_state: Any, error: type, message: str) -> None:
    state = make_state(pool)
    check_error(pool, lambda p: p.restore_state(state), error, message)


@pytest.mark.parametrize(
    ("saved", "message"),
    [
        pytest.param(None, "the pickled HostPagePool holds a NoneType, not a pool's state", id="none"),
        pytest.param(
            {"format": 2, "pool_size": N},
            "this HostPagePool was pickled in state format 2, written by a newer hostpool_nb; "
            "this hostpool_nb reads format 1 "
            "(pickle it again with the same hostpool_nb version that loads it)",
            id="format",
        ),
        pytest.param(
            {"format": 1, "pool_size": 0, "state": None}, "the pickled HostPagePool has pool_size=0", id="size"
        ),
        pytest.param(
            {"format": 1, "pool_size": N, "state": [1, 2]},
            "the pickled HostPagePool holds a list, not a host pool's state",
            id="not-an-array",
        ),
    ],
)
def test_a_damaged_pickle_is_refused(saved: Any, message: str) -> None:
    blank = HostPagePool.__new__(HostPagePool)
    with pytest.raises(HostPoolError) as info:
        blank.__setstate__(saved)
    assert str(info.value) == message


def test_a_pickle_and_a_snapshot_give_the_same_pool(pool: HostPagePool) -> None:
    twin = pickle.loads(pickle.dumps(pool))
    assert state_of(twin) == state_of(pool)
    assert twin.lock is not pool.lock
    restored = HostPagePool(N)
    restored.restore_state(pickle.loads(pickle.dumps(pool.backup_state())))
    assert state_of(restored) == state_of(pool)
    for p in (twin, restored):
        assert p.reserve() == 5
        assert p.free([5, 3]) == 2
        p.check_invariants()


def test_the_views_are_read_only_and_follow_the_state(pool: HostPagePool) -> None:
    for view in (pool.allocated, pool.generation, pool.lock_ref):
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 0
    assert pool.allocated.dtype == np.bool_
    assert pool.allocated[[0, 1, 2]].tolist() == [True, False, True]
    gen = int(pool.generation[5])
    assert pool.reserve() == 5
    assert int(pool.generation[5]) == gen + 1
    assert bool(pool.allocated[5])
    pool.restore_state(make_pool().backup_state())  # views stay views of the pool's own state
    assert not bool(pool.allocated[5])


@pytest.mark.parametrize(
    ("words", "kind"),
    [(["a", "b"], "list"), ([object()], "list"), (np.array([1.5]), "float64 array of shape (1,)"), (None, "NoneType")],
    ids=["digit-strings", "objects", "floats", "none"],
)
def test_a_damaged_snapshot_pickle_with_words_that_are_not_integers_is_a_host_pool_error(words: Any, kind: str) -> None:
    from hostpool_nb._diagnostics.snapshot import FORMATS, _load_host

    with pytest.raises(HostPoolError) as info:
        _load_host(FORMATS["HostPageState"], N, words)  # what pickle.loads calls for a HostPageState
    assert str(info.value) == f"the HostPageState holds a {kind}, not a pool's state words (a 1-D int64 array)"


def test_a_restore_whose_free_list_head_is_the_pool_size_is_refused(pool: HostPagePool) -> None:
    before = state_of(pool)
    words = pool.backup_state()._words.copy()
    words[L.HP_HEAD] = N
    with pytest.raises(HostPoolError, match=rf"header out of range: pages={N} head={N} "):
        pool.restore_state(HostPageState(N, words))
    assert state_of(pool) == before
