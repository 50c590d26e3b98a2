"""Differential state machine: sglang's host pools on hostpool_nb's books against the original bookkeeping.

For each source of the original methods (the stand-ins written from
docs/behaviour.md section 5, and sglang 0.5.23's own, read from its wheel
when ``HOSTPOOL_NB_SGLANG_WHEEL`` names it) and each bookkeeping and shape
(the base class at page sizes 1 and 4 and with decode context parallelism,
Mamba's, DeepSeek V4's paged pool and the QSA pool that inherits it),
hypothesis drives two pools of the same class: one with the original
methods, one with hostpool_nb's (replaced on the classes that define them,
as ``install()`` does). Correct calls go to both: ``alloc`` of whole pages
(of any size for the DeepSeek V4 pool, which rounds up), ``free`` of held
pages in any order and grouping, ``_merge_release_slots``, ``clear``; the
results, ``available_size()`` and, at the end, every slot handed out must
be equal. Misuses go to hostpool_nb's pool only, and must raise an error
that is both hostpool_nb's and the original's kind, changing nothing: the
equality of every later call proves the state unchanged. With double frees
accepted (the Mamba and DeepSeek V4 pools), a double free returns what the
original returns and frees nothing more.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import strategies as st  # noqa: E402 - after the skip without torch
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
    HostKVDoubleFreeError,
    HostKVSlotRangeError,
    HostPoolError,
    PartialPageError,
)
from hostpool_nb.integrations import sglang  # noqa: E402
from tests import sglang_host_cases as C  # noqa: E402

pytestmark = pytest.mark.torch


class HostPools(RuleBasedStateMachine):
    """One original pool and one on hostpool_nb's books, of the same class and shape, driven alike."""

    geometry: C.Geometry
    source: str
    accept: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.original = self.geometry.build(C.hierarchy(self.source))
        ours = C.hierarchy(self.source)
        C.keep_books(ours)
        self.ours = self.geometry.build(ours)
        self.books = sglang.books(self.ours)
        if self.accept:
            self.books.accept_double_frees = True
        self.unit = self.geometry.unit
        self.held: list[list[int]] = []  # pages held, each a list of its slot ids

    # -- correct calls, to both -------------------------------------------------------

    @rule(pages=st.integers(0, 4), short=st.integers(0, 3))
    def alloc(self, pages: int, short: int) -> None:
        need = pages * self.unit
        if self.geometry.bookkeeping.rounds_up and pages > 0:
            need -= short % self.unit  # a partial last page, rounded up by both
        theirs, mine = self.original.alloc(need), self.ours.alloc(need)
        assert (theirs is None) == (mine is None), (need, theirs, mine)
        if mine is None:
            return
        assert mine.dtype == torch.int64
        assert mine.device.type == "cpu"
        assert mine.tolist() == theirs.tolist()
        ids = mine.tolist()
        self.held += [ids[i : i + self.unit] for i in range(0, len(ids), self.unit)]

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(range(len(self.held))), min_size=1, unique=True), label="pages")
        pages = [self.held[i] for i in chosen]
        for i in sorted(chosen, reverse=True):
            del self.held[i]
        dtype = data.draw(st.sampled_from([torch.int64, torch.int32]), label="dtype")
        theirs = self.original.free(torch.tensor([s for p in pages for s in p], dtype=dtype))
        mine = self.ours.free(torch.tensor([s for p in pages for s in p], dtype=dtype))
        assert mine == theirs == len(pages) * self.unit

    @rule()
    def merge(self) -> None:
        self.original._merge_release_slots()
        self.ours._merge_release_slots()

    @rule()
    def clear(self) -> None:
        self.original.clear()
        self.ours.clear()
        self.held = []

    @rule()
    def free_nothing(self) -> None:
        empty = torch.empty(0, dtype=torch.float32)  # an empty tensor of any dtype frees nothing, in both
        assert self.original.free(empty) == self.ours.free(empty) == 0

    # -- misuse, to hostpool_nb's pool only: refused, nothing changed --------------------

    def _free_pages(self) -> list[int]:
        """First slots of the pages that are free now (not held)."""
        held = {p[0] for p in self.held}
        return [s for s in range(0, self.geometry.slots, self.unit) if s not in held]

    @precondition(lambda self: not self.accept)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        free = self._free_pages()
        if not free:
            return
        first = data.draw(st.sampled_from(free), label="free page")
        with pytest.raises(HostKVDoubleFreeError, match=r"^Double-free detected: ") as caught:
            self.ours.free(torch.arange(first, first + self.unit))
        assert isinstance(caught.value, AssertionError)

    @precondition(lambda self: self.held and not self.accept)
    @rule(data=st.data())
    def same_page_twice(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held), label="page")
        with pytest.raises(HostKVDoubleFreeError, match="freed twice in one call"):
            self.ours.free(torch.tensor(page + page))

    @precondition(lambda self: self.accept)
    @rule(data=st.data())
    def double_free_accepted(self, data: st.DataObject) -> None:
        """As the original returns; the pages already free stay free once, the held ones are freed (in both)."""
        free = self._free_pages()
        firsts = data.draw(st.lists(st.sampled_from(free)) if free else st.just([]), label="free")
        pages = [list(range(s, s + self.unit)) for s in firsts]
        if self.held:
            again = data.draw(st.lists(st.sampled_from(range(len(self.held))), unique=True), label="held")
            chosen = [self.held[i] for i in again]
            for i in sorted(again, reverse=True):
                del self.held[i]
        else:
            chosen = []
        twice = chosen + chosen[:1] + pages  # one held page named twice too
        slots = torch.tensor([s for p in twice for s in p], dtype=torch.int64)
        assert self.ours.free(slots) == len(slots)
        if chosen:  # the original, given only what was freed, stays equal
            self.original.free(torch.tensor([s for p in chosen for s in p], dtype=torch.int64))

    @rule(beyond=st.integers(0, 3), negative=st.booleans())
    def out_of_range(self, beyond: int, negative: bool) -> None:
        first = -self.unit * (beyond + 1) if negative else self.geometry.slots + beyond * self.unit
        with pytest.raises(HostKVSlotRangeError) as caught:
            self.ours.free(torch.arange(first, first + self.unit))
        assert isinstance(caught.value, IndexError)

    @precondition(lambda self: self.held and self.unit > 1)
    @rule(data=st.data())
    def partial_page(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held), label="page")
        with pytest.raises((PartialPageError, AlignmentError)):
            self.ours.free(torch.tensor([*page[:-1], page[0]]))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def two_dimensional(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held), label="page")
        with pytest.raises(HostPoolError, match="indices must be 1-D"):
            self.ours.free(torch.tensor(page).reshape(1, -1))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def float_slots(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held), label="page")
        with pytest.raises(TypeError, match="indices must hold integers"):
            self.ours.free(torch.tensor(page, dtype=torch.float32))

    @precondition(lambda self: self.unit > 1 and not self.geometry.bookkeeping.rounds_up)
    @rule(pages=st.integers(0, 3), off=st.integers(1, 3))
    def misaligned_alloc(self, pages: int, off: int) -> None:
        with pytest.raises(
            HostKVAlignmentError, match=r"^The requested size should be a multiple of the page size"
        ) as e:
            self.ours.alloc(pages * self.unit + off % self.unit)
        assert isinstance(e.value, AssertionError)

    @rule(pages=st.integers(1, 8))
    def negative_alloc(self, pages: int) -> None:
        with pytest.raises(HostPoolError, match="must be non-negative"):
            self.ours.alloc(-pages * self.unit)

    # -- after every step ---------------------------------------------------------------

    @invariant()
    def same_available(self) -> None:
        assert self.ours.available_size() == self.original.available_size()

    def teardown(self) -> None:
        """Both hand out the same slots for everything left; the books hold their invariants."""
        self.books.check_invariants()
        rest = self.original.available_size()
        if rest:
            assert self.ours.alloc(rest).tolist() == self.original.alloc(rest).tolist()
        assert self.ours.available_size() == self.original.available_size() == 0


def _machine(source: str, geometry: C.Geometry, accept: bool) -> type[HostPools]:
    return type(f"HostPools_{geometry.cls}", (HostPools,), {"source": source, "geometry": geometry, "accept": accept})


CASES = [
    pytest.param(source, g, accept, id=f"{source}-{g}{'-accepting' if accept else ''}")
    for source in C.SOURCES
    for g in C.GEOMETRIES
    for accept in ((False, True) if not g.bookkeeping.checks_frees else (False,))
]


@pytest.mark.parametrize(("source", "geometry", "accept"), CASES)
def test_hostpool_nbs_books_match_the_original_bookkeeping(source: str, geometry: C.Geometry, accept: bool) -> None:
    if source == "wheel":
        C.need_wheel()
    run_state_machine_as_test(_machine(source, geometry, accept))
