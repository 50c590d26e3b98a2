"""Numba kernels of the core pool: every change to a ``LogicalHostPool``'s state.

The layout of ``st`` and the status codes are in ``_layout.py``. Kernels
move integers and return status codes; they never raise and never allocate
Python objects, so ``_pool.py`` can validate, lock, and turn a status into
the right exception. On failure the header, the live window and the owner
flags are as they were; only the scratch behind the window may differ.
Measured trade-offs behind the choices here are in ``docs/architecture.md``.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ._jit import callee as _callee
from ._jit import kernel as _jit
from ._jit import twin as _twin
from ._layout import (
    E_CORRUPT,
    E_DUPLICATE,
    E_LENGTH,
    E_MISALIGNED,
    E_NEGATIVE,
    E_NO_GROUP,
    E_NOT_ALLOCATED,
    E_PARTIAL,
    E_RANGE,
    E_SHORT,
    H_ALLOC_CALLS,
    H_CLEARS,
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

_LOW32 = (1 << 32) - 1  # a tracking word's low half: the site that last freed the page


@_jit("i8(i8[::1])")
def reset(st: NDArray[np.int64]) -> int:
    """Make every page free, in ascending order; empty the other lists; end all groups.

    The counters are kept, but for ``H_CLEARS``, which counts this call.
    Returns the number of free pages.
    """
    n: int = st[H_NPAGES]
    owner = owner_view(st)
    ring = ring_view(st)
    t: int = st[H_TRACK]
    for p in range(n):
        if t != 0 and owner[p] == OWNER_ALLOCATED:
            st[t + n + p] = (st[t + n + p] & ~_LOW32) | 1  # freed by clear() (the tracker's id 1)
        ring[p] = p
        owner[p] = OWNER_FREE
    st[H_HEAD] = 0
    st[H_NFREE] = n
    st[H_NREL] = 0
    st[H_NPEND] = 0
    st[H_GROUP_DEPTH] = 0
    st[H_CLEARS] += 1
    return n


@_callee()
def _list_free(owner: NDArray[np.uint8], into: NDArray[np.int32], start: int) -> int:
    """Write the free pages from ``start`` on, ascending, to ``into`` until it is full; return the page after.

    Branch-free: every page's id is written and the position moves on only
    for a free page, so a mix of free and allocated pages costs no
    mispredicted branch. Every write stays in ``into``: the loop ends when
    it is full, and the caller has counted the free pages.
    """
    n = owner.shape[0]
    m = into.shape[0]
    q = 0
    p = start
    while q < m and p < n:
        into[q] = p
        q += owner[p] == OWNER_FREE
        p += 1
    return p


@_callee()
def _sort_window(st: NDArray[np.int64]) -> int:
    """Rewrite the free and release lists as one ascending free list.

    The owner flags already say which pages are free (``OWNER_FREE``; a
    pending page is flagged apart), so one pass over them lists the pages in
    order: O(pages), no comparison sort. The window keeps its place on the
    ring, so the pending list behind it stays where it is. Returns the
    number of pages on the free list, or ``E_CORRUPT`` (state unchanged) if
    the flags do not count as many free pages as the lists hold.
    """
    n: int = st[H_NPAGES]
    live: int = st[H_NFREE] + st[H_NREL]
    owner = owner_view(st)
    found = 0
    for p in range(n):  # a sum of comparisons: LLVM vectorises it
        found += owner[p] == OWNER_FREE
    if found != live:
        return fail(E_CORRUPT, 0)
    head: int = st[H_HEAD]
    ring = ring_view(st)
    first = min(live, n - head)  # the window is ring[head:head + first], then ring[:live - first]
    _list_free(owner, ring[: live - first], _list_free(owner, ring[head : head + first], 0))
    st[H_NFREE] = live
    st[H_NREL] = 0
    return live


@_jit("i8(i8[::1])")
def merge(st: NDArray[np.int64]) -> int:
    """Fold the release list into the free list.

    FIFO order: the release list already sits right behind the free list on
    the ring, in the order it was freed, so merging moves a boundary and
    copies nothing. Sorted order (``H_SORTED``): the two become one
    ascending list (:func:`_sort_window`). Nothing happens, and nothing is
    counted, without released pages. Returns the number of pages merged, or
    ``E_CORRUPT`` with the state unchanged.
    """
    moved: int = st[H_NREL]
    if moved > 0:
        if st[H_SORTED] != 0:
            status = _sort_window(st)
            if status < 0:
                return status
        else:
            st[H_NFREE] += moved
            st[H_NREL] = 0
        st[H_MERGES] += 1
    return moved


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
    calling :func:`alloc_pages`; the counters must still see it.
    """
    count_alloc(st, 1)
    return fail(E_SHORT, 0)


# -- runs ---------------------------------------------------------------------
# Allocations hand out the free list in order and callers give back what they
# were given, so a call's pages mostly come in runs of consecutive page ids.
# alloc and free take a long run whole: one vectorised test that its owner
# flags are as expected, one fill that changes them, one block store of its
# ids, instead of a branchy step per page. Short runs, lone pages and any
# run that fails a test go one page at a time, in input order, which also
# finds the exact position of a fault.

# A run is followed entry by entry for its first ``_RUN_PROBE`` entries, then
# ``_RUN_BLOCK`` entries at a time: one branch per block, in a loop LLVM
# vectorises (64 is as fast as one plain pass; larger blocks gain nothing).
_RUN_PROBE = 8
_RUN_BLOCK = 64


@_callee()  # a caller's slots, the ring's ids
def _run_length(ids: NDArray[np.int64] | NDArray[np.int32], start: int, limit: int, first: int) -> int:
    """How many of ``ids[start:start + limit]`` count up by one from ``first`` (at least 1).

    ``first`` is the caller's read of ``ids[start]``, which the run is
    measured against (never a second read). The first entries are compared
    one by one, so that input without runs (a shuffled free list) pays
    about one comparison per entry; a run that lasts is followed in
    vectorised blocks of ``_RUN_BLOCK``.
    """
    k = 1
    while k < limit and k < _RUN_PROBE:
        if ids[start + k] != first + k:
            return k
        k += 1
    while k + _RUN_BLOCK <= limit:
        # A slice view: indexing ``ids[start + t]`` directly kept numba's
        # negative-index test in the loop, which stopped LLVM vectorising it.
        block = ids[start + k : start + k + _RUN_BLOCK]
        acc = 0
        for t in range(_RUN_BLOCK):
            acc |= block[t] ^ (first + k + t)
        if acc != 0:
            break
        k += _RUN_BLOCK
    while k < limit and ids[start + k] == first + k:
        k += 1
    return k


# Eight owner flags in one word: a flag value repeated in every byte.
_EVERY_BYTE = np.uint64(0x0101010101010101)
# Runs shorter than this are tested and flagged a byte at a time: for them
# the word view and the two edge loops cost more than they save.
_WORDS_FROM = 64


@_callee()
def _flags_are_by_words(owner: NDArray[np.uint8], start: int, length: int, want: int) -> bool:
    """:func:`_flags_are` for a long run: eight flags at a time.

    The bytes up to the first multiple of 8 one by one, then whole uint64
    words (byte by byte, LLVM widens each byte to a 64-bit lane), then the
    rest.
    """
    end = start + length
    lo = min(end, (start + 7) & ~7)
    hi = max(lo, end & ~7)
    bad = 0
    for p in range(start, lo):
        bad |= owner[p] ^ want
    for p in range(hi, end):
        bad |= owner[p] ^ want
    words = owner[lo:hi].view(np.uint64)
    pattern = np.uint64(want) * _EVERY_BYTE
    acc = np.uint64(0)
    for q in range(words.shape[0]):
        acc |= words[q] ^ pattern
    return bad == 0 and acc == 0


@_callee()
def _flags_are(owner: NDArray[np.uint8], start: int, length: int, want: int) -> bool:
    """Whether pages ``start .. start + length - 1`` are all flagged ``want``.

    A short run byte by byte in one small loop (which its callers inline),
    a long one by words (:func:`_flags_are_by_words`).
    """
    if length >= _WORDS_FROM:
        return _flags_are_by_words(owner, start, length, want)
    flags = owner[start : start + length]  # a slice: no negative-index test per flag
    bad = 0
    for p in range(length):
        bad |= flags[p] ^ want
    return bad == 0


@_callee()
def _set_flags_by_words(owner: NDArray[np.uint8], start: int, length: int, flag: int) -> None:
    """:func:`_set_flags` for a long run, whole words where it can."""
    end = start + length
    lo = min(end, (start + 7) & ~7)
    hi = max(lo, end & ~7)
    for p in range(start, lo):
        owner[p] = flag
    for p in range(hi, end):
        owner[p] = flag
    words = owner[lo:hi].view(np.uint64)
    pattern = np.uint64(flag) * _EVERY_BYTE
    for q in range(words.shape[0]):
        words[q] = pattern


@_callee()
def _set_flags(owner: NDArray[np.uint8], start: int, length: int, flag: int) -> None:
    """Flag pages ``start .. start + length - 1`` as ``flag``: a short run in one fill, a long one by words."""
    if length >= _WORDS_FROM:
        _set_flags_by_words(owner, start, length, flag)
        return
    flags = owner[start : start + length]
    for p in range(length):
        flags[p] = flag


@_callee()
def _stage_run(ring: NDArray[np.int32], pos: int, first: int, length: int) -> int:
    """Write page ids ``first .. first + length - 1`` on the ring from ``pos``; return the position after.

    Two block stores, split where the ring wraps, instead of a wrap test per page.
    """
    n = ring.shape[0]
    head = min(length, n - pos)
    seg = ring[pos : pos + head]
    for q in range(head):
        seg[q] = first + q
    seg = ring[: length - head]
    for q in range(length - head):
        seg[q] = first + head + q
    pos += length
    return pos - n if pos >= n else pos


@_callee()
def _fill_run(out: NDArray[np.int64], start: int, length: int, first: int) -> None:
    """Write ``first, first + 1, ...`` to ``out[start:start + length]``.

    Filling a slice view lets LLVM vectorise the loop (indexing ``out``
    directly, it could not rule out aliasing). The view lives in this
    helper, not in a caller's loop, where numba would count references to
    it on every iteration.
    """
    dst = out[start : start + length]
    for j in range(length):
        dst[j] = first + j


# A stretch of at least ``_LONG_SLOTS`` slots (and two pages) is taken as a
# run; anything shorter goes a page at a time. Taking a run costs calls,
# views and three passes (measure, test, fill) where the page-at-a-time
# loop makes one, so only long runs repay it.
_LONG_SLOTS = 1024


@_callee()
def long_run(page_size: int) -> int:
    """Pages in a stretch long enough to take as a run, for pages of ``page_size`` slots."""
    return max(2, _LONG_SLOTS // page_size)


# -- alloc --------------------------------------------------------------------


@_callee()
def _claim(
    owner: NDArray[np.uint8], ids: NDArray[np.int32], out: NDArray[np.int64], at: int, page_size: int, long: int
) -> int:
    """Flag the pages ``ids`` (from the free list) allocated and write their slots to ``out``.

    Slots go to ``out`` from page ``at`` of it on. Where the id ``long - 1``
    places ahead continues the current one, the stretch is measured
    (:func:`_run_length`) and, when its flags all say free, taken whole:
    one flag test, one fill, one vectorised write of its slots (the ring
    is read once and never copied). Everything else goes a page at a
    time. ``long`` larger than ``len(ids)`` takes no run at all, the
    plain page-by-page claim the tests compare against.

    Returns ``len(ids)``; or, on an id that is not a page or a page that is
    not free (a corrupted ring), that id's position, with every flag it set
    put back.
    """
    n = owner.shape[0]
    count: int = ids.shape[0]
    i = 0
    skip = 0  # a stretch that failed its flag test is not measured twice
    while i < count:
        if i >= skip and i + long <= count:
            p = ids[i]
            if 0 <= p < n and ids[i + long - 1] == p + long - 1:
                # Bounded so that the run stays a run of pages: an id beyond
                # the last page fails on its own, below.
                length = _run_length(ids, i, min(count - i, n - p), p)
                if _flags_are(owner, p, length, OWNER_FREE):
                    _set_flags(owner, p, length, OWNER_ALLOCATED)
                    _fill_run(out, (at + i) * page_size, length * page_size, p * page_size)
                    i += length
                    continue
                skip = i + length  # page by page, to the first page that is not free
        end = min(count, i + long)
        # A view indexed from 0, so LLVM drops the negative-index test.
        block = ids[i:end]
        stop = end
        if page_size == 1:
            # Through a view of ``out`` indexed from 0, like ``block``, in a
            # loop of its own rather than a page-size test per page.
            dst = out[at + i : at + end]
            for k in range(end - i):
                p = block[k]
                if p < 0 or p >= n or owner[p] != OWNER_FREE:
                    stop = i + k
                    break
                owner[p] = OWNER_ALLOCATED
                dst[k] = p
        else:
            for k in range(end - i):
                p = block[k]
                if p < 0 or p >= n or owner[p] != OWNER_FREE:
                    stop = i + k
                    break
                owner[p] = OWNER_ALLOCATED
                # A call per page, but a vectorised fill (faster than an inline loop).
                _fill_run(out, (at + i + k) * page_size, page_size, p * page_size)
        i = stop
        if stop < end:
            break
    if i < count:
        for e in range(i):  # corrupted: undo the flags set so far
            owner[ids[e]] = OWNER_FREE
    return i


@_jit("i8(i8[::1], i8[::1])")
def alloc_pages(st: NDArray[np.int64], out: NDArray[np.int64]) -> int:
    """Pop ``len(out) // page_size`` pages from the front of the free list.

    ``out`` (int64, caller-provided, length a multiple of ``page_size``)
    receives the slot ids ``p * page_size + 0 .. page_size - 1`` of each
    page ``p``, pages in list order. Merges the release list if the free
    list alone is too short (FIFO: after reading on from the free list into
    the release list, which is the same; sorted: first). Returns
    ``len(out)``, or a failure (``E_SHORT``, or ``E_CORRUPT`` if a listed
    page is not free) with the lists unchanged; ``out`` is then partly
    written and should be discarded. Counts the call either way; but
    ``E_MISALIGNED`` (``len(out)`` is not a multiple of ``page_size``: the
    pool's alignment check, made here to spare the hot path a Python
    check) comes before anything, counters included.
    """
    page_size: int = st[H_PAGE_SIZE]
    n = st[H_NPAGES]
    if out.shape[0] % page_size != 0:
        return fail(E_MISALIGNED, 0)  # not counted: no allocation was asked for
    need: int = out.shape[0] // page_size
    if need == 0:
        count_alloc(st, 0)
        return 0
    if need > st[H_NFREE] + st[H_NREL]:
        count_alloc(st, 1)
        return fail(E_SHORT, 0)
    if need > st[H_NFREE] and st[H_SORTED] != 0:
        # A sorted merge reorders the pages, so it must come before reading
        # them; after it the free list alone holds them all.
        status = merge(st)
        if status < 0:
            return status
    owner = owner_view(st)
    ring = ring_view(st)
    head = st[H_HEAD]
    long = long_run(page_size)
    # The release list follows the free list on the ring, so reading on from
    # the head also reads the pages a merge would provide. The pages are
    # ring[head:] then, if they wrap, ring[:rest].
    first = min(need, n - head)
    rest = need - first
    if need == 1:
        # The single-page round trip, without _claim's call and block view.
        p = ring[head]
        got = 0
        if 0 <= p < n and owner[p] == OWNER_FREE:
            owner[p] = OWNER_ALLOCATED
            _fill_run(out, 0, page_size, p * page_size)
            got = 1
    else:
        got = _claim(owner, ring[head : head + first], out, 0, page_size, long)
    if got == first and rest > 0:
        got = first + _claim(owner, ring[:rest], out, first, page_size, long)
        if got < need:  # put back the first part's flags too
            for p in ring[head : head + first]:
                owner[p] = OWNER_FREE
    if got < need:
        return fail(E_CORRUPT, got)
    if need > st[H_NFREE]:
        merge(st)  # FIFO here: a sorted pool merged before reading the ring
    st[H_HEAD] = head + need if head + need < n else rest
    st[H_NFREE] -= need
    count_alloc(st, 0)
    return need * page_size


# -- free ---------------------------------------------------------------------
@_callee()
def _staged_twice(ring: NDArray[np.int32], tail: int, done: int, page: int, position: int) -> int:
    """The failure for a ``page`` that ``free`` found not allocated.

    ``E_DUPLICATE`` if this call staged it already (it is among the ``done``
    pages staged from ring position ``tail``), else ``E_NOT_ALLOCATED``.
    Error path only; it reads the pool's ring, never the caller's input.
    """
    n = ring.shape[0]
    pos = tail
    for _ in range(done):
        if ring[pos] == page:
            return fail(E_DUPLICATE, position)
        pos = pos + 1 if pos + 1 < n else 0
    return fail(E_NOT_ALLOCATED, position)


@_callee()
def _unstage(ring: NDArray[np.int32], owner: NDArray[np.uint8], tail: int, done: int) -> None:
    """Roll back a failed free: flag the ``done`` staged pages allocated again.

    The staged ids (from ring position ``tail``) stay outside the live
    window, so they are left as unread scratch.
    """
    n = ring.shape[0]
    pos = tail
    for _ in range(done):
        owner[ring[pos]] = OWNER_ALLOCATED
        pos = pos + 1 if pos + 1 < n else 0


@_callee()
def _take_staged(st: NDArray[np.int64], count: int) -> None:
    """Take ``count`` pages staged behind the window into the release list.

    Inside a free group they join the pending list instead (the free kernels
    flagged them ``OWNER_PENDING``); the group's end releases them.
    """
    if st[H_GROUP_DEPTH] > 0:
        st[H_NPEND] += count
    else:
        st[H_NREL] += count
    if count > 0:
        st[H_FREE_CALLS] += 1


@_callee()
def _stage_if_allocated(
    ring: NDArray[np.int32], owner: NDArray[np.uint8], pos: int, p: int, length: int, mark: int
) -> int:
    """Release a run of pages ``p .. p + length - 1`` if every one is allocated.

    Flags them ``mark`` in one fill and stages them from ring position
    ``pos`` in one block store. Returns the position after them; or -1,
    changing nothing, when some page of the run is not allocated.
    """
    if not _flags_are(owner, p, length, OWNER_ALLOCATED):
        return -1
    _set_flags(owner, p, length, mark)
    return _stage_run(ring, pos, p, length)


# A kernel of its own, not a callee: compiled into free_pages, it ran slower.
@_jit("i8(i8[::1], i8[::1], i8)")
def _free_slot_pages(st: NDArray[np.int64], slots: NDArray[np.int64], long: int) -> int:
    """:func:`free_pages` for ``page_size == 1``, where a page id is a slot id.

    The input goes in blocks of ``long`` slots. A block whose last slot
    continues its first starts a run: the run is measured (it may go on
    past the block) and, when every slot of it is allocated, released
    whole. Any other block goes through a plain loop that validates, flags
    and stages one slot at a time. Testing for runs only at block starts
    keeps that loop as tight as a loop without runs.
    """
    n = st[H_NPAGES]
    count: int = slots.shape[0]
    owner = owner_view(st)
    ring = ring_view(st)
    mark = OWNER_PENDING if st[H_GROUP_DEPTH] > 0 else OWNER_FREE
    if n == 0 and count > 0:  # no slot is in range, and no ring to stage into
        return fail(E_RANGE, 0)
    tail = ring_tail(st)
    pos = tail
    status = 0
    c = 0  # input slots staged
    skip = 0  # a run that failed its flag test is not measured twice
    while c < count:
        if c >= skip and c + long <= count:
            p = slots[c]  # the run's ids all derive from this one read
            if 0 <= p < n and slots[c + long - 1] == p + long - 1:
                length = _run_length(slots, c, min(count - c, n - p), p)
                after = _stage_if_allocated(ring, owner, pos, p, length, mark)
                if after >= 0:
                    pos = after
                    c += length
                    continue
                skip = c + length  # slot by slot, to the exact position of the fault
        # A block stops at the ring's end, so it stages into one view of
        # the ring: no wrap test and no negative-index test per slot.
        end = min(count, c + long, c + n - pos)
        block = slots[c:end]
        into = ring[pos : pos + end - c]
        stop = end
        p = 0
        for k in range(end - c):
            p = block[k]  # the only read of this element
            if p < 0 or p >= n or owner[p] != OWNER_ALLOCATED:
                stop = c + k
                break
            owner[p] = mark
            into[k] = p
        pos += stop - c
        if pos == n:
            pos = 0
        c = stop  # the slots staged so far
        if stop < end:  # the fault, from the value read above
            status = fail(E_RANGE, c) if p < 0 or p >= n else _staged_twice(ring, tail, c, p, c)
            break
    if status != 0:
        _unstage(ring, owner, tail, c)
        return status
    _take_staged(st, count)
    return count


@_callee()
def _free_whole_pages(st: NDArray[np.int64], slots: NDArray[np.int64], long: int) -> int:
    """:func:`free_pages` for ``page_size > 1``: a page, or a run of ``long`` pages or more, at a time.

    Pages are taken in input order, so the error reported is the first one
    in input order: the first slot out of range, misaligned or out of its
    page's order, or the first page not allocated or named twice. Where the
    page ``long - 1`` pages ahead begins where a run would put it, the run
    is measured and, when every slot of it counts up and every page is
    allocated, released whole; otherwise it goes page by page.
    """
    page_size: int = st[H_PAGE_SIZE]
    shift = st[H_PAGE_SHIFT]
    mask = page_size - 1
    n = st[H_NPAGES]
    size = n * page_size
    count: int = slots.shape[0] // page_size
    owner = owner_view(st)
    ring = ring_view(st)
    mark = OWNER_PENDING if st[H_GROUP_DEPTH] > 0 else OWNER_FREE
    # A page can only be staged after its flag said "allocated", and every
    # allocated page is off the live window, so the spare part of the ring
    # (from the tail on) always has room for the pages staged here.
    if n == 0 and count > 0:  # no slot is in range, and no ring to stage into
        return fail(E_RANGE, 0)
    tail = ring_tail(st)
    pos = tail
    status = 0
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
                length = _run_length(slots, start, min(count - c, n - p) * page_size, first) // page_size
                if length > 0:
                    after = _stage_if_allocated(ring, owner, pos, p, length, mark)
                    if after >= 0:
                        pos = after
                        c += length
                        continue
                skip = c + length  # page by page, to the exact position of the fault
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
                status = _staged_twice(ring, tail, c + k, p, start + b)
                stop = c + k
                break
            owner[p] = mark
            ring[pos] = p
            pos = pos + 1 if pos + 1 < n else 0
        c = stop  # the pages staged so far
        if status != 0:
            break
    if status != 0:
        _unstage(ring, owner, tail, c)
        return status
    _take_staged(st, count)
    return count * page_size


@_jit("i8(i8[::1], i8[::1])")
def free_pages(st: NDArray[np.int64], slots: NDArray[np.int64]) -> int:
    """Validate ``slots`` as whole allocated pages, then release them.

    ``slots`` (int64, length a multiple of ``page_size``) is read in runs of
    ``page_size``; each run must be one page's slots in ascending order, of
    a page that is currently allocated and not named earlier in the call.
    Pages may come in any order; they are appended to the release list in
    the order given (to the pending list inside a free group). Returns the
    number of slots freed, or a failure
    (``E_RANGE``, ``E_MISALIGNED``, ``E_PARTIAL``, ``E_NOT_ALLOCATED``,
    ``E_DUPLICATE``) at the first offending position, with the state
    unchanged; ``E_LENGTH`` first if ``len(slots)`` is not a multiple of
    ``page_size``.

    ``slots`` may be a caller's array that another thread writes while this
    kernel runs without the GIL. So each page's id is derived from one read
    of its first slot (a run's from its first), the rest of its slots are
    compared against that read, and the id is checked and staged in the
    ring's spare part (pool memory, outside the live window) before
    anything else happens; the release, and the roll-back of a failure,
    read only those staged ids, never ``slots`` again. A racing writer can
    make the call fail, but never make it act on a value it did not
    validate.
    """
    page_size: int = st[H_PAGE_SIZE]
    if slots.shape[0] % page_size != 0:
        return fail(E_LENGTH, 0)
    if page_size == 1:
        return _free_slot_pages(st, slots, long_run(1))
    return _free_whole_pages(st, slots, long_run(page_size))


# Calls of at most SHORT_SLOTS slots keep the GIL: handing it over and back
# costs more than a one-page call's work, and such a call holds it for a few
# microseconds at most (numpy draws a similar line). The pool calls these
# twins for them; same work and results, only the GIL differs.
SHORT_SLOTS = 4096


# The same kernels compiled again, keeping the GIL: for at most SHORT_SLOTS slots.
alloc_pages_short = _twin(alloc_pages, "i8(i8[::1], i8[::1])", name="alloc_pages_short", nogil=False)
free_pages_short = _twin(free_pages, "i8(i8[::1], i8[::1])", name="free_pages_short", nogil=False)


@_jit("i8(i8[::1], i8[::1], i8)")
def alloc_pages_tracked(st: NDArray[np.int64], out: NDArray[np.int64], site: int) -> int:
    """:func:`alloc_pages`, then each page handed out records this allocation.

    The allocation gets the next number (``H_SEQ``); each of its pages
    records that number and ``site`` (the id of the call site and tag),
    keeping the id of the site that last freed it. O(pages).
    """
    status = alloc_pages(st, out)
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


@_jit("i8(i8[::1], i8[::1], i8)")
def free_pages_tracked(st: NDArray[np.int64], slots: NDArray[np.int64], site: int) -> int:
    """:func:`free_pages`, then each page freed records ``site`` as the site that freed it.

    The pages are read back from where the free staged them on the ring (not
    from ``slots`` again). O(pages).
    """
    tail = ring_tail(st)
    status = free_pages(st, slots)
    if status <= 0:
        return status
    n: int = st[H_NPAGES]
    t: int = st[H_TRACK]
    pos = tail
    ring = ring_view(st)
    for _ in range(status // st[H_PAGE_SIZE]):
        p = ring[pos]
        st[t + n + p] = (st[t + n + p] & ~_LOW32) | site
        pos = pos + 1 if pos + 1 < n else 0
    return status


# The tracking kernels' twins keeping the GIL, for the same short calls.
alloc_pages_tracked_short = _twin(
    alloc_pages_tracked, "i8(i8[::1], i8[::1], i8)", name="alloc_pages_tracked_short", nogil=False
)
free_pages_tracked_short = _twin(
    free_pages_tracked, "i8(i8[::1], i8[::1], i8)", name="free_pages_tracked_short", nogil=False
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
    flags change (``OWNER_PENDING`` to ``OWNER_FREE``), O(pages released).
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
    owner = owner_view(st)
    ring = ring_view(st)
    pos: int = st[H_HEAD] + st[H_NFREE] + st[H_NREL]
    if pos >= n:
        pos -= n
    for _ in range(pend):
        owner[ring[pos]] = OWNER_FREE
        pos = pos + 1 if pos + 1 < n else 0
    st[H_NREL] += pend
    st[H_NPEND] = 0
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
