"""Differential test: LogicalHostPool against the pure-Python reference model.

A hypothesis state machine drives both with the same calls: allocations
(including 0 and more than is available), batches of them (``alloc_many``:
empty, with zero sizes, refused, beyond int64, in several input forms),
frees of whole held pages in random subsets, orders and input forms, free
groups (nested, ended, unbalanced, ``with`` blocks whose body frees, frees
twice, clears or raises), ``merge()``, ``clear()``, snapshots restored
later, pickle and deepcopy round trips, and invalid calls of every kind; for
both merge orders and page sizes 1, 3, 4 and 16. Every result and every
raised exception (class, failed check and its position) must match the
model; a failed call must leave the pool's state untouched and a refused
allocation must change only the refusal counters. After every step the
pool's own invariant check runs and its lists (in order), open groups and
``stats()`` must equal the model's. Small pools of a few pages make pages
cycle through the lists and merges happen often. Each run records the rules,
situations and errors it reached, and the test asserts it reached them all.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import pickle
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hostpool_nb import LogicalHostPool, PoolState
from hostpool_nb._kernels import layout as L
from tests.conftest import assert_lock_free
from tests.reference import INT64_MAX, ReferencePool, to_slot_list

MAX_PAGES = 6
PAGE_SIZES = [1, 3, 4, 16]
MERGE_ORDERS = ["fifo", "sorted"]
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", ">i8", "<i4"]
# Forms a valid slot list can be passed in (see PoolMachine.as_form).
FORMS = ["list", "tuple", "int64", "dtype", "2d", "fortran", "strided", "readonly", "array_like"]
# Forms a batch of sizes can be passed in (see PoolMachine.sizes_form).
SIZE_FORMS = ["list", "tuple", "int64", "int32", "uint16", "array_like", "numpy_scalars"]

_MISSING = object()


# The pool's messages, by the check that failed (see tests/reference.py).
_KINDS = [
    ("alignment", re.compile(r"^LogicalHostPool (allocation|free) must be page-aligned, got ")),
    ("negative", re.compile(r"^(need_size|sizes\[\d+\]) must be non-negative, got \1=-\d+$")),
    ("int64", re.compile(r"^free got slot -?\d+ at indices\[\d+\] \(flattened\), outside the int64 range$")),
    ("range", re.compile(r"^free got slot -?\d+ at indices\[\d+\] \(flattened\), outside \[0, \d+\)$")),
    ("misaligned", re.compile(r"which is not the first slot of a page")),
    ("partial", re.compile(r", expected -?\d+ to continue page \d+ ")),
    ("twice", re.compile(r"^page \d+ \(slots \d+\.\.\d+\) is freed twice in one call \(again at indices")),
    ("not_allocated", re.compile(r"^page \d+ \(slots \d+\.\.\d+\), freed at indices\[\d+\] \(flattened\), is not")),
    ("no_group", re.compile(r"^free_group_end\(\) without a free group: ")),
    ("foreign", re.compile(r"^the state is from a pool with size=\d+, page_size=\d+, merge='\w+'; this pool has ")),
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


def pool_lists(pool: LogicalHostPool) -> tuple[list[int], list[int], list[int]]:
    """The pool's free, release and pending lists, as page ids in order.

    Read from the state array's ring (layout in ``_kernels/pool.py``): the public
    API shows only their lengths, and an order bug should fail the step that
    makes it, not a later allocation that happens to reveal it.
    """
    s = pool._st
    nfree, nrel = int(s[L.H_NFREE]), int(s[L.H_NREL])
    window = L.listed(s).tolist()
    return window[:nfree], window[nfree : nfree + nrel], window[nfree + nrel :]


class ArrayLike:
    """Not a sequence, only convertible through ``__array__``."""

    def __init__(self, values: np.ndarray) -> None:
        self._values = values

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self._values if dtype is None else self._values.astype(dtype)


class BodyError(Exception):
    """Raised by the body of a ``with pool.free_group()`` block."""


class PoolMachine(RuleBasedStateMachine):
    def __init__(
        self,
        page_size: int,
        merge: str,
        fixtures: dict[str, Callable[..., Any]],
        errors_seen: set[str],
        events: set[str],
    ) -> None:
        super().__init__()
        self.ps = page_size
        self.merge_order = merge
        self.snapshot = fixtures["snapshot"]  # conftest fixtures
        self.unchanged = fixtures["unchanged"]
        self.refused = fixtures["refused"]
        self.errors_seen = errors_seen  # shared by all runs of one test
        self.events = events  # rules, situations and error kinds reached, shared likewise

    # Mostly 2 pages or more (a merge order needs two); pools of one page and of
    # none are edge cases with little to do, so they get a sixth of the runs.
    @initialize(n_pages=st.sampled_from([2, 3, 4, 5, MAX_PAGES] * 2 + [1, 0]))
    def make_pools(self, n_pages: int) -> None:
        size = n_pages * self.ps
        self.n_pages = n_pages
        self.size = size
        self.pool = LogicalHostPool(size, self.ps, merge=self.merge_order)
        self.ref = ReferencePool(size, self.ps, merge=self.merge_order)
        self.before = self.snapshot(self.pool)  # the state before the last call through both()
        self.last_error: BaseException | None = None  # the model's error in the last failed call
        # (PoolState, model copy) pairs from backup_state, restored by a later rule.
        self.backups: list[tuple[PoolState, ReferencePool]] = []
        # The pool replaced by its pickled or deep copy, with its model and a copy of
        # its state array: it must not change while the copy is used.
        self.retired: tuple[LogicalHostPool, ReferencePool, np.ndarray] | None = None

    # -- the comparison every rule goes through ----------------------------

    def both(
        self,
        pool_call: Callable[[], Any],
        ref_call: Callable[[], Any],
        expect_error: bool = False,
        *,
        call: str,
        where: str = "indices",
    ) -> Any:
        """Run one call on pool and model; compare outcomes; return the result.

        ``call`` names the call in the events; ``where`` is the argument the
        model's error position indexes (``indices`` for free, ``sizes`` for
        alloc_many), which the pool's message must name.
        """
        before = self.before = self.snapshot(self.pool)
        fifo_order = self.ref.free_slots + self.ref.released_slots()
        merges = self.ref.merges
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
                assert f"{where}[{position}]" in str(got_exc), f"pool raised {got_exc!r}, model failed at {position}"
            self.unchanged(self.pool, before)
            self.errors_seen.add(type(want_exc).__name__)
            self.events.add(f"{call} error: {want_kind}")
            self.last_error = want_exc
            return _MISSING
        assert got_exc is None, f"pool raised {got_exc!r}, model returned {want!r}"
        if call in ("alloc", "alloc_many", "merge") and self.ref.merges > merges:
            self.events.add(f"{call} merged")
            if fifo_order != sorted(fifo_order):  # the merge orders give different lists
                self.events.add("a merge whose order matters")
        return got, want

    def check_alloc(self, need: Any, expect_error: bool = False) -> None:
        out = self.both(lambda: self.pool.alloc(need), lambda: self.ref.alloc(need), expect_error, call="alloc")
        if out is _MISSING:
            return
        got, want = out
        if want is None:
            assert got is None
            self.refused(self.pool, self.before)  # only the refusal counters moved, and the lock is free
            return
        assert isinstance(got, np.ndarray)
        assert got.dtype == np.int64
        assert got.ndim == 1
        assert got.tolist() == want

    def check_alloc_many(self, sizes: Any, expect_error: bool = False) -> None:
        out = self.both(
            lambda: self.pool.alloc_many(sizes),
            lambda: self.ref.alloc_many(sizes),
            expect_error,
            call="alloc_many",
            where="sizes",
        )
        if out is _MISSING:
            return
        got, want = out
        if want is None:
            assert got is None
            self.refused(self.pool, self.before)  # all or nothing: only the refusal counters moved
            self.events.add("alloc_many refused")
            return
        assert type(got) is tuple
        assert len(got) == 2
        slots, offsets = got
        for arr in (slots, offsets):
            assert isinstance(arr, np.ndarray)
            assert arr.dtype == np.int64
            assert arr.ndim == 1
            # Caller-owned: nothing shared with the pool's state or the caller's sizes.
            assert not np.shares_memory(arr, self.pool._st)
            assert not (isinstance(sizes, np.ndarray) and np.shares_memory(arr, sizes))
        assert not np.shares_memory(slots, offsets)
        assert slots.tolist() == want[0]
        assert offsets.tolist() == want[1]
        self.events.add("alloc_many")
        if len(want[1]) == 1:
            self.events.add("alloc_many empty batch")
        if 0 in np.diff(want[1]).tolist():
            self.events.add("alloc_many zero size")

    def check_free(self, indices: Any, expect_error: bool = False) -> None:
        pending = set(self.pages_of(self.ref.pending_slots()))
        out = self.both(lambda: self.pool.free(indices), lambda: self.ref.free(indices), expect_error, call="free")
        if out is _MISSING:
            # A page freed earlier in an open group, still pending, freed again.
            kind, position = (getattr(self.last_error, a, None) for a in ("kind", "position"))
            if kind == "not_allocated" and to_slot_list(indices)[position] // self.ps in pending:
                self.events.add("free of a pending page")
            return
        got, want = out
        assert type(got) is int
        assert got == want
        if got and self.ref.group_depth > 0:
            self.events.add("free inside a group")

    # -- helpers -----------------------------------------------------------

    def page_slots(self, pages: list[int]) -> list[int]:
        return [p * self.ps + j for p in pages for j in range(self.ps)]

    def pages_of(self, slots: list[int]) -> list[int]:
        return [s // self.ps for s in slots[:: self.ps]]

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

    def sizes_form(self, sizes: list[Any], form: str) -> Any:
        """The same batch of sizes as a list, tuple, numpy array or array-like."""
        if form == "list":
            return list(sizes)
        if form == "tuple":
            return tuple(sizes)
        if form in ("int64", "int32", "uint16"):
            return np.array(sizes, dtype=form)
        if form == "array_like":
            return ArrayLike(np.array(sizes, dtype=np.int64))
        if form == "numpy_scalars":  # a list of numpy integers of mixed widths
            return [(np.int64, np.uint16, np.int32)[i % 3](s) for i, s in enumerate(sizes)]
        raise AssertionError(f"test bug: unknown form {form}")

    def held(self) -> list[int]:
        return self.ref.held_pages()

    def not_held(self) -> list[int]:
        held = set(self.ref.allocated)
        return [p for p in range(self.n_pages) if p not in held]

    # -- valid calls ---------------------------------------------------------

    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        # Mostly sizes that succeed; more than the free list holds (the release list
        # merges); or 0, exactly everything available, or more than that (-> None).
        ps = self.ps
        available, free = self.ref.available_size(), len(self.ref.free_slots)
        kinds = ["fits", "fits", "edge"] + (["merge"] if self.ref.release_list else [])
        kind = data.draw(st.sampled_from(kinds if available else ["edge"]), label="kind")
        if kind == "fits":
            pages = data.draw(st.integers(1, available // ps), label="pages")
            width = data.draw(st.sampled_from([int, int, np.int64, np.uint32, np.int16]), label="width")
            self.check_alloc(width(pages * ps))
        elif kind == "merge":
            self.check_alloc(free + data.draw(st.integers(1, (available - free) // ps), label="pages") * ps)
        else:
            extra = data.draw(st.integers(1, 2), label="extra") * ps
            self.check_alloc(data.draw(st.sampled_from([0, available, available + extra]), label="need"))

    @rule(data=st.data())
    def alloc_many(self, data: st.DataObject) -> None:
        # Up to 4 requests that fit together (zero sizes and empty batches included);
        # more than the free list holds (the release list merges); or batches of
        # exactly everything available, or more: a little more, a sum beyond int64
        # (each size within it), or a size beyond int64 itself.
        ps = self.ps
        kinds = ["fits", "fits", "empty", "exact", "short", "int64"]
        kind = data.draw(st.sampled_from(kinds + (["merge"] * 2 if self.ref.release_list else [])), label="kind")
        available = self.ref.available_size() // ps
        if kind == "fits":
            pages = []
            for _ in range(data.draw(st.integers(0, 4), label="requests")):
                pages.append(data.draw(st.integers(0, available - sum(pages)), label="pages"))
            sizes = [p * ps for p in pages]
        elif kind == "empty":
            sizes = []
        elif kind in ("exact", "short", "merge"):
            if kind == "exact":
                total = available
            elif kind == "short":
                total = available + data.draw(st.integers(1, 2), label="extra")
            else:
                total = data.draw(st.integers(len(self.ref.free_slots) // ps + 1, available), label="pages")
            first = data.draw(st.integers(0, total), label="first")
            sizes = [first * ps, (total - first) * ps]
            if data.draw(st.booleans(), label="zero"):
                sizes.insert(1, 0)
        else:
            # Sizes within int64 whose sum is not, and a size beyond int64 itself.
            self.events.add("alloc_many overflow int64")
            big = (INT64_MAX // ps // 2 + 1) * ps  # two of these add up beyond int64
            form = data.draw(st.sampled_from(["list", "int64"]), label="form")
            self.check_alloc_many(self.sizes_form([ps, big, big], form))
            self.events.add("alloc_many beyond int64")
            beyond = (INT64_MAX // ps + 1) * ps  # the first page multiple beyond int64
            as_uint64 = data.draw(st.booleans(), label="uint64")
            self.check_alloc_many(np.array([0, beyond], dtype=np.uint64) if as_uint64 else [0, beyond])
            return
        form = data.draw(st.sampled_from(SIZE_FORMS), label="form")
        self.events.add(f"alloc_many as {form}")
        self.check_alloc_many(self.sizes_form(sizes, form))

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        # Random non-empty subsets of the held pages, in random order, in up to
        # three calls: several released chunks make merge orders differ. Or an
        # empty free, in any form.
        available = self.ref.available_size() // self.ps
        if not self.ref.allocated and available:
            # Nothing held: a batch of two requests first, so that there is something to free.
            first = data.draw(st.integers(1, available), label="first")
            second = data.draw(st.integers(0, available - first), label="second")
            self.check_alloc_many([first * self.ps, second * self.ps])
        if not self.ref.allocated or data.draw(st.sampled_from([False] * 4 + [True]), label="empty"):
            self.check_free(self.as_form([], data.draw(st.sampled_from(FORMS), label="form"), data))
            return
        for _ in range(data.draw(st.integers(1, 3), label="calls")):
            if not self.ref.allocated:
                break
            pages = data.draw(st.lists(st.sampled_from(self.held()), min_size=1, unique=True), label="pages")
            form = data.draw(st.sampled_from(FORMS), label="form")
            self.check_free(self.as_form(self.page_slots(pages), form, data))
        # Then what a scheduler may do next, so the situations that need a step
        # after a free are frequent: merge now, or allocate more than the free list
        # holds (the release list merges; in order or not, depending on the frees).
        released = len(self.ref.released_slots()) // self.ps
        then = data.draw(
            st.sampled_from(
                ["nothing", "merge"]
                + (["alloc", "alloc_many"] if released else [])
                + (["free again"] if self.ref.pending else [])
            ),
            label="then",
        )
        if then == "merge":
            self.merge(data)
        elif then in ("alloc", "alloc_many"):
            need = len(self.ref.free_slots) + self.ps * data.draw(st.integers(1, released), label="pages")
            if then == "alloc":
                self.check_alloc(need)
            else:
                first = data.draw(st.integers(0, need // self.ps), label="first") * self.ps
                form = data.draw(st.sampled_from(SIZE_FORMS), label="form")
                self.events.add(f"alloc_many as {form}")
                self.check_alloc_many(self.sizes_form([first, need - first], form))
        elif then == "free again":
            # A page freed earlier in the open group, still pending: a double free.
            page = data.draw(st.sampled_from(self.pages_of(self.ref.pending_slots())), label="page")
            self.check_free(self.page_slots([page]), expect_error=True)

    # A data argument, even unused, keeps hypothesis from picking a rule several
    # times as often as the others (it favours rules without arguments).
    @rule(data=st.data())
    def merge(self, data: st.DataObject) -> None:
        released = self.ref.release_list != []
        got, want = self.both(self.pool.merge, self.ref.merge, call="merge")
        assert type(got) is int
        assert got == want
        self.events.add("merge()")
        if not released:
            self.events.add("merge with nothing released")

    # Only when there is something to clear: repeated clears of a fresh pool
    # would crowd out the rules that need held pages.
    @precondition(lambda self: self.ref.allocated or self.ref.group_depth or self.ref.release_list)
    @rule(data=st.data())  # the unused data: see merge
    def clear(self, data: st.DataObject) -> None:
        if self.ref.group_depth > 0:
            self.events.add("clear inside a group")
        self.both(self.pool.clear, self.ref.clear, call="clear")

    # -- free groups -----------------------------------------------------------

    @rule(data=st.data())
    def free_group(self, data: st.DataObject) -> None:
        # Begin or end an explicit group, at most two deep. One rule for both, so
        # groups end about as often as they begin and the pool also spends long
        # stretches outside them, where frees are released and merges happen.
        depth = self.ref.group_depth
        if depth == 0 or (depth == 1 and data.draw(st.booleans(), label="nest")):
            self.free_group_begin_both()
            return
        self.free_group_end_both()

    def free_group_begin_both(self) -> None:
        """``free_group_begin()`` on both."""
        self.events.add("free_group_begin" + (" nested" if self.ref.group_depth > 0 else ""))
        self.both(self.pool.free_group_begin, self.ref.free_group_begin, call="free_group_begin")

    def free_group_end_both(self) -> None:
        """``free_group_end()`` on both, for a group that is open."""
        self.events.add("free_group_end")
        if self.ref.group_depth > 1:
            self.events.add("free_group_end inner")
        elif self.ref.pending:
            self.events.add("free_group_end released")
        self.both(self.pool.free_group_end, self.ref.free_group_end, call="free_group_end")

    @rule(data=st.data())
    def free_group_block(self, data: st.DataObject) -> None:
        # A free group around some frees, as ``with pool.free_group():`` or as
        # explicit begin and end calls. The body may free a page twice and, in a
        # with block, clear the pool, and end normally or raise.
        style = data.draw(st.sampled_from(["with", "explicit"]), label="style")
        outermost = self.ref.group_depth == 0
        do_clear = style == "with" and data.draw(st.sampled_from([False, False, True]), label="clear")
        do_raise = style == "with" and data.draw(st.booleans(), label="raise")
        freed: list[int] = []  # slots freed in the block, in order

        def body() -> None:
            available = self.ref.available_size()
            if not self.held() and available:
                # Something to free: allocating inside a group is fine.
                self.check_alloc(data.draw(st.integers(1, available // self.ps), label="pages") * self.ps)
            for _ in range(data.draw(st.integers(1, 3), label="frees")):
                if not self.held():
                    break
                pages = data.draw(st.lists(st.sampled_from(self.held()), min_size=1, unique=True), label="pages")
                self.check_free(self.as_form(self.page_slots(pages), "int64", data))
                freed.extend(self.page_slots(pages))
            if freed and data.draw(st.booleans(), label="twice"):
                # Freed in this block, still pending: a double free.
                page = data.draw(st.sampled_from(self.pages_of(freed)), label="page")
                self.check_free(self.page_slots([page]), expect_error=True)
                self.events.add("group block double free")
            if freed and data.draw(st.booleans(), label="alloc"):
                # Up to everything freed so far: pending pages are not available yet,
                # so asking for them too is refused.
                pages = data.draw(st.integers(0, (self.ref.available_size() + len(freed)) // self.ps), label="pages")
                self.check_alloc(pages * self.ps)
            if do_clear:
                self.clear(data)
            if do_raise:
                raise BodyError

        raised = False
        try:
            if style == "with":
                self.events.add("free_group_begin" + ("" if outermost else " nested"))
                with self.pool.free_group(), self.ref.free_group():
                    body()
                if not outermost and not do_clear:
                    self.events.add("free_group_end inner")
            else:
                self.free_group_begin_both()
                body()
                self.free_group_end_both()
        except BodyError:
            raised = True
        assert raised == do_raise, "the with block swallowed its body's exception"
        if freed and not do_clear:
            # The block's frees are applied whether or not its body raised: released
            # at the end of an outermost group, still pending inside another one.
            _, released, pending = pool_lists(self.pool)
            where = released if outermost else pending
            assert self.page_slots(where[len(where) - len(freed) // self.ps :]) == freed
            assert (pending == []) is outermost
        ending = "cleared" if do_clear else "raised" if do_raise else "returned"
        self.events.add(f"{style} block")
        self.events.add(f"{style} block {ending}" + (" freed" * bool(freed)))

    # -- snapshots and copies --------------------------------------------------

    @rule(data=st.data())
    def snapshot_state(self, data: st.DataObject) -> None:
        # Back up now (up to three backups are kept), or restore one taken earlier.
        if not self.backups or data.draw(st.booleans(), label="backup"):
            state = self.pool.backup_state()
            assert isinstance(state, PoolState)
            self.backups = [*self.backups[-2:], (state, self.ref.backup_state())]
            self.events.add("backup_state")
            return
        # A backup taken any number of steps ago, maybe of another pool with the same
        # shape (before a pickle round trip), maybe itself pickled in between.
        state, ref_state = data.draw(st.sampled_from(self.backups), label="backup")
        if data.draw(st.booleans(), label="pickled"):
            state = pickle.loads(pickle.dumps(state))
            self.events.add("restore_state pickled")
        self.both(
            lambda: self.pool.restore_state(state), lambda: self.ref.restore_state(ref_state), call="restore_state"
        )
        self.events.add("restore_state")

    @rule(how=st.sampled_from(["pickle", "deepcopy", "take back"]))
    def replace_by_copy(self, how: str) -> None:
        # The copy takes over; the original, retired with a copy of its model, must
        # not change while the copy is used, and may be taken back later.
        if how == "take back" and self.retired is not None:
            pool, ref, _ = self.retired
            self.retired = (self.pool, self.ref, self.pool._st.copy())
            self.pool, self.ref = pool, ref
            self.events.add("take back the retired pool")
            return
        how = "pickle" if how == "take back" else how  # nothing retired yet to take back
        old = self.pool
        new = pickle.loads(pickle.dumps(old)) if how == "pickle" else copy.deepcopy(old)

        def shape(pool: LogicalHostPool) -> tuple[Any, ...]:
            return type(pool), pool.size, pool.page_size, pool.layout, pool.merge_order

        assert shape(new) == shape(old)
        assert not np.shares_memory(new._st, old._st)
        assert new.lock is not old.lock
        with old.lock:
            assert_lock_free(new)  # a lock of its own: holding the original's does not block it
        self.retired = (old, copy.deepcopy(self.ref), old._st.copy())
        self.pool = new
        self.events.add(f"replace_by_copy {how}")

    # -- invalid calls ---------------------------------------------------------

    @rule(data=st.data())
    def invalid_free(self, data: st.DataObject) -> None:
        # Invalid frees of every kind, and arbitrary slot lists (mostly invalid).
        data.draw(st.sampled_from([self.free_invalid, self.free_random]), label="call")(data)

    @rule(data=st.data())
    def invalid_call(self, data: st.DataObject) -> None:
        # One rule for all other invalid calls, so valid traffic dominates the runs;
        # each step makes every kind of them (a failed call changes nothing, so
        # their order matters little), so that every error kind is reached often.
        calls = [self.alloc_invalid, self.alloc_many_invalid, self.restore_invalid]
        if self.ref.group_depth == 0:
            calls.append(self.free_group_end_unbalanced)
        for call in data.draw(st.permutations(calls), label="calls"):
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
        if self.ref.pending:
            choices.append("pending")
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
        elif kind == "pending":
            # Freed inside the open group: a second free is a double free.
            bad = self.page_slots([data.draw(st.sampled_from(self.pages_of(self.ref.pending_slots())))])
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

    def alloc_many_invalid(self, data: st.DataObject) -> None:
        ps = self.ps
        # A size that fails alloc's checks, at a random position of a batch...
        n = data.draw(st.integers(1, 4), label="requests")
        pos = data.draw(st.integers(0, n - 1), label="position")
        negative = st.integers(-3, -1).map(lambda k: k * ps)
        misaligned = st.integers(-3 * ps, 3 * ps).filter(lambda v: v % ps != 0)
        for bad_size in [negative, misaligned] if ps > 1 else [negative]:
            sizes: list[Any] = [data.draw(st.integers(0, 2), label="pages") * ps for _ in range(n)]
            sizes[pos] = data.draw(bad_size, label="bad")
            form = data.draw(st.sampled_from(["list", "tuple", "int64", "int32"]), label="form")
            if form != "int32" and pos > 0 and data.draw(st.booleans(), label="big"):
                # A size that cannot be served comes first: the checks still go on.
                sizes[0] = (INT64_MAX // ps) * ps
            if data.draw(st.booleans(), label="later"):
                sizes.append(-ps if ps == 1 else 1)  # a later bad size: the first one is reported
            self.check_alloc_many(self.sizes_form(sizes, form), expect_error=True)
        # ...and a batch that is no 1-D sequence of integers.
        bad: Any
        if data.draw(st.booleans(), label="element"):
            # An element that is no integer, in a list or a tuple.
            sizes = [data.draw(st.integers(0, 2), label="pages") * ps for _ in range(n)]
            sizes[pos] = data.draw(
                st.sampled_from([float(ps), True, np.bool_(False), None, [ps], str(ps), np.float32(ps)]), label="bad"
            )
            bad = sizes if data.draw(st.booleans(), label="list") else tuple(sizes)
        else:
            bad = data.draw(
                st.sampled_from(
                    [
                        np.array([[ps], [ps]]),
                        np.zeros((0, 2), dtype=np.int64),
                        ps,
                        np.int64(ps),
                        np.array(ps),
                        str(ps),
                        None,
                        np.array([float(ps)]),
                        np.array([True]),
                        np.array([ps], dtype=object),
                        ArrayLike(np.array([[ps]])),
                    ]
                ),
                label="bad",
            )
        self.check_alloc_many(bad, expect_error=True)

    def restore_invalid(self, data: st.DataObject) -> None:
        # Something that is no backup (the same object for both: neither a
        # PoolState nor a model copy)...
        bad = data.draw(st.sampled_from([None, "state", {}, self.pool._st.copy()]), label="bad")
        self.both(
            lambda: self.pool.restore_state(bad),
            lambda: self.ref.restore_state(bad),
            expect_error=True,
            call="restore_state",
        )
        # ...and a backup of a pool of another shape.
        ps = self.ps
        size, page_size, merge = self.size, ps, self.merge_order
        kind = data.draw(st.sampled_from(["size", "merge"] + (["page_size"] if ps > 1 else [])), label="kind")
        if kind == "size":
            size += ps * data.draw(st.sampled_from([-1, 1]).filter(lambda d: size + d * ps >= 0), label="pages")
        elif kind == "merge":
            merge = "sorted" if merge == "fifo" else "fifo"
        else:
            page_size = 1
        state = LogicalHostPool(size, page_size, merge=merge).backup_state()
        ref_state = ReferencePool(size, page_size, merge=merge).backup_state()
        self.both(
            lambda: self.pool.restore_state(state),
            lambda: self.ref.restore_state(ref_state),
            expect_error=True,
            call="restore_state",
        )

    def free_group_end_unbalanced(self, data: st.DataObject) -> None:
        self.both(self.pool.free_group_end, self.ref.free_group_end, expect_error=True, call="free_group_end")

    # -- after every step -----------------------------------------------------

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool, ref = self.pool, self.ref
        pool.check_invariants()
        assert pool.available_size() == ref.available_size()
        assert pool.size == self.size
        # Every statistic, field by field; a field the model lacks fails too.
        pool_stats = pool.stats()
        stats = dataclasses.asdict(pool_stats)
        want = ref.stats()
        assert stats.keys() == want.keys(), f"stats() fields {sorted(stats)}, model has {sorted(want)}"
        for name, value in want.items():
            assert stats[name] == value, f"stats().{name} is {stats[name]}, model says {value}"
        assert pool_stats.usage == (want["allocated_pages"] / want["num_pages"] if want["num_pages"] else 0.0)
        # Merges happen exactly when the model's do (when an allocation needs
        # more than the free list holds, or on merge()), so the lists agree,
        # in order: the free, release and pending lists, and the open groups.
        assert int(pool._st[L.H_MERGES]) == ref.merges
        free, released, pending = pool_lists(pool)
        assert self.page_slots(free) == ref.free_slots
        assert self.page_slots(released) == ref.released_slots()
        assert self.page_slots(pending) == ref.pending_slots()
        assert int(pool._st[L.H_GROUP_DEPTH]) == ref.group_depth
        if self.retired is not None:
            old, _, words = self.retired
            assert np.array_equal(old._st, words), "using a pickled or deep copy changed the original"


def expected_events(page_size: int, thorough: bool) -> set[str]:
    """What the runs at each page size and merge order must reach.

    Always every new call (each rule's) and every error kind of the new
    calls; when ``thorough``, also the situations that make them interesting.
    """
    events = {
        "alloc_many",
        "alloc_many refused",
        "alloc_many error: type",
        "alloc_many error: negative",
        "merge()",
        "free_group_begin",
        "free_group_end",
        "free_group_end error: no_group",
        "with block",
        "explicit block",
        "backup_state",
        "restore_state",
        "restore_state error: type",
        "restore_state error: foreign",
        "replace_by_copy pickle",
        "replace_by_copy deepcopy",
    }
    if page_size > 1:
        events.add("alloc_many error: alignment")
    if not thorough:
        return events
    return events | {
        # alloc_many: an empty batch and zero sizes; refused for totals and sizes
        # beyond int64; merging the release list.
        "alloc_many empty batch",
        "alloc_many zero size",
        "alloc_many overflow int64",
        "alloc_many beyond int64",
        "alloc_many merged",
        # Merges by allocations and by merge(), with lists that the two merge
        # orders put in different orders; merge() with nothing released.
        "alloc merged",
        "merge merged",
        "a merge whose order matters",
        "merge with nothing released",
        # Free groups: nested, ended inside another, releasing pages; frees inside
        # them (also of pages already pending); blocks that return, raise or clear.
        "free_group_begin nested",
        "free_group_end inner",
        "free_group_end released",
        "free inside a group",
        "free of a pending page",
        "clear inside a group",
        "with block returned freed",
        "with block raised freed",
        "with block cleared freed",
        "explicit block returned freed",
        "group block double free",
        # Snapshots and copies.
        "restore_state pickled",
        "take back the retired pool",
    }


@pytest.mark.slow
@pytest.mark.parametrize("merge", MERGE_ORDERS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_pool_matches_reference(page_size: int, merge: str, snapshot: Any, unchanged: Any, refused: Any) -> None:
    errors_seen: set[str] = set()
    events: set[str] = set()
    fixtures = {"snapshot": snapshot, "unchanged": unchanged, "refused": refused}
    run_state_machine_as_test(lambda: PoolMachine(page_size, merge, fixtures, errors_seen, events))
    # The invalid calls reached every error the pool can raise at this page size.
    expected = {"TypeError", "HostPoolError", "SlotRangeError", "DoubleFreeError"}
    if page_size > 1:
        expected |= {"AlignmentError", "PartialPageError"}
    assert errors_seen == expected
    # And the runs reached every new call and error kind of the scheduler API, and
    # with enough steps every situation. Fewer (the mutation profile's 60 runs of
    # at most 30 steps) cannot promise each situation at every page size.
    current = settings()
    thorough = current.max_examples * current.stateful_step_count >= 4000
    missing = expected_events(page_size, thorough) - events
    assert not missing, f"the runs never reached: {sorted(missing)}"


def test_reference_observable_order() -> None:
    """The model itself reproduces the worked example of docs/behaviour.md of FIFO order."""
    ref = ReferencePool(8, 1)
    assert ref.alloc(8) == list(range(8))
    ref.free([0, 1])
    ref.free([2, 3])
    assert ref.alloc(4) == [0, 1, 2, 3]


@pytest.mark.parametrize("cls", [ReferencePool, LogicalHostPool])
@pytest.mark.parametrize(("merge", "order"), [("fifo", [6, 7, 2, 3, 0, 1]), ("sorted", [0, 1, 2, 3, 6, 7])])
def test_merge_order_and_free_group_example(cls: Any, merge: str, order: list[int]) -> None:
    """The two merge orders and a free group, on a worked example, for model and pool alike."""
    pool = cls(8, 1, merge=merge)
    assert np.asarray(pool.alloc(8)).tolist() == list(range(8))
    pool.free([6, 7])
    pool.free([2, 3])
    with pool.free_group():
        pool.free([0, 1])
        assert pool.available_size() == 4  # pages freed in an open group are not available
    assert pool.available_size() == 6
    # The free list is empty: the allocation merges everything released, in the pool's order.
    assert np.asarray(pool.alloc(6)).tolist() == order


def test_pool_observable_order() -> None:
    """The worked example of docs/behaviour.md on the pool, plus release-order merging after free slots."""
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


@pytest.mark.parametrize("merge", MERGE_ORDERS)
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_large_ring_random_trace_matches_reference(page_size: int, merge: str) -> None:
    """The state machine's pools have a few pages; here 300, so block copies, sorted
    merges and ring positions span more than a few entries and wrap many times."""
    rng = np.random.default_rng(page_size)
    pages = 300
    pool = LogicalHostPool(pages * page_size, page_size, merge=merge)
    ref = ReferencePool(pages * page_size, page_size, merge=merge)
    held: list[list[int]] = []
    for step in range(400):
        op = rng.random()
        if held and op < 0.45:
            chunk = held.pop(int(rng.integers(len(held))))
            by_page = np.array(chunk).reshape(-1, page_size)[rng.permutation(len(chunk) // page_size)]
            assert pool.free(by_page.reshape(-1)) == ref.free(by_page.reshape(-1)), step
        elif op < 0.5:
            # Groups up to two deep, so pending pages pile up behind the release list.
            if ref.group_depth < 2 and rng.random() < 0.5:
                pool.free_group_begin()
                ref.free_group_begin()
            elif ref.group_depth > 0:
                pool.free_group_end()
                ref.free_group_end()
        elif op < 0.7:
            sizes = (rng.integers(0, 20, size=int(rng.integers(0, 4))) * page_size).tolist()
            got, want = pool.alloc_many(sizes), ref.alloc_many(sizes)
            assert (None if got is None else (got[0].tolist(), got[1].tolist())) == want, step
            if want:
                slots, offsets = want
                held += [slots[a:b] for a, b in itertools.pairwise(offsets) if b > a]
        else:
            need = int(rng.integers(0, 60)) * page_size
            got1, want1 = pool.alloc(need), ref.alloc(need)
            assert (None if got1 is None else got1.tolist()) == want1, step
            if want1:
                held.append(want1)
        assert pool.available_size() == ref.available_size(), step
        assert dataclasses.asdict(pool.stats()) == ref.stats(), step
    pool.check_invariants()
    assert ref.merges > 10, "test too weak: too few merges"
