"""What a ``LogicalHostPool`` shows and keeps of its state: snapshots and pickles, statistics, leak reports,
its trace's shape, the invariants check and its repr. The calls that change the state are ``_core/pool.py``'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._convert import as_count
from .._diagnostics.invariants import pool_problems
from .._diagnostics.snapshot import PoolState, checked_words, upgraded_words
from .._diagnostics.tracking import Outstanding, Tracker, excluded, leak_report
from .._errors import HostPoolError
from .._kernels import layout as _layout
from .._kernels import pool as _kernels
from .._kernels.jit import Entries
from .protocol import ArrayStatePool, Recordable, recorded_kind, start_words
from .stats import PoolStats

MERGE_ORDERS = ("fifo", "sorted")
_CORE = Entries(_kernels.POOL)  # the core pool's kernels beyond alloc and free, each compiled on its first use


class _PoolStateKeeping(Recordable, ArrayStatePool):
    """The pool's state as others see it; ``LogicalHostPool`` holds the calls that change it."""

    # Set by LogicalHostPool._setup.
    size: int
    page_size: int
    merge_order: str
    layout: str
    track: bool
    _st: NDArray[np.int64]
    _owner: NDArray[np.uint8]
    _tracker: Tracker | None
    _setup: Callable[..., None]

    # -- snapshots and pickling -----------------------------------------------

    def _snapshot(self) -> PoolState:
        """The state and its site table, as of one moment (under the lock): ``PoolState`` makes the one copy."""
        tracker = self._tracker
        sites = None if tracker is None else tracker.table()
        return PoolState(self.size, self.page_size, self.merge_order, self._st, sites)

    def _checked(self, state: PoolState) -> tuple[NDArray[np.int64], Any]:
        """A snapshot's words, checked for this pool (its size, page size, merge order and tracking)."""
        words = checked_words(
            state._words,
            (self.size, self.page_size, self.merge_order, self.track),
            (state.size, state.page_size, state.merge),
            "the state",
            state.sites,
        )
        return words, state.sites

    def _load(self, checked: tuple[NDArray[np.int64], Any]) -> None:
        words, sites = checked
        _CORE.load_state(self._st, words, 1)
        if self._tracker is not None:  # the ids in the restored words index the snapshot's sites
            self._tracker.load(sites)

    def _pickled(self) -> dict[str, Any]:
        """The shape, the layout and one state copy, with its site table."""
        tracker = self._tracker
        return {
            "size": self.size,
            "page_size": self.page_size,
            "layout": self.layout,
            "merge": self.merge_order,
            "state": _layout.persisted(self._st),
            "sites": None if tracker is None else tracker.table(),
        }

    def _upgraded(self, saved: dict[str, Any]) -> dict[str, Any]:
        """A format-3 pickle: its state words with one run per page."""
        return {**saved, "state": upgraded_words(saved["state"])} if "state" in saved else saved

    def _unpickled(self, saved: dict[str, Any], what: str) -> None:
        missing = sorted({"size", "page_size", "layout", "merge", "state"} - set(saved))
        if missing:
            raise HostPoolError(f"{what} lacks {', '.join(missing)}")
        size, page_size, merge = saved["size"], saved["page_size"], saved["merge"]
        if type(size) is not int or type(page_size) is not int or page_size < 1 or size < 0 or size % page_size:
            raise HostPoolError(f"{what} has size={size!r}, page_size={page_size!r}: not a pool's shape")
        if merge not in MERGE_ORDERS:
            raise HostPoolError(f"{what} has merge={merge!r}, not 'fifo' or 'sorted'")
        shape = (size, page_size, merge)
        sites = saved.get("sites")
        words = checked_words(saved["state"], (*shape, sites is not None), shape, what, sites)
        self._setup(size, page_size, saved["layout"], merge, words, None if sites is None else Tracker(list(sites)))

    # -- statistics -----------------------------------------------------------

    def stats(self) -> PoolStats:
        """Usage and counters now, read from the state's header in O(1)."""
        with self.lock:
            header = self._st[: _layout.HEADER].copy()
        return PoolStats.from_header(header)

    # -- diagnostics ----------------------------------------------------------

    def outstanding(self, *, exclude: Any = None) -> list[Outstanding]:
        """The pages allocated now, grouped by the call site and tag that allocated them.

        Largest groups first (then oldest). Each record has ``site``
        (``"file:line in function"`` of the first frame outside
        hostpool_nb), ``tag``, ``pages``, ``slots``, ``allocations`` and
        ``oldest`` (the number of the group's oldest allocation). O(pages).

        Parameters
        ----------
        exclude : array_like of int, optional, keyword-only
            Slots known to be held legitimately (a cache's, say): their
            pages are left out, so what remains is what nobody accounts for.

        Raises
        ------
        HostPoolError
            If the pool was not constructed with ``track=True``;
            :class:`SlotRangeError` for an ``exclude`` slot outside the pool.
        """
        tracker = self._tracker
        if tracker is None:
            raise HostPoolError(
                "outstanding() needs a tracking pool: construct it with track=True "
                "(leak_report() still says how much is allocated)"
            )
        skip = excluded(exclude, self.size // self.page_size, self.page_size, "the pool")
        with self.lock:
            return tracker.outstanding(self._st, self._owner, self.page_size, skip)

    def _trace_shape(self) -> dict[str, Any]:
        return {
            "pool": recorded_kind(self),
            "size": self.size,
            "page_size": self.page_size,
            "merge": self.merge_order,
            "track": self.track,
            "dp_size": 1,
            "strict": False,
            "debug_mode": False,
            "size_swa": 0,
        }

    def _trace_start(self) -> NDArray[np.int64]:
        return start_words([(int(self._st[_layout.H_GROUP_DEPTH]), *_layout.lists_of(self._st))])

    def leak_report(self, limit: int = 20, *, exclude: Any = None) -> str:
        """A readable table of what is allocated now and where, for logs and test failures.

        Groups by call site and tag, largest first, at most ``limit`` rows;
        says so plainly when nothing is allocated. Without ``track=True``
        it gives the totals and says how to see the sites.

        Parameters
        ----------
        limit : int, optional
            The most rows to show (20 by default).
        exclude : array_like of int, optional, keyword-only
            Slots known to be held legitimately: left out of the report and
            its totals (:meth:`outstanding`).
        """
        limit = as_count(limit, "limit")
        if limit < 0:
            raise HostPoolError(f"limit must be non-negative, got limit={limit}")
        n = self.size // self.page_size
        skip = excluded(exclude, n, self.page_size, "the pool")
        with self.lock:  # the totals and the records as of one moment
            held = self._owner == _layout.OWNER_ALLOCATED
            pages = int(np.count_nonzero(held if skip is None else held & ~skip))
            tracker = self._tracker
            records = None if tracker is None else tracker.outstanding(self._st, self._owner, self.page_size, skip)
        name = f"{type(self).__name__}(size={self.size}, page_size={self.page_size})"
        return leak_report(name, records, pages, self.page_size, limit)

    # -- checks ----------------------------------------------------------

    def _corruption(self) -> str | None:
        """What ``check_invariants`` reports (under the lock).

        Checks, independently of the kernels, that the counters agree, that
        every page id on the free, release and pending lists is in range,
        flagged accordingly and listed once, that every page not listed is
        held by a caller, and that a sorted pool's free list ascends.
        """
        tracker = self._tracker
        sites = None if tracker is None else tracker.table()
        found = pool_problems(self._st, self.size // self.page_size, self.page_size, sites)
        return "LogicalHostPool state is corrupted: " + "; ".join(found) if found else None

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"{type(self).__name__}(size={s.size}, page_size={s.page_size}, merge={self.merge_order!r}: "
            f"{s.allocated_pages}/{s.num_pages} pages allocated ({s.usage:.1%}), "
            f"available={s.available_size}, pending_pages={s.pending_pages})"
        )
