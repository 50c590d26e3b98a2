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
def merge_lists(st: NDArray[np.int64]) -> int:
    """Fold the release list into the free list.

    FIFO order: the release list already sits right behind the free list on
    the ring, in the order it was freed, so merging moves a boundary and
    copies nothing. Sorted order (``H_SORTED``): the two become one
    ascending list. The owner flags already say which pages are free
    (``OWNER_FREE``; a pending page is flagged apart), so one pass over them
    lists the pages in order: O(pages), no comparison sort, and without a
    branch per page (every id is written, the position moves on only for a
    free page). The window keeps its place on the ring, so the pending list
    behind it stays where it is. Nothing happens, and nothing is counted,
    without released pages. Returns the number of pages merged, or
    ``E_CORRUPT`` with the state unchanged if the flags do not count as
    many free pages as the lists hold.
    """
    moved: int = st[H_NREL]
    if moved == 0:
        return 0
    if st[H_SORTED] != 0:
        n: int = st[H_NPAGES]
        live: int = st[H_NFREE] + moved
        owner = owner_view(st)
        found = 0
        for p in range(n):  # a sum of comparisons: LLVM vectorises it
            found += owner[p] == OWNER_FREE
        if found != live:
            return fail(E_CORRUPT, 0)
        ring = ring_view(st)
        head: int = st[H_HEAD]
        first = min(live, n - head)  # the window is ring[head:head + first], then ring[:live - first]
        p = 0
        for segment in range(2):
            into = ring[head : head + first] if segment == 0 else ring[: live - first]
            m = into.shape[0]
            q = 0
            while q < m and p < n:  # every write stays in ``into``: the free pages were counted
                into[q] = p
                q += owner[p] == OWNER_FREE
                p += 1
        st[H_NFREE] = live
    else:
        st[H_NFREE] += moved
    st[H_NREL] = 0
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

# A stretch of at least ``_LONG_SLOTS`` slots (and two pages) is taken as a
# run; anything shorter goes a page at a time. Taking a run costs calls,
# views and three passes (measure, test, fill) where the page-at-a-time
# loop makes one, so only long runs repay it.
_LONG_SLOTS = 1024


@_callee()
def long_run(page_size: int) -> int:
    """Pages in a stretch long enough to take as a run, for pages of ``page_size`` slots."""
    return max(2, _LONG_SLOTS // page_size)


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


# Eight owner flags in one word of the state: a flag value repeated in every byte.
_EVERY_BYTE = 0x0101010101010101
# Runs shorter than this are tested and flagged a byte at a time: for them
# the word loop and the two edge loops cost more than they save.
_WORDS_FROM = 64


@_callee()
def _flags_are(st: NDArray[np.int64], owner: NDArray[np.uint8], start: int, length: int, want: int) -> bool:
    """Whether pages ``start .. start + length - 1`` are all flagged ``want``.

    A short run byte by byte in one small loop; a long one eight flags at a
    time: the bytes up to the first multiple of 8 one by one, then whole
    words, then the rest. The owner flags start on a word of ``st``, so
    flags ``8q .. 8q + 7`` are the word ``st[base + q]``, read as it is
    (byte by byte, LLVM widens each byte to a 64-bit lane; and no view of
    another dtype to compile).
    """
    if length < _WORDS_FROM:
        flags = owner[start : start + length]  # a slice: no negative-index test per flag
        bad = 0
        for p in range(length):
            bad |= flags[p] ^ want
        return bad == 0
    end = start + length
    lo = (start + 7) & ~7
    hi = end & ~7
    bad = 0
    for p in range(start, lo):
        bad |= owner[p] ^ want
    for p in range(hi, end):
        bad |= owner[p] ^ want
    base = HEADER + (st[H_NPAGES] + 1) // 2  # the ring's int64 words end here (_layout.py)
    words = st[base + (lo >> 3) : base + (hi >> 3)]
    pattern = want * _EVERY_BYTE
    for q in range(words.shape[0]):
        bad |= words[q] ^ pattern
    return bad == 0


@_callee()
def _set_flags(st: NDArray[np.int64], owner: NDArray[np.uint8], start: int, length: int, flag: int) -> None:
    """Flag pages ``start .. start + length - 1`` as ``flag``: a short run in one fill, a long one by words."""
    if length < _WORDS_FROM:
        flags = owner[start : start + length]
        for p in range(length):
            flags[p] = flag
        return
    end = start + length
    lo = (start + 7) & ~7
    hi = end & ~7
    for p in range(start, lo):
        owner[p] = flag
    for p in range(hi, end):
        owner[p] = flag
    base = HEADER + (st[H_NPAGES] + 1) // 2  # the ring's int64 words end here (_layout.py)
    words = st[base + (lo >> 3) : base + (hi >> 3)]
    pattern = flag * _EVERY_BYTE
    for q in range(words.shape[0]):
        words[q] = pattern


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


@_callee()
def _claim_slots(ids: NDArray[np.int32], out: NDArray[np.int64], owner: NDArray[np.uint8]) -> int:
    """Flag the pages ``ids`` allocated and write them to ``out``, until one is not a free page: how many.

    Page size 1's loop, a function of its own: views indexed from 0 (no
    negative-index test), and few enough live values that the flags'
    base stays in a register (inlined into the kernel, it was reloaded from
    the stack for every slot, 15% slower).
    """
    n = owner.shape[0]
    count: int = ids.shape[0]
    for k in range(count):
        p = ids[k]
        if p < 0 or p >= n or owner[p] != OWNER_FREE:
            return k
        owner[p] = OWNER_ALLOCATED
        out[k] = p
    return count


@_callee()
def _stage_slots(
    slots: NDArray[np.int64], into: NDArray[np.int32], owner: NDArray[np.uint8], mark: int
) -> tuple[int, int]:
    """Flag the allocated pages ``slots`` ``mark`` and stage them ``into`` the ring, until one is not.

    Returns how many were staged and the value that stopped it, as read
    (the one read of it), for the caller's error; ``len(slots)`` and 0 when
    none did. Page size 1's loop, a function of its own for the reason
    :func:`_claim_slots` gives.
    """
    n = owner.shape[0]
    for k in range(slots.shape[0]):
        p = slots[k]  # the only read of this element
        if p < 0 or p >= n or owner[p] != OWNER_ALLOCATED:
            return k, p
        owner[p] = mark
        into[k] = p
    return slots.shape[0], 0


# -- short calls -------------------------------------------------------------
# A call of at most SHORT_SLOTS slots holds no run worth taking (_LONG_SLOTS),
# so it goes through one flat page loop, for every page size: each kernel
# below is a single function with no callee but ``fail``. numba compiles a
# callee as a unit of its own (its own typing, lowering and machine code)
# and links it in again, so these two compile in a third of the time the
# run kernels take (docs/architecture.md): what a new process's first
# alloc and free wait for. They keep the GIL: handing it over and back
# costs more than a short call's work.
SHORT_SLOTS = 1023


@_jit("i8(i8[::1], i8[::1])", nogil=False)
def alloc_short(st: NDArray[np.int64], out: NDArray[np.int64]) -> int:
    """Pop ``len(out) // page_size`` pages from the front of the free list, a page at a time.

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
    head: int = st[H_HEAD]
    # The pages are ring[head:head + part], then ring[:need - part] if they
    # wrap: views indexed from 0, so no wrap or negative-index test per page.
    part = need if need <= n - head else n - head
    got = 0
    for segment in range(2):
        ids = ring[head : head + part] if segment == 0 else ring[: need - part]
        k = 0
        if page_size == 1:  # page ids are slot ids: the tightest loop
            dst = out[got : got + ids.shape[0]]
            while k < ids.shape[0]:
                p = ids[k]
                if p < 0 or p >= n or owner[p] != OWNER_FREE:
                    break
                owner[p] = OWNER_ALLOCATED
                dst[k] = p
                k += 1
        else:
            while k < ids.shape[0]:
                p = ids[k]
                if p < 0 or p >= n or owner[p] != OWNER_FREE:
                    break
                owner[p] = OWNER_ALLOCATED
                slots = out[(got + k) * page_size : (got + k + 1) * page_size]  # a view: LLVM vectorises the fill
                first = p * page_size
                for j in range(page_size):
                    slots[j] = first + j
                k += 1
        got += k
        if k < ids.shape[0]:
            break
    pos = head + need if head + need < n else head + need - n
    if got < need:  # a corrupted ring: the pages claimed are put back
        pos = head
        for _ in range(got):
            owner[ring[pos]] = OWNER_FREE
            pos = pos + 1 if pos + 1 < n else 0
        return fail(E_CORRUPT, got)
    if need > nfree:  # read on into the release list: a FIFO merge
        st[H_NFREE] += st[H_NREL]
        st[H_NREL] = 0
        st[H_MERGES] += 1
    st[H_HEAD] = pos
    st[H_NFREE] -= need
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
    order given (the pending list inside a free group). Each page's id
    derives from one read of its first slot, its other slots are compared
    against that read, and it is staged on the ring's spare part before
    anything else (see ``free_pn``). Returns the number of slots freed, or
    ``E_LENGTH``, ``E_RANGE``, ``E_MISALIGNED``, ``E_PARTIAL``,
    ``E_NOT_ALLOCATED`` or ``E_DUPLICATE`` at the first offending position
    in input order, with the state unchanged.
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
    tail: int = st[H_HEAD] + st[H_NFREE] + st[H_NREL] + st[H_NPEND]
    if tail >= n:
        tail -= n
    pos = tail
    status = 0
    missing = -1  # a page found not allocated: freed earlier in this call, or not held
    c = 0  # pages staged
    while page_size == 1 and c < count:  # page ids are slot ids: the tightest loop
        # A block stops at the ring's end: one view of the ring, no wrap test per slot.
        end = count if count - c <= n - pos else c + n - pos
        src = slots[c:end]
        into = ring[pos : pos + end - c]
        k = 0
        p = 0
        while k < src.shape[0]:
            p = src[k]  # the only read of this element
            if p < 0 or p >= n or owner[p] != OWNER_ALLOCATED:
                break
            owner[p] = mark
            into[k] = p
            k += 1
        c += k
        pos = pos + k if pos + k < n else 0
        if k < src.shape[0]:  # the fault, from the value read
            if p < 0 or p >= n:
                status = fail(E_RANGE, c)
            else:
                missing = p
            break
    while page_size > 1 and c < count:
        b = c * page_size
        first = slots[b]  # the page's id derives from this one read
        if first < 0 or first >= size:
            status = fail(E_RANGE, b)
            break
        # Shifts and masks for power-of-two pages: a division is a small page's largest cost.
        misaligned = first & mask if shift >= 0 else first % page_size
        if misaligned != 0:
            status = fail(E_MISALIGNED, b)
            break
        p = first >> shift if shift >= 0 else first // page_size
        page = slots[b : b + page_size]
        bad = 0
        for j in range(page_size):  # branch-free; the exact position only when wrong
            bad |= page[j] ^ (first + j)
        if bad != 0:
            status = fail(E_PARTIAL, b + 1)  # a writer may have restored the value since
            for j in range(page_size):
                if page[j] != first + j:
                    status = fail(E_PARTIAL, b + j)
                    break
            break
        if owner[p] != OWNER_ALLOCATED:
            missing = p
            break
        owner[p] = mark
        ring[pos] = p
        pos = pos + 1 if pos + 1 < n else 0
        c += 1
    if missing >= 0:  # E_DUPLICATE if this call staged it already; the staged ids, not the input
        status = fail(E_NOT_ALLOCATED, c * page_size)
        q = tail
        for _ in range(c):
            if ring[q] == missing:
                status = fail(E_DUPLICATE, c * page_size)
                break
            q = q + 1 if q + 1 < n else 0
    if status < 0:  # roll back: the staged pages are allocated again
        pos = tail
        for _ in range(c):
            owner[ring[pos]] = OWNER_ALLOCATED
            pos = pos + 1 if pos + 1 < n else 0
        return status
    if st[H_GROUP_DEPTH] > 0:
        st[H_NPEND] += c
    else:
        st[H_NREL] += c
    if c > 0:
        st[H_FREE_CALLS] += 1
    return count * page_size


# -- alloc --------------------------------------------------------------------
# Longer calls: one kernel per page-size class (page size 1, where a page id is a slot id,
# and larger pages), so a process compiles only the classes its pools use.


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


@_callee()
def _alloc_end(st: NDArray[np.int64], need: int, got: int) -> int:
    """Commit an allocation whose pages were claimed: move the head, merge, count; the slots handed out.

    ``got < need`` is a corrupted ring: the flags of the ``got`` pages
    claimed are put back, and the result is ``E_CORRUPT`` at the first bad
    position, with the lists unchanged.
    """
    n: int = st[H_NPAGES]
    head: int = st[H_HEAD]
    if got < need:
        owner = owner_view(st)
        ring = ring_view(st)
        for e in range(got):
            pos = head + e
            owner[ring[pos if pos < n else pos - n]] = OWNER_FREE
        return fail(E_CORRUPT, got)
    if need > st[H_NFREE]:
        # FIFO here: a sorted pool merged before reading the ring.
        st[H_NFREE] += st[H_NREL]
        st[H_NREL] = 0
        st[H_MERGES] += 1
    st[H_HEAD] = head + need if head + need < n else head + need - n
    st[H_NFREE] -= need
    count_alloc(st, 0)
    page_size: int = st[H_PAGE_SIZE]
    return need * page_size


@_jit("i8(i8[::1], i8[::1])")
def alloc_pn(st: NDArray[np.int64], out: NDArray[np.int64]) -> int:
    """Pop ``len(out) // page_size`` pages from the front of the free list; for ``page_size > 1``.

    ``out`` (int64, caller-provided, length a multiple of ``page_size``)
    receives the slot ids ``p * page_size + 0 .. page_size - 1`` of each
    page ``p``, pages in list order. Merges the release list if the free
    list alone is too short (FIFO: after reading on from the free list into
    the release list, which is the same). A sorted pool that needs a merge
    gets ``E_MERGE_FIRST`` instead, nothing changed or counted: its caller
    merges (:func:`merge`) and calls again. Returns ``len(out)``, or a
    failure (``E_SHORT``, or ``E_CORRUPT`` if a listed page is not free)
    with the lists unchanged; ``out`` is then partly written and should be
    discarded.
    Counts the call either way; but ``E_MISALIGNED`` comes before anything,
    counters included.

    The pages are ``ring[head:]``, then, if they wrap, ``ring[:rest]``: two
    segments, one loop for both. Where the id ``long - 1`` places ahead
    continues the current one, the stretch is measured
    (:func:`_run_length`) and, when its flags all say free, taken whole:
    one flag test, one fill, one vectorised write of its slots (the ring is
    read once and never copied). Everything else goes a page at a time.
    """
    need = _alloc_begin(st, out)
    if need <= 0:
        return need
    if need > st[H_NFREE] and st[H_SORTED] != 0:
        # A sorted merge reorders the pages, so it comes before reading them;
        # the pool calls merge and asks again (this kernel stays small).
        return fail(E_MERGE_FIRST, 0)
    owner = owner_view(st)
    ring = ring_view(st)
    page_size: int = st[H_PAGE_SIZE]
    n = ring.shape[0]
    head: int = st[H_HEAD]
    got = 0
    if need == 1:  # the single-page round trip, without the loops and views
        p = ring[head]
        if 0 <= p < n and owner[p] == OWNER_FREE:
            owner[p] = OWNER_ALLOCATED
            _fill_run(out, 0, page_size, p * page_size)
            got = 1
        return _alloc_end(st, need, got)
    long = long_run(page_size)
    first = min(need, n - head)
    for segment in range(2):
        ids = ring[head : head + first] if segment == 0 else ring[: need - first]
        count = ids.shape[0]
        i = 0
        skip = 0  # a stretch that failed its flag test is not measured twice
        while i < count:
            if i >= skip and i + long <= count:
                p = ids[i]
                if 0 <= p < n and ids[i + long - 1] == p + long - 1:
                    # Bounded so that the run stays a run of pages: an id
                    # beyond the last page fails on its own, below.
                    length = _run_length(ids, i, min(count - i, n - p), p)
                    if _flags_are(st, owner, p, length, OWNER_FREE):
                        _set_flags(st, owner, p, length, OWNER_ALLOCATED)
                        _fill_run(out, (got + i) * page_size, length * page_size, p * page_size)
                        i += length
                        continue
                    skip = i + length  # page by page, to the first page that is not free
            end = min(count, i + long)
            block = ids[i:end]  # a view indexed from 0, so LLVM drops the negative-index test
            stop = end
            for k in range(end - i):
                p = block[k]
                if p < 0 or p >= n or owner[p] != OWNER_FREE:
                    stop = i + k
                    break
                owner[p] = OWNER_ALLOCATED
                # A call per page, but a vectorised fill (faster than an inline loop).
                _fill_run(out, (got + i + k) * page_size, page_size, p * page_size)
            i = stop
            if stop < end:
                break
        got += i
        if i < count:
            break
    return _alloc_end(st, need, got)


@_jit("i8(i8[::1], i8[::1])")
def alloc_p1(st: NDArray[np.int64], out: NDArray[np.int64]) -> int:
    """:func:`alloc_pn` for ``page_size == 1``, where ``out`` gets the page ids themselves."""
    need = _alloc_begin(st, out)
    if need <= 0:
        return need
    if need > st[H_NFREE] and st[H_SORTED] != 0:
        # A sorted merge reorders the pages, so it comes before reading them;
        # the pool calls merge and asks again (this kernel stays small).
        return fail(E_MERGE_FIRST, 0)
    owner = owner_view(st)
    ring = ring_view(st)
    n = ring.shape[0]
    head: int = st[H_HEAD]
    long = long_run(1)
    first = min(need, n - head)
    got = 0
    for segment in range(2):
        ids = ring[head : head + first] if segment == 0 else ring[: need - first]
        count = ids.shape[0]
        i = 0
        skip = 0
        while i < count:
            if i >= skip and i + long <= count:
                p = ids[i]
                if 0 <= p < n and ids[i + long - 1] == p + long - 1:
                    length = _run_length(ids, i, min(count - i, n - p), p)
                    if _flags_are(st, owner, p, length, OWNER_FREE):
                        _set_flags(st, owner, p, length, OWNER_ALLOCATED)
                        _fill_run(out, got + i, length, p)
                        i += length
                        continue
                    skip = i + length
            end = min(count, i + long)
            stop = i + _claim_slots(ids[i:end], out[got + i : got + end], owner)
            i = stop
            if stop < end:
                break
        got += i
        if i < count:
            break
    return _alloc_end(st, need, got)


# -- free ---------------------------------------------------------------------
# ``slots`` may be a caller's array that another thread writes while a free
# kernel runs without the GIL. So each page's id is derived from one read of
# its first slot (a run's from its first), the rest of its slots are compared
# against that read, and the id is checked and staged in the ring's spare
# part (pool memory, outside the live window) before anything else happens;
# the release, and the roll-back of a failure, read only those staged ids,
# never ``slots`` again. A racing writer can make the call fail, but never
# make it act on a value it did not validate. A page can only be staged
# after its flag said "allocated", and every allocated page is off the live
# window, so the spare part of the ring always has room.


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
def _free_end(st: NDArray[np.int64], tail: int, done: int, status: int) -> int:
    """Finish a free that staged ``done`` pages from ring position ``tail``: commit them, or roll back.

    On a failure (``status < 0``) the staged pages are flagged allocated
    again (their ids stay outside the live window, as unread scratch) and
    the failure is returned. Otherwise they join the release list (inside a
    free group, the pending list: the kernels flagged them
    ``OWNER_PENDING``; the group's end releases them) and ``status`` is
    returned.
    """
    if status < 0:
        ring = ring_view(st)
        owner = owner_view(st)
        n = ring.shape[0]
        pos = tail
        for _ in range(done):
            owner[ring[pos]] = OWNER_ALLOCATED
            pos = pos + 1 if pos + 1 < n else 0
        return status
    if st[H_GROUP_DEPTH] > 0:
        st[H_NPEND] += done
    else:
        st[H_NREL] += done
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
    the order given (to the pending list inside a free group). Returns the
    number of slots freed, or a failure (``E_RANGE``, ``E_MISALIGNED``,
    ``E_PARTIAL``, ``E_NOT_ALLOCATED``, ``E_DUPLICATE``) at the first
    offending position in input order, with the state unchanged;
    ``E_LENGTH`` first if ``len(slots)`` is not a multiple of
    ``page_size``.

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
                if length > 0 and _flags_are(st, owner, p, length, OWNER_ALLOCATED):
                    _set_flags(st, owner, p, length, mark)
                    pos = _stage_run(ring, pos, p, length)
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
    return _free_end(st, tail, c, status if status != 0 else count * page_size)


@_jit("i8(i8[::1], i8[::1])")
def free_p1(st: NDArray[np.int64], slots: NDArray[np.int64]) -> int:
    """:func:`free_pn` for ``page_size == 1``, where a page id is a slot id (every length is whole pages).

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
    long = long_run(1)
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
                if _flags_are(st, owner, p, length, OWNER_ALLOCATED):
                    _set_flags(st, owner, p, length, mark)
                    pos = _stage_run(ring, pos, p, length)
                    c += length
                    continue
                skip = c + length  # slot by slot, to the exact position of the fault
        # A block stops at the ring's end, so it stages into one view of
        # the ring: no wrap test and no negative-index test per slot.
        end = min(count, c + long, c + n - pos)
        staged, p = _stage_slots(slots[c:end], ring[pos : pos + end - c], owner, mark)
        c += staged  # the slots staged so far
        if c < end:  # the fault, from the value read
            status = fail(E_RANGE, c) if p < 0 or p >= n else _staged_twice(ring, tail, c, p, c)
            break
        pos += staged
        if pos == n:
            pos = 0
    return _free_end(st, tail, c, status if status != 0 else count)


# Calls of SHORT_SLOTS + 1 .. GIL_SLOTS slots run these twins of the run
# kernels, compiled from the same source with the GIL kept: handing it over
# and back costs more than such a call saves by letting others run.
GIL_SLOTS = 4096

_TWO = "i8(i8[::1], i8[::1])"
alloc_pn_gil = _twin(alloc_pn, _TWO, name="alloc_pn_gil", nogil=False)
alloc_p1_gil = _twin(alloc_p1, _TWO, name="alloc_p1_gil", nogil=False)
free_pn_gil = _twin(free_pn, _TWO, name="free_pn_gil", nogil=False)
free_p1_gil = _twin(free_p1, _TWO, name="free_p1_gil", nogil=False)


# -- tracking -----------------------------------------------------------------
# A tracking pool's kernels call the plain kernels' code as callees (the same
# source, compiled again only when a tracking pool is used), then record who
# holds each page. The plain kernels stay as short as an untracked pool needs.

_alloc_short = _as_callee(alloc_short)
_alloc_pn = _as_callee(alloc_pn)
_alloc_p1 = _as_callee(alloc_p1)
_free_short = _as_callee(free_short)
_free_pn = _as_callee(free_pn)
_free_p1 = _as_callee(free_p1)


@_callee()
def _track_alloc(st: NDArray[np.int64], out: NDArray[np.int64], site: int, status: int) -> int:
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
def _track_free(st: NDArray[np.int64], tail: int, site: int, status: int) -> int:
    """After a successful free (``status > 0``), each page freed records ``site`` as the site that freed it.

    The pages are read back from where the free staged them on the ring
    (from position ``tail``, not from the caller's slots again). O(pages).
    """
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


_TRACKED = "i8(i8[::1], i8[::1], i8)"


@_jit(_TRACKED)
def alloc_pn_tracked(st: NDArray[np.int64], out: NDArray[np.int64], site: int) -> int:
    """:func:`alloc_pn`, then each page handed out records this allocation (:func:`_track_alloc`)."""
    return _track_alloc(st, out, site, _alloc_pn(st, out))


@_jit(_TRACKED)
def alloc_p1_tracked(st: NDArray[np.int64], out: NDArray[np.int64], site: int) -> int:
    """:func:`alloc_p1`, then each page handed out records this allocation (:func:`_track_alloc`)."""
    return _track_alloc(st, out, site, _alloc_p1(st, out))


@_jit(_TRACKED)
def free_pn_tracked(st: NDArray[np.int64], slots: NDArray[np.int64], site: int) -> int:
    """:func:`free_pn`, then each page freed records ``site`` (:func:`_track_free`)."""
    tail = ring_tail(st)
    return _track_free(st, tail, site, _free_pn(st, slots))


@_jit(_TRACKED)
def free_p1_tracked(st: NDArray[np.int64], slots: NDArray[np.int64], site: int) -> int:
    """:func:`free_p1`, then each page freed records ``site`` (:func:`_track_free`)."""
    tail = ring_tail(st)
    return _track_free(st, tail, site, _free_p1(st, slots))


@_jit(_TRACKED, nogil=False)
def alloc_tracked_short(st: NDArray[np.int64], out: NDArray[np.int64], site: int) -> int:
    """:func:`alloc_short`, then each page handed out records this allocation (:func:`_track_alloc`)."""
    return _track_alloc(st, out, site, _alloc_short(st, out))


@_jit(_TRACKED, nogil=False)
def free_tracked_short(st: NDArray[np.int64], slots: NDArray[np.int64], site: int) -> int:
    """:func:`free_short`, then each page freed records ``site`` (:func:`_track_free`)."""
    tail = ring_tail(st)
    return _track_free(st, tail, site, _free_short(st, slots))


class PageSizeKernels(NamedTuple):
    """The alloc and free kernels of one page-size class: ``KERNELS[page_size == 1]``.

    Calls of at most :data:`SHORT_SLOTS` slots run the flat ``*_short``
    kernels (one pair for every class), calls of up to :data:`GIL_SLOTS`
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
        alloc_pn,
        alloc_pn_gil,
        alloc_short,
        free_pn,
        free_pn_gil,
        free_short,
        alloc_pn_tracked,
        alloc_tracked_short,
        free_pn_tracked,
        free_tracked_short,
    ),
    PageSizeKernels(
        alloc_p1,
        alloc_p1_gil,
        alloc_short,
        free_p1,
        free_p1_gil,
        free_short,
        alloc_p1_tracked,
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
