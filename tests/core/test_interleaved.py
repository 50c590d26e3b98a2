"""``InterleavedPagePool`` against its oracle, the owner-classed lists written from docs/behaviour.md section 6.

A hypothesis state machine drives the pool and
``hostpool_nb.originals.sglang_host.ClassedFreeLists`` alike with correct
calls (``alloc`` of whole pages from any start class, ``free`` of held
pages in any order and grouping, ``clear``) and compares every result,
``available_size`` and each class's list after every step; misuses go to
the pool alone and must raise, leaving it equal to the oracle. Then the
bad-input matrix, snapshots, pickles and threads.
"""

from __future__ import annotations

import copy
import pickle
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from hostpool_nb import (
    AlignmentError,
    DoubleFreeError,
    HostPoolError,
    InterleavedPagePool,
    InterleavedPageState,
    PartialPageError,
    SlotRangeError,
)
from hostpool_nb.originals.sglang_host import ClassedFreeLists

SHAPES = [(2, 1, 5), (2, 4, 3), (3, 2, 4), (4, 16, 2), (8, 1, 1)]  # classes, page size, pages a class


class Interleaved(RuleBasedStateMachine):
    classes: int
    page_size: int
    per_class: int

    def __init__(self) -> None:
        super().__init__()
        self.rows = self.per_class * self.page_size + self.page_size - 1  # a partial page's rows are no page
        self.pool = InterleavedPagePool(self.rows, self.page_size, self.classes)
        self.oracle = ClassedFreeLists(self.rows, self.page_size, self.classes)
        self.held: list[list[int]] = []

    def _pages(self, slots: np.ndarray) -> list[list[int]]:
        return [slots[i : i + self.page_size].tolist() for i in range(0, slots.shape[0], self.page_size)]

    @rule(pages=st.integers(1, 12), start=st.integers(-9, 9))
    def alloc(self, pages: int, start: int) -> None:
        need = pages * self.page_size
        mine, theirs = self.pool.alloc(need, start), self.oracle.alloc_cyclic(start, need)
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert mine.dtype == np.int64
            assert mine.tolist() == theirs
            self.held += self._pages(mine)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(range(len(self.held))), min_size=1, unique=True), label="pages")
        pages = [self.held[i] for i in chosen]
        self.held = [p for i, p in enumerate(self.held) if i not in set(chosen)]
        slots = [s for p in pages for s in p]
        assert self.pool.free(np.array(slots)) == len(slots)
        self.oracle.free(slots)

    @rule()
    def free_nothing(self) -> None:
        assert self.pool.free(np.empty(0, dtype=np.int64)) == 0
        assert self.pool.free([]) == 0

    @rule()
    def clear(self) -> None:
        self.pool.clear()
        self.oracle = ClassedFreeLists(self.rows, self.page_size, self.classes)
        self.held = []

    # -- misuse: refused, nothing changed (the invariants compare every list) ---------------

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held), label="page")
        self.held.remove(page)
        self.pool.free(np.array(page))
        self.oracle.free(page)
        with pytest.raises(DoubleFreeError, match="is not allocated"):
            self.pool.free(np.array(page))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def named_twice(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held), label="page")
        with pytest.raises(DoubleFreeError, match="freed twice in one call"):
            self.pool.free(np.array(page + page))

    @rule(beyond=st.integers(0, 3), negative=st.booleans())
    def out_of_range(self, beyond: int, negative: bool) -> None:
        ps = self.page_size
        first = -ps * (beyond + 1) if negative else self.pool.size + beyond * ps
        with pytest.raises(SlotRangeError, match="outside"):
            self.pool.free(np.arange(first, first + ps))

    @rule(cls=st.integers(0, 7))
    def reserved_page(self, cls: int) -> None:
        page = cls % self.classes
        with pytest.raises(DoubleFreeError, match="reserved"):
            self.pool.free(np.arange(page * self.page_size, (page + 1) * self.page_size))

    @precondition(lambda self: self.held and self.page_size > 1)
    @rule(data=st.data())
    def partial_page(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held), label="page")
        with pytest.raises(PartialPageError):
            self.pool.free(np.array(page[::-1]))
        with pytest.raises(AlignmentError, match="whole pages"):
            self.pool.free(np.array(page[:-1]))

    @precondition(lambda self: self.held and len(self.held) > 1)
    @rule(data=st.data())
    def a_bad_page_after_good_ones(self, data: st.DataObject) -> None:
        good = data.draw(st.sampled_from(self.held), label="page")
        with pytest.raises(SlotRangeError):
            self.pool.free(np.array([*good, -self.page_size, *list(range(-self.page_size + 1, 0))]))

    @rule(pages=st.integers(0, 3), off=st.integers(1, 15))
    def misaligned_alloc(self, pages: int, off: int) -> None:
        need = pages * self.page_size + off % self.page_size
        if need % self.page_size == 0 and need > 0:
            return
        with pytest.raises(AlignmentError, match="positive multiple of page_size"):
            self.pool.alloc(need, 0)

    @rule()
    def backup_and_restore(self) -> None:
        state = self.pool.backup_state()
        taken = self.pool.alloc(self.page_size, 0)
        self.pool.restore_state(state)
        if taken is not None:
            assert self.pool.alloc(self.page_size, 0).tolist() == taken.tolist()  # the same page again
            self.pool.restore_state(state)

    @invariant()
    def same_lists(self) -> None:
        assert self.pool.free_lists() == self.oracle.class_free_pages
        assert self.pool.available_size() == self.oracle.available_size()
        assert self.pool.class_free_page_counts() == [len(x) for x in self.oracle.class_free_pages]

    def teardown(self) -> None:
        self.pool.check_invariants()
        again = pickle.loads(pickle.dumps(self.pool))
        assert again.free_lists() == self.pool.free_lists()
        again.check_invariants()


@pytest.mark.parametrize(("classes", "page_size", "per_class"), SHAPES)
def test_the_pool_matches_the_classed_lists(classes: int, page_size: int, per_class: int) -> None:
    machine = type("Machine", (Interleaved,), {"classes": classes, "page_size": page_size, "per_class": per_class})
    run_state_machine_as_test(machine, settings=settings(max_examples=60, stateful_step_count=40, deadline=None))


# -- the bad-input matrix ------------------------------------------------------------------

BAD_SHAPES = [
    ((16, 4, 1), HostPoolError, "shard_size must be at least 2"),
    ((16, 0, 2), HostPoolError, "page_size must be at least 1"),
    ((-1, 4, 2), HostPoolError, "size must be non-negative"),
    ((16.0, 4, 2), TypeError, "size must be an integer"),
    ((16, True, 2), TypeError, "page_size must be an integer, got bool"),
    ((16, 4, np.array(2)), TypeError, "shard_size must be an integer"),
    ((2**40, 1, 2**10), HostPoolError, "beyond what one pool's state can index"),
]


@pytest.mark.parametrize(("args", "error", "text"), BAD_SHAPES)
def test_a_bad_shape_is_refused_naming_it(args: tuple, error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        InterleavedPagePool(*args)


BAD_ALLOCS = [
    ((4.0, 0), TypeError, "need_size must be an integer"),
    ((4, 0.5), TypeError, "start_class must be an integer"),
    ((4, None), TypeError, "start_class must be an integer"),
    ((True, 0), TypeError, "need_size must be an integer, got bool"),
    ((np.array([4]), 0), TypeError, "need_size must be an integer"),
    ((0, 0), AlignmentError, "positive multiple"),
    ((-4, 0), AlignmentError, "positive multiple"),
    ((6, 0), AlignmentError, "positive multiple"),
]


@pytest.mark.parametrize(("args", "error", "text"), BAD_ALLOCS)
def test_a_bad_alloc_is_refused_and_changes_nothing(args: tuple, error: type, text: str) -> None:
    pool = InterleavedPagePool(16, 4, 2)
    before = pool.free_lists()
    with pytest.raises(error, match=text):
        pool.alloc(*args)
    assert pool.free_lists() == before


BAD_FREES = [
    (np.array([8.0, 9.0, 10.0, 11.0]), TypeError, "must hold integers"),
    ("abcd", TypeError, "integer slot ids"),
    (8, TypeError, "scalar"),
    ([8, 9, True, 11], TypeError, "bool"),
    (np.array([8, 9, 10, 11], dtype=np.uint64) + np.uint64(2**63), SlotRangeError, "outside the int64 range"),
]


@pytest.mark.parametrize(("indices", "error", "text"), BAD_FREES)
def test_a_bad_free_is_refused_and_changes_nothing(indices: object, error: type, text: str) -> None:
    pool = InterleavedPagePool(16, 4, 2)
    held = pool.alloc(8, 0)
    before = pool.free_lists()
    with pytest.raises(error, match=text):
        pool.free(indices)
    assert pool.free_lists() == before
    assert pool.free(held) == 8


def test_a_free_that_fails_frees_none_of_the_good_pages_before_the_bad_one() -> None:
    pool = InterleavedPagePool(16, 4, 2)
    held = pool.alloc(16, 0)
    before = pool.free_lists()
    with pytest.raises(DoubleFreeError, match="freed twice"):
        pool.free(np.concatenate([held, held[:4]]))
    assert pool.free_lists() == before
    assert pool.free(held) == 16  # every page still held: the failed call staged and unstaged them all


def test_restore_refuses_another_shape_or_a_damaged_state() -> None:
    pool = InterleavedPagePool(16, 4, 2)
    with pytest.raises(HostPoolError, match="shape"):
        pool.restore_state(InterleavedPagePool(16, 4, 4).backup_state())
    with pytest.raises(TypeError, match="InterleavedPageState"):
        pool.restore_state(object())
    words = pool.backup_state()._words.copy()
    words[-1] = 0xFF  # a page state no page can be in
    with pytest.raises(HostPoolError, match="invariants"):
        pool.restore_state(InterleavedPageState(pool.shape, words))
    pool.check_invariants()


def test_a_snapshot_and_a_deep_copy_are_independent_of_the_pool() -> None:
    pool = InterleavedPagePool(16, 4, 2)
    state, twin = pool.backup_state(), copy.deepcopy(pool)
    pool.alloc(8, 1)
    assert twin.free_lists() != pool.free_lists()
    assert pickle.loads(pickle.dumps(state)).shape == pool.shape
    pool.restore_state(state)
    assert twin.free_lists() == pool.free_lists()


@given(st.lists(st.integers(-3, 40), max_size=12))
@settings(max_examples=80, deadline=None)
def test_any_slots_are_freed_exactly_when_they_are_whole_held_pages_named_once(slots: list[int]) -> None:
    pool = InterleavedPagePool(16, 2, 2)
    held = pool.alloc(16, 0)
    pages = [s // 2 for s in slots[::2]]
    whole = len(slots) % 2 == 0 and all(
        a >= 0 and a % 2 == 0 and b == a + 1 for a, b in zip(slots[::2], slots[1::2], strict=False)
    )
    fine = whole and len(set(pages)) == len(pages) and all(p * 2 in set(held.tolist()) for p in pages)
    before = pool.free_lists()
    if fine:
        assert pool.free(slots) == len(slots)
    else:
        with pytest.raises(HostPoolError):
            pool.free(slots)
        assert pool.free_lists() == before
    pool.check_invariants()


def test_threads_never_hand_out_a_page_twice() -> None:
    pool = InterleavedPagePool(4096, 4, 4)
    seen: list[list[int]] = []
    errors: list[BaseException] = []

    def work(start: int) -> None:
        try:
            mine = []
            for i in range(300):
                got = pool.alloc(4 * (1 + i % 5), start + i)
                if got is not None:
                    mine.append(got.tolist())
                if len(mine) > 4:
                    pool.free(np.array(mine.pop(0)))
            seen.append([s for a in mine for s in a])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    held = [s for part in seen for s in part]
    assert len(held) == len(set(held))
    pool.check_invariants()
    assert pool.aggregate_free_size() + len(held) == pool.shard_size * pool.pages_per_class * pool.page_size
