"""Snapshots of a pool's state: ``PoolState``, and the pool's pickled form.

A pool's whole state is one int64 array (``_kernels.py``), so a snapshot is
one copy of it plus the shape it belongs to. Both a snapshot and a pickled
pool carry a format number; a state is accepted only for a pool of the same
size, page size and merge order, and only if it passes the invariants, so
neither a snapshot from another pool nor a tampered pickle can corrupt one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import _kernels as K
from ._errors import HostPoolError
from ._invariants import problems
from ._tracking import site_id_problems, table_problem

# The layout of the state array. A snapshot or pickle of another format was
# made by a hostpool_nb whose kernels read the array differently (format 2:
# int64 ring entries; 3: int32).
FORMAT = 3


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
    """

    size: int
    page_size: int
    merge: str
    _words: NDArray[np.int64] = field(repr=False)
    sites: tuple[Any, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        words = np.array(self._words, dtype=np.int64, copy=True)
        words.flags.writeable = False  # frozen means the contents too
        object.__setattr__(self, "_words", words)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_state, (FORMAT, (self.size, self.page_size, self.merge, self._words, self.sites)))

    def __repr__(self) -> str:
        h = self._words
        return (
            f"PoolState(size={self.size}, page_size={self.page_size}, merge={self.merge!r}, "
            f"free_pages={int(h[K.H_NFREE])}, released_pages={int(h[K.H_NREL])}, "
            f"pending_pages={int(h[K.H_NPEND])})"
        )


def _load_state(version: int, fields: tuple[Any, ...]) -> PoolState:
    """Unpickle a ``PoolState``, refusing another format."""
    check_format(version, "PoolState")
    size, page_size, merge, words, sites = fields
    return PoolState(size, page_size, merge, words, sites)


def check_format(version: Any, what: str) -> None:
    if version != FORMAT:
        raise HostPoolError(
            f"this {what} was pickled in state format {version!r}; this hostpool_nb reads format {FORMAT} "
            "(pickle it again with the same hostpool_nb version that loads it)"
        )


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
    found = problems(arr, size // page_size, page_size)
    if not found and int(arr[K.H_SORTED]) != (merge == "sorted"):
        found = [f"its merge order word is {int(arr[K.H_SORTED])}, but it says merge={merge!r}"]
    if not found and bool(arr[K.H_TRACK]) != track:
        raise HostPoolError(f"{what} is from a pool with track={bool(arr[K.H_TRACK])}; this pool has track={track}")
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
