"""``PoolStats``: a pool's usage and counters, read from its state header in O(1)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from .._kernels import layout as _layout


@dataclass(frozen=True)
class PoolStats:
    """What a pool holds now, and what it has done since it was built.

    Page counts describe the moment of the call: every page is exactly one
    of free (on the free list), released (freed, not merged yet), pending
    (freed inside a free group that has not ended) or allocated (held by a
    caller). The counters only grow; ``clear()`` keeps them.

    Attributes
    ----------
    size, page_size, num_pages : int
        The pool's shape: ``num_pages * page_size == size``.
    free_pages, released_pages, pending_pages, allocated_pages : int
        Pages in each state; they sum to ``num_pages``.
    available_size : int
        Slots an ``alloc`` can hand out now: ``(free + released) * page_size``.
    merges : int
        Times the release list was merged into the free list.
    alloc_calls : int
        ``alloc`` and ``alloc_many`` calls answered, with slots or ``None``
        (calls that raised are not counted).
    failed_allocs : int
        Of those, the ones answered ``None``.
    free_calls : int
        ``free`` calls that freed at least one page.
    peak_allocated_pages : int
        The most pages allocated at once.

    Examples
    --------
    >>> from hostpool_nb import LogicalHostPool
    >>> pool = LogicalHostPool(64, 16)
    >>> pool.free(pool.alloc(32)[:16])
    16
    >>> stats = pool.stats()
    >>> stats.allocated_pages, stats.released_pages, stats.free_pages
    (1, 1, 2)
    >>> stats.available_size
    48
    """

    size: int
    page_size: int
    num_pages: int
    free_pages: int
    released_pages: int
    pending_pages: int
    allocated_pages: int
    available_size: int
    merges: int
    alloc_calls: int
    failed_allocs: int
    free_calls: int
    peak_allocated_pages: int

    @property
    def usage(self) -> float:
        """Fraction of the pages allocated now (0.0 for an empty pool)."""
        return self.allocated_pages / self.num_pages if self.num_pages else 0.0

    @classmethod
    def from_header(cls, header: NDArray[np.int64]) -> PoolStats:
        """Read the statistics from a copy of a state array's header."""
        h = [int(x) for x in header[: _layout.HEADER]]
        n, ps = h[_layout.H_NPAGES], h[_layout.H_PAGE_SIZE]
        free, released, pending = h[_layout.H_NFREE], h[_layout.H_NREL], h[_layout.H_NPEND]
        return cls(
            size=n * ps,
            page_size=ps,
            num_pages=n,
            free_pages=free,
            released_pages=released,
            pending_pages=pending,
            allocated_pages=n - free - released - pending,
            available_size=(free + released) * ps,
            merges=h[_layout.H_MERGES],
            alloc_calls=h[_layout.H_ALLOC_CALLS],
            failed_allocs=h[_layout.H_FAILED_ALLOCS],
            free_calls=h[_layout.H_FREE_CALLS],
            peak_allocated_pages=h[_layout.H_PEAK],
        )


@dataclass(frozen=True)
class HostPageStats:
    """What a :class:`~hostpool_nb.HostPagePool` holds now, and what it has done since it was built.

    Attributes
    ----------
    pool_size, free_pages, allocated_pages, pinned_pages : int
        Pages in all, free, held, and held with a pin count above 0.
    peak_allocated_pages : int
        The most pages held at once (the original's ``_peak_used``).
    alloc_calls : int
        ``reserve`` and ``alloc`` calls answered, with pages or ``None``.
    exhausted_calls : int
        Of those, the ones answered ``None`` (the original's ``_exhaust_count``).
    free_calls : int
        ``release`` and ``free`` calls that freed at least one page.
    clears : int
        ``clear()`` calls.

    Examples
    --------
    >>> from hostpool_nb import HostPagePool
    >>> pool = HostPagePool(8)
    >>> pool.inc_lock_ref(pool.reserve())
    >>> stats = pool.stats()
    >>> stats.allocated_pages, stats.pinned_pages, stats.free_pages
    (1, 1, 7)
    """

    pool_size: int
    free_pages: int
    allocated_pages: int
    pinned_pages: int
    peak_allocated_pages: int
    alloc_calls: int
    exhausted_calls: int
    free_calls: int
    clears: int

    @property
    def usage(self) -> float:
        """Fraction of the pages held now."""
        return self.allocated_pages / self.pool_size
