"""Helpers shared by the tests of ``hostpool_nb.paged``: state captures, oracle comparison, request models.

``capture`` reads what fully determines an allocator's logical state, per
rank: its lists (through the public read-only copies and the raw words of a
``backup_state()``), the owner flags and the free group buffer (``_gp``).
A failed call must leave every part of it unchanged. The scratch parts of
the arrays are left out on purpose: ``free`` stages the page ids it has
validated behind the ring's live window and behind the group's pending ids
(``_kernels/paged.py``), and a failed call may leave them there.

``compare`` checks an allocator against the oracle of ``hostpool_nb.originals.paged``
after a step: the free list in order (it is what the next allocation takes),
the released pages as a set (their order is not part of the contract), the
dtypes, ``available_size`` of every rank and whether a free group is open.

``Requests`` is the caller's side of a paged allocator: the token slots of
each live request per rank, in order (so ``last_loc`` is the last slot and
the prefix its length), as a scheduler keeps them.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from hostpool_nb._kernels import layout as L
from hostpool_nb._kernels.layout import owner_flags

RankState = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def rank_state(words: np.ndarray, gp: np.ndarray) -> RankState:
    """One rank's logical state: header, live ring window, owner flags, pending page ids, their marks."""
    n = int(words[L.H_NPAGES])
    window = np.concatenate(L.window_entries(words))  # the runs as entries: how they are split matters too
    owner = owner_flags(words, n)
    count, cap = int(gp[L.GP_COUNT]), int(gp[L.GP_CAP])
    pending = gp[L.GP_HEADER : L.GP_HEADER + count]
    marks = gp[L.GP_HEADER + cap :].view(np.uint8)[:cap]
    return (
        tuple(words[: L.HEADER].tolist()),
        tuple(window.tolist()),
        tuple(owner.tolist()),
        (int(gp[L.GP_CAP]), *pending.tolist()),
        tuple(marks.tolist()),
    )


def capture(alloc: Any) -> tuple[Any, ...]:
    """Everything a failed call must leave as it was, for every rank (see the module docstring)."""
    state = alloc.backup_state()
    ranks = tuple(rank_state(np.asarray(w), g) for w, g in zip(state._ranks, alloc._gp, strict=True))
    if getattr(alloc, "free_pages", None) is not None:  # the token allocator's is None
        lists: tuple[Any, ...] = (
            tuple(tuple(a.tolist()) for a in alloc.free_pages),
            tuple(tuple(sorted(a.tolist())) for a in alloc.release_pages),
        )
    else:
        lists = (tuple(tuple(a.tolist()) for a in alloc.free_slots),)
    sizes = tuple(alloc.available_size(r) for r in range(alloc.dp_size))
    return ranks, lists, sizes, alloc.is_not_in_free_group


def assert_unchanged(alloc: Any, before: tuple[Any, ...]) -> None:
    """Every rank (lists, flags, group buffer) is as captured, the invariants hold and the lock is free."""
    after = capture(alloc)
    names = ("rank words and group buffers", "public lists", "available sizes", "is_not_in_free_group")
    for name, old, new in zip(names, before, after, strict=True):
        assert old == new, f"{name} changed: {old} -> {new}"
    alloc.check_invariants()
    assert alloc.lock.acquire(timeout=5), "the allocator's lock is still held after the call"
    alloc.lock.release()


def pending_pages(alloc: Any, r: int) -> set[int]:
    """The pages of rank ``r`` freed in the open group and not released yet (the group buffer)."""
    gp = alloc._gp[r]
    return {int(p) for p in gp[L.GP_HEADER : L.GP_HEADER + int(gp[L.GP_COUNT])]}


def compare(alloc: Any, oracle: Any) -> None:
    """The allocator's lists, dtypes and sizes equal the oracle's on every rank; its invariants hold."""
    alloc.check_invariants()
    assert alloc.is_not_in_free_group == oracle.is_not_in_free_group
    groups = alloc.free_group
    assert len(groups) == len(oracle.free_group) == oracle.dp_size
    for r in range(oracle.dp_size):
        got_frees = [a.tolist() for a in groups[r]]
        want_frees = [np.asarray(a).reshape(-1).astype(np.int64).tolist() for a in oracle.free_group[r]]
        assert got_frees == want_frees, f"rank {r} free_group {got_frees}, oracle {want_frees}"
        assert all(a.dtype == np.int64 and not a.flags.writeable for a in groups[r])
    if getattr(oracle, "free_pages", None) is not None:  # the token allocator's is None
        free, released = alloc.free_pages, alloc.release_pages
        assert len(free) == len(released) == oracle.dp_size
        for r in range(oracle.dp_size):
            assert free[r].dtype == np.int32
            assert released[r].dtype == np.int32
            assert free[r].tolist() == oracle.free_pages[r].tolist(), f"rank {r} free list"
            got, want = sorted(released[r].tolist()), sorted(oracle.release_pages[r].tolist())
            assert got == want, f"rank {r} released pages {got}, oracle {want}"
            assert_available(alloc, oracle, r)
    else:
        slots = alloc.free_slots
        assert len(slots) == oracle.dp_size
        for r in range(oracle.dp_size):
            assert slots[r].dtype == np.int32
            assert slots[r].tolist() == oracle.free_slots[r].tolist(), f"rank {r} free slots"
            assert_available(alloc, oracle, r)


def assert_available(alloc: Any, oracle: Any, r: int) -> None:
    """``available_size`` of rank ``r``, by each way of asking (the hot path reads rank 0's word on its own)."""
    want = oracle.available_size(r)
    assert alloc.available_size(r) == want
    assert alloc.available_size(np.int64(r)) == want  # the checked path: the rank's state word, read there
    if r == 0:
        assert alloc.available_size() == want


def oracle_allocated(oracle: Any, r: int) -> set[int]:
    """Pages (or token slots) of rank ``r`` that the oracle holds allocated: not on any of its lists."""
    if getattr(oracle, "free_pages", None) is not None:  # the token allocator's is None
        listed = set(oracle.free_pages[r].tolist()) | set(oracle.release_pages[r].tolist())
        return set(range(1, oracle.pages_per_rank + 1)) - listed
    return set(range(1, oracle.size_per_rank + 1)) - set(oracle.free_slots[r].tolist())


class Requests:
    """Live requests per rank: each a list of its token slots in order.

    Token ``j`` of a request lies at offset ``j % page_size`` of its page
    (extends fill the current page first, then new pages; decodes start a
    new page exactly when ``(seq - 1) % page_size == 0``), so a request's
    pages hold consecutive runs of its tokens, and ``last_loc`` is its last
    slot.
    """

    def __init__(self, dp_size: int, page_size: int) -> None:
        self.ps = page_size
        self.ranks: list[list[list[int]]] = [[] for _ in range(dp_size)]

    def copy(self) -> Requests:
        return copy.deepcopy(self)

    def pages(self, slots: list[int]) -> list[int]:
        """The distinct pages of ``slots``, in first-seen order."""
        return list(dict.fromkeys(s // self.ps for s in slots))

    def held(self, r: int) -> set[int]:
        return {s // self.ps for req in self.ranks[r] for s in req}

    def drop_pages(self, r: int, pages: set[int]) -> int:
        """Forget ``pages`` of rank ``r`` (freed): each request keeps its tokens before its first freed page.

        Whole pages of a request after a freed one (a hole, when a free
        group released a page a restored request held) stay the caller's:
        they become a request of their own, of all their slots, which is a
        consistent request too (prefix a multiple of the page size, last_loc
        a page's last slot). Returns the number of requests changed.
        """
        ps = self.ps
        kept: list[list[int]] = []
        changed = 0
        for req in self.ranks[r]:
            cut = next((j for j, s in enumerate(req) if s // ps in pages), None)
            if cut is None:
                kept.append(req)
                continue
            changed += 1
            head = req[: cut - cut % ps]
            if head:
                kept.append(head)
            rest = [p for p in self.pages(req[cut:]) if p not in pages]
            if rest:
                kept.append([p * ps + j for p in rest for j in range(ps)])
        self.ranks[r] = kept
        return changed

    def check(self, oracle: Any) -> None:
        """The model itself is sound: every request's pages are allocated and no page has two requests."""
        for r, reqs in enumerate(self.ranks):
            allocated = oracle_allocated(oracle, r)
            seen: set[int] = set()
            for req in reqs:
                assert req, "test bug: an empty request"
                pages = set(self.pages(req))
                assert pages <= allocated, f"test bug: rank {r} request holds free pages {pages - allocated}"
                assert not pages & seen, f"test bug: rank {r} pages {pages & seen} held twice"
                seen |= pages
