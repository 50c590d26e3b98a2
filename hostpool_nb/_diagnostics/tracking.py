"""Who holds each page: call sites and tags of allocations and frees (``track=True``).

A tracking pool keeps, per page, the number of the allocation that handed it
out and two small ids, in its state array (``_kernels/pool.py``); the kernels
write them as they allocate and free. This module keeps what the ids index:
the table of call sites (file, line, function of the first frame outside
hostpool_nb) and tags, and turns the per-page words into reports.

Id 0 is "unknown" and id 1 is ``clear()`` (it freed every page held then);
real sites start at 2. The table only grows, so an id stays valid for the
life of the pool and of its snapshots.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._convert import own_slots
from .._errors import HostPoolError, SlotRangeError
from .._kernels import layout as _layout

UNKNOWN, CLEARED = _layout.SITE_UNKNOWN, _layout.SITE_CLEARED
# What starts the history a tracking pool appends to a DoubleFreeError; a
# replay, whose pool does not track, compares the text before it.
HISTORY_MARK = "; it was "
MAX_SITE_ID = 2**31 - 1  # ids share an int64 word with another id
_SWEEP_AT = 1024  # the smallest table worth sweeping
_PACKAGE = __name__.partition(".")[0]  # hostpool_nb: every frame of the package is skipped
_SUBMODULE = _PACKAGE + "."
_getframe = sys._getframe
_LOW32 = (1 << 32) - 1
ENV = "HOSTPOOL_NB_TRACK"  # tracking for every pool and allocator built without track=
ENV_ON = ("1", "true", "yes", "on")
ENV_OFF = ("", "0", "false", "no", "off")


def wanted(track: Any) -> bool:
    """``track`` as a pool's constructor was given it; ``None`` (not given): what :data:`ENV` says.

    Engines build their allocators themselves, so the environment is how a
    user turns tracking on in production without editing the engine. A
    value the variable cannot mean is an error, not a silent default.
    """
    if track is None:
        value = os.environ.get(ENV, "")
        if value.strip().lower() in ENV_ON:
            return True
        if value.strip().lower() in ENV_OFF:
            return False
        raise HostPoolError(f"{ENV} must be 1 or 0 (or true/false, yes/no, on/off), got {ENV}={value!r}")
    if type(track) is not bool:
        raise TypeError(f"track must be True, False or None, got {type(track).__name__} {track!r}")
    return track


def excluded(exclude: Any, num_pages: int, page_size: int, where: str) -> NDArray[np.bool_] | None:
    """The pages of the slots ``exclude`` (held legitimately), as a mask; ``None`` for none.

    ``SlotRangeError`` for a slot outside ``0 .. num_pages * page_size - 1``
    (``where`` says whose), ``TypeError`` for what is not slot ids.
    """
    if exclude is None:
        return None
    slots = own_slots(exclude, "exclude")  # checked, then indexed: read once
    mask = np.zeros(num_pages, dtype=np.bool_)
    if slots.shape[0] == 0:
        return mask
    bad = (slots < 0) | (slots >= num_pages * page_size)
    if bad.any():
        i = int(np.argmax(bad))
        raise SlotRangeError(
            f"exclude got slot {int(slots[i])} at exclude[{i}] (flattened), outside {where} "
            f"(slots 0..{num_pages * page_size - 1})"
        )
    mask[slots // page_size] = True
    return mask


@dataclass(frozen=True)
class Site:
    """One allocation or free site: where the call came from, and the caller's tag.

    ``tag_hash`` and ``tag_repr`` are the tag's hash and repr taken once, at
    the call that recorded it: the table is keyed on them and reports show
    ``tag_repr``, so nothing the caller does to the tag later (a hash that
    changes, a repr that starts raising) can reach the pool.
    """

    file: str
    line: int
    function: str
    tag: Hashable = None
    tag_hash: int = field(default=0, compare=False, repr=False)
    tag_repr: str = field(default="None", compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"

    def key(self) -> SiteKey:
        """What the table is keyed on: the place, and the tag as it was at the call."""
        if type(self.tag) in _PLAIN_TAGS:
            return (self.file, self.line, self.function, self.tag)
        return (self.file, self.line, self.function, self.tag_hash, self.tag_repr)


# (file, line, function, tag's hash, tag's repr): immutable, so a table keyed on
# it never calls back into a caller's object. No tag, or an int or str tag (a
# request id), is immutable itself and stands in the key as it is, which saves
# a call per tracked call: (file, line, function, tag).
SiteKey = tuple[Any, ...]
_PLAIN_TAGS = (int, str, type(None))
_PLAIN_TYPES = frozenset(_PLAIN_TAGS)
_FULL_KEY = 5  # the length of a key with the tag's hash and repr


# A batch's tags as Tracker.keys gives them to Tracker.ids: the place (file, line,
# function), the tags, and their keys (None: every tag plain, looked up by place).
@dataclass(frozen=True)
class _Repeat:
    """The last batch of plain tags from one call site and their ids: a decode step's are the last step's."""

    tags: list[Any]
    ids: NDArray[np.int64]  # read by kernels, never written
    version: int  # the table's version they index


Batch = tuple[tuple[str, int, str], list[Any], Any]  # the keys: a list of SiteKey, a _Repeat, or None

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
    tag_repr : str
        ``repr(tag)`` as it was when the tag was recorded.
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
    tag_repr: str = field(default="None", compare=False, repr=False)


def site_key(tag: Hashable, depth: int = 0) -> SiteKey:
    """The key of the caller's site with ``tag``; ``TypeError`` for an unusable tag (before any change).

    The key is the file, line and function of the first frame outside
    hostpool_nb, then the tag (a plain one itself, else its hash and repr:
    see SiteKey). The search starts ``depth`` frames above the function
    calling this: 1 from a public method, to start at its caller (a known
    chain, so no frame inside the package is created just to be skipped).
    Frames still inside the package (the torch adapter's, say) are skipped
    from there. This is :meth:`Tracker.where` itself, not called by it: a
    tracked round trip asks twice, and a call more is a twentieth of it.
    """
    try:
        frame: FrameType | None = _getframe(depth + 1)
    except ValueError:  # fewer frames than that: start from the nearest
        frame = _getframe(1)
    # The test for a frame inside the package (hostpool_nb or one of its
    # modules; hostpool_nb_x is not) is written out here, not called.
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != _PACKAGE and not module.startswith(_SUBMODULE):
            break
        frame = frame.f_back
    if frame is None:
        file, line, function = "<unknown>", 0, "?"
    else:
        code = frame.f_code
        file, line, function = code.co_filename, frame.f_lineno, code.co_name
    cls = type(tag)
    if tag is None or cls is int or cls is str:  # immutable: the key holds it (see SiteKey)
        return file, line, function, tag
    tag_hash, tag_repr = tag_identity(tag)
    return file, line, function, tag_hash, tag_repr


def caller(depth: int = 2) -> tuple[str, int, str]:
    """File, line and function of the first frame outside hostpool_nb, ``depth`` frames above this one's."""
    file, line, function, _ = site_key(None, depth)
    return file, line, function


def tag_identity(tag: Hashable) -> tuple[int, str]:
    """The tag's hash and repr, taken now; ``TypeError`` for a tag that cannot give both.

    Called before anything changes. A tag whose ``__hash__`` or ``__repr__``
    raises (a writable ``memoryview`` raises ``ValueError``) is refused here,
    so no later error message or report has to call into it.
    """
    if tag is None:
        return 0, "None"
    try:
        h = hash(tag)
    except Exception:  # noqa: BLE001 - TypeError, or a memoryview's ValueError: the tag is unusable
        raise TypeError(f"tag must be hashable, got {type(tag).__name__} {_safe_repr(tag)}") from None
    try:
        r = repr(tag)
    except Exception as exc:  # noqa: BLE001 - whatever its repr raises, the tag cannot be reported
        raise TypeError(f"tag must have a repr, got a {type(tag).__name__} whose repr raised {exc!r}") from None
    if type(r) is not str:
        raise TypeError(f"tag must have a repr, got a {type(tag).__name__} whose repr is not a str")
    return h, r


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - for an error message only
        return f"<{type(value).__name__} object>"


def _equal(tags: list[Any], known: list[Any]) -> bool:
    """Whether ``tags`` equal ``known`` (plain tags) element by element: in C, by identity first.

    A tag equal to a plain one (``np.int64(5)`` to ``5``) counts as it, as a
    dict key would; one whose ``==`` raises (an array) is not equal.
    """
    try:
        return tags == known
    except Exception:  # noqa: BLE001 - a tag's own __eq__ failed: not the known batch
        return False


def _made(key: SiteKey, tag: Hashable) -> Site:
    """The Site of a table entry kept as its key and tag."""
    file, line, function = key[:3]
    tag_hash, tag_repr = key[3:] if len(key) == _FULL_KEY else (hash(tag), repr(tag))  # plain tags: cheap
    return Site(file, line, function, tag, tag_hash, tag_repr)


class Tracker:
    """The site table of one pool: ``Site`` by id, and id by :data:`SiteKey`.

    The table only holds what some page refers to. A scheduler tags each
    request with its own id, so entries come and go with requests: when the
    table has doubled since the last sweep, the entries no page's words
    mention any more are dropped and their ids reused. The table then holds
    at most two entries per page (its allocation's and its last free's)
    plus those added since the sweep, however many requests the pool has
    served. Ids of entries still referred to never change.

    :meth:`where` runs before the pool's lock is taken (it reads the
    caller's frame and the tag, and touches no table); :meth:`intern`,
    :meth:`sweep` and :meth:`load` run under it, so an id cannot be dropped
    or replaced between its lookup and the kernel that records it.
    """

    def __init__(self, sites: Sequence[Site | None] | None = None) -> None:
        # An entry is a Site, or (key, tag) until something asks for it as one:
        # a Site costs a microsecond to make, and most entries are never reported.
        self._sites: list[Site | tuple[SiteKey, Hashable] | None] = []
        self._ids: dict[SiteKey, int] = {}
        # The ids of the plain-tagged keys again, by place then tag: a batch's
        # request ids are found with a dict lookup each, without a key made.
        self._plain: dict[tuple[str, int, str], dict[Hashable, int]] = {}
        self._free_ids: list[int] = []
        self._live_after_sweep = 0
        self._added: list[tuple[SiteKey, bool]] = []  # since :meth:`begin`: (key, appended), for :meth:`rollback`
        # Per call site, its last batch of plain tags: the same tag objects again reuse its ids while the
        # table's version (bumped whenever an id may change its meaning) is theirs.
        self._last: dict[tuple[str, int, str], _Repeat] = {}
        self._version = 0
        self._sites = []
        self.load(sites)

    def begin(self) -> None:
        """Start a call (every call that interns does): :meth:`rollback` takes back what it adds from now on."""
        if self._added:  # mostly empty: a call that finds its site adds nothing
            self._added.clear()

    def rollback(self) -> None:
        """The call failed: forget the entries it added (no page refers to them), so the table is as it was."""
        if self._added:
            self._version += 1
        for key, appended in reversed(self._added):
            sid = self._forget(key)
            if appended:
                self._sites.pop()
            else:
                self._sites[sid] = None
                self._free_ids.append(sid)  # back where intern popped it from
        self._added = []

    def _forget(self, key: SiteKey) -> int:
        sid = self._ids.pop(key)
        if len(key) != _FULL_KEY:
            del self._plain[key[:3]][key[3]]
        return sid

    def load(self, sites: Sequence[Site | None] | None) -> None:
        """Make this the table ``sites`` (a checked one: :func:`table_problem`); ``None`` for a new table."""
        if sites and len(sites) == len(self._sites) and list(sites) == self._sites:  # by identity first, in C
            return  # a snapshot of the table as it is (no entry added or dropped since): every id means the same
        self._sites = list(sites) if sites else list(_FIXED)
        self._ids = {}
        self._plain = {}
        self._last = {}
        self._version += 1
        self._free_ids = []
        for i, s in enumerate(self._sites):
            if i < len(_FIXED):
                continue
            if s is None:
                self._free_ids.append(i)
            else:
                self._remember(s.key(), i)  # type: ignore[union-attr]  # loaded entries are Sites
        self._live_after_sweep = len(self._ids)

    def _remember(self, key: SiteKey, sid: int) -> None:
        self._ids[key] = sid
        if len(key) != _FULL_KEY:
            self._plain.setdefault(key[:3], {})[key[3]] = sid

    # The key of the caller's site with ``tag`` (see site_key), ``depth`` frames above the method calling it.
    where = staticmethod(site_key)

    def keys(self, tags: Any, count: int, depth: int = 0) -> Batch:
        """What :meth:`ids` needs for ``tags``, one per request of a batch of ``count``, from one call site.

        The place, the tags as a list, and their keys (``None`` when every
        tag is plain: :meth:`ids` then looks them up by place and tag; the
        last batch's :class:`_Repeat` when they equal its tags, whose ids
        :meth:`ids` then reuses while the table has not changed since).
        ``HostPoolError`` unless ``tags`` has ``count`` entries, ``TypeError``
        for a tag that cannot be one (before any change).
        """
        if isinstance(tags, (str, bytes)) or not hasattr(tags, "__len__"):
            raise TypeError(f"tags must be a sequence of one tag per request, got {type(tags).__name__}")
        if len(tags) != count:
            raise HostPoolError(f"tags must have one entry per request ({count}), got {len(tags)}")
        place = caller(depth + 2)
        listed = list(tags)
        last = self._last.get(place)
        if last is not None and len(last.tags) == count and _equal(listed, last.tags):
            return place, listed, last  # the last batch's tags from here again (a decode step's): known
        if set(map(type, listed)) <= _PLAIN_TYPES:
            return place, listed, None
        found: list[SiteKey] = []
        for tag in listed:
            cls = type(tag)
            found.append((*place, tag) if cls in _PLAIN_TYPES else (*place, *tag_identity(tag)))
        return place, listed, found

    def ids(self, batch: Batch, st: NDArray[np.int64]) -> NDArray[np.int64]:
        """The id of each tag of ``batch`` (from :meth:`keys`), added on first use, as a kernel's site array.

        Under the lock.
        """
        place, tags, keys = batch
        if type(keys) is _Repeat:
            if keys.version == self._version and self._last.get(place) is keys:
                return keys.ids
            keys = None  # the table changed since: plain tags still, looked up again
        if keys is None:  # plain tags: a dict lookup each (one pass when all are known), new ones interned
            known = self._plain.get(place, {})
            try:
                ids = np.fromiter(map(known.__getitem__, tags), dtype=np.int64, count=len(tags))
            except KeyError:
                ids = np.array([self.intern((*place, t), t, st) for t in tags], dtype=np.int64)
            self._last[place] = _Repeat(tags, ids, self._version)  # the version after any sweep it made
            return ids
        return np.array([self.intern(k, tag, st) for k, tag in zip(keys, tags, strict=True)], dtype=np.int64)

    def intern(self, key: SiteKey, tag: Hashable, st: NDArray[np.int64]) -> int:
        """The id of ``key`` (from :meth:`where`, for ``tag``), added on first use. Call under the pool's lock."""
        sid = self._ids.get(key)
        if sid is not None:
            return sid
        if len(self._ids) >= max(2 * self._live_after_sweep, _SWEEP_AT):
            self.sweep(st)
        appended = not self._free_ids
        if not appended:
            sid = self._free_ids.pop()
            self._sites[sid] = (key, tag)
        else:
            sid = len(self._sites)
            if sid > MAX_SITE_ID:
                return UNKNOWN
            self._sites.append((key, tag))
        self._remember(key, sid)
        self._added.append((key, appended))
        return sid

    def sweep(self, st: NDArray[np.int64]) -> int:
        """Drop the entries no page refers to; return how many. O(pages + table). Under the pool's lock."""
        used = np.zeros(len(self._sites), dtype=bool)
        alloc_ids, free_ids = site_ids(st)
        used[alloc_ids] = True
        used[free_ids] = True
        used[: len(_FIXED)] = True
        for key, _ in self._added:  # this call's entries: ids it handed out may not be recorded yet
            used[self._ids[key]] = True
        dropped = 0
        for key, sid in list(self._ids.items()):
            if not used[sid]:
                self._forget(key)
                self._sites[sid] = None
                self._free_ids.append(sid)
                dropped += 1
        self._live_after_sweep = len(self._ids)
        if dropped:
            self._version += 1
        return dropped

    def site(self, sid: int) -> Site:
        sites = self._sites
        found = sites[sid] if 0 <= sid < len(sites) else None
        if found is None:
            return _FIXED[UNKNOWN]
        if type(found) is tuple:
            found = _made(*found)
            sites[sid] = found
        return found  # type: ignore[return-value]  # a Site now

    def table(self) -> tuple[Site | None, ...]:
        """The table (``None`` for a reusable id): what a snapshot or a pickle keeps. Under the pool's lock."""
        return tuple(None if s is None else self.site(i) for i, s in enumerate(self._sites))

    def history(self, st: NDArray[np.int64], page: int) -> str:
        """Where ``page`` was last allocated and last freed, for an error message."""
        n = int(st[_layout.H_NPAGES])
        t = int(st[_layout.H_TRACK])
        word = int(st[t + n + page])
        seq = int(st[t + page])
        if seq == 0:  # allocations are numbered from 1: this page was never handed out
            return "never allocated by this pool"
        alloc = self.site(word >> 32)
        freed = self.site(word & 0xFFFFFFFF)
        text = f"allocated at {alloc}{_tag_text(alloc)} (allocation #{seq})"
        if (word & 0xFFFFFFFF) == CLEARED:
            return f"{text}, then freed by clear()"
        if (word & 0xFFFFFFFF) != UNKNOWN:
            return f"{text}, then freed at {freed}"
        return text

    def outstanding(
        self,
        st: NDArray[np.int64],
        owner: NDArray[np.uint8],
        page_size: int,
        skip: NDArray[np.bool_] | None = None,
    ) -> list[Outstanding]:
        """The allocated pages but those ``skip`` marks, grouped by (site, tag), largest first, then oldest first."""
        n = int(st[_layout.H_NPAGES])
        t = int(st[_layout.H_TRACK])
        allocated = owner == _layout.OWNER_ALLOCATED
        held = np.flatnonzero(allocated if skip is None else allocated & ~skip)
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
                    tag_repr=s.tag_repr,
                )
            )
        records.sort(key=lambda r: (-r.pages, r.oldest))
        return records


def site_ids(st: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Every page's allocation site id and last freeing site id, from a tracking state's words."""
    n = int(st[_layout.H_NPAGES])
    t = int(st[_layout.H_TRACK])
    words = st[t + n : t + 2 * n]
    return words >> 32, words & _LOW32


def table_problem(sites: Any) -> str | None:
    """Why ``sites`` is not a site table a pool could have made; ``None`` if it is one."""
    if not isinstance(sites, tuple):
        return f"it is a {type(sites).__name__}, not a tuple"
    if not len(_FIXED) <= len(sites) <= MAX_SITE_ID + 1:
        return f"it has {len(sites)} entries, not {len(_FIXED)} to {MAX_SITE_ID + 1}"
    for i, s in enumerate(sites):
        if s is None and i >= len(_FIXED):
            continue
        if type(s) is not Site or not (
            type(s.file) is str
            and type(s.line) is int
            and type(s.function) is str
            and type(s.tag_hash) is int
            and type(s.tag_repr) is str
        ):
            return f"entry {i} is a {type(s).__name__}, not a Site"
        if i < len(_FIXED) and (s.file, s.line, s.function) != (_FIXED[i].file, _FIXED[i].line, _FIXED[i].function):
            return f"entry {i} is {s}, expected {_FIXED[i]}"
    return None


def site_id_problems(st: NDArray[np.int64], sites: Sequence[Site | None]) -> list[str]:
    """Every page's site ids must name an entry of ``sites`` (0 and 1 always do)."""
    alloc_ids, free_ids = site_ids(st)
    live = np.array([s is not None for s in sites], dtype=bool)
    found = []
    for what, ids in (("allocation", alloc_ids), ("free", free_ids)):
        bad = (ids < 0) | (ids >= live.shape[0])
        bad[~bad] = ~live[ids[~bad]]
        if bad.any():
            p = int(np.argmax(bad))
            found.append(f"page {p}'s {what} site id {int(ids[p])} is not in its site table of {len(sites)}")
    return found


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _tag_text(site: Site) -> str:
    return "" if site.tag is None else f" with tag {site.tag_repr}"


def leak_report(pool_text: str, records: list[Outstanding] | None, held_pages: int, page_size: int, limit: int) -> str:
    """A readable table of ``records`` for logs and test failures.

    ``records`` is ``None`` for a pool that does not track: the report then
    says how much is held and how to find out where.
    """
    if held_pages == 0:
        return f"{pool_text}: no pages are allocated; nothing is outstanding."
    head = f"{pool_text}: {_count(held_pages, 'page')} ({_count(held_pages * page_size, 'slot')}) allocated"
    if records is None:
        return f"{head}; the pool does not track where: construct it with track=True to see the call sites."
    allocations = sum(r.allocations for r in records)
    lines = [f"{head}, by {_count(allocations, 'allocation')} in {_count(len(records), 'group')} (call site, tag):"]
    shown = records[:limit]
    rows = [("pages", "slots", "allocs", "oldest", "tag", "site")]
    rows += [(str(r.pages), str(r.slots), str(r.allocations), f"#{r.oldest}", r.tag_repr, r.site) for r in shown]
    numeric = 4  # pages, slots, allocs, oldest: right-aligned; then the tag; the site runs on
    widths = [max(len(row[c]) for row in rows) for c in range(numeric + 1)]
    for row in rows:
        cells = [row[c].rjust(widths[c]) if c < numeric else row[c].ljust(widths[c]) for c in range(numeric + 1)]
        lines.append("  " + "  ".join(cells) + "  " + row[-1])
    if len(records) > limit:
        rest = records[limit:]
        more = f"{_count(len(rest), 'more group')} holding {_count(sum(r.pages for r in rest), 'page')}"
        lines.append(f"  ... and {more} (limit={limit})")
    return "\n".join(lines)
