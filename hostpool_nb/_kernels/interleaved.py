"""Numba kernels of ``InterleavedPagePool``: every change to an interleaved pool's state.

The layout is in ``_kernels/layout.py`` (``IP_*``). Kernels validate before
they write and never raise; a failed call leaves the state as it was.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .jit import callee as _callee
from .jit import kernel as _jit
from .layout import (
    E_DUPLICATE,
    E_LENGTH,
    E_MISALIGNED,
    E_NOT_ALLOCATED,
    E_PARTIAL,
    E_RANGE,
    E_SHORT,
    IP_ALLOC_CALLS,
    IP_CLASSES,
    IP_CLEARS,
    IP_EXHAUSTED,
    IP_FREE,
    IP_FREE_CALLS,
    IP_HELD,
    IP_HELD_PAGE,
    IP_MIN,
    IP_PAGE_SIZE,
    IP_PEAK,
    IP_PER_CLASS,
    IP_RESERVED,
    IP_STAGED,
    fail,
    ip_counts,
    ip_stacks,
    ip_states,
)

I64 = NDArray[np.int64]


@_callee()
def _fewest(counts: I64) -> int:
    least: int = counts[0]
    for c in range(1, counts.shape[0]):
        least = min(least, counts[c])
    return least


@_jit("i8(i8[::1])", nogil=False)
def reset(st: I64) -> int:
    """Every page free: class ``r`` lists ``N + r, 2N + r, ...`` from its front; counters kept."""
    n: int = st[IP_CLASSES]
    per: int = st[IP_PER_CLASS]
    counts = ip_counts(st)
    stacks = ip_stacks(st)
    states = ip_states(st)
    for r in range(n):
        counts[r] = per
        for k in range(per):  # the top of the stack is the front of the list
            stacks[r * per + k] = n * (per - k) + r
        states[r] = IP_RESERVED
    for p in range(n, states.shape[0]):
        states[p] = IP_FREE
    st[IP_MIN] = per
    st[IP_HELD] = 0
    st[IP_CLEARS] += 1
    return 0


@_jit("i8(i8[::1], i8[::1], i8)", nogil=False)
def alloc(st: I64, out: I64, start: int) -> int:
    """``out.shape[0] // page_size`` pages, page ``j`` from class ``(start + j) % N``'s front, as slots into ``out``.

    ``E_SHORT`` (nothing taken) when some class has fewer free pages than
    its share of the cycle.
    """
    n: int = st[IP_CLASSES]
    per: int = st[IP_PER_CLASS]
    ps: int = st[IP_PAGE_SIZE]
    counts = ip_counts(st)
    stacks = ip_stacks(st)
    states = ip_states(st)
    pages = out.shape[0] // ps
    start = start % n
    st[IP_ALLOC_CALLS] += 1
    whole, rest = pages // n, pages % n
    for c in range(n):
        share = whole + (1 if (c - start) % n < rest else 0)
        if share > counts[c]:
            st[IP_EXHAUSTED] += 1
            return fail(E_SHORT, 0)
    c = start
    for j in range(pages):
        top = counts[c] - 1
        page = stacks[c * per + top]
        counts[c] = top
        states[page] = IP_HELD_PAGE
        first = page * ps
        for t in range(ps):
            out[j * ps + t] = first + t
        c = c + 1 if c + 1 < n else 0
    held: int = st[IP_HELD] + pages
    st[IP_HELD] = held
    st[IP_PEAK] = max(st[IP_PEAK], held)
    st[IP_MIN] = _fewest(counts)
    taken: int = pages * ps
    return taken


@_callee()
def _sort(a: I64, k: int) -> None:
    """``a[:k]`` ascending, in place (heapsort: no allocation, which kernels cannot make)."""
    for root in range(k // 2 - 1, -1, -1):
        _sift(a, root, k)
    for end in range(k - 1, 0, -1):
        a[0], a[end] = a[end], a[0]
        _sift(a, 0, end)


@_callee()
def _sift(a: I64, root: int, end: int) -> None:
    while True:
        child = 2 * root + 1
        if child >= end:
            return
        if child + 1 < end and a[child + 1] > a[child]:
            child += 1
        if a[root] >= a[child]:
            return
        a[root], a[child] = a[child], a[root]
        root = child


@_callee()
def _unstage(states: Any, scratch: I64, staged: int) -> None:
    for i in range(staged):
        states[scratch[i]] = IP_HELD_PAGE


@_jit("i8(i8[::1], i8[::1], i8[::1])", nogil=False)
def free(st: I64, slots: I64, scratch: I64) -> int:
    """Free whole pages: each class's freed pages, ascending, go to the front of its list.

    Every slot is checked first (whole pages, each in order; in range; held;
    not named twice); a failure is ``fail(code, position)`` and changes
    nothing. ``scratch`` holds at least as many words as pages freed.
    """
    n: int = st[IP_CLASSES]
    per: int = st[IP_PER_CLASS]
    ps: int = st[IP_PAGE_SIZE]
    counts = ip_counts(st)
    stacks = ip_stacks(st)
    states = ip_states(st)
    size = slots.shape[0]
    if size % ps != 0:
        return fail(E_LENGTH, size)
    pages = size // ps
    limit = states.shape[0] * ps
    for j in range(pages):
        at = j * ps
        first = slots[at]
        code = 0
        if first < 0 or first >= limit:
            code = E_RANGE
        elif first % ps != 0:
            code = E_MISALIGNED
        else:
            for t in range(1, ps):
                if slots[at + t] != first + t:
                    code, at = E_PARTIAL, at + t
                    break
        if code == 0:
            state = states[first // ps]
            if state == IP_STAGED:
                code = E_DUPLICATE
            elif state != IP_HELD_PAGE:
                code = E_NOT_ALLOCATED
        if code != 0:
            _unstage(states, scratch, j)
            return fail(code, at)
        states[first // ps] = IP_STAGED
        scratch[j] = first // ps
    _sort(scratch, pages)
    for i in range(pages - 1, -1, -1):  # the lowest page pushed last: the front of its class's list
        page = scratch[i]
        c = page % n
        stacks[c * per + counts[c]] = page
        counts[c] += 1
        states[page] = IP_FREE
    if pages > 0:
        st[IP_FREE_CALLS] += 1
    st[IP_HELD] -= pages
    st[IP_MIN] = _fewest(counts)
    freed: int = size
    return freed


class InterleavedKernels(NamedTuple):
    """An interleaved pool's kernels, for its class."""

    reset: Any
    alloc: Any
    free: Any


KERNELS = InterleavedKernels(reset, alloc, free)
