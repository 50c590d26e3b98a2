"""sglang's ``PageInterleaveHostPool`` on hostpool_nb's books, against the original's (stand-in and wheel).

The state machine drives two pools of the same class, one with the
original methods (the stand-in written from docs/behaviour.md section 6,
or sglang 0.5.23's own, read from its wheel when
``HOSTPOOL_NB_SGLANG_WHEEL`` names it), one with hostpool_nb's (replaced on
the class, as ``install()`` does): every correct call's result,
``available_size`` and each class's list must be equal; each misuse goes
to hostpool_nb's pool only and must raise both hostpool_nb's error and the
original's kind, changing nothing. Then ``install()`` on the stand-in
engine: status, the INFO line, subclasses, ``uninstall()``'s hand-back,
threads.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from hypothesis import settings  # noqa: E402 - after the skip without torch
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hostpool_nb import (  # noqa: E402
    AlignmentError,
    HostKVAlignmentError,
    HostKVArgumentError,
    HostKVDoubleFreeError,
    HostKVSlotRangeError,
    HostPoolError,
    InterleavedPagePool,
    PartialPageError,
)
from hostpool_nb.integrations import sglang, status  # noqa: E402
from hostpool_nb.originals.engines import stand_in_engine  # noqa: E402
from tests import sglang_host_cases as C  # noqa: E402

pytestmark = pytest.mark.torch

SHAPES = [(1, 6, 2), (4, 5, 2), (2, 4, 3), (16, 3, 4)]  # page size, pages a class, classes


def _lists(pool: object) -> list[list[int]]:
    """Each class's free pages, front first, from either side: the original's allocator, or our books."""
    kept = vars(pool).get("_hostpool_nb")
    if kept is not None:
        return kept.free_lists()
    return [list(map(int, listed)) for listed in pool._slots.class_free_pages]


class InterleavePools(RuleBasedStateMachine):
    source: str
    shape: tuple[int, int, int]

    def __init__(self) -> None:
        super().__init__()
        ps, per, n = self.shape
        self.original = C.interleaved(C.interleave_class(self.source), ps, per, n)
        ours = C.interleave_class(self.source)
        C.keep_interleave_books(ours)
        self.ours = C.interleaved(ours, ps, per, n)
        self.books = sglang.books(self.ours)
        assert isinstance(self.books, InterleavedPagePool)
        self.ps, self.n = ps, n
        self.held: list[list[int]] = []

    @rule(pages=st.integers(1, 10), start=st.integers(-6, 12), as_tensor=st.booleans())
    def alloc(self, pages: int, start: int, as_tensor: bool) -> None:
        need = pages * self.ps
        owner = torch.tensor(start) if as_tensor else start
        theirs, mine = self.original.alloc(need, start_owner=start), self.ours.alloc(need, start_owner=owner)
        assert (theirs is None) == (mine is None)
        if mine is not None:
            assert mine.dtype == torch.int64
            assert mine.tolist() == theirs.tolist()
            self.held += [mine[i : i + self.ps].tolist() for i in range(0, need, self.ps)]

    @precondition(lambda self: self.held)
    @rule(data=st.data(), dtype=st.sampled_from([torch.int64, torch.int32]))
    def free(self, data: st.DataObject, dtype: torch.dtype) -> None:
        chosen = data.draw(st.lists(st.sampled_from(range(len(self.held))), min_size=1, unique=True), label="pages")
        pages = [self.held[i] for i in chosen]
        self.held = [p for i, p in enumerate(self.held) if i not in set(chosen)]
        slots = torch.tensor([s for p in pages for s in p], dtype=dtype)
        assert self.ours.free(slots) == self.original.free(slots) == len(slots)

    @rule()
    def free_nothing(self) -> None:
        empty = torch.empty(0, dtype=torch.float32)
        assert self.ours.free(empty) == self.original.free(empty) == 0

    @rule()
    def clear(self) -> None:
        self.ours.clear()
        self.original.clear()
        self.held = []

    # -- misuse: hostpool_nb's pool only; it raises and changes nothing ---------------------

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held), label="page")
        self.held.remove(page)
        assert self.ours.free(torch.tensor(page)) == self.original.free(torch.tensor(page))
        with pytest.raises(HostKVDoubleFreeError, match=r"^Double-free detected") as caught:
            self.ours.free(torch.tensor(page))
        assert isinstance(caught.value, AssertionError)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def named_twice(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held), label="page")
        with pytest.raises(HostKVDoubleFreeError, match="freed twice in one call"):
            self.ours.free(torch.tensor(page + page))

    @rule(beyond=st.integers(0, 3), negative=st.booleans())
    def out_of_range(self, beyond: int, negative: bool) -> None:
        first = -self.ps * (beyond + 1) if negative else self.books.size + beyond * self.ps
        with pytest.raises(HostKVSlotRangeError) as caught:
            self.ours.free(torch.arange(first, first + self.ps))
        assert isinstance(caught.value, IndexError)

    @precondition(lambda self: self.held and self.ps > 1)
    @rule(data=st.data())
    def partial_page(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held), label="page")
        with pytest.raises((PartialPageError, AlignmentError)):
            self.ours.free(torch.tensor(page[1:]))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def two_dimensional_or_float(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held), label="page")
        with pytest.raises(HostPoolError, match="indices must be 1-D"):
            self.ours.free(torch.tensor(page).reshape(1, -1))
        with pytest.raises(TypeError, match="indices must hold integers"):
            self.ours.free(torch.tensor(page, dtype=torch.float32))

    @rule(pages=st.integers(1, 3))
    def without_an_owner(self, pages: int) -> None:
        with pytest.raises(HostKVArgumentError, match="start_owner") as caught:
            self.ours.alloc(pages * self.ps)
        assert isinstance(caught.value, AssertionError)
        with pytest.raises(AssertionError):  # the original asserts it too
            self.original.alloc(pages * self.ps)

    @rule(pages=st.integers(-3, 0))
    def nothing_or_less(self, pages: int) -> None:
        with pytest.raises(HostKVArgumentError, match="must be positive") as caught:
            self.ours.alloc(pages * self.ps, start_owner=0)
        assert isinstance(caught.value, AssertionError)

    @precondition(lambda self: self.ps > 1)
    @rule(pages=st.integers(0, 3), off=st.integers(1, 15))
    def part_of_a_page(self, pages: int, off: int) -> None:
        with pytest.raises(HostKVAlignmentError) as caught:
            self.ours.alloc(pages * self.ps + 1 + off % (self.ps - 1), start_owner=0)
        assert isinstance(caught.value, AssertionError)

    @invariant()
    def same_books(self) -> None:
        assert self.ours.available_size() == self.original.available_size()
        assert _lists(self.ours) == _lists(self.original)

    def teardown(self) -> None:
        self.books.check_invariants()


CASES = [pytest.param(source, shape, id=f"{source}-{shape}") for source in C.SOURCES for shape in SHAPES]


@pytest.mark.parametrize(("source", "shape"), CASES)
def test_hostpool_nbs_books_match_the_interleaved_original(source: str, shape: tuple[int, int, int]) -> None:
    if source == "wheel":
        C.need_wheel()
    machine = type("Machine", (InterleavePools,), {"source": source, "shape": shape})
    run_state_machine_as_test(machine, settings=settings(max_examples=40, stateful_step_count=30, deadline=None))


# -- install() ------------------------------------------------------------------------------


def test_install_keeps_every_interleaved_pool_built_after_it_and_uninstall_hands_the_lists_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with stand_in_engine("sglang") as engine, caplog.at_level(logging.INFO, logger="hostpool_nb"):
        early = C.interleaved(engine.module.PageInterleaveHostPool, 4, 5, 2)
        replaced = sglang.install()
        where = "sglang.srt.mem_cache.pool_host.page_interleave.PageInterleaveHostPool"
        assert {f"{where}.{m}" for m in ("clear", "available_size", "alloc", "free")} <= set(replaced)
        assert {f"{where}.{m}" for m in ("alloc", "free")} <= {r.where for r in status()}
        cls = engine.module.PageInterleaveHostPool

        class Later(cls):  # a subclass defined after install() inherits the books
            pass

        pool, twin = C.interleaved(Later, 4, 5, 2), C.interleaved(C.interleave_class("stand-in"), 4, 5, 2)
        lines = [
            r.getMessage()
            for r in caplog.records
            if "builds Later on hostpool_nb (InterleavedPagePool)" in r.getMessage()
        ]
        assert len(lines) == 1
        assert "2 owner classes of 5 pages, page_size=4" in lines[0]
        with pytest.raises(HostPoolError, match="keeps its own books"):
            sglang.books(early)  # built before install(): its own allocator, and the original methods
        assert early.alloc(8, start_owner=1).tolist() == [12, 13, 14, 15, 8, 9, 10, 11]
        held = [pool.alloc(8, start_owner=k) for k in range(3)]
        theirs = [twin.alloc(8, start_owner=k) for k in range(3)]
        assert [h.tolist() for h in held] == [t.tolist() for t in theirs]
        pool.free(held[1])
        twin.free(theirs[1])
        sglang.uninstall()
        assert "_hostpool_nb" not in vars(pool)
        # Under sglang's own methods now: the same lists, so the same calls give the same slots.
        assert pool.alloc(12, start_owner=1).tolist() == twin.alloc(12, start_owner=1).tolist()
        assert pool.free(held[0]) == twin.free(theirs[0]) == 8
        assert _lists(pool) == _lists(twin)


def test_threads_on_an_installed_pool_never_share_a_slot() -> None:
    cls = C.interleave_class("stand-in")
    C.keep_interleave_books(cls)
    pool = C.interleaved(cls, 4, 400, 4)
    got: list[list[int]] = []
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            mine = []
            for i in range(200):
                out = pool.alloc(4 * (1 + i % 4), start_owner=k + i)
                if out is not None:
                    mine.append(out)
                if len(mine) > 3:
                    pool.free(mine.pop(0))
            got.append([s for t in mine for s in t.tolist()])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    held = [s for part in got for s in part]
    assert len(held) == len(set(held))
    sglang.books(pool).check_invariants()


def _churn(pool: object, held: list, errors: list, calls: threading.Event, stop: threading.Event) -> None:
    try:
        k = 0
        while not stop.is_set():
            got = pool.alloc(4 * (1 + k % 3), start_owner=k)
            k += 1
            if got is not None:
                held.append(got.tolist())
            if len(held) > 8:
                pool.free(torch.tensor(held.pop(0)))
            calls.set()
    except BaseException as error:  # noqa: BLE001 - reported by the test
        errors.append(error)


def test_uninstall_while_another_thread_allocates_hands_no_page_out_twice() -> None:
    """A call in flight when uninstall() hands the books back runs on the lists handed back, not on stale books."""
    for attempt in range(5):
        with stand_in_engine("sglang") as engine:
            sglang.install()
            pool = C.interleaved(engine.module.PageInterleaveHostPool, 4, 2000, 4)
            held: list[list[int]] = []
            errors: list[BaseException] = []
            calls, stop = threading.Event(), threading.Event()
            worker = threading.Thread(target=_churn, args=(pool, held, errors, calls, stop))
            worker.start()
            calls.wait(10)
            sglang.uninstall()  # while the worker allocates and frees
            time.sleep(0.05)  # and goes on, under the original methods
            stop.set()
            worker.join(10)
            assert not worker.is_alive()
            assert errors == [], f"attempt {attempt}: {errors!r}"
            assert "_hostpool_nb" not in vars(pool)
            listed = [p for listed in _lists(pool) for p in listed]
            in_use = [s // 4 for got in held for s in got[::4]]
            assert len(set(listed)) == len(listed)  # no page listed twice
            assert not set(listed) & set(in_use), f"attempt {attempt}: pages held and free at once"
            assert sorted(listed + in_use) == list(range(4, 4 * 2001))  # none lost either
