"""sglang-jax's paged and token allocators: one rank's kernels per call, the checks before them."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from .._convert import _INT64_MAX, as_count, as_int_vectors
from .._core.protocol import handed_off
from .._errors import AlignmentError, HostPoolError
from .._kernels import layout as _layout
from .._kernels import paged as _paged_kernels
from ._base import _CHECK, _CORE, _INT32_MAX, _NONE, _STATUS_SHORT, _BatchCalls, _RankedAllocator, raise_unless_short


class PagedTokenToKVPoolAllocator(_BatchCalls, _RankedAllocator):
    """sglang-jax's paged allocator: whole pages per request, page 0 reserved, sorted merges.

    Per rank: a free list of page ids ``1..pages_per_rank`` (always
    ascending) and a release list of pages freed since the last merge.
    Allocations take pages from the front of the free list; when it is too
    short, the release list is merged in (sorted) first, and only then is a
    request refused with ``None``. ``free`` frees whole pages: any slot of a
    page frees it, and a page already free is ignored (``strict=True``:
    a :class:`DoubleFreeError`).

    Parameters
    ----------
    size, page_size : int
        Token slots and slots per page; ``num_pages = size // page_size``.
    kvcache : object
        Stored; ``get_kvcache()`` returns it, ``get_cpu_copy`` and
        ``load_cpu_copy`` forward to it.
    debug_mode : bool, optional
        Check that ``last_loc`` continues each request's tokens
        (``HostPoolError`` naming the request, where the original asserts).
    dp_size : int, optional
        Data-parallel ranks, each an independent allocator of
        ``pages_per_rank = num_pages // dp_size`` pages. A method's
        ``dp_rank`` names one, in ``[0, dp_size)``; 0 by default.
    strict : bool, optional, keyword-only
        Make freeing an already-free page a ``DoubleFreeError`` (for
        debugging; callers free token ranges that share pages, which the
        default accepts).
    track : bool or None, optional, keyword-only
        Record who holds each page: the call site (the first frame outside
        hostpool_nb) and tag of the allocation that handed it out, and the
        site that last freed it, for :meth:`outstanding`,
        :meth:`leak_report` and double-free messages (16 bytes of state per
        page). ``None`` (the default): if ``HOSTPOOL_NB_TRACK=1`` is in the
        environment, so tracking is turned on without editing the engine.

    Examples
    --------
    >>> from hostpool_nb.paged import PagedTokenToKVPoolAllocator
    >>> alloc = PagedTokenToKVPoolAllocator(size=64, page_size=4, kvcache=None)
    >>> alloc.alloc_extend([0], [6], [-1], 6)  # 6 tokens: pages 1 and 2
    array([4, 5, 6, 7, 8, 9], dtype=int32)
    >>> alloc.alloc_decode([7], [9])  # its 7th token continues page 2
    array([10], dtype=int32)
    >>> alloc.free([4, 5, 6, 7]), alloc.available_size()
    (1, 60)
    """

    _kind = "PagedTokenToKVPoolAllocator"
    _snapshot_kind = "paged"
    _sorted = True
    _rank_calls = ("reset_rank", "end_group", "alloc_slots", "alloc_extend", "alloc_decode", "free_slots")
    _core_calls = ("merge", "load_state")
    _recorded = (*_RankedAllocator._recorded, "alloc_extend", "alloc_decode", "merge_and_sort_free")

    def __init__(  # noqa: PLR0913 - sglang-jax's constructor, kept for drop-in use
        self,
        size: int,
        page_size: int,
        kvcache: Any,
        debug_mode: bool = False,
        dp_size: int = 1,
        *,
        strict: bool = False,
        track: bool | None = None,
    ) -> None:
        size, page_size, dp_size = self._shape(size, page_size, dp_size)
        self.num_pages = size // page_size
        self.pages_per_rank = self.num_pages // dp_size
        if (self.pages_per_rank + 1) * page_size - 1 > _INT32_MAX:
            raise HostPoolError(
                f"slot ids of {self.pages_per_rank} pages of {page_size} slots per rank do not fit the int32 "
                "arrays alloc_extend and alloc_decode return"
            )
        self.debug_mode = bool(debug_mode)
        super().__init__((size, page_size, dp_size), self.pages_per_rank, kvcache, strict, track)

    @classmethod
    def _pages_of(cls, size: int, page_size: int, dp_size: int) -> int:
        return size // page_size // dp_size

    def _constructor_args(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "page_size": self.page_size,
            "debug_mode": self.debug_mode,
            "dp_size": self.dp_size,
            "strict": self.strict,
            "track": self.track,
        }

    @property
    def free_pages(self) -> list[NDArray[np.int32]]:
        """Each rank's free list (ascending page ids, int32), as read-only copies."""
        with self.lock:
            return [self._window(r, 0, int(st[_layout.H_NFREE])) for r, st in enumerate(self._st)]

    @property
    def release_pages(self) -> list[NDArray[np.int32]]:
        """Each rank's pages freed since its last merge (int32, order not meaningful), read-only copies."""
        with self.lock:
            return [self._window(r, int(st[_layout.H_NFREE]), int(st[_layout.H_NREL])) for r, st in enumerate(self._st)]

    @handed_off
    def merge_and_sort_free(self, dp_rank: Any = 0) -> None:
        """Merge the rank's release list into its free list, keeping it ascending. O(pages)."""
        r = self._rank(dp_rank)
        with self.lock:
            status = _CORE.merge(self._st[r])
        if status < 0:
            raise self._corrupt("merge", status)

    def _alloc_plain(self, st: Any, need_size: int) -> Any:
        ps = self.page_size
        if need_size % ps or need_size < 0 or need_size > self._pages * ps:
            return _CHECK
        out = np.empty(need_size, dtype=np.int64)
        lock = self.lock
        lock.acquire()  # not ``with``: at page size 1 an engine allocates every decode step
        try:
            status: int = self._k.alloc_slots(st, out, ps, -1)
        finally:
            lock.release()
        return out if status >= 0 else raise_unless_short(self, status)

    def _alloc(self, need_size: int, r: int, tag: Hashable) -> NDArray[np.int64] | None:
        """``alloc`` of whole pages, as int64 slots."""
        ps = self.page_size
        if need_size % ps != 0:
            raise AlignmentError(f"alloc must be page-aligned, got need_size={need_size}, page_size={ps}")
        if need_size < 0:
            raise HostPoolError(f"need_size must be non-negative, got need_size={need_size}")
        if need_size // ps > self._pages:
            # More pages than the rank has: refused like any short request
            # (after merging, as the original), without allocating the output.
            need_size = (self._pages + 1) * ps
        trackers = self._trackers
        where = None if trackers is None else trackers[r].where(tag, 1)  # an unusable tag raises here
        return self._alloc_into(r, np.empty(need_size, dtype=np.int64), where, tag, self._k.alloc_slots, ps)

    def _extend(  # noqa: PLR0913, PLR0917 - alloc_extend's arguments, passed on as they came
        self, prefix_lens: Any, seq_lens: Any, last_loc: Any, extend_num_tokens: Any, dp_rank: Any, tags: Any
    ) -> NDArray[np.int32] | None:
        prefix, seq, last = as_int_vectors((prefix_lens, seq_lens, last_loc), ("prefix_lens", "seq_lens", "last_loc"))
        total = as_count(extend_num_tokens, "extend_num_tokens")
        r = self._rank(dp_rank)
        if not prefix.shape[0] == seq.shape[0] == last.shape[0]:
            raise HostPoolError(
                "prefix_lens, seq_lens and last_loc must have the same length, got "
                f"{prefix.shape[0]}, {seq.shape[0]} and {last.shape[0]}"
            )
        if total < 0:
            raise HostPoolError(f"extend_num_tokens must be non-negative, got extend_num_tokens={total}")
        # Beyond this many tokens the new pages outnumber the rank's pages
        # (each request's current page takes under page_size of them), so
        # the call can only fail: the kernel checks it without an output
        # rather than after a huge (or impossible) np.empty.
        ps = self.page_size
        fits = total <= (self._pages + prefix.shape[0]) * ps
        trackers = self._trackers
        keys = None if trackers is None else self._keys(r, tags, prefix.shape[0])
        out = np.empty(total if fits else 0, dtype=np.int32)
        debug = int(self.debug_mode)
        with self.lock:
            # A total beyond int64 is passed as the int64 maximum: unequal to
            # any sum the kernel can reach, so still E_TOTAL, in its turn.
            tokens = min(total, _INT64_MAX)
            sites = _NONE if keys is None else self._request_sites(r, keys, tags)
            status = self._k.alloc_extend(self._st[r], prefix, seq, last, out, tokens, ps, debug, sites)
            if status < 0 and keys is not None:  # refused or failed: the table as it was
                self._failed(r)
        return out if status >= 0 else self._refused(status, (prefix, seq, last), total, "alloc_extend")

    def _decode(self, seq_lens: Any, last_loc: Any, dp_rank: Any, tags: Any) -> NDArray[np.int32] | None:
        seq, last = as_int_vectors((seq_lens, last_loc), ("seq_lens", "last_loc"))
        r = dp_rank if type(dp_rank) is int and 0 <= dp_rank < self.dp_size else self._rank(dp_rank)
        if seq.shape[0] != last.shape[0]:
            raise HostPoolError(
                f"seq_lens and last_loc must have the same length, got {seq.shape[0]} and {last.shape[0]}"
            )
        trackers = self._trackers
        keys = None if trackers is None else self._keys(r, tags, seq.shape[0])
        out = np.empty(seq.shape[0], dtype=np.int32)
        ps, debug = self.page_size, int(self.debug_mode)
        with self.lock:
            sites = _NONE if keys is None else self._request_sites(r, keys, tags)
            status = self._k.alloc_decode(self._st[r], seq, last, out, ps, debug, sites)
            if status < 0 and keys is not None:  # refused or failed: the table as it was
                self._failed(r)
        return out if status >= 0 else self._refused(status, (seq - 1, seq, last), seq.shape[0], "alloc_decode")

    def _refused(
        self, status: int, lens: tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]], total: int, op: str
    ) -> NDArray[np.int32] | None:
        """The result of a batch call its kernel refused: ``None`` when the rank was short, else the error raised."""
        if status != _STATUS_SHORT:
            raise self._batch_error(status, lens, total, op)
        return None

    def _batch_error(
        self, status: int, lens: tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]], total: int, op: str
    ) -> Exception:
        """The error for a failed ``alloc_extend`` / ``alloc_decode`` check, naming the request."""
        prefix, seq, last = lens
        prefix_name = "prefix_lens"
        code, i = _layout.decode_status(status)
        ps = self.page_size
        if code == _layout.E_NEGATIVE:
            return HostPoolError(f"{prefix_name}[{i}] must be non-negative, got {prefix_name}[{i}]={int(prefix[i])}")
        if code == _layout.E_SEQ_BELOW_PREFIX:
            return HostPoolError(
                f"seq_lens[{i}]={int(seq[i])} is below prefix_lens[{i}]={int(prefix[i])}: a request cannot shrink"
            )
        if code == _layout.E_TOTAL:
            return HostPoolError(
                f"extend_num_tokens={total} is not the sum of seq_lens - prefix_lens ({int(np.sum(seq - prefix))})"
            )
        if code == _layout.E_SEQ_BELOW_ONE:
            return HostPoolError(f"seq_lens[{i}] must be at least 1 (it counts the new token), got {int(seq[i])}")
        if code == _layout.E_LAST_LOC:
            if op == "alloc_extend":
                rule = "(last_loc + 1) % page_size == prefix_lens % page_size"
                have = f"prefix_lens[{i}]={int(prefix[i])}"
            else:
                rule = "(last_loc + 2) % page_size == seq_lens % page_size"
                have = f"seq_lens[{i}]={int(seq[i])}"
            return HostPoolError(
                f"debug_mode: request {i}: last_loc[{i}]={int(last[i])} does not continue {have} "
                f"(expected {rule}, page_size={ps})"
            )
        return self._corrupt(op, status)


class TokenToKVPoolAllocator(_RankedAllocator):
    """sglang-jax's token allocator (page size 1): a free list per rank, frees appended.

    Per rank: the free slots ``1..size_per_rank`` in order; ``alloc`` takes
    the first ones, ``free`` appends the given slots at the end, in order.
    Freeing a slot that is not allocated (twice, or never handed out) is a
    :class:`DoubleFreeError`: the original would put it on the list twice.

    Parameters
    ----------
    size : int
        Token slots; ``size_per_rank = size // dp_size``.
    kvcache : object
        Stored and forwarded, as for the paged allocator.
    dp_size : int, optional
        Data-parallel ranks, each an independent allocator. A method's
        ``dp_rank`` names one, in ``[0, dp_size)``; 0 by default.
    strict : bool, optional, keyword-only
        Accepted for symmetry with the paged allocator; a double free is
        always an error here.
    track : bool or None, optional, keyword-only
        Record who holds each page, as for the paged allocator.

    Examples
    --------
    >>> from hostpool_nb import DoubleFreeError
    >>> from hostpool_nb.paged import TokenToKVPoolAllocator
    >>> alloc = TokenToKVPoolAllocator(size=16, kvcache=None)
    >>> slots = alloc.alloc(4)
    >>> slots
    array([1, 2, 3, 4], dtype=int32)
    >>> alloc.free(slots[2:]), alloc.free(slots[:2])  # appended as given
    (2, 2)
    >>> alloc.alloc(16)[-4:]  # after the untouched ones, in the order freed
    array([3, 4, 1, 2], dtype=int32)
    >>> alloc.free(slots[:1]); alloc.free(slots[:1])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hostpool_nb.DoubleFreeError: ...
    """

    _kind = "TokenToKVPoolAllocator"
    _snapshot_kind = "token"
    _sorted = False
    _free_mode = _paged_kernels.FREE_TOKENS  # every slot allocated and named once
    _rank_calls = ("reset_rank", "end_group", "alloc_tokens", "free_slots")
    #: ``None``, as the original's (its base class's page lists, which a token allocator does not keep).
    free_pages: ClassVar[None] = None
    #: ``None``, as the original's (see :attr:`free_pages`).
    release_pages: ClassVar[None] = None

    def __init__(
        self, size: int, kvcache: Any, dp_size: int = 1, *, strict: bool = False, track: bool | None = None
    ) -> None:
        size, _, dp_size = self._shape(size, 1, dp_size)
        if size // dp_size > _INT32_MAX:
            raise HostPoolError(f"{size // dp_size} slots per rank do not fit the int32 arrays alloc returns")
        super().__init__((size, 1, dp_size), size // dp_size, kvcache, strict, track)
        self.origin_size = self.size_per_rank  # the original's: each rank's free slots at construction

    @classmethod
    def _pages_of(cls, size: int, page_size: int, dp_size: int) -> int:
        return size // dp_size

    def _constructor_args(self) -> dict[str, Any]:
        return {"size": self.size, "dp_size": self.dp_size, "strict": self.strict, "track": self.track}

    @property
    def free_slots(self) -> list[NDArray[np.int32]]:
        """Each rank's free slots in allocation order (int32), as read-only copies."""
        with self.lock:
            return [self._window(r, 0, int(st[_layout.H_NFREE] + st[_layout.H_NREL])) for r, st in enumerate(self._st)]

    def _alloc_plain(self, st: Any, need_size: int) -> Any:
        if need_size < 0 or need_size > self.size_per_rank:
            return _CHECK
        out = np.empty(need_size, dtype=np.int32)
        lock = self.lock
        lock.acquire()  # not ``with``: an engine allocates every decode step
        try:
            status: int = self._k.alloc_tokens(st, out, -1)
        finally:
            lock.release()
        return out if status >= 0 else raise_unless_short(self, status)

    def _alloc(self, need_size: int, r: int, tag: Hashable) -> NDArray[np.int32] | None:
        """``alloc`` of slots, as int32."""
        if need_size < 0:
            raise HostPoolError(f"need_size must be non-negative, got need_size={need_size}")
        if need_size > self.size_per_rank:
            return None
        trackers = self._trackers
        where = None if trackers is None else trackers[r].where(tag, 1)  # an unusable tag raises here
        return self._alloc_into(r, np.empty(need_size, dtype=np.int32), where, tag, self._k.alloc_tokens)
