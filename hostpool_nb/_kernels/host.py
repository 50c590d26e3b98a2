"""Numba kernels of ``HostPagePool``: every change to a host page pool's state.

The state array's layout and the status codes are in ``_kernels/layout.py``.
Kernels validate before they write and never raise; on failure the state
is as it was but for its scratch, and the fault words say which page (and
which generation) the call stopped at, so the error message is built from
values the kernel checked.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .jit import callee as _callee
from .jit import kernel as _jit
from .layout import (
    E_CORRUPT,
    E_NOT_ALLOCATED,
    E_PINNED,
    E_RANGE,
    E_SHORT,
    E_STALE,
    E_UNDERFLOW,
    HP_ALLOC_CALLS,
    HP_CLEARS,
    HP_EXHAUSTED,
    HP_FAULT,
    HP_FAULT_GEN,
    HP_FREE_CALLS,
    HP_HEAD,
    HP_NFREE,
    HP_NPAGES,
    HP_PEAK,
    HP_PINNED,
    fail,
    host_flags,
    host_gens,
    host_marks,
    host_refs,
    host_ring,
)


@_jit("i8(i8[::1])")
def host_reset(st: NDArray[np.int64]) -> int:
    """Every page free, in ascending order, unpinned; generations and counters kept."""
    n: int = st[HP_NPAGES]
    ring = host_ring(st)
    ref = host_refs(st)
    flags = host_flags(st)
    marks = host_marks(st)
    for p in range(n):
        ring[p] = p
        ref[p] = 0
        flags[p] = 0
        marks[p] = 0
    st[HP_HEAD] = 0
    st[HP_NFREE] = n
    st[HP_PINNED] = 0
    st[HP_CLEARS] += 1
    return n


@_callee()
def _answered(st: NDArray[np.int64], exhausted: int) -> None:
    st[HP_ALLOC_CALLS] += 1
    if exhausted != 0:
        st[HP_EXHAUSTED] += 1
    else:
        st[HP_PEAK] = max(st[HP_PEAK], st[HP_NPAGES] - st[HP_NFREE])


@_jit("i8(i8[::1])", nogil=False)
def host_reserve(st: NDArray[np.int64]) -> int:
    """Take the front page: return its id, or ``E_SHORT`` (counted) when none is free."""
    n: int = st[HP_NPAGES]
    if st[HP_NFREE] == 0:
        _answered(st, 1)
        return fail(E_SHORT, 0)
    head: int = st[HP_HEAD]
    p: int = host_ring(st)[head]
    flags = host_flags(st)
    if p < 0 or p >= n or flags[p] != 0:
        return fail(E_CORRUPT, 0)
    flags[p] = 1
    host_gens(st)[p] += 1
    st[HP_HEAD] = head + 1 if head + 1 < n else 0
    st[HP_NFREE] -= 1
    _answered(st, 0)
    return p


@_jit("i8(i8[::1], i8[::1])")
def host_alloc(st: NDArray[np.int64], out: NDArray[np.int64]) -> int:
    """Take the ``len(out)`` front pages into ``out``, or ``E_SHORT`` (counted) when fewer are free.

    The ring is read and checked first, then written: ``E_CORRUPT`` (a listed
    page not free) changes nothing. O(len(out)), whatever the pool's size.
    """
    n: int = st[HP_NPAGES]
    k: int = out.shape[0]
    if k > st[HP_NFREE]:
        _answered(st, 1)
        return fail(E_SHORT, 0)
    ring = host_ring(st)
    flags = host_flags(st)
    gen = host_gens(st)
    head: int = st[HP_HEAD]
    pos = head
    for i in range(k):
        p = ring[pos]
        if p < 0 or p >= n or flags[p] != 0:
            return fail(E_CORRUPT, i)
        out[i] = p
        pos = pos + 1 if pos + 1 < n else 0
    for i in range(k):
        p = out[i]
        flags[p] = 1
        gen[p] += 1
    st[HP_HEAD] = pos
    st[HP_NFREE] -= k
    _answered(st, 0)
    return k


@_callee()
def _faulted(st: NDArray[np.int64], code: int, position: int, page: int, given: int) -> int:
    """Leave the fault in the scratch words; return the status."""
    st[HP_FAULT] = page
    st[HP_FAULT_GEN] = given
    return fail(code, position)


@_jit("i8(i8[::1], i8[::1], i8[::1], i8, i8[::1])")
def host_free(
    st: NDArray[np.int64], pages: NDArray[np.int64], gens: NDArray[np.int64], check: int, out: NDArray[np.int64]
) -> int:
    """Free ``pages`` (a page named again counts once); return how many pages were freed.

    Each entry is read once. In order: a page outside ``[0, n)`` is
    ``E_RANGE``, one not allocated ``E_NOT_ALLOCATED``, with ``check`` one
    whose generation is not ``gens[i]`` ``E_STALE`` (a repeat is checked
    too), a pinned one ``E_PINNED``; the position is the entry's. The pages
    that passed are staged behind the free list and marked; only when every
    entry has passed do they join the free list, in the order first named,
    and, when ``out`` has room for one per entry, are written to ``out``.
    """
    n: int = st[HP_NPAGES]
    m: int = pages.shape[0]
    ring = host_ring(st)
    flags = host_flags(st)
    marks = host_marks(st)
    gen = host_gens(st)
    ref = host_refs(st)
    tail: int = st[HP_HEAD] + st[HP_NFREE]
    if tail >= n:
        tail -= n
    pos = tail
    staged = 0
    status = 0
    for i in range(m):
        x = pages[i]
        if x < 0 or x >= n:
            status = _faulted(st, E_RANGE, i, x, 0)
            break
        given = gens[i] if check != 0 else 0
        if check != 0 and flags[x] != 0 and given != gen[x]:
            status = _faulted(st, E_STALE, i, x, given)
            break
        if marks[x] != 0:
            continue
        if flags[x] == 0:
            status = _faulted(st, E_NOT_ALLOCATED, i, x, given)
            break
        if ref[x] > 0:
            status = _faulted(st, E_PINNED, i, x, given)
            break
        marks[x] = 1
        ring[pos] = x
        pos = pos + 1 if pos + 1 < n else 0
        staged += 1
    listed = out.shape[0] >= m
    pos = tail
    for j in range(staged):
        p = ring[pos]
        marks[p] = 0
        if status == 0:
            flags[p] = 0
            if listed:
                out[j] = p
        pos = pos + 1 if pos + 1 < n else 0
    if status != 0:
        return status
    st[HP_NFREE] += staged
    if staged > 0:
        st[HP_FREE_CALLS] += 1
    return staged


@_jit("i8(i8[::1], i8, i8, i8)", nogil=False)
def host_release(st: NDArray[np.int64], page: int, given: int, check: int) -> int:
    """``host_free`` of one page, without an array: returns 1, or the same failures at position 0."""
    n: int = st[HP_NPAGES]
    if page < 0 or page >= n:
        return _faulted(st, E_RANGE, 0, page, 0)
    flags = host_flags(st)
    if flags[page] == 0:
        return _faulted(st, E_NOT_ALLOCATED, 0, page, given)
    if check != 0 and given != host_gens(st)[page]:
        return _faulted(st, E_STALE, 0, page, given)
    if host_refs(st)[page] > 0:
        return _faulted(st, E_PINNED, 0, page, given)
    tail: int = st[HP_HEAD] + st[HP_NFREE]
    host_ring(st)[tail - n if tail >= n else tail] = page
    flags[page] = 0
    st[HP_NFREE] += 1
    st[HP_FREE_CALLS] += 1
    return 1


@_callee()
def _pin_one(st: NDArray[np.int64], page: int, delta: int, position: int) -> int:
    n: int = st[HP_NPAGES]
    if page < 0 or page >= n:
        return _faulted(st, E_RANGE, position, page, 0)
    if host_flags(st)[page] == 0:
        return _faulted(st, E_NOT_ALLOCATED, position, page, 0)
    ref = host_refs(st)
    count: int = ref[page]
    if delta < 0 and count == 0:
        return _faulted(st, E_UNDERFLOW, position, page, 0)
    ref[page] = count + delta
    if count == 0:
        st[HP_PINNED] += 1
    elif count + delta == 0:
        st[HP_PINNED] -= 1
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


class HostKernels(NamedTuple):
    """The host page pool's kernels: what its classes call, through ``_kernels.jit.Entries``."""

    reset: Any
    reserve: Any
    alloc: Any
    free: Any
    release: Any
    pin1: Any
    pin: Any


KERNELS = HostKernels(host_reset, host_reserve, host_alloc, host_free, host_release, host_pin1, host_pin)
