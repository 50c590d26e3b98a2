"""Differential test: LogicalHostPool against the pure-Python reference model.

A hypothesis state machine drives both with the same calls: allocations
(including 0 and more than is available), frees of whole held pages in random
subsets, orders and input forms, clear(), and invalid calls of every kind.
Every result, every raised exception type and every available_size() must
match the model; a failed call must leave the pool's state untouched; the
pool's own invariant check runs after every step. Small pools of a few pages
make pages cycle through the free and release lists and merges happen often.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hostpool_nb import LogicalHostPool
from hostpool_nb import _kernels as K
from tests.conftest import assert_lock_free
from tests.reference import ReferencePool

MAX_PAGES = 6
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", ">i8", "<i4"]
# Forms a valid slot list can be passed in (see PoolMachine.as_form).
FORMS = ["list", "tuple", "int64", "dtype", "2d", "fortran", "strided", "readonly", "array_like"]

_MISSING = object()


# The pool's messages, by the check that failed (see tests/reference.py).
_KINDS = [
    ("alignment", re.compile(r"^LogicalHostPool (allocation|free) must be page-aligned, got ")),
    ("negative", re.compile(r"^need_size must be non-negative, got need_size=-\d+$")),
    ("int64", re.compile(r"^free got slot -?\d+ at indices\[\d+\] \(flattened\), outside the int64 range$")),
    ("range", re.compile(r"^free got slot -?\d+ at indices\[\d+\] \(flattened\), outside \[0, \d+\)$")),
    ("misaligned", re.compile(r"which is not the first slot of a page")),
    ("partial", re.compile(r", expected -?\d+ to continue page \d+ ")),
    ("twice", re.compile(r"^page \d+ \(slots \d+\.\.\d+\) is freed twice in one call \(again at indices")),
    ("not_allocated", re.compile(r"^page \d+ \(slots \d+\.\.\d+\), freed at indices\[\d+\] \(flattened\), is not")),
]


def error_kind(exc: BaseException | None) -> str:
    """Which of the pool's checks raised ``exc``, read from its message."""
    if isinstance(exc, TypeError):
        return "type"
    text = str(exc)
    for kind, pattern in _KINDS:
        if pattern.search(text):
            return kind
    return f"unknown: {exc!r}"


class ArrayLike:
    """Not a sequence, only convertible through ``__array__``."""

    def __init__(self, values: np.ndarray) -> None:
        self._values = values

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self._values if dtype is None else self._values.astype(dtype)


class PoolMachine(RuleBasedStateMachine):
    def __init__(
        self, page_size: int, snapshot: Callable[..., Any], unchanged: Callable[..., None], errors_seen: set[str]
    ) -> None:
        super().__init__()
        self.ps = page_size
        self.snapshot = snapshot  # conftest fixtures
        self.unchanged = unchanged
        self.errors_seen = errors_seen  # shared by all runs of one test

    @initialize(n_pages=st.sampled_from([2, 3, 1, 4, 5, MAX_PAGES, 0]))
    def make_pools(self, n_pages: int) -> None:
        size = n_pages * self.ps
        self.n_pages = n_pages
        self.size = size
        self.pool = LogicalHostPool(size, self.ps)
        self.ref = ReferencePool(size, self.ps)

    # -- the comparison every rule goes through ----------------------------

    def both(self, pool_call: Callable[[], Any], ref_call: Callable[[], Any], expect_error: bool = False) -> Any:
        """Run one call on pool and model; compare outcomes; return the result."""
        before = self.snapshot(self.pool)
        try:
            want, want_exc = ref_call(), None
        except (TypeError, ValueError) as exc:  # anything else is a model bug
            want, want_exc = None, exc
        try:
            got, got_exc = pool_call(), None
        except Exception as exc:  # noqa: BLE001 - whatever the pool raises is compared with the model
            got, got_exc = None, exc
        if expect_error:
            assert want_exc is not None, "test bug: an invalid call the model accepts"
        if want_exc is not None:
            assert type(got_exc) is type(want_exc), f"pool raised {got_exc!r}, model raised {want_exc!r}"
            # The same check failed, at the same place: not only the same class.
            want_kind = getattr(want_exc, "kind", "type")
            assert error_kind(got_exc) == want_kind, f"pool raised {got_exc!r}, model's failed check is {want_kind}"
            position = getattr(want_exc, "position", None)
            if position is not None:
                assert f"indices[{position}]" in str(got_exc), f"pool raised {got_exc!r}, model failed at {position}"
            self.unchanged(self.pool, before)
            self.errors_seen.add(type(want_exc).__name__)
            return _MISSING
        assert got_exc is None, f"pool raised {got_exc!r}, model returned {want!r}"
        return got, want

    def check_alloc(self, need: Any, expect_error: bool = False) -> None:
        out = self.both(lambda: self.pool.alloc(need), lambda: self.ref.alloc(need), expect_error)
        if out is _MISSING:
            return
        got, want = out
        if want is None:
            assert got is None
            assert_lock_free(self.pool)  # the refusal released the lock too
            return
        assert isinstance(got, np.ndarray)
        assert got.dtype == np.int64
        assert got.ndim == 1
        assert got.tolist() == want

    def check_free(self, indices: Any, expect_error: bool = False) -> None:
        out = self.both(lambda: self.pool.free(indices), lambda: self.ref.free(indices), expect_error)
        if out is _MISSING:
            return
        got, want = out
        assert type(got) is int
        assert got == want

    # -- helpers -----------------------------------------------------------

    def page_slots(self, pages: list[int]) -> list[int]:
        return [p * self.ps + j for p in pages for j in range(self.ps)]

    def as_form(self, slots: list[int], form: str, data: st.DataObject) -> Any:
        """The same slot sequence as a list, tuple, or array of some layout."""
        arr = np.array(slots, dtype=np.int64)
        if form == "list":
            return list(slots)
        if form == "tuple":
            return tuple(slots)
        if form == "int64":
            return arr
        if form == "dtype":
            return arr.astype(data.draw(st.sampled_from(INT_DTYPES), label="dtype"))
        if form == "2d" and slots:
            return arr.reshape(-1, self.ps)
        if form == "fortran" and slots:
            return np.asfortranarray(arr.reshape(-1, self.ps))  # C-order flattening is slots
        if form == "strided":
            wide = np.full(2 * len(slots), -7, dtype=np.int64)
            wide[::2] = arr
            return wide[::2]
        if form == "readonly":
            arr.flags.writeable = False
            return arr
        if form == "array_like":
            return ArrayLike(arr.astype(np.int32))
        return arr

    def held(self) -> list[int]:
        return self.ref.held_pages()

    def not_held(self) -> list[int]:
        held = set(self.ref.allocated)
        return [p for p in range(self.n_pages) if p not in held]

    # -- valid calls ---------------------------------------------------------

    @precondition(lambda self: self.ref.available_size() > 0)
    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        # Mostly sizes that succeed; a merge happens when they exceed the free list.
        available_pages = self.ref.available_size() // self.ps
        pages = data.draw(st.integers(1, available_pages), label="pages")
        kind = data.draw(st.sampled_from([int, int, np.int64, np.uint32, np.int16]), label="kind")
        self.check_alloc(kind(pages * self.ps))

    @precondition(lambda self: self.ref.release_list)
    @rule(data=st.data())
    def alloc_with_merge(self, data: st.DataObject) -> None:
        # More than the free list holds (per the model): the release list merges.
        released = sum(len(chunk) for chunk in self.ref.release_list) // self.ps
        need = len(self.ref.free_slots) + data.draw(st.integers(1, released), label="pages") * self.ps
        self.check_alloc(need)

    @rule(data=st.data())
    def alloc_edge(self, data: st.DataObject) -> None:
        # 0, exactly everything available, or more than available (-> None).
        available = self.ref.available_size()
        extra = data.draw(st.integers(1, 2), label="extra") * self.ps
        self.check_alloc(data.draw(st.sampled_from([0, available, available + extra]), label="need"))

    @rule(data=st.data())
    def free_empty(self, data: st.DataObject) -> None:
        self.check_free(self.as_form([], data.draw(st.sampled_from(FORMS), label="form"), data))

    @precondition(lambda self: self.ref.allocated)
    @rule(data=st.data())
    def free_held(self, data: st.DataObject) -> None:
        # A random non-empty subset of the held pages, in random order.
        pages = data.draw(st.lists(st.sampled_from(self.held()), min_size=1, unique=True), label="pages")
        form = data.draw(st.sampled_from(FORMS), label="form")
        self.check_free(self.as_form(self.page_slots(pages), form, data))

    @rule()
    def clear(self) -> None:
        self.pool.clear()
        self.ref.clear()

    # -- invalid calls ---------------------------------------------------------

    @rule(data=st.data())
    def invalid_call(self, data: st.DataObject) -> None:
        # One rule for all invalid calls, so valid traffic dominates the runs.
        call = data.draw(st.sampled_from([self.free_invalid, self.free_random, self.alloc_invalid]), label="call")
        call(data)

    def free_invalid(self, data: st.DataObject) -> None:
        held = self.held()
        ps = self.ps
        # Some valid pages first, so a late failure must roll back earlier ones.
        prefix = data.draw(st.lists(st.sampled_from(held), unique=True, max_size=2), label="prefix") if held else []
        rest = [p for p in held if p not in prefix]
        choices = ["range_low", "range_high", "types"]
        if self.not_held():
            choices.append("not_allocated")
        if held:
            choices.append("twice_in_call")
        if ps > 1:
            choices += ["misaligned_len", "unordered", "partial"]
            if self.n_pages >= 2:
                choices.append("straddle")
        kind = data.draw(st.sampled_from(choices), label="kind")
        bad: Any
        if kind == "not_allocated":
            bad = self.page_slots([data.draw(st.sampled_from(self.not_held()))])
        elif kind == "twice_in_call":
            page = data.draw(st.sampled_from(prefix or held))
            between = [p for p in rest[:1] if p != page]
            bad = self.page_slots([page, *between, page])
        elif kind == "range_low":
            bad = [data.draw(st.integers(-3 * ps, -1)), *range(1, ps)]
        elif kind == "range_high":
            first = data.draw(st.integers(self.size, self.size + 2 * ps))
            bad = [first + j for j in range(ps)]
        elif kind == "misaligned_len":
            bad = self.page_slots(held[:1] or [0])[: data.draw(st.integers(1, ps - 1))]
        elif kind == "unordered":
            bad = self.page_slots(held[:1] or [0])[::-1]
        elif kind == "partial":
            slots = self.page_slots(held[:1] or [0])
            j = data.draw(st.integers(1, ps - 1))
            slots[j] = data.draw(st.integers(-1, self.size + 1).filter(lambda v, w=slots[j]: v != w))
            bad = slots
        elif kind == "straddle":
            first = data.draw(st.integers(0, self.size - ps - 1).filter(lambda v: v % ps != 0))
            bad = list(range(first, first + ps))
        else:  # wrong types
            bad = data.draw(
                st.sampled_from(
                    [
                        np.zeros(ps, dtype=np.float64),
                        np.arange(ps, dtype=np.float32),
                        np.ones(ps, dtype=bool),
                        np.arange(ps).astype(object),
                        np.arange(ps).astype(complex),
                        np.array([str(i) for i in range(ps)]),
                        np.full(ps, 2**63, dtype=np.uint64),
                        [float(i) for i in range(ps)],
                        "0" * ps,
                        0,
                        np.int64(0),
                        None,
                        [[0], [1, 2]],
                    ]
                ),
                label="bad",
            )
            self.check_free(bad, expect_error=True)
            return
        if kind in ("misaligned_len", "unordered", "partial", "straddle", "range_low", "range_high"):
            # These must fail on their own, before ownership is looked at.
            self.check_free(bad, expect_error=True)
        bad = self.page_slots(prefix) + list(bad)
        form = data.draw(st.sampled_from(["list", "int64", "dtype", "strided"]), label="form")
        if kind != "misaligned_len" and data.draw(st.booleans(), label="2d"):
            form = "2d"
        self.check_free(self.as_form(bad, form, data), expect_error=True)

    def free_random(self, data: st.DataObject) -> None:
        # Arbitrary slot lists, mostly invalid; the model decides.
        ps = self.ps
        n = data.draw(st.integers(0, 3) if ps == 1 else st.sampled_from([0, ps, 2 * ps, ps + 1]), label="n")
        slots = data.draw(st.lists(st.integers(-ps, self.size + ps), min_size=n, max_size=n), label="slots")
        self.check_free(slots)

    def alloc_invalid(self, data: st.DataObject) -> None:
        ps = self.ps
        choices: list[Any] = [
            -ps * data.draw(st.integers(1, 3)),
            float(ps),
            str(ps),
            None,
            True,
            np.bool_(True),
            np.array(ps),
            [ps],
            np.float64(ps),
        ]
        if ps > 1:
            choices += [data.draw(st.integers(-3 * ps, 3 * ps).filter(lambda v: v % ps != 0))]
        self.check_alloc(data.draw(st.sampled_from(choices), label="need"), expect_error=True)

    # -- after every step -----------------------------------------------------

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        assert self.pool.available_size() == self.ref.available_size()
        assert self.pool.size == self.size
        # Merges happen exactly when the model's do (when an allocation needs
        # more than the free list holds), so the free/released split agrees.
        st = self.pool._st
        assert int(st[K.H_MERGES]) == self.ref.merges
        assert int(st[K.H_NFREE]) * self.ps == len(self.ref.free_slots)
        assert int(st[K.H_NREL]) * self.ps == sum(len(chunk) for chunk in self.ref.release_list)


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
def test_pool_matches_reference(page_size: int, snapshot: Any, unchanged: Any) -> None:
    errors_seen: set[str] = set()
    run_state_machine_as_test(lambda: PoolMachine(page_size, snapshot, unchanged, errors_seen))
    # The invalid calls reached every error the pool can raise at this page size.
    expected = {"TypeError", "HostPoolError", "SlotRangeError", "DoubleFreeError"}
    if page_size > 1:
        expected |= {"AlignmentError", "PartialPageError"}
    assert errors_seen == expected


def test_reference_observable_order() -> None:
    """The model itself reproduces SPEC's worked example of FIFO order."""
    ref = ReferencePool(8, 1)
    assert ref.alloc(8) == list(range(8))
    ref.free([0, 1])
    ref.free([2, 3])
    assert ref.alloc(4) == [0, 1, 2, 3]


def test_pool_observable_order() -> None:
    """SPEC's example on the pool, plus release-order merging after free slots."""
    pool = LogicalHostPool(8, 1)
    assert pool.alloc(8).tolist() == list(range(8))
    pool.free([0, 1])
    pool.free([2, 3])
    assert pool.alloc(4).tolist() == [0, 1, 2, 3]
    pool = LogicalHostPool(16, 4)
    a = pool.alloc(8)  # pages 0, 1; pages 2, 3 stay on the free list
    pool.free(a[4:])  # page 1 released
    pool.free(a[:4])  # then page 0
    # Free list (pages 2, 3) first, then released chunks in release order.
    assert pool.alloc(16).tolist() == [*range(8, 16), *range(4, 8), *range(4)]


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_large_ring_random_trace_matches_reference(page_size: int) -> None:
    """The state machine's pools have a few pages; here 300, so block copies and
    ring positions span more than a few entries and wrap many times."""
    rng = np.random.default_rng(page_size)
    pages = 300
    pool, ref = LogicalHostPool(pages * page_size, page_size), ReferencePool(pages * page_size, page_size)
    held: list[list[int]] = []
    for step in range(400):
        if held and rng.random() < 0.5:
            chunk = held.pop(int(rng.integers(len(held))))
            by_page = np.array(chunk).reshape(-1, page_size)[rng.permutation(len(chunk) // page_size)]
            assert pool.free(by_page.reshape(-1)) == ref.free(by_page.reshape(-1)), step
        else:
            need = int(rng.integers(0, 60)) * page_size
            got, want = pool.alloc(need), ref.alloc(need)
            assert (None if got is None else got.tolist()) == want, step
            if want:
                held.append(want)
        assert pool.available_size() == ref.available_size(), step
        assert int(pool._st[K.H_MERGES]) == ref.merges, step
    pool.check_invariants()
