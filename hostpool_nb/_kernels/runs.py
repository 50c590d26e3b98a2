"""Numba callees and kernels on runs of pages: the ring's run encoding, owner flags tested and set eight to a
word, taking pages from the front of the lists, merges, and runs in a caller's input.

The core pool's kernels (``_kernels/pool.py``, ``_kernels/short.py``) and the device allocators'
(``_kernels/paged.py``) all read and write lists through these. Layout and status codes: ``_kernels/layout.py``;
the measured trade-offs: ``docs/architecture.md``.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .jit import callee as _callee
from .jit import kernel as _jit
from .jit import popcount, trailing_zeros
from .layout import (
    E_CORRUPT,
    E_DUPLICATE,
    E_MISALIGNED,
    E_NOT_ALLOCATED,
    E_SHORT,
    H_ALLOC_CALLS,
    H_AVAIL,
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
    H_PAGE_SIZE,
    H_PEAK,
    H_SORTED,
    HEADER,
    OWNER_ALLOCATED,
    OWNER_FREE,
    fail,
    owner_view,
    ring_view,
)

# The kernels' Python annotations are for type checkers only: numba compiles
# each kernel from its signature string, a callee for its callers' types.
# A local annotated ``int`` holds an array element or a shape entry.

# Kernels hold their loops themselves and call only small helpers that call
# nothing big in turn: numba optimises and generates machine code for every
# compiled function with everything it calls linked in, so a loop nested
# three calls deep was compiled four times over (docs/architecture.md).

# Whether _run_length tests the blocks after the first whole before masking one, and set_runs flags a run's
# pages by masked words: the run kernels'. The short free is written with both off (_kernels/flat.py): less to compile.
_WHOLE_BLOCKS = True
_WORD_FLAGS = True

# -- runs on the ring ----------------------------------------------------------
# Every list is a sequence of runs (``_kernels/layout.py``): an entry ``p >= 0``, then,
# for a run of ``L >= 2`` pages, the entry ``-L``. These are the only two
# functions that know the encoding; the kernels here and the paged ranks'
# read and write runs through them.


@_callee()
def run_at(ring: NDArray[np.int32], pos: int, left: int) -> int:
    """The length of the run whose first entry is at ring position ``pos``, ``left`` entries of its list from there.

    A negative entry after it is its length, but only inside its list: the
    entry after a list's last run is another list's, or scratch.
    """
    length = 1
    if left > 1:
        nxt = pos + 1 if pos + 1 < ring.shape[0] else 0
        e: int = ring[nxt]
        if e < 0:
            length = -e
    return length


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


@_callee()
def stage(
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


# Eight owner flags in one word of the state: a flag value repeated in every byte.
_EVERY_BYTE = 0x0101010101010101
_HIGH_BITS = 0x8080808080808080 - (1 << 64)  # the high bit of every byte, as an int64: no uint64 mixed in
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
def _claim_flags(st: NDArray[np.int64], start: int, length: int, want: int, flag: int) -> bool:
    """Whether pages ``start .. start + length - 1`` (``length >= 1``) are all ``want``; if so, flag them ``flag``.

    A word of eight flags at a time, the run's first and last words masked
    to it: one pass tests, one sets, with no branch on the run's length.
    """
    words = st[HEADER + (st[H_NPAGES] + 1) // 2 :]  # the ring's int64 words end here (_kernels/layout.py)
    lo, hi, first, last = _word_masks(start, length)
    expect = want * _EVERY_BYTE
    wrong = ((words[lo] ^ expect) & first) | ((words[hi] ^ expect) & last)
    middle = words[lo + 1 : hi]  # indexed from 0, LLVM vectorises it
    for q in range(middle.shape[0]):
        wrong |= middle[q] ^ expect
    if wrong == 0:
        pattern = flag * _EVERY_BYTE
        words[lo] = (words[lo] & ~first) | (pattern & first)
        words[hi] = (words[hi] & ~last) | (pattern & last)
        for q in range(middle.shape[0]):
            middle[q] = pattern
    claimed: bool = wrong == 0
    return claimed


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
        if length == 1:  # a lone page: its byte
            owner[ring[pos]] = flag
        elif _WORD_FLAGS:
            _set_flags(st, ring[pos], length, flag)
        else:  # a loop LLVM makes a fill: less to compile where spliced, and short calls' runs are short
            back = owner[ring[pos] : ring[pos] + length]
            for j in range(length):  # a loop, not a slice assignment: that compiles numpy's setitem
                back[j] = flag
        w = run_width(length)
        pos = pos + w if pos + w < n else pos + w - n
        left -= w


@_callee()
def ring_tail(st: NDArray[np.int64]) -> int:
    """Ring position just past the live window: where ``free`` stages runs."""
    n: int = st[H_NPAGES]
    tail: int = st[H_HEAD] + st[H_EFREE] + st[H_EREL] + st[H_EPEND]
    return tail - n if tail >= n else tail


@_callee()
def staged_twice(ring: NDArray[np.int32], tail: int, entries: int, page: int, position: int) -> int:
    """The failure for a ``page`` that ``free`` found not allocated.

    ``E_DUPLICATE`` if this call staged it already (it is in one of the
    ``entries`` staged from ring position ``tail``), else
    ``E_NOT_ALLOCATED``. Error path only; it reads the pool's ring, never
    the caller's input.
    """
    n = ring.shape[0]
    pos = tail
    left = entries
    status = fail(E_NOT_ALLOCATED, position)
    while left > 0:
        length = run_at(ring, pos, left)
        if ring[pos] <= page < ring[pos] + length:
            status = fail(E_DUPLICATE, position)
            break
        w = run_width(length)
        pos = pos + w if pos + w < n else pos + w - n
        left -= w
    return status


@_callee()
def free_end(st: NDArray[np.int64], tail: int, done: int, entries: int, status: int) -> int:
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
    elif st[H_GROUP_DEPTH] > 0:
        st[H_NPEND] += done
        st[H_EPEND] += entries
    else:
        st[H_NREL] += done
        st[H_EREL] += entries
        st[H_AVAIL] = (st[H_NFREE] + st[H_NREL]) * st[H_PAGE_SIZE]
    if status >= 0 and done > 0:
        st[H_FREE_CALLS] += 1
    return status


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


# Whether take_front hands out a stretch of lone pages at page size 1 through its own loop (_claim_lone): the
# run kernels' does; the short alloc (_kernels/flat.py) is written with it off, and calls nothing.
_LONE_STRETCHES = True


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

    A run's flags are claimed by ``_claim_flags``; ``run_at``, ``run_width``
    and the fills are written inline, with no ``min()`` (its overload is a
    compile of its own). Its one ``return`` is its last statement: the short
    alloc is spliced from it (``tests/flatten.py``).
    """
    owner = owner_view(st)
    ring = ring_view(st)
    n = ring.shape[0]
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
            if _LONE_STRETCHES:
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
        take = length if length < need - got else need - got
        if p < 0 or length > n - p:
            bad = True
            break
        claimed = _claim_flags(st, p, take, OWNER_FREE, OWNER_ALLOCATED)  # eight flags a word
        if not claimed:
            bad = True
            break
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
    status = 0
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
        status = fail(E_CORRUPT, got)
    else:
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
        st[H_AVAIL] = (st[H_NFREE] + st[H_NREL]) * st[H_PAGE_SIZE]
    return status


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
    words = st[HEADER + (n + 1) // 2 : HEADER + (n + 1) // 2 + (n + 7) // 8]  # the owner flags (_kernels/layout.py)
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
        base = HEADER + (n + 1) // 2  # the owner flags' first word (_kernels/layout.py)
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


@_callee()
def alloc_begin(st: NDArray[np.int64], out: NDArray[np.int64]) -> int:
    """An allocation's checks: the pages to take (above 0), or what the kernel returns (0 or a failure).

    ``E_MISALIGNED`` (``len(out)`` not a multiple of ``page_size``: the
    pool's alignment check, made here to spare the hot path a Python check)
    comes before anything, counters included. An empty allocation and one
    the lists cannot serve (``E_SHORT``) are counted here.
    """
    page_size: int = st[H_PAGE_SIZE]
    need: int = out.shape[0] // page_size
    if out.shape[0] % page_size != 0:
        need = fail(E_MISALIGNED, 0)  # not counted: no allocation was asked for
    elif need == 0 or need > st[H_NFREE] + st[H_NREL]:  # counted; failed if any page was asked for
        count_alloc(st, need)
        if need > 0:
            need = fail(E_SHORT, 0)
    return need


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
    test is masked. Without ``_WHOLE_BLOCKS`` (the short free, into which
    it is spliced: its runs end in their first blocks) every block is a
    mask, which compiles to less.
    """
    k = 1
    off = 0  # bit t: entry k + t does not continue the run
    if _WHOLE_BLOCKS:
        if k + _RUN_BLOCK <= limit:
            # A slice view: indexing ``ids[start + t]`` directly kept numba's
            # negative-index test in the loop, which stopped LLVM vectorising it.
            block = ids[start + k : start + k + _RUN_BLOCK]
            for t in range(_RUN_BLOCK):
                off |= np.int64(block[t] != first + k + t) << t
            if off == 0:
                k += _RUN_BLOCK
        while off == 0 and k + _RUN_BLOCK <= limit:
            block = ids[start + k : start + k + _RUN_BLOCK]
            acc = 0
            for t in range(_RUN_BLOCK):
                acc |= block[t] ^ (first + k + t)
            if acc != 0:
                break  # masked below
            k += _RUN_BLOCK
    else:
        while k + _RUN_BLOCK <= limit:
            block = ids[start + k : start + k + _RUN_BLOCK]
            for t in range(_RUN_BLOCK):
                off |= np.int64(block[t] != first + k + t) << t
            if off != 0:
                break
            k += _RUN_BLOCK
    if off == 0:
        end = k + _RUN_BLOCK if k + _RUN_BLOCK < limit else limit  # not min(): spliced into a flat kernel
        block = ids[start + k : start + end]  # the block that failed, or what is left
        for t in range(block.shape[0]):
            off |= np.int64(block[t] != first + k + t) << t
    length = k + trailing_zeros(off) if off != 0 else (limit if limit > 1 else 1)
    return length
