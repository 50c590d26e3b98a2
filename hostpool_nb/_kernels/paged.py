"""Numba kernels of ``hostpool_nb.paged``: every change to a rank's page state.

Each data-parallel rank keeps two int64 arrays (``_kernels/layout.py``): ``st``, in
the core pool's layout for ``pages + 1`` pages, page 0 being the padding
page, flagged allocated forever and never listed, so the core's merge, sort
and invariants apply unchanged (the paged allocator merges sorted, the
token allocator FIFO); and ``gp``, the rank's free group. A snapshot copies
``st`` only: as in the original, free groups are not part of the state.

The allocators have no ``stats()``; the core's counter words are kept where
the shared invariants and helpers read them. Each input element is read
once; what a kernel acts on is what it validated, staged in pool memory.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .jit import callee as _callee
from .jit import kernel as _jit
from .jit import variant as _variant
from .layout import (
    E_CORRUPT,
    E_DUPLICATE,
    E_LAST_LOC,
    E_NEGATIVE,
    E_NOT_ALLOCATED,
    E_PAGE0,
    E_RANGE,
    E_SEQ_BELOW_ONE,
    E_SEQ_BELOW_PREFIX,
    E_SHORT,
    E_TOTAL,
    GP_COUNT,
    GP_FAULT,
    GP_HEADER,
    H_AVAIL,
    H_CLEARS,
    H_EFREE,
    H_EREL,
    H_HEAD,
    H_NFREE,
    H_NPAGES,
    H_NREL,
    H_PAGE_SHIFT,
    H_PAGE_SIZE,
    H_PEAK,
    H_SEQ,
    H_TRACK,
    MARK_NONE,
    MARK_PENDING,
    MARK_STAGED,
    OWNER_ALLOCATED,
    OWNER_FREE,
    OWNER_STAGED,
    SITE_CLEARED,
    fail,
    marks_view,
    owner_view,
    ring_view,
)
from .pool import _LOW32, track_alloc, track_free
from .runs import count_alloc, merge_lists, put_run, run_width, set_runs, stage, take_front

# Whether a kernel records who holds each page: one definition per kernel, compiled twice (``KERNELS``)
# with this global fixed, numba freezing it as a constant and dropping the branches it rules out. A
# branch on the site at run time instead kept the tracking code in the plain kernels and cost the
# sliding-window free 15% (docs/architecture.md).
TRACKED = False

I64 = NDArray[np.int64]  # the kernels' annotations (numba compiles from the signature strings)
I32 = NDArray[np.int32]

# free_slots modes.
FREE_PAGED = 0  # a page already free is ignored (the original's meaning)
FREE_PAGED_STRICT = 1  # a page free before the call is a double free
FREE_TOKENS = 2  # page size 1: every slot allocated and named once


@_callee()
def _ceil_div(x: int, page_size: int) -> int:
    """``ceil(x / page_size)`` for ``x >= 0``, without the overflow of ``x + page_size - 1``."""
    return 0 if x <= 0 else (x - 1) // page_size + 1


@_callee()
def _drop_group(gp: NDArray[np.int64]) -> int:
    """Forget the rank's pending frees (its pages stay allocated); return how many."""
    count: int = gp[GP_COUNT]
    marks = marks_view(gp)
    for i in range(count):
        marks[gp[GP_HEADER + i]] = MARK_NONE
    gp[GP_COUNT] = 0
    return count


@_jit("i8(i8[::1], i8[::1])")
def reset_rank(st: NDArray[np.int64], gp: NDArray[np.int64]) -> int:
    """The rank's initial state: pages ``1..pages`` free in order, no release list, no group.

    The counters are kept. Returns the number of free pages.
    """
    cap: int = st[H_NPAGES]
    owner = owner_view(st)
    ring = ring_view(st)
    t: int = st[H_TRACK]
    if t != 0:
        for p in range(1, cap):
            if owner[p] == OWNER_ALLOCATED:
                st[t + cap + p] = (st[t + cap + p] & ~_LOW32) | SITE_CLEARED
    for p in range(1, cap):
        owner[p] = OWNER_FREE
    entries = 0
    if cap > 1:
        put_run(ring, 0, 1, cap - 1)
        entries = run_width(cap - 1)
    if cap > 0:
        owner[0] = OWNER_ALLOCATED  # the padding page: never listed, never handed out
    st[H_HEAD] = 0
    st[H_NFREE] = cap - 1
    st[H_AVAIL] = (cap - 1) * st[H_PAGE_SIZE]
    st[H_EFREE] = entries
    st[H_NREL] = 0
    st[H_EREL] = 0
    st[H_CLEARS] += 1
    st[H_PEAK] = max(st[H_PEAK], 1)  # the padding page counts as held (the shared invariants check it)
    _drop_group(gp)
    return cap - 1


@_callee()
def _take_front(st: NDArray[np.int64], k: int, out: NDArray[np.int64] | NDArray[np.int32], page_size: int) -> int:
    """Take ``k`` pages from the front of the free list: their slots to ``out`` (``page_size`` each); 0.

    As the original: if the free list alone is too short, the release list
    is merged first, and only then is the request refused (``E_SHORT``),
    so a refused request may still have merged. ``E_CORRUPT`` (lists
    unchanged) if a listed page is not flagged free (``take_front``).
    """
    if k > st[H_NFREE] and st[H_NREL] > 0:
        status = merge_lists(st)
        if status < 0:
            return status
    if k > st[H_NFREE]:
        return fail(E_SHORT, 0)
    status = take_front(st, k, out, page_size)
    if status < 0:
        return status
    count_alloc(st, 0)
    return 0


@_callee()
def _take_ids(st: NDArray[np.int64], k: int, out: NDArray[np.int32]) -> int:
    """Take ``k`` pages (:func:`_take_front`), their ids into the last ``k`` words of ``out``; 0 or the failure.

    Every new page owns at least one of ``out``'s slots after those written
    before it, so filling ``out`` from the front never overwrites an id not
    yet read.
    """
    if k == 0:
        return 0
    return _take_front(st, k, out[out.shape[0] - k :], 1)


@_jit("i8(i8[::1], i8[::1], i8, i8)")
def alloc_slots(st: NDArray[np.int64], out: NDArray[np.int64], page_size: int, site: int) -> int:
    """``alloc``: ``len(out) // page_size`` pages from the front, their slots into ``out`` (int64).

    Returns ``len(out)``, or ``E_SHORT`` / ``E_CORRUPT``. Tracked, the
    pages record one allocation from ``site`` (``_kernels.track_alloc``).
    """
    k = out.shape[0] // page_size
    if k == 0:
        return 0
    status = _take_front(st, k, out, page_size)
    if status < 0:
        return status
    n: int = out.shape[0]
    if TRACKED:
        track_alloc(st, out, site, n)
    return n


@_jit("i8(i8[::1], i4[::1], i8)")
def alloc_tokens(st: NDArray[np.int64], out: NDArray[np.int32], site: int) -> int:
    """The token allocator's ``alloc``: the first ``len(out)`` slots of its list, as int32.

    FIFO: its free list and release list are one list, so nothing merges
    before the check; ``E_SHORT`` when the two together are too short.
    Tracked, the slots record one allocation from ``site``.
    """
    k: int = out.shape[0]
    if k > st[H_NFREE] + st[H_NREL]:
        count_alloc(st, 1)
        return fail(E_SHORT, 0)
    if k == 0:
        return 0
    status = _take_front(st, k, out, 1)
    if status < 0:
        return status
    if TRACKED:
        track_alloc(st, out, site, k)
    return k


@_jit("i8(i8[::1], i8[::1], i8[::1], i8[::1], i4[::1], i8, i8, i8, i8[::1])")
def alloc_extend(
    st: I64, prefix: I64, seq: I64, last: I64, out: I32, tokens: int, page_size: int, debug: int, sites: I64
) -> int:
    """Extend each request ``i`` from ``prefix[i]`` to ``seq[i]`` tokens; slots into ``out`` (int32).

    Checks every request first (``E_NEGATIVE`` for a negative prefix,
    ``E_SEQ_BELOW_PREFIX``, with ``debug`` ``E_LAST_LOC`` when
    ``(last + 1) % page_size != prefix % page_size``; the position is the
    request) and that ``tokens`` (the caller's ``extend_num_tokens``) is
    the sum of the extensions (``E_TOTAL``). Then takes the new pages,
    ``sum(ceil(seq / ps) - ceil(prefix / ps))``, from the front of the free
    list as one block (merging first if short; ``E_SHORT`` if still short)
    and writes, for each request with a positive extension: the rest of its
    current page (``last + 1, ...``), its whole new pages in block order,
    then a partial new page.

    ``out`` is ``tokens`` long, or empty when ``tokens`` is so large that
    the pages cannot fit the rank (the caller spares itself a huge
    allocation): the checks then run as ever and the call ends in
    ``E_SHORT`` (after the merge the original makes), never writing.
    The new pages' ids are staged at the end of ``out`` (:func:`_take_ids`).

    Tracked, each request that takes new pages is one allocation from
    ``sites[i]`` (``sites`` holds a site id per request, or one for all).
    """
    n = seq.shape[0]
    limit = tokens
    total = 0
    pages = 0
    for i in range(n):
        p = prefix[i]
        s = seq[i]
        if p < 0:
            return fail(E_NEGATIVE, i)
        if s < p:
            return fail(E_SEQ_BELOW_PREFIX, i)
        if debug != 0 and (last[i] + 1) % page_size != p % page_size:
            return fail(E_LAST_LOC, i)
        if s - p > limit - total:  # more tokens than extend_num_tokens: stop before any overflow
            return fail(E_TOTAL, 0)
        total += s - p
        pages += _ceil_div(s, page_size) - _ceil_div(p, page_size)
    if total != limit:
        return fail(E_TOTAL, 0)
    if out.shape[0] < limit:
        if pages > st[H_NPAGES] - 1:
            # More pages than the rank lists (page 0 never is): _take_front merges
            # as the original would, then refuses, without writing anything.
            return _take_front(st, pages, out[:0], 1)
        return fail(E_CORRUPT, 0)  # the caller's bound is wrong: never write past ``out``
    status = _take_ids(st, pages, out[:limit])
    if status < 0:
        return status
    ids = out[limit - pages : limit]
    number = site = 0
    w = 0
    page = 0
    for i in range(n):
        p = prefix[i]
        left = seq[i] - p
        if left <= 0:
            continue
        # The rest of the current page: from last_loc + 1 up to the page end.
        used = p % page_size
        rest = min(page_size - used if used != 0 else 0, left)
        start = last[i] + 1
        for j in range(rest):
            out[w + j] = start + j
        w += rest
        left -= rest
        if TRACKED and left > 0:  # one allocation per request that takes pages
            number = st[H_SEQ]
            st[H_SEQ] = number + 1
            site = sites[0] if sites.shape[0] == 1 else sites[i]
        # Then new pages in free-list order, the last one possibly partial.
        while left > 0:
            take = min(page_size, left)
            pid = ids[page]  # read before the fill below may overwrite it
            if TRACKED:
                _track_page(st, pid, number, site)
            base = pid * page_size
            for j in range(take):
                out[w + j] = base + j
            page += 1
            w += take
            left -= take
    return w


@_jit("i8(i8[::1], i8[::1], i8[::1], i4[::1], i8, i8, i8[::1])")
def alloc_decode(st: I64, seq: I64, last: I64, out: I32, page_size: int, debug: int, sites: I64) -> int:
    """One new token per request: ``out[i]`` is a new page's first slot, or ``last[i] + 1``.

    Request ``i`` needs a new page when its new token starts one
    (``(seq[i] - 1) % page_size == 0``). Checks first: ``E_SEQ_BELOW_ONE``
    (``seq`` counts the new token), with ``debug`` ``E_LAST_LOC`` when
    ``(last + 2) % page_size != seq % page_size``. The new pages come from
    the front of the free list in request order (merging first if short;
    ``E_SHORT`` if still short). The new pages' ids are staged at the
    end of ``out`` (:func:`_take_ids`). Tracked, each request given a new
    page is one allocation, from ``sites[i]`` (or ``sites[0]`` for all).
    """
    n: int = seq.shape[0]
    pages = 0
    for i in range(n):
        s = seq[i]
        if s < 1:
            return fail(E_SEQ_BELOW_ONE, i)
        if debug != 0 and (last[i] + 2) % page_size != s % page_size:
            return fail(E_LAST_LOC, i)
        if (s - 1) % page_size == 0:
            pages += 1
    status = _take_ids(st, pages, out)
    if status < 0:
        return status
    ids = out[n - pages :]
    page = 0
    for i in range(n):
        if (seq[i] - 1) % page_size == 0:
            pid = ids[page]  # read before out[i] may overwrite it
            if TRACKED:
                number: int = st[H_SEQ]
                st[H_SEQ] = number + 1
                _track_page(st, pid, number, sites[0] if sites.shape[0] == 1 else sites[i])
            out[i] = pid * page_size
            page += 1
        else:
            out[i] = last[i] + 1
    return n


@_callee()
def _refusal(mode: int, again: bool, code: int, c: int) -> int:
    """What a free does with a page it cannot take, at slot ``c``: 0 where ``mode`` skips it, else ``fail(code, c)``.

    A page this call named already (``again``): only the token free refuses
    it, a paged free names a page by any of its slots. A page not held, or
    pending: the strict modes refuse it, ``FREE_PAGED`` ignores it.
    """
    refused = mode == FREE_TOKENS if again else mode != FREE_PAGED
    return fail(code, c) if refused else 0


@_jit("i8(i8[::1], i8[::1], i8[::1], i8, i8, i8, i8)")
def free_slots(st: I64, gp: I64, slots: I64, page_size: int, mode: int, in_group: int, site: int) -> int:
    """Free the pages of token ``slots``; return the number of pages freed (or pending).

    ``FREE_PAGED``: a page is freed once however many of its slots are
    given; a page already free is ignored. ``FREE_PAGED_STRICT``: a page
    free before this call is ``E_NOT_ALLOCATED``, one freed earlier in the
    open group ``E_DUPLICATE``. ``FREE_TOKENS`` (page size 1): every slot
    must be allocated and named once (``E_NOT_ALLOCATED`` /
    ``E_DUPLICATE``). Slots of page 0 are ``E_PAGE0``, slots outside the
    rank's pages ``E_RANGE``, at the offending position.

    Outside a group the pages freed are appended to the release list, in
    the order first named; inside one (``in_group``) to the group buffer,
    marked pending and left allocated until :func:`end_group`. A page still
    marked pending outside a group (its group was ended by ``clear`` of
    another rank) is ``E_NOT_ALLOCATED`` in the strict modes. Every slot is
    read once; on any failure the rank is as it was.
    Tracked, each page freed or made pending records ``site`` as its freer.
    """
    cap: int = st[H_NPAGES]
    count = slots.shape[0]
    owner = owner_view(st)
    marks = marks_view(gp)
    ring = ring_view(st)
    shift: int = st[H_PAGE_SHIFT]  # log2(page_size), or -1: a division per slot
    tail: int = st[H_HEAD] + st[H_EFREE] + st[H_EREL]
    if tail >= cap:
        tail -= cap
    pos = tail
    entries = 0  # staged on the ring, but for the open run
    first = -2  # the open run, not written yet: pages in a row are one run
    length = 0
    pend0: int = gp[GP_COUNT]
    done = 0
    status = 0
    slot = 0
    for c in range(count):
        slot = slots[c]  # the only read of this element
        p = slot >> shift if shift >= 0 else slot // page_size
        if p == 0:
            status = fail(E_PAGE0, c)
            break
        if p < 0 or p >= cap:
            status = fail(E_RANGE, c)
            break
        if in_group != 0:
            mark = marks[p]
            if mark != MARK_NONE or owner[p] != OWNER_ALLOCATED:  # named earlier in the group, or not held
                status = _refusal(mode, mark == MARK_STAGED, E_NOT_ALLOCATED if mark == MARK_NONE else E_DUPLICATE, c)
                if status < 0:
                    break
                continue
            marks[p] = MARK_STAGED
            gp[GP_HEADER + pend0 + done] = p
            done += 1
            continue
        # _refusal's rule written out: through the callee, the sliding-window free (this loop twice) ran slower.
        flag = owner[p]
        if flag == OWNER_STAGED:
            if mode == FREE_TOKENS:
                status = fail(E_DUPLICATE, c)
                break
            continue
        if flag != OWNER_ALLOCATED:
            if mode != FREE_PAGED:
                status = fail(E_NOT_ALLOCATED, c)
                break
            continue
        if mode != FREE_PAGED and marks[p] == MARK_PENDING:
            # Freed in a group that clear() of another rank ended: still
            # allocated, but released at the next end_group. A second free
            # is a double free, as it would be inside the group.
            status = fail(E_NOT_ALLOCATED, c)
            break
        owner[p] = OWNER_STAGED
        # stage() written out: as a callee three calls deep in the sliding-window free, it slowed that free
        # (docs/architecture.md).
        if p == first + length:
            length += 1
        else:
            if length > 0:
                pos = put_run(ring, pos, first, length)
                entries += run_width(length)
            first = p
            length = 1
        done += 1
    if length > 0:
        put_run(ring, pos, first, length)
        entries += run_width(length)
    if status != 0:
        gp[GP_FAULT] = slot  # the value the check failed on: the caller's array may have changed since
    if in_group != 0:
        new_mark = MARK_NONE if status != 0 else MARK_PENDING
        for i in range(done):
            marks[gp[GP_HEADER + pend0 + i]] = new_mark
        if status != 0:
            return status
        gp[GP_COUNT] = pend0 + done
        if TRACKED:
            t: int = st[H_TRACK]
            for i in range(pend0, pend0 + done):
                p = gp[GP_HEADER + i]
                st[t + cap + p] = (st[t + cap + p] & ~_LOW32) | site
        return done
    set_runs(st, tail, entries, OWNER_ALLOCATED if status != 0 else OWNER_FREE)
    if status != 0:
        return status
    st[H_NREL] += done
    st[H_EREL] += entries
    st[H_AVAIL] = (st[H_NFREE] + st[H_NREL]) * st[H_PAGE_SIZE]
    if TRACKED:
        track_free(st, tail, entries, site, done)
    return done


@_jit("i8(i8[::1], i8[::1])")
def end_group(st: NDArray[np.int64], gp: NDArray[np.int64]) -> int:
    """Free the rank's pending pages, in the order they were freed; return how many.

    As the original's one ``free`` of the group's concatenation: a pending
    page that is no longer allocated (freed directly after a ``clear`` of
    another rank left the group, or made free by ``restore_state``) is
    skipped. The marks and the buffer are emptied.
    """
    cap: int = st[H_NPAGES]
    owner = owner_view(st)
    ring = ring_view(st)
    marks = marks_view(gp)
    count: int = gp[GP_COUNT]
    pos: int = st[H_HEAD] + st[H_EFREE] + st[H_EREL]
    if pos >= cap:
        pos -= cap
    released = 0
    entries = 0
    first = -2  # the open run: pages in a row are one run
    length = 0
    for i in range(count):
        p = gp[GP_HEADER + i]
        marks[p] = MARK_NONE
        if owner[p] == OWNER_ALLOCATED:
            owner[p] = OWNER_FREE
            pos, entries, first, length = stage(ring, pos, entries, first, length, p, 1)
            released += 1
    if length > 0:
        put_run(ring, pos, first, length)
        entries += run_width(length)
    gp[GP_COUNT] = 0
    st[H_NREL] += released
    st[H_EREL] += entries
    st[H_AVAIL] = (st[H_NFREE] + st[H_NREL]) * st[H_PAGE_SIZE]
    return released


# -- variants ---------------------------------------------------------------------------------


@_callee()
def _track_page(st: NDArray[np.int64], page: int, number: int, site: int) -> None:
    """``page`` was handed out by allocation ``number`` from ``site`` (the free site's id is kept)."""
    t: int = st[H_TRACK]
    n: int = st[H_NPAGES]
    st[t + page] = number
    st[t + n + page] = (site << 32) | (st[t + n + page] & _LOW32)


class RankKernels(NamedTuple):
    """A rank's kernels in one variant: ``KERNELS[tracked]`` for the allocators, ``CALLEES[tracked]`` in kernels."""

    reset_rank: Any
    end_group: Any
    alloc_slots: Any
    alloc_tokens: Any
    alloc_extend: Any
    alloc_decode: Any
    free_slots: Any


def tracked(made: Any, constants: dict[str, Any]) -> Any:
    """The tracked variant of ``made``: ``<name>_tracked``, its signature and GIL option; ``constants`` read."""
    # None under NUMBA_DISABLE_JIT, where the plain function is copied as a callee (the function itself).
    signature = getattr(made, "signature", None)
    return _variant(
        made,
        name=f"{made.__name__}_tracked",
        signature=signature,
        nogil=getattr(made, "nogil", True),
        constants=constants,
    )


_PLAIN = RankKernels(reset_rank, end_group, alloc_slots, alloc_tokens, alloc_extend, alloc_decode, free_slots)
KERNELS = (
    _PLAIN,
    _PLAIN._replace(**{f: tracked(getattr(_PLAIN, f), {"TRACKED": True}) for f in _PLAIN._fields[2:]}),
)
# The same, for the sliding-window kernels (``_kernels/swa.py``) to call: compiled into theirs. A kernel in
# both rows (reset_rank, end_group) is one callee.
_CALLEE_OF = {k: _variant(k) for k in (*KERNELS[0], *KERNELS[1])}
CALLEES = tuple(RankKernels(*(_CALLEE_OF[k] for k in kernels)) for kernels in KERNELS)
