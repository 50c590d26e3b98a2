"""The template of the core pool's free for short calls (at most ``SHORT_SLOTS`` slots): what a first free compiles.

Its own page loops, calling the run kernels' helpers; ``python -m tests.flatten`` writes it out flat, those helpers'
bodies in, as ``_kernels/flat.py``'s ``free_short``, which ``_kernels/pool.py`` compiles (docs/architecture.md).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .layout import (
    E_LENGTH,
    E_MISALIGNED,
    E_PARTIAL,
    E_RANGE,
    H_GROUP_DEPTH,
    H_NPAGES,
    H_PAGE_SHIFT,
    H_PAGE_SIZE,
    OWNER_ALLOCATED,
    OWNER_FREE,
    OWNER_PENDING,
    fail,
    owner_view,
    ring_view,
)
from .runs import _RUN_PROBE, _claim_flags, _run_length, free_end, put_run, ring_tail, staged_twice

# The kernels' Python annotations are for type checkers only: numba compiles
# each kernel from its signature string, a callee for its callers' types.
# A local annotated ``int`` holds an array element or a shape entry.

# Kernels hold their loops themselves and call only small helpers that call
# nothing big in turn: numba optimises and generates machine code for every
# compiled function with everything it calls linked in, so a loop nested
# three calls deep was compiled four times over (docs/architecture.md).

# -- short calls -------------------------------------------------------------
# A call of at most SHORT_SLOTS slots holds no run worth taking (_LONG_SLOTS),
# so it goes through one flat loop, for every page size: the free below,
# written out flat, and the short alloc are single functions, no callee but ``fail``.
# numba compiles a callee as a unit of its own (its own typing, lowering and
# machine code) and links it in again, so the two compile in a third of the
# time the run kernels take (docs/architecture.md): what a new process's
# first alloc and free wait for. They keep the GIL: handing it over and back
# costs more than a short call's work.
SHORT_SLOTS = 1023
# Which page-size classes a short free serves, fixed when it compiles: each
# class's pool runs a copy with the other's loop off (``free_p1_short`` and
# ``free_pn_short``, in _kernels/pool.py), whose branch numba drops before typing
# it: a new process's first free compiles half the code.
_PAGE_SIZE_1_LOOP = True
_LARGER_PAGES_LOOP = True


def _free_short(st: NDArray[np.int64], slots: NDArray[np.int64]) -> int:
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
    tail: int = ring_tail(st)
    pos = tail
    status = 0
    missing = -1  # a page found not allocated: freed earlier in this call, or not held
    c = 0  # pages staged
    entries = 0  # entries staged
    if _PAGE_SIZE_1_LOOP:  # noqa: SIM102 - a flag alone: numba drops the branch before typing it
        if page_size == 1:  # page ids are slot ids; runs as in free_p1
            reach = _RUN_PROBE - 1
            skip = 0
            while c < count:
                p = slots[c]  # the only read of this element (a run's ids all derive from it)
                if p < 0 or p >= n:
                    status = fail(E_RANGE, c)
                    break
                if c >= skip and c + reach < count and slots[c + reach] == p + reach:
                    limit = count - c if count - c < n - p else n - p  # not min(): its overload is a compile of its own
                    run = _run_length(slots, c, limit, p)
                    if run > 1:
                        held = _claim_flags(st, p, run, OWNER_ALLOCATED, mark)
                        if held:
                            # Measured to its end (or the pool's): the next slot never continues it.
                            pos = put_run(ring, pos, p, run)
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
    if _LARGER_PAGES_LOOP:
        while page_size > 1 and c < count:
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
    if missing >= 0:
        status = staged_twice(ring, tail, entries, missing, c * page_size)
    return free_end(st, tail, c, entries, status if status != 0 else count * page_size)
