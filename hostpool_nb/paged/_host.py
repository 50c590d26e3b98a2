"""``HostKVPoolMixin``: sglang-jax's host KV pools (LRU and queue) with their books on a :class:`HostPagePool`."""

from __future__ import annotations

import importlib
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from .._convert import INT64, as_count
from .._core.host import HOST_KERNELS, NO_OUT, STATUS_SHORT, HostPagePool, elements, empty
from .._errors import HostPoolError
from .._fork import follow as follow_lock
from .._kernels import layout as _layout

# sglang-jax's PD metrics module: the host class's release adds 1 to its host_pool_free.
PD_METRICS = "sgl_jax.srt.disaggregation.common.metrics"


def _kept_count(index: int) -> property:
    """A count of a host class's that the pool's header word ``index`` keeps: 0 before the pool exists, set ignored."""

    def get(self: Any) -> int:
        header = getattr(self, "_header", None)
        return 0 if header is None else int(header[index])

    def ignore(self: Any, value: int) -> None:
        """The host class's ``__init__`` sets it; the pool keeps the count."""

    return property(get, ignore)


class HostKVPoolMixin:
    """Put sglang-jax's host KV pools' bookkeeping on a :class:`~hostpool_nb.HostPagePool`, in one class line.

    ::

        class FastLRU(HostKVPoolMixin, LRUHostKVPool): ...
        class FastQueue(HostKVPoolMixin, QueueHostKVPool): ...

    The host class's own ``__init__`` runs first (it allocates the data
    plane and sets ``_pool_size``); then ``reserve``, ``release``, ``alloc``,
    ``free``, ``available_size``, ``inc_lock_ref``, ``dec_lock_ref`` and
    ``_require_allocated`` keep their books in a ``HostPagePool`` of that
    size, ``_host_pages``. Its lock is ``_lock``, and ``_allocated``,
    ``_generation`` and ``_lock_ref`` are read-only views of its arrays
    (memoryviews: an element reads as a Python ``bool`` or ``int``, as from
    the original's lists), so the host class's transfer methods, which read
    them under ``_lock``, keep working unchanged. ``_peak_used`` and
    ``_exhaust_count`` read the pool's counters. The host class's own free
    list is left as its ``__init__`` made it, unused.

    What the host class's methods do beyond the bookkeeping still happens,
    in the same order and under the same conditions (docs/behaviour.md,
    section 4):

    - for each page freed or released, under the lock and in order, the
      host class's ``_drop_pending(page)`` and ``_slots[page] = None`` (where
      the class has them);
    - an exhausted ``reserve`` or ``alloc`` logs one INFO line, at most once
      a second, under the lock, on the logger of the module that defines
      the host class's ``reserve``;
    - where the host class reports PD metrics (it has ``_inc_alloc_metric``,
      as ``QueueHostKVPool``): after a successful ``reserve``, with the lock
      released, ``_inc_alloc_metric()``; after a successful ``release``,
      ``_inc_free_metric()``, which adds 1 to sglang-jax's
      ``host_pool_free(pool_name, 1)`` unless the host class defines its own.

    What differs from the host class is ``HostPagePool``'s: every call is
    checked whole before anything changes (the original frees the pages
    before a bad one), errors are its subclasses of the originals'
    ``ValueError`` / ``RuntimeError``, and ``free`` and ``release`` take
    ``generations=`` / ``generation=`` to refuse stale frees. Should a
    ``_drop_pending`` raise, the pages are freed all the same and the rest
    still dropped; its first exception is raised at the end.

    Examples
    --------
    >>> from hostpool_nb.originals.host_tier import QueueHostKVPool
    >>> from hostpool_nb.paged import HostKVPoolMixin
    >>> class FastQueue(HostKVPoolMixin, QueueHostKVPool):
    ...     pass
    >>> pool = FastQueue(4)
    >>> pool.reserve(), pool.reserve(), pool.available_size()
    (0, 1, 2)
    >>> pool.release(0)
    >>> pool.release(0)  # the original would append it to its free list twice
    Traceback (most recent call last):
    ...
    hostpool_nb.PageDoubleFreeError: double free of buffer_id=0
    """

    _host_pages: HostPagePool
    _pool_size: int
    _pool_name: str

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pages = HostPagePool(self._pool_size)
        self._host_pages = pages
        self._lock = pages.lock
        follow_lock(self, "_lock", pages)  # a fork that makes the pool's lock unusable in a child, makes this one
        self._header = pages._words
        self._allocated = elements(pages.allocated)
        self._generation = elements(pages.generation)
        self._lock_ref = elements(pages.lock_ref)
        cls = type(self)
        self._drops = callable(getattr(cls, "_drop_pending", None))
        self._clears = isinstance(getattr(self, "_slots", None), list)
        self._reports = callable(getattr(cls, "_inc_alloc_metric", None))
        self._log = logging.getLogger(_logging_module(cls))

    def _kernel_calls(self) -> list[tuple[Any, str]]:
        """Its host page pool's (``hostpool_nb.warmup.load``)."""
        return self._host_pages._kernel_calls()

    # -- allocation -----------------------------------------------------------------

    def reserve(self) -> int | None:
        """``HostPagePool.reserve``: the first free page, or ``None`` (logged, counted)."""
        lock = self._host_pages.lock
        lock.acquire()
        try:
            page: int = HOST_KERNELS.reserve(self._host_pages._st)
            if page == STATUS_SHORT:
                self._log_exhausted(1)
        finally:
            lock.release()
        if page >= 0:
            if self._reports:
                self._inc_alloc_metric()
            return page
        if page == STATUS_SHORT:
            return None
        raise self._host_pages._corrupt("reserve", page)

    def alloc(self, need_pages: int) -> NDArray[np.int64] | None:
        """``HostPagePool.alloc`` (its parameters): the first ``need_pages`` free pages, or ``None`` (logged)."""
        if type(need_pages) is not int:
            need_pages = as_count(need_pages, "need_pages")
        if need_pages <= 0:
            raise HostPoolError(f"need_pages must be positive, got {need_pages}")
        out = empty(min(need_pages, self._pool_size + 1), INT64)
        lock = self._host_pages.lock
        lock.acquire()
        try:
            status: int = HOST_KERNELS.alloc(self._host_pages._st, out)
            if status == STATUS_SHORT:
                self._log_exhausted(need_pages)
        finally:
            lock.release()
        if status >= 0:
            return out
        if status == STATUS_SHORT:
            return None
        raise self._host_pages._corrupt("alloc", status)

    # -- freeing ----------------------------------------------------------------------

    def release(self, buffer_id: int, *, generation: int | None = None) -> None:
        """``HostPagePool.release`` (its parameters); the page's transfers and payload dropped, then the metric."""
        pages = self._host_pages
        lock = pages.lock
        if type(buffer_id) is int and generation is None and 0 <= buffer_id < self._pool_size:
            lock.acquire()
            try:
                status: int = HOST_KERNELS.release(pages._st, buffer_id, 0, 0)
                if status < 0:
                    raise pages._page_error(status, "buffer_id", "release", {})
                self._forget((buffer_id,))
            finally:
                lock.release()
        else:  # every other argument: the pool checks and says what is wrong
            with lock:
                pages.release(buffer_id, generation=generation)
                self._forget((int(buffer_id),))
        if self._reports:
            self._inc_free_metric()

    def free(self, host_page_ids: Any, *, generations: Any = None) -> int:
        """``HostPagePool.free``, then each freed page's pending transfers and payload dropped, under the lock.

        The whole input is read first: a generator that releases a page of
        this pool while it is read leaves this call's freed pages, and so
        what is dropped, as they are. Parameters and result: ``HostPagePool.free``'s.
        """
        pool = self._host_pages
        pages, beyond, gens, check = pool._free_arguments(host_page_ids, generations)
        listed = self._drops or self._clears
        out = empty(pages.shape[0], INT64) if listed else NO_OUT
        lock = pool.lock
        lock.acquire()
        try:
            count = pool._free_locked(pages, beyond, gens, check, out)
            if listed and count:
                self._forget(out[:count].tolist())
        finally:
            lock.release()
        return count

    def available_size(self) -> int:
        """The number of free pages."""
        lock = self._host_pages.lock
        lock.acquire()
        free: int = self._header[_layout.HP_NFREE]
        lock.release()
        return free

    # -- pins -------------------------------------------------------------------------

    def inc_lock_ref(self, buffer_id: Any) -> None:
        """:meth:`HostPagePool.inc_lock_ref`: pin a page, or each page of a 1-D array (its parameters, its errors)."""
        self._host_pages._pin(buffer_id, 1)

    def dec_lock_ref(self, buffer_id: Any) -> None:
        """:meth:`HostPagePool.dec_lock_ref`: unpin a page, or each page of a 1-D array (its parameters, its errors)."""
        self._host_pages._pin(buffer_id, -1)

    def _require_allocated(self, buffer_id: int) -> None:
        # The transfer methods call this per page under the lock: an allocated page costs two tests.
        try:
            if 0 <= buffer_id < self._pool_size and self._allocated[buffer_id]:
                return
        except TypeError:
            pass  # not an integer: the pool says so
        self._host_pages.require_allocated(buffer_id)

    # -- the host class's side effects ------------------------------------------------

    def _inc_free_metric(self) -> None:
        """Add 1 to sglang-jax's PD metric ``host_pool_free`` (what its ``release`` does); errors ignored."""
        try:  # noqa: SIM105 - not contextlib.suppress, which costs a third of a release
            importlib.import_module(PD_METRICS).host_pool_free(self._pool_name, 1)
        except Exception:  # noqa: BLE001 - metrics never fail a call, as in the original
            pass

    def _log_exhausted(self, need: int) -> None:
        """Log an exhausted call at INFO, at most once a second, under the lock (as the host class does)."""
        now = time.time()
        if now - getattr(self, "_last_exhaust_log", 0.0) >= 1.0:
            self._last_exhaust_log = now
            self._log.info(
                "host pool %s exhausted: %d pages asked for, %d free (size=%d, peak_used=%d, exhaust_count=%d)",
                getattr(self, "_pool_name", type(self).__name__),
                need,
                self._header[_layout.HP_NFREE],
                self._pool_size,
                self._header[_layout.HP_PEAK],
                self._header[_layout.HP_EXHAUSTED],
            )

    def _forget(self, freed: list[int] | tuple[int, ...]) -> None:
        """For each freed page, in order, what the host class does: drop its staged transfers, clear its payload.

        Every page is seen to even if a ``_drop_pending`` raises; the first
        such exception is raised once all are done.
        """
        failed: BaseException | None = None
        drop = self._drop_pending if self._drops else None
        slots = self._slots if self._clears else None
        for page in freed:
            if drop is not None:
                try:
                    drop(page)
                except Exception as exc:  # noqa: BLE001 - raised below, after every page
                    failed = failed or exc
            if slots is not None:
                slots[page] = None
        if failed is not None:
            raise failed

    if TYPE_CHECKING:  # what the host class provides, where it does

        def _drop_pending(self, page: int) -> None: ...
        def _inc_alloc_metric(self) -> None: ...

        _slots: list[Any]

    # The host class's __init__ sets these two before the pool exists (until then, 0); the pool keeps the counts.
    _peak_used = _kept_count(_layout.HP_PEAK)
    _exhaust_count = _kept_count(_layout.HP_EXHAUSTED)


def _logging_module(cls: type) -> str:
    """Where the host class logs: the module of the class (after the mixin) whose ``reserve`` the mixin replaces."""
    mro = cls.__mro__
    after = mro[mro.index(HostKVPoolMixin) + 1 :]
    owner = next((c for c in after if "reserve" in vars(c) or "alloc" in vars(c)), after[0])
    return owner.__module__
