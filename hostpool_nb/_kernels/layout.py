"""The layout of every state array, and the kernels' status codes: the one place that says so.

Each pool keeps its state in int64 arrays that only kernels change. The
kernels compile these constants in, so this module is stamped into their
cache (``_kernels/jit.py``): changing it recompiles them.

The core pool (``LogicalHostPool``, and each rank of ``hostpool_nb.paged``)
--------------------------------------------------------------------------
A pool of ``n`` pages keeps one array ``st`` of :func:`state_length` words:

``st[:HEADER]``
    Scalars at the ``H_*`` offsets: the lists' places, the pool's shape, and
    counters that only grow (``clear()`` keeps them).
the ring (:func:`ring_view`), ``n`` int32 entries after the header
    The lists are kept as runs of consecutive page ids: an entry ``p >= 0``
    starts a run at page ``p``; when the entry after it (in the same list)
    is negative, ``-L`` with ``L >= 2``, the run is ``p .. p + L - 1``,
    else it is ``p`` alone. A run never spans two lists, so an entry takes
    at most one ring position per page and the ring always has room. From
    ring position ``st[H_HEAD]`` on: the ``st[H_EFREE]`` entries of the
    free list (``st[H_NFREE]`` pages), the ``st[H_EREL]`` of the release
    list (``st[H_NREL]`` pages, freed, not merged yet), the ``st[H_EPEND]``
    of the pending list (``st[H_NPEND]`` pages, freed in a free group).
    Free list then release list is the FIFO order allocation follows; a
    sorted pool's merge rewrites both as one ascending list of the longest
    runs. Runs need not be the longest: a free makes runs of the pages it is
    given in a row, and never joins them to a list's last run. The entries
    after the live window are scratch: ``free`` stages the runs it has
    checked there, which is always room enough, since it stages only held
    pages.
the owner flags (:func:`owner_view`), one byte per page after the ring
    ``OWNER_ALLOCATED`` for a page a caller holds, ``OWNER_FREE`` for one on
    the free or release list, ``OWNER_PENDING`` for one on the pending list.
``st[st[H_TRACK]:]``, only with ``track=True``
    Two words per page: the number of the allocation that handed it out,
    then the site ids (high 32 bits: that allocation's; low: the last free's)
    that the tracking module's table resolves (:data:`SITE_UNKNOWN`, :data:`SITE_CLEARED`, then its own).

A paged rank's free group (``GP_*``)
------------------------------------
``gp[GP_COUNT]`` pending page ids from ``gp[GP_HEADER]`` on, in the order
freed, then one mark byte per page (``MARK_PENDING``: freed earlier in the
group; ``MARK_STAGED``: during the call freeing it). ``gp[GP_FAULT]`` is
scratch: the slot a failed free stopped at.

A host page pool (``HP_*``)
---------------------------
``HP_HEADER`` header words, then a FIFO ring of ``n`` int32 page ids (the
free list from ``st[HP_HEAD]``; scratch after it), ``n`` generations
(incremented at each hand-out), ``n`` pin counts, ``n`` allocated bytes (0
or 1 at all times), and ``n`` mark bytes (scratch of one ``free`` call,
zero between calls). ``HP_FAULT`` and ``HP_FAULT_GEN`` are scratch: the
page a failed call stopped at and the generation it was given.

An interleaved page pool (``IP_*``)
-----------------------------------
``IP_HEADER`` header words; then ``N`` words, each owner class's free page
count; then ``N`` stacks of ``IP_PER_CLASS`` page ids (class ``r``'s from
word ``IP_HEADER + N + r * per_class``, its free list's front on top, so a
draw pops and a free pushes); then one state byte per logical page
(``IP_FREE``, ``IP_HELD``, ``IP_RESERVED`` for pages ``0 .. N - 1``, which
no class lists; ``IP_STAGED`` only inside one ``free`` call).

A page-envelope pool (``EV_*``)
-------------------------------
``EV_HEADER`` header words, then ``EV_SIDE_WORDS`` words for each side
(``S_*`` offsets: its shape, its watermark and counts), then each side's
arrays from its ``S_BASE``: ``page_num`` words logical -> physical, the same
physical -> logical (``-1``: none), then two bitmaps of 63 bits a word (the
free logical pages, the physical holes). A physical page is kept as its
distance from the side's own end (``d``: page ``d`` for a side that grows
up, ``page_num - 1 - d`` for one that grows down), so both sides take the
lowest ``d`` first and pack towards ``d = 0``; ``S_MARK`` is the first
``d`` never used since the last compaction. A ``free`` marks the pages it
has checked by writing ``-2 - d`` in their logical -> physical words,
restored before it returns.

Status codes
------------
A kernel returns a value ``>= 0`` on success, or ``-1 - (position << 5 |
code)`` (:func:`fail`), where ``code`` is an ``E_*`` below and ``position``
the offending index into the kernel's input; :func:`decode_status` splits
it, and :func:`status_for` makes one in Python. A failed kernel leaves the state as it was, but for its scratch.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .jit import callee, window

# -- the core pool's header ---------------------------------------------------------
H_HEAD = 0  # ring position of the first free page
H_NFREE = 1  # pages on the free list
H_NREL = 2  # pages on the release list
H_NPAGES = 3  # ring capacity: size // page_size
H_PAGE_SIZE = 4
H_PAGE_SHIFT = 5  # log2(page_size) if a power of two, else -1
H_MERGES = 6  # merges performed
H_NPEND = 7  # pages on the pending list
H_GROUP_DEPTH = 8  # free groups begun and not ended
H_SORTED = 9  # merge order: 0 FIFO, 1 ascending page ids
H_ALLOC_CALLS = 10  # alloc and alloc_many calls answered (slots or None)
H_FAILED_ALLOCS = 11  # of those, answered None
H_FREE_CALLS = 12  # free calls that freed at least one page
H_PEAK = 13  # most pages allocated at once
H_CLEARS = 14  # clear() calls: a free_group() block tells it was ended by one
H_TRACK = 15  # where the tracking words start (0: the pool does not track)
H_SEQ = 16  # the next allocation's number, in a tracking pool
H_EFREE = 17  # ring entries of the free list
H_EREL = 18  # ring entries of the release list
H_EPEND = 19  # ring entries of the pending list
# Slots of the pages on the free and release lists ((H_NFREE + H_NREL) * page size), stored by each kernel that
# changes either: one aligned word available_size reads without the lock. Derived: 0 in a snapshot or pickle.
H_AVAIL = 20
HEADER = 24  # the spare words keep room for later counters

SITE_UNKNOWN = 0  # a tracking word's site id: no site known
SITE_CLEARED = 1  # the page was freed by clear(), not by a call with a site

OWNER_FREE = 0
OWNER_ALLOCATED = 1
OWNER_PENDING = 2
OWNER_STAGED = 3  # paged: a page being freed by the current call
MIN_RUN = 2  # a run of one page is its id alone; a longer one carries its length

MAX_PAGES = 2**31 - 1  # ring entries are int32 page ids

# -- status codes -------------------------------------------------------------------
E_SHORT = 1  # fewer available pages than requested
E_RANGE = 2  # a slot or page outside the pool (or the rank)
E_MISALIGNED = 3  # a page's first slot (or a size) is not a multiple of page_size
E_PARTIAL = 4  # the slots after a page's first are not that page's, in order
E_NOT_ALLOCATED = 5  # the page is not held: a double free, or never allocated
E_DUPLICATE = 6  # a page named twice in one call
E_CORRUPT = 7  # the state is inconsistent (never through the public API)
E_NEGATIVE = 8  # a size or length is negative
E_NO_GROUP = 9  # free_group_end without a group
E_PAGE0 = 10  # paged: a slot of the padding page 0
E_SEQ_BELOW_PREFIX = 11  # paged alloc_extend: seq_lens[i] < prefix_lens[i]
E_TOTAL = 12  # paged alloc_extend: extend_num_tokens is not the sum of the extensions
E_LAST_LOC = 13  # paged debug_mode: last_loc does not continue the request
E_SEQ_BELOW_ONE = 14  # paged alloc_decode: seq_lens[i] < 1
E_LENGTH = 15  # free's input is not a whole number of pages
E_PINNED = 16  # host: a pinned page freed or released
E_STALE = 17  # host: a generation that is not the page's any more
E_UNDERFLOW = 18  # host: dec_lock_ref of an unpinned page
E_MERGE_FIRST = 19  # a sorted pool's allocation needs its release list merged first: the pool does, then asks again
E_COMPACT_FIRST = (
    20  # a page-envelope allocation fits only once the sides are compacted: the pool does, then asks again
)
_CODE_BITS = 5


def status_for(code: int, position: int) -> int:
    """The status of a failure: ``code`` at input ``position`` (what kernels return through :data:`fail`)."""
    return -1 - ((position << _CODE_BITS) | code)


fail = callee()(status_for)  # the same, for kernels to call


def decode_status(status: int) -> tuple[int, int]:
    """Split a failure status into ``(code, position)``."""
    err = -1 - int(status)
    return err & ((1 << _CODE_BITS) - 1), err >> _CODE_BITS


def status_of(code: int) -> int:
    """The status a kernel returns for ``code`` at position 0 (``-1 - code``), for fast comparisons."""
    return -1 - code


# -- the core pool's arrays ------------------------------------------------------------


def ring_words(num_pages: int) -> int:
    """int64 words holding ``num_pages`` int32 page ids."""
    return (num_pages + 1) // 2


_ring_words = callee()(ring_words)


def track_offset(num_pages: int) -> int:
    """Where a tracking pool's per-page words start: right after the owner flags."""
    return HEADER + ring_words(num_pages) + (num_pages + 7) // 8


def state_length(num_pages: int, tracked: bool = False) -> int:
    """Length of the state array of a pool of ``num_pages`` pages (two words more per page when tracked)."""
    return track_offset(num_pages) + (2 * num_pages if tracked else 0)


def page_shift(page_size: int) -> int:
    """``log2(page_size)`` if it is a power of two, else -1."""
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1


def run_entries(ids: NDArray[np.integer]) -> NDArray[np.int32]:
    """The ring entries of a list of page ids: each stretch that counts up by one as a run."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.shape[0] == 0:
        return np.zeros(0, dtype=np.int32)
    starts = np.flatnonzero(np.concatenate([[True], np.diff(ids) != 1]))
    lengths = np.diff(np.append(starts, ids.shape[0]))
    width = np.where(lengths > 1, 2, 1)
    at = np.cumsum(width) - width
    entries = np.zeros(int(width.sum()), dtype=np.int64)
    entries[at] = ids[starts]
    entries[at[lengths > 1] + 1] = -lengths[lengths > 1]
    return entries.astype(np.int32)


def run_pages(entries: NDArray[np.integer]) -> NDArray[np.int64]:
    """The page ids of well-formed ring entries (:func:`run_entries` undone)."""
    e = np.asarray(entries, dtype=np.int64)
    at = np.flatnonzero(e >= 0)
    nxt = np.append(e[1:], 0)[at]
    lengths = np.where(nxt < 0, -nxt, 1)
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    pages: NDArray[np.int64] = np.repeat(e[at], lengths) + np.arange(int(lengths.sum())) - offsets
    return pages


def persisted(st: NDArray[np.int64]) -> NDArray[np.int64]:
    """A copy of a core state as snapshots and pickles keep it: :data:`H_AVAIL` 0, their format unchanged by it."""
    words: NDArray[np.int64] = st.copy()
    words[H_AVAIL] = 0
    return words


def derive(st: NDArray[np.int64]) -> None:
    """Set the derived word of a state taken from a pickle (which holds 0 there: :func:`persisted`)."""
    st[H_AVAIL] = (st[H_NFREE] + st[H_NREL]) * st[H_PAGE_SIZE]


def new_state(num_pages: int, page_size: int, sorted_order: bool = False, track: bool = False) -> NDArray[np.int64]:
    """A new state: every page free, listed in ascending order, as ``reset`` leaves it.

    Built with numpy rather than by the ``reset`` kernel, so that making a
    pool compiles nothing it does not call.
    """
    st = np.zeros(state_length(num_pages, track), dtype=np.int64)  # owner flags: zero, OWNER_FREE
    first = run_entries(np.arange(num_pages))
    ring_ids(st, num_pages)[: first.shape[0]] = first
    st[H_EFREE] = first.shape[0]
    st[H_NFREE] = num_pages
    st[H_AVAIL] = num_pages * page_size
    st[H_NPAGES] = num_pages
    st[H_PAGE_SIZE] = page_size
    st[H_PAGE_SHIFT] = page_shift(page_size)
    st[H_SORTED] = int(sorted_order)
    if track:
        st[H_TRACK] = track_offset(num_pages)
        st[H_SEQ] = 1  # allocations are numbered from 1
    return st


def ring_ids(st: NDArray[np.int64], num_pages: int) -> NDArray[np.int32]:
    """The ring, as Python code reads it."""
    return st[HEADER : HEADER + ring_words(num_pages)].view(np.int32)[:num_pages]


def owner_flags(st: NDArray[np.int64], num_pages: int) -> NDArray[np.uint8]:
    """The owner flags, as Python code reads them."""
    return st[HEADER + ring_words(num_pages) :].view(np.uint8)[:num_pages]


def ring_positions(head: int, count: int, capacity: int) -> NDArray[np.int64]:
    """Ring positions of ``count`` entries from ``head`` on, wrapping at ``capacity``: every ring's formula."""
    return (head + np.arange(count)) % max(capacity, 1)


def window_entries(st: NDArray[np.int64]) -> tuple[NDArray[np.int32], NDArray[np.int32], NDArray[np.int32]]:
    """The ring entries of the free, release and pending lists (new arrays)."""
    n = int(st[H_NPAGES])
    counts = [int(st[h]) for h in (H_EFREE, H_EREL, H_EPEND)]
    entries = ring_ids(st, n)[ring_positions(int(st[H_HEAD]), sum(counts), n)]
    return entries[: counts[0]], entries[counts[0] : counts[0] + counts[1]], entries[counts[0] + counts[1] :]


def listed(st: NDArray[np.int64], start: int = 0, count: int | None = None) -> NDArray[np.int32]:
    """Page ids of the live window from its ``start``-th page on (a new array), as Python code reads them.

    The window is the free list, then the release list, then the pending
    list; ``count`` pages (all that follow ``start`` by default).
    """
    pages = np.concatenate([run_pages(e) for e in window_entries(st)]).astype(np.int32)
    return pages[start:] if count is None else pages[start : start + count]


def lists_of(st: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """The free, release and pending lists' page ids, each in its order, as int64 (new arrays)."""
    nfree, nrel = int(st[H_NFREE]), int(st[H_NREL])
    ids = listed(st).astype(np.int64)
    return ids[:nfree], ids[nfree : nfree + nrel], ids[nfree + nrel :]


def state_of_lists(
    shape: tuple[int, int, bool, bool],
    lists: tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]],
    group_depth: int,
) -> NDArray[np.int64]:
    """A state whose free, release and pending lists hold ``lists`` in order; every other page held.

    ``shape`` is the pool's ``(pages, page_size, sorted order, track)``.

    Counters start at zero (the peak at what is held). A tracking state's
    pages carry no allocation number or site: "unknown". The caller checks
    the result as any state from outside (``restore_state``).
    """
    num_pages, page_size, sorted_order, track = shape
    free, released, pending = lists
    st = new_state(num_pages, page_size, sorted_order, track)
    ids = np.concatenate([free, released, pending]).astype(np.int32)
    entries = [run_entries(ids) for ids in lists]
    ring_ids(st, num_pages)[:] = 0
    ring_ids(st, num_pages)[: sum(e.shape[0] for e in entries)] = np.concatenate(entries)
    st[H_EFREE], st[H_EREL], st[H_EPEND] = (e.shape[0] for e in entries)
    owner = owner_flags(st, num_pages)
    owner[:] = OWNER_ALLOCATED
    owner[ids[: free.shape[0] + released.shape[0]]] = OWNER_FREE
    owner[ids[free.shape[0] + released.shape[0] :]] = OWNER_PENDING
    st[H_NFREE], st[H_NREL], st[H_NPEND] = free.shape[0], released.shape[0], pending.shape[0]
    st[H_GROUP_DEPTH] = group_depth
    st[H_PEAK] = num_pages - ids.shape[0]
    return st


def _ring_at(st: NDArray[np.int64]) -> tuple[int, int]:
    return HEADER, st[H_NPAGES]


def _owner_at(st: NDArray[np.int64]) -> tuple[int, int]:
    n = st[H_NPAGES]
    return HEADER + _ring_words(n), n


ring_view = window(np.int32, _ring_at)  # the ring, as kernels read it
owner_view = window(np.uint8, _owner_at)  # the owner flags, as kernels read them


# -- a paged rank's free group ------------------------------------------------------------
GP_COUNT = 0
GP_CAP = 1  # pages + 1: room for every page once
GP_FAULT = 2  # scratch
GP_HEADER = 3
MARK_NONE = 0
MARK_PENDING = 1
MARK_STAGED = 2


def group_length(num_pages: int) -> int:
    """Length of a rank's group buffer: header, a page id per page, a mark byte per page."""
    cap = num_pages + 1
    return GP_HEADER + cap + (cap + 7) // 8


def group_of_pages(num_pages: int, pending: NDArray[np.integer]) -> NDArray[np.int64]:
    """A rank's group buffer with ``pending`` (page ids, in the order they were freed) pending.

    What the frees of a free group leave; the caller checks the result as
    any state from outside (``group_problems``).
    """
    gp = np.zeros(group_length(num_pages), dtype=np.int64)
    gp[GP_CAP] = num_pages + 1
    gp[GP_COUNT] = pending.shape[0]
    gp[GP_HEADER : GP_HEADER + pending.shape[0]] = pending
    group_marks(gp)[pending] = MARK_PENDING
    return gp


def group_marks(gp: NDArray[np.int64]) -> NDArray[np.uint8]:
    """The mark bytes of a group buffer, as Python code reads them."""
    cap = int(gp[GP_CAP])
    return gp[GP_HEADER + cap :].view(np.uint8)[:cap]


def _marks_at(gp: NDArray[np.int64]) -> tuple[int, int]:
    cap = gp[GP_CAP]
    return GP_HEADER + cap, cap


marks_view = window(np.uint8, _marks_at)  # the mark bytes of a group buffer, as kernels read them


# -- a host page pool ------------------------------------------------------------------------
HP_HEAD = 0  # ring position of the first free page
HP_NFREE = 1  # pages on the free list
HP_NPAGES = 2  # pool_size
HP_ALLOC_CALLS = 3  # reserve and alloc calls answered (pages or None)
HP_EXHAUSTED = 4  # of those, answered None
HP_FREE_CALLS = 5  # release and free calls that freed at least one page
HP_PEAK = 6  # most pages held at once
HP_CLEARS = 7  # clear() calls
HP_PINNED = 8  # pages whose pin count is above 0
HP_FAULT = 9  # scratch
HP_FAULT_GEN = 10  # scratch
HP_HEADER = 16
HP_SCRATCH = (HP_FAULT, HP_FAULT_GEN)


def host_offsets(n: int) -> tuple[int, int, int, int, int]:
    """Word offsets of a host pool's ring, generations, pin counts, allocated bytes and marks."""
    ring = HP_HEADER
    gen = ring + ring_words(n)
    ref = gen + n
    flags = ref + n
    marks = flags + (n + 7) // 8
    return ring, gen, ref, flags, marks


def host_views(
    st: NDArray[np.int64], n: int
) -> tuple[NDArray[np.int32], NDArray[np.int64], NDArray[np.int64], NDArray[np.uint8], NDArray[np.uint8]]:
    """A host pool's ring, generations, pin counts, allocated bytes and marks, as Python code reads them."""
    ring, gen, ref, flags, marks = host_offsets(n)
    return (
        st[ring : ring + ring_words(n)].view(np.int32)[:n],
        st[gen : gen + n],
        st[ref : ref + n],
        st[flags:].view(np.uint8)[:n],
        st[marks:].view(np.uint8)[:n],
    )


def host_state_length(n: int) -> int:
    """Length of a host pool's state array (about 22 bytes a page)."""
    return host_offsets(n)[4] + (n + 7) // 8


def _host_ring_at(st: NDArray[np.int64]) -> tuple[int, int]:
    return HP_HEADER, st[HP_NPAGES]


def _host_gens_at(st: NDArray[np.int64]) -> tuple[int, int]:
    n = st[HP_NPAGES]
    return HP_HEADER + _ring_words(n), n


def _host_refs_at(st: NDArray[np.int64]) -> tuple[int, int]:
    n = st[HP_NPAGES]
    return HP_HEADER + _ring_words(n) + n, n


def _host_flags_at(st: NDArray[np.int64]) -> tuple[int, int]:
    n = st[HP_NPAGES]
    return HP_HEADER + _ring_words(n) + 2 * n, n


def _host_marks_at(st: NDArray[np.int64]) -> tuple[int, int]:
    n = st[HP_NPAGES]
    return HP_HEADER + _ring_words(n) + 2 * n + (n + 7) // 8, n


# A host pool's parts, as kernels read them (host_offsets, for Python).
host_ring = window(np.int32, _host_ring_at)
host_gens = window(np.int64, _host_gens_at)
host_refs = window(np.int64, _host_refs_at)
host_flags = window(np.uint8, _host_flags_at)
host_marks = window(np.uint8, _host_marks_at)


# -- an interleaved page pool ------------------------------------------------------------------
IP_CLASSES = 0  # N, the owner classes (page p belongs to class p % N)
IP_PER_CLASS = 1  # pages each class lists when all are free
IP_PAGE_SIZE = 2
IP_MIN = 3  # the fewest free pages of any class: what available_size reads
IP_HELD = 4  # pages allocated
IP_ALLOC_CALLS = 5  # alloc calls answered (pages or None)
IP_EXHAUSTED = 6  # of those, answered None
IP_FREE_CALLS = 7  # free calls that freed at least one page
IP_PEAK = 8  # most pages held at once
IP_CLEARS = 9  # clear() calls
IP_HEADER = 16
IP_FREE = 0
IP_HELD_PAGE = 1
IP_RESERVED = 2
IP_STAGED = 3


def interleaved_offsets(classes: int, per_class: int) -> tuple[int, int, int]:
    """Word offsets of an interleaved pool's class counts, class stacks and page states."""
    counts = IP_HEADER
    stacks = counts + classes
    states = stacks + classes * per_class
    return counts, stacks, states


def interleaved_pages(classes: int, per_class: int) -> int:
    """Logical pages of an interleaved pool: its classes' pages and the reserved first page of each class."""
    return classes * (per_class + 1)


def interleaved_state_length(classes: int, per_class: int) -> int:
    """Length of an interleaved pool's state array (about 9 bytes a page)."""
    return interleaved_offsets(classes, per_class)[2] + (interleaved_pages(classes, per_class) + 7) // 8


def interleaved_views(
    st: NDArray[np.int64],
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.uint8]]:
    """An interleaved pool's class counts, class stacks (one row per class) and page states, as Python reads them."""
    n, per = int(st[IP_CLASSES]), int(st[IP_PER_CLASS])
    counts, stacks, states = interleaved_offsets(n, per)
    return (
        st[counts:stacks],
        st[stacks:states].reshape(n, per),
        st[states:].view(np.uint8)[: interleaved_pages(n, per)],
    )


def _ip_counts_at(st: NDArray[np.int64]) -> tuple[int, int]:
    return IP_HEADER, st[IP_CLASSES]


def _ip_stacks_at(st: NDArray[np.int64]) -> tuple[int, int]:
    n = st[IP_CLASSES]
    return IP_HEADER + n, n * st[IP_PER_CLASS]


def _ip_states_at(st: NDArray[np.int64]) -> tuple[int, int]:
    n = st[IP_CLASSES]
    per = st[IP_PER_CLASS]
    return IP_HEADER + n + n * per, n * (per + 1)


# An interleaved pool's parts, as kernels read them (interleaved_views, for Python).
ip_counts = window(np.int64, _ip_counts_at)
ip_stacks = window(np.int64, _ip_stacks_at)
ip_states = window(np.uint8, _ip_states_at)


# -- a page-envelope pool -------------------------------------------------------------------------
EV_SIDES = 0  # 1 or 2
EV_ALLOCATABLE = 1  # bytes the sides share
EV_ALLOC_CALLS = 2  # allocation calls answered (pages or None)
EV_EXHAUSTED = 3  # of those, answered None
EV_FREE_CALLS = 4  # free calls that freed at least one page
EV_COMPACTIONS = 5
EV_CLEARS = 6  # clear() calls, of either side
EV_HEADER = 8
EV_SIDE_WORDS = 16
S_PAGE_SIZE = 0
S_PAGE_BYTES = 1
S_PAGE_NUM = 2
S_DOWN = 3  # 1: grows down from the envelope's top
S_MARK = 4  # the first distance from the side's end never used since the last compaction
S_LIVE = 5  # pages allocated
S_FREE = 6  # free logical pages
S_HOLES = 7  # physical pages below the mark that no live page holds
S_LOW_FREE = 8  # no free logical page lies in a bitmap word below this one
S_LOW_HOLE = 9  # no hole lies in a bitmap word below this one
S_BASE = 10  # the word the side's arrays start at
EV_BITS = 63  # bits a bitmap word holds: the sign bit is left alone


def envelope_words(page_num: int) -> int:
    """Words of one side's arrays: two maps and two bitmaps."""
    return 2 * page_num + 2 * ((page_num + EV_BITS - 1) // EV_BITS)


def envelope_state_length(page_nums: tuple[int, ...]) -> int:
    """Length of a page-envelope pool's state array (about 16 bytes a page of each side)."""
    return EV_HEADER + EV_SIDE_WORDS * len(page_nums) + sum(envelope_words(n) for n in page_nums)
