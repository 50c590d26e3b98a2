"""sglang's unified host backing (``_SharedPageEnvelopeHostBacking``) on hostpool_nb's books, against the original's.

The state machine drives two backings of the same class and shape, one
with the original methods (the stand-in written from docs/behaviour.md
section 7, or sglang 0.5.23's own class, compiled whole from its wheel
when ``HOSTPOOL_NB_SGLANG_WHEEL`` names it, its constructor included), one
with hostpool_nb's (replaced on the class, as ``install()`` does). Each
page allocated gets its own bytes written at its physical place, so the
envelopes' bytes must stay equal through every compaction; every correct
call's result, ``available_size`` of each side, ``free_bytes``, every held
slot's translation and ``can_fit_many_then`` must be equal. Misuses go to
hostpool_nb's backing only and must raise both hostpool_nb's error and the
original's kind, changing nothing. Then ``install()`` on the stand-in
engine: status, the INFO line, subclasses, ``uninstall()``'s hand-back.
"""

from __future__ import annotations

import logging

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
    EnvelopePagePool,
    HostKVAlignmentError,
    HostKVArgumentError,
    HostKVDoubleFreeError,
    HostKVUnknownPoolError,
    HostPoolError,
)
from hostpool_nb.integrations import sglang, status  # noqa: E402
from hostpool_nb.originals import sglang_host  # noqa: E402
from hostpool_nb.originals.engines import stand_in_engine  # noqa: E402
from tests import sglang_host_cases as C  # noqa: E402

pytestmark = pytest.mark.torch

SHAPES = [
    (96, {"full": (1, 8, "up"), "swa": (1, 16, "down")}),
    (200, {"full": (4, 8, "up"), "swa": (2, 12, "down")}),
    (130, {"swa": (16, 32, "down"), "full": (4, 12, "up")}),
    (77, {"kv": (2, 6, "up")}),
]


class Backings(RuleBasedStateMachine):
    source: str
    total: int
    sides: dict[str, tuple[int, int, str]]

    def __init__(self) -> None:
        super().__init__()
        self.original = C.envelope(C.envelope_class(self.source), self.total, self.sides)
        ours = C.envelope_class(self.source)
        C.keep_envelope_books(ours)
        self.ours = C.envelope(ours, self.total, self.sides)
        self.books = sglang.books(self.ours)
        assert isinstance(self.books, EnvelopePagePool)
        self.held: dict[str, list[list[int]]] = {name: [] for name in self.sides}
        self.stamp = 0

    def _keep(self, name: str, got: torch.Tensor) -> None:
        """Hold the pages of ``got``, and write a new byte into each one's place in both envelopes."""
        ps, pb, _ = self.sides[name]
        for i in range(0, got.shape[0], ps):
            page = got[i : i + ps].tolist()
            self.held[name].append(page)
            self.stamp = self.stamp % 251 + 1
            for env in (self.original, self.ours):
                at = env.translate_index(name, page[0]) // ps * pb
                env.raw[at : at + pb] = self.stamp

    @rule(data=st.data(), pages=st.integers(0, 10))
    def alloc(self, data: st.DataObject, pages: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.sides)), label="side")
        need = pages * self.sides[name][0]
        theirs, mine = self.original.alloc(name, need), self.ours.alloc(name, need)
        assert (theirs is None) == (mine is None)
        if mine is not None:
            assert mine.dtype == torch.int64
            assert mine.tolist() == theirs.tolist()
            self._keep(name, mine)

    @rule(data=st.data())
    def alloc_many(self, data: st.DataObject) -> None:
        names = data.draw(st.lists(st.sampled_from(sorted(self.sides)), max_size=3), label="sides")
        requests = [(n, self.sides[n][0] * data.draw(st.integers(0, 4), label="pages")) for n in names]
        theirs, mine = self.original.alloc_many(requests), self.ours.alloc_many(requests)
        assert (theirs is None) == (mine is None)
        if mine is not None:
            assert [m.tolist() for m in mine] == [t.tolist() for t in theirs]
            for (n, _), got in zip(requests, mine, strict=True):
                self._keep(n, got)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), dtype=st.sampled_from([torch.int64, torch.int32]))
    def free(self, data: st.DataObject, dtype: torch.dtype) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, h in self.held.items() if h)), label="side")
        held = self.held[name]
        chosen = data.draw(st.lists(st.sampled_from(range(len(held))), min_size=1, unique=True), label="pages")
        slots = torch.tensor([s for i in chosen for s in held[i]], dtype=dtype)
        self.held[name] = [p for i, p in enumerate(held) if i not in set(chosen)]
        assert self.ours.free(name, slots) == self.original.free(name, slots) == len(slots)

    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.sides)), label="side")
        self.ours.clear(name)
        self.original.clear(name)
        self.held[name] = []

    @rule(data=st.data(), empty=st.booleans())
    def can_fit(self, data: st.DataObject, empty: bool) -> None:
        names = data.draw(st.lists(st.sampled_from(sorted(self.sides)), max_size=2), label="sides")
        first = [(n, self.sides[n][0] * data.draw(st.integers(0, 20), label="pages")) for n in names]
        then = [(n, self.sides[n][0] * data.draw(st.integers(0, 20), label="pages")) for n in names[:1]]
        assert self.ours.can_fit_many_then(first, then, empty=empty) is self.original.can_fit_many_then(
            first, then, empty=empty
        )

    # -- misuse: hostpool_nb's backing only; it raises and changes nothing -----------------------

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, h in self.held.items() if h)), label="side")
        page = data.draw(st.sampled_from(self.held[name]), label="page")
        self.held[name].remove(page)
        assert self.ours.free(name, torch.tensor(page)) == self.original.free(name, torch.tensor(page))
        with pytest.raises(HostKVDoubleFreeError, match=r"^Host pages are not allocated"):
            self.ours.free(name, torch.tensor(page))
        with pytest.raises(HostKVArgumentError, match="not allocated"):
            self.ours.translate_indices(name, torch.tensor(page))

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def named_twice_or_out_of_range(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, h in self.held.items() if h)), label="side")
        page = data.draw(st.sampled_from(self.held[name]), label="page")
        ps = self.sides[name][0]
        with pytest.raises(HostKVDoubleFreeError, match="more than once"):
            self.ours.free(name, torch.tensor(page + page))
        with pytest.raises(HostKVDoubleFreeError) as caught:
            self.ours.free(name, torch.tensor(page + list(range(-ps, 0))))
        assert isinstance(caught.value, AssertionError)

    @precondition(lambda self: any(len(h) and self.sides[n][0] > 1 for n, h in self.held.items()))
    @rule(data=st.data())
    def partial_page(self, data: st.DataObject) -> None:
        name = data.draw(
            st.sampled_from(sorted(n for n, h in self.held.items() if h and self.sides[n][0] > 1)), label="side"
        )
        page = data.draw(st.sampled_from(self.held[name]), label="page")
        with pytest.raises(HostKVAlignmentError, match="whole pages"):
            self.ours.free(name, torch.tensor(page[1:]))

    @rule(data=st.data(), off=st.integers(1, 15))
    def misuse_of_alloc(self, data: st.DataObject, off: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.sides)), label="side")
        ps = self.sides[name][0]
        if off % ps:
            with pytest.raises(HostKVAlignmentError, match=r"^The requested size should be a multiple"):
                self.ours.alloc_many([(name, ps), (name, off)])
        with pytest.raises(HostKVUnknownPoolError) as caught:
            self.ours.alloc("nope", ps)
        assert isinstance(caught.value, ValueError)
        with pytest.raises(KeyError):
            self.ours.free("nope", torch.arange(ps))
        with pytest.raises(HostPoolError, match="non-negative"):
            self.ours.alloc(name, -ps)

    @invariant()
    def same_books(self) -> None:
        for name in self.sides:
            assert self.ours.available_size(name) == self.original.available_size(name)
            slots = [s for page in self.held[name] for s in page]
            if slots:
                mine = self.ours.translate_indices(name, torch.tensor(slots))
                assert mine.tolist() == self.original.translate_indices(name, torch.tensor(slots)).tolist()
        assert self.ours.free_bytes() == self.original.free_bytes()
        assert torch.equal(self.ours.raw, self.original.raw)  # the same bytes, moved the same way

    def teardown(self) -> None:
        self.books.check_invariants()


CASES = [
    pytest.param(source, total, sides, id=f"{source}-{i}")
    for source in C.SOURCES
    for i, (total, sides) in enumerate(SHAPES)
]


@pytest.mark.parametrize(("source", "total", "sides"), CASES)
def test_hostpool_nbs_books_match_the_unified_backing(source: str, total: int, sides: dict) -> None:
    if source == "wheel":
        C.need_wheel()
    machine = type("Machine", (Backings,), {"source": source, "total": total, "sides": sides})
    run_state_machine_as_test(machine, settings=settings(max_examples=40, stateful_step_count=40, deadline=None))


# -- install() ------------------------------------------------------------------------------


def test_install_keeps_every_backing_built_after_it_and_uninstall_hands_the_books_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sides = {"full": (1, 8, "up"), "swa": (1, 16, "down")}
    with stand_in_engine("sglang") as engine, caplog.at_level(logging.INFO, logger="hostpool_nb"):
        early = C.envelope(engine.module._SharedPageEnvelopeHostBacking, 96, sides)
        replaced = sglang.install()
        where = "sglang.srt.mem_cache.pool_host.unified._SharedPageEnvelopeHostBacking"
        assert {f"{where}.{m}" for m in sglang.UNIFIED_ENVELOPE.methods} <= set(replaced)
        assert f"{where}.alloc_many" in {r.where for r in status()}

        class Later(engine.module._SharedPageEnvelopeHostBacking):  # defined after install(): inherits the books
            pass

        env, twin = (
            C.envelope(Later, 96, sides),
            C.envelope(sglang_host.hierarchy()["_SharedPageEnvelopeHostBacking"], 96, sides),
        )
        lines = [
            r.getMessage() for r in caplog.records if "builds Later on hostpool_nb (EnvelopePagePool)" in r.getMessage()
        ]
        assert len(lines) == 1
        assert "full (page_size=1, 12 pages of 8 bytes, grows up)" in lines[0]
        with pytest.raises(HostPoolError, match="keeps its own books"):
            sglang.books(early)
        assert early.alloc("full", 2).tolist() == [0, 1]  # its own books, the original methods
        for backing in (env, twin):
            held = backing.alloc("full", 6)
            backing.free("full", held[:3])
            backing.alloc("swa", 3)
        sglang.uninstall()
        assert "_hostpool_nb" not in vars(env)
        # Under the original methods now, from the same books: the same calls give the same slots and bytes.
        for name, need in (("swa", 2), ("full", 4), ("full", 1), ("swa", 1)):
            mine, theirs = env.alloc(name, need), twin.alloc(name, need)
            assert (mine is None) == (theirs is None)
            if mine is not None:
                assert mine.tolist() == theirs.tolist()
        assert env.free_bytes() == twin.free_bytes()
        for name in sides:
            assert env.sides[name].logical_to_physical == twin.sides[name].logical_to_physical


def test_a_unified_pools_books_are_its_shared_backings() -> None:
    """``books(pool)`` of one of the two pools over a backing (which holds ``_shared_backing``) is the backing's."""
    cls = C.envelope_class("stand-in")
    C.keep_envelope_books(cls)
    backing = C.envelope(cls, 96, SHAPES[0][1])

    class Pool:  # what sglang's UnifiedPageEnvelopeHostPool holds of its backing
        def __init__(self) -> None:
            self._shared_backing = backing

    assert sglang.books(Pool()) is sglang.books(backing)
    with pytest.raises(HostPoolError, match="keeps its own books"):
        sglang.books(type("Other", (), {"_shared_backing": None})())
