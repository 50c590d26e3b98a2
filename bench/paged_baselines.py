"""The original device-side allocators' algorithm, in plain numpy.

``PagedTokenToKVPoolAllocator`` and ``TokenToKVPoolAllocator`` are sglang-jax's
KV-cache allocators as SPEC-paged section 1 describes them, written from that
text alone (no numba, no jax, no torch). As ``bench/baselines.py`` is for the
host pool, this one copy serves two purposes:

- the differential oracle of ``tests/``: ``hostpool_nb.paged`` must return the
  same values, dtypes and allocation order, and leave the same free-list order,
  released page set and ``available_size``, for every call the original handles
  correctly;
- the baseline ``python -m bench`` times ``hostpool_nb.paged`` against. It is
  therefore the original's *algorithm with its costs*, not an optimised
  rewrite: ``free`` de-duplicates the freed pages (``np.unique``) and
  set-subtracts them against the concatenation of the whole free and release
  lists (``np.setdiff1d``), so it is O(free list) on every call; a merge is a
  comparison sort of the whole list; ``alloc_extend`` and ``alloc_decode`` loop
  in Python per request and per page.

It keeps the original's silent failures (no validation beyond the original's
plain ``assert`` statements): freeing page 0 or pages beyond the rank adds
them to the pool, a token double free puts a slot on the list twice, a
``dp_rank`` is not range-checked, and mismatched or negative lengths give
whatever the arithmetic gives. That is the behaviour ``hostpool_nb.paged``
replaces with ``HostPoolError`` (SPEC-paged section 2), and what it is measured
against; an oracle that validated would hide the difference and cost time the
original does not spend. Tests compare against it only on correct calls.

Ambiguities of SPEC-paged section 1, and the reading chosen here:

1. "free list ``1..pages_per_rank``" (and token ``1..size_per_rank``) is
   inclusive: a rank starts with ``pages_per_rank`` pages, so
   ``available_size`` starts at ``pages_per_rank * page_size`` (the cache
   holds one extra padding page 0). "Beyond the rank" means page
   ``> pages_per_rank``.
2. ``release_pages[r]`` is one int32 array per rank (empty initially); each
   ``free`` appends its new pages (ascending within the call, as
   ``np.setdiff1d`` returns them) to the end. int32 so that a merge keeps
   ``free_pages[r]`` int32 whatever integer dtype was freed. Its order is not
   part of the contract (a merge sorts); the released *set* is.
3. ``alloc(0)`` returns an empty int64 array (paged) / empty int32 array
   (token), not ``None``; it takes no page and never merges.
4. ``alloc_extend`` needing no new page (e.g. ``extend_num_tokens == 0``)
   returns an empty-or-filled int32 array, never ``None``, and does not merge.
5. ``alloc_extend`` writes into ``np.zeros(extend_num_tokens, int32)``: if
   ``extend_num_tokens`` is larger than the extensions' sum the tail stays 0
   (the padding slot); if smaller, numpy raises after the pages were taken.
   Both are outside the contract (``hostpool_nb.paged`` raises first).
6. An empty ``free`` is a no-op even inside a free group (nothing is stored).
7. Inside a group ``free`` stores ``np.asarray(free_index)`` (no copy) in
   ``free_group[dp_rank]``.
8. ``free_group_begin()`` only clears ``is_not_in_free_group``; it does not
   drop frees still pending from an earlier ``begin`` (a nested begin keeps
   them).
9. ``free_group_end()`` leaves the group first, then for ranks
   ``0..dp_size-1`` in order frees each non-empty concatenation in one
   ``free`` call (ranks with nothing pending make no call), then empties the
   lists. Outside a group it is a no-op.
10. ``clear(dp_rank=r)`` resets rank ``r`` (free list, release list, its
    pending frees) and sets ``is_not_in_free_group = True``; other ranks'
    pending frees are kept, neither freed nor dropped (the next
    ``free_group_end`` frees them). ``clear()`` resets every rank and so drops
    every pending free.
11. ``backup_state()`` returns ``(free_copies, release_copies)``, two lists of
    per-rank array copies (paged), or a list of per-rank ``free_slots`` copies
    (token). Free groups are not part of the state. ``restore_state`` copies
    again, so one state can be restored several times.
12. ``merge_and_sort_free`` is ``np.sort(np.concatenate([free, release]))``:
    the two lists are disjoint by construction (``free`` subtracts both), so
    the union needs no de-duplication. With an empty release list it changes
    nothing (the free list is not re-sorted).
13. The ``debug_mode`` assertions run before any state change. Token
    ``free`` flattens and casts the slots to int32 before appending.
14. No lock: SPEC-paged section 1 mentions none for the originals.
15. ``TokenToKVPoolAllocator`` has ``page_size == 1`` and no ``debug_mode``,
    ``alloc_extend`` or ``alloc_decode`` (section 1 lists none for it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

_I32 = np.int32
_I64 = np.int64


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


class PagedTokenToKVPoolAllocator:
    """SPEC-paged section 1's paged allocator: page ids from 1, a release list, sort-merge."""

    def __init__(self, size: int, page_size: int, kvcache: Any, debug_mode: bool = False, dp_size: int = 1) -> None:
        self.size = size
        self.page_size = page_size
        self.dp_size = dp_size
        self.size_per_rank = size // dp_size
        self.num_pages = size // page_size
        self.pages_per_rank = self.num_pages // dp_size
        self.debug_mode = debug_mode
        self._kvcache = kvcache
        self.free_pages: list[np.ndarray] = [np.empty(0, _I32) for _ in range(dp_size)]
        self.release_pages: list[np.ndarray] = [np.empty(0, _I32) for _ in range(dp_size)]
        self.free_group: list[list[np.ndarray]] = [[] for _ in range(dp_size)]
        self.is_not_in_free_group = True
        self.clear()

    # -- state -------------------------------------------------------------

    def available_size(self, dp_rank: int = 0) -> int:
        return (len(self.free_pages[dp_rank]) + len(self.release_pages[dp_rank])) * self.page_size

    def clear(self, dp_rank: int | None = None) -> None:
        ranks = range(self.dp_size) if dp_rank is None else (dp_rank,)
        for r in ranks:
            self.free_pages[r] = np.arange(1, self.pages_per_rank + 1, dtype=_I32)
            self.release_pages[r] = np.empty(0, _I32)
            self.free_group[r] = []
        self.is_not_in_free_group = True

    def merge_and_sort_free(self, dp_rank: int = 0) -> None:
        released = self.release_pages[dp_rank]
        if len(released) == 0:
            return
        merged = np.concatenate([self.free_pages[dp_rank], released])
        self.free_pages[dp_rank] = np.sort(merged).astype(_I32, copy=False)
        self.release_pages[dp_rank] = np.empty(0, _I32)

    def backup_state(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        return [f.copy() for f in self.free_pages], [p.copy() for p in self.release_pages]

    def restore_state(self, state: tuple[list[np.ndarray], list[np.ndarray]]) -> None:
        free, released = state
        self.free_pages = [np.array(f, dtype=_I32) for f in free]
        self.release_pages = [np.array(p, dtype=_I32) for p in released]

    def _take_pages(self, k: int, dp_rank: int) -> np.ndarray | None:
        """The first ``k`` free pages (merging first if short), or ``None``."""
        if k > len(self.free_pages[dp_rank]):
            self.merge_and_sort_free(dp_rank)
        free = self.free_pages[dp_rank]
        if k > len(free):
            return None
        self.free_pages[dp_rank] = free[k:]
        return free[:k]

    # -- allocation ----------------------------------------------------------

    def alloc(self, need_size: int, dp_rank: int = 0) -> np.ndarray | None:
        ps = self.page_size
        assert need_size % ps == 0, f"need_size={need_size} is not a multiple of page_size={ps}"
        pages = self._take_pages(need_size // ps, dp_rank)
        if pages is None:
            return None
        return (pages.astype(_I64)[:, None] * ps + np.arange(ps, dtype=_I64)).reshape(-1)

    def alloc_extend(
        self,
        prefix_lens: Any,
        seq_lens: Any,
        last_loc: Any,
        extend_num_tokens: int,
        dp_rank: int = 0,
    ) -> np.ndarray | None:
        ps = self.page_size
        prefix = np.asarray(prefix_lens, dtype=_I64)
        seq = np.asarray(seq_lens, dtype=_I64)
        last = np.asarray(last_loc, dtype=_I64)
        if self.debug_mode:
            assert np.all((last + 1) % ps == prefix % ps), "last_loc does not match prefix_lens"
        new_per_request = _ceil_div(seq, ps) - _ceil_div(prefix, ps)
        pages = self._take_pages(int(new_per_request.sum()), dp_rank)
        if pages is None:
            return None
        out = np.zeros(extend_num_tokens, dtype=_I32)
        offsets = np.arange(ps, dtype=_I64)
        pos = 0
        cursor = 0
        for i in range(len(seq)):
            p = int(prefix[i])
            remaining = int(seq[i]) - p
            if remaining <= 0:
                continue
            # Rest of the current page: from last_loc + 1 up to the page end.
            rest = min(-(-p // ps) * ps - p, remaining)
            if rest > 0:
                start = int(last[i]) + 1
                out[pos : pos + rest] = np.arange(start, start + rest, dtype=_I64)
                pos += rest
                remaining -= rest
            # Then new pages in free-list order, the last one possibly partial.
            while remaining > 0:
                take = min(ps, remaining)
                out[pos : pos + take] = int(pages[cursor]) * ps + offsets[:take]
                cursor += 1
                pos += take
                remaining -= take
        return out

    def alloc_decode(self, seq_lens: Any, last_loc: Any, dp_rank: int = 0) -> np.ndarray | None:
        ps = self.page_size
        seq = np.asarray(seq_lens, dtype=_I64)
        last = np.asarray(last_loc, dtype=_I64)
        if self.debug_mode:
            assert np.all((last + 2) % ps == seq % ps), "last_loc does not match seq_lens"
        needs_page = _ceil_div(seq, ps) > _ceil_div(seq - 1, ps)
        pages = self._take_pages(int(needs_page.sum()), dp_rank)
        if pages is None:
            return None
        out = np.empty(len(seq), dtype=_I32)
        cursor = 0
        for i in range(len(seq)):
            if needs_page[i]:
                out[i] = int(pages[cursor]) * ps
                cursor += 1
            else:
                out[i] = int(last[i]) + 1
        return out

    # -- freeing -------------------------------------------------------------

    def free(self, free_index: Any, dp_rank: int = 0) -> None:
        index = np.asarray(free_index)
        if index.size == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group[dp_rank].append(index)
            return
        pages = np.unique(index // self.page_size).astype(_I64, copy=False)
        # O(free list): set-difference against every free and released page.
        known = np.concatenate([self.free_pages[dp_rank], self.release_pages[dp_rank]])
        new = np.setdiff1d(pages, known).astype(_I32)
        self.release_pages[dp_rank] = np.concatenate([self.release_pages[dp_rank], new])

    def free_group_begin(self) -> None:
        self.is_not_in_free_group = False

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        for r in range(self.dp_size):
            pending = self.free_group[r]
            if pending:
                self.free(np.concatenate(pending), dp_rank=r)
            self.free_group[r] = []

    # -- kvcache forwarding ----------------------------------------------------

    def get_kvcache(self) -> Any:
        return self._kvcache

    def get_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        return self._kvcache.get_cpu_copy(*args, **kwargs)

    def load_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        return self._kvcache.load_cpu_copy(*args, **kwargs)


class TokenToKVPoolAllocator:
    """SPEC-paged section 1's token allocator: a free list, frees appended as given."""

    def __init__(self, size: int, kvcache: Any, dp_size: int = 1) -> None:
        self.size = size
        self.page_size = 1
        self.dp_size = dp_size
        self.size_per_rank = size // dp_size
        self._kvcache = kvcache
        self.free_slots: list[np.ndarray] = [np.empty(0, _I32) for _ in range(dp_size)]
        self.free_group: list[list[np.ndarray]] = [[] for _ in range(dp_size)]
        self.is_not_in_free_group = True
        self.clear()

    def available_size(self, dp_rank: int = 0) -> int:
        return len(self.free_slots[dp_rank])

    def clear(self, dp_rank: int | None = None) -> None:
        ranks = range(self.dp_size) if dp_rank is None else (dp_rank,)
        for r in ranks:
            self.free_slots[r] = np.arange(1, self.size_per_rank + 1, dtype=_I32)
            self.free_group[r] = []
        self.is_not_in_free_group = True

    def backup_state(self) -> list[np.ndarray]:
        return [s.copy() for s in self.free_slots]

    def restore_state(self, state: list[np.ndarray]) -> None:
        self.free_slots = [np.array(s, dtype=_I32) for s in state]

    def alloc(self, need_size: int, dp_rank: int = 0) -> np.ndarray | None:
        free = self.free_slots[dp_rank]
        if need_size > len(free):
            return None
        select = free[:need_size].copy()
        self.free_slots[dp_rank] = free[need_size:]
        return select

    def free(self, free_index: Any, dp_rank: int = 0) -> None:
        index = np.asarray(free_index)
        if index.size == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group[dp_rank].append(index)
            return
        # Appended as given: no merge, no sort, no de-duplication.
        appended = index.reshape(-1).astype(_I32)
        self.free_slots[dp_rank] = np.concatenate([self.free_slots[dp_rank], appended])

    def free_group_begin(self) -> None:
        self.is_not_in_free_group = False

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        for r in range(self.dp_size):
            pending = self.free_group[r]
            if pending:
                self.free(np.concatenate(pending), dp_rank=r)
            self.free_group[r] = []

    def get_kvcache(self) -> Any:
        return self._kvcache

    def get_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        return self._kvcache.get_cpu_copy(*args, **kwargs)

    def load_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        return self._kvcache.load_cpu_copy(*args, **kwargs)


__all__ = ["PagedTokenToKVPoolAllocator", "TokenToKVPoolAllocator"]
