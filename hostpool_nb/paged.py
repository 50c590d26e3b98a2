"""Drop-ins for sglang-jax's device KV-cache allocators, on Numba kernels.

``PagedTokenToKVPoolAllocator`` and ``TokenToKVPoolAllocator`` take the
arguments, return the values (with their dtypes) and allocate in the order
of the numpy allocators of sglang-jax (JAX serving), for every call those
handle correctly (``docs/behaviour.md`` section 3), and raise a
:class:`~hostpool_nb.HostPoolError` (a ``ValueError``), before changing
anything, for the calls they get silently wrong: slots of the padding page
0 or beyond the rank, a ``dp_rank`` outside ``[0, dp_size)``, a misaligned
``alloc``, batch arguments of different lengths, negative lengths,
``seq_lens < prefix_lens``, a wrong ``extend_num_tokens``, ``debug_mode``
violations, and a token allocator's double free.

Costs: ``free`` is O(its input), whatever the free list holds (the original
de-duplicates and set-subtracts against the whole free list); a merge is
O(pages) with no comparison sort; ``alloc_extend`` and ``alloc_decode`` are
one kernel call for the whole batch. Lists are accepted wherever the
original takes them; numpy int64 arrays are read without a conversion and
are faster.

Importing this module imports neither torch nor jax; a jax array passed in
is read through ``numpy.asarray``. Use::

    from hostpool_nb.paged import PagedTokenToKVPoolAllocator  # instead of sgl_jax's

Where docs/behaviour.md (section 3) leaves a choice, this module takes the one below (and
``hostpool_nb.originals.paged``, the oracle, the same where it applies):

- Free groups do not nest and ``free_group_end()`` outside one does
  nothing, as the original's flag. A free inside a group is checked at
  the call and fixes then which pages it frees (those allocated at that
  moment); the original evaluates it at the group's end. Both agree unless
  a page that was free at the call is handed out again before the end,
  which the original would then free under its new owner.
- ``clear(r)`` resets rank ``r`` (its pending frees too) and leaves the
  group; other ranks' pending frees stay pending until the next
  ``free_group_end()``. Snapshots hold the lists, not the group.
- ``free`` returns the number of pages freed (the original returns
  ``None``); ``alloc(0)`` returns an empty array; ``free_pages``,
  ``release_pages`` and ``free_slots`` are read-only int32 copies, the
  release list's order not being part of the contract.
- An allocator pickles and deep-copies with every rank, the open free
  group and its pending frees, and its ``kvcache`` (pickled or copied as
  pickle and ``copy.deepcopy`` do, with it); a damaged pickle is a
  ``HostPoolError``, checked as ``restore_state`` checks a snapshot.
- ``alloc_decode`` requires ``seq_lens >= 1`` (they count the new token);
  a pool whose slot ids would not fit the int32 results is refused at
  construction.
- As the original, a ``size`` that is not a whole number of pages for every
  rank leaves the rest unused (``PagedTokenToKVPoolAllocator(size=1000,
  page_size=16, ...)`` serves 62 pages, 992 slots); the allocator's
  ``repr`` says how many slots of ``size`` are in no page. (The host pool,
  whose original refuses such a size, refuses it.)
- The three derive from :class:`BaseTokenToKVPoolAllocator`, as sglang-jax's
  from its base of that name, and offer what it gives them; where the
  original's inherited method fails (``merge_and_sort_free`` on the token
  and sliding-window allocators), it does what its name says.
"""

from __future__ import annotations

from collections.abc import Hashable
from threading import get_ident
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from . import _kernels, _layout, _paged_kernels, _swa_kernels
from ._convert import _INT64_MAX, INT64, STRIDES_1D, as_count, as_int_vector, as_slots, own_slots, pool_shape
from ._errors import AlignmentError, DoubleFreeError, HostPoolError, PagedOnlyError, SlotRangeError
from ._fork import register as _register_fork_lock
from ._host import HostKVPoolMixin, HostPagePool
from ._invariants import group_problems, rank_problems
from ._jit import entry_point
from ._protocol import ArrayStatePool, Recordable, parts, start_words
from ._snapshot import PagedState, SWAState, checked_ranks, checked_sites, upgraded_words
from ._tracking import HISTORY_MARK, Outstanding, Tracker, excluded, leak_report, site_id_problems, wanted

_merge = entry_point(_kernels.merge)
_load_state = entry_point(_kernels.load_state)
_reset_rank = entry_point(_paged_kernels.reset_rank)
_end_group = entry_point(_paged_kernels.end_group)
_free_slots = entry_point(_paged_kernels.free_slots)
_alloc_slots = entry_point(_paged_kernels.alloc_slots)
_alloc_tokens = entry_point(_paged_kernels.alloc_tokens)
_alloc_extend = entry_point(_paged_kernels.alloc_extend)
_alloc_decode = entry_point(_paged_kernels.alloc_decode)
_alloc_slots_tracked = entry_point(_paged_kernels.alloc_slots_tracked)
_alloc_tokens_tracked = entry_point(_paged_kernels.alloc_tokens_tracked)
_alloc_extend_tracked = entry_point(_paged_kernels.alloc_extend_tracked)
_alloc_decode_tracked = entry_point(_paged_kernels.alloc_decode_tracked)
_free_slots_tracked = entry_point(_paged_kernels.free_slots_tracked)
_swa_alloc_tokens = entry_point(_swa_kernels.alloc_tokens)
_swa_alloc_pages = entry_point(_swa_kernels.alloc_pages)
_swa_alloc_extend = entry_point(_swa_kernels.alloc_extend)
_swa_alloc_decode = entry_point(_swa_kernels.alloc_decode)
_swa_free = entry_point(_swa_kernels.free)
_swa_free_swa = entry_point(_swa_kernels.free_swa)
_swa_end_group = entry_point(_swa_kernels.end_group)
_swa_reset = entry_point(_swa_kernels.reset)
_swa_alloc_tokens_tracked = entry_point(_swa_kernels.alloc_tokens_tracked)
_swa_alloc_pages_tracked = entry_point(_swa_kernels.alloc_pages_tracked)
_swa_alloc_extend_tracked = entry_point(_swa_kernels.alloc_extend_tracked)
_swa_alloc_decode_tracked = entry_point(_swa_kernels.alloc_decode_tracked)
_swa_free_tracked = entry_point(_swa_kernels.free_tracked)
_swa_free_swa_tracked = entry_point(_swa_kernels.free_swa_tracked)
_STATUS_SHORT = _layout.status_of(_layout.E_SHORT)
_INT32_MAX = 2**31 - 1


class BaseTokenToKVPoolAllocator:
    """What every device allocator offers because sglang-jax's base class of this name gives it to its three.

    sglang-jax's allocators derive from its ``BaseTokenToKVPoolAllocator``,
    and callers see its methods on each of them: so do hostpool_nb's
    (``docs/behaviour.md`` section 3 says where they differ). Each
    allocator here defines its own ``alloc``, ``free``, ``available_size``,
    ``clear``, free groups and snapshots; this class holds the rest:

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
        if rec is not None and rec.owner != get_ident():
            return rec.free_group_begin()  # type: ignore[no-any-return]
        with self.lock:
            self._in_group = True

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
        """Nothing to merge on an allocator with no release list; ``dp_rank`` is checked, nothing changes.

        Parameters
        ----------
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.
        """
        self._rank(dp_rank)


class _RankedAllocator(BaseTokenToKVPoolAllocator, Recordable, ArrayStatePool):
    """What both allocators share: ranks, the lock, free groups, snapshots, kvcache forwarding.

    Each rank ``r`` has its own state arrays (``_paged_kernels.py``); one
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
        self.track = track
        # Per rank, the call sites and tags its tracking words index (track=True), else None.
        self._trackers: list[Tracker] | None = [Tracker() for _ in range(dp_size)] if track else None
        self._kvcache = kvcache
        self._pages = pages_per_rank
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
        self.clear()
        self._record_if_asked()

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
        if rec is not None and rec.owner != get_ident():
            return rec.free_group_end()  # type: ignore[no-any-return]
        with self.lock:
            self._in_group = False
            for st, gp in zip(self._st, self._gp, strict=True):
                if gp[_layout.GP_COUNT]:
                    _end_group(st, gp)
            for frees in self._group_frees:
                frees.clear()

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
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.clear(dp_rank)  # type: ignore[no-any-return]
        ranks = range(self.dp_size) if dp_rank is None else (self._rank(dp_rank),)
        with self.lock:
            for r in ranks:
                _reset_rank(self._st[r], self._gp[r])
                self._group_frees[r].clear()
            self._in_group = False

    def available_size(self, dp_rank: Any = 0) -> int:
        """Slots an allocation on ``dp_rank`` can use now: free and released pages, in slots.

        Parameters
        ----------
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.
        """
        r = self._rank(dp_rank)
        st = self._st[r]
        with self.lock:
            return int(st[_layout.H_NFREE] + st[_layout.H_NREL]) * self.page_size

    # -- who holds each page (track=True) ---------------------------------------

    def _site_of(self, r: int, where: Any, tag: Hashable) -> int:
        """The id of ``where`` (a key from ``Tracker.where``) in rank ``r``'s table. Under the lock.

        Begins a call of the tracker's: a tracked call that fails then calls
        :meth:`_failed`, so that it leaves the table as it was.
        """
        tracker = self._trackers[r]  # type: ignore[index]  # a tracking allocator
        tracker.begin()
        return tracker.intern(where, tag, self._st[r])

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
        ranks = tuple(st.copy() for st in self._st)
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
            _load_state(st, words)
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
            "ranks": tuple(st.copy() for st in self._st),
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
                found = ["the frees it keeps for free_group are not the pages pending"]
            if found:
                raise HostPoolError(f"{what}: the free group of rank {r} fails the invariants: " + "; ".join(found))
        self._st = ranks
        self._gp = [np.array(gp, dtype=np.int64, copy=True) for gp in groups]
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
    )

    def _trace_shape(self) -> dict[str, Any]:
        return {
            "pool": type(self).__name__,
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

    def _free(self, free_index: Any, dp_rank: Any, mode: int) -> int:
        r = self._rank(dp_rank)
        if type(free_index) is np.ndarray and free_index.dtype is INT64 and free_index.strides == STRIDES_1D:
            slots: NDArray[np.int64] = free_index
        else:
            slots = as_slots(free_index, "free_index")
        if slots.shape[0] == 0:
            return 0
        where = None if self._trackers is None else self._trackers[r].where(None, 2)
        with self.lock:
            in_group = self._in_group
            if in_group:  # free_group keeps the slots: the kernel reads this copy, so they are what it checked
                slots = slots.copy()
            if self._trackers is None:
                status = _free_slots(self._st[r], self._gp[r], slots, self.page_size, mode, int(in_group))
            else:
                site = self._site_of(r, where, None)
                status = _free_slots_tracked(self._st[r], self._gp[r], slots, self.page_size, mode, int(in_group), site)
                if status < 0:  # refused or failed: the table as it was
                    self._failed(r)
            if status < 0:  # built under the same hold, from the value the kernel checked
                raise self._free_error(status, r)
            if in_group:
                slots.flags.writeable = False
                self._group_frees[r].append(slots)
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


def _lists_of(st: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """A rank's free and release lists (its pending list is empty: a rank's pending pages are its group's)."""
    free, released, _ = _layout.lists_of(st)
    return free, released


def _swa_words(depth: int, full: Any, swa: Any, mappings: Any) -> NDArray[np.int64]:
    """A sliding-window allocator's trace words: per rank its full side's lists, its SWA side's, its mapping."""
    none = np.empty(0, dtype=np.int64)
    parts = []
    for f, w, m in zip(full, swa, mappings, strict=True):
        parts.append(start_words([(depth, *_lists_of(f), none), (depth, *_lists_of(w), none)]))
        parts.append(np.asarray(m, dtype=np.int64))
    return np.concatenate(parts)


def _is_words(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == np.int64 and value.ndim == 1


def _same_pending(gp: NDArray[np.int64], kept: Any, page_size: int) -> bool:
    """Whether the slot arrays ``kept`` (a rank's ``free_group``) name exactly the pages pending in ``gp``."""
    if not isinstance(kept, list) or not all(_is_words(f) for f in kept):
        return False
    pending = set(gp[_layout.GP_HEADER : _layout.GP_HEADER + int(gp[_layout.GP_COUNT])].tolist())
    named = {int(slot) // page_size for f in kept for slot in f.tolist()}
    return named == pending


def _read_only_copy(slots: NDArray[np.int64]) -> NDArray[np.int64]:
    copy = np.array(slots, dtype=np.int64, copy=True)
    copy.flags.writeable = False
    return copy


class PagedTokenToKVPoolAllocator(_RankedAllocator):
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
        ``pages_per_rank = num_pages // dp_size`` pages.
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

    def merge_and_sort_free(self, dp_rank: Any = 0) -> None:
        """Merge the rank's release list into its free list, keeping it ascending. O(pages).

        Parameters
        ----------
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.
        """
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.merge_and_sort_free(dp_rank)  # type: ignore[no-any-return]
        r = self._rank(dp_rank)
        with self.lock:
            status = _merge(self._st[r])
        if status < 0:
            raise self._corrupt("merge", status)

    def alloc(self, need_size: Any, dp_rank: Any = 0, *, tag: Hashable = None) -> NDArray[np.int64] | None:
        """``need_size // page_size`` whole pages from the front of the free list, as int64 slots.

        Parameters
        ----------
        need_size : int
            Slots; a non-negative multiple of ``page_size``.
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.
        tag : hashable, optional, keyword-only
            A label for the allocation (a request id) that a tracking
            allocator records with its pages; ignored otherwise.

        Returns
        -------
        numpy.ndarray or None
            The slots of the pages, page by page (int64), or ``None`` when
            the rank is short even after merging.

        Raises
        ------
        AlignmentError
            When ``need_size`` is not a multiple of ``page_size`` (the
            original's failed assert).
        HostPoolError
            When ``need_size`` is negative or ``dp_rank`` is out of range.
        """
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.alloc(need_size, dp_rank, tag=tag)  # type: ignore[no-any-return]
        if type(need_size) is not int:
            need_size = as_count(need_size, "need_size")
        r = self._rank(dp_rank)
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
        out = np.empty(need_size, dtype=np.int64)
        with self.lock:
            if trackers is None:
                status = _alloc_slots(self._st[r], out, ps)
            else:
                status = _alloc_slots_tracked(self._st[r], out, ps, self._site_of(r, where, tag))
                if status < 0:  # refused or failed: the table as it was
                    self._failed(r)
        if status >= 0:
            return out
        if status == _STATUS_SHORT:
            return None
        raise self._corrupt("alloc", status)

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
        if rec is not None and rec.owner != get_ident():
            return rec.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens, dp_rank, tags=tags)  # type: ignore[no-any-return]
        prefix = as_int_vector(prefix_lens, "prefix_lens")
        seq = as_int_vector(seq_lens, "seq_lens")
        last = as_int_vector(last_loc, "last_loc")
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
            if trackers is None:
                status = _alloc_extend(self._st[r], prefix, seq, last, out, tokens, ps, debug)
            else:
                sites = self._request_sites(r, keys, tags)
                status = _alloc_extend_tracked(self._st[r], prefix, seq, last, out, tokens, ps, debug, sites)
                if status < 0:  # refused or failed: the table as it was
                    self._failed(r)
        if status >= 0:
            return out
        if status == _STATUS_SHORT:
            return None
        raise self._batch_error(status, (prefix, seq, last), total, "alloc_extend")

    def alloc_decode(
        self, seq_lens: Any, last_loc: Any, dp_rank: Any = 0, *, tags: Any = None
    ) -> NDArray[np.int32] | None:
        """One new token per request: its slot, a new page's first or ``last_loc + 1`` (int32).

        ``seq_lens`` counts the new token. The new pages come from the front
        of the free list in request order (merging first if short).

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
        if rec is not None and rec.owner != get_ident():
            return rec.alloc_decode(seq_lens, last_loc, dp_rank, tags=tags)  # type: ignore[no-any-return]
        seq = as_int_vector(seq_lens, "seq_lens")
        last = as_int_vector(last_loc, "last_loc")
        r = self._rank(dp_rank)
        if seq.shape[0] != last.shape[0]:
            raise HostPoolError(
                f"seq_lens and last_loc must have the same length, got {seq.shape[0]} and {last.shape[0]}"
            )
        trackers = self._trackers
        keys = None if trackers is None else self._keys(r, tags, seq.shape[0])
        out = np.empty(seq.shape[0], dtype=np.int32)
        ps, debug = self.page_size, int(self.debug_mode)
        with self.lock:
            if trackers is None:
                status = _alloc_decode(self._st[r], seq, last, out, ps, debug)
            else:
                sites = self._request_sites(r, keys, tags)
                status = _alloc_decode_tracked(self._st[r], seq, last, out, ps, debug, sites)
                if status < 0:  # refused or failed: the table as it was
                    self._failed(r)
        if status >= 0:
            return out
        if status == _STATUS_SHORT:
            return None
        raise self._batch_error(status, (seq - 1, seq, last), seq.shape[0], "alloc_decode")

    def free(self, free_index: Any, dp_rank: Any = 0) -> int:
        """Free the pages of ``free_index`` (token slots, any integer dtype and shape).

        A page is freed once however many of its slots are given, and a page
        already free is ignored (``strict``: ``DoubleFreeError``). Inside a
        free group the pages stay allocated until the group ends.

        Parameters
        ----------
        free_index : array_like of int
            Token slots: a list, or an array of any integer dtype and shape.
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.

        Returns
        -------
        int
            The number of pages freed (or made pending).

        Raises
        ------
        SlotRangeError
            For slots of page 0 or beyond the rank's pages, before anything
            changes.
        """
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.free(free_index, dp_rank)  # type: ignore[no-any-return]
        return self._free(
            free_index, dp_rank, _paged_kernels.FREE_PAGED_STRICT if self.strict else _paged_kernels.FREE_PAGED
        )

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
        Data-parallel ranks, each an independent allocator.
    strict : bool, optional, keyword-only
        Accepted for symmetry with the paged allocator; a double free is
        always an error here.
    track : bool or None, optional, keyword-only
        Record who holds each page: the call site (the first frame outside
        hostpool_nb) and tag of the allocation that handed it out, and the
        site that last freed it, for :meth:`outstanding`,
        :meth:`leak_report` and double-free messages (16 bytes of state per
        page). ``None`` (the default): if ``HOSTPOOL_NB_TRACK=1`` is in the
        environment, so tracking is turned on without editing the engine.

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

    def alloc(self, need_size: Any, dp_rank: Any = 0, *, tag: Hashable = None) -> NDArray[np.int32] | None:
        """The first ``need_size`` free slots of the rank (int32), or ``None`` if it has fewer.

        Parameters
        ----------
        need_size : int
            Slots, at least 0.
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.
        tag : hashable, optional, keyword-only
            A label for the allocation that a tracking allocator records
            with its slots; ignored otherwise.
        """
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.alloc(need_size, dp_rank, tag=tag)  # type: ignore[no-any-return]
        if type(need_size) is not int:
            need_size = as_count(need_size, "need_size")
        r = self._rank(dp_rank)
        if need_size < 0:
            raise HostPoolError(f"need_size must be non-negative, got need_size={need_size}")
        if need_size > self.size_per_rank:
            return None
        trackers = self._trackers
        where = None if trackers is None else trackers[r].where(tag, 1)  # an unusable tag raises here
        out = np.empty(need_size, dtype=np.int32)
        with self.lock:
            if trackers is None:
                status = _alloc_tokens(self._st[r], out)
            else:
                status = _alloc_tokens_tracked(self._st[r], out, self._site_of(r, where, tag))
                if status < 0:  # refused or failed: the table as it was
                    self._failed(r)
        if status >= 0:
            return out
        if status == _STATUS_SHORT:
            return None
        raise self._corrupt("alloc", status)

    def free(self, free_index: Any, dp_rank: Any = 0) -> int:
        """Append ``free_index`` (slots, any integer dtype and shape) to the rank's free list.

        Each slot must be allocated and named once: a :class:`DoubleFreeError`
        otherwise, and a :class:`SlotRangeError` for slot 0 (the padding
        slot) or beyond the rank, before anything changes. Inside a free
        group the slots are appended when it ends.

        Parameters
        ----------
        free_index : array_like of int
            Slots: a list, or an array of any integer dtype and shape.
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.

        Returns
        -------
        int
            The number of slots freed (or made pending).
        """
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.free(free_index, dp_rank)  # type: ignore[no-any-return]
        return self._free(free_index, dp_rank, _paged_kernels.FREE_TOKENS)


class SWATokenToKVPoolAllocator(BaseTokenToKVPoolAllocator, Recordable, ArrayStatePool):
    """sglang-jax's sliding-window allocator: a full and an SWA sub-allocator, and the mapping between them.

    For hybrid models that mix full and sliding-window attention: each
    token has a full slot and, while inside the window, an SWA slot.
    ``full_to_swa_index_mapping`` (int32, one array per rank when
    ``dp_size > 1``) gives each full slot's SWA slot, 0 for none; it is the
    same array object for the allocator's life, updated in place (the KV
    pool and the attention backend hold it). Each call is one kernel call
    for both sub-allocators and the mapping.

    As the original (docs/behaviour.md, section 3), for every call it handles: the
    sub-allocators are this module's token allocators at page size 1, else
    paged ones, on ``kvcache.full_kv_pool`` and ``kvcache.swa_kv_pool``;
    ``alloc`` checks both sides first; ``alloc_extend`` and
    ``alloc_decode`` allocate on both, the SWA side with the mapped
    ``last_loc``; ``free`` frees the full slots and their SWA slots;
    ``free_swa`` frees only the SWA slots (tokens that left the window).
    Above page size 1 both free whole pages while the mapping is per slot:
    the entries of a freed page's other slots stay, as in the original.
    Unlike the original: a full slot freed twice at page size 1, slots
    outside the ranks and batch arguments of different lengths are a
    :class:`HostPoolError` raised before anything changes; an
    ``alloc_extend`` or ``alloc_decode`` the SWA side cannot serve is
    refused without taking (and freeing again) the full side's pages;
    ``backup_state`` / ``restore_state`` work (the original raises
    ``NotImplementedError``). It does not pickle: the mapping's identity is
    what the KV pool and the backend rely on, and a copy would silently
    leave them reading a mapping no allocator updates.

    Parameters
    ----------
    size, size_swa : int
        Full and SWA token slots.
    kvcache : object
        The hybrid KV pool: ``full_kv_pool`` and ``swa_kv_pool`` are given
        to the sub-allocators, and ``full_to_swa_index_mapping`` is set to
        the mapping.
    page_size : int, optional
        Slots per page (1: token allocators).
    dp_size : int, optional
        Data-parallel ranks.
    track : bool or None, optional, keyword-only
        Build both sub-allocators tracking: each side's pages know the call
        site and tag that allocated them (``tag=`` on :meth:`alloc`,
        ``tags=`` on the batch calls) and the site that last freed them.
        :meth:`outstanding` is the full side's (the SWA side's is
        ``swa_attn_allocator.outstanding()``), :meth:`leak_report` both
        sides', and a double free names both sites. ``None`` (the default):
        if ``HOSTPOOL_NB_TRACK=1`` is in the environment.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> from hostpool_nb.paged import SWATokenToKVPoolAllocator
    >>> kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    >>> a = SWATokenToKVPoolAllocator(size=64, size_swa=16, kvcache=kv)
    >>> full = a.alloc(3)
    >>> full, a.full_to_swa_index_mapping[full]
    (array([1, 2, 3], dtype=int32), array([1, 2, 3], dtype=int32))
    >>> a.free_swa(full[:1]), a.count_swa_mapped(full)  # the first left the window
    (1, 2)
    >>> a.free(full), a.available_size()
    (3, 16)
    """

    _kind = "SWATokenToKVPoolAllocator"
    _state_class = SWAState
    #: ``None``, as the original's (its base class's page lists, which the sub-allocators keep instead).
    free_pages: ClassVar[None] = None
    #: ``None``, as the original's (see :attr:`free_pages`).
    release_pages: ClassVar[None] = None

    def __init__(  # noqa: PLR0913 - sglang-jax's constructor, and track
        self, size: int, size_swa: int, kvcache: Any, page_size: int = 1, dp_size: int = 1, *, track: Any = None
    ) -> None:
        page_size = as_count(page_size, "page_size")
        track = wanted(track)
        full_pool, swa_pool = kvcache.full_kv_pool, kvcache.swa_kv_pool
        sub: Any
        with parts():  # the sides are this allocator's: HOSTPOOL_NB_RECORD records it, not them
            if page_size == 1:
                self.full_attn_allocator: Any = TokenToKVPoolAllocator(size, full_pool, dp_size=dp_size, track=track)
                sub = TokenToKVPoolAllocator(size_swa, swa_pool, dp_size=dp_size, track=track)
                self._modes = (_paged_kernels.FREE_TOKENS, _paged_kernels.FREE_TOKENS)
            else:
                self.full_attn_allocator = PagedTokenToKVPoolAllocator(
                    size, page_size, full_pool, dp_size=dp_size, track=track
                )
                sub = PagedTokenToKVPoolAllocator(size_swa, page_size, swa_pool, dp_size=dp_size, track=track)
                self._modes = (_paged_kernels.FREE_PAGED, _paged_kernels.FREE_PAGED)
        self.swa_attn_allocator: Any = sub
        self.track = track
        self.page_size = page_size
        self.dp_size = self.full_attn_allocator.dp_size
        self.size = self.full_attn_allocator.size  # the original's base class sets these two from the full side
        self.size_per_rank = self.full_attn_allocator.size_per_rank
        self._kvcache = kvcache
        self.lock = self.full_attn_allocator.lock  # one lock for the three: each call holds both sides
        sub.lock = self.lock
        _register_fork_lock(self)
        length = self.full_attn_allocator.size_per_rank + page_size
        self._maps = [np.zeros(length, dtype=np.int32) for _ in range(self.dp_size)]
        self.full_to_swa_index_mapping: Any = self._maps[0] if self.dp_size == 1 else self._maps
        kvcache.full_to_swa_index_mapping = self.full_to_swa_index_mapping
        self._in_group = False
        self._group_frees = [[] for _ in range(self.dp_size)]
        self._scratch = np.zeros(max(64, page_size), dtype=np.int64)
        self._record_if_asked()

    # -- attributes and sizes --------------------------------------------------------

    @property
    def size_full(self) -> int:
        """The full sub-allocator's slots."""
        return int(self.full_attn_allocator.size)

    @property
    def size_swa(self) -> int:
        """The SWA sub-allocator's slots."""
        return int(self.swa_attn_allocator.size)

    def full_available_size(self, dp_rank: Any = 0) -> int:
        """The full sub-allocator's ``available_size(dp_rank)``."""
        return int(self.full_attn_allocator.available_size(dp_rank))

    def swa_available_size(self, dp_rank: Any = 0) -> int:
        """The SWA sub-allocator's ``available_size(dp_rank)``."""
        return int(self.swa_attn_allocator.available_size(dp_rank))

    def available_size(self, dp_rank: Any = 0) -> int:
        """The smaller of the two sub-allocators' available sizes."""
        with self.lock:
            return min(self.full_available_size(dp_rank), self.swa_available_size(dp_rank))

    def merge_and_sort_free(self, dp_rank: Any = 0) -> None:
        """Merge each side's release list into its free list (page size > 1; at page size 1 nothing to merge).

        The original inherits its base class's method, which fails here with
        a ``TypeError`` (it keeps no lists of its own); the engine never
        calls it. This does what the name says, on both sub-allocators, in
        one hold of the lock.

        Parameters
        ----------
        dp_rank : int, optional
            The data-parallel rank, in ``[0, dp_size)``; 0 by default.
        """
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.merge_and_sort_free(dp_rank)  # type: ignore[no-any-return]
        r = self._rank(dp_rank)
        with self.lock:
            self.full_attn_allocator.merge_and_sort_free(r)
            self.swa_attn_allocator.merge_and_sort_free(r)

    def debug_print(self, dp_rank: Any = 0) -> str:
        """``"#swa-available-size: S, #full-attn-available-size: F, "``, as the original's."""
        with self.lock:
            swa, full = self.swa_available_size(dp_rank), self.full_available_size(dp_rank)
        return f"#swa-available-size: {swa}, #full-attn-available-size: {full}, "

    def _rank(self, dp_rank: Any) -> int:
        return int(self.full_attn_allocator._rank(dp_rank))

    def _states(self, r: int) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        full, swa = self.full_attn_allocator, self.swa_attn_allocator
        return full._st[r], full._gp[r], swa._st[r], swa._gp[r]

    def _scratch_for(self, n: int) -> NDArray[np.int64]:
        """The int64 buffer the kernels stage in, at least ``n`` long (grown, never per call). Under the lock."""
        if self._scratch.shape[0] < n:
            self._scratch = np.zeros(max(n, 2 * self._scratch.shape[0]), dtype=np.int64)
        return self._scratch

    # -- who holds each page (track=True): each side's own tracking, from the same call sites -------

    def _where(self, r: int, tag: Hashable) -> Any:
        """Before the lock: the caller's site key with ``tag`` (``None`` untracked); a bad tag raises."""
        trackers = self.full_attn_allocator._trackers
        return None if trackers is None else trackers[r].where(tag, 2)

    def _sites(self, r: int, where: Any, tag: Hashable) -> tuple[int, int]:
        """Under the lock: the site's id on each side (each call that fails then calls :meth:`_failed`)."""
        return self.full_attn_allocator._site_of(r, where, tag), self.swa_attn_allocator._site_of(r, where, tag)

    def _batch_keys(self, r: int, tags: Any, n: int) -> Any:
        """Before the lock: each side's keys for a batch's ``tags`` (``None`` untracked); bad tags raise."""
        if self.full_attn_allocator._trackers is None:
            return None
        return self.full_attn_allocator._keys(r, tags, n), self.swa_attn_allocator._keys(r, tags, n)

    def _batch_sites(self, r: int, keys: Any, tags: Any) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        full, swa = self.full_attn_allocator, self.swa_attn_allocator
        return full._request_sites(r, keys[0], tags), swa._request_sites(r, keys[1], tags)

    def _failed(self, r: int) -> None:
        """A tracked call on rank ``r`` refused or failed: both sides' tables as they were."""
        self.full_attn_allocator._failed(r)
        self.swa_attn_allocator._failed(r)

    def outstanding(self, dp_rank: Any = 0, *, exclude: Any = None) -> list[Outstanding]:
        """What the full side holds on ``dp_rank``, by call site and tag (``track=True``).

        As :meth:`PagedTokenToKVPoolAllocator.outstanding` of
        :attr:`full_attn_allocator`; :attr:`swa_attn_allocator`'s
        ``outstanding`` gives the SWA side's.
        """
        return list(self.full_attn_allocator.outstanding(dp_rank, exclude=exclude))

    def leak_report(self, dp_rank: Any = 0, *, exclude: Any = None, limit: int = 20) -> str:
        """Both sides' leak reports: the full slots not in ``exclude``, then the SWA slots not mapped from them.

        ``exclude`` (full slots held legitimately, such as the radix
        cache's) leaves out those full slots and the SWA slots they map to.
        """
        r = self._rank(dp_rank)
        full = self.full_attn_allocator.leak_report(r, exclude=exclude, limit=limit)
        swa_exclude = None
        if exclude is not None:
            held = own_slots(exclude, "exclude")  # checked, then indexed: read once
            mapping = self._maps[r]
            inside = held[(held >= 0) & (held < mapping.shape[0])]
            with self.lock:
                mapped = mapping[inside]
            swa_exclude = mapped[mapped > 0].astype(np.int64)
        swa = self.swa_attn_allocator.leak_report(r, exclude=swa_exclude, limit=limit)
        return f"full side: {full}\nSWA side: {swa}"

    # -- allocation -----------------------------------------------------------------------

    def alloc(self, need_size: Any, dp_rank: Any = 0, *, tag: Hashable = None) -> NDArray[Any] | None:
        """``need_size`` full slots and as many SWA slots, mapped; ``None`` if either side has fewer available.

        Returns the full slots: int32 at page size 1, int64 (whole pages)
        above, as the sub-allocators' ``alloc``. ``tag`` (keyword-only): a
        label a tracking allocator records with both sides' pages.
        """
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.alloc(need_size, dp_rank, tag=tag)  # type: ignore[no-any-return]
        if type(need_size) is not int:
            need_size = as_count(need_size, "need_size")
        r = self._rank(dp_rank)
        ps = self.page_size
        if need_size < 0:
            raise HostPoolError(f"need_size must be non-negative, got need_size={need_size}")
        if need_size % ps != 0:
            raise AlignmentError(f"alloc must be page-aligned, got need_size={need_size}, page_size={ps}")
        if need_size > self.full_attn_allocator.size_per_rank + ps:
            return None  # more than a rank holds: refused before anything is allocated
        dtype = np.int32 if ps == 1 else np.int64
        where = self._where(r, tag)  # an unusable tag raises here
        out, swa = np.empty(need_size, dtype=dtype), np.empty(need_size, dtype=dtype)
        stf, _, sts, _ = self._states(r)
        with self.lock:
            if where is None:
                status = (
                    _swa_alloc_tokens(stf, sts, self._maps[r], out, swa)
                    if ps == 1
                    else _swa_alloc_pages(stf, sts, self._maps[r], out, swa, ps)
                )
            else:
                sf, ss = self._sites(r, where, tag)
                status = (
                    _swa_alloc_tokens_tracked(stf, sts, self._maps[r], out, swa, sf, ss)
                    if ps == 1
                    else _swa_alloc_pages_tracked(stf, sts, self._maps[r], out, swa, ps, sf, ss)
                )
                if status < 0:
                    self._failed(r)
        if status >= 0:
            return out
        if status == _STATUS_SHORT:
            return None
        raise self._corrupt("alloc", status)

    def _batch_args(self, lens: tuple[Any, ...], names: tuple[str, ...]) -> tuple[NDArray[np.int64], ...]:
        arrays = tuple(as_int_vector(v, name) for v, name in zip(lens, names, strict=True))
        if len({a.shape[0] for a in arrays}) != 1:
            got = ", ".join(str(a.shape[0]) for a in arrays)
            raise HostPoolError(f"{', '.join(names[:-1])} and {names[-1]} must have the same length, got {got}")
        return arrays

    def _needs_pages(self, op: str) -> None:
        if self.page_size == 1:
            raise self._paged_only(op)  # as the original's token sub-allocators raise

    def _last_error(self, status: int, last: NDArray[np.int64], r: int) -> Exception | None:
        code, i = _layout.decode_status(status)
        if code != _layout.E_RANGE:
            return None
        return SlotRangeError(
            f"last_loc[{i}]={int(last[i])} is outside rank {r}'s full slots (-1, or 0..{self._maps[r].shape[0] - 1})"
        )

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
        """Extend a batch on both sides (page size > 1); the full slots (int32), or ``None`` if a side is short.

        As ``PagedTokenToKVPoolAllocator.alloc_extend`` on the full side;
        the SWA side gets the same lengths and ``last_loc`` mapped to SWA
        slots. Each new full slot is mapped to its new SWA slot. ``tags``
        (keyword-only): one label per request, for a tracking allocator.
        """
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens, dp_rank, tags=tags)  # type: ignore[no-any-return]
        self._needs_pages("alloc_extend")
        prefix, seq, last = self._batch_args((prefix_lens, seq_lens, last_loc), ("prefix_lens", "seq_lens", "last_loc"))
        total = as_count(extend_num_tokens, "extend_num_tokens")
        r = self._rank(dp_rank)
        if total < 0:
            raise HostPoolError(f"extend_num_tokens must be non-negative, got extend_num_tokens={total}")
        ps = self.page_size
        fits = total <= (self.full_attn_allocator._pages + prefix.shape[0]) * ps
        keys = self._batch_keys(r, tags, prefix.shape[0])
        out = np.empty(total if fits else 0, dtype=np.int32)
        swa = np.empty(out.shape[0], dtype=np.int32)
        stf, _, sts, _ = self._states(r)
        mp = self._maps[r]
        with self.lock:
            scratch = self._scratch_for(prefix.shape[0])
            tokens = min(total, _INT64_MAX)
            if keys is None:
                status = _swa_alloc_extend(stf, sts, mp, prefix, seq, last, out, swa, scratch, tokens, ps)
            else:
                sf, ss = self._batch_sites(r, keys, tags)
                status = _swa_alloc_extend_tracked(
                    stf, sts, mp, prefix, seq, last, out, swa, scratch, tokens, ps, sf, ss
                )
                if status < 0:
                    self._failed(r)
        if status >= 0:
            return out
        if status == _STATUS_SHORT:
            return None
        error = self._last_error(status, last, r)
        raise error or self.full_attn_allocator._batch_error(status, (prefix, seq, last), total, "alloc_extend")

    def alloc_decode(
        self, seq_lens: Any, last_loc: Any, dp_rank: Any = 0, *, tags: Any = None
    ) -> NDArray[np.int32] | None:
        """One new token per request on both sides (page size > 1); the full slots (int32), or ``None``.

        ``tags`` (keyword-only): one label per request, for a tracking allocator.
        """
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.alloc_decode(seq_lens, last_loc, dp_rank, tags=tags)  # type: ignore[no-any-return]
        self._needs_pages("alloc_decode")
        seq, last = self._batch_args((seq_lens, last_loc), ("seq_lens", "last_loc"))
        r = self._rank(dp_rank)
        keys = self._batch_keys(r, tags, seq.shape[0])
        out, swa = np.empty(seq.shape[0], dtype=np.int32), np.empty(seq.shape[0], dtype=np.int32)
        stf, _, sts, _ = self._states(r)
        mp, ps = self._maps[r], self.page_size
        with self.lock:
            scratch = self._scratch_for(seq.shape[0])
            if keys is None:
                status = _swa_alloc_decode(stf, sts, mp, seq, last, out, swa, scratch, ps)
            else:
                sf, ss = self._batch_sites(r, keys, tags)
                status = _swa_alloc_decode_tracked(stf, sts, mp, seq, last, out, swa, scratch, ps, sf, ss)
                if status < 0:
                    self._failed(r)
        if status >= 0:
            return out
        if status == _STATUS_SHORT:
            return None
        error = self._last_error(status, last, r)
        raise error or self.full_attn_allocator._batch_error(status, (seq - 1, seq, last), seq.shape[0], "alloc_decode")

    # -- freeing ----------------------------------------------------------------------------

    def free(self, free_index: Any, dp_rank: Any = 0) -> int:
        """Free full slots and their SWA slots; in a free group, when it ends (checked now).

        Returns what the full sub-allocator's ``free`` returns (slots at
        page size 1, pages above). Page size 1: a slot not allocated is a
        :class:`DoubleFreeError`; slots outside the rank a
        :class:`SlotRangeError`; before anything changes.
        """
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.free(free_index, dp_rank)  # type: ignore[no-any-return]
        r = self._rank(dp_rank)
        slots = as_slots(free_index, "free_index")
        if slots.shape[0] == 0:
            return 0
        full_mode, swa_mode = self._modes
        stf, gpf, sts, gps = self._states(r)
        where = self._where(r, None)
        mp, ps = self._maps[r], self.page_size
        with self.lock:
            in_group = self._in_group
            # One read of the caller's array, into a copy of ours: both sides work from it (and a free group keeps
            # it for its end), so a thread writing the caller's array meanwhile cannot make the SWA side index an
            # unchecked slot. A copy here costs a memcpy; one in the kernel cost a loop LLVM could not vectorise.
            slots = slots.copy()
            scratch = self._scratch_for(slots.shape[0])
            if where is None:
                status = _swa_free(stf, gpf, sts, gps, mp, slots, scratch, ps, full_mode, swa_mode, int(in_group))
            else:
                sf, ss = self._sites(r, where, None)
                status = _swa_free_tracked(
                    stf, gpf, sts, gps, mp, slots, scratch, ps, full_mode, swa_mode, int(in_group), sf, ss
                )
                if status < 0:
                    self._failed(r)
            if status < 0:
                raise self._free_failed(status, r)
            if in_group:
                slots.flags.writeable = False
                self._group_frees[r].append(slots)
        return int(status)

    def _free_failed(self, status: int, r: int) -> Exception:
        code, _ = _layout.decode_status(status)
        if code == _layout.E_CORRUPT:
            return self._corrupt("free", status)
        full = self.full_attn_allocator
        outside, full._in_group = full._in_group, self._in_group  # the group is this allocator's: say so
        try:
            error: Exception = full._free_error(status, r)
        finally:
            full._in_group = outside
        return error

    def free_swa(self, free_index: Any, dp_rank: Any = 0) -> int:
        """Free the SWA slots of full slots (tokens that left the window); the full slots stay. How many went."""
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.free_swa(free_index, dp_rank)  # type: ignore[no-any-return]
        r = self._rank(dp_rank)
        slots = as_slots(free_index, "free_index")
        _, _, sts, gps = self._states(r)
        where = self._where(r, None)
        mp, ps, mode = self._maps[r], self.page_size, self._modes[1]
        n = slots.shape[0]
        with self.lock:
            scratch = self._scratch_for(2 * n)  # the kernel reads the slots once, into scratch[n:2n]
            if where is None:
                status = _swa_free_swa(sts, gps, mp, slots, scratch, ps, mode)
            else:
                site = self.swa_attn_allocator._site_of(r, where, None)
                status = _swa_free_swa_tracked(sts, gps, mp, slots, scratch, ps, mode, site)
                if status < 0:
                    self.swa_attn_allocator._failed(r)
            if status >= 0:
                return int(status)
            code, i = _layout.decode_status(status)
            if code == _layout.E_RANGE:  # the slot the kernel read and refused, not the caller's array again
                raise SlotRangeError(
                    f"free_swa got slot {int(scratch[n + i])} at free_index[{i}] (flattened), outside rank {r}'s "
                    f"full slots 0..{self._maps[r].shape[0] - 1}"
                )
        raise self._corrupt("free_swa", status)

    def count_swa_mapped(self, indices: Any, dp_rank: Any = 0) -> int:
        """How many of the full slots ``indices`` have an SWA slot."""
        r = self._rank(dp_rank)
        slots = own_slots(indices, "indices")  # checked, then indexed: read once
        mapping = self._maps[r]
        bad = (slots < 0) | (slots >= mapping.shape[0])
        if bad.any():
            i = int(np.argmax(bad))
            raise SlotRangeError(
                f"count_swa_mapped got slot {int(slots[i])} at indices[{i}] (flattened), outside rank {r}'s "
                f"full slots 0..{mapping.shape[0] - 1}"
            )
        with self.lock:
            return int(np.count_nonzero(mapping[slots]))

    # -- groups, clear ----------------------------------------------------------------------

    def free_group_end(self) -> None:
        """Free, per rank, the group's frees as one: the full slots, then their SWA slots."""
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.free_group_end()  # type: ignore[no-any-return]
        wheres = [self._where(r, None) for r in range(self.dp_size)]
        with self.lock:
            self._in_group = False
            for r, frees in enumerate(self._group_frees):
                if not frees:
                    continue
                slots = np.concatenate(frees)
                stf, gpf, sts, gps = self._states(r)
                site = -1 if wheres[r] is None else self.swa_attn_allocator._site_of(r, wheres[r], None)
                status = _swa_end_group(
                    stf,
                    gpf,
                    sts,
                    gps,
                    self._maps[r],
                    slots,
                    self._scratch_for(slots.shape[0]),
                    self.page_size,
                    self._modes[1],
                    site,
                )
                frees.clear()
                if status < 0:
                    raise self._corrupt("free_group_end", status)

    def clear(self, dp_rank: Any = None) -> None:
        """Reset both sides of the rank (or every rank), zero its mapping, drop its pending frees, leave the group."""
        rec = self._recording
        if rec is not None and rec.owner != get_ident():
            return rec.clear(dp_rank)  # type: ignore[no-any-return]
        ranks = range(self.dp_size) if dp_rank is None else (self._rank(dp_rank),)
        with self.lock:
            for r in ranks:
                _swa_reset(*self._states(r), self._maps[r])
                self._group_frees[r].clear()
            self._in_group = False

    # -- recording (``pool.recording(path)``, from Recordable) -------------------------------

    _recorded = (*_RankedAllocator._recorded, "alloc_extend", "alloc_decode", "merge_and_sort_free", "free_swa")

    def _trace_shape(self) -> dict[str, Any]:
        return {
            **self.full_attn_allocator._trace_shape(),
            "pool": type(self).__name__,
            "size_swa": self.size_swa,
        }

    def _trace_start(self) -> NDArray[np.int64]:
        """Per rank: the full side's state, the SWA side's, the mapping. Under the lock.

        A free pending in a group is refused: the group's end frees the SWA
        slots of exactly the slots freed, which a trace's pages do not say.
        """
        if any(self._group_frees) or any(gp[_layout.GP_COUNT] for gp in self.full_attn_allocator._gp):
            raise HostPoolError(
                "an SWATokenToKVPoolAllocator records from a state with no frees pending in a free group: "
                "start the recording before the group's frees, or after free_group_end()"
            )
        full, swa = self.full_attn_allocator._st, self.swa_attn_allocator._st
        return _swa_words(int(self._in_group), full, swa, self._maps)

    def _trace_state(self, state: Any) -> NDArray[np.int64] | None:
        """A snapshot's lists and mappings in ``start``'s layout, or ``None`` if it is not one of this shape."""
        dp = self.dp_size
        if (
            not isinstance(state, SWAState)
            or not len(state._mappings) == len(state.full._ranks) == len(state.swa._ranks) == dp
        ):
            return None
        try:
            return _swa_words(0, state.full._ranks, state.swa._ranks, state._mappings)
        except (ValueError, IndexError):  # a state restore_state refuses: its record is its error alone
            return None

    # -- snapshots, invariants ------------------------------------------------------------

    def _snapshot(self) -> SWAState:
        return SWAState(
            self.full_attn_allocator._snapshot(),
            self.swa_attn_allocator._snapshot(),
            tuple(m.copy() for m in self._maps),
        )

    def _checked(self, state: SWAState) -> tuple[Any, Any, list[NDArray[np.int32]]]:
        if type(state) is not SWAState:
            raise TypeError(f"restore_state needs an SWAState from backup_state(), got {type(state).__name__}")
        full = self.full_attn_allocator._checked(state.full)
        swa = self.swa_attn_allocator._checked(state.swa)
        maps = list(state._mappings)
        if len(maps) != self.dp_size:
            raise HostPoolError(f"the state holds {len(maps)} mappings; this allocator has dp_size={self.dp_size}")
        for r, m in enumerate(maps):
            found = self._mapping_problems(m, full[0][r], swa[0][r])
            if found:
                raise HostPoolError(f"the state's mapping of rank {r} fails the invariants: {found}")
        return full, swa, maps

    def _load(self, checked: tuple[Any, Any, list[NDArray[np.int32]]]) -> None:
        full, swa, maps = checked
        self.full_attn_allocator._load(full)
        self.swa_attn_allocator._load(swa)
        for mine, saved in zip(self._maps, maps, strict=True):
            mine[:] = saved  # in place: the KV pool and the backend hold these arrays

    def _mapping_problems(  # noqa: PLR0911 - one return per way a mapping can be wrong
        self, m: NDArray[np.int32], full: NDArray[np.int64], swa: NDArray[np.int64]
    ) -> str | None:
        """Why ``m`` is not a mapping between the ranks' states ``full`` and ``swa``; ``None`` if it is one."""
        ps = self.page_size
        if m.shape != self._maps[0].shape:
            return f"it has {m.shape[0]} entries, expected {self._maps[0].shape[0]}"
        mapped = np.flatnonzero(m)
        values = m[mapped].astype(np.int64)
        swa_pages = int(swa[_layout.H_NPAGES])
        if values.size and (values.min() < 1 or values.max() >= swa_pages * ps):
            return "an SWA slot is outside the SWA rank"
        if ps > 1:
            # Frees act on whole pages, the mapping on the slots named (as the
            # original's): entries of a page's other slots may outlive it, and a
            # request whose last SWA slot went continues from slot 0's page.
            return None
        if np.unique(values).size != values.size:
            return "two full slots map to one SWA slot"
        full_owner = _layout.owner_flags(full, int(full[_layout.H_NPAGES]))
        if mapped.size and (
            mapped.max() >= full_owner.shape[0] * ps or (full_owner[mapped // ps] != _layout.OWNER_ALLOCATED).any()
        ):
            return "a full slot that is not allocated has an SWA slot"
        swa_owner = _layout.owner_flags(swa, swa_pages)
        if values.size and (swa_owner[values // ps] != _layout.OWNER_ALLOCATED).any():
            return "a mapped SWA slot is not allocated"
        return None

    def _corruption(self) -> str | None:
        for sub in (self.full_attn_allocator, self.swa_attn_allocator):
            found: str | None = sub._corruption()
            if found is not None:
                return found
        for r, m in enumerate(self._maps):
            problem = self._mapping_problems(m, self.full_attn_allocator._st[r], self.swa_attn_allocator._st[r])
            if problem is not None:
                return f"{self._kind} rank {r} is corrupted: its mapping: {problem}"
        return None

    def __repr__(self) -> str:
        dp = self.dp_size
        sides = [
            (name, [sub.available_size(r) for r in range(dp)])
            for name, sub in (("full", self.full_attn_allocator), ("swa", self.swa_attn_allocator))
        ]
        with self.lock:
            said = ", ".join(f"available_{name}={got if dp > 1 else got[0]}" for name, got in sides)
        return (
            f"SWATokenToKVPoolAllocator(size={self.size_full}, size_swa={self.size_swa}, page_size={self.page_size}, "
            f"dp_size={dp}: {said}" + (", tracking" if self.track else "") + ")"
        )

    def _pickled(self) -> dict[str, Any]:
        raise TypeError(_NO_PICKLE)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NO_PICKLE)

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(_NO_PICKLE)


_NO_PICKLE = (
    "SWATokenToKVPoolAllocator does not pickle or copy: the KV pool and the attention backend hold its mapping "
    "array by identity, and a copy's mapping would be one no allocator updates; use backup_state() and "
    "restore_state() for a snapshot"
)


# help(), reprs and tracebacks name the public path, where each is imported from (pickles find it there too).
for _cls in (HostKVPoolMixin, PagedState, SWAState):
    _cls.__module__ = __name__
del _cls

__all__ = [
    "BaseTokenToKVPoolAllocator",
    "HostKVPoolMixin",
    "HostPagePool",
    "PagedState",
    "PagedTokenToKVPoolAllocator",
    "SWAState",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
]
