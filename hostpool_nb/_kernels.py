"""Numba kernels of the core pool: every change to a ``LogicalHostPool``'s state.

The layout of ``st`` and the status codes are in ``_layout.py``. Kernels
move integers and return status codes; they never raise and never allocate
Python objects, so ``_pool.py`` can validate, lock, and turn a status into
the right exception. On failure the header, the live window and the owner
flags are as they were; only the scratch behind the window may differ.
Measured trade-offs behind the choices here are in ``docs/architecture.md``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._jit import as_callee as _as_callee
from ._jit import callee as _callee
from ._jit import kernel as _jit
from ._jit import popcount, trailing_zeros
from ._jit import twin as _twin
from ._layout import (
    E_CORRUPT,
    E_DUPLICATE,
    E_LENGTH,
    E_MERGE_FIRST,
    E_MISALIGNED,
    E_NEGATIVE,
    E_NO_GROUP,
    E_NOT_ALLOCATED,
    E_PARTIAL,
    E_RANGE,
    E_SHORT,
    H_ALLOC_CALLS,
    H_CLEARS,
    H_EFREE,
    H_EPEND,
    H_EREL,
    H_FAILED_ALLOCS,
    H_FREE_CALLS,
    H_GROUP_DEPTH,
    H_HEAD,
    H_MERGES,
    H_NFREE,
    H_NPAGES,
    H_NPEND,
    H_NREL,
    H_PAGE_SHIFT,
    H_PAGE_SIZE,
    H_PEAK,
    H_SEQ,
    H_SORTED,
    H_TRACK,
    HEADER,
    OWNER_ALLOCATED,
    OWNER_FREE,
    OWNER_PENDING,
    fail,
    owner_view,
    ring_tail,
    ring_view,
)

# The kernels' Python annotations are for type checkers only: numba compiles
# each kernel from its signature string, a callee for its callers' types.
# A local annotated ``int`` holds an array element or a shape entry.

# Kernels hold their loops themselves and call only small helpers that call
# nothing big in turn: numba optimises and generates machine code for every
# compiled function with everything it calls linked in, so a loop nested
# three calls deep was compiled four times over (docs/architecture.md).

_LOW32 = (1 << 32) - 1  # a tracking word's low half: the site that last freed the page


@_jit("i8(i8[::1])")
def reset(st: NDArray[np.int64]) -> int:
    """Make every page free, in ascending order (one run); empty the other lists; end all groups.

    The counters are kept, but for ``H_CLEARS``, which counts this call.
    Returns the number of free pages.
    """
    n: int = st[H_NPAGES]
    owner = owner_view(st)
    ring = ring_view(st)
    t: int = st[H_TRACK]
    if t != 0:
        for p in range(n):
            if owner[p] == OWNER_ALLOCATED:
                st[t + n + p] = (st[t + n + p] & ~_LOW32) | 1  # freed by clear() (the tracker's id 1)
    for p in range(n):
        owner[p] = OWNER_FREE
    entries = 0
    if n > 0:
        entries = 1 if n == 1 else 2
        put_run(ring, 0, 0, n)
    st[H_HEAD] = 0
    st[H_NFREE] = n
    st[H_EFREE] = entries
    st[H_NREL] = 0
    st[H_EREL] = 0
    st[H_NPEND] = 0
    st[H_EPEND] = 0
    st[H_GROUP_DEPTH] = 0
    st[H_CLEARS] += 1
    return n


# -- runs on the ring ----------------------------------------------------------
# Every list is a sequence of runs (``_layout.py``): an entry ``p >= 0``, then,
# for a run of ``L >= 2`` pages, the entry ``-L``. These are the only two
# functions that know the encoding; the kernels here and the paged ranks'
# read and write runs through them.


@_callee()
def run_at(ring: NDArray[np.int32], pos: int, left: int) -> int:
    """The length of the run whose first entry is at ring position ``pos``, ``left`` entries of its list from there.

    A negative entry after it is its length, but only inside its list: the
    entry after a list's last run is another list's, or scratch.
    """
    if left > 1:
        nxt = pos + 1 if pos + 1 < ring.shape[0] else 0
        e: int = ring[nxt]
        if e < 0:
            return -e
    return 1


@_callee()
def put_run(ring: NDArray[np.int32], pos: int, first: int, length: int) -> int:
    """Write the run ``first .. first + length - 1`` (``length >= 1``) at ring position ``pos``; the position after."""
    n = ring.shape[0]
    ring[pos] = first
    pos = pos + 1 if pos + 1 < n else 0
    if length > 1:
        ring[pos] = -length
        pos = pos + 1 if pos + 1 < n else 0
    return pos


@_callee()
def run_width(length: int) -> int:
    """Ring entries a run of ``length`` pages takes."""
    return 1 if length == 1 else 2


# Eight owner flags in one word of the state: a flag value repeated in every byte.
_EVERY_BYTE = 0x0101010101010101
_HIGH_BITS = 0x8080808080808080 - (1 << 64)  # the high bit of every byte, as an int64: no uint64 mixed in
_ALLOCATED_WORD = OWNER_ALLOCATED * _EVERY_BYTE
# Masks of a word's bytes, built from int64 values: page ids read from the int32
# ring would make int32 masks when numpy runs the kernels (NUMBA_DISABLE_JIT=1).
_ALL_BYTES = np.int64(-1)
_LOW_BYTE = np.int64(1)
_FLAGS_PER_WORD = 8


# The owner flags start on a word of ``st``, so flags ``8q .. 8q + 7`` are the
# word ``st[base + q]``, page ``8q + b`` its byte ``b`` (little-endian). A run
# of pages is tested and flagged eight at a time, its first and last words
# masked to the run: no loop per byte, so no branch on a run's length at
# the edges either (docs/architecture.md).


@_callee()
def _word_masks(start: int, length: int) -> tuple[int, int, int, int]:
    """The words of pages ``start .. start + length - 1`` (``length >= 1``): first, last, and their masks.

    Each mask keeps the run's bytes of its word; a run within one word gets
    one mask for both (first and last are the same word).
    """
    lo = start >> 3
    hi = (start + length - 1) >> 3
    first = _ALL_BYTES << ((start & 7) << 3)
    top = ((start + length - 1) & 7) + 1  # how many of the last word's low bytes are the run's
    last = _ALL_BYTES if top == _FLAGS_PER_WORD else (_LOW_BYTE << (top << 3)) - 1
    if lo == hi:
        first &= last
        last = first
    return lo, hi, first, last


@_callee()
def _flags_are(st: NDArray[np.int64], start: int, length: int, want: int) -> bool:
    """Whether pages ``start .. start + length - 1`` (``length >= 1``) are all flagged ``want``."""
    words = st[HEADER + (st[H_NPAGES] + 1) // 2 :]  # the ring's int64 words end here (_layout.py)
    lo, hi, first, last = _word_masks(start, length)
    pattern = want * _EVERY_BYTE
    bad = ((words[lo] ^ pattern) & first) | ((words[hi] ^ pattern) & last)
    middle = words[lo + 1 : hi]  # indexed from 0, LLVM vectorises it
    for q in range(middle.shape[0]):
        bad |= middle[q] ^ pattern
    ok: bool = bad == 0
    return ok


@_callee()
def _set_flags(st: NDArray[np.int64], start: int, length: int, flag: int) -> None:
    """Flag pages ``start .. start + length - 1`` (``length >= 1``) as ``flag``, and no other."""
    words = st[HEADER + (st[H_NPAGES] + 1) // 2 :]
    lo, hi, first, last = _word_masks(start, length)
    pattern = flag * _EVERY_BYTE
    words[lo] = (words[lo] & ~first) | (pattern & first)
    words[hi] = (words[hi] & ~last) | (pattern & last)
    middle = words[lo + 1 : hi]  # indexed from 0, LLVM vectorises it
    for q in range(middle.shape[0]):
        middle[q] = pattern


@_callee()
def set_runs(st: NDArray[np.int64], pos: int, entries: int, flag: int) -> None:
    """Flag every page of the ``entries`` ring entries from ``pos`` on ``flag``."""
    ring = ring_view(st)
    owner = owner_view(st)
    n = ring.shape[0]
    left = entries
    while left > 0:
        length = run_at(ring, pos, left)
        if length == 1:  # a lone page: its byte, no masks to make
            owner[ring[pos]] = flag
        else:
            _set_flags(st, ring[pos], length, flag)
        w = run_width(length)
        pos = pos + w if pos + w < n else pos + w - n
        left -= w


@_callee()
def _fill_run(out: NDArray[np.int64] | NDArray[np.int32], start: int, length: int, first: int) -> None:
    """Write ``first, first + 1, ...`` to ``out[start:start + length]``.

    Filling a slice view lets LLVM vectorise the loop (indexing ``out``
    directly, it could not rule out aliasing). The view lives in this
    helper, not in a caller's loop, where numba would count references to
    it on every iteration.
    """
    dst = out[start : start + length]
    for j in range(length):
        dst[j] = first + j


@_callee()
def _claim_lone(ids: NDArray[np.int32], dst: NDArray[np.int64] | NDArray[np.int32], owner: NDArray[np.uint8]) -> int:
    """Flag the lone free pages ``ids[:-1]`` allocated and write them to ``dst``, until one is not: how many.

    An entry followed by a length entry starts a run, which the caller
    takes. Page size 1's loop, a function of its own: views indexed from 0,
    and few live values, so the flags' base stays in a register.
    """
    n = owner.shape[0]
    for k in range(dst.shape[0]):
        p = ids[k]
        if ids[k + 1] < 0 or p < 0 or p >= n or owner[p] != OWNER_FREE:
            return k
        owner[p] = OWNER_ALLOCATED
        dst[k] = p
    count: int = dst.shape[0]
    return count


@_callee()
def take_front(st: NDArray[np.int64], need: int, out: NDArray[np.int64] | NDArray[np.int32], page_size: int) -> int:
    """Hand out the first ``need`` pages of the lists, run by run; their slots to ``out`` (``page_size`` each).

    Each run's owner flags are tested free and set allocated as a block,
    and its slots written as one range: nothing is read or written per page
    but the caller's output. A run longer than what is left of the request
    is split: its rest stays at the front, rewritten in place. Reads on
    into the release list when the free list is short (a FIFO merge, then
    counted). Returns 0; or ``E_CORRUPT`` at the page it stopped at, with
    the lists and flags as they were, when a run is not a run of free
    pages or the lists hold fewer pages than their counts.
    """
    owner = owner_view(st)
    ring = ring_view(st)
    n = ring.shape[0]
    words = st[HEADER + (n + 1) // 2 :]  # the owner flags, eight to a word (_flags_are)
    nfree: int = st[H_NFREE]
    into_released = need > nfree
    avail: int = st[H_EFREE] + st[H_EREL] if into_released else st[H_EFREE]
    head: int = st[H_HEAD]
    pos = head
    used = 0  # entries wholly taken
    got = 0
    length = 0
    take = 0
    bad = False
    while got < need:
        if used >= avail:
            bad = True
            break
        p: int = ring[pos]
        nxt = pos + 1 if pos + 1 < n else 0
        if avail - used == 1 or ring[nxt] >= 0:  # a page alone: no views, no block loops
            # Page size 1: a stretch of lone pages in one tight loop, through
            # views indexed from 0; the entry after each tells whether it
            # starts a run, so the view ends one entry early, inside the list.
            m = min(need - got, avail - used - 1, n - pos - 1) if page_size == 1 else 0
            if m > 0:
                k = _claim_lone(ring[pos : pos + m + 1], out[got : got + m], owner)
                if k > 0:
                    got += k
                    pos += k
                    used += k
                    length = take = 1
                    continue
            if p < 0 or p >= n or owner[p] != OWNER_FREE:
                bad = True
                break
            owner[p] = OWNER_ALLOCATED
            if page_size == 1:
                out[got] = p
            else:
                _fill_run(out, got * page_size, page_size, p * page_size)
            got += 1
            pos = nxt
            used += 1
            length = take = 1
            continue
        length = -ring[nxt]
        take = min(length, need - got)
        if p < 0 or length > n - p:
            bad = True
            break
        # The loops of _flags_are, _set_flags and _fill_run written out: calls
        # per run cost more than the loops (docs/architecture.md).
        lo, hi, first, last = _word_masks(p, take)
        wrong = (words[lo] & first) | (words[hi] & last)  # OWNER_FREE is 0
        middle = words[lo + 1 : hi]  # indexed from 0, LLVM vectorises it
        for q in range(middle.shape[0]):
            wrong |= middle[q]
        if wrong != 0:
            bad = True
            break
        words[lo] = (words[lo] & ~first) | (_ALLOCATED_WORD & first)
        words[hi] = (words[hi] & ~last) | (_ALLOCATED_WORD & last)
        for q in range(middle.shape[0]):
            middle[q] = _ALLOCATED_WORD
        # A view (LLVM vectorises the fill) rounded up to 16 slots while the
        # rest of ``out`` has room: later runs overwrite the excess, and the
        # loop never ends in a remainder of its own (docs/architecture.md).
        at = got * page_size
        span = take * page_size
        if at + span + 15 < need * page_size:
            span = (span + 15) & ~15
        dst = out[at : at + span]
        start = p * page_size
        for j in range(span):
            dst[j] = start + j
        got += take
        if take < length:
            break
        w = run_width(length)
        pos = pos + w if pos + w < n else pos + w - n
        used += w
    if bad:  # a corrupted list: the pages claimed are put back
        q = head
        done = 0
        left = avail
        while done < got:
            length = run_at(ring, q, left)
            part = min(length, got - done)
            _set_flags(st, ring[q], part, OWNER_FREE)
            done += part
            w = run_width(length)
            q = q + w if q + w < n else q + w - n
            left -= w
        return fail(E_CORRUPT, got)
    if take < length:  # the last run's rest stays at the front
        rest = length - take
        first = ring[pos] + take
        if rest > 1:
            put_run(ring, pos, first, rest)
        else:
            pos = pos + 1 if pos + 1 < n else 0
            ring[pos] = first
            used += 1
    if into_released:
        st[H_NFREE] += st[H_NREL]
        st[H_EFREE] += st[H_EREL]
        st[H_NREL] = 0
        st[H_EREL] = 0
        st[H_MERGES] += 1
    st[H_HEAD] = pos
    st[H_NFREE] -= need
    st[H_EFREE] -= used
    return 0


# A sorted merge writes the longest runs when they average at least this many pages.
_RUNS_IN_A_MERGE = 4


@_callee()
def _free_counts(st: NDArray[np.int64], n: int) -> tuple[int, int]:
    """The free pages (``OWNER_FREE``) of a pool of ``n`` pages, and the ring entries their longest runs take.

    Eight flags a word: a bit per page says it is free (bit 0 of its byte,
    the byte's bits or-ed down into it), the same word shifted up a byte or
    two says whether the one or two pages before it are, and ``popcount``
    counts the pages, the runs' first pages and their second pages (a run
    of two or more takes one entry more). About four times faster than a
    branch-free loop over the bytes, whose carried state LLVM does not
    vectorise. The words are only shifted and masked: an int64 product or
    sum that overflows is undefined in numba's code (``nsw``), so no
    multiply tricks.
    """
    words = st[HEADER + (n + 1) // 2 : HEADER + (n + 1) // 2 + (n + 7) // 8]  # the owner flags (_layout.py)
    last = words.shape[0] - 1
    tail = (_LOW_BYTE << ((n & 7) << 3)) - 1 if n & 7 != 0 else _ALL_BYTES  # the last word's bytes that are pages
    found = 0
    entries = 0
    prev = 0  # the previous word's free bits; no page before page 0 is free
    for q in range(words.shape[0]):
        w: int = words[q]
        w |= w >> 4
        w |= w >> 2
        w |= w >> 1
        free = ~w & _EVERY_BYTE
        if q == last:
            free &= tail
        before = (free << 8) | (prev >> 56)  # page p - 1 free, in page p's bit
        older = (free << 16) | (prev >> 48)
        found += popcount(free)
        entries += popcount(free & ~before) + popcount(free & before & ~older)
        prev = free
    return found, entries


@_callee()
def merge_lists(st: NDArray[np.int64]) -> int:
    """Fold the release list into the free list.

    FIFO order: the release list already sits right behind the free list on
    the ring, in the order it was freed, so merging moves a boundary and
    copies nothing. Sorted order (``H_SORTED``): the two become one
    ascending list of the longest runs of free pages. The owner flags
    already say which pages are free (``OWNER_FREE``; a pending page is
    flagged apart), so one pass over them counts the pages and the entries
    their runs need, eight flags a word (:func:`_free_counts`), and a
    second writes the runs, skipping eight flags at a time inside and
    between runs: O(pages), no comparison sort. The longest runs take no
    more entries than the lists held, so they are written to end where the
    pending list starts, which stays where it is. When the runs are short
    (more than one entry per ``_RUNS_IN_A_MERGE`` pages), every page is
    written as an entry of its own instead, without a branch per page: the
    ring holds every page once. Nothing happens, and nothing is counted,
    without released pages.
    Returns the number of pages merged, or ``E_CORRUPT`` with the state
    unchanged if the flags do not count as many free pages as the lists
    hold.
    """
    moved: int = st[H_NREL]
    if moved == 0:
        return 0
    if st[H_SORTED] != 0:
        n: int = st[H_NPAGES]
        live: int = st[H_NFREE] + moved
        owner = owner_view(st)
        found, entries = _free_counts(st, n)
        old: int = st[H_EFREE] + st[H_EREL]
        if found != live or entries > old:
            return fail(E_CORRUPT, 0)
        ring = ring_view(st)
        base = HEADER + (n + 1) // 2  # the owner flags' first word (_layout.py)
        end: int = st[H_HEAD] + old  # where the pending list starts
        # Short runs: every free page as an entry of its own, without a branch
        # per page (a branch per run boundary cost more than the runs save).
        # They fit: the ring holds every page once.
        lone = entries * _RUNS_IN_A_MERGE > live
        written = live if lone else entries
        start = end - written
        start = start - n if start >= n else start
        start = start + n if start < 0 else start
        if lone:
            first = min(live, n - start)  # ring[start:start + first], then ring[:live - first]
            p = 0
            for segment in range(2):
                into = ring[start : start + first] if segment == 0 else ring[: live - first]
                m = into.shape[0]
                q = 0
                while q < m and p < n:  # every write stays in ``into``: the free pages were counted
                    into[q] = p
                    q += owner[p] == OWNER_FREE
                    p += 1
        else:
            pos = start
            p = 0
            while p < n:
                while p < n and owner[p] != OWNER_FREE:
                    w: int = st[base + (p >> 3)] if p & 7 == 0 and p + 8 <= n else 0
                    # No zero byte in the word: eight pages in a row that are not free.
                    p += 8 if w != 0 and ((w - _EVERY_BYTE) & ~w & _HIGH_BITS) == 0 else 1
                if p >= n:
                    break
                first = p
                while p < n and owner[p] == OWNER_FREE:
                    p += 8 if p & 7 == 0 and p + 8 <= n and st[base + (p >> 3)] == 0 else 1
                pos = put_run(ring, pos, first, p - first)
        st[H_HEAD] = start
        st[H_NFREE] = live
        st[H_EFREE] = written
    else:
        st[H_NFREE] += moved
        st[H_EFREE] += st[H_EREL]
    st[H_NREL] = 0
    st[H_EREL] = 0
    st[H_MERGES] += 1
    return moved


@_jit("i8(i8[::1])")
def merge(st: NDArray[np.int64]) -> int:
    """:func:`merge_lists`, for the pools to call."""
    return merge_lists(st)


@_callee()
def count_alloc(st: NDArray[np.int64], failed: int) -> None:
    """Count an answered allocation call, and the most pages ever held."""
    st[H_ALLOC_CALLS] += 1
    if failed != 0:
        st[H_FAILED_ALLOCS] += 1
    held: int = st[H_NPAGES] - st[H_NFREE] - st[H_NREL] - st[H_NPEND]
    st[H_PEAK] = max(st[H_PEAK], held)


@_jit("i8(i8[::1])")
def refuse(st: NDArray[np.int64]) -> int:
    """Count an allocation answered ``None`` before reaching a kernel; return ``E_SHORT``.

    The pool refuses a request larger than the whole pool, or one that a
    capacity check finds short before allocating its output, without
    calling an alloc kernel; the counters must still see it.
    """
    count_alloc(st, 1)
    return fail(E_SHORT, 0)


# -- runs in the caller's input ------------------------------------------------
# Callers give back what they were given, so a free's pages mostly come in
# runs of consecutive ids. free takes a long run whole: one vectorised test
# that its owner flags say allocated, one fill that changes them, one run on
# the ring. Short runs, lone pages and any run that fails a test go one page
# at a time, in input order, which also finds the exact position of a fault;
# consecutive pages still become one run on the ring.

# A free probes the slot ``_RUN_PROBE - 1`` ahead before it measures a run, so
# that input without runs (a shuffled free list) pays one comparison per slot.
# A run is measured ``_RUN_BLOCK`` slots at a time: a mask of the slots that
# do not continue it, built without a branch (LLVM vectorises the fixed-size
# loop), and its lowest set bit is where the run ends: one branch per block
# and one at the run's end, whatever its length (docs/architecture.md).
_RUN_PROBE = 8
_RUN_BLOCK = 64

# A stretch of at least ``_LONG_SLOTS`` slots (and two pages) is taken as a
# run; anything shorter goes a page at a time. Taking a run costs calls,
# views and three passes (measure, test, fill) where the page-at-a-time
# loop makes one, so only long runs repay it.
_LONG_SLOTS = 1024


@_callee()
def long_run(page_size: int) -> int:
    """Pages in a stretch long enough to take as a run, for pages of ``page_size`` slots."""
    return max(2, _LONG_SLOTS // page_size)


@_callee()  # a caller's slots
def _run_length(ids: NDArray[np.int64], start: int, limit: int, first: int) -> int:
    """How many of ``ids[start:start + limit]`` count up by one from ``first`` (at least 1).

    ``first`` is the caller's read of ``ids[start]``, which the run is
    measured against (never a second read); every other entry is read once.
    The first block is a mask (most runs end in it); later ones are first
    tested whole, which costs less per entry, and the block that fails the
    test is masked.
    """
    k = 1
    if k + _RUN_BLOCK <= limit:
        # A slice view: indexing ``ids[start + t]`` directly kept numba's
        # negative-index test in the loop, which stopped LLVM vectorising it.
        block = ids[start + k : start + k + _RUN_BLOCK]
        off = 0  # bit t: entry k + t does not continue the run
        for t in range(_RUN_BLOCK):
            off |= np.int64(block[t] != first + k + t) << t
        if off != 0:
            return k + trailing_zeros(off)
        k += _RUN_BLOCK
    while k + _RUN_BLOCK <= limit:
        block = ids[start + k : start + k + _RUN_BLOCK]
        acc = 0
        for t in range(_RUN_BLOCK):
            acc |= block[t] ^ (first + k + t)
        if acc != 0:
            break
        k += _RUN_BLOCK
    block = ids[start + k : start + min(k + _RUN_BLOCK, limit)]  # the block that failed, or what is left
    off = 0
    for t in range(block.shape[0]):
        off |= np.int64(block[t] != first + k + t) << t
    return k + trailing_zeros(off) if off != 0 else max(limit, 1)


# -- short calls -------------------------------------------------------------
# A call of at most SHORT_SLOTS slots holds no run worth taking (_LONG_SLOTS),
# so it goes through one flat loop, for every page size: each kernel below
# is a single function with no callee but ``fail``. numba compiles a callee
# as a unit of its own (its own typing, lowering and machine code) and links
# it in again, so these two compile in a third of the time the run kernels
# take (docs/architecture.md): what a new process's first alloc and free
# wait for. They keep the GIL: handing it over and back costs more than a
# short call's work. They read and write runs as ``run_at`` and ``put_run``
# do, written out.
SHORT_SLOTS = 1023
# Which page-size class a short kernel serves, fixed when it compiles: -1
# both, 0 pages of more than one slot, 1 page size 1. Each class's pool
# runs a copy compiled with its class (``free_p1_short`` and
# ``free_pn_short``, below), in which numba and LLVM drop the other's loop:
# a new process's first free compiles half the code.
_SHORT_CLASS = -1


@_jit("i8(i8[::1], i8[::1])", nogil=False)
def alloc_short(st: NDArray[np.int64], out: NDArray[np.int64]) -> int:
    """Pop ``len(out) // page_size`` pages from the front of the free list, run by run (:func:`take_front`).

    ``out`` (int64, its length a multiple of ``page_size``) receives the slot
    ids ``p * page_size + 0 .. page_size - 1`` of each page ``p``, pages in
    list order. Merges a FIFO release list when the free list alone is too
    short; a sorted pool that needs a merge gets ``E_MERGE_FIRST``, with
    nothing changed or counted: the pool merges and calls again. Returns
    ``len(out)``, or ``E_SHORT`` (counted), ``E_MISALIGNED`` (not counted),
    or ``E_CORRUPT`` if a listed page is not free, the lists unchanged.
    """
    page_size: int = st[H_PAGE_SIZE]
    if out.shape[0] % page_size != 0:
        return fail(E_MISALIGNED, 0)  # not counted: no allocation was asked for
    need: int = out.shape[0] // page_size
    nfree: int = st[H_NFREE]
    short = need > nfree + st[H_NREL]
    if need == 0 or short:
        st[H_ALLOC_CALLS] += 1
        st[H_FAILED_ALLOCS] += short
        return fail(E_SHORT, 0) if short else 0
    if need > nfree and st[H_SORTED] != 0:
        return fail(E_MERGE_FIRST, 0)  # a sorted merge reorders the pages: the pool merges first
    owner = owner_view(st)
    ring = ring_view(st)
    n = ring.shape[0]
    words = st[HEADER + (n + 1) // 2 :]  # the owner flags, eight to a word (_flags_are)
    into_released = need > nfree
    avail: int = st[H_EFREE] + st[H_EREL] if into_released else st[H_EFREE]
    head: int = st[H_HEAD]
    pos = head
    used = 0
    got = 0
    length = 0
    take = 0
    bad = False
    while got < need:
        if used >= avail:
            bad = True
            break
        p: int = ring[pos]
        nxt = pos + 1 if pos + 1 < n else 0
        if avail - used == 1 or ring[nxt] >= 0:  # a page alone: no views
            if p < 0 or p >= n or owner[p] != OWNER_FREE:
                bad = True
                break
            owner[p] = OWNER_ALLOCATED
            if page_size == 1:
                out[got] = p
            else:
                dst = out[got * page_size : (got + 1) * page_size]  # a view: LLVM vectorises the fill
                first = p * page_size
                for j in range(page_size):
                    dst[j] = first + j
            got += 1
            pos = nxt
            used += 1
            length = take = 1
            continue
        length = -ring[nxt]
        take = length if length < need - got else need - got  # not min(): its overload is a compile of its own
        if p < 0 or length > n - p:
            bad = True
            break
        # The run's flags, eight to a word: _word_masks, _flags_are and _set_flags written out.
        lo = p >> 3
        hi = (p + take - 1) >> 3
        first = _ALL_BYTES << ((p & 7) << 3)
        top = ((p + take - 1) & 7) + 1
        last = _ALL_BYTES if top == _FLAGS_PER_WORD else (_LOW_BYTE << (top << 3)) - 1
        if lo == hi:
            first &= last
            last = first
        wrong = (words[lo] & first) | (words[hi] & last)  # OWNER_FREE is 0
        middle = words[lo + 1 : hi]  # indexed from 0, LLVM vectorises it
        for q in range(middle.shape[0]):
            wrong |= middle[q]
        if wrong != 0:
            bad = True
            break
        words[lo] = (words[lo] & ~first) | (_ALLOCATED_WORD & first)
        words[hi] = (words[hi] & ~last) | (_ALLOCATED_WORD & last)
        for q in range(middle.shape[0]):
            middle[q] = _ALLOCATED_WORD
        # A view (LLVM vectorises the fill) rounded up to 16 slots while the
        # rest of ``out`` has room: later runs overwrite the excess, and the
        # loop never ends in a remainder of its own (docs/architecture.md).
        at = got * page_size
        span = take * page_size
        if at + span + 15 < need * page_size:
            span = (span + 15) & ~15
        dst = out[at : at + span]
        first = p * page_size
        for j in range(span):
            dst[j] = first + j
        got += take
        if take < length:
            break
        w = 1 if length == 1 else 2
        pos = pos + w if pos + w < n else pos + w - n
        used += w
    if bad:  # a corrupted list: the pages claimed are put back
        q = head
        done = 0
        left = avail
        while done < got:
            nxt = q + 1 if q + 1 < n else 0
            length = -ring[nxt] if left > 1 and ring[nxt] < 0 else 1
            part = length if length < got - done else got - done
            back = owner[ring[q] : ring[q] + part]
            for j in range(part):  # a loop, not a slice assignment: that compiles numpy's setitem
                back[j] = OWNER_FREE
            done += part
            w = 1 if length == 1 else 2
            q = q + w if q + w < n else q + w - n
            left -= w
        return fail(E_CORRUPT, got)
    if take < length:  # the last run's rest stays at the front
        rest = length - take
        nxt = pos + 1 if pos + 1 < n else 0
        if rest > 1:
            ring[pos] += take
            ring[nxt] = -rest
        else:
            ring[nxt] = ring[pos] + take
            pos = nxt
            used += 1
    if into_released:  # read on into the release list: a FIFO merge
        st[H_NFREE] += st[H_NREL]
        st[H_EFREE] += st[H_EREL]
        st[H_NREL] = 0
        st[H_EREL] = 0
        st[H_MERGES] += 1
    st[H_HEAD] = pos
    st[H_NFREE] -= need
    st[H_EFREE] -= used
    st[H_ALLOC_CALLS] += 1
    st[H_PEAK] = max(st[H_PEAK], n - st[H_NFREE] - st[H_NREL] - st[H_NPEND])
    return need * page_size


@_jit("i8(i8[::1], i8[::1])", nogil=False)
def free_short(st: NDArray[np.int64], slots: NDArray[np.int64]) -> int:
    """Validate ``slots`` as whole allocated pages, then release them, a page at a time.

    ``slots`` (int64, its length a multiple of ``page_size``) is read in
    runs of ``page_size``; each must be one page's slots in ascending
    order, of a page currently allocated and not named earlier in the
    call. Pages may come in any order; they join the release list in the
    order given (the pending list inside a free group): at page size 1,
    runs of ``_RUN_PROBE`` slots or more as runs, else each page an entry
    of its own. Each page's id derives from one read of its first slot, its
    other slots are compared against that read, and it is staged on the
    ring's spare part before anything else (see ``free_pn``). Returns the
    number of slots freed, or ``E_LENGTH``, ``E_RANGE``, ``E_MISALIGNED``,
    ``E_PARTIAL``, ``E_NOT_ALLOCATED`` or ``E_DUPLICATE`` at the first
    offending position in input order, with the state unchanged.
    """
    page_size: int = st[H_PAGE_SIZE]
    if slots.shape[0] % page_size != 0:
        return fail(E_LENGTH, 0)
    n: int = st[H_NPAGES]
    count: int = slots.shape[0] // page_size
    if n == 0 and count > 0:  # no slot is in range, and no ring to stage into
        return fail(E_RANGE, 0)
    shift: int = st[H_PAGE_SHIFT]
    mask = page_size - 1
    size = n * page_size
    owner = owner_view(st)
    ring = ring_view(st)
    mark = OWNER_PENDING if st[H_GROUP_DEPTH] > 0 else OWNER_FREE
    tail: int = st[H_HEAD] + st[H_EFREE] + st[H_EREL] + st[H_EPEND]
    if tail >= n:
        tail -= n
    pos = tail
    status = 0
    missing = -1  # a page found not allocated: freed earlier in this call, or not held
    c = 0  # pages staged
    entries = 0  # entries staged
    if page_size == 1 and _SHORT_CLASS != 0:  # page ids are slot ids; runs as in free_p1, written out
        words = st[HEADER + (n + 1) // 2 :]  # the owner flags, eight to a word (_flags_are)
        reach = _RUN_PROBE - 1
        skip = 0
        while c < count:
            p = slots[c]  # the only read of this element (a run's ids all derive from it)
            if p < 0 or p >= n:
                status = fail(E_RANGE, c)
                break
            if c >= skip and c + reach < count and slots[c + reach] == p + reach:
                # _run_length, _word_masks, _flags_are and _set_flags written out (all masks, no test first:
                # a short call's runs end in their first blocks).
                run = 1
                limit = count - c if count - c < n - p else n - p  # not min(): its overload is a compile of its own
                off = 0
                while run + _RUN_BLOCK <= limit:
                    block = slots[c + run : c + run + _RUN_BLOCK]
                    for t in range(_RUN_BLOCK):
                        off |= np.int64(block[t] != p + run + t) << t
                    if off != 0:
                        break
                    run += _RUN_BLOCK
                if off == 0:
                    block = slots[c + run : c + limit]
                    for t in range(block.shape[0]):
                        off |= np.int64(block[t] != p + run + t) << t
                run = run + trailing_zeros(off) if off != 0 else limit
                lo = p >> 3
                hi = (p + run - 1) >> 3
                first = _ALL_BYTES << ((p & 7) << 3)
                top = ((p + run - 1) & 7) + 1
                last = _ALL_BYTES if top == _FLAGS_PER_WORD else (_LOW_BYTE << (top << 3)) - 1
                if lo == hi:
                    first &= last
                    last = first
                held = OWNER_ALLOCATED * _EVERY_BYTE
                wrong = ((words[lo] ^ held) & first) | ((words[hi] ^ held) & last)
                middle = words[lo + 1 : hi]  # indexed from 0, LLVM vectorises it
                for q in range(middle.shape[0]):
                    wrong |= middle[q] ^ held
                if wrong == 0 and run > 1:
                    pattern = mark * _EVERY_BYTE
                    words[lo] = (words[lo] & ~first) | (pattern & first)
                    words[hi] = (words[hi] & ~last) | (pattern & last)
                    for q in range(middle.shape[0]):
                        middle[q] = pattern
                    # A run is measured to its end (or the pool's), so the next
                    # slot never continues it: nothing to join.
                    ring[pos] = p
                    pos = pos + 1 if pos + 1 < n else 0
                    ring[pos] = -run
                    pos = pos + 1 if pos + 1 < n else 0
                    entries += 2
                    c += run
                    continue
                skip = c + run  # slot by slot, to the exact position of the fault
            if owner[p] != OWNER_ALLOCATED:
                missing = p
                break
            owner[p] = mark
            ring[pos] = p
            pos = pos + 1 if pos + 1 < n else 0
            entries += 1
            c += 1
    while page_size > 1 and _SHORT_CLASS != 1 and c < count:
        b = c * page_size
        head_slot = slots[b]  # the page's id derives from this one read
        if head_slot < 0 or head_slot >= size:
            status = fail(E_RANGE, b)
            break
        # Shifts and masks for power-of-two pages: a division is a small page's largest cost.
        misaligned = head_slot & mask if shift >= 0 else head_slot % page_size
        if misaligned != 0:
            status = fail(E_MISALIGNED, b)
            break
        p = head_slot >> shift if shift >= 0 else head_slot // page_size
        page = slots[b : b + page_size]
        bad = 0
        for j in range(page_size):  # branch-free; the exact position only when wrong
            bad |= page[j] ^ (head_slot + j)
        if bad != 0:
            status = fail(E_PARTIAL, b + 1)  # a writer may have restored the value since
            for j in range(page_size):
                if page[j] != head_slot + j:
                    status = fail(E_PARTIAL, b + j)
                    break
            break
        if owner[p] != OWNER_ALLOCATED:
            missing = p
            break
        owner[p] = mark
        ring[pos] = p  # a page of its own: a short call's pages are few, its runs short
        pos = pos + 1 if pos + 1 < n else 0
        entries += 1
        c += 1
    if missing >= 0 and _SHORT_CLASS == 0:  # lone pages only: E_DUPLICATE if this call staged it already
        status = fail(E_NOT_ALLOCATED, c * page_size)
        q = tail
        for _ in range(entries):
            if ring[q] == missing:
                status = fail(E_DUPLICATE, c * page_size)
                break
            q = q + 1 if q + 1 < n else 0
    elif missing >= 0:  # E_DUPLICATE if this call staged it already; the staged runs, not the input
        status = fail(E_NOT_ALLOCATED, c * page_size)
        q = tail
        left = entries
        while left > 0:
            nxt = q + 1 if q + 1 < n else 0
            run = -ring[nxt] if left > 1 and ring[nxt] < 0 else 1
            if ring[q] <= missing < ring[q] + run:
                status = fail(E_DUPLICATE, c * page_size)
                break
            w = 1 if run == 1 else 2
            q = q + w if q + w < n else q + w - n
            left -= w
    if status < 0 and _SHORT_CLASS == 0:  # roll back: the staged pages are allocated again
        q = tail
        for _ in range(entries):
            owner[ring[q]] = OWNER_ALLOCATED
            q = q + 1 if q + 1 < n else 0
        return status
    if status < 0:
        q = tail
        left = entries
        while left > 0:
            nxt = q + 1 if q + 1 < n else 0
            run = -ring[nxt] if left > 1 and ring[nxt] < 0 else 1
            back = owner[ring[q] : ring[q] + run]
            for j in range(run):  # a loop, not a slice assignment: that compiles numpy's setitem
                back[j] = OWNER_ALLOCATED
            w = 1 if run == 1 else 2
            q = q + w if q + w < n else q + w - n
            left -= w
        return status
    if st[H_GROUP_DEPTH] > 0:
        st[H_NPEND] += c
        st[H_EPEND] += entries
    else:
        st[H_NREL] += c
        st[H_EREL] += entries
    if c > 0:
        st[H_FREE_CALLS] += 1
    return count * page_size


# -- alloc --------------------------------------------------------------------
# Longer calls. With the lists kept as runs, an allocation writes each run's
# slots as one range for every page size, so one kernel serves both
# page-size classes.


@_callee()
def _alloc_begin(st: NDArray[np.int64], out: NDArray[np.int64]) -> int:
    """An allocation's checks: the pages to take (above 0), or what the kernel returns (0 or a failure).

    ``E_MISALIGNED`` (``len(out)`` not a multiple of ``page_size``: the
    pool's alignment check, made here to spare the hot path a Python check)
    comes before anything, counters included. An empty allocation and one
    the lists cannot serve (``E_SHORT``) are counted here.
    """
    page_size: int = st[H_PAGE_SIZE]
    if out.shape[0] % page_size != 0:
        return fail(E_MISALIGNED, 0)  # not counted: no allocation was asked for
    need: int = out.shape[0] // page_size
    if need == 0:
        count_alloc(st, 0)
        return 0
    if need > st[H_NFREE] + st[H_NREL]:
        count_alloc(st, 1)
        return fail(E_SHORT, 0)
    return need


@_jit("i8(i8[::1], i8[::1])")
def alloc_pages(st: NDArray[np.int64], out: NDArray[np.int64]) -> int:
    """Pop ``len(out) // page_size`` pages from the front of the free list (:func:`take_front`).

    ``out`` (int64, caller-provided, length a multiple of ``page_size``)
    receives the slot ids ``p * page_size + 0 .. page_size - 1`` of each
    page ``p``, pages in list order. Merges the release list if the free
    list alone is too short (FIFO: after reading on from the free list into
    the release list, which is the same). A sorted pool that needs a merge
    gets ``E_MERGE_FIRST`` instead, nothing changed or counted: its caller
    merges (:func:`merge`) and calls again. Returns ``len(out)``, or a
    failure (``E_SHORT``, or ``E_CORRUPT`` if a listed page is not free)
    with the lists unchanged; ``out`` is then partly written and should be
    discarded. Counts the call either way; but ``E_MISALIGNED`` comes
    before anything, counters included.
    """
    need = _alloc_begin(st, out)
    if need <= 0:
        return need
    if need > st[H_NFREE] and st[H_SORTED] != 0:
        # A sorted merge reorders the pages, so it comes before reading them;
        # the pool calls merge and asks again (this kernel stays small).
        return fail(E_MERGE_FIRST, 0)
    page_size: int = st[H_PAGE_SIZE]
    status = take_front(st, need, out, page_size)
    if status < 0:
        return status
    count_alloc(st, 0)
    return need * page_size


# -- free ---------------------------------------------------------------------
# ``slots`` may be a caller's array that another thread writes while a free
# kernel runs without the GIL. So each page's id is derived from one read of
# its first slot (a run's from its first), the rest of its slots are compared
# against that read, and the id is checked and staged in the ring's spare
# part (pool memory, outside the live window) before anything else happens;
# the release, and the roll-back of a failure, read only those staged runs,
# never ``slots`` again. A racing writer can make the call fail, but never
# make it act on a value it did not validate. A page can only be staged
# after its flag said "allocated", and every allocated page is off the live
# window, so the spare part of the ring always has room (a run takes at most
# an entry per page).


@_callee()
def _stage(
    ring: NDArray[np.int32], pos: int, entries: int, first: int, length: int, p: int, more: int
) -> tuple[int, int, int, int]:
    """Add pages ``p .. p + more - 1`` to the open run ``first, length``, or write it and open theirs.

    A free's staging registers: ``pos`` (the next entry), ``entries``
    (written so far), and the open run, written only when a page does not
    continue it (or at the end): a run of any length costs two writes.
    """
    if p == first + length:
        return pos, entries, first, length + more
    if length > 0:
        pos = put_run(ring, pos, first, length)
        entries += run_width(length)
    return pos, entries, p, more


@_callee()
def _staged_twice(ring: NDArray[np.int32], tail: int, entries: int, page: int, position: int) -> int:
    """The failure for a ``page`` that ``free`` found not allocated.

    ``E_DUPLICATE`` if this call staged it already (it is in one of the
    ``entries`` staged from ring position ``tail``), else
    ``E_NOT_ALLOCATED``. Error path only; it reads the pool's ring, never
    the caller's input.
    """
    n = ring.shape[0]
    pos = tail
    left = entries
    while left > 0:
        length = run_at(ring, pos, left)
        if ring[pos] <= page < ring[pos] + length:
            return fail(E_DUPLICATE, position)
        w = run_width(length)
        pos = pos + w if pos + w < n else pos + w - n
        left -= w
    return fail(E_NOT_ALLOCATED, position)


@_callee()
def _free_end(st: NDArray[np.int64], tail: int, done: int, entries: int, status: int) -> int:
    """Finish a free that staged ``done`` pages as ``entries`` from ring position ``tail``: commit, or roll back.

    On a failure (``status < 0``) the staged pages are flagged allocated
    again (their runs stay outside the live window, as unread scratch) and
    the failure is returned. Otherwise they join the release list (inside a
    free group, the pending list: the kernels flagged them
    ``OWNER_PENDING``; the group's end releases them) and ``status`` is
    returned.
    """
    if status < 0:
        set_runs(st, tail, entries, OWNER_ALLOCATED)
        return status
    if st[H_GROUP_DEPTH] > 0:
        st[H_NPEND] += done
        st[H_EPEND] += entries
    else:
        st[H_NREL] += done
        st[H_EREL] += entries
    if done > 0:
        st[H_FREE_CALLS] += 1
    return status


@_jit("i8(i8[::1], i8[::1])")
def free_pn(st: NDArray[np.int64], slots: NDArray[np.int64]) -> int:
    """Validate ``slots`` as whole allocated pages, then release them; for ``page_size > 1``.

    ``slots`` (int64, length a multiple of ``page_size``) is read in runs of
    ``page_size``; each run must be one page's slots in ascending order, of
    a page that is currently allocated and not named earlier in the call.
    Pages may come in any order; they are appended to the release list in
    the order given (to the pending list inside a free group), pages in a
    row as one run. Returns the number of slots freed, or a failure
    (``E_RANGE``, ``E_MISALIGNED``, ``E_PARTIAL``, ``E_NOT_ALLOCATED``,
    ``E_DUPLICATE``) at the first offending position in input order, with
    the state unchanged; ``E_LENGTH`` first if ``len(slots)`` is not a
    multiple of ``page_size``.

    A page at a time, or a run of ``long`` pages or more: where the page
    ``long - 1`` pages ahead begins where a run would put it, the run is
    measured and, when every slot of it counts up and every page is
    allocated, released whole.
    """
    page_size: int = st[H_PAGE_SIZE]
    if slots.shape[0] % page_size != 0:
        return fail(E_LENGTH, 0)
    shift = st[H_PAGE_SHIFT]
    mask = page_size - 1
    n = st[H_NPAGES]
    size = n * page_size
    count: int = slots.shape[0] // page_size
    owner = owner_view(st)
    ring = ring_view(st)
    mark = OWNER_PENDING if st[H_GROUP_DEPTH] > 0 else OWNER_FREE
    if n == 0 and count > 0:  # no slot is in range, and no ring to stage into
        return fail(E_RANGE, 0)
    long = long_run(page_size)
    tail = ring_tail(st)
    pos = tail
    entries = 0
    first_page = -2
    length = 0
    status = 0
    missing = -1  # a page found not allocated: freed earlier in this call, or not held
    reach = (long - 1) * page_size
    c = 0  # input pages staged
    skip = 0  # a stretch that failed its tests is not measured twice
    while c < count:
        start = c * page_size
        if c >= skip and c + long <= count:
            first = slots[start]  # every slot of the run is compared against this one read
            if 0 <= first < size and first % page_size == 0 and slots[start + reach] == first + reach:
                p = first // page_size
                # Whole pages of a run are one run of slots: measured in one
                # vectorised pass over every slot. A page cut short ends it.
                run = _run_length(slots, start, min(count - c, n - p) * page_size, first) // page_size
                if run > 0 and _flags_are(st, p, run, OWNER_ALLOCATED):
                    _set_flags(st, p, run, mark)
                    pos, entries, first_page, length = _stage(ring, pos, entries, first_page, length, p, run)
                    c += run
                    continue
                skip = c + run  # page by page, to the exact position of the fault
        # A view of the block indexed from 0: a slice per page, or indexing
        # ``slots`` from a running position, cost a reference count or a
        # negative-index test per page.
        end = min(count, c + long)
        block = slots[start : end * page_size]
        stop = end
        for k in range(end - c):
            b = k * page_size
            first = block[b]  # the page's id derives from this one read
            if first < 0 or first >= size:
                status = fail(E_RANGE, start + b)
                stop = c + k
                break
            # Shifts and masks for power-of-two pages: a division per page
            # is the largest cost of small pages.
            if shift >= 0:
                misaligned = first & mask
                p = first >> shift
            else:
                misaligned = first % page_size
                p = first // page_size
            if misaligned != 0:
                status = fail(E_MISALIGNED, start + b)
                stop = c + k
                break
            # One branch-free pass per page; the scan for the exact position
            # runs only when the page is already known to be wrong. It
            # compares against ``first`` as read above, so an element
            # changed since then fails the page rather than slipping through.
            bad = 0
            for j in range(page_size):
                bad |= block[b + j] ^ (first + j)
            if bad != 0:
                # A writer may have restored the value by now: report the
                # page at its second slot then, still a partial page.
                status = fail(E_PARTIAL, start + b + 1)
                for j in range(page_size):
                    if block[b + j] != first + j:
                        status = fail(E_PARTIAL, start + b + j)
                        break
                stop = c + k
                break
            if owner[p] != OWNER_ALLOCATED:
                missing = p  # resolved below, once the open run is written
                stop = c + k
                break
            owner[p] = mark
            pos, entries, first_page, length = _stage(ring, pos, entries, first_page, length, p, 1)
        c = stop  # the pages staged so far
        if status != 0 or missing >= 0:
            break
    if length > 0:
        put_run(ring, pos, first_page, length)
        entries += run_width(length)
    if missing >= 0:
        status = _staged_twice(ring, tail, entries, missing, c * page_size)
    return _free_end(st, tail, c, entries, status if status != 0 else count * page_size)


_STOPPED_AT_A_RUN = 1  # why _stage_lone stopped (0: the end of its view)
_STOPPED_AT_A_FAULT = 2


@_callee()
def _stage_lone(
    src: NDArray[np.int64], into: NDArray[np.int32], owner: NDArray[np.uint8], mark: int, probe_from: int
) -> tuple[int, int, int]:
    """Flag the allocated pages ``src`` ``mark`` and stage each ``into`` the ring alone, until one is not.

    Stops before a slot, from ``probe_from`` on, that starts a run (the slot
    ``_RUN_PROBE - 1`` ahead continues it), for the caller to take whole.
    Page size 1's loop, a function of its own: views indexed from 0 and few
    live values, so the flags' base stays in a register. Returns the slots
    staged, the value that stopped it as read (the one read of it), and
    why: 0 the end of ``into``, ``_STOPPED_AT_A_RUN``, or ``_STOPPED_AT_A_FAULT`` (not an allocated page).
    """
    reach = _RUN_PROBE - 1
    n = owner.shape[0]
    m = into.shape[0]
    probed = min(m, src.shape[0] - reach)  # slots with a slot ``reach`` ahead to probe
    k = 0
    p = 0
    while k < probed:
        p = src[k]
        if p < 0 or p >= n or owner[p] != OWNER_ALLOCATED:
            return k, p, _STOPPED_AT_A_FAULT
        if src[k + reach] == p + reach and k >= probe_from:
            return k, p, _STOPPED_AT_A_RUN
        owner[p] = mark
        into[k] = p
        k += 1
    while k < m:
        p = src[k]
        if p < 0 or p >= n or owner[p] != OWNER_ALLOCATED:
            return k, p, _STOPPED_AT_A_FAULT
        owner[p] = mark
        into[k] = p
        k += 1
    return k, p, 0


@_jit("i8(i8[::1], i8[::1])")
def free_p1(st: NDArray[np.int64], slots: NDArray[np.int64]) -> int:
    """:func:`free_pn` for ``page_size == 1``, where a page id is a slot id (every length is whole pages).

    Where the slot ``_RUN_PROBE - 1`` ahead continues this one, the run is
    measured (:func:`_run_length`) and, when every page of it is
    allocated, taken whole: its flags tested and set eight to a word, one
    run staged.
    Other slots are staged one entry each (:func:`_stage_lone`): a short
    run costs less as lone pages than measured.
    """
    n = st[H_NPAGES]
    count: int = slots.shape[0]
    owner = owner_view(st)
    ring = ring_view(st)
    mark = OWNER_PENDING if st[H_GROUP_DEPTH] > 0 else OWNER_FREE
    if n == 0 and count > 0:  # no slot is in range, and no ring to stage into
        return fail(E_RANGE, 0)
    reach = _RUN_PROBE - 1
    tail = ring_tail(st)
    pos = tail
    entries = 0
    status = 0
    c = 0  # input slots staged
    skip = 0  # a run that failed its flag test is not measured twice
    missing = -1  # a page found not allocated: freed earlier in this call, or not held
    while c < count:
        p = slots[c]  # the only read of this element (a run's ids all derive from it)
        if c >= skip and 0 <= p < n and c + reach < count and slots[c + reach] == p + reach:
            run = _run_length(slots, c, min(count - c, n - p), p)
            if run > 1 and _flags_are(st, p, run, OWNER_ALLOCATED):
                _set_flags(st, p, run, mark)
                # Measured to its end (or the pool's): the next slot never continues it.
                pos = put_run(ring, pos, p, run)
                entries += 2
                c += run
                continue
            skip = c + run  # slot by slot, to the exact position of the fault
        staged, p, why = _stage_lone(slots[c:], ring[pos : pos + min(count - c, n - pos)], owner, mark, skip - c)
        c += staged
        entries += staged
        pos += staged
        if pos == n:
            pos = 0
        if why == _STOPPED_AT_A_FAULT:  # the fault, from the value read
            if p < 0 or p >= n:
                status = fail(E_RANGE, c)
            else:
                missing = p
            break
    if missing >= 0:
        status = _staged_twice(ring, tail, entries, missing, c)
    return _free_end(st, tail, c, entries, status if status != 0 else count)


# Calls of SHORT_SLOTS + 1 .. GIL_SLOTS slots run these twins of the run
# kernels, compiled from the same source with the GIL kept: handing it over
# and back costs more than such a call saves by letting others run.
GIL_SLOTS = 4096

_TWO = "i8(i8[::1], i8[::1])"
alloc_pages_gil = _twin(alloc_pages, _TWO, name="alloc_pages_gil", nogil=False)
free_pn_gil = _twin(free_pn, _TWO, name="free_pn_gil", nogil=False)
free_p1_gil = _twin(free_p1, _TWO, name="free_p1_gil", nogil=False)
free_pn_short = _twin(free_short, _TWO, name="free_pn_short", nogil=False, constants={"_SHORT_CLASS": 0})
free_p1_short = _twin(free_short, _TWO, name="free_p1_short", nogil=False, constants={"_SHORT_CLASS": 1})


# -- tracking -----------------------------------------------------------------
# A tracking pool's kernels call the plain kernels' code as callees (the same
# source, compiled again only when a tracking pool is used), then record who
# holds each page. The plain kernels stay as short as an untracked pool needs.

_alloc_short = _as_callee(alloc_short)
_alloc_pages = _as_callee(alloc_pages)
_free_short = _as_callee(free_short)
_free_pn = _as_callee(free_pn)
_free_p1 = _as_callee(free_p1)


@_callee()
def track_alloc(st: NDArray[np.int64], out: NDArray[np.int64] | NDArray[np.int32], site: int, status: int) -> int:
    """After a successful allocation into ``out`` (``status > 0``), each of its pages records it.

    The allocation gets the next number (``H_SEQ``); each of its pages
    records that number and ``site`` (the id of the call site and tag),
    keeping the id of the site that last freed it. O(pages).
    """
    if status <= 0:
        return status
    page_size: int = st[H_PAGE_SIZE]
    n: int = st[H_NPAGES]
    t: int = st[H_TRACK]
    seq: int = st[H_SEQ]
    st[H_SEQ] = seq + 1
    for i in range(out.shape[0] // page_size):
        p = out[i * page_size] // page_size
        st[t + p] = seq
        st[t + n + p] = (site << 32) | (st[t + n + p] & _LOW32)
    return status


@_callee()
def track_free(st: NDArray[np.int64], tail: int, site: int, status: int) -> int:
    """After a successful free (``status > 0``), each page freed records ``site`` as the site that freed it.

    The pages are read back from the runs the free staged on the ring
    (from position ``tail`` to the new end of the window, not from the
    caller's slots again). O(pages).
    """
    if status <= 0:
        return status
    n: int = st[H_NPAGES]
    t: int = st[H_TRACK]
    pos = tail
    ring = ring_view(st)
    left = ring_tail(st) - tail
    if left < 0:
        left += n
    while left > 0:
        length = run_at(ring, pos, left)
        first: int = ring[pos]
        for p in range(first, first + length):
            st[t + n + p] = (st[t + n + p] & ~_LOW32) | site
        w = run_width(length)
        pos = pos + w if pos + w < n else pos + w - n
        left -= w
    return status


_TRACKED = "i8(i8[::1], i8[::1], i8)"


@_jit(_TRACKED)
def alloc_tracked(st: NDArray[np.int64], out: NDArray[np.int64], site: int) -> int:
    """:func:`alloc_pages`, then each page handed out records this allocation (:func:`track_alloc`)."""
    return track_alloc(st, out, site, _alloc_pages(st, out))


@_jit(_TRACKED)
def free_pn_tracked(st: NDArray[np.int64], slots: NDArray[np.int64], site: int) -> int:
    """:func:`free_pn`, then each page freed records ``site`` (:func:`track_free`)."""
    tail = ring_tail(st)
    return track_free(st, tail, site, _free_pn(st, slots))


@_jit(_TRACKED)
def free_p1_tracked(st: NDArray[np.int64], slots: NDArray[np.int64], site: int) -> int:
    """:func:`free_p1`, then each page freed records ``site`` (:func:`track_free`)."""
    tail = ring_tail(st)
    return track_free(st, tail, site, _free_p1(st, slots))


@_jit(_TRACKED, nogil=False)
def alloc_tracked_short(st: NDArray[np.int64], out: NDArray[np.int64], site: int) -> int:
    """:func:`alloc_short`, then each page handed out records this allocation (:func:`track_alloc`)."""
    return track_alloc(st, out, site, _alloc_short(st, out))


@_jit(_TRACKED, nogil=False)
def free_tracked_short(st: NDArray[np.int64], slots: NDArray[np.int64], site: int) -> int:
    """:func:`free_short`, then each page freed records ``site`` (:func:`track_free`)."""
    tail = ring_tail(st)
    return track_free(st, tail, site, _free_short(st, slots))


class PageSizeKernels(NamedTuple):
    """The alloc and free kernels of one page-size class: ``KERNELS[page_size == 1]``.

    Calls of at most :data:`SHORT_SLOTS` slots run the flat ``*_short``
    kernels (one alloc for every class, a free compiled for each), calls of up to :data:`GIL_SLOTS`
    the run kernels' ``*_gil`` twins, longer ones the run kernels, which
    release the GIL. A tracking pool's calls run ``*_tracked_short`` up to
    :data:`SHORT_SLOTS`, ``*_tracked`` beyond.
    """

    alloc: Any
    alloc_gil: Any
    alloc_short: Any
    free: Any
    free_gil: Any
    free_short: Any
    alloc_tracked: Any
    alloc_tracked_short: Any
    free_tracked: Any
    free_tracked_short: Any


KERNELS = (
    PageSizeKernels(
        alloc_pages,
        alloc_pages_gil,
        alloc_short,
        free_pn,
        free_pn_gil,
        free_pn_short,
        alloc_tracked,
        alloc_tracked_short,
        free_pn_tracked,
        free_tracked_short,
    ),
    PageSizeKernels(
        alloc_pages,
        alloc_pages_gil,
        alloc_short,
        free_p1,
        free_p1_gil,
        free_p1_short,
        alloc_tracked,
        alloc_tracked_short,
        free_p1_tracked,
        free_tracked_short,
    ),
)


@_jit("i8(i8[::1])")
def group_begin(st: NDArray[np.int64]) -> int:
    """Begin a (possibly nested) free group; return the new depth."""
    st[H_GROUP_DEPTH] += 1
    depth: int = st[H_GROUP_DEPTH]
    return depth


@_jit("i8(i8[::1])")
def group_end(st: NDArray[np.int64]) -> int:
    """End the innermost free group; the outermost one releases the pending list.

    The pending list sits right behind the release list, in the order its
    pages were freed, so releasing it moves a boundary; only the pages'
    flags change (``OWNER_PENDING`` to ``OWNER_FREE``), a run at a time.
    Returns the number of pages released (0 for an inner group), or
    ``E_NO_GROUP`` with the state unchanged when no group is open.
    """
    depth: int = st[H_GROUP_DEPTH]
    if depth <= 0:
        return fail(E_NO_GROUP, 0)
    st[H_GROUP_DEPTH] = depth - 1
    if depth > 1:
        return 0
    n: int = st[H_NPAGES]
    pend: int = st[H_NPEND]
    pos: int = st[H_HEAD] + st[H_EFREE] + st[H_EREL]
    set_runs(st, pos - n if pos >= n else pos, st[H_EPEND], OWNER_FREE)
    st[H_NREL] += pend
    st[H_EREL] += st[H_EPEND]
    st[H_NPEND] = 0
    st[H_EPEND] = 0
    return pend


@_jit("i8(i8[::1], i8[::1], i8, i8)")
def plan_batch(sizes: NDArray[np.int64], offsets: NDArray[np.int64], page_size: int, limit: int) -> int:
    """Check a batch of allocation sizes and lay out where each request's slots go.

    ``sizes`` (int64) must each be a non-negative multiple of ``page_size``;
    they are checked in order, each for alignment before sign, as ``alloc``
    checks one size: ``E_MISALIGNED`` or ``E_NEGATIVE`` at the first bad
    one. ``offsets`` (length ``len(sizes) + 1``) receives the prefix sums,
    so request ``i`` owns ``slots[offsets[i]:offsets[i + 1]]`` of the one
    allocation of the total that follows (:func:`alloc_pages`), which is
    why the batch gets exactly the slots ``alloc(total)`` would. Returns the
    total, or ``limit + 1`` when it exceeds ``limit`` (the pool's size: the
    sum saturates there rather than overflow, and the batch cannot be
    served). Touches no pool state.
    """
    mask = page_size - 1
    pow2 = (page_size & mask) == 0
    total = 0
    over = False
    offsets[0] = 0
    for i in range(sizes.shape[0]):
        s: int = sizes[i]
        misaligned = (s & mask) if pow2 else (s % page_size)
        if misaligned != 0:
            return fail(E_MISALIGNED, i)
        if s < 0:
            return fail(E_NEGATIVE, i)
        if over or s > limit - total:
            over = True  # the batch cannot be served; later sizes are still checked
        else:
            total += s
        offsets[i + 1] = total
    return limit + 1 if over else total


@_jit("i8(i8[::1], i8[::1])")
def load_state(st: NDArray[np.int64], src: NDArray[np.int64]) -> int:
    """Copy a validated snapshot ``src`` over the state; return its length.

    ``restore_state`` and unpickling check ``src`` (same layout, invariants)
    before calling this; here it is one block copy, so the pool is never
    seen half restored by a kernel.
    """
    words: int = st.shape[0]
    for i in range(words):  # not ``st[:] = src``, which may copy ``src`` first
        st[i] = src[i]
    return words
