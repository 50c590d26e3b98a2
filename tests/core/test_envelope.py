"""``EnvelopePagePool`` against its oracle, the backing's books written from docs/behaviour.md section 7.

A hypothesis state machine drives the pool and
``hostpool_nb.originals.sglang_host.EnvelopeBacking`` alike with correct
calls (``alloc`` and ``alloc_many`` of whole pages of either side, ``free``
of held pages in any order and grouping, ``clear`` of a side) and compares
every result, ``available_size`` of each side, ``free_bytes``, every held
slot's physical slot and every page moved by a compaction, after every
step; misuses go to the pool alone and must raise, leaving it equal to the
oracle. Then the bad-input matrix, snapshots, pickles and threads.
"""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from hostpool_nb import (
    AlignmentError,
    DoubleFreeError,
    EnvelopePagePool,
    EnvelopePageState,
    HostPoolError,
    PartialPageError,
    SlotRangeError,
)
from hostpool_nb.originals.sglang_host import EnvelopeBacking

# total bytes; sides: name -> (page size, page bytes, growth)
SHAPES = [
    (96, {"full": (1, 8, "up"), "swa": (1, 16, "down")}),
    (200, {"full": (4, 8, "up"), "swa": (2, 12, "down")}),
    (130, {"swa": (16, 32, "down"), "full": (4, 12, "up")}),
    (77, {"only": (2, 6, "up")}),
    (77, {"only": (1, 5, "down")}),
]


class Recorder:
    """A compactor that lists what it is told, and checks begin/finish pair up around the moves."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, int, int]] = []
        self.open = False

    def begin(self) -> None:
        assert not self.open
        self.open = True

    def move(self, name: str, sources: np.ndarray, targets: np.ndarray) -> None:
        assert self.open
        self.moves += [(name, int(a), int(b)) for a, b in zip(sources, targets, strict=True)]

    def finish(self) -> None:
        assert self.open
        self.open = False


class Envelope(RuleBasedStateMachine):
    total: int
    sides: dict[str, tuple[int, int, str]]

    def __init__(self) -> None:
        super().__init__()
        self.pool = EnvelopePagePool(self.total, self.sides)
        self.recorder = Recorder()
        self.pool.compactor = self.recorder
        self.oracle = EnvelopeBacking(self.total, self.sides)
        self.held: dict[str, list[list[int]]] = {name: [] for name in self.sides}

    def _keep(self, name: str, slots: list[int]) -> None:
        ps = self.sides[name][0]
        self.held[name] += [slots[i : i + ps] for i in range(0, len(slots), ps)]

    @rule(data=st.data(), pages=st.integers(0, 12))
    def alloc(self, data: st.DataObject, pages: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.sides)), label="side")
        need = pages * self.sides[name][0]
        mine, theirs = self.pool.alloc(name, need), self.oracle.alloc(name, need)
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert mine.dtype == np.int64
            assert mine.tolist() == theirs
            self._keep(name, theirs)

    @rule(data=st.data())
    def alloc_many(self, data: st.DataObject) -> None:
        names = data.draw(st.lists(st.sampled_from(sorted(self.sides)), max_size=3), label="sides")
        requests = [(n, self.sides[n][0] * data.draw(st.integers(0, 5), label="pages")) for n in names]
        mine, theirs = self.pool.alloc_many(requests), self.oracle.alloc_many(requests)
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert [m.tolist() for m in mine] == theirs
            for (n, _), got in zip(requests, theirs, strict=True):
                self._keep(n, got)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, h in self.held.items() if h)), label="side")
        held = self.held[name]
        chosen = data.draw(st.lists(st.sampled_from(range(len(held))), min_size=1, unique=True), label="pages")
        slots = [s for i in chosen for s in held[i]]
        self.held[name] = [p for i, p in enumerate(held) if i not in set(chosen)]
        assert self.pool.free(name, np.array(slots)) == self.oracle.free(name, slots) == len(slots)

    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.sides)), label="side")
        self.pool.clear(name)
        self.oracle.clear(name)
        self.held[name] = []

    @rule(data=st.data(), empty=st.booleans())
    def can_fit(self, data: st.DataObject, empty: bool) -> None:
        names = data.draw(st.lists(st.sampled_from(sorted(self.sides)), max_size=2), label="sides")
        first = [(n, self.sides[n][0] * data.draw(st.integers(0, 20), label="pages")) for n in names]
        then = [(n, self.sides[n][0] * data.draw(st.integers(0, 20), label="pages")) for n in names[:1]]
        expect = _fits_then(self.oracle, first, then, empty)
        assert self.pool.can_fit_many_then(first, then, empty=empty) is expect

    # -- misuse: refused, nothing changed (the invariants compare everything) --------------------

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, h in self.held.items() if h)), label="side")
        page = data.draw(st.sampled_from(self.held[name]), label="page")
        self.held[name].remove(page)
        self.pool.free(name, np.array(page))
        self.oracle.free(name, page)
        with pytest.raises(DoubleFreeError, match="is not allocated"):
            self.pool.free(name, np.array(page))

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def named_twice(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, h in self.held.items() if h)), label="side")
        page = data.draw(st.sampled_from(self.held[name]), label="page")
        with pytest.raises(DoubleFreeError, match="named twice"):
            self.pool.free(name, np.array(page + page))

    @precondition(lambda self: any(len(h) > 1 for h in self.held.values()))
    @rule(data=st.data())
    def wrong_side_or_partial(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, h in self.held.items() if len(h) > 1)), label="side")
        page = data.draw(st.sampled_from(self.held[name]), label="page")
        ps = self.sides[name][0]
        if ps > 1:
            with pytest.raises((PartialPageError, AlignmentError)):
                self.pool.free(name, np.array(page[1:] + page[:1]))
        with pytest.raises(SlotRangeError):
            self.pool.free(name, np.array(page + list(range(-ps, 0))))

    @rule(data=st.data(), off=st.integers(1, 15))
    def misaligned_alloc(self, data: st.DataObject, off: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.sides)), label="side")
        ps = self.sides[name][0]
        if off % ps:
            with pytest.raises(AlignmentError, match="multiple"):
                self.pool.alloc_many([(name, ps), (name, off)])

    @rule()
    def unknown_side(self) -> None:
        with pytest.raises(HostPoolError, match="no side"):
            self.pool.alloc("nope", 1)

    @invariant()
    def same_books(self) -> None:
        for name in self.sides:
            assert self.pool.available_size(name) == self.oracle.available_size(name)
            slots = [s for page in self.held[name] for s in page]
            if slots:
                assert self.pool.translate_indices(name, slots).tolist() == self.oracle.translate(name, slots)
        assert self.pool.free_bytes() == self.oracle.free_bytes()
        assert self.recorder.moves == self.oracle.moves

    def teardown(self) -> None:
        self.pool.check_invariants()
        again = pickle.loads(pickle.dumps(self.pool))
        again.check_invariants()
        for name in self.sides:
            assert again.available_size(name) == self.pool.available_size(name)


def _fits_then(oracle: EnvelopeBacking, first: list, then: list, empty: bool) -> bool:
    """The oracle's answer to ``can_fit_many_then``: the counts alone (the original changes nothing either)."""
    sides = oracle.sides
    live = {n: 0 if empty else len(s.logical_to_physical) for n, s in sides.items()}
    free = {n: s.page_num if empty else s.free_logical() for n, s in sides.items()}

    def pages(requests: list) -> dict[str, int]:
        got = dict.fromkeys(sides, 0)
        for n, need in requests:
            got[n] += need // sides[n].page_size
        return got

    one, two = pages(first), pages(then)
    if not oracle._fits(live, free, one):
        return False
    return oracle._fits({n: live[n] + one[n] for n in sides}, {n: free[n] - one[n] for n in sides}, two)


@pytest.mark.parametrize(("total", "sides"), SHAPES, ids=[str(i) for i in range(len(SHAPES))])
def test_the_pool_matches_the_backings_books(total: int, sides: dict) -> None:
    machine = type("Machine", (Envelope,), {"total": total, "sides": sides})
    run_state_machine_as_test(machine, settings=settings(max_examples=60, stateful_step_count=50, deadline=None))


# -- the bad-input matrix ------------------------------------------------------------------

BAD_SHAPES = [
    ((0, {"a": (1, 8, "up")}), HostPoolError, "total_bytes must be positive"),
    ((64, {}), HostPoolError, "one or two names"),
    ((64, {"a": (1, 8, "up"), "b": (1, 8, "down"), "c": (1, 8, "up")}), HostPoolError, "one or two names"),
    ((64, {"a": (1, 8, "up"), "b": (1, 16, "up")}), HostPoolError, "opposite ends"),
    ((64, {"a": (1, 8, "sideways")}), HostPoolError, "grow must be"),
    ((64, {"a": (0, 8, "up")}), HostPoolError, "must be positive"),
    ((64, {"a": (1, 128, "up")}), HostPoolError, "holds no page"),
    ((64, {"a": (1, 8)}), HostPoolError, "must be"),
    ((64, {1: (1, 8, "up")}), TypeError, "name must be a str"),
    ((64.0, {"a": (1, 8, "up")}), TypeError, "total_bytes must be an integer"),
    ((64, {"a": (1.0, 8, "up")}), TypeError, "page_size must be an integer"),
    ((64, [("a", 1, 8, "up")]), HostPoolError, "must map"),
]


@pytest.mark.parametrize(("args", "error", "text"), BAD_SHAPES)
def test_a_bad_shape_is_refused_naming_it(args: tuple, error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        EnvelopePagePool(*args)


POOL = (96, {"full": (2, 8, "up"), "swa": (1, 16, "down")})

BAD_CALLS = [
    (lambda p: p.alloc("full", 3), AlignmentError, "multiple of 'full'"),
    (lambda p: p.alloc("full", -2), HostPoolError, "non-negative"),
    (lambda p: p.alloc("full", 2.0), TypeError, "need_size must be an integer"),
    (lambda p: p.alloc("full", True), TypeError, "got bool"),
    (lambda p: p.alloc("other", 2), HostPoolError, "no side 'other'"),
    (lambda p: p.alloc_many([("full", 2), ("swa", 1), ("full", 1)]), AlignmentError, "multiple"),
    (lambda p: p.free("full", [0.0, 1.0]), TypeError, "must hold integers"),
    (lambda p: p.free("full", [0, 1, 2]), AlignmentError, "whole pages"),
    (lambda p: p.free("full", [1, 2]), PartialPageError, "whole pages"),
    (lambda p: p.free("full", [24, 25]), SlotRangeError, "outside 'full'"),
    (lambda p: p.free("full", [2, 3]), DoubleFreeError, "not allocated"),
    (lambda p: p.free("swa", [0]), DoubleFreeError, "not allocated"),
    (lambda p: p.free("full", [0, 1, 0, 1]), DoubleFreeError, "named twice"),
    (lambda p: p.translate_indices("full", [2, 3]), DoubleFreeError, "not allocated"),
    (lambda p: p.translate_index("full", 2.5), TypeError, "index must be an integer"),
    (lambda p: p.clear("nope"), HostPoolError, "no side"),
    (lambda p: p.available_size("nope"), HostPoolError, "no side"),
]


@pytest.mark.parametrize(("call", "error", "text"), BAD_CALLS)
def test_a_bad_call_is_refused_and_changes_nothing(call: object, error: type, text: str) -> None:
    pool = EnvelopePagePool(*POOL)
    held = pool.alloc("full", 2)
    before = pool.backup_state()._words.copy()
    with pytest.raises(error, match=text):
        call(pool)
    assert (pool.backup_state()._words == before).all()
    assert pool.free("full", held) == 2


def test_a_compaction_moves_pages_towards_each_end_in_order_and_keeps_logical_ids() -> None:
    pool = EnvelopePagePool(64, {"full": (1, 8, "up"), "swa": (1, 16, "down")})
    recorder = Recorder()
    pool.compactor = recorder
    full = pool.alloc("full", 4)  # physical 0..3 (bytes 0..31)
    pool.free("full", full[:2])  # holes 0 and 1 stay: the watermark holds at 4
    swa = pool.alloc("swa", 2)  # physical 3, 2 (bytes 32..63): no gap left
    assert pool.free_bytes() == 64 - 2 * 8 - 2 * 16
    got = pool.alloc("swa", 1)  # 16 bytes: only once the full side is packed to 0, 1
    assert got is not None
    assert recorder.moves == [("full", 2, 0), ("full", 3, 1)]
    assert pool.translate_indices("full", full[2:]).tolist() == [0, 1]
    assert pool.translate_indices("swa", swa).tolist() == [3, 2]
    assert pool.translate_index("swa", int(got[0])) == 1
    pool.check_invariants()


def test_restore_refuses_another_shape_or_a_damaged_state() -> None:
    pool = EnvelopePagePool(*POOL)
    with pytest.raises(HostPoolError, match="shape"):
        pool.restore_state(EnvelopePagePool(96, {"full": (2, 8, "up")}).backup_state())
    words = pool.backup_state()._words.copy()
    words[-1] = 5  # a hole bit past the watermark
    with pytest.raises(HostPoolError, match="invariants"):
        pool.restore_state(EnvelopePageState(pool.shape, words))
    pool.check_invariants()


def test_threads_never_share_a_page() -> None:
    pool = EnvelopePagePool(1 << 16, {"full": (4, 16, "up"), "swa": (2, 32, "down")})
    errors: list[BaseException] = []
    kept: list[tuple[str, list[int]]] = []

    def work(k: int) -> None:
        try:
            mine: list[tuple[str, np.ndarray]] = []
            for i in range(300):
                name = ("full", "swa")[(k + i) % 2]
                got = pool.alloc(name, pool.sides[name][0] * (1 + i % 4))
                if got is not None:
                    mine.append((name, got))
                if len(mine) > 6:
                    name, slots = mine.pop(0)
                    pool.free(name, slots)
            kept.extend((n, s.tolist()) for n, s in mine)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    pool.check_invariants()
    for name in ("full", "swa"):
        slots = [s for n, got in kept if n == name for s in got]
        assert len(slots) == len(set(slots))
        physical = pool.translate_indices(name, slots).tolist() if slots else []
        assert len(physical) == len(set(physical))
