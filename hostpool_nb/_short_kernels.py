"""The core pool's flat kernels for short calls (at most ``SHORT_SLOTS`` slots): one loop, no callee but ``fail``.

What a new process's first alloc and free compile; written out because a callee per run measured slower and
compiled longer (``docs/architecture.md``).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ._jit import kernel as _jit
from ._jit import trailing_zeros
from ._layout import (
    E_CORRUPT,
    E_DUPLICATE,
    E_LENGTH,
    E_MERGE_FIRST,
    E_MISALIGNED,
    E_NOT_ALLOCATED,
    E_PARTIAL,
    E_RANGE,
    E_SHORT,
    H_ALLOC_CALLS,
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
    H_SORTED,
    HEADER,
    OWNER_ALLOCATED,
    OWNER_FREE,
    OWNER_PENDING,
    fail,
    owner_view,
    ring_view,
)
from ._run_kernels import _ALL_BYTES, _ALLOCATED_WORD, _EVERY_BYTE, _FLAGS_PER_WORD, _LOW_BYTE, _RUN_BLOCK, _RUN_PROBE

# The kernels' Python annotations are for type checkers only: numba compiles
# each kernel from its signature string, a callee for its callers' types.
# A local annotated ``int`` holds an array element or a shape entry.

# Kernels hold their loops themselves and call only small helpers that call
# nothing big in turn: numba optimises and generates machine code for every
# compiled function with everything it calls linked in, so a loop nested
# three calls deep was compiled four times over (docs/architecture.md).

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
