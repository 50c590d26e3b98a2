"""Snapshots of every pool's state, the format numbers of their pickles, and the checks before loading one.

A pool's whole state is int64 arrays (``_kernels/layout.py``), so a snapshot is a
copy of them plus the shape they belong to. Snapshots and pickled pools
carry the format of their layout (:data:`FORMATS`, checked by
:func:`check_format`); a state is taken only by a pool of the same shape,
and only once it passes the invariants, so neither a snapshot from another
pool nor a tampered pickle can corrupt one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import HostPoolError
from .._kernels import layout as _layout
from .invariants import envelope_problems, host_problems, interleaved_problems, pool_problems, rank_problems
from .tracking import site_id_problems, table_problem

# The layout each kind of state is in. A pickle in another format was made by
# a hostpool_nb whose kernels read the arrays differently: the core's format 2
# had int64 ring entries, 3 int32 page ids one per entry, 4 runs
# (``_kernels/layout.py``); the paged allocators' 1 was the core's 3, 2 its 4, 3 adds
# the site tables of tracking allocators (``track=True``).
FORMATS = {
    "LogicalHostPool": 4,
    "PoolState": 4,
    "PagedAllocator": 3,  # a paged or token allocator's pickle
    "PagedState": 3,
    "HostPagePool": 1,
    "HostPageState": 1,
    "SWAState": 1,
    "InterleavedPagePool": 1,
    "InterleavedPageState": 1,
    "EnvelopePagePool": 1,
    "EnvelopePageState": 1,
}
# Formats this version still loads, converted (:func:`upgraded_words`): a
# list of one page per entry is a list of runs of one page each.
CONVERTS = {"LogicalHostPool": 3, "PoolState": 3, "PagedAllocator": 1, "PagedState": 1}
# Older formats this version reads as they are: their words are today's; they
# only lack what came later (a format-2 paged pickle is of an allocator that
# could not track).
READS = {"PagedAllocator": 2, "PagedState": 2}
# What wrote a format this version refuses.
_WRITTEN_BY = {2: "hostpool_nb before its ring held int32 page ids"}
FORMAT = FORMATS["LogicalHostPool"]


@dataclass(frozen=True, eq=False)
class PoolState:
    """An immutable copy of a pool's state, from ``pool.backup_state()``.

    Give it to ``restore_state`` of the same pool, or of any pool with the
    same ``size``, ``page_size`` and ``merge`` order, to make every later
    call behave exactly as it would have at the backup. It can be pickled.

    Attributes
    ----------
    size, page_size : int
        The shape of the pool it was taken from.
    merge : str
        That pool's merge order, ``"fifo"`` or ``"sorted"``.
    sites : tuple of Site, or None
        A tracking pool's call sites and tags at the backup (the ids in the
        state index them); ``None`` for a pool that does not track.

    Examples
    --------
    >>> from hostpool_nb import LogicalHostPool
    >>> pool = LogicalHostPool(64, 16)
    >>> state = pool.backup_state()
    >>> state  # doctest: +NORMALIZE_WHITESPACE
    PoolState(size=64, page_size=16, merge='fifo',
              free_pages=4, released_pages=0, pending_pages=0)
    >>> first = pool.alloc(32)
    >>> pool.restore_state(state)
    >>> bool((pool.alloc(32) == first).all())  # the same slots again
    True
    """

    size: int
    page_size: int
    merge: str
    _words: NDArray[np.int64] = field(repr=False)
    sites: tuple[Any, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_words", frozen_words(self._words, "the PoolState"))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_state, (FORMATS["PoolState"], (self.size, self.page_size, self.merge, self._words, self.sites)))

    def __repr__(self) -> str:
        h = self._words
        return (
            f"PoolState(size={self.size}, page_size={self.page_size}, merge={self.merge!r}, "
            f"free_pages={int(h[_layout.H_NFREE])}, released_pages={int(h[_layout.H_NREL])}, "
            f"pending_pages={int(h[_layout.H_NPEND])})"
        )


def frozen_words(words: Any, what: str, *, core: bool = True) -> NDArray[np.int64]:
    """A snapshot's state words as a read-only int64 copy; ``HostPoolError`` for anything that is not one.

    A damaged pickle may hold any object here: only a 1-D array of integers
    is a state (numpy would read a list of digit strings, or floats, as
    numbers), and the checks before a load need its values as they are. A
    ``core`` state (a pool's, a rank's) is kept as :func:`_kernels.layout.persisted` keeps it.
    """
    if not isinstance(words, np.ndarray) or words.ndim != 1 or words.dtype.kind not in "iu":
        kind = f"{words.dtype} array of shape {words.shape}" if isinstance(words, np.ndarray) else type(words).__name__
        raise HostPoolError(f"{what} holds a {kind}, not a pool's state words (a 1-D int64 array)")
    frozen = np.array(words, dtype=np.int64, copy=True)
    if core and frozen.shape[0] > _layout.H_AVAIL:
        frozen[_layout.H_AVAIL] = 0
    frozen.flags.writeable = False  # frozen means the contents too
    return frozen


def _load_state(version: int, fields: tuple[Any, ...]) -> PoolState:
    """Unpickle a ``PoolState``, refusing another format."""
    old = check_format(version, "PoolState")
    size, page_size, merge, words, sites = fields
    return PoolState(size, page_size, merge, upgraded_words(words) if old else words, sites)


def check_format(version: Any, kind: str, what: str | None = None) -> bool:
    """Refuse a pickle of ``kind`` (a key of :data:`FORMATS`) in a format this version neither reads nor converts.

    Returns whether it is in the older format of :data:`CONVERTS`, whose
    state words :func:`upgraded_words` converts. ``what`` names it in the
    message (a subclass's name), ``kind`` by default.
    """
    expected = FORMATS[kind]
    what = what or kind
    if version == expected or (type(version) is int and version == READS.get(kind)):
        return False
    if type(version) is int and version == CONVERTS.get(kind):
        return True
    if type(version) is int and version > expected:
        by = "a newer hostpool_nb"
    else:
        by = _WRITTEN_BY.get(version, "no hostpool_nb this one knows") if type(version) is int else "no hostpool_nb"
    raise HostPoolError(
        f"this {what} was pickled in state format {version!r}, written by {by}; this hostpool_nb reads format "
        f"{expected}{_also(kind)} (pickle it again with the same hostpool_nb version that loads it)"
    )


def _also(kind: str) -> str:
    also = f" and {READS[kind]}" if kind in READS else ""
    return also + (f" and converts format {CONVERTS[kind]}" if kind in CONVERTS else "")


def upgraded_words(words: Any) -> Any:
    """A core state in the format before runs (one page id per ring entry), in today's; anything else as it is.

    Each entry becomes a run of one page: the entry counts are the page
    counts, in header words that were spare (zero) then. The checks that
    follow refuse whatever is not a valid state.
    """
    if not isinstance(words, np.ndarray) or words.ndim != 1 or words.dtype.kind not in "iu":
        return words
    if words.shape[0] < _layout.HEADER:
        return words
    new = np.array(words, dtype=np.int64, copy=True)
    new[[_layout.H_EFREE, _layout.H_EREL, _layout.H_EPEND]] = new[[_layout.H_NFREE, _layout.H_NREL, _layout.H_NPEND]]
    return new


def checked_words(
    words: Any, pool: tuple[int, int, str, bool], source: tuple[int, int, str], what: str, sites: Any = None
) -> NDArray[np.int64]:
    """``words`` as a state for ``pool``, or a ``HostPoolError`` saying why not.

    ``pool`` is the (size, page_size, merge, track) of the pool taking the
    state, ``source`` the (size, page_size, merge) the state says it came
    from; a state must come from a pool that tracks as this one does, and
    ``sites`` is the site table that comes with a tracking state: it must
    be one a pool could have made, and every page's site ids must name its
    entries.
    """
    size, page_size, merge, track = pool
    if source != pool[:3]:
        raise HostPoolError(
            f"{what} is from a pool with size={source[0]}, page_size={source[1]}, merge={source[2]!r}; "
            f"this pool has size={size}, page_size={page_size}, merge={merge!r}"
        )
    if not isinstance(words, np.ndarray):
        raise HostPoolError(f"{what} holds a {type(words).__name__}, not a pool state")
    arr = words
    if arr.dtype != np.int64 or arr.ndim != 1:
        raise HostPoolError(f"{what} holds a {arr.dtype} array of shape {arr.shape}, not a pool state")
    arr = np.ascontiguousarray(arr)
    found = pool_problems(arr, size // page_size, page_size, loading=True)
    if not found and int(arr[_layout.H_SORTED]) != (merge == "sorted"):
        found = [f"its merge order word is {int(arr[_layout.H_SORTED])}, but it says merge={merge!r}"]
    if not found and bool(arr[_layout.H_TRACK]) != track:
        raise HostPoolError(
            f"{what} is from a pool with track={bool(arr[_layout.H_TRACK])}; this pool has track={track}"
        )
    if track and sites is None:
        raise HostPoolError(f"{what} has no site table, but this pool tracks: its site ids would index nothing")
    if not track and sites is not None:
        raise HostPoolError(f"{what} has a site table, but this pool does not track")
    if sites is not None:
        problem = table_problem(sites)
        if problem is not None:
            raise HostPoolError(f"{what} has a damaged site table: {problem}")
        if not found:
            found = site_id_problems(arr, sites)
    if found:
        raise HostPoolError(f"{what} fails the pool's invariants: " + "; ".join(found))
    return np.array(arr, dtype=np.int64, copy=True)  # writable: a kernel argument is never read-only


@dataclass(frozen=True, eq=False)
class PagedState:
    """An immutable snapshot of a paged allocator's lists, from ``backup_state()``.

    Like the original's, it holds every rank's free and release lists and
    not the free group: restoring it leaves an open group, and the frees
    pending in it, as they are. A tracking allocator's state holds each
    rank's site table too (``sites``), which its pages' words index.

    Examples
    --------
    >>> from hostpool_nb.paged import PagedTokenToKVPoolAllocator
    >>> alloc = PagedTokenToKVPoolAllocator(size=64, page_size=4, kvcache=None)
    >>> state = alloc.backup_state()
    >>> alloc.alloc(8)
    array([ 4,  5,  6,  7,  8,  9, 10, 11])
    >>> alloc.restore_state(state)
    >>> alloc.available_size()
    64
    """

    kind: str
    size: int
    page_size: int
    dp_size: int
    _ranks: tuple[NDArray[np.int64], ...] = field(repr=False)
    sites: tuple[tuple[Any, ...], ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self._ranks, (tuple, list)):
            raise HostPoolError(f"the PagedState holds a {type(self._ranks).__name__}, not one state per rank")
        ranks = tuple(frozen_words(words, f"the PagedState's rank {r}") for r, words in enumerate(self._ranks))
        object.__setattr__(self, "_ranks", ranks)

    def __reduce__(self) -> tuple[Any, ...]:
        fields = (self.kind, self.size, self.page_size, self.dp_size, self._ranks, self.sites)
        return (_load_paged, (FORMATS["PagedState"], fields))


def _load_paged(version: int, fields: Any) -> PagedState:
    """Unpickle a ``PagedState``, refusing another format (formats before 3 have no site tables)."""
    old = check_format(version, "PagedState")
    expected = 6 if version == FORMATS["PagedState"] else 5
    if not isinstance(fields, tuple) or len(fields) != expected:
        raise HostPoolError(f"the PagedState pickle of format {version} does not hold its {expected} fields")
    kind, size, page_size, dp_size, ranks, *sites = fields
    if old and isinstance(ranks, (tuple, list)):
        ranks = [upgraded_words(words) for words in ranks]
    return PagedState(kind, size, page_size, dp_size, tuple(ranks), sites[0] if sites else None)


@dataclass(frozen=True, eq=False)
class SWAState:
    """An immutable snapshot of a sliding-window allocator, from ``backup_state()``.

    Both sub-allocators' states (``full``, ``swa``: :class:`PagedState`)
    and every rank's full-to-SWA mapping as of one moment. Its free group
    is not part of it, as for the other allocators.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> from hostpool_nb.paged import SWATokenToKVPoolAllocator
    >>> kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    >>> a, b = (SWATokenToKVPoolAllocator(64, 16, kv, page_size=4) for _ in "ab")
    >>> full = a.alloc(8)
    >>> state = a.backup_state()
    >>> type(state.full).__name__, state.swa.page_size
    ('PagedState', 4)
    >>> b.restore_state(state)  # another of the same sizes takes it
    >>> b.full_available_size(), b.swa_available_size()
    (56, 8)
    >>> mapped = b.full_to_swa_index_mapping[full]
    >>> mapped.tolist() == a.full_to_swa_index_mapping[full].tolist()
    True
    """

    full: PagedState
    swa: PagedState
    _mappings: Any = field(repr=False)  # a tuple of int32 arrays once made; checked here as anything

    def __post_init__(self) -> None:
        for name in ("full", "swa"):
            if type(getattr(self, name)) is not PagedState:
                raise HostPoolError(
                    f"the SWAState's {name} is a {type(getattr(self, name)).__name__}, not a PagedState"
                )
        if not isinstance(self._mappings, (tuple, list)):
            raise HostPoolError(f"the SWAState holds a {type(self._mappings).__name__}, not one mapping per rank")
        frozen = []
        for r, m in enumerate(self._mappings):
            if not isinstance(m, np.ndarray) or m.ndim != 1 or m.dtype.kind not in "iu":
                raise HostPoolError(f"the SWAState's mapping of rank {r} is not a 1-D integer array")
            copy = np.array(m, dtype=np.int32, copy=True)
            copy.flags.writeable = False
            frozen.append(copy)
        object.__setattr__(self, "_mappings", tuple(frozen))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_swa, (FORMATS["SWAState"], (self.full, self.swa, self._mappings)))


def _load_swa(version: Any, fields: Any) -> SWAState:
    """Unpickle an ``SWAState``, refusing another format."""
    check_format(version, "SWAState")
    if not isinstance(fields, tuple) or len(fields) != 3:  # noqa: PLR2004 - full, swa, mappings
        raise HostPoolError("the SWAState pickle does not hold its 3 fields")
    return SWAState(*fields)


@dataclass(frozen=True, eq=False)
class HostPageState:
    """An immutable snapshot of a :class:`HostPagePool`, from ``backup_state()``.

    ``restore_state`` of it, on that pool or any of the same ``pool_size``,
    makes every later call behave as it would have at the backup: the free
    list's order, the allocated pages, their generations and pin counts.

    Examples
    --------
    >>> from hostpool_nb import HostPagePool
    >>> pool = HostPagePool(8)
    >>> state = pool.backup_state()
    >>> pool.alloc(3)
    array([0, 1, 2])
    >>> pool.restore_state(state)
    >>> pool.available_size()
    8
    """

    pool_size: int
    _words: NDArray[np.int64] = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_words", frozen_words(self._words, "the HostPageState", core=False))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_host, (FORMATS["HostPageState"], self.pool_size, self._words))


def _load_host(version: Any, pool_size: Any, words: Any) -> HostPageState:
    """Unpickle a ``HostPageState``, refusing another format."""
    check_format(version, "HostPageState")
    return HostPageState(pool_size, words)


def checked_state_words(
    words: Any, problems: Callable[[NDArray[np.int64]], list[str]], what: str, kind: str
) -> NDArray[np.int64]:
    """``words`` as a fresh state array, or a ``HostPoolError`` saying why not: not a 1-D int64 array, or one that
    breaks the invariants ``problems`` finds (``kind`` names the pool in the message)."""
    if not isinstance(words, np.ndarray):
        raise HostPoolError(f"{what} holds a {type(words).__name__}, not {kind}'s state")
    arr = np.ascontiguousarray(words)
    if arr.dtype != np.int64 or arr.ndim != 1:
        raise HostPoolError(f"{what} holds a {arr.dtype} array of shape {arr.shape}, not {kind}'s state")
    found = problems(arr)
    if found:
        raise HostPoolError(f"{what} fails the pool's invariants: " + "; ".join(found))
    return np.array(arr, dtype=np.int64, copy=True)


def checked_host_words(words: Any, n: int, what: str) -> NDArray[np.int64]:
    return checked_state_words(words, lambda arr: host_problems(arr, n, loading=True), what, "a host pool")


def checked_ranks(  # noqa: PLR0913, PLR0917 - the allocator's shape, spelled out
    ranks: tuple[NDArray[np.int64], ...], dp_size: int, pages: int, page_size: int, sorted_order: bool, track: bool
) -> list[NDArray[np.int64]]:
    """A ``PagedState``'s rank words as fresh arrays for an allocator of that shape; ``HostPoolError`` if not."""
    if len(ranks) != dp_size:
        raise HostPoolError(f"the state holds {len(ranks)} ranks; this allocator has dp_size={dp_size}")
    out = []
    for r, words in enumerate(ranks):
        if not isinstance(words, np.ndarray):
            raise HostPoolError(f"the state of rank {r} is a {type(words).__name__}, not a rank's state words")
        arr = np.ascontiguousarray(words)
        found = rank_problems(arr, pages, page_size, sorted_order, loading=True)
        if found:
            raise HostPoolError(f"the state of rank {r} fails the invariants: " + "; ".join(found))
        if bool(arr[_layout.H_TRACK]) != track:
            raise HostPoolError(
                f"the state of rank {r} is from an allocator with track={bool(arr[_layout.H_TRACK])}; "
                f"this one has track={track}"
            )
        out.append(np.array(arr, dtype=np.int64, copy=True))
    return out


def checked_sites(ranks: list[NDArray[np.int64]], sites: Any, track: bool, what: str) -> None:
    """``HostPoolError`` unless ``sites`` holds a site table per rank that its words index (``None``: untracked)."""
    if not track:
        if sites is not None:
            raise HostPoolError(f"{what} has site tables, but this allocator does not track")
        return
    if not isinstance(sites, tuple) or len(sites) != len(ranks):
        have = f"{len(sites)} site tables" if isinstance(sites, tuple) else f"a {type(sites).__name__}"
        raise HostPoolError(f"{what} holds {have}; this tracking allocator needs one per rank ({len(ranks)})")
    for r, (words, table) in enumerate(zip(ranks, sites, strict=True)):
        problem = table_problem(table)
        if problem is not None:
            raise HostPoolError(f"{what} has a damaged site table for rank {r}: {problem}")
        found = site_id_problems(words, table)
        if found:
            raise HostPoolError(f"the state of rank {r} fails the invariants: " + "; ".join(found))


@dataclass(frozen=True, eq=False)
class InterleavedPageState:
    """An immutable snapshot of an :class:`~hostpool_nb.InterleavedPagePool`, from ``backup_state()``.

    ``restore_state`` of it, on that pool or any of the same shape, makes
    every later call behave as it would have at the backup: each class's
    free list in its order, and which pages are held.

    Examples
    --------
    >>> from hostpool_nb import InterleavedPagePool
    >>> pool = InterleavedPagePool(16, 4, 2)
    >>> state = pool.backup_state()
    >>> pool.alloc(8, 0)
    array([ 8,  9, 10, 11, 12, 13, 14, 15])
    >>> pool.restore_state(state)
    >>> pool.available_size()
    32
    """

    shape: tuple[int, int, int]  # classes, pages per class, page size
    _words: NDArray[np.int64] = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_words", frozen_words(self._words, "the InterleavedPageState", core=False))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_interleaved, (FORMATS["InterleavedPageState"], self.shape, self._words))


def _load_interleaved(version: Any, shape: Any, words: Any) -> InterleavedPageState:
    """Unpickle an ``InterleavedPageState``, refusing another format."""
    check_format(version, "InterleavedPageState")
    return InterleavedPageState(shape, words)


def checked_interleaved_words(words: Any, shape: tuple[int, int, int], what: str) -> NDArray[np.int64]:
    """``words`` as a fresh state for an interleaved pool of ``shape``, or a ``HostPoolError`` saying why not."""
    return checked_state_words(
        words, lambda arr: interleaved_problems(arr, *shape, loading=True), what, "an interleaved pool"
    )


@dataclass(frozen=True, eq=False)
class EnvelopePageState:
    """An immutable snapshot of an :class:`~hostpool_nb.EnvelopePagePool`, from ``backup_state()``.

    ``restore_state`` of it, on that pool or any of the same shape, makes
    every later call behave as it would have at the backup: each side's
    free pages, holes, watermark and map.

    Examples
    --------
    >>> from hostpool_nb import EnvelopePagePool
    >>> pool = EnvelopePagePool(64, {"full": (1, 8, "up")})
    >>> state = pool.backup_state()
    >>> pool.alloc("full", 3).tolist()
    [0, 1, 2]
    >>> pool.restore_state(state)
    >>> pool.available_size("full")
    8
    """

    shape: tuple[int, tuple[tuple[str, int, int, str], ...]]  # total bytes; each side's name, page size, bytes, growth
    _words: NDArray[np.int64] = field(repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_words", frozen_words(self._words, "the EnvelopePageState", core=False))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_envelope, (FORMATS["EnvelopePageState"], self.shape, self._words))


def _load_envelope(version: Any, shape: Any, words: Any) -> EnvelopePageState:
    """Unpickle an ``EnvelopePageState``, refusing another format."""
    check_format(version, "EnvelopePageState")
    return EnvelopePageState(shape, words)


def checked_envelope_words(
    words: Any, shape: tuple[int, tuple[tuple[str, int, int, str], ...]], what: str
) -> NDArray[np.int64]:
    """``words`` as a fresh state for a page-envelope pool of ``shape``, or a ``HostPoolError`` saying why not."""
    return checked_state_words(words, lambda arr: envelope_problems(arr, shape), what, "a page-envelope pool")
