"""sglang-jax's device KV-cache allocators' algorithm, in numpy, with the engine's class hierarchy.

The three derive from :class:`BaseTokenToKVPoolAllocator`, as sglang-jax's
do from its base of that name, and inherit from it what the engine's
inherit, failures included: so a drop-in that lacks a base method fails
``install()`` against the stand-in engine as it would against the engine.

``PagedTokenToKVPoolAllocator`` and ``TokenToKVPoolAllocator`` as
``docs/behaviour.md`` describes them: per data-parallel rank a free list
(int32) and, for the paged one, a release list merged by sorting. The
original's costs are kept: ``free`` de-duplicates the freed pages and
set-subtracts them against the whole free and release lists, a merge is a
comparison sort, the batch calls loop in Python per request. So are its
silent failures: freeing page 0 or pages beyond the rank adds them to the
pool, a token double free lists a slot twice, ``dp_rank`` and lengths are
not checked, and the ``debug_mode`` checks fail as the original's
``assert`` does (an ``AssertionError``).

Readings of the behaviour where it leaves a choice: the free lists start as
``1..pages_per_rank`` (inclusive); ``release_pages[r]`` gets each free's new
pages appended, ascending within the call; ``alloc(0)`` returns an empty
array; an ``alloc_extend`` needing no new page never merges; inside a free
group ``free`` stores ``np.asarray(free_index)`` in ``free_group[r]``;
``free_group_begin`` only clears the flag; ``free_group_end`` leaves the
group, then frees each rank's non-empty concatenation in one call;
``clear(r)`` drops rank ``r``'s pending frees and leaves the group (other
ranks' stay pending); a snapshot copies the lists, not the group; a merge
with nothing released changes nothing; the batch calls' debug checks come
before any change; the token ``free`` appends the slots as int32.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

_I32 = np.int32
_I64 = np.int64


def _check(ok: Any, message: str) -> None:
    """The original's ``assert``, kept when Python runs with -O."""
    if not bool(np.all(ok)):
        raise AssertionError(message)


class BaseTokenToKVPoolAllocator(abc.ABC):
    """sglang-jax's base class of the three allocators, as observed: what each inherits unless it overrides it.

    Its constructor sets the shape, ``free_pages`` and ``release_pages``
    to ``None`` (a subclass with page lists replaces them), an empty
    ``free_group`` and the flag. ``merge_and_sort_free`` reads the page
    lists, so on the token and sliding-window allocators, which keep none,
    it fails with a ``TypeError``; ``get_cpu_copy`` and ``load_cpu_copy``
    raise ``NotImplementedError`` unless a subclass forwards them, and
    ``alloc_extend`` / ``alloc_decode`` raise ``NotImplementedError``
    unless a subclass pages.

    Examples
    --------
    >>> from hostpool_nb.originals import paged
    >>> alloc = paged.TokenToKVPoolAllocator(16, None)
    >>> isinstance(alloc, paged.BaseTokenToKVPoolAllocator)
    True
    >>> alloc.debug_print(), alloc.free_pages
    ('', None)
    >>> alloc.alloc_extend([0], [1], [-1], 1)
    Traceback (most recent call last):
    ...
    NotImplementedError: alloc_extend is only for paged allocator
    """

    free_pages: Any
    release_pages: Any
    free_group: Any

    @abc.abstractmethod
    def __init__(self, size: int, page_size: int, kvcache: Any, dp_size: int = 1) -> None:
        self.size = size
        self.page_size = page_size
        self.dp_size = dp_size
        self.size_per_rank = size // dp_size
        self._kvcache = kvcache
        self.free_pages = None
        self.release_pages = None
        self.is_not_in_free_group = True
        self.free_group = []

    def debug_print(self) -> str:
        return ""

    def available_size(self, dp_rank: int = 0) -> int:
        return (len(self.free_pages[dp_rank]) + len(self.release_pages[dp_rank])) * self.page_size

    def get_kvcache(self) -> Any:
        return self._kvcache

    def restore_state(self, state: Any) -> None:
        self.free_pages, self.release_pages = state

    def backup_state(self) -> Any:
        return (self.free_pages, self.release_pages)

    def free_group_begin(self) -> None:
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        if self.free_group:
            self.free(np.concatenate(self.free_group))

    def merge_and_sort_free(self, dp_rank: int = 0) -> None:
        released = self.release_pages[dp_rank]  # None on the token and SWA allocators: a TypeError
        if len(released) == 0:
            return
        merged = np.concatenate([self.free_pages[dp_rank], released])
        self.free_pages[dp_rank] = np.sort(merged).astype(_I32, copy=False)
        self.release_pages[dp_rank] = np.empty(0, _I32)

    def get_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("get_cpu_copy not implemented for JAX")

    def load_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("load_cpu_copy not implemented for JAX")

    def alloc_extend(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("alloc_extend is only for paged allocator")

    def alloc_decode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("alloc_decode is only for paged allocator")

    @abc.abstractmethod
    def clear(self, dp_rank: int | None = None) -> None: ...

    @abc.abstractmethod
    def alloc(self, need_size: int, dp_rank: int = 0) -> np.ndarray | None: ...

    @abc.abstractmethod
    def free(self, free_index: Any, dp_rank: int = 0) -> None: ...


class _Ranked(BaseTokenToKVPoolAllocator):
    """Free groups per rank, as each of the three allocators overrides the base's."""

    def __init__(self, size: int, page_size: int, kvcache: Any, dp_size: int = 1) -> None:
        super().__init__(size, page_size, kvcache, dp_size)
        self.free_group: list[list[np.ndarray]] = [[] for _ in range(dp_size)]
        self.is_not_in_free_group = True

    def free_group_begin(self) -> None:
        self.is_not_in_free_group = False

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        for r in range(self.dp_size):
            pending = self.free_group[r]
            if pending:
                self.free(np.concatenate(pending), dp_rank=r)
            self.free_group[r] = []

    def _defer(self, index: np.ndarray, dp_rank: int) -> bool:
        """Store ``index`` in the open group, if any; whether it was."""
        if self.is_not_in_free_group:
            return False
        self.free_group[dp_rank].append(index)
        return True


class _ForwardsCopies:
    """The token and paged allocators forward CPU copies to their KV pool (the SWA allocator does not)."""

    _kvcache: Any

    def get_cpu_copy(self, indices: Any) -> Any:
        return self._kvcache.get_cpu_copy(indices)

    def load_cpu_copy(self, kv_cache_cpu: Any, indices: Any) -> Any:
        return self._kvcache.load_cpu_copy(kv_cache_cpu, indices)


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


class PagedTokenToKVPoolAllocator(_ForwardsCopies, _Ranked):
    """The paged allocator: page ids from 1, a release list, sort-merge.

    Examples
    --------
    >>> from hostpool_nb.originals.paged import PagedTokenToKVPoolAllocator
    >>> alloc = PagedTokenToKVPoolAllocator(64, 4, None)
    >>> alloc.alloc_extend([0], [6], [-1], 6)
    array([4, 5, 6, 7, 8, 9], dtype=int32)
    """

    def __init__(self, size: int, page_size: int, kvcache: Any, debug_mode: bool = False, dp_size: int = 1) -> None:
        super().__init__(size, page_size, kvcache, dp_size)
        self.num_pages = size // page_size
        self.pages_per_rank = self.num_pages // dp_size
        self.debug_mode = debug_mode
        self.free_pages: list[np.ndarray] = [np.empty(0, _I32) for _ in range(dp_size)]
        self.release_pages: list[np.ndarray] = [np.empty(0, _I32) for _ in range(dp_size)]
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
        _check(need_size % ps == 0, f"need_size={need_size} is not a multiple of page_size={ps}")
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
            _check((last + 1) % ps == prefix % ps, "last_loc does not match prefix_lens")
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
            _check((last + 2) % ps == seq % ps, "last_loc does not match seq_lens")
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
        if self._defer(index, dp_rank):
            return
        pages = np.unique(index // self.page_size).astype(_I64, copy=False)
        # O(free list): set-difference against every free and released page.
        known = np.concatenate([self.free_pages[dp_rank], self.release_pages[dp_rank]])
        new = np.setdiff1d(pages, known).astype(_I32)
        self.release_pages[dp_rank] = np.concatenate([self.release_pages[dp_rank], new])


class TokenToKVPoolAllocator(_ForwardsCopies, _Ranked):
    """The token allocator: a free list, frees appended as given.

    Examples
    --------
    >>> from hostpool_nb.originals.paged import TokenToKVPoolAllocator
    >>> alloc = TokenToKVPoolAllocator(16, None)
    >>> slots = alloc.alloc(2)
    >>> alloc.free(slots); alloc.free(slots)  # a double free, accepted
    >>> alloc.available_size()  # two slots listed twice
    18
    """

    def __init__(self, size: int, kvcache: Any, dp_size: int = 1) -> None:
        super().__init__(size, 1, kvcache, dp_size)
        self.free_slots: list[np.ndarray] = [np.empty(0, _I32) for _ in range(dp_size)]
        self.clear()
        self.origin_size = len(self.free_slots[0])

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
        select: np.ndarray = free[:need_size].copy()
        self.free_slots[dp_rank] = free[need_size:]
        return select

    def free(self, free_index: Any, dp_rank: int = 0) -> None:
        index = np.asarray(free_index)
        if index.size == 0:
            return
        if self._defer(index, dp_rank):
            return
        # Appended as given: no merge, no sort, no de-duplication.
        appended = index.reshape(-1).astype(_I32)
        self.free_slots[dp_rank] = np.concatenate([self.free_slots[dp_rank], appended])


class SWATokenToKVPoolAllocator(_Ranked):
    """sglang-jax's sliding-window allocator (docs/behaviour.md, section 3): a full and an SWA sub-allocator, a mapping.

    Each full slot maps to the SWA slot of the same token (0: none), in one
    int32 array per rank that the allocator updates in place. As observed:
    ``alloc`` checks both sub-allocators first; ``alloc_extend`` and
    ``alloc_decode`` allocate on the full one, then on the SWA one with the
    mapped ``last_loc``, and free the full slots again when the SWA one
    refuses; ``free`` frees the full slots and then their SWA slots
    (``free_swa``); snapshots raise ``NotImplementedError``. Its silent
    corruptions are the sub-allocators' (a token double free lists a slot
    twice) and a ``free_swa`` of a full slot handed out again since.

    Readings where the observation leaves a choice: ``clear(r)`` also drops
    rank ``r``'s pending frees and leaves the group, as the sub-allocators'
    ``clear``; the mapping is given to ``kvcache`` as its
    ``full_to_swa_index_mapping`` attribute.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> from hostpool_nb.originals.paged import SWATokenToKVPoolAllocator
    >>> kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    >>> a = SWATokenToKVPoolAllocator(64, 16, kv)
    >>> full = a.alloc(3)
    >>> a.full_to_swa_index_mapping[full]
    array([1, 2, 3], dtype=int32)
    """

    def __init__(self, size: int, size_swa: int, kvcache: Any, page_size: int = 1, dp_size: int = 1) -> None:
        super().__init__(size, page_size, kvcache, dp_size)
        sub: Any
        if page_size == 1:
            self.full_attn_allocator: Any = TokenToKVPoolAllocator(size, kvcache.full_kv_pool, dp_size=dp_size)
            sub = TokenToKVPoolAllocator(size_swa, kvcache.swa_kv_pool, dp_size=dp_size)
        else:
            self.full_attn_allocator = PagedTokenToKVPoolAllocator(
                size, page_size, kvcache.full_kv_pool, debug_mode=False, dp_size=dp_size
            )
            sub = PagedTokenToKVPoolAllocator(
                size_swa, page_size, kvcache.swa_kv_pool, debug_mode=False, dp_size=dp_size
            )
        self.swa_attn_allocator: Any = sub
        length = self.full_attn_allocator.size_per_rank + page_size
        self._maps = [np.zeros(length, dtype=_I32) for _ in range(dp_size)]
        self.full_to_swa_index_mapping: Any = self._maps[0] if dp_size == 1 else self._maps
        kvcache.full_to_swa_index_mapping = self.full_to_swa_index_mapping

    @property
    def size_full(self) -> int:
        return int(self.full_attn_allocator.size)

    @property
    def size_swa(self) -> int:
        return int(self.swa_attn_allocator.size)

    def full_available_size(self, dp_rank: int = 0) -> int:
        return int(self.full_attn_allocator.available_size(dp_rank))

    def swa_available_size(self, dp_rank: int = 0) -> int:
        return int(self.swa_attn_allocator.available_size(dp_rank))

    def available_size(self, dp_rank: int = 0) -> int:
        return min(self.full_available_size(dp_rank), self.swa_available_size(dp_rank))

    def debug_print(self, dp_rank: int = 0) -> str:
        return (
            f"#swa-available-size: {self.swa_available_size(dp_rank)}, "
            f"#full-attn-available-size: {self.full_available_size(dp_rank)}, "
        )

    def alloc(self, need_size: int, dp_rank: int = 0) -> np.ndarray | None:
        if need_size > self.full_available_size(dp_rank) or need_size > self.swa_available_size(dp_rank):
            return None
        full = self.full_attn_allocator.alloc(need_size, dp_rank)
        swa = self.swa_attn_allocator.alloc(need_size, dp_rank)
        if swa is None:
            self.full_attn_allocator.free(full, dp_rank)
            return None
        self._maps[dp_rank][full] = swa
        return full  # type: ignore[no-any-return]

    def _mapped(self, last_loc: Any, dp_rank: int) -> np.ndarray:
        return self._maps[dp_rank][np.asarray(last_loc, dtype=_I64)].astype(_I32)

    def alloc_extend(
        self, prefix_lens: Any, seq_lens: Any, last_loc: Any, extend_num_tokens: int, dp_rank: int = 0
    ) -> np.ndarray | None:
        full = self.full_attn_allocator.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens, dp_rank)
        if full is None:
            return None
        swa = self.swa_attn_allocator.alloc_extend(
            prefix_lens, seq_lens, self._mapped(last_loc, dp_rank), extend_num_tokens, dp_rank
        )
        if swa is None:
            self.full_attn_allocator.free(full, dp_rank)
            return None
        self._maps[dp_rank][full] = swa
        return full  # type: ignore[no-any-return]

    def alloc_decode(self, seq_lens: Any, last_loc: Any, dp_rank: int = 0) -> np.ndarray | None:
        full = self.full_attn_allocator.alloc_decode(seq_lens, last_loc, dp_rank)
        if full is None:
            return None
        swa = self.swa_attn_allocator.alloc_decode(seq_lens, self._mapped(last_loc, dp_rank), dp_rank)
        if swa is None:
            self.full_attn_allocator.free(full, dp_rank)
            return None
        self._maps[dp_rank][full] = swa
        return full  # type: ignore[no-any-return]

    def free(self, free_index: Any, dp_rank: int = 0) -> None:
        index = np.asarray(free_index)
        if index.size == 0:
            return
        if self._defer(index, dp_rank):
            return
        self.full_attn_allocator.free(index, dp_rank)
        self.free_swa(index, dp_rank)
        _check(self.full_attn_allocator.available_size(dp_rank) <= self.full_attn_allocator.size, "full pool overflow")
        _check(self.swa_attn_allocator.available_size(dp_rank) <= self.swa_attn_allocator.size, "swa pool overflow")

    def free_swa(self, free_index: Any, dp_rank: int = 0) -> None:
        index = np.asarray(free_index, dtype=_I64).reshape(-1)
        mapping = self._maps[dp_rank]
        swa = mapping[index]
        swa = swa[swa > 0]
        self.swa_attn_allocator.free(swa, dp_rank)
        mapping[index] = 0

    def count_swa_mapped(self, indices: Any, dp_rank: int = 0) -> int:
        return int(np.count_nonzero(self._maps[dp_rank][np.asarray(indices, dtype=_I64)]))

    def clear(self, dp_rank: int | None = None) -> None:
        ranks = range(self.dp_size) if dp_rank is None else (dp_rank,)
        self.full_attn_allocator.clear(dp_rank)
        self.swa_attn_allocator.clear(dp_rank)
        for r in ranks:
            self._maps[r][:] = 0
            self.free_group[r] = []
        self.is_not_in_free_group = True

    def backup_state(self) -> Any:
        raise NotImplementedError

    def restore_state(self, state: Any) -> None:
        raise NotImplementedError


__all__ = [
    "BaseTokenToKVPoolAllocator",
    "PagedTokenToKVPoolAllocator",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
]
