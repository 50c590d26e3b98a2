"""Snapshots and invariants of ``hostpool_nb.paged``'s per-rank state.

A rank's lists are a core-layout state array (``_paged_kernels.py``), so the
core's invariant check applies to it, plus what is particular to a paged
rank: page 0 is the padding page (held forever, never listed), a paged
rank's free list ascends, and the core's own pending list and groups are
unused (free groups live in the separate group buffer, outside snapshots,
as in the original).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import _kernels as K
from . import _paged_kernels as P
from ._errors import HostPoolError
from ._invariants import owner_flags, problems

FORMAT = 1


def rank_problems(st: NDArray[np.int64], pages: int, page_size: int, sorted_order: bool) -> list[str]:
    """Every way ``st`` breaks a rank's invariants; empty if none. O(pages)."""
    found = problems(st, pages + 1, page_size)
    if found:
        return found
    owner = owner_flags(st, pages + 1)
    if owner[0] != K.OWNER_ALLOCATED:
        found.append(f"the padding page 0 has owner flag {int(owner[0])}, expected {K.OWNER_ALLOCATED}")
    if int(st[K.H_NPEND]) or int(st[K.H_GROUP_DEPTH]):
        found.append("a rank's core pending list and group depth must stay empty")
    if bool(int(st[K.H_SORTED])) != sorted_order:
        found.append(f"merge order word is {int(st[K.H_SORTED])}, expected {int(sorted_order)}")
    return found


def group_problems(gp: NDArray[np.int64], st: NDArray[np.int64], pages: int) -> list[str]:
    """Every way a rank's group buffer breaks its invariants; empty if none."""
    count, cap = int(gp[P.GP_COUNT]), int(gp[P.GP_CAP])
    if cap != pages + 1 or gp.shape[0] != P.group_layout(pages):
        return [f"group buffer of capacity {cap} and length {gp.shape[0]} for {pages} pages"]
    if not 0 <= count <= cap:
        return [f"group buffer holds {count} pages"]
    ids = gp[P.GP_HEADER : P.GP_HEADER + count]
    marks = gp[P.GP_HEADER + cap :].view(np.uint8)[:cap]
    if count and (ids.min() < 1 or ids.max() > pages):
        return ["a pending page id is out of range"]
    expected = np.zeros(cap, dtype=np.uint8)
    expected[ids] = P.MARK_PENDING
    if len(np.unique(ids)) != count or not np.array_equal(marks, expected):
        return ["the pending pages and their marks disagree"]
    return []


@dataclass(frozen=True, eq=False)
class PagedState:
    """An immutable snapshot of a paged allocator's lists, from ``backup_state()``.

    Like the original's, it holds every rank's free and release lists and
    not the free group: restoring it leaves an open group, and the frees
    pending in it, as they are.
    """

    kind: str
    size: int
    page_size: int
    dp_size: int
    _ranks: tuple[NDArray[np.int64], ...] = field(repr=False)

    def __post_init__(self) -> None:
        ranks = []
        for words in self._ranks:
            copy = np.array(words, dtype=np.int64, copy=True)
            copy.flags.writeable = False
            ranks.append(copy)
        object.__setattr__(self, "_ranks", tuple(ranks))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load, (FORMAT, (self.kind, self.size, self.page_size, self.dp_size, self._ranks)))


def _load(version: int, fields: tuple[Any, ...]) -> PagedState:
    """Unpickle a ``PagedState``, refusing another format."""
    if version != FORMAT:
        raise HostPoolError(f"this PagedState was pickled in format {version!r}; this hostpool_nb reads {FORMAT}")
    kind, size, page_size, dp_size, ranks = fields
    return PagedState(kind, size, page_size, dp_size, tuple(ranks))
