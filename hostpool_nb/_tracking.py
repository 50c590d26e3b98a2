"""Who holds each page: call sites and tags of allocations and frees (``track=True``).

A tracking pool keeps, per page, the number of the allocation that handed it
out and two small ids, in its state array (``_kernels.py``); the kernels
write them as they allocate and free. This module keeps what the ids index:
the table of call sites (file, line, function of the first frame outside
hostpool_nb) and tags, and turns the per-page words into reports.

Id 0 is "unknown" and id 1 is ``clear()`` (it freed every page held then);
real sites start at 2. The table only grows, so an id stays valid for the
life of the pool and of its snapshots.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import _kernels as K

UNKNOWN, CLEARED = 0, 1
_MAX_SITES = 2**31 - 1  # ids share an int64 word with another id
_PACKAGE = __name__.rsplit(".", 1)[0]


@dataclass(frozen=True)
class Site:
    """One allocation or free site: where the call came from, and the caller's tag."""

    file: str
    line: int
    function: str
    tag: Hashable = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


_FIXED = (Site("<unknown>", 0, "?"), Site("<clear()>", 0, "clear"))


@dataclass(frozen=True)
class Outstanding:
    """Pages allocated now from one call site with one tag (``pool.outstanding()``).

    Attributes
    ----------
    site : str
        ``"file:line in function"`` of the allocating call (the first frame
        outside hostpool_nb).
    tag : hashable
        The ``tag`` given to ``alloc`` / ``alloc_many`` (``None`` if none).
    pages, slots : int
        How much of the pool these allocations hold now.
    oldest : int
        The number of the oldest of these allocations (allocations are
        numbered from 1 in the order they were made).
    allocations : int
        How many allocations the pages come from.
    file, line, function : str, int, str
        The site's parts.
    """

    site: str
    tag: Hashable
    pages: int
    slots: int
    oldest: int
    allocations: int
    file: str
    line: int
    function: str


def caller() -> tuple[str, int, str]:
    """File, line and function of the first frame outside hostpool_nb."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return "<unknown>", 0, "?"
    code = frame.f_code
    return code.co_filename, frame.f_lineno, code.co_name


class Tracker:
    """The site table of one pool: ``Site`` by id, id by (file, line, function, tag)."""

    def __init__(self, sites: list[Site] | None = None) -> None:
        self._lock = threading.Lock()
        self._sites: list[Site] = list(sites) if sites else list(_FIXED)
        self._ids: dict[tuple[str, int, str, Hashable], int] = {
            (s.file, s.line, s.function, s.tag): i for i, s in enumerate(self._sites) if i >= len(_FIXED)
        }

    def site_id(self, tag: Hashable) -> int:
        """The id of the calling site with ``tag``, added to the table on first use.

        Raises ``TypeError`` for an unhashable tag, before any state changes.
        """
        file, line, function = caller()
        key = (file, line, function, tag)
        try:
            sid = self._ids.get(key)
        except TypeError:
            raise TypeError(f"tag must be hashable, got {type(tag).__name__} {tag!r}") from None
        if sid is None:
            with self._lock:  # two threads meeting a new site add it once
                sid = self._ids.get(key)
                if sid is None:
                    sid = len(self._sites)
                    if sid > _MAX_SITES:
                        return UNKNOWN
                    self._sites.append(Site(file, line, function, tag))
                    self._ids[key] = sid
        return sid

    def site(self, sid: int) -> Site:
        sites = self._sites
        return sites[sid] if 0 <= sid < len(sites) else sites[UNKNOWN]

    def table(self) -> tuple[Site, ...]:
        """The sites so far: what a snapshot or a pickle keeps."""
        with self._lock:
            return tuple(self._sites)

    def history(self, st: NDArray[np.int64], page: int) -> str:
        """Where ``page`` was last allocated and last freed, for an error message."""
        n = int(st[K.H_NPAGES])
        t = int(st[K.H_TRACK])
        word = int(st[t + n + page])
        seq = int(st[t + page])
        alloc = self.site(word >> 32)
        freed = self.site(word & 0xFFFFFFFF)
        text = f"allocated at {alloc}{_tag_text(alloc.tag)} (allocation #{seq})"
        if (word & 0xFFFFFFFF) == CLEARED:
            return f"{text}, then freed by clear()"
        if (word & 0xFFFFFFFF) != UNKNOWN:
            return f"{text}, then freed at {freed}"
        return text

    def outstanding(self, st: NDArray[np.int64], owner: NDArray[np.uint8], page_size: int) -> list[Outstanding]:
        """The allocated pages grouped by (site, tag), largest first, then oldest first."""
        n = int(st[K.H_NPAGES])
        t = int(st[K.H_TRACK])
        held = np.flatnonzero(owner == K.OWNER_ALLOCATED)
        if held.size == 0:
            return []
        ids = st[t + n + held] >> 32
        seqs = st[t + held]
        # Sort by (site, allocation number): each site's pages are then one
        # run, its oldest allocation first, and allocations are told apart
        # by a change of number. O(P log P) for P pages held, whatever the
        # number of sites or tags.
        order = np.lexsort((seqs, ids))
        ids, seqs = ids[order], seqs[order]
        first_of_site = np.ones(ids.shape[0], dtype=bool)
        first_of_site[1:] = ids[1:] != ids[:-1]
        first_of_alloc = first_of_site.copy()
        first_of_alloc[1:] |= seqs[1:] != seqs[:-1]
        starts = np.flatnonzero(first_of_site)
        uniq = ids[starts]
        oldest = seqs[starts]
        pages = np.diff(np.append(starts, ids.shape[0]))
        allocations = np.add.reduceat(first_of_alloc.astype(np.int64), starts)
        records = []
        for i, sid in enumerate(uniq.tolist()):
            s = self.site(int(sid))
            records.append(
                Outstanding(
                    site=str(s),
                    tag=s.tag,
                    pages=int(pages[i]),
                    slots=int(pages[i]) * page_size,
                    oldest=int(oldest[i]),
                    allocations=int(allocations[i]),
                    file=s.file,
                    line=s.line,
                    function=s.function,
                )
            )
        records.sort(key=lambda r: (-r.pages, r.oldest))
        return records


def _tag_text(tag: Any) -> str:
    return "" if tag is None else f" with tag {tag!r}"


def leak_report(pool_text: str, records: list[Outstanding] | None, held_pages: int, page_size: int, limit: int) -> str:
    """A readable table of ``records`` for logs and test failures.

    ``records`` is ``None`` for a pool that does not track: the report then
    says how much is held and how to find out where.
    """
    if held_pages == 0:
        return f"{pool_text}: no pages are allocated; nothing is outstanding."
    head = f"{pool_text}: {held_pages} pages ({held_pages * page_size} slots) are allocated"
    if records is None:
        return f"{head}; the pool does not track where: construct it with track=True to see the call sites."
    allocations = sum(r.allocations for r in records)
    lines = [f"{head}, by {allocations} allocations from {len(records)} call sites (with tags):"]
    shown = records[:limit]
    rows = [("pages", "slots", "allocs", "oldest", "tag", "site")]
    rows += [(str(r.pages), str(r.slots), str(r.allocations), f"#{r.oldest}", repr(r.tag), r.site) for r in shown]
    numeric = 4  # pages, slots, allocs, oldest: right-aligned; then the tag; the site runs on
    widths = [max(len(row[c]) for row in rows) for c in range(numeric + 1)]
    for row in rows:
        cells = [row[c].rjust(widths[c]) if c < numeric else row[c].ljust(widths[c]) for c in range(numeric + 1)]
        lines.append("  " + "  ".join(cells) + "  " + row[-1])
    if len(records) > limit:
        rest = records[limit:]
        lines.append(f"  ... and {len(rest)} more groups holding {sum(r.pages for r in rest)} pages (limit={limit})")
    return "\n".join(lines)
