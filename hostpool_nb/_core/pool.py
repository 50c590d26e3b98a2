"""The torch-free ``LogicalHostPool``: validation, locking and errors.

All state changes happen in the kernels of ``_kernels/pool.py``; this class checks
arguments before any of them runs, holds the lock around them, and turns
their status codes into exceptions.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._convert import INT64, STRIDES_1D, as_count, as_sizes, as_slots, pool_shape
from .._diagnostics.snapshot import PoolState
from .._diagnostics.tracking import HISTORY_MARK, SiteKey, Tracker, wanted
from .._errors import AlignmentError, DoubleFreeError, HostPoolError, PartialPageError, SlotRangeError
from .._hooks import DataPlaneHooks
from .._kernels import layout as _layout
from .._kernels import pool as _kernels
from .._kernels import short as _short_kernels
from .._kernels.jit import Entries
from .protocol import handed_off
from .state import _CORE, MERGE_ORDERS, _PoolStateKeeping

_K = _CORE  # the rarer calls' kernels, each compiled (or loaded) on its first use
# The alloc and free kernels of each page-size class: _ENTRIES[page_size == 1].
_ENTRIES = (Entries(_kernels.KERNELS[0]), Entries(_kernels.KERNELS[1]))
# Which of a class's kernels serves a call, by its length (up to SHORT_SLOTS, up to GIL_SLOTS, longer) and
# whether the pool tracks: the one table every call but the two hot paths reads (see LogicalHostPool._sized).
_ALLOC_KERNELS = {
    False: ("alloc_short", "alloc_gil", "alloc"),
    True: ("alloc_tracked_short", "alloc_tracked", "alloc_tracked"),
}
_FREE_KERNELS = {
    False: ("free_short", "free_gil", "free"),
    True: ("free_tracked_short", "free_tracked", "free_tracked"),
}


_UINT8 = np.dtype(np.uint8)
_empty = np.empty  # one global load on the hot paths instead of two
_ndarray = np.ndarray
_INT64 = INT64
_STRIDES_1D = STRIDES_1D
_STATUS_SHORT = _layout.status_of(_layout.E_SHORT)
_STATUS_MISALIGNED = _layout.status_of(_layout.E_MISALIGNED)  # at position 0: the length is not page-aligned
_STATUS_MERGE_FIRST = _layout.status_of(_layout.E_MERGE_FIRST)  # a sorted pool: merge, then allocate again
_SHORT_SLOTS = _short_kernels.SHORT_SLOTS  # calls this short run the flat kernels
_GIL_SLOTS = _kernels.GIL_SLOTS  # and up to this long, kernels that keep the GIL
# Above this many slots, ``alloc`` checks capacity before allocating its
# output: 256 KiB, past which np.empty maps fresh memory (microseconds, or a
# MemoryError for absurd sizes); below, reusing the allocator's free blocks
# costs less than the extra lock round trip would.
_PRECHECK_SLOTS = 1 << 15


def _new_state(size: int, page_size: int, num_pages: int, sorted_order: bool, track: bool) -> NDArray[np.int64]:
    """A new state array, or a clear error for a pool too large to hold."""
    if num_pages > _layout.MAX_PAGES:  # the ring holds int32 page ids
        raise HostPoolError(
            f"LogicalHostPool(size={size}, page_size={page_size}) is too large: it has {num_pages} pages, "
            f"at most {_layout.MAX_PAGES} (2**31 - 1) are supported; use a larger page_size"
        )
    words = _layout.state_length(num_pages, track)
    if words * 8 > sys.maxsize:  # 32-bit platforms; numpy's own error would be about "dimensions"
        raise HostPoolError(
            f"LogicalHostPool(size={size}, page_size={page_size}) is too large: its {num_pages} pages "
            f"need {words * 8} bytes of metadata (5 per page), more than this platform can address"
        )
    try:
        return _layout.new_state(num_pages, page_size, sorted_order, track)
    except MemoryError as exc:
        raise MemoryError(
            f"LogicalHostPool(size={size}, page_size={page_size}) needs {words * 8 / 2**30:.3g} GiB "
            f"of metadata for its {num_pages} pages (5 bytes per page): {exc}"
        ) from exc


# Over 500 lines: alloc and free keep their hot paths in line (a helper call per step costs more than a
# one-page call's work: docs/architecture.md), and its docstring is the pool's manual.
class LogicalHostPool(DataPlaneHooks, _PoolStateKeeping):
    """Page-aligned allocator of host KV-cache token slots, without torch.

    Hands out integer slot ids in ``[0, size)``, a whole number of pages of
    ``page_size`` slots at a time, and takes them back. Behaves like sglang's
    ``LogicalHostPool`` for every correct call and raises a clear error for
    every incorrect one, before changing anything.

    Order: pages form one FIFO sequence, the free list followed by the
    release list (pages freed since the last merge, in the order they were
    freed). ``alloc`` takes pages from the front; ``free`` appends to the
    back; the release list is merged into the free list only when an
    allocation needs it (or on :meth:`merge`). ``clear`` restores ascending
    order. With ``merge="sorted"`` a merge puts every available page in
    ascending order instead, so allocations come out in address order.

    Invariant: every page is exactly once either on the free list, on the
    release list, on the pending list (freed inside a free group that has
    not ended), or held by a caller; only held pages may be freed.
    :meth:`check_invariants` verifies it.

    Cost: ``alloc(k)`` and ``free`` of ``k`` slots are O(k) with no
    allocation but the returned array; a FIFO merge is O(1), a sorted one
    O(pages). ``alloc_many`` is one allocation of the batch's total.
    Metadata is 5 bytes per page (an int32 ring entry and a uint8 owner
    flag) plus a 192-byte header, with no peak; a pool has at most
    2**31 - 1 pages.

    Thread safety: :attr:`lock` (a ``threading.RLock``) guards every state
    change; kernels release the GIL while they run. Free groups belong to
    the pool, not to a thread.

    Parameters
    ----------
    size : int
        Number of token slots; a non-negative multiple of ``page_size``.
    page_size : int
        Slots per page, at least 1.
    layout : str, optional
        Stored as given, for compatibility with sglang's host pools.
    merge : {"fifo", "sorted"}, optional, keyword-only
        The order a merge gives the available pages: sglang's FIFO order
        (the default), or ascending page ids, as sglang-jax's
        ``merge_and_sort_free``.
    track : bool or None, optional, keyword-only
        Record who holds each page: the call site (the first frame outside
        hostpool_nb) and the ``tag`` of the allocation that handed it out,
        and the site that last freed it, for :meth:`outstanding`,
        :meth:`leak_report` and double-free messages. Costs 16 bytes of
        state per page and about three times as long a single-page round
        trip; an untracked pool pays nothing. ``None`` (the default):
        tracking if the environment variable ``HOSTPOOL_NB_TRACK`` is ``1``.

    Raises
    ------
    TypeError
        If ``size`` or ``page_size`` is not an integer, or ``track`` is not
        a bool or ``None``.
    HostPoolError
        If ``page_size < 1``, ``size < 0``, the pool has more than
        2**31 - 1 pages or is too large to address, ``merge`` is not ``"fifo"`` or ``"sorted"``,
        or ``HOSTPOOL_NB_TRACK`` holds what is neither on nor off;
        :class:`AlignmentError` (with sglang's message) if ``size`` is not a
        multiple of ``page_size``.

    Examples
    --------
    >>> from hostpool_nb import DoubleFreeError, LogicalHostPool
    >>> pool = LogicalHostPool(size=64, page_size=16)
    >>> slots = pool.alloc(32)
    >>> slots
    array([ 0,  1,  2,  3,  4,  5,  6,  7,  8,  9, 10, 11, 12, 13, 14, 15, 16,
           17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31])
    >>> pool.free(slots[:16]), pool.available_size()
    (16, 48)
    >>> pool.free(slots[:16])
    Traceback (most recent call last):
    ...
    hostpool_nb.DoubleFreeError: page 0 (slots 0..15), freed at indices[0] ...
    """

    _kind = "LogicalHostPool"  # in messages, for the torch adapter's class too

    def _kernel_calls(self) -> list[tuple[Any, str]]:
        """Its page-size class's alloc and free kernels for every call length (tracked or not), and the rest."""
        own = {*_ALLOC_KERNELS[self.track], *_FREE_KERNELS[self.track]}
        return [(self._k, name) for name in sorted(own)] + [(_K, name) for name in _kernels.POOL._fields]

    _format = "LogicalHostPool"
    _state_class = PoolState

    def __init__(
        self,
        size: int,
        page_size: int,
        layout: str = "layer_first",
        *,
        merge: str = "fifo",
        track: bool | None = None,
    ) -> None:
        size, page_size = pool_shape(size, page_size)
        if size % page_size != 0:
            raise AlignmentError(f"LogicalHostPool size must be page-aligned, got size={size}, page_size={page_size}")
        if merge not in MERGE_ORDERS:
            raise HostPoolError(f"merge must be 'fifo' or 'sorted', got merge={merge!r}")
        track = wanted(track)
        num_pages = size // page_size
        st = _new_state(size, page_size, num_pages, merge == "sorted", track)
        self._setup(size, page_size, layout, merge, st, Tracker() if track else None)
        self._record_if_asked()

    def _setup(  # noqa: PLR0913, PLR0917 - every attribute the pickle restores
        self, size: int, page_size: int, layout: Any, merge: str, st: NDArray[np.int64], tracker: Tracker | None
    ) -> None:
        """Set every attribute: for ``__init__`` and for unpickling."""
        self.size = size
        self.logical_size = size
        self.page_size = page_size
        self.device = "cpu"
        self.layout = layout
        self.dtype = self._uint8_dtype()
        self.layer_num = 0
        self.start_layer = 0
        self.end_layer = 0
        self.kv_buffer = None
        self.size_per_token = 0
        self.allocator = None
        self.can_use_write_back_jit = True
        self.merge_order = merge
        self.track = tracker is not None
        self._tracker = tracker
        # The hot paths take alloc sizes 0.._plain_limit and free inputs of
        # up to _plain_limit slots: short enough that a refused allocation's
        # output costs little (_PRECHECK_SLOTS); a tracking pool's take none.
        self._plain_limit = _PRECHECK_SLOTS if tracker is None else -1  # and -1 while recording
        # This page-size class's kernels, by call length: the short calls' two
        # (the hot paths') are compiled (or loaded) now, the others on their first call.
        self._k = _ENTRIES[page_size == 1]
        self._alloc_kernels: list[Any] = list(_ALLOC_KERNELS[tracker is not None])  # names, then kernels
        self._free_kernels: list[Any] = list(_FREE_KERNELS[tracker is not None])
        self._alloc_short = self._sized(self._alloc_kernels, 0)
        self._free_short = self._sized(self._free_kernels, 0)
        self._make_lock()
        self._recording = None  # an instance attribute: read on the checked paths, faster than the class's
        _layout.derive(st)
        self._st = st
        # A view for Python-side checks; the kernels find it inside ``_st``.
        self._owner = _layout.owner_flags(st, size // page_size)

    # -- allocation -----------------------------------------------------

    @handed_off
    def clear(self) -> None:
        """Free every slot, in ascending order, and empty the release list.

        Slots held by callers become free: freeing them afterwards raises
        :class:`DoubleFreeError`.
        """
        with self.lock:
            _K.reset(self._st)

    @handed_off
    def merge(self) -> int:
        """Merge the release list into the free list now, in the pool's merge order.

        FIFO: the released pages follow the free ones, in the order they
        were freed (what an allocation needing them would do). Sorted: all
        available pages in ascending order. Pending pages of an open free
        group are not touched.

        Returns
        -------
        int
            The number of slots merged (0 when nothing was released).
        """
        with self.lock:
            moved = int(_K.merge(self._st))
        if moved < 0:
            raise self._corrupt("merge", moved)
        return moved * self.page_size

    def available_size(self) -> int:
        """Number of slots an ``alloc`` can hand out now (free + released).

        One word of the state that every kernel changing the lists stores
        last: read without the lock, it is the count as of one moment.
        """
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.available_size()  # type: ignore[no-any-return]
        return int(self._st[_layout.H_AVAIL])

    def alloc(self, need_size: int, *, tag: Any = None) -> NDArray[np.int64] | None:
        """Allocate ``need_size`` slots: whole pages, in FIFO order.

        Parameters
        ----------
        need_size : int
            Number of slots; a non-negative multiple of ``page_size``.
        tag : hashable, optional, keyword-only
            A label for this allocation (e.g. a request id) that a tracking
            pool records with its call site (``outstanding()``,
            ``leak_report()``); accepted and ignored when the pool does not
            track.

        Returns
        -------
        numpy.ndarray or None
            A new 1-D C-contiguous int64 array of slot ids, owned by the
            caller (the pool never reads or writes it again), or ``None``
            when fewer than ``need_size`` slots are available.

        Raises
        ------
        TypeError
            If ``need_size`` is not an integer.
        AlignmentError
            If ``need_size`` is not a multiple of ``page_size`` (sglang's
            message).
        HostPoolError
            If ``need_size`` is negative.
        """
        if type(need_size) is not int or not 0 <= need_size <= self._plain_limit:
            # Not a plain int, tracking pools, a recording (_plain_limit -1 then), negative and long sizes:
            # written out here, as a call more costs a tracked round trip a tenth of its time.
            rec = self._recording
            if rec is not None and rec.takes():
                return rec.alloc(need_size, tag=tag)  # type: ignore[no-any-return]
            # A plain int got here by its range: checked path, without testing that range again.
            if type(need_size) is int or not 0 <= (need_size := as_count(need_size, "need_size")) <= self._plain_limit:
                return self._alloc_checked(need_size, tag)
        # The hot path, for a plain pool and a size without a capacity check
        # first: the kernel refuses a size that is not page-aligned (before
        # any change), which saves the check here. The output is allocated
        # before taking the lock, so its page faults are not paid while other
        # threads wait; the kernel checks capacity and reports E_SHORT
        # without touching the state.
        out = _empty(need_size, _INT64)
        # Plain attribute loads, by length (the table _sized reads): a method call costs more.
        if need_size <= _SHORT_SLOTS:
            kernel = self._alloc_short
        else:
            kernel = self._k.alloc_gil if need_size <= _GIL_SLOTS else self._k.alloc
        lock = self.lock
        lock.acquire()  # acquire/release: measurably cheaper than ``with``
        try:
            status = kernel(self._st, out)
        finally:
            lock.release()
        return out if status >= 0 else self._failed_alloc(status, need_size, out)

    def _alloc_checked(self, need_size: int, tag: Any) -> NDArray[np.int64] | None:
        """``alloc`` for a tracking pool, a negative size or a long one: every check in Python."""
        if need_size % self.page_size != 0:
            raise self._alloc_misaligned(need_size)
        if need_size < 0:
            raise HostPoolError(f"need_size must be non-negative, got need_size={need_size}")
        tracker = self._tracker
        where = None if tracker is None else tracker.where(tag, 2)  # an unusable tag raises here
        if need_size > _PRECHECK_SLOTS and self._beyond_capacity(need_size):
            return None
        out = _empty(need_size, _INT64)
        status = self._alloc_into(out, where, tag)
        return out if status >= 0 else self._failed_alloc(status, need_size)

    def _sized(self, kernels: list[Any], length: int) -> Any:
        """The kernel of ``kernels`` (this pool's row of ``_ALLOC_KERNELS`` or ``_FREE_KERNELS``) for ``length``.

        Each is looked up (compiled, or loaded) on its first use and kept in the pool's row.
        """
        i = 0 if length <= _SHORT_SLOTS else 1 if length <= _GIL_SLOTS else 2
        kernel = kernels[i]
        if type(kernel) is str:
            kernel = kernels[i] = getattr(self._k, kernel)
        return kernel

    def _alloc_into(self, out: NDArray[np.int64], where: SiteKey | None, tag: Any) -> int:
        """Allocate ``len(out)`` slots into ``out`` under the lock (recording ``where``, if tracked); the status.

        The one path of every allocation but the hot path's, and the one
        place a sorted pool's ``E_MERGE_FIRST`` is answered: merge, then
        the same kernel again (its alloc kernels leave the merge, which
        reorders the pages, to the pool, so that they stay small to compile).
        """
        n = out.shape[0]
        kernel = self._alloc_short if n <= _SHORT_SLOTS else self._sized(self._alloc_kernels, n)
        st = self._st
        lock = self.lock
        lock.acquire()
        try:
            if where is None:
                status: int = kernel(st, out)
                if status == _STATUS_MERGE_FIRST:
                    status = self._merged_then(kernel, out)
                return status
            # A tracked call's site id is looked up under the lock, where a sweep cannot drop it.
            tracker = self._tracker
            tracker.begin()  # type: ignore[union-attr]  # tracked: where is set
            site = tracker.intern(where, tag, st)  # type: ignore[union-attr]
            status = kernel(st, out, site)
            if status == _STATUS_MERGE_FIRST:
                status = self._merged_then(kernel, out, site)
            if status < 0:  # refused or failed: the site table as it was
                tracker.rollback()  # type: ignore[union-attr]
            return status
        finally:
            lock.release()

    def _merged_then(self, kernel: Any, *args: Any) -> int:
        """Under the lock, after an alloc kernel's ``E_MERGE_FIRST``: merge, then the same kernel again; its status."""
        moved: int = _K.merge(self._st)
        return moved if moved < 0 else int(kernel(self._st, *args))

    def _failed_alloc(
        self, status: int, need_size: int, out: NDArray[np.int64] | None = None
    ) -> NDArray[np.int64] | None:
        """What a failed allocation kernel means: ``None`` (too few slots), or the error it reported.

        A sorted pool whose allocation into ``out`` needed a merge first
        (the hot path's kernel does not merge) merges and allocates again.
        """
        if status == _STATUS_MERGE_FIRST and out is not None:
            status = self._alloc_into(out, None, None)
            if status >= 0:
                return out
        if status == _STATUS_SHORT:
            return None
        if status == _STATUS_MISALIGNED:
            raise self._alloc_misaligned(need_size)
        raise self._corrupt("alloc", status)

    def _alloc_misaligned(self, need_size: int) -> AlignmentError:
        """The error of an allocation that is not whole pages (a pool serving another original words it as that)."""
        return AlignmentError(
            f"LogicalHostPool allocation must be page-aligned, got need_size={need_size}, page_size={self.page_size}"
        )

    def alloc_many(self, sizes: Any, *, tag: Any = None) -> tuple[NDArray[np.int64], NDArray[np.int64]] | None:
        """Allocate a batch of requests at once: all of them, or none.

        The batch is one allocation of ``sum(sizes)`` slots, so ``slots``
        holds exactly what ``alloc(sum(sizes))`` would return; request ``i``
        owns ``slots[offsets[i]:offsets[i + 1]]``. One kernel checks the
        sizes and lays out the offsets, one allocates: no Python loop over
        the requests. A batch free needs no call of its own: ``free`` of
        the concatenated slots of many requests is one kernel call too.

        Parameters
        ----------
        sizes : sequence or 1-D array of int
            Slots per request, each a non-negative multiple of
            ``page_size``. A numpy int64 array is read fastest.
        tag : hashable, optional, keyword-only
            As for :meth:`alloc`: recorded for the whole batch by a
            tracking pool (one allocation), ignored otherwise.

        Returns
        -------
        (numpy.ndarray, numpy.ndarray) or None
            ``(slots, offsets)``: new int64 arrays owned by the caller, of
            lengths ``sum(sizes)`` and ``len(sizes) + 1``, with
            ``offsets[0] == 0`` and ``offsets[i + 1] - offsets[i] ==
            sizes[i]``. ``None``, with the pool unchanged, when fewer than
            ``sum(sizes)`` slots are available.

        Raises
        ------
        TypeError
            If ``sizes`` is not a 1-D sequence or array of integers (naming
            the position of an element that is not one).
        AlignmentError, HostPoolError
            If a size is not a multiple of ``page_size``, or is negative:
            ``alloc``'s errors, naming the first such position
            (``sizes[3]=...``), raised before anything changes.
        """
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.alloc_many(sizes, tag=tag)  # type: ignore[no-any-return]
        arr = as_sizes(sizes)
        page_size = self.page_size
        tracker = self._tracker
        where = None if tracker is None else tracker.where(tag, 1)
        if isinstance(arr, list):  # sizes beyond int64: checked here, never served
            for i, s in enumerate(arr):
                self._check_batch_size(i, s, page_size)
            self._beyond_capacity(self.size + 1)
            return None
        offsets = np.empty(arr.shape[0] + 1, dtype=_INT64)
        total = _K.plan_batch(arr, offsets, page_size, self.size)
        if total < 0:
            _, pos = _layout.decode_status(total)
            self._check_batch_size(pos, int(arr[pos]), page_size)
            raise self._corrupt("alloc_many", total)  # the kernel failed a size the check passes
        # A total beyond the pool (the kernel saturates at size + 1) or a large
        # one the pool cannot serve now is refused before its output exists.
        if (total > self.size or total > _PRECHECK_SLOTS) and self._beyond_capacity(total):
            return None
        out = np.empty(total, dtype=_INT64)
        status = self._alloc_into(out, where, tag)
        if status >= 0:
            return out, offsets
        if status == _STATUS_SHORT:
            return None
        raise self._corrupt("alloc_many", status)  # the plan made the total page-aligned

    def free(self, indices: Any) -> int:
        """Give back slots from earlier allocations: whole pages only.

        Parameters
        ----------
        indices : array_like of int
            Slot ids, any integer dtype and any shape (flattened in C
            order). Every run of ``page_size`` entries must be one page's
            slots in ascending order, of a page currently allocated; pages
            may come in any order.

        Returns
        -------
        int
            The number of slots freed.

        Raises
        ------
        TypeError
            If ``indices`` is a scalar or holds non-integers.
        AlignmentError
            If the number of slots is not a multiple of ``page_size``
            (sglang's message).
        SlotRangeError, PartialPageError, DoubleFreeError
            If a slot is outside ``[0, size)``, a run is not one whole page
            in order, or a page is not currently allocated (freed twice, in
            two calls or in this one, freed after ``clear()``, or never
            allocated).
        """
        # The hot path: strides == (8,) means 1-D and contiguous in one test
        # (a 0- or 1-element array may miss it and take the general path).
        if type(indices) is _ndarray and indices.dtype is _INT64 and indices.strides == _STRIDES_1D:
            slots: NDArray[np.int64] = indices
        else:
            rec = self._recording
            if rec is not None and rec.takes():
                return rec.free(indices)  # type: ignore[no-any-return]
            slots = as_slots(indices)
        # One test for the hot path: a plain pool (a tracking or recording pool's limit is
        # -1) and a call of up to _PRECHECK_SLOTS; its kernel by length, as _sized chooses.
        size = slots.size  # an attribute of numpy's: read once
        if size <= self._plain_limit:
            if size <= _SHORT_SLOTS:
                kernel = self._free_short
            else:
                kernel = self._k.free_gil if size <= _GIL_SLOTS else self._k.free
        elif self._tracker is not None:
            return self._free_tracked(slots)
        else:
            rec = self._recording  # a recording's calls come this way (or the tracked one)
            if rec is not None and rec.takes():
                return rec.free(indices)  # type: ignore[no-any-return]
            kernel = self._sized(self._free_kernels, size)
        # The kernel refuses a length that is not a multiple of page_size
        # (before any change) and returns the number of slots freed, a
        # Python int (_jit.entry_point).
        lock = self.lock
        lock.acquire()
        try:
            status: int = kernel(self._st, slots)
        finally:
            lock.release()
        if status < 0:
            raise self._free_error(status, slots)
        return status

    def _free_tracked(self, slots: NDArray[np.int64]) -> int:
        """``free`` for a tracking pool: the freeing site is recorded with the pages (and a recording's call)."""
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.free(slots)  # type: ignore[no-any-return]
        tracker = self._tracker
        if tracker is None:  # pragma: no cover - only called for a tracking pool
            raise RuntimeError("_free_tracked called on a pool that does not track")
        where = tracker.where(None, 2)
        n = slots.size
        kernel = self._free_short if n <= _SHORT_SLOTS else self._sized(self._free_kernels, n)
        lock = self.lock
        lock.acquire()  # not ``with``, which costs more, on the path a tracked round trip takes twice
        try:
            tracker.begin()
            status: int = kernel(self._st, slots, tracker.intern(where, None, self._st))
            if status < 0:  # the error's history is read under the same hold as the failed free
                tracker.rollback()
                raise self._free_error(status, slots)
        finally:
            lock.release()
        return status

    # -- free groups --------------------------------------------------------

    @handed_off
    def free_group_begin(self) -> None:
        """Begin a free group: frees are checked at once, released at its end.

        Inside a group ``free`` validates and returns its count as always
        (a page freed twice in the group is a :class:`DoubleFreeError`),
        but the pages go to a pending list, available to neither ``alloc``
        nor ``available_size()`` until the outermost group ends. Groups
        nest. Prefer ``with pool.free_group():``, which ends the group even
        when its body raises.
        """
        with self.lock:
            _K.group_begin(self._st)

    @handed_off
    def free_group_end(self) -> None:
        """End the innermost free group; the outermost releases what it freed.

        The pending pages join the release list in the order they were
        freed, in one kernel call.

        Raises
        ------
        HostPoolError
            If no free group is open (none was begun, or ``clear()`` ended
            them all).
        """
        with self.lock:
            status = _K.group_end(self._st)
        if status < 0:
            raise HostPoolError("free_group_end() without a free group: none was begun, or clear() ended it")

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """``with pool.free_group(): ...``: a free group around the block.

        The group ends when the block does, whether it returns or raises,
        so frees made before an exception are still released. A
        ``clear()`` inside the block ends every group; the block's end then
        leaves the pool alone.
        """
        st = self._st
        with self.lock:  # the public calls, so a recording sees the group
            self.free_group_begin()
            clears = int(st[_layout.H_CLEARS])
        try:
            yield
        finally:
            with self.lock:
                if int(st[_layout.H_CLEARS]) == clears and int(st[_layout.H_GROUP_DEPTH]) > 0:
                    self.free_group_end()

    def _recording_changed(self) -> None:
        """A recording's calls take the checked paths, which hand them to it: the hot paths do not look."""
        self._plain_limit = _PRECHECK_SLOTS if self._tracker is None and self._recording is None else -1

    _recorded = (
        "alloc",
        "alloc_many",
        "free",
        "clear",
        "merge",
        "free_group_begin",
        "free_group_end",
        "backup_state",
        "restore_state",
        "available_size",
    )

    # -- internals -------------------------------------------------------

    def _uint8_dtype(self) -> Any:
        """The ``dtype`` attribute; the torch adapter returns ``torch.uint8``."""
        return _UINT8

    def _beyond_capacity(self, need: int) -> bool:
        """Whether ``need`` slots are beyond what the pool can serve now; count the refusal.

        Before a large output is allocated: a refused request must cost
        microseconds whatever its size, not a huge ``np.empty`` (or a
        ``MemoryError``) first.
        """
        st = self._st
        with self.lock:
            if need > (st[_layout.H_NFREE] + st[_layout.H_NREL]) * self.page_size:
                _K.refuse(st)
                return True
        return False

    def _check_batch_size(self, pos: int, size: int, page_size: int) -> None:
        """``alloc``'s checks for ``sizes[pos]``, with the position in the message."""
        if size % page_size != 0:
            raise AlignmentError(
                f"LogicalHostPool allocation must be page-aligned, got sizes[{pos}]={size}, page_size={page_size}"
            )
        if size < 0:
            raise HostPoolError(f"sizes[{pos}] must be non-negative, got sizes[{pos}]={size}")

    def _page_text(self, page: int) -> str:
        ps = self.page_size
        return f"page {page} (slots {page * ps}..{page * ps + ps - 1})"

    def _free_error(self, status: int, slots: NDArray[np.int64]) -> Exception:  # noqa: PLR0911 - one per code
        code, pos = _layout.decode_status(status)
        ps = self.page_size
        if code == _layout.E_LENGTH:
            return AlignmentError(
                f"LogicalHostPool free must be page-aligned, got len(indices)={slots.shape[0]}, page_size={ps}"
            )
        start = pos - pos % ps
        slot = int(slots[pos])
        if code == _layout.E_RANGE:
            return SlotRangeError(f"free got slot {slot} at indices[{pos}] (flattened), outside [0, {self.size})")
        if code == _layout.E_MISALIGNED:
            return PartialPageError(
                f"free takes whole pages: indices[{pos}] (flattened) is slot {slot}, which is not "
                f"the first slot of a page (a multiple of page_size={ps}); each run of {ps} "
                "entries must be one page's slots in ascending order"
            )
        if code == _layout.E_PARTIAL:
            first = int(slots[start])
            return PartialPageError(
                f"free takes whole pages: indices[{pos}] (flattened) is slot {slot}, expected "
                f"{first + pos - start} to continue {self._page_text(first // ps)} in ascending order"
            )
        if code == _layout.E_NOT_ALLOCATED:
            return DoubleFreeError(
                f"{self._page_text(slot // ps)}, freed at indices[{pos}] (flattened), is not "
                "allocated: it was freed already, freed by clear(), or never allocated" + self._history(slot // ps)
            )
        if code == _layout.E_DUPLICATE:
            return DoubleFreeError(
                f"{self._page_text(slot // ps)} is freed twice in one call (again at indices[{pos}], flattened)"
                + self._history(slot // ps)
            )
        return self._corrupt("free", status)

    def _history(self, page: int) -> str:
        """``"; it was allocated at ..., then freed at ..."`` for a tracking pool, else nothing."""
        tracker = self._tracker
        if tracker is None or not 0 <= page < self.size // self.page_size:
            return ""
        with self.lock:
            return HISTORY_MARK + tracker.history(self._st, page)
