"""HostPagePool against the original host pool's bookkeeping, call by call (hypothesis).

The machine drives a ``HostPagePool`` and the model of ``tests/host_model.py``
(sglang-jax's ``LRUHostKVPool`` algorithm in plain Python lists, with the
package's rules on top) with the same calls: ``reserve``, ``release``,
``alloc``, ``free`` of held pages, of free ones, of pages out of range and of
repeats (as lists and as numpy arrays of several integer dtypes), pins and
unpins (one page or an array), frees and releases with the generations the
caller kept (stale ones too), ``clear``, ``backup_state`` /
``restore_state`` and a pickle round trip. After every step the result (ids
and their order, or the exception's class and text), the free list in
order, ``available_size`` and the ``allocated`` / ``generation`` /
``lock_ref`` arrays must equal the model's, a refused call must have
changed no word of the state, and the invariants must hold.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from hostpool_nb import HostPagePool
from tests.host_model import Expected, Refused, state_of, words_of

DTYPES = ["list", "int64", "int32", "uint16", "int8", "tuple"]


def as_form(pages: list[int], form: str) -> Any:
    if form == "list":
        return list(pages)
    if form == "tuple":
        return tuple(pages)
    return np.array(pages, dtype=form)


class HostMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.events: set[str] = set()

    @initialize(n=st.integers(1, 12))
    def start(self, n: int) -> None:
        self.n = n
        self.pool = HostPagePool(n)
        self.model = Expected(n)
        self.held: dict[int, int] = {}  # page -> the generation its holder got
        self.backups: list[tuple[Any, Expected, dict[int, int]]] = []

    # -- running one call on both ----------------------------------------------------

    def both(self, name: str, mine: Any, theirs: Any) -> Any:
        """Run the pool's call and the model's; the same result, or the same refusal with nothing changed."""
        before = words_of(self.pool)
        refusal: Refused | None = None
        try:
            want = theirs()
        except Refused as predicted:
            refusal = predicted
        if refusal is not None:
            with pytest.raises(refusal.cls) as info:
                mine()
            assert type(info.value) is refusal.cls, f"{name}: {type(info.value).__name__}, not {refusal.cls.__name__}"
            assert str(info.value) == refusal.text
            assert np.array_equal(words_of(self.pool), before), f"{name} raised and changed the state"
            self.events.add(f"{name} refused: {refusal.cls.__name__}")
            return Refused
        got = mine()
        self.events.add(name)
        return got, want

    def hand_out(self, pages: list[int]) -> None:
        for p in pages:
            self.held[p] = int(self.pool.generation[p])

    # -- rules -----------------------------------------------------------------------------

    @rule()
    def reserve(self) -> None:
        out = self.both("reserve", self.pool.reserve, self.model.reserve)
        got, want = out
        assert got == want
        if got is None:
            self.events.add("reserve exhausted")
        else:
            assert type(got) is int
            self.hand_out([got])

    @rule(need=st.integers(-2, 14))
    def alloc(self, need: int) -> None:
        out = self.both("alloc", lambda: self.pool.alloc(need), lambda: self.model.alloc(need))
        if out is Refused:
            return
        got, want = out
        if want is None:
            assert got is None
            self.events.add("alloc exhausted")
            return
        assert got.dtype == np.int64
        assert got.tolist() == want
        self.hand_out(want)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        held = self.held and data.draw(st.booleans(), label="a held page")
        page = data.draw(st.sampled_from(sorted(self.held)) if held else st.integers(-1, self.n), label="page")
        how = data.draw(st.sampled_from(["plain", "current", "stale"]))
        gen = None
        if how == "current" and page in self.held:
            gen = self.held[page]
        elif how == "stale" and 0 <= page < self.n:
            gen = int(self.pool.generation[page]) - 1
        out = self.both(
            "release", lambda: self.pool.release(page, generation=gen), lambda: self.model.release(page, gen)
        )
        if out is not Refused:
            assert out == (None, None)
            self.held.pop(page, None)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from(["held", "held, repeated", "anything"]), label="kind")
        if kind != "anything" and self.held:
            pages = data.draw(st.lists(st.sampled_from(sorted(self.held)), max_size=6, unique=True), label="pages")
            if kind == "held, repeated" and pages:
                pages = pages + data.draw(st.lists(st.sampled_from(pages), min_size=1, max_size=3))
        else:
            choices = [*sorted(self.held), -1, self.n, 0, self.n - 1]
            pages = data.draw(st.lists(st.sampled_from(choices), max_size=8), label="pages")
        form = data.draw(st.sampled_from(DTYPES), label="form")
        if form.startswith("u") and min(pages, default=0) < 0:
            form = "int64"
        if form == "int8" and max(pages, default=0) > 127:
            form = "int64"
        gens = None
        if data.draw(st.booleans(), label="with generations"):
            gens = [self.held.get(p, 0) for p in pages]
            if pages and data.draw(st.booleans(), label="one stale"):
                gens[data.draw(st.integers(0, len(pages) - 1))] -= 1
        arg = as_form(pages, form)
        out = self.both(
            "free",
            lambda: self.pool.free(arg, generations=gens),
            lambda: self.model.free(pages, gens),
        )
        if out is Refused:
            return
        got, want = out
        assert type(got) is int
        assert got == want
        if len(set(pages)) < len(pages):
            self.events.add("free with repeats")
        for p in pages:
            self.held.pop(p, None)

    @rule(data=st.data())
    def free_pinned_or_stale(self, data: st.DataObject) -> None:
        """A held page pinned, or given with an old generation, among others: refusals random frees seldom reach."""
        if not self.held:
            return
        page = data.draw(st.sampled_from(sorted(self.held)), label="page")
        others = data.draw(st.lists(st.sampled_from(sorted(self.held)), max_size=3, unique=True), label="others")
        pages = [*others, page] if page not in others else others
        gens = [self.held[p] for p in pages]
        if data.draw(st.booleans(), label="stale rather than pinned"):
            gens[pages.index(page)] -= 1
        else:
            self.both("pin", lambda: self.pool.inc_lock_ref(page), lambda: self.model.pin(page, 1))
        out = self.both("free", lambda: self.pool.free(pages, generations=gens), lambda: self.model.free(pages, gens))
        if out is not Refused:  # the model says which calls succeed; then both must agree
            got, want = out
            assert got == want
            for p in pages:
                self.held.pop(p, None)

    @rule(data=st.data(), delta=st.sampled_from([1, -1]))
    def pin(self, data: st.DataObject, delta: int) -> None:
        choices = [*sorted(self.held), -1, self.n, 0]
        if data.draw(st.booleans(), label="one page"):
            arg: Any = data.draw(st.sampled_from(choices))
            pages: Any = arg
        else:
            pages = data.draw(st.lists(st.sampled_from(choices), max_size=4))
            arg = as_form(pages, data.draw(st.sampled_from(["list", "int64"])))
        call = self.pool.inc_lock_ref if delta > 0 else self.pool.dec_lock_ref
        out = self.both("pin" if delta > 0 else "unpin", lambda: call(arg), lambda: self.model.pin(pages, delta))
        if out is not Refused:
            assert out == (None, None)

    @rule()
    def clear(self) -> None:
        self.pool.clear()
        self.model.clear()
        self.held.clear()
        self.events.add("clear")

    @rule()
    def backup(self) -> None:
        self.backups.append((self.pool.backup_state(), self.model.snapshot(), dict(self.held)))
        self.events.add("backup")

    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        if not self.backups:
            return
        state, model, held = data.draw(st.sampled_from(self.backups))
        if data.draw(st.booleans()):
            state = pickle.loads(pickle.dumps(state))
        self.pool.restore_state(state)
        self.model = model.snapshot()
        self.held = dict(held)
        self.events.add("restore")

    @rule()
    def pickle_round_trip(self) -> None:
        self.pool = pickle.loads(pickle.dumps(self.pool))
        self.events.add("pickle")

    # -- after every step --------------------------------------------------------------------

    @invariant()
    def same_books(self) -> None:
        if not hasattr(self, "pool"):
            return
        assert state_of(self.pool) == self.model.state()
        assert self.pool.available_size() == len(self.model.o._free_list)
        s = self.pool.stats()
        o = self.model.o
        assert (s.peak_allocated_pages, s.exhausted_calls) == (o._peak_used, o._exhaust_count)
        assert (s.alloc_calls, s.free_calls, s.clears) == (
            self.model.alloc_calls,
            self.model.free_calls,
            self.model.clears,
        )
        assert s.pinned_pages == sum(1 for k in o._lock_ref if k > 0)
        self.pool.check_invariants()


EVERY_RULE = {"reserve", "alloc", "release", "free", "pin", "unpin", "clear", "backup", "restore", "pickle"}
SITUATIONS = {
    "reserve exhausted",
    "alloc exhausted",
    "free with repeats",
    "free refused: SlotRangeError",
    "free refused: PageDoubleFreeError",
    "free refused: StaleFreeError",
    "free refused: PinnedPageError",
    "release refused: PageDoubleFreeError",
    "release refused: StaleFreeError",
    "pin refused: PageNotAllocatedError",
    "unpin refused: LockRefUnderflowError",
    "alloc refused: HostPoolError",
}


@pytest.mark.slow
def test_host_page_pool_matches_the_original_bookkeeping() -> None:
    events: set[str] = set()

    class Machine(HostMachine):
        def __init__(self) -> None:
            super().__init__()
            self.events = events

    # The coverage check below needs enough steps to be meaningful whatever the
    # profile (the mutation profile's 60 short runs miss some refusals).
    base = settings()
    enough = settings(
        base, max_examples=max(base.max_examples, 150), stateful_step_count=max(base.stateful_step_count, 40)
    )
    run_state_machine_as_test(Machine, settings=enough)
    missing = (EVERY_RULE | SITUATIONS) - events
    assert not missing, f"the runs never reached {sorted(missing)}"
