"""``InterleavedPagePool``: pages striped over owner classes (sglang's page-interleaved KV sharding) on kernels.

All state changes happen in the kernels of ``_kernels/interleaved.py``;
this class checks arguments, holds the lock around the kernels and turns
their status codes into exceptions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._convert import INT64, as_count, own_slots, pool_shape, shown
from .._diagnostics.invariants import interleaved_problems
from .._diagnostics.snapshot import InterleavedPageState, checked_interleaved_words
from .._errors import AlignmentError, DoubleFreeError, HostPoolError, PartialPageError, SlotRangeError
from .._kernels import interleaved as _kernels
from .._kernels import layout as _layout
from .._kernels import pool as _pool_kernels
from .._kernels.jit import Entries
from .host import elements
from .protocol import ArrayStatePool

KERNELS = Entries(_kernels.KERNELS)
_CORE = Entries(_pool_kernels.POOL)  # load_state: checked words copied in
STATUS_SHORT = _layout.status_of(_layout.E_SHORT)
empty = np.empty
_SHAPE = ("shard_size", "pages_per_class", "page_size")


class InterleavedPagePool(ArrayStatePool):
    """Pages owned by ``shard_size`` classes (page ``p`` by class ``p % shard_size``), each class a free list.

    Keeps the books sglang 0.5.23's ``PageInterleavePoolAllocator`` keeps
    for its HiCache host pool (``PageInterleaveHostPool``), with the same
    results for every correct call: ``size`` is one rank's slots, so each
    class lists ``size // page_size`` pages, class ``r`` at first
    ``N + r, 2N + r, ...`` (pages ``0 .. N - 1`` are never handed out).
    ``alloc(need, start_class)`` takes page ``j`` from the front of class
    ``(start_class + j) % N``'s list, or nothing (``None``) when some class
    lacks its share; ``free`` puts each class's freed pages, ascending, at
    the front of its list, so they are drawn again first.

    Unlike the original, every call checks its input before it changes
    anything: whole pages only, each once, in range and allocated (the
    original frees a partial page's other slots, lists a page freed twice
    twice, and files a negative id under the last class).

    Cost: ``alloc`` and ``free`` of ``k`` pages are O(k + N) (a free sorts
    its pages: O(k log k)); ``available_size`` is O(1). Metadata is about
    9 bytes a page, in one int64 array. Thread safety: :attr:`lock` (a
    ``threading.RLock``) guards every change.

    Parameters
    ----------
    size : int
        Slots of one rank (``PageInterleavePoolAllocator``'s ``size``).
    page_size : int
        Slots per page, at least 1.
    shard_size : int
        Owner classes, at least 2.

    Examples
    --------
    >>> from hostpool_nb import InterleavedPagePool
    >>> pool = InterleavedPagePool(12, 4, 2)  # 3 pages a class: 2, 4, 6 and 3, 5, 7
    >>> slots = pool.alloc(12, start_class=1)
    >>> (slots[::4] // 4).tolist()  # from classes 1, 0, 1
    [3, 2, 5]
    >>> pool.available_size(), pool.class_free_page_counts()
    (8, [2, 1])
    >>> pool.free(slots[:4])  # page 3 back to the front of class 1
    4
    >>> pool.free_lists()
    [[4, 6], [3, 7]]
    """

    __module__ = "hostpool_nb"  # its public path, where help(), reprs and pickles find it
    _kind = _format = "InterleavedPagePool"
    _state_class = InterleavedPageState

    def _kernel_calls(self) -> list[tuple[Any, str]]:
        return [(KERNELS, name) for name in _kernels.KERNELS._fields] + [(_CORE, "load_state")]

    def __init__(self, size: int, page_size: int, shard_size: int) -> None:
        size, page_size = pool_shape(size, page_size)
        shard_size = as_count(shard_size, "shard_size")
        if shard_size < 2:  # noqa: PLR2004 - one class is a plain pool
            raise HostPoolError(f"shard_size must be at least 2 (one class is a plain pool), got {shown(shard_size)}")
        per_class = size // page_size
        if _layout.interleaved_pages(shard_size, per_class) > _layout.MAX_PAGES or page_size > _layout.MAX_PAGES:
            raise HostPoolError(
                f"size={shown(size)}, page_size={page_size}, shard_size={shown(shard_size)} is beyond what one "
                "pool's state can index"
            )
        st = np.zeros(_layout.interleaved_state_length(shard_size, per_class), dtype=np.int64)
        st[_layout.IP_CLASSES] = shard_size
        st[_layout.IP_PER_CLASS] = per_class
        st[_layout.IP_PAGE_SIZE] = page_size
        self._setup(st)
        KERNELS.reset(st)
        st[_layout.IP_CLEARS] = 0  # the construction is not a clear() call

    def _setup(self, st: NDArray[np.int64]) -> None:
        self.shard_size = int(st[_layout.IP_CLASSES])
        self.pages_per_class = int(st[_layout.IP_PER_CLASS])
        self.page_size = int(st[_layout.IP_PAGE_SIZE])
        #: Logical slots: every class's pages and the reserved ones, ``page_size`` each.
        self.size = _layout.interleaved_pages(self.shard_size, self.pages_per_class) * self.page_size
        self._most = self.shard_size * self.pages_per_class * self.page_size
        self._per_page_min = self.shard_size * self.page_size
        self._make_lock()
        self._st = st
        self._words = elements(st)
        self._scratch = np.empty(
            self.shard_size * self.pages_per_class + 1, INT64
        )  # a free's pages, sorted: at most every page can pass the checks

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(shard_size, pages_per_class, page_size)``."""
        return self.shard_size, self.pages_per_class, self.page_size

    # -- calls ----------------------------------------------------------------------

    def alloc(self, need_size: int, start_class: int) -> NDArray[np.int64] | None:
        """``need_size`` slots, whole pages, page ``j`` from class ``(start_class + j) % shard_size``.

        Returns
        -------
        numpy.ndarray or None
            A new int64 array of slots, each page's in ascending order;
            ``None`` (nothing taken) when some class has fewer free pages
            than its share.

        Raises
        ------
        TypeError
            If ``need_size`` or ``start_class`` is not an integer.
        AlignmentError
            If ``need_size`` is not a positive multiple of ``page_size``.
        """
        if type(need_size) is not int:
            need_size = as_count(need_size, "need_size")
        if type(start_class) is not int:
            start_class = as_count(start_class, "start_class")
        ps = self.page_size
        if need_size <= 0 or need_size % ps:
            raise AlignmentError(
                f"need_size must be a positive multiple of page_size={ps} (whole pages), got {shown(need_size)}"
            )
        out = empty(min(need_size, self._most + ps), INT64)  # more than every class holds: refused, unallocated
        with self.lock:
            status = KERNELS.alloc(self._st, out, start_class % self.shard_size)
        if status >= 0:
            return out
        if status == STATUS_SHORT:
            return None
        raise self._corrupt("alloc", status)

    def free(self, indices: Any) -> int:
        """Free whole pages; each class's freed pages, ascending, go to the front of its list.

        Parameters
        ----------
        indices : array_like of int
            Slots, whole pages, each page's in ascending order (any order
            of pages); empty frees nothing.

        Returns
        -------
        int
            The number of slots freed.

        Raises
        ------
        TypeError
            If ``indices`` does not hold integers.
        AlignmentError, PartialPageError, SlotRangeError, DoubleFreeError
            If the slots are not whole pages, lie outside the pool, or name
            a page not allocated (or one twice); nothing is freed.
        """
        slots = own_slots(indices)
        if slots.shape[0] == 0:
            return 0
        with self.lock:
            status = KERNELS.free(self._st, slots, self._scratch)
        if status >= 0:
            return int(status)
        raise self._free_error(status, slots)

    def available_size(self) -> int:
        """Slots every class can still supply in turn: ``shard_size * page_size * min(class free pages)``."""
        least: int = self._words[_layout.IP_MIN]
        return self._per_page_min * least

    def class_free_page_counts(self) -> list[int]:
        """Free pages of each class."""
        with self.lock:
            return _layout.interleaved_views(self._st)[0].tolist()  # type: ignore[no-any-return]

    def aggregate_free_size(self) -> int:
        """Free slots over all classes."""
        return sum(self.class_free_page_counts()) * self.page_size

    def least_full_class(self) -> int:
        """The class with the most free pages (the lowest such class): where a new chain starts."""
        counts = self.class_free_page_counts()
        return counts.index(max(counts))

    def free_lists(self) -> list[list[int]]:
        """Each class's free pages, front (drawn next) first."""
        with self.lock:
            counts, stacks, _ = _layout.interleaved_views(self._st)
            return [stacks[r, : counts[r]][::-1].tolist() for r in range(self.shard_size)]

    def clear(self) -> None:
        """Every page free, each class's list as at construction; counters kept."""
        with self.lock:
            KERNELS.reset(self._st)

    # -- the protocol -----------------------------------------------------------------

    def _corruption(self) -> str | None:
        found = interleaved_problems(self._st, *self.shape)
        return "InterleavedPagePool state is corrupted: " + "; ".join(found) if found else None

    def _snapshot(self) -> InterleavedPageState:
        return InterleavedPageState(self.shape, self._st)

    def _checked(self, state: InterleavedPageState) -> NDArray[np.int64]:
        if state.shape != self.shape:
            raise HostPoolError(f"the state is from a pool of shape {state.shape}; this one is {self.shape}")
        return checked_interleaved_words(state._words, self.shape, "the state")

    def _load(self, checked: NDArray[np.int64]) -> None:
        _CORE.load_state(self._st, checked, 0)

    def _pickled(self) -> dict[str, Any]:
        return {"shape": self.shape, "state": self._st.copy()}

    def _unpickled(self, saved: dict[str, Any], what: str) -> None:
        shape = saved.get("shape")
        if not (type(shape) is tuple and len(shape) == len(_SHAPE) and all(type(v) is int and v >= 0 for v in shape)):
            raise HostPoolError(f"{what} has shape={shape!r}")
        self._setup(checked_interleaved_words(saved.get("state"), shape, what))

    def __repr__(self) -> str:
        return (
            f"InterleavedPagePool(shard_size={self.shard_size}, pages_per_class={self.pages_per_class}, "
            f"page_size={self.page_size}: {self.class_free_page_counts()} pages free per class)"
        )

    def _free_error(self, status: int, slots: NDArray[np.int64]) -> Exception:
        code, pos = _layout.decode_status(status)
        ps = self.page_size
        if code == _layout.E_LENGTH:
            return AlignmentError(f"free takes whole pages, got {slots.shape[0]} slots, page_size={ps}")
        slot = int(slots[pos])
        if code == _layout.E_RANGE:
            return SlotRangeError(f"free got slot {slot} at indices[{pos}] (flattened), outside [0, {self.size})")
        if code in (_layout.E_MISALIGNED, _layout.E_PARTIAL):
            return PartialPageError(
                f"free takes whole pages: indices[{pos}] (flattened) is slot {slot}; each run of {ps} entries "
                f"must be one page's slots in ascending order, from a multiple of page_size={ps}"
            )
        if code == _layout.E_DUPLICATE:
            return DoubleFreeError(f"page {slot // ps} is freed twice in one call (again at indices[{pos}])")
        if code == _layout.E_NOT_ALLOCATED:
            reserved = " (reserved: no class lists it)" if slot // ps < self.shard_size else ""
            return DoubleFreeError(
                f"page {slot // ps}{reserved}, freed at indices[{pos}] (flattened), is not allocated: it was freed "
                "already, freed by clear(), or never allocated"
            )
        return self._corrupt("free", status)
