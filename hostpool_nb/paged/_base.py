"""What every device allocator shares: sglang-jax's base class, and the ranks, lock, groups and snapshots of
the paged and token allocators (``_RankedAllocator``)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, ClassVar, TypeVar

import numpy as np
from numpy.typing import NDArray

from .._convert import INT64, STRIDES_1D, as_count, as_slots, pool_shape
from .._core.protocol import ArrayStatePool, Recordable, handed_off, recorded_kind, start_words
from .._diagnostics.invariants import group_problems, rank_problems
from .._diagnostics.snapshot import PagedState, checked_ranks, checked_sites, upgraded_words
from .._diagnostics.tracking import (
    HISTORY_MARK,
    Outstanding,
    Tracker,
    excluded,
    leak_report,
    site_id_problems,
    wanted,
)
from .._errors import DoubleFreeError, HostPoolError, PagedOnlyError, SlotRangeError
from .._kernels import layout as _layout
from .._kernels import paged as _paged_kernels
from .._kernels import pool as _kernels
from .._kernels.jit import Entries

_CORE = Entries(_kernels.POOL)  # the core pool's merge and load: a rank keeps the core layout
# Each allocator reads its kernels from the table their module makes: a rank's, plain and tracked.
_RANK_KERNELS = tuple(Entries(kernels) for kernels in _paged_kernels.KERNELS)
_STATUS_SHORT = _layout.status_of(_layout.E_SHORT)
_AVAIL = _layout.H_AVAIL
_CHECK = object()  # what a fast path returns for a call its checked path must answer (an error, a refusal)
_RANK0 = 0  # the int 0 every 0 is in CPython (its small ints are cached): `dp_rank is _RANK0` takes no bool
_NDARRAY = np.ndarray
_I32 = np.dtype(np.int32)
_Out = TypeVar("_Out", bound=NDArray[Any])  # an allocation's output: int64 slots, or a token allocator's int32
_NONE = np.zeros(0, dtype=np.int64)  # no sites, no copy: an untracked call's empty arrays
_INT32_MAX = 2**31 - 1


def raise_unless_short(pool: ArrayStatePool, status: int) -> NDArray[Any] | None:
    """The result of an ``alloc`` its kernel refused: ``None`` when the rank was short, else the corruption raised.

    Called only on refusal (``out if status >= 0 else raise_unless_short(...)``): a served call pays no call.
    """
    if status != _STATUS_SHORT:
        raise pool._corrupt("alloc", status)
    return None


class BaseTokenToKVPoolAllocator:
    """What every device allocator offers because sglang-jax's base class of this name gives it to its three.

    sglang-jax's allocators derive from its ``BaseTokenToKVPoolAllocator``,
    and callers see its methods on each of them: so do hostpool_nb's
    (``docs/behaviour.md`` section 3 says where they differ). Each
    allocator here defines its own ``free``, ``available_size``, ``clear``,
    free groups and snapshots, and the work of ``alloc`` (``_alloc``); this
    class holds the rest:

    - ``alloc``'s front: a recording's hand-off, the size and rank checked;

    - ``debug_print()``: ``""`` (the sliding-window allocator's says its sizes);
    - ``get_kvcache()``, and ``get_cpu_copy`` / ``load_cpu_copy`` forwarded
      to the ``kvcache``;
    - ``alloc_extend`` / ``alloc_decode``: a :class:`~hostpool_nb.PagedOnlyError`
      (a ``NotImplementedError``, as the original's) on an allocator that
      does not page;
    - ``merge_and_sort_free(dp_rank)``: on an allocator with no release
      list (the token allocator), nothing to merge: the rank is checked
      and nothing changes, where the original's inherited method fails with
      a ``TypeError``.

    Examples
    --------
    >>> from hostpool_nb.paged import BaseTokenToKVPoolAllocator as Base
    >>> from hostpool_nb.paged import TokenToKVPoolAllocator
    >>> alloc = TokenToKVPoolAllocator(16, kvcache=None)
    >>> isinstance(alloc, Base), alloc.debug_print()
    (True, '')
    >>> alloc.merge_and_sort_free()  # nothing to merge here
    """

    _kvcache: Any
    lock: Any
    _recording: Any

    def alloc(self, need_size: Any, dp_rank: Any = 0, *, tag: Hashable = None) -> NDArray[Any] | None:
        """``need_size`` slots from the front of the rank's free list; ``None`` if it has fewer.

        The paged allocator hands out ``need_size // page_size`` whole pages,
        their slots int64, page by page (merging first if short); the token
        allocator slots, int32; the sliding-window allocator as many on both
        sides, mapped, and returns the full slots (int32 at page size 1,
        int64 above), ``None`` if either side is short.

        Parameters
        ----------
        need_size : int
            Slots; not negative, and above page size 1 a multiple of ``page_size``.
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.
        tag : hashable, optional, keyword-only
            A label for the allocation (a request id) that a tracking
            allocator records with its pages; ignored otherwise.

        Returns
        -------
        numpy.ndarray or None
            The slots, or ``None`` when the rank is short (even after
            merging).

        Raises
        ------
        AlignmentError
            When ``need_size`` is not a multiple of ``page_size`` (the
            original's failed assert).
        HostPoolError
            When ``need_size`` is negative or ``dp_rank`` is out of range.
        """
        plain = self._plain.get(dp_rank) if dp_rank.__class__ is int else None
        if plain is not None and need_size.__class__ is int:  # an engine's call: an int on a rank, untracked
            out: NDArray[Any] | None = self._alloc_plain(plain[1], need_size)
            if out is not _CHECK:
                return out
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.alloc(need_size, dp_rank, tag=tag)  # type: ignore[no-any-return]
        if type(need_size) is not int:
            need_size = as_count(need_size, "need_size")
        return self._alloc(need_size, self._rank(dp_rank), tag)

    # A rank's (rank, state, group buffer) by rank, for the calls that take no detour (_RankedAllocator._bind).
    _plain: dict[int, tuple[int, Any, Any]] = {}  # noqa: RUF012 - empty: another kind's calls go the checked way

    def _alloc_plain(self, st: Any, need_size: int) -> Any:
        """``alloc`` of an allocator whose calls take no detour, or :data:`_CHECK`: the checked path says why not."""
        return _CHECK

    def _alloc(self, need_size: int, r: int, tag: Hashable) -> NDArray[Any] | None:
        raise NotImplementedError

    _in_group: bool
    # Per rank, the slots of each free made inside the open group, as validated (free_group).
    _group_frees: list[list[NDArray[np.int64]]]

    @property
    def is_not_in_free_group(self) -> bool:
        """``True`` outside a free group, as the original's attribute."""
        return not self._in_group

    @property
    def free_group(self) -> list[list[NDArray[np.int64]]]:
        """Per rank, the slots of each ``free`` made in the open group, in order, as read-only int64 arrays.

        The original's ``free_group[r]``: ``[]`` on every rank outside a
        group (but for the frees still pending on other ranks after a
        ``clear(r)``, as in the original). A new list each time; the arrays
        hold the slots as ``free`` read and checked them, flattened.
        """
        with self.lock:
            return [list(frees) for frees in self._group_frees]

    def free_group_begin(self) -> None:
        """Defer frees until ``free_group_end()``; each is still checked when made.

        As the original: groups do not nest (a second begin continues the
        group), and the pages freed inside stay allocated until the end.
        """
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.free_group_begin()  # type: ignore[no-any-return]
        # One store, no lock: a free holding the lock sees the group begun or not, as if made before or after.
        self._in_group = True
        return None

    def debug_print(self) -> str:
        """``""``: what sglang-jax's base class prints (its sliding-window allocator's says more)."""
        return ""

    def get_kvcache(self) -> Any:
        """The ``kvcache`` given to the constructor (the SWA allocator's: the hybrid KV pool)."""
        return self._kvcache

    def get_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        """Forwarded to ``kvcache.get_cpu_copy``."""
        return self._kvcache.get_cpu_copy(*args, **kwargs)

    def load_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        """Forwarded to ``kvcache.load_cpu_copy``."""
        return self._kvcache.load_cpu_copy(*args, **kwargs)

    def _paged_only(self, op: str) -> PagedOnlyError:
        return PagedOnlyError(
            f"{op} is only for paged allocator: {type(self).__name__} at page size 1 hands out single slots; "
            "use alloc(n)"
        )

    def alloc_extend(self, *args: Any, **kwargs: Any) -> Any:
        """A paged allocator's call: here a :class:`~hostpool_nb.PagedOnlyError` (a ``NotImplementedError``)."""
        raise self._paged_only("alloc_extend")

    def alloc_decode(self, *args: Any, **kwargs: Any) -> Any:
        """A paged allocator's call: here a :class:`~hostpool_nb.PagedOnlyError` (a ``NotImplementedError``)."""
        raise self._paged_only("alloc_decode")

    def _rank(self, dp_rank: Any) -> int:
        raise NotImplementedError

    def merge_and_sort_free(self, dp_rank: Any = 0) -> None:
        """Nothing to merge on an allocator with no release list; ``dp_rank`` is checked, nothing changes."""
        self._rank(dp_rank)


class _BatchCalls:
    """sglang-jax's batch calls, as its paged and sliding-window allocators take them: one front for both.

    A recording hands another thread's call to the recording; the class's
    ``_extend`` and ``_decode`` do the work.
    """

    _recording: Any

    def alloc_extend(  # noqa: PLR0913 - sglang-jax's arguments, and the tags
        self,
        prefix_lens: Any,
        seq_lens: Any,
        last_loc: Any,
        extend_num_tokens: Any,
        dp_rank: Any = 0,
        *,
        tags: Any = None,
    ) -> NDArray[np.int32] | None:
        """Extend a batch of requests; return their new slots, requests in order (int32).

        Request ``i`` grows from ``prefix_lens[i]`` to ``seq_lens[i]``
        tokens; ``last_loc[i]`` is the slot of its last prefix token (``-1``
        for an empty prefix). Its slots: the rest of its current page, then
        whole new pages, then a partial one; the new pages of the whole
        batch come from the front of the free list as one block (merging
        first if short). ``None`` when the rank is short even after merging.
        The sliding-window allocator extends both sides (page size > 1):
        the SWA side gets the same lengths and ``last_loc`` mapped to its
        slots, each new full slot mapped to its new SWA slot, and the full
        slots are returned; ``None`` if either side is short.

        Parameters
        ----------
        prefix_lens, seq_lens, last_loc : sequence or 1-D array of int
            Per request: its tokens before and after the call, and the slot
            of its last prefix token (``-1`` for none). Lists or arrays of
            any integer dtype; int64 arrays are read without a conversion.
        extend_num_tokens : int
            ``sum(seq_lens - prefix_lens)``: the length of the result.
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.
        tags : sequence of hashable, optional, keyword-only
            One label per request (its id) that a tracking allocator records
            with the request's new pages; ignored otherwise.

        Returns
        -------
        numpy.ndarray or None
            ``extend_num_tokens`` slots (int32), or ``None`` when the rank is
            short even after merging.

        Raises
        ------
        HostPoolError
            For arguments of different lengths, a negative prefix,
            ``seq_lens < prefix_lens``, an ``extend_num_tokens`` other than
            the extensions' sum, and with ``debug_mode`` a ``last_loc`` that
            does not continue its request; the allocator is then unchanged.
        TypeError
            For non-integer arguments.
        """
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens, dp_rank, tags=tags)  # type: ignore[no-any-return]
        return self._extend(prefix_lens, seq_lens, last_loc, extend_num_tokens, dp_rank, tags)

    def alloc_decode(
        self, seq_lens: Any, last_loc: Any, dp_rank: Any = 0, *, tags: Any = None
    ) -> NDArray[np.int32] | None:
        """One new token per request: its slot, a new page's first or ``last_loc + 1`` (int32).

        ``seq_lens`` counts the new token. The new pages come from the front
        of the free list in request order (merging first if short). The
        sliding-window allocator does so on both sides (page size > 1) and
        returns the full slots; ``None`` if either side is short.

        Parameters
        ----------
        seq_lens, last_loc : sequence or 1-D array of int
            Per request: its tokens including the new one, and the slot of
            its last token before it.
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.
        tags : sequence of hashable, optional, keyword-only
            One label per request that a tracking allocator records with
            the request's new page; ignored otherwise.

        Returns
        -------
        numpy.ndarray or None
            One slot per request (int32), or ``None`` when the rank is short
            even after merging.

        Raises
        ------
        HostPoolError
            For arguments of different lengths, ``seq_lens < 1``, and with
            ``debug_mode`` a ``last_loc`` that does not end its request.
        """
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.alloc_decode(seq_lens, last_loc, dp_rank, tags=tags)  # type: ignore[no-any-return]
        return self._decode(seq_lens, last_loc, dp_rank, tags)

    def _extend(  # noqa: PLR0913, PLR0917 - alloc_extend's arguments, passed on as they came
        self, prefix_lens: Any, seq_lens: Any, last_loc: Any, extend_num_tokens: Any, dp_rank: Any, tags: Any
    ) -> NDArray[np.int32] | None:
        raise NotImplementedError

    def _decode(self, seq_lens: Any, last_loc: Any, dp_rank: Any, tags: Any) -> NDArray[np.int32] | None:
        raise NotImplementedError


class _RankedAllocator(BaseTokenToKVPoolAllocator, Recordable, ArrayStatePool):
    """What both allocators share: ranks, the lock, free groups, snapshots, kvcache forwarding.

    Each rank ``r`` has its own state arrays (``_kernels/paged.py``); one
    ``threading.RLock`` (:attr:`lock`) guards every change, and the kernels
    release the GIL while they run.
    """

    _snapshot_kind = ""  # the kind a PagedState names ("paged", "token")
    _sorted = False
    _format = "PagedAllocator"
    _state_class = PagedState

    def __init__(
        self, shape: tuple[int, int, int], pages_per_rank: int, kvcache: Any, strict: bool, track: Any
    ) -> None:
        track = wanted(track)
        size, page_size, dp_size = shape
        self.size = size
        self.page_size = page_size
        self.dp_size = dp_size
        self.size_per_rank = size // dp_size
        self.strict = bool(strict)
        if self._free_mode != _paged_kernels.FREE_TOKENS:
            self._free_mode = _paged_kernels.FREE_PAGED_STRICT if self.strict else _paged_kernels.FREE_PAGED
        self.track = track
        # Per rank, the call sites and tags its tracking words index (track=True), else None.
        self._trackers: list[Tracker] | None = [Tracker() for _ in range(dp_size)] if track else None
        self._kvcache = kvcache
        self._pages = pages_per_rank
        self._k = _RANK_KERNELS[bool(track)]
        self._recording = None  # an instance attribute, as the pool's: every call reads it, faster than the class's
        self._make_lock()
        self._in_group = False
        self._group_frees = [[] for _ in range(dp_size)]
        self._st: list[NDArray[np.int64]] = []
        self._gp: list[NDArray[np.int64]] = []
        for _ in range(dp_size):
            self._st.append(_layout.new_state(pages_per_rank + 1, page_size, self._sorted, track))
            gp = np.zeros(_layout.group_length(pages_per_rank), dtype=np.int64)
            gp[_layout.GP_CAP] = pages_per_rank + 1
            self._gp.append(gp)
        self._bind()
        self.clear()
        self._record_if_asked()

    def _bind(self) -> None:
        """The hot paths' tables, after the ranks' arrays are placed and when a recording begins or ends.

        ``_heads`` maps each rank to a view of its header (``available_size``
        reads one word of it, without the lock); ``_plain`` each rank to
        ``(rank, state, group buffer)`` for ``free``. Both are empty while the
        allocator records, ``_plain`` also when it tracks: a rank missing
        from them sends the call down the checked path, which hands it on.
        The tables are looked up with the caller's ``dp_rank`` as it is, so
        only a valid rank (an ``int`` in ``[0, dp_size)``) finds an entry.
        """
        recording = self._recording is not None
        self._heads: dict[int, memoryview] = {} if recording else {r: _words(st) for r, st in enumerate(self._st)}
        self._head0: memoryview | None = self._heads.get(0)
        plain = not recording and self._trackers is None
        ranks = enumerate(zip(self._st, self._gp, strict=True))
        self._plain = {r: (r, st, gp) for r, (st, gp) in ranks} if plain else {}

    def _recording_changed(self) -> None:
        self._bind()

    @staticmethod
    def _shape(size: Any, page_size: Any, dp_size: Any) -> tuple[int, int, int]:
        size, page_size = pool_shape(size, page_size)
        dp_size = as_count(dp_size, "dp_size")
        if dp_size < 1:
            raise HostPoolError(f"dp_size must be at least 1, got dp_size={dp_size}")
        return size, page_size, dp_size

    # -- ranks and groups ---------------------------------------------------------

    def _rank(self, dp_rank: Any) -> int:
        """``dp_rank`` as an int in ``[0, dp_size)``, or the error naming it."""
        r = dp_rank if type(dp_rank) is int else as_count(dp_rank, "dp_rank")
        if not 0 <= r < self.dp_size:
            raise HostPoolError(f"dp_rank must be in [0, {self.dp_size}), got dp_rank={r}")
        return r

    def free_group_end(self) -> None:
        """Free, per rank, what was freed in the group (one kernel call per rank).

        Outside a group nothing is pending, and nothing happens.
        """
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.free_group_end()  # type: ignore[no-any-return]
        lock = self.lock
        lock.acquire()  # not ``with``: a call every decode step makes
        try:
            self._in_group = False
            if any(self._group_frees):  # a rank's pending pages are those of its frees kept here
                for st, gp, frees in zip(self._st, self._gp, self._group_frees, strict=True):
                    if frees:
                        if gp[_layout.GP_COUNT]:
                            self._k.end_group(st, gp)
                        frees.clear()
        finally:
            lock.release()
        return None

    @handed_off
    def clear(self, dp_rank: Any = None) -> None:
        """Reset the given rank (or every rank) to its initial state, and leave any free group.

        A rank's reset drops its pending frees; other ranks' stay pending
        (their pages allocated) until the next ``free_group_end()``, as in
        the original.

        Parameters
        ----------
        dp_rank : int, optional
            The rank to reset; ``None`` (the default) resets every rank.
        """
        ranks = range(self.dp_size) if dp_rank is None else (self._rank(dp_rank),)
        with self.lock:
            for r in ranks:
                self._k.reset_rank(self._st[r], self._gp[r])
                self._group_frees[r].clear()
            self._in_group = False

    def available_size(self, dp_rank: Any = 0) -> int:
        """Slots an allocation on ``dp_rank`` can use now: free and released pages, in slots.

        One word of the rank's state, which every kernel that changes the
        lists stores last: read without the lock, it is the count as of one
        moment.
        """
        if dp_rank is _RANK0:  # the default rank: an engine calls this thousands of times a run, 100 ns a call
            try:
                return self._head0[20]  # type: ignore[index]  # H_AVAIL, written out: a constant's name costs more
            except TypeError:  # None: the allocator records, the call goes to the recording below
                pass
        head = self._heads.get(dp_rank) if dp_rank.__class__ is int else None
        if head is not None:
            return head[_AVAIL]
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.available_size(dp_rank)  # type: ignore[no-any-return]
        return int(self._st[self._rank(dp_rank)][_AVAIL])

    # -- who holds each page (track=True) ---------------------------------------

    def _site_of(self, r: int, where: Any, tag: Hashable) -> int:
        """The id of ``where`` (a key from ``Tracker.where``) in rank ``r``'s table. Under the lock.

        Begins a call of the tracker's: a tracked call that fails then calls
        :meth:`_failed`, so that it leaves the table as it was.
        """
        tracker = self._trackers[r]  # type: ignore[index]  # a tracking allocator
        tracker.begin()
        return tracker.intern(where, tag, self._st[r])

    def _alloc_into(self, r: int, out: _Out, where: Any, tag: Hashable, kernel: Any, *args: int) -> _Out | None:
        """``alloc`` after its checks: ``kernel(st, out, *args, site)`` on rank ``r``; ``out``, or ``None`` if short.

        ``where`` is the caller's site key (``None`` untracked); a tracked
        call the kernel refuses or fails leaves the site table as it was.
        """
        with self.lock:
            status: int = kernel(self._st[r], out, *args, -1 if where is None else self._site_of(r, where, tag))
            if status < 0 and where is not None:
                self._failed(r)
        if status >= 0:
            return out
        raise_unless_short(self, status)
        return None

    def _failed(self, r: int) -> None:
        """A tracked call on rank ``r`` refused or failed: the sites it added go. Under the lock."""
        if self._trackers is not None:
            self._trackers[r].rollback()

    def _keys(self, r: int, tags: Any, count: int) -> Any:
        """Before the lock: the caller's site key, or one per request with ``tags``; errors for bad tags."""
        tracker = self._trackers[r]  # type: ignore[index]  # a tracking allocator
        return tracker.where(None, 2) if tags is None else tracker.keys(tags, count, 2)

    def _request_sites(self, r: int, keys: Any, tags: Any) -> NDArray[np.int64]:
        """A kernel's site array: one id per request (``tags`` given) or one for all. Under the lock."""
        tracker = self._trackers[r]  # type: ignore[index]  # a tracking allocator
        tracker.begin()
        if tags is None:
            return np.array([tracker.intern(keys, None, self._st[r])], dtype=np.int64)
        return tracker.ids(keys, self._st[r])

    def _unaccounted(self, r: int, exclude: Any) -> NDArray[np.bool_]:
        """Pages of rank ``r`` not to report: the padding page, those pending in a group, ``exclude``'s."""
        skip = excluded(exclude, self._pages + 1, self.page_size, f"rank {r}")
        mask: NDArray[np.bool_] = _layout.group_marks(self._gp[r]) == _layout.MARK_PENDING
        if skip is not None:
            mask |= skip
        mask[0] = True
        return mask

    def outstanding(self, dp_rank: Any = 0, *, exclude: Any = None) -> list[Outstanding]:
        """The rank's pages allocated now, grouped by the call site and tag that allocated them.

        As ``LogicalHostPool.outstanding``: largest groups first (then
        oldest), each record with ``site``, ``tag``, ``pages``, ``slots``,
        ``allocations`` (a request of ``alloc_extend`` / ``alloc_decode``
        that took pages is one) and ``oldest``. Pages pending in a free
        group are freed already and are not listed. O(pages).

        Parameters
        ----------
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.
        exclude : array_like of int, optional, keyword-only
            Slots known to be held legitimately (the radix cache's, the
            running requests'): their pages are left out, so what remains
            is what nobody accounts for.

        Raises
        ------
        HostPoolError
            If the allocator does not track (``track=True``, or
            ``HOSTPOOL_NB_TRACK=1`` when it was built);
            :class:`SlotRangeError` for an ``exclude`` slot beyond the rank.
        """
        r = self._rank(dp_rank)
        trackers = self._trackers
        if trackers is None:
            raise HostPoolError(
                f"outstanding() needs a tracking allocator: construct {type(self).__name__} with track=True "
                "or set HOSTPOOL_NB_TRACK=1 before the engine builds it (leak_report() still says how much is held)"
            )
        with self.lock:
            st = self._st[r]
            owner = _layout.owner_flags(st, self._pages + 1)
            return trackers[r].outstanding(st, owner, self.page_size, self._unaccounted(r, exclude))

    def leak_report(self, dp_rank: Any = 0, *, exclude: Any = None, limit: int = 20) -> str:
        """A readable table of the rank's allocated pages and who allocated them, for logs and leak checks.

        Groups by call site and tag, largest first, at most ``limit`` rows,
        leaving out the pages of ``exclude`` (slots held legitimately) and
        those pending in a free group. Without tracking it gives the totals
        and says how to see the sites.

        Parameters
        ----------
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.
        exclude : array_like of int, optional, keyword-only
            As for :meth:`outstanding`.
        limit : int, optional, keyword-only
            The most rows to show (20 by default).
        """
        r = self._rank(dp_rank)
        limit = as_count(limit, "limit")
        if limit < 0:
            raise HostPoolError(f"limit must be non-negative, got limit={limit}")
        trackers = self._trackers
        with self.lock:  # the totals and the records as of one moment
            st = self._st[r]
            owner = _layout.owner_flags(st, self._pages + 1)
            skip = self._unaccounted(r, exclude)
            pages = int(np.count_nonzero((owner == _layout.OWNER_ALLOCATED) & ~skip))
            records = None if trackers is None else trackers[r].outstanding(st, owner, self.page_size, skip)
        name = f"{type(self).__name__}(size={self.size}, page_size={self.page_size}) rank {r}"
        return leak_report(name, records, pages, self.page_size, limit)

    def _history(self, r: int, page: int) -> str:
        """``"; it was allocated at ..., then freed at ..."`` for a tracking allocator, else nothing. Under the lock."""
        trackers = self._trackers
        if trackers is None or not 1 <= page <= self._pages:
            return ""
        return HISTORY_MARK + trackers[r].history(self._st[r], page)

    # -- snapshots --------------------------------------------------------------

    def _snapshot(self) -> PagedState:
        """Every rank's lists (not the free group, as the original's), as of one moment."""
        ranks = tuple(_layout.persisted(st) for st in self._st)
        sites = None if self._trackers is None else tuple(t.table() for t in self._trackers)
        return PagedState(self._snapshot_kind, self.size, self.page_size, self.dp_size, ranks, sites)

    def _checked(self, state: PagedState) -> tuple[list[NDArray[np.int64]], tuple[Any, ...] | None]:
        mine = (self._snapshot_kind, self.size, self.page_size, self.dp_size)
        theirs = (state.kind, state.size, state.page_size, state.dp_size)
        if mine != theirs:
            raise HostPoolError(f"the state is from {theirs} (kind, size, page_size, dp_size); this is {mine}")
        ranks = checked_ranks(state._ranks, self.dp_size, self._pages, self.page_size, self._sorted, self.track)
        checked_sites(ranks, state.sites, self.track, "the state")
        return ranks, state.sites

    def _load(self, checked: tuple[list[NDArray[np.int64]], tuple[Any, ...] | None]) -> None:
        ranks, sites = checked
        for st, words in zip(self._st, ranks, strict=True):
            _CORE.load_state(st, words, 1)
        if self._trackers is not None and sites is not None:  # the ids restored index these tables
            for tracker, table in zip(self._trackers, sites, strict=True):
                tracker.load(table)

    def _corruption(self) -> str | None:
        trackers = self._trackers
        for r, (st, gp) in enumerate(zip(self._st, self._gp, strict=True)):
            found = rank_problems(st, self._pages, self.page_size, self._sorted)
            found += group_problems(gp, st, self._pages)
            if not found and trackers is not None:
                found = site_id_problems(st, trackers[r].table())
            if found:
                return f"{type(self).__name__} rank {r} is corrupted: " + "; ".join(found)
        return None

    # -- pickling ---------------------------------------------------------------

    def _constructor_args(self) -> dict[str, Any]:
        """What the constructor was given but the ``kvcache``: a pickle rebuilds the allocator with it."""
        raise NotImplementedError

    def _pickled(self) -> dict[str, Any]:
        """The constructor's arguments, the ``kvcache`` (pickled as pickle pickles it), every rank and free group."""
        return {
            "args": self._constructor_args(),
            "kvcache": self._kvcache,
            "ranks": tuple(_layout.persisted(st) for st in self._st),
            "groups": tuple(gp.copy() for gp in self._gp),
            "group_frees": [[f.copy() for f in frees] for frees in self._group_frees],
            "in_group": self._in_group,
            "sites": None if self._trackers is None else tuple(t.table() for t in self._trackers),
        }

    def _upgraded(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A format-1 pickle: each rank's words with one run per page."""
        ranks = saved.get("ranks")
        if not isinstance(ranks, (tuple, list)):
            return saved
        return {**saved, "ranks": tuple(upgraded_words(words) for words in ranks)}

    def _unpickled(self, saved: dict[str, Any], what: str) -> None:
        missing = sorted({"args", "kvcache", "ranks", "groups", "group_frees", "in_group"} - set(saved))
        if missing:
            raise HostPoolError(f"{what} lacks {', '.join(missing)}")
        args = saved["args"]
        if not isinstance(args, dict):
            raise HostPoolError(f"{what} holds constructor arguments of type {type(args).__name__}")
        args = {"track": False, **args}  # formats before 3 could not track: never HOSTPOOL_NB_TRACK's say
        self._declared_fits(args, saved, what)  # before anything is built: a damaged size could ask for terabytes
        try:
            type(self).__init__(self, kvcache=saved["kvcache"], **args)
        except (TypeError, HostPoolError) as exc:  # what the constructor refuses, said as a damaged pickle
            raise HostPoolError(f"{what} has arguments no allocator takes ({args!r}): {exc}") from None
        ranks_in, groups, frees = saved["ranks"], saved["groups"], saved["group_frees"]  # sequences of dp_size: fits
        ranks = checked_ranks(tuple(ranks_in), self.dp_size, self._pages, self.page_size, self._sorted, self.track)
        sites = saved.get("sites")  # absent from the pickles of allocators that could not track
        checked_sites(ranks, sites, self.track, what)
        if type(saved["in_group"]) is not bool:
            raise HostPoolError(f"{what} holds in_group={saved['in_group']!r}, not a bool")
        for r, (st, gp, kept) in enumerate(zip(ranks, groups, frees, strict=True)):  # each gp's words: fits
            found = group_problems(gp, st, self._pages)
            if not found and not _same_pending(gp, kept, self.page_size):
                found = ["the frees it keeps for free_group do not name every page pending"]
            if found:
                raise HostPoolError(f"{what}: the free group of rank {r} fails the invariants: " + "; ".join(found))
        for st in ranks:
            _layout.derive(st)
        self._st = ranks
        self._gp = [np.array(gp, dtype=np.int64, copy=True) for gp in groups]
        self._bind()
        self._group_frees = [[_read_only_copy(f) for f in kept] for kept in frees]
        self._in_group = saved["in_group"]
        if self._trackers is not None:
            for tracker, table in zip(self._trackers, sites, strict=True):  # type: ignore[arg-type]  # checked
                tracker.load(table)

    @classmethod
    def _pages_of(cls, size: int, page_size: int, dp_size: int) -> int:
        """The pages of each rank of an allocator of this shape (``size``, ``page_size`` and ``dp_size`` checked)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        ps, dp = self.page_size, self.dp_size
        unused = self.size - dp * self._pages * ps  # as the original: slots that make no whole page of a rank
        with self.lock:
            available = [int(st[_layout.H_NFREE] + st[_layout.H_NREL]) * ps for st in self._st]
        unit = "slot" if ps == 1 else "page"
        return (
            f"{type(self).__name__}(size={self.size}, page_size={ps}, dp_size={dp}: {self._pages} {unit}s a rank"
            + (f", {unused} slot{'s' * (unused != 1)} of size in no rank's {unit}s" if unused else "")
            + f", available={available if dp > 1 else available[0]}"
            + (", tracking" if self.track else "")
            + ")"
        )

    def _declared_fits(self, args: dict[str, Any], saved: dict[str, Any], what: str) -> None:
        """``HostPoolError`` unless the pickle's ranks and groups are the arrays its arguments declare.

        Only the arguments' shape and the arrays' lengths are read, so a
        damaged ``size`` is refused without building (and allocating) the
        allocator it names.
        """
        try:
            size, page_size, dp = self._shape(args.get("size"), args.get("page_size", 1), args.get("dp_size", 1))
            pages = self._pages_of(size, page_size, dp)
        except (TypeError, HostPoolError) as exc:
            raise HostPoolError(f"{what} has arguments no allocator takes ({args!r}): {exc}") from None
        words = _layout.state_length(pages + 1, args.get("track") is True)
        group = _layout.group_length(pages)
        ranks, groups, frees = saved["ranks"], saved["groups"], saved["group_frees"]
        if not all(isinstance(x, (tuple, list)) for x in (ranks, groups, frees)):
            raise HostPoolError(f"{what} does not hold its ranks, groups and group frees as sequences")
        if len(ranks) != dp:
            raise HostPoolError(f"the state holds {len(ranks)} ranks; this allocator has dp_size={dp}")
        if len(groups) != dp or len(frees) != dp:
            raise HostPoolError(f"{what} holds free groups for {len(groups)} ranks; it has dp_size={dp}")
        for r, (st, gp) in enumerate(zip(ranks, groups, strict=True)):
            if not isinstance(st, np.ndarray):
                raise HostPoolError(f"the state of rank {r} is a {type(st).__name__}, not a rank's state words")
            if st.shape != (words,):
                raise HostPoolError(
                    f"{what} declares size={size}, page_size={page_size}, dp_size={dp} ({pages} pages a rank, "
                    f"{words} state words), but the state of rank {r} has shape {st.shape}"
                )
            if not _is_words(gp) or gp.shape != (group,):
                raise HostPoolError(
                    f"{what}: the free group of rank {r} fails the invariants: its group buffer is not an int64 "
                    f"array of {group} words"
                )

    # -- recording (``pool.recording(path)``, from Recordable) -------------------------

    _recorded: ClassVar[tuple[str, ...]] = (
        "alloc",
        "free",
        "clear",
        "free_group_begin",
        "free_group_end",
        "backup_state",
        "restore_state",
        "available_size",
    )

    def _trace_shape(self) -> dict[str, Any]:
        return {
            "pool": recorded_kind(self),
            "size": self.size,
            "page_size": self.page_size,
            "merge": "sorted" if self._sorted else "fifo",
            "track": self.track,
            "dp_size": self.dp_size,
            "strict": self.strict,
            "debug_mode": bool(getattr(self, "debug_mode", False)),
            "size_swa": 0,
        }

    def _trace_start(self) -> NDArray[np.int64]:
        """Per rank: whether a group is open, its free and release lists, its pending pages in the group's order."""
        depth = int(self._in_group)
        states = []
        for st, gp in zip(self._st, self._gp, strict=True):
            pending = gp[_layout.GP_HEADER : _layout.GP_HEADER + int(gp[_layout.GP_COUNT])].astype(np.int64)
            states.append((depth, *_lists_of(st), pending))
        return start_words(states)

    def _trace_state(self, state: Any) -> NDArray[np.int64] | None:
        """A snapshot's lists as a trace holds them (``start``'s layout), or ``None`` if it is not this kind's."""
        if not isinstance(state, PagedState) or len(state._ranks) != self.dp_size:
            return None
        none = np.empty(0, dtype=np.int64)
        try:
            return start_words([(0, *_lists_of(words), none) for words in state._ranks])
        except (ValueError, IndexError):  # a state restore_state refuses: its record is its error alone
            return None

    # -- views and forwarding ------------------------------------------------------

    def _window(self, r: int, start: int, count: int) -> NDArray[np.int32]:
        view = _layout.listed(self._st[r], start, count)  # a copy
        view.flags.writeable = False
        return view

    # -- freeing -----------------------------------------------------------------

    _free_mode = _paged_kernels.FREE_PAGED  # the kernel's rule for a page it cannot take (set by each allocator)
    # The rank kernels and core kernels (merge, load_state) each kind calls: what warmup.load loads.
    _rank_calls: ClassVar[tuple[str, ...]] = ()
    _core_calls: ClassVar[tuple[str, ...]] = ("load_state",)

    def _kernel_calls(self) -> list[tuple[Any, str]]:
        return [(self._k, name) for name in self._rank_calls] + [(_CORE, name) for name in self._core_calls]

    def free(self, free_index: Any, dp_rank: Any = 0) -> int:
        """Free the pages of ``free_index`` (token slots, any integer dtype and shape); the token allocator its slots.

        The paged allocator frees a page once however many of its slots are
        given, and ignores a page already free (``strict``:
        :class:`DoubleFreeError`); the freed pages go to the release list.
        The token allocator appends the slots to its free list, in order:
        each must be allocated and named once, else a
        :class:`DoubleFreeError`. Inside a free group the pages stay
        allocated until the group ends.

        Parameters
        ----------
        free_index : array_like of int
            Token slots: a list, or an array of any integer dtype and shape.
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.

        Returns
        -------
        int
            The number of pages (slots) freed, or made pending.

        Raises
        ------
        SlotRangeError
            For slots of page 0 (the padding page) or beyond the rank's
            pages, before anything changes.
        """
        plain = self._plain.get(dp_rank) if dp_rank.__class__ is int else None
        if plain is not None and free_index.__class__ is _NDARRAY and free_index.ndim == 1:
            dtype = free_index.dtype
            if dtype is INT64 or dtype is _I32:  # sglang-jax's: a 1-D int32 array, often empty
                if free_index.shape[0] == 0:
                    return 0
                if dtype is INT64 and free_index.strides == STRIDES_1D:  # what the kernel reads
                    return self._freed(plain, free_index, False, None)
                return self._freed(plain, free_index.astype(INT64), True, None)
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.free(free_index, dp_rank)  # type: ignore[no-any-return]
        return self._free(free_index, dp_rank)

    def _free(self, free_index: Any, dp_rank: Any) -> int:
        """``free``'s checked path: any argument it takes, tracking."""
        r = self._rank(dp_rank)
        if type(free_index) is np.ndarray and free_index.dtype is INT64 and free_index.strides == STRIDES_1D:
            slots: NDArray[np.int64] = free_index
        else:
            slots = as_slots(free_index, "free_index")
        if slots.shape[0] == 0:
            return 0
        where = None if self._trackers is None else self._trackers[r].where(None, 2)
        return self._freed((r, self._st[r], self._gp[r]), slots, False, where)

    def _freed(self, rank: tuple[int, Any, Any], slots: NDArray[np.int64], owned: bool, where: Any) -> int:
        """Free ``slots`` (C-contiguous int64) on ``rank``, ``(r, state, group buffer)``: the kernel under the lock.

        ``owned``: ``slots`` is a copy of the caller's, which a group may keep
        as it is; ``where`` the caller's site key (``None``: untracked).
        """
        r, st, gp = rank
        lock = self.lock
        lock.acquire()  # not ``with``, which costs more, on the call every decode step makes
        try:
            in_group = self._in_group
            if in_group and not owned:  # free_group keeps the slots: the kernel reads this copy, the slots kept
                slots = slots.copy()
            site = -1 if where is None else self._site_of(r, where, None)
            # in_group, a bool, is the kernel's 0 or 1 as it is: the entry point reads any int.
            status: int = self._k.free_slots(st, gp, slots, self.page_size, self._free_mode, in_group, site)
            if status < 0:  # refused or failed: the table as it was, the error built under the same hold
                if where is not None:
                    self._failed(r)
                raise self._free_error(status, r)
            if in_group:
                slots.flags.writeable = False
                self._group_frees[r].append(slots)
        finally:
            lock.release()
        return status

    def _free_error(self, status: int, r: int) -> Exception:  # noqa: PLR0911 - one per code
        code, pos = _layout.decode_status(status)
        slot = int(self._gp[r][_layout.GP_FAULT])
        ps = self.page_size
        n = self._pages
        where = f"free_index[{pos}] (flattened)"
        if code == _layout.E_PAGE0:
            return SlotRangeError(f"free got slot {slot} at {where}, in the padding page 0, which is never allocated")
        if code == _layout.E_RANGE:
            return SlotRangeError(
                f"free got slot {slot} at {where}, outside rank {r}'s pages 1..{n} (slots {ps}..{(n + 1) * ps - 1})"
            )
        what = f"slot {slot}" if ps == 1 else f"page {slot // ps} (slots {slot // ps * ps}..{slot // ps * ps + ps - 1})"
        history = self._history(r, slot // ps)
        if code == _layout.E_DUPLICATE:
            if self._in_group:
                return DoubleFreeError(
                    f"{what} of rank {r}, freed at {where}, was already freed in this free group{history}"
                )
            return DoubleFreeError(f"{what} of rank {r} is freed twice in one call (again at {where}){history}")
        if code == _layout.E_NOT_ALLOCATED:
            if _layout.group_marks(self._gp[r])[slot // ps] == _layout.MARK_PENDING:
                return DoubleFreeError(
                    f"{what} of rank {r}, freed at {where}, was freed already in a free group that clear() "
                    f"ended; it is released at the next free_group_end(){history}"
                )
            return DoubleFreeError(
                f"{what} of rank {r}, freed at {where}, is not allocated: it was freed already{history}"
            )
        return RuntimeError(f"{type(self).__name__} rank {r} is corrupted: free kernel failed with code {code}")


def _words(st: NDArray[np.int64]) -> memoryview:
    """A view of ``st`` whose items are Python ints: a read of one costs less than numpy's scalar."""
    return memoryview(st)  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs do not say so


def _lists_of(st: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """A rank's free and release lists (its pending list is empty: a rank's pending pages are its group's)."""
    free, released, _ = _layout.lists_of(st)
    return free, released


def _is_words(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == np.int64 and value.ndim == 1


def _same_pending(gp: NDArray[np.int64], kept: Any, page_size: int) -> bool:
    """Whether the slot arrays ``kept`` (a rank's ``free_group``) name every page pending in ``gp``.

    They may name more: a free of the paged allocator ignores a page already free, and keeps the slots as given.
    """
    if not isinstance(kept, list) or not all(_is_words(f) for f in kept):
        return False
    pending = set(gp[_layout.GP_HEADER : _layout.GP_HEADER + int(gp[_layout.GP_COUNT])].tolist())
    named = {int(slot) // page_size for f in kept for slot in f.tolist()}
    return pending <= named


def _read_only_copy(slots: NDArray[np.int64]) -> NDArray[np.int64]:
    copy = np.array(slots, dtype=np.int64, copy=True)
    copy.flags.writeable = False
    return copy
