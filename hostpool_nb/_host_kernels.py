"""Numba kernels of ``HostPagePool``: every change to a host page pool's state.

A pool of ``n`` pages keeps one int64 array ``st`` (:func:`state_length`):

``st[:HEADER]``
    Scalars at the ``H_*`` offsets below: the free list's place on the ring,
    counters that only grow, and two scratch words a failed call leaves its
    fault in (the page it stopped at, and the generation it was given), so
    the error message is built from values the kernel checked.
the ring (:func:`ring_view`), ``n`` int32 page ids
    From ``st[H_HEAD]`` on, the ``st[H_NFREE]`` entries are the FIFO free
    list: allocation takes from the front, a freed page goes to the back.
    The entries after them are scratch: ``free`` stages the pages it
    validated there, which is room enough, since it only stages held pages.
``generation``, ``n`` int64 words
    Incremented each time the page is handed out.
``lock_ref``, ``n`` int64 words
    The page's pin count; a pinned page cannot be freed.
``allocated``, ``n`` bytes (0 or 1, at all times)
    1 from allocation until free or release.
``marks``, ``n`` bytes
    Scratch of one ``free`` call (a page named again in the same call is
    one free); all zero between calls.

Kernels validate before they write, return the shared status encoding of
``_kernels.py`` (a value ``>= 0`` on success) and never raise; on failure
the state is as it was, but for the scratch.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ._jit import callee as _callee
from ._jit import kernel as _jit
from ._kernels import E_CORRUPT, E_NOT_ALLOCATED, E_RANGE, E_SHORT, _fail, ring_words

H_HEAD = 0  # ring position of the first free page
H_NFREE = 1  # pages on the free list
H_NPAGES = 2  # pool_size
H_ALLOC_CALLS = 3  # reserve and alloc calls answered (a page, pages or None)
H_EXHAUSTED = 4  # of those, answered None
H_FREE_CALLS = 5  # release and free calls that freed at least one page
H_PEAK = 6  # most pages held at once
H_CLEARS = 7  # clear() calls
H_PINNED = 8  # pages whose lock_ref is above 0
H_FAULT = 9  # scratch: the page a failed call stopped at
H_FAULT_GEN = 10  # scratch: the generation the caller gave for it
HEADER = 16  # the spare words keep room for later counters
SCRATCH = (H_FAULT, H_FAULT_GEN)

# Status codes of these kernels beyond _kernels' E_SHORT, E_RANGE, E_NOT_ALLOCATED, E_CORRUPT.
E_PINNED = 10  # a pinned page freed or released
E_STALE = 11  # a generation that is not the page's: it was handed out again since
E_UNDERFLOW = 12  # dec_lock_ref of an unpinned page


def _offsets(n: int) -> tuple[int, int, int, int, int]:
    """Word offsets of the ring, generations, pin counts, allocated flags and marks."""
    ring = HEADER
    gen = ring + ring_words(n)
    ref = gen + n
    flags = ref + n
    marks = flags + (n + 7) // 8
    return ring, gen, ref, flags, marks


def state_length(n: int) -> int:
    """Length of the int64 state array of a pool of ``n`` pages (about 22 bytes a page)."""
    return _offsets(n)[4] + (n + 7) // 8


@_callee(views=True)
def ring_view(st: NDArray[np.int64]) -> NDArray[np.int32]:
    n = st[H_NPAGES]
    return st[HEADER : HEADER + ring_words(n)].view(np.int32)[:n]


@_callee(views=True)
def gen_view(st: NDArray[np.int64]) -> NDArray[np.int64]:
    n = st[H_NPAGES]
    start = HEADER + ring_words(n)
    return st[start : start + n]


@_callee(views=True)
def ref_view(st: NDArray[np.int64]) -> NDArray[np.int64]:
    n = st[H_NPAGES]
    start = HEADER + ring_words(n) + n
    return st[start : start + n]


@_callee(views=True)
def flags_view(st: NDArray[np.int64]) -> NDArray[np.uint8]:
    n = st[H_NPAGES]
    start = HEADER + ring_words(n) + 2 * n
    return st[start:].view(np.uint8)[:n]


@_callee(views=True)
def marks_view(st: NDArray[np.int64]) -> NDArray[np.uint8]:
    n = st[H_NPAGES]
    start = HEADER + ring_words(n) + 2 * n + (n + 7) // 8
    return st[start:].view(np.uint8)[:n]


@_jit("i8(i8[::1])")
def host_reset(st: NDArray[np.int64]) -> int:
    """Every page free, in ascending order, unpinned; generations and counters kept."""
    n: int = st[H_NPAGES]
    ring = ring_view(st)
    ref = ref_view(st)
    flags = flags_view(st)
    marks = marks_view(st)
    for p in range(n):
        ring[p] = p
        ref[p] = 0
        flags[p] = 0
        marks[p] = 0
    st[H_HEAD] = 0
    st[H_NFREE] = n
    st[H_PINNED] = 0
    st[H_CLEARS] += 1
    return n


@_callee()
def _answered(st: NDArray[np.int64], exhausted: int) -> None:
    st[H_ALLOC_CALLS] += 1
    if exhausted != 0:
        st[H_EXHAUSTED] += 1
    else:
        st[H_PEAK] = max(st[H_PEAK], st[H_NPAGES] - st[H_NFREE])


@_jit("i8(i8[::1])", nogil=False)
def host_reserve(st: NDArray[np.int64]) -> int:
    """Take the front page: return its id, or ``E_SHORT`` (counted) when none is free."""
    n: int = st[H_NPAGES]
    if st[H_NFREE] == 0:
        _answered(st, 1)
        return _fail(E_SHORT, 0)
    head: int = st[H_HEAD]
    p: int = ring_view(st)[head]
    flags = flags_view(st)
    if p < 0 or p >= n or flags[p] != 0:
        return _fail(E_CORRUPT, 0)
    flags[p] = 1
    gen_view(st)[p] += 1
    st[H_HEAD] = head + 1 if head + 1 < n else 0
    st[H_NFREE] -= 1
    _answered(st, 0)
    return p


@_jit("i8(i8[::1], i8[::1])")
def host_alloc(st: NDArray[np.int64], out: NDArray[np.int64]) -> int:
    """Take the ``len(out)`` front pages into ``out``, or ``E_SHORT`` (counted) when fewer are free.

    The ring is read and checked first, then written: ``E_CORRUPT`` (a listed
    page not free) changes nothing. O(len(out)), whatever the pool's size.
    """
    n: int = st[H_NPAGES]
    k: int = out.shape[0]
    if k > st[H_NFREE]:
        _answered(st, 1)
        return _fail(E_SHORT, 0)
    ring = ring_view(st)
    flags = flags_view(st)
    gen = gen_view(st)
    head: int = st[H_HEAD]
    pos = head
    for i in range(k):
        p = ring[pos]
        if p < 0 or p >= n or flags[p] != 0:
            return _fail(E_CORRUPT, i)
        out[i] = p
        pos = pos + 1 if pos + 1 < n else 0
    for i in range(k):
        p = out[i]
        flags[p] = 1
        gen[p] += 1
    st[H_HEAD] = pos
    st[H_NFREE] -= k
    _answered(st, 0)
    return k


@_callee()
def _refusal(st: NDArray[np.int64], code: int, position: int, page: int, given: int) -> int:
    """Leave the fault in the scratch words; return the status."""
    st[H_FAULT] = page
    st[H_FAULT_GEN] = given
    return _fail(code, position)


@_jit("i8(i8[::1], i8[::1], i8[::1], i8)")
def host_free(st: NDArray[np.int64], pages: NDArray[np.int64], gens: NDArray[np.int64], check: int) -> int:
    """Free ``pages`` (a page named again counts once); return how many pages were freed.

    Each entry is read once. In order: a page outside ``[0, n)`` is
    ``E_RANGE``, one not allocated ``E_NOT_ALLOCATED``, with ``check`` one
    whose generation is not ``gens[i]`` ``E_STALE`` (a repeat is checked
    too), a pinned one ``E_PINNED``; the position is the entry's. The pages
    that passed are staged behind the free list and marked; only when every
    entry has passed do they join the free list, in the order first named.
    """
    n: int = st[H_NPAGES]
    m: int = pages.shape[0]
    ring = ring_view(st)
    flags = flags_view(st)
    marks = marks_view(st)
    gen = gen_view(st)
    ref = ref_view(st)
    tail: int = st[H_HEAD] + st[H_NFREE]
    if tail >= n:
        tail -= n
    pos = tail
    staged = 0
    status = 0
    for i in range(m):
        x = pages[i]
        if x < 0 or x >= n:
            status = _refusal(st, E_RANGE, i, x, 0)
            break
        given = gens[i] if check != 0 else 0
        if check != 0 and flags[x] != 0 and given != gen[x]:
            status = _refusal(st, E_STALE, i, x, given)
            break
        if marks[x] != 0:
            continue
        if flags[x] == 0:
            status = _refusal(st, E_NOT_ALLOCATED, i, x, given)
            break
        if ref[x] > 0:
            status = _refusal(st, E_PINNED, i, x, given)
            break
        marks[x] = 1
        ring[pos] = x
        pos = pos + 1 if pos + 1 < n else 0
        staged += 1
    pos = tail
    for _ in range(staged):
        p = ring[pos]
        marks[p] = 0
        if status == 0:
            flags[p] = 0
        pos = pos + 1 if pos + 1 < n else 0
    if status != 0:
        return status
    st[H_NFREE] += staged
    if staged > 0:
        st[H_FREE_CALLS] += 1
    return staged


@_jit("i8(i8[::1], i8, i8, i8)", nogil=False)
def host_release(st: NDArray[np.int64], page: int, given: int, check: int) -> int:
    """``host_free`` of one page, without an array: returns 1, or the same failures at position 0."""
    n: int = st[H_NPAGES]
    if page < 0 or page >= n:
        return _refusal(st, E_RANGE, 0, page, 0)
    flags = flags_view(st)
    if flags[page] == 0:
        return _refusal(st, E_NOT_ALLOCATED, 0, page, given)
    if check != 0 and given != gen_view(st)[page]:
        return _refusal(st, E_STALE, 0, page, given)
    if ref_view(st)[page] > 0:
        return _refusal(st, E_PINNED, 0, page, given)
    tail: int = st[H_HEAD] + st[H_NFREE]
    ring_view(st)[tail - n if tail >= n else tail] = page
    flags[page] = 0
    st[H_NFREE] += 1
    st[H_FREE_CALLS] += 1
    return 1


@_callee()
def _pin_one(st: NDArray[np.int64], page: int, delta: int, position: int) -> int:
    n: int = st[H_NPAGES]
    if page < 0 or page >= n:
        return _refusal(st, E_RANGE, position, page, 0)
    if flags_view(st)[page] == 0:
        return _refusal(st, E_NOT_ALLOCATED, position, page, 0)
    ref = ref_view(st)
    count: int = ref[page]
    if delta < 0 and count == 0:
        return _refusal(st, E_UNDERFLOW, position, page, 0)
    ref[page] = count + delta
    if count == 0:
        st[H_PINNED] += 1
    elif count + delta == 0:
        st[H_PINNED] -= 1
    return 0


@_jit("i8(i8[::1], i8, i8)", nogil=False)
def host_pin1(st: NDArray[np.int64], page: int, delta: int) -> int:
    """Add ``delta`` (+1 or -1) to one allocated page's pin count; 1, or ``E_RANGE`` / ``E_NOT_ALLOCATED`` /
    ``E_UNDERFLOW``."""
    status = _pin_one(st, page, delta, 0)
    return 1 if status == 0 else status


@_jit("i8(i8[::1], i8[::1], i8)")
def host_pin(st: NDArray[np.int64], pages: NDArray[np.int64], delta: int) -> int:
    """:func:`host_pin1` for each of ``pages`` in order (a repeat counts each time), all or none.

    ``pages`` must be the pool's own copy: a failure undoes the entries
    before it by reading them again.
    """
    m: int = pages.shape[0]
    for i in range(m):
        status = _pin_one(st, pages[i], delta, i)
        if status != 0:
            for j in range(i - 1, -1, -1):
                _pin_one(st, pages[j], -delta, j)
            return status
    return m
