"""Numba kernels of the core pool: every change to a ``LogicalHostPool``'s state.

The layout of ``st`` and the status codes are in ``_kernels/layout.py``. Kernels
move integers and return status codes; they never raise and never allocate
Python objects, so ``_core/pool.py`` can validate, lock, and turn a status into
the right exception. On failure the header, the live window and the owner
flags are as they were; only the scratch behind the window may differ.
Measured trade-offs behind the choices here are in ``docs/architecture.md``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from . import flat as _flat
from .jit import callee as _callee
from .jit import kernel as _jit
from .jit import variant as _variant
from .layout import (
    E_LENGTH,
    E_MERGE_FIRST,
    E_MISALIGNED,
    E_NEGATIVE,
    E_NO_GROUP,
    E_PARTIAL,
    E_RANGE,
    H_AVAIL,
    H_CLEARS,
    H_EFREE,
    H_EPEND,
    H_EREL,
    H_GROUP_DEPTH,
    H_HEAD,
    H_NFREE,
    H_NPAGES,
    H_NPEND,
    H_NREL,
    H_PAGE_SHIFT,
    H_PAGE_SIZE,
    H_SEQ,
    H_SORTED,
    H_TRACK,
    OWNER_ALLOCATED,
    OWNER_FREE,
    OWNER_PENDING,
    fail,
    owner_view,
    ring_view,
)
from .runs import (
    _RUN_PROBE,
    _claim_flags,
    _run_length,
    alloc_begin,
    count_alloc,
    free_end,
    long_run,
    merge,
    put_run,
    refuse,
    ring_tail,
    run_at,
    run_width,
    set_runs,
    stage,
    staged_twice,
    take_front,
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
    st[H_AVAIL] = n * st[H_PAGE_SIZE]
    st[H_EFREE] = entries
    st[H_NREL] = 0
    st[H_EREL] = 0
    st[H_NPEND] = 0
    st[H_EPEND] = 0
    st[H_GROUP_DEPTH] = 0
    st[H_CLEARS] += 1
    return n


# -- alloc --------------------------------------------------------------------
# Longer calls. With the lists kept as runs, an allocation writes each run's
# slots as one range for every page size, so one kernel serves both
# page-size classes.


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
    need: int = alloc_begin(st, out)
    if need <= 0:
        return need
    if need > st[H_NFREE] and st[H_SORTED] != 0:
        # A sorted merge reorders the pages, so it comes before reading them;
        # the pool calls merge and asks again (this kernel stays small).
        return fail(E_MERGE_FIRST, 0)
    page_size: int = st[H_PAGE_SIZE]
    status: int = take_front(st, need, out, page_size)
    if status < 0:
        return status
    count_alloc(st, 0)
    return need * page_size


# Calls of at most SHORT_SLOTS slots: the same definition, flat (its callees' bodies written in by tests/flatten.py,
# so that it compiles as one unit: what a new process's first alloc waits for), with the GIL kept, and without the
# stretches of lone pages. The short free (_kernels/short.py) is made the same way; a copy per class compiles below.
alloc_short = _jit("i8(i8[::1], i8[::1])", nogil=False)(_flat.alloc_short)


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
                if run > 0 and _claim_flags(st, p, run, OWNER_ALLOCATED, mark):
                    pos, entries, first_page, length = stage(ring, pos, entries, first_page, length, p, run)
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
            pos, entries, first_page, length = stage(ring, pos, entries, first_page, length, p, 1)
        c = stop  # the pages staged so far
        if status != 0 or missing >= 0:
            break
    if length > 0:
        put_run(ring, pos, first_page, length)
        entries += run_width(length)
    if missing >= 0:
        status = staged_twice(ring, tail, entries, missing, c * page_size)
    return free_end(st, tail, c, entries, status if status != 0 else count * page_size)


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
            if run > 1 and _claim_flags(st, p, run, OWNER_ALLOCATED, mark):
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
        status = staged_twice(ring, tail, entries, missing, c)
    return free_end(st, tail, c, entries, status if status != 0 else count)


# Calls of SHORT_SLOTS + 1 .. GIL_SLOTS slots run these twins of the run
# kernels, compiled from the same source with the GIL kept: handing it over
# and back costs more than such a call saves by letting others run.
GIL_SLOTS = 4096

_TWO = "i8(i8[::1], i8[::1])"
alloc_pages_gil = _variant(alloc_pages, name="alloc_pages_gil", signature=_TWO, nogil=False)
free_pn_gil = _variant(free_pn, name="free_pn_gil", signature=_TWO, nogil=False)
free_p1_gil = _variant(free_p1, name="free_p1_gil", signature=_TWO, nogil=False)
# The short free, a copy per page-size class with the other's loop dropped: a first free compiles half the code.
_SHORT_PN = {"_PAGE_SIZE_1_LOOP": False}
_SHORT_P1 = {"_LARGER_PAGES_LOOP": False}
free_pn_short = _variant(_flat.free_short, name="free_pn_short", signature=_TWO, nogil=False, constants=_SHORT_PN)
free_p1_short = _variant(_flat.free_short, name="free_p1_short", signature=_TWO, nogil=False, constants=_SHORT_P1)


# -- tracking -----------------------------------------------------------------
# A tracking pool's kernels call the plain kernels' code as callees (the same
# source, compiled again only when a tracking pool is used), then record who
# holds each page. The plain kernels stay as short as an untracked pool needs.

_alloc_short = _variant(alloc_short)
_alloc_pages = _variant(alloc_pages)
_free_short = _variant(_flat.free_short)
_free_pn = _variant(free_pn)
_free_p1 = _variant(free_p1)


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
def track_free(st: NDArray[np.int64], tail: int, staged: int, site: int, status: int) -> int:
    """After a successful free (``status > 0``), each page freed records ``site`` as the site that freed it.

    The pages are read back from the ``staged`` ring entries the free
    wrote from position ``tail`` (not from the caller's slots again): a
    count, as a free that fills the whole ring ends where it began. O(pages).
    """
    if status <= 0:
        return status
    n: int = st[H_NPAGES]
    t: int = st[H_TRACK]
    pos = tail
    ring = ring_view(st)
    left = staged
    while left > 0:
        length = run_at(ring, pos, left)
        first: int = ring[pos]
        for p in range(first, first + length):
            st[t + n + p] = (st[t + n + p] & ~_LOW32) | site
        w = run_width(length)
        pos = pos + w if pos + w < n else pos + w - n
        left -= w
    return status


@_callee()
def ring_entries(st: NDArray[np.int64]) -> int:
    """The ring's live entries: the free, released and pending lists' runs."""
    entries: int = st[H_EFREE] + st[H_EREL] + st[H_EPEND]
    return entries


_TRACKED = "i8(i8[::1], i8[::1], i8)"


@_jit(_TRACKED)
def alloc_tracked(st: NDArray[np.int64], out: NDArray[np.int64], site: int) -> int:
    """:func:`alloc_pages`, then each page handed out records this allocation (:func:`track_alloc`)."""
    return track_alloc(st, out, site, _alloc_pages(st, out))


@_jit(_TRACKED)
def free_pn_tracked(st: NDArray[np.int64], slots: NDArray[np.int64], site: int) -> int:
    """:func:`free_pn`, then each page freed records ``site`` (:func:`track_free`)."""
    tail, before = ring_tail(st), ring_entries(st)
    status = _free_pn(st, slots)
    return track_free(st, tail, ring_entries(st) - before, site, status)


@_jit(_TRACKED)
def free_p1_tracked(st: NDArray[np.int64], slots: NDArray[np.int64], site: int) -> int:
    """:func:`free_p1`, then each page freed records ``site`` (:func:`track_free`)."""
    tail, before = ring_tail(st), ring_entries(st)
    status = _free_p1(st, slots)
    return track_free(st, tail, ring_entries(st) - before, site, status)


@_jit(_TRACKED, nogil=False)
def alloc_tracked_short(st: NDArray[np.int64], out: NDArray[np.int64], site: int) -> int:
    """:func:`alloc_short`, then each page handed out records this allocation (:func:`track_alloc`)."""
    return track_alloc(st, out, site, _alloc_short(st, out))


@_jit(_TRACKED, nogil=False)
def free_tracked_short(st: NDArray[np.int64], slots: NDArray[np.int64], site: int) -> int:
    """The short free (``_kernels.flat.free_short``), then each page freed records ``site`` (:func:`track_free`)."""
    tail, before = ring_tail(st), ring_entries(st)
    status = _free_short(st, slots)
    return track_free(st, tail, ring_entries(st) - before, site, status)


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
    st[H_AVAIL] = (st[H_NFREE] + st[H_NREL]) * st[H_PAGE_SIZE]
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


@_jit("i8(i8[::1], i8[::1], i8)")
def load_state(st: NDArray[np.int64], src: NDArray[np.int64], core: int) -> int:
    """Copy a validated snapshot ``src`` over the state; return its length.

    ``restore_state`` and unpickling check ``src`` (same layout, invariants)
    before calling this; here it is one block copy, so the pool is never
    seen half restored by a kernel. A ``core`` state's derived word
    (``H_AVAIL``, 0 in a snapshot) is set in the same call; a host pool's
    layout has none.
    """
    words: int = st.shape[0]
    for i in range(words):  # not ``st[:] = src``, which may copy ``src`` first
        st[i] = src[i]
    if core != 0:
        st[H_AVAIL] = (st[H_NFREE] + st[H_NREL]) * st[H_PAGE_SIZE]
    return words


class PoolKernels(NamedTuple):
    """The core pool's kernels beyond alloc and free (``KERNELS``): what ``LogicalHostPool`` calls for the rest."""

    reset: Any
    merge: Any
    refuse: Any
    plan_batch: Any
    group_begin: Any
    group_end: Any
    load_state: Any


POOL = PoolKernels(reset, merge, refuse, plan_batch, group_begin, group_end, load_state)
