"""What a HostPagePool should do: the original bookkeeping (docs/behaviour.md, section 4) and the stricter rules.

``Expected`` wraps the original algorithm (``hostpool_nb.originals.host_tier``'s
``LRUHostKVPool``, plain Python lists) and applies to it what hostpool_nb
adds: a call that raises changes nothing (the original frees the pages
before a bad one: here it runs on a copy first), the errors are the
package's classes (each a subclass of the original's ``ValueError`` or
``RuntimeError``, with the original's text), and ``generations=`` /
``generation=`` refuse a page handed out again since. ``clear`` makes every
page free in ascending order and unpinned, keeping generations and
counters; a snapshot is a deep copy.

``state_of`` reads a pool (or the model) as comparable lists: the free list
in order, and the allocated flags, generations and pin counts by page.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from hostpool_nb import (
    HostPoolError,
    LockRefUnderflowError,
    PageDoubleFreeError,
    PageNotAllocatedError,
    PinnedPageError,
    SlotRangeError,
    StaleFreeError,
)
from hostpool_nb._kernels import layout as L
from hostpool_nb.originals.host_tier import LRUHostKVPool


def classify(exc: BaseException) -> type[Exception]:
    """The package's class for an error of the original, by its text."""
    text = str(exc)
    if isinstance(exc, ValueError) and "outside pool range" in text:
        return SlotRangeError
    if isinstance(exc, ValueError) and text.startswith("need_pages must be positive"):
        return HostPoolError
    if text.startswith("double free of"):
        return PageDoubleFreeError
    if "of locked" in text:
        return PinnedPageError
    if "is not allocated (in free-list)" in text:
        return PageNotAllocatedError
    if text.startswith("dec_lock_ref underflow"):
        return LockRefUnderflowError
    raise AssertionError(f"the oracle raised an error the model does not know: {exc!r}")


class Refused(Exception):  # the model's prediction of a refusal, not an error of its own
    """The model's prediction: the call raises ``cls`` with ``text`` and changes nothing."""

    def __init__(self, cls: type[Exception], text: str) -> None:
        super().__init__(text)
        self.cls = cls
        self.text = text


class Expected:
    """The model: the original pool's books, with hostpool_nb's rules on top."""

    def __init__(self, pool_size: int) -> None:
        self.o = LRUHostKVPool(pool_size)
        self.n = pool_size
        self.free_calls = 0
        self.alloc_calls = 0
        self.clears = 0

    def _attempt(self, call: Any) -> Any:
        """Run ``call(oracle)`` on a copy; keep the copy if it returned, raise Refused if it raised."""
        trial = copy.deepcopy(self.o)
        try:
            result = call(trial)
        except (ValueError, RuntimeError) as exc:
            raise Refused(classify(exc), str(exc)) from None
        self.o = trial
        return result

    # -- the original's calls, atomic ----------------------------------------------

    def reserve(self) -> int | None:
        self.alloc_calls += 1
        return self._attempt(lambda o: o.reserve())

    def alloc(self, need: int) -> list[int] | None:
        got = self._attempt(lambda o: o.alloc(need))  # need <= 0 raises before it is counted
        self.alloc_calls += 1
        return None if got is None else got.tolist()

    def release(self, page: int, generation: int | None = None) -> None:
        # The order of checks: range, double free, stale, pinned; only the stale one is not the original's.
        known = 0 <= page < self.n and self.o._allocated[page]
        if generation is not None and known and generation != self.o._generation[page]:
            raise Refused(
                StaleFreeError,
                f"stale release of buffer_id={page}: it was handed out again since generation "
                f"{generation} (its generation is {self.o._generation[page]})",
            )
        self._attempt(lambda o: o.release(page))
        self.free_calls += 1

    def free(self, pages: list[int], generations: list[int] | None = None) -> int:
        seen: set[int] = set()
        for i, page in enumerate(pages):
            if not 0 <= page < self.n:
                break  # the original's range error, below
            allocated = self.o._allocated[page]
            if generations is not None and allocated and generations[i] != self.o._generation[page]:
                raise Refused(
                    StaleFreeError,
                    f"stale free of page id={page}: it was handed out again since generation "
                    f"{generations[i]} (its generation is {self.o._generation[page]})",
                )
            if page in seen:
                continue
            if not allocated or self.o._lock_ref[page] > 0:
                break  # the original's error, below
            seen.add(page)
        self._attempt(lambda o: o.free(pages))
        if seen:
            self.free_calls += 1
        return len(seen)

    def pin(self, pages: list[int] | int, delta: int) -> None:
        def apply(o: LRUHostKVPool) -> None:
            for page in [pages] if isinstance(pages, int) else pages:
                (o.inc_lock_ref if delta > 0 else o.dec_lock_ref)(page)

        self._attempt(apply)

    # -- what only hostpool_nb has -----------------------------------------------------

    def clear(self) -> None:
        o = self.o
        o._free_list = list(range(self.n))
        o._allocated = [False] * self.n
        o._lock_ref = [0] * self.n
        o._slots = [None] * self.n
        o._pending = {}
        self.clears += 1

    def snapshot(self) -> Expected:
        return copy.deepcopy(self)

    def state(self) -> tuple[list[int], list[bool], list[int], list[int]]:
        o = self.o
        return list(o._free_list), list(o._allocated), list(o._generation), list(o._lock_ref)


def state_of(pool: Any) -> tuple[list[int], list[bool], list[int], list[int]]:
    """A pool's free list in order, then its allocated flags, generations and pin counts by page."""
    st = pool._st
    n = pool.pool_size
    head, nfree = int(st[L.HP_HEAD]), int(st[L.HP_NFREE])
    free = pool._ring[(head + np.arange(nfree)) % n].tolist()
    return free, pool.allocated.tolist(), pool.generation.tolist(), pool.lock_ref.tolist()


def words_of(pool: Any) -> np.ndarray:
    """A pool's whole state array but for its scratch: what a refused call must leave as it was.

    The scratch is the two fault words of the header and the ring's entries
    after the free list, where ``free`` stages the pages it checked.
    """
    words = pool._st.copy()
    words[list(L.HP_SCRATCH)] = 0
    n = pool.pool_size
    head, nfree = int(words[L.HP_HEAD]), int(words[L.HP_NFREE])
    ring = words[L.HP_HEADER : L.HP_HEADER + (n + 1) // 2].view(np.int32)[:n]
    spare = (head + nfree + np.arange(n - nfree)) % n
    ring[spare] = -1
    return words
