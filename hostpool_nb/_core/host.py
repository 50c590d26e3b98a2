"""``HostPagePool``: the host KV tier's page bookkeeping (sglang-jax's HiCache L2 and PD staging) on kernels.

All state changes happen in the kernels of ``_kernels/host.py``; this class
checks arguments, holds the lock around the kernels and turns their status
codes into the exceptions, with the texts, of sglang-jax's host pools.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._convert import INT64, STRIDES_1D, as_count, as_page_ids, is_array_like, shown
from .._diagnostics.invariants import host_problems
from .._diagnostics.snapshot import HostPageState, checked_host_words
from .._errors import (
    HostPoolError,
    LockRefUnderflowError,
    PageDoubleFreeError,
    PageNotAllocatedError,
    PinnedPageError,
    SlotRangeError,
    StaleFreeError,
)
from .._kernels import host as _host_kernels
from .._kernels import layout as _layout
from .._kernels import pool as _kernels
from .._kernels.jit import Entries
from .protocol import ArrayStatePool
from .stats import HostPageStats

log = logging.getLogger("hostpool_nb")

HOST_KERNELS = Entries(_host_kernels.KERNELS)  # each compiled (or loaded) on its first use
_CORE = Entries(_kernels.POOL)  # the core's load_state: the same checked words, copied in

_NO_GENS = np.empty(0, dtype=np.int64)
NO_OUT = np.empty(0, dtype=np.int64)  # host_free: do not list the freed pages
STATUS_SHORT = _layout.status_of(_layout.E_SHORT)
empty = np.empty
_ndarray = np.ndarray


class HostPagePool(ArrayStatePool):
    """Page ids of a host KV tier: allocated, freed, pinned and numbered by generation, in kernels.

    Behaves as sglang-jax's ``LRUHostKVPool`` and ``QueueHostKVPool`` keep
    their books, for every correct call: the same ids in the same order and
    the same results. Pages are ``0 .. pool_size - 1`` on one FIFO free list,
    ascending at first; allocation takes from the front, a freed page goes
    to the back; there is no release list and no merge. Each page carries an
    allocated flag, a generation (incremented each time it is handed out)
    and a pin count (a pinned page cannot be freed).

    Unlike the originals, every call checks all of its input before it
    changes anything: a ``free`` that raises has freed nothing (the
    originals free the pages before the bad one). The exceptions keep the
    originals' texts and types: an out-of-range page is a
    :class:`~hostpool_nb.SlotRangeError` (a ``ValueError``); a double free, a
    pinned page and an underflow are :class:`~hostpool_nb.PageStateError`
    subclasses, which are ``RuntimeError`` too. ``generations=`` (and
    ``generation=``) catch what no original can: a page freed through a
    stale copy after it was handed out again (:class:`~hostpool_nb.StaleFreeError`).

    Cost: ``reserve``, ``release``, ``alloc(k)``, ``free`` of ``k`` pages and
    the pin calls are O(1) or O(k), whatever the pool's size and however
    many pages are free (the originals' are O(free pages) per page).
    Metadata is about 22 bytes per page, in one int64 array.

    Thread safety: :attr:`lock` (a ``threading.RLock``) guards every change;
    the array kernels release the GIL while they run. The read-only views
    :attr:`allocated`, :attr:`generation` and :attr:`lock_ref` are meant to
    be read under :attr:`lock`, as transfers do.

    Parameters
    ----------
    pool_size : int
        Number of pages, at least 1.

    Examples
    --------
    >>> from hostpool_nb import HostPagePool
    >>> pool = HostPagePool(8)
    >>> pages = pool.alloc(3)
    >>> pages, pool.generation[pages]
    (array([0, 1, 2]), array([1, 1, 1]))
    >>> pool.inc_lock_ref(pages[0])
    >>> pool.free(pages)
    Traceback (most recent call last):
    ...
    hostpool_nb.PinnedPageError: free of locked page id=0 (lock_ref=1)
    >>> pool.dec_lock_ref(pages[0]); pool.free(pages)
    3
    """

    _kind = _format = "HostPagePool"

    def _kernel_calls(self) -> list[tuple[Any, str]]:
        return [(HOST_KERNELS, name) for name in _host_kernels.KERNELS._fields] + [(_CORE, "load_state")]

    _state_class = HostPageState

    def __init__(self, pool_size: int) -> None:
        pool_size = as_count(pool_size, "pool_size")
        if pool_size <= 0:
            raise HostPoolError(f"pool_size must be positive, got {shown(pool_size)}")
        if pool_size > _layout.MAX_PAGES:
            raise HostPoolError(f"pool_size must be at most {_layout.MAX_PAGES} (2**31 - 1), got {shown(pool_size)}")
        st = np.zeros(_layout.host_state_length(pool_size), dtype=np.int64)
        st[_layout.HP_NPAGES] = pool_size
        self._setup(st)
        HOST_KERNELS.reset(st)
        st[_layout.HP_CLEARS] = 0  # the construction is not a clear() call

    def _setup(self, st: NDArray[np.int64]) -> None:
        n = int(st[_layout.HP_NPAGES])
        self.pool_size = n
        self._make_lock()
        self._st = st
        ring, gen, ref, flags, _ = _layout.host_views(st, n)
        self._ring = ring
        self.allocated = _read_only(flags.view(np.bool_))
        self.generation = _read_only(gen)
        self.lock_ref = _read_only(ref)
        self._words = elements(st)  # header words as Python ints, without a numpy scalar each
        self._last_exhaust_log = -1.0

    # -- allocation -----------------------------------------------------------

    def reserve(self) -> int | None:
        """Take the first free page; ``None`` when none is free (an exhausted call).

        Returns
        -------
        int or None
            The page id; it is allocated and its generation incremented.
        """
        lock = self.lock
        lock.acquire()
        try:
            page: int = HOST_KERNELS.reserve(self._st)
        finally:
            lock.release()
        if page >= 0:
            return page
        if page == STATUS_SHORT:
            self._exhausted(1)
            return None
        raise self._corrupt("reserve", page)

    def alloc(self, need_pages: int) -> NDArray[np.int64] | None:
        """Take the first ``need_pages`` free pages, in free-list order; ``None`` when fewer are free.

        Parameters
        ----------
        need_pages : int
            At least 1.

        Returns
        -------
        numpy.ndarray or None
            A new int64 array of page ids, owned by the caller; each page is
            allocated and its generation incremented. ``None`` (nothing
            taken, an exhausted call) when fewer pages are free.

        Raises
        ------
        TypeError
            If ``need_pages`` is not an integer.
        HostPoolError
            If ``need_pages < 1`` (the original's text).
        """
        if type(need_pages) is not int:
            need_pages = as_count(need_pages, "need_pages")
        if need_pages <= 0:
            raise HostPoolError(f"need_pages must be positive, got {need_pages}")
        out = empty(min(need_pages, self.pool_size + 1), INT64)  # more than the pool: refused, unallocated
        lock = self.lock
        lock.acquire()
        try:
            status = HOST_KERNELS.alloc(self._st, out)
        finally:
            lock.release()
        if status >= 0:
            return out
        if status == STATUS_SHORT:
            self._exhausted(need_pages)
            return None
        raise self._corrupt("alloc", status)

    # -- freeing --------------------------------------------------------------------

    def release(self, buffer_id: int, *, generation: int | None = None) -> None:
        """Give back one page (``QueueHostKVPool.release`` / ``LRUHostKVPool.release``).

        Parameters
        ----------
        buffer_id : int
            The page.
        generation : int, optional, keyword-only
            The page's generation when the caller got it
            (``pool.generation[page]`` then): refused if it has moved on.

        Raises
        ------
        SlotRangeError
            ``buffer_id`` outside ``[0, pool_size)``.
        PageDoubleFreeError, StaleFreeError, PinnedPageError
            The page is free, was handed out again since ``generation``, or
            is pinned; nothing changes.
        """
        if type(buffer_id) is not int:
            buffer_id = as_count(buffer_id, "buffer_id")
        check = 0
        given = 0
        if generation is not None:
            given = as_count(generation, "generation")
            check = 1
            if not -(2**63) <= given < 2**63:
                raise HostPoolError(f"generation holds {given}, beyond the int64 range")
        if not -(2**63) <= buffer_id < 2**63:
            raise SlotRangeError(f"buffer_id={buffer_id} outside pool range [0, {self.pool_size})")
        lock = self.lock
        lock.acquire()
        try:
            status = HOST_KERNELS.release(self._st, buffer_id, given, check)
            if status < 0:
                raise self._page_error(status, "buffer_id", "release", {})
        finally:
            lock.release()

    def free(self, host_page_ids: Any, *, generations: Any = None) -> int:
        """Give back pages, all or none; a page named twice is freed once.

        Parameters
        ----------
        host_page_ids : sequence or 1-D array of int
            Page ids: a list, a tuple, a 1-D array of any integer dtype, or
            any iterable of integers. A C-contiguous int64 array is read
            without a copy, each entry once.
        generations : sequence or 1-D array of int, optional, keyword-only
            One per entry of ``host_page_ids``: the generations the caller
            got with the pages (``pool.generation[pages]`` at allocation).
            A page whose generation has moved on is refused.

        Returns
        -------
        int
            The number of pages freed (the original returns ``None``).

        Raises
        ------
        TypeError
            If ``host_page_ids`` or ``generations`` is not a sequence of integers.
        HostPoolError
            If ``generations`` has not one entry per page.
        SlotRangeError, PageDoubleFreeError, StaleFreeError, PinnedPageError
            For the first entry, in order, that is out of range, free,
            handed out again since its generation, or pinned; the originals'
            texts. Nothing is freed.
        """
        pages, beyond, gens, check = self._free_arguments(host_page_ids, generations)
        lock = self.lock
        lock.acquire()
        try:
            return self._free_locked(pages, beyond, gens, check, NO_OUT)
        finally:
            lock.release()

    def free_listed(self, host_page_ids: Any, *, generations: Any = None) -> NDArray[np.int64]:
        """:meth:`free`, returning the pages it freed, in the order first named (a new int64 array).

        For code that must act on each freed page under :attr:`lock`
        (``HostKVPoolMixin`` drops the page's pending transfers and payload).
        The whole input is read before the pool is: a generator that frees
        a page of this pool while it is read does not change what this call
        reports.

        Parameters
        ----------
        host_page_ids, generations
            As for :meth:`free`.
        """
        pages, beyond, gens, check = self._free_arguments(host_page_ids, generations)
        out = empty(pages.shape[0], INT64)
        with self.lock:
            count = self._free_locked(pages, beyond, gens, check, out)
        return out[:count]

    def _free_arguments(
        self, host_page_ids: Any, generations: Any
    ) -> tuple[NDArray[np.int64], dict[int, int], NDArray[np.int64], int]:
        """``free``'s arguments as the kernel reads them: every one converted before any state is read."""
        if type(host_page_ids) is _ndarray and host_page_ids.dtype is INT64 and host_page_ids.strides == STRIDES_1D:
            pages: NDArray[np.int64] = host_page_ids
            beyond: dict[int, int] = {}
        else:
            pages, beyond = as_page_ids(host_page_ids, "host_page_ids")
        gens, check = self._generations(generations, pages.shape[0])
        return pages, beyond, gens, check

    def _free_locked(
        self,
        pages: NDArray[np.int64],
        beyond: dict[int, int],
        gens: NDArray[np.int64],
        check: int,
        out: NDArray[np.int64],
    ) -> int:
        """The free kernel, under :attr:`lock` (held by the caller): the pages freed, into ``out`` if it has room."""
        status: int = HOST_KERNELS.free(self._st, pages, gens, check, out)
        if status < 0:  # built under the same hold, from the values the kernel checked
            raise self._page_error(status, "page id", "free", beyond)
        return status

    # -- pins -------------------------------------------------------------------------

    def inc_lock_ref(self, buffer_id: Any) -> None:
        """Pin a page (or each page of a 1-D array, all or none): it cannot be freed until unpinned.

        Parameters
        ----------
        buffer_id : int or 1-D array of int
            A page, or pages (a list or an integer array), all or none.

        Raises
        ------
        SlotRangeError, PageNotAllocatedError
            A page outside the pool, or free (the originals' texts).
        """
        self._pin(buffer_id, 1)

    def dec_lock_ref(self, buffer_id: Any) -> None:
        """Unpin a page, or pages as :meth:`inc_lock_ref` takes them (all or none; a repeat counts each time).

        Raises
        ------
        SlotRangeError, PageNotAllocatedError, LockRefUnderflowError
            A page outside the pool, free, or not pinned (the originals' texts).
        """
        self._pin(buffer_id, -1)

    def _pin(self, buffer_id: Any, delta: int) -> None:
        if not isinstance(buffer_id, (list, tuple)) and not is_array_like(buffer_id):  # one page
            page = buffer_id if type(buffer_id) is int else as_count(buffer_id, "buffer_id")
            if not -(2**63) <= page < 2**63:
                raise SlotRangeError(f"buffer_id={page} outside pool range [0, {self.pool_size})")
            with self.lock:
                status = HOST_KERNELS.pin1(self._st, page, delta)
                if status < 0:
                    raise self._page_error(status, "buffer_id", "lock_ref", {})
            return
        pages, beyond = as_page_ids(buffer_id, "buffer_id")
        if pages is buffer_id:
            pages = pages.copy()  # host_pin reads its input twice to undo a failure: our own copy
        with self.lock:
            status = HOST_KERNELS.pin(self._st, pages, delta)
            if status < 0:
                raise self._page_error(status, "buffer_id", "lock_ref", beyond)

    def require_allocated(self, buffer_id: int) -> None:
        """Raise the originals' errors unless ``buffer_id`` is an allocated page (``_require_allocated``).

        Parameters
        ----------
        buffer_id : int
            The page.

        Raises
        ------
        SlotRangeError, PageNotAllocatedError
            The page is outside the pool, or free.
        """
        page = buffer_id if type(buffer_id) is int else as_count(buffer_id, "buffer_id")
        with self.lock:
            if not 0 <= page < self.pool_size:
                raise SlotRangeError(f"buffer_id={page} outside pool range [0, {self.pool_size})")
            if not self.allocated[page]:
                raise PageNotAllocatedError(f"buffer_id={page} is not allocated (in free-list)")

    # -- state ---------------------------------------------------------------------

    def available_size(self) -> int:
        """Number of free pages."""
        with self.lock:
            free: int = self._words[_layout.HP_NFREE]
            return free

    def total_size(self) -> int:
        """``pool_size``."""
        return self.pool_size

    def clear(self) -> None:
        """Make every page free, in ascending order, and unpinned; generations and counters are kept.

        A page held before the clear is free afterwards; its generation
        still says which allocation it was, so a stale free of it is caught.
        """
        with self.lock:
            HOST_KERNELS.reset(self._st)

    def stats(self) -> HostPageStats:
        """Usage and counters now, in O(1)."""
        with self.lock:
            h = [int(x) for x in self._st[: _layout.HP_HEADER]]
        n = h[_layout.HP_NPAGES]
        return HostPageStats(
            pool_size=n,
            free_pages=h[_layout.HP_NFREE],
            allocated_pages=n - h[_layout.HP_NFREE],
            pinned_pages=h[_layout.HP_PINNED],
            peak_allocated_pages=h[_layout.HP_PEAK],
            alloc_calls=h[_layout.HP_ALLOC_CALLS],
            exhausted_calls=h[_layout.HP_EXHAUSTED],
            free_calls=h[_layout.HP_FREE_CALLS],
            clears=h[_layout.HP_CLEARS],
        )

    def _corruption(self) -> str | None:
        found = host_problems(self._st, self.pool_size)
        return "HostPagePool state is corrupted: " + "; ".join(found) if found else None

    def _snapshot(self) -> HostPageState:
        """The free list's order, allocated pages, generations and pins, as of one moment."""
        return HostPageState(self.pool_size, self._st)

    def _checked(self, state: HostPageState) -> NDArray[np.int64]:
        if state.pool_size != self.pool_size:
            raise HostPoolError(f"the state is from a pool of {state.pool_size} pages; this one has {self.pool_size}")
        return checked_host_words(state._words, self.pool_size, "the state")

    def _load(self, checked: NDArray[np.int64]) -> None:
        _CORE.load_state(self._st, checked, 0)

    def _pickled(self) -> dict[str, Any]:
        return {"pool_size": self.pool_size, "state": self._st.copy()}

    def _unpickled(self, saved: dict[str, Any], what: str) -> None:
        pool_size = saved.get("pool_size")
        if type(pool_size) is not int or not 0 < pool_size <= _layout.MAX_PAGES:
            raise HostPoolError(f"{what} has pool_size={pool_size!r}")
        self._setup(checked_host_words(saved.get("state"), pool_size, what))

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"HostPagePool(pool_size={s.pool_size}: {s.allocated_pages} pages allocated ({s.usage:.1%}), "
            f"{s.pinned_pages} pinned, {s.free_pages} free)"
        )

    # -- internals ------------------------------------------------------------------

    def _generations(self, generations: Any, count: int) -> tuple[NDArray[np.int64], int]:
        if generations is None:
            return _NO_GENS, 0
        gens, beyond = as_page_ids(generations, "generations")
        if beyond:
            raise HostPoolError(f"generations holds {next(iter(beyond.values()))}, beyond the int64 range")
        if gens.shape[0] != count:
            raise HostPoolError(f"generations must have one entry per page: got {gens.shape[0]} for {count} pages")
        return gens, 1

    def _exhausted(self, need: int) -> None:
        """Log an exhausted call at INFO, at most once a second (as the originals do)."""
        now = time.monotonic()
        if now - self._last_exhaust_log >= 1.0:
            self._last_exhaust_log = now
            log.info("HostPagePool exhausted: %d pages asked for, %d free", need, self.available_size())

    def _fault(self, beyond: dict[int, int], position: int) -> tuple[int, int]:
        """The page a failed kernel stopped at (as it read it) and the generation it was given."""
        st = self._st
        return beyond.get(position, int(st[_layout.HP_FAULT])), int(st[_layout.HP_FAULT_GEN])

    def _page_error(self, status: int, what: str, op: str, beyond: dict[int, int]) -> Exception:  # noqa: PLR0911
        """Why a kernel refused ``what`` in ``op`` (``release``, ``free``, or ``lock_ref``: the pins); one per code."""
        code, pos = _layout.decode_status(status)
        page, given = self._fault(beyond, pos)
        if code == _layout.E_RANGE:
            return SlotRangeError(f"{what}={shown(page)} outside pool range [0, {self.pool_size})")
        if code == _layout.E_NOT_ALLOCATED and op == "lock_ref":
            return PageNotAllocatedError(f"{what}={page} is not allocated (in free-list)")
        if code == _layout.E_NOT_ALLOCATED:
            return PageDoubleFreeError(f"double free of {what}={page}")
        if code == _layout.E_UNDERFLOW:
            return LockRefUnderflowError(f"dec_lock_ref underflow on {what}={page}")
        if code == _layout.E_STALE:
            return StaleFreeError(
                f"stale {op} of {what}={page}: it was handed out again since generation {given} "
                f"(its generation is {int(self.generation[page])})"
            )
        if code == _layout.E_PINNED:
            verb = "release" if op == "release" else "free"
            return PinnedPageError(f"{verb} of locked {what}={page} (lock_ref={int(self.lock_ref[page])})")
        return self._corrupt(op, status)


def elements(array: NDArray[Any]) -> memoryview:
    """A read-only memoryview of ``array``: an element reads as a Python int or bool, nearly as fast as a list's."""
    return memoryview(array).toreadonly()  # type: ignore[arg-type]  # ndarray is a buffer; its stubs say so only on 3.12+


def _read_only(view: NDArray[Any]) -> NDArray[Any]:
    view.flags.writeable = False
    return view
