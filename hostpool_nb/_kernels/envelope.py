"""Numba kernels of ``EnvelopePagePool``: every change to a page-envelope pool's state.

The layout is in ``_kernels/layout.py`` (``EV_*``, ``S_*``). Kernels
validate before they write and never raise; a failed call leaves the state
as it was.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .jit import callee as _callee
from .jit import kernel as _jit
from .jit import trailing_zeros
from .layout import (
    E_COMPACT_FIRST,
    E_DUPLICATE,
    E_LENGTH,
    E_MISALIGNED,
    E_NOT_ALLOCATED,
    E_PARTIAL,
    E_RANGE,
    E_SHORT,
    EV_ALLOC_CALLS,
    EV_ALLOCATABLE,
    EV_BITS,
    EV_CLEARS,
    EV_COMPACTIONS,
    EV_EXHAUSTED,
    EV_FREE_CALLS,
    EV_HEADER,
    EV_SIDE_WORDS,
    EV_SIDES,
    S_BASE,
    S_DOWN,
    S_FREE,
    S_HOLES,
    S_LIVE,
    S_LOW_FREE,
    S_LOW_HOLE,
    S_MARK,
    S_PAGE_BYTES,
    S_PAGE_NUM,
    S_PAGE_SIZE,
    fail,
)

I64 = NDArray[np.int64]


@_callee()
def _block(s: int) -> int:
    return EV_HEADER + s * EV_SIDE_WORDS


@_callee()
def _bitmap_words(n: int) -> int:
    return (n + EV_BITS - 1) // EV_BITS


@_callee()
def _set_bit(st: I64, at: int, i: int) -> None:
    w = at + i // EV_BITS
    st[w] = st[w] | (1 << (i % EV_BITS))


@_callee()
def _clear_bit(st: I64, at: int, i: int) -> None:
    w = at + i // EV_BITS
    st[w] = st[w] & ~(1 << (i % EV_BITS))


@_callee()
def _has_bit(st: I64, at: int, i: int) -> bool:
    bit: bool = (st[at + i // EV_BITS] >> (i % EV_BITS)) & 1 == 1
    return bit


@_callee()
def _take_lowest(st: I64, at: int, b: int, hint: int) -> int:
    """Clear and return the lowest set bit of the bitmap at ``at`` (one is set), from word ``st[b + hint]`` on."""
    w: int = st[b + hint]
    while st[at + w] == 0:
        w += 1
    word: int = st[at + w]
    bit = trailing_zeros(word)
    st[at + w] = word & (word - 1)
    st[b + hint] = w
    return w * EV_BITS + bit


@_callee()
def _gap(st: I64) -> int:
    """Bytes between the side growing up and the side growing down (or the envelope's end)."""
    low = 0
    high: int = st[EV_ALLOCATABLE]
    for s in range(st[EV_SIDES]):
        b = _block(s)
        if st[b + S_DOWN] == 0:
            low = st[b + S_MARK] * st[b + S_PAGE_BYTES]
        else:
            high = (st[b + S_PAGE_NUM] - st[b + S_MARK]) * st[b + S_PAGE_BYTES]
    return max(0, high - low)


@_callee()
def _plan(st: I64, requests: I64) -> int:
    """0: the requests' pages fit as the sides lie; 1: once compacted; 2: not at all."""
    extension = 0
    used = 0
    for s in range(st[EV_SIDES]):
        b = _block(s)
        pages = 0
        for i in range(0, requests.shape[0], 2):
            if requests[i] == s:
                pages += requests[i + 1]
        if pages > st[b + S_FREE]:
            return 2
        extension += max(0, pages - st[b + S_HOLES]) * st[b + S_PAGE_BYTES]
        used += (st[b + S_LIVE] + pages) * st[b + S_PAGE_BYTES]
    if extension <= _gap(st):
        return 0
    return 1 if used <= st[EV_ALLOCATABLE] else 2


@_jit("i8(i8[::1], i8)", nogil=False)
def reset_side(st: I64, s: int) -> int:
    """Side ``s`` empty: every logical page free, no hole, its mark at its end."""
    b = _block(s)
    n: int = st[b + S_PAGE_NUM]
    base: int = st[b + S_BASE]
    for i in range(2 * n):
        st[base + i] = -1
    words = _bitmap_words(n)
    lbits = base + 2 * n
    for w in range(words):
        st[lbits + w] = (1 << EV_BITS) - 1
        st[lbits + words + w] = 0
    tail = n - (words - 1) * EV_BITS  # bits of the last word that are pages
    st[lbits + words - 1] = ((1 << EV_BITS) - 1) >> (EV_BITS - tail)
    st[b + S_MARK] = 0
    st[b + S_LIVE] = 0
    st[b + S_FREE] = n
    st[b + S_HOLES] = 0
    st[b + S_LOW_FREE] = 0
    st[b + S_LOW_HOLE] = 0
    st[EV_CLEARS] += 1
    return 0


@_jit("i8(i8[::1], i8[::1], i8[::1])", nogil=False)
def alloc(st: I64, requests: I64, out: I64) -> int:
    """Request ``i``: ``requests[2i + 1]`` pages of side ``requests[2i]``, their slots into ``out`` in order.

    Logical pages lowest first; physical pages the side's holes nearest its
    end first, then from its mark. ``E_SHORT`` when they cannot fit,
    ``E_COMPACT_FIRST`` when they fit only once compacted (nothing changed
    by either).
    """
    plan = _plan(st, requests)
    if plan == 2:  # noqa: PLR2004 - _plan's "not at all"
        st[EV_ALLOC_CALLS] += 1
        st[EV_EXHAUSTED] += 1
        return fail(E_SHORT, 0)
    if plan == 1:
        return fail(E_COMPACT_FIRST, 0)
    st[EV_ALLOC_CALLS] += 1
    at = 0
    for i in range(0, requests.shape[0], 2):
        b = _block(requests[i])
        ps: int = st[b + S_PAGE_SIZE]
        n: int = st[b + S_PAGE_NUM]
        base: int = st[b + S_BASE]
        lbits = base + 2 * n
        hbits = lbits + _bitmap_words(n)
        pages = requests[i + 1]
        for _ in range(pages):
            logical = _take_lowest(st, lbits, b, S_LOW_FREE)
            if st[b + S_HOLES] > 0:
                d = _take_lowest(st, hbits, b, S_LOW_HOLE)
                st[b + S_HOLES] -= 1
            else:
                d = st[b + S_MARK]
                st[b + S_MARK] = d + 1
            st[base + logical] = d
            st[base + n + d] = logical
            first = logical * ps
            for t in range(ps):
                out[at + t] = first + t
            at += ps
        st[b + S_LIVE] += pages
        st[b + S_FREE] -= pages
    return at


@_jit("i8(i8[::1], i8[::1])", nogil=False)
def compact(st: I64, moves: I64) -> int:
    """Each side's live pages packed towards its end, in order; each page moved listed as ``(side, from, to)``.

    ``moves`` holds three words for every live page; the count of moves is
    returned, with physical page ids (not distances).
    """
    count = 0
    for s in range(st[EV_SIDES]):
        b = _block(s)
        n: int = st[b + S_PAGE_NUM]
        base: int = st[b + S_BASE]
        down: int = st[b + S_DOWN]
        k = 0
        for d in range(st[b + S_MARK]):
            logical: int = st[base + n + d]
            if logical < 0:
                continue
            if d != k:
                st[base + n + k] = logical
                st[base + n + d] = -1
                st[base + logical] = k
                moves[3 * count] = s
                moves[3 * count + 1] = n - 1 - d if down else d
                moves[3 * count + 2] = n - 1 - k if down else k
                count += 1
            k += 1
        hbits = base + 2 * n + _bitmap_words(n)
        for w in range(_bitmap_words(n)):
            st[hbits + w] = 0
        st[b + S_MARK] = k
        st[b + S_HOLES] = 0
        st[b + S_LOW_HOLE] = 0
    st[EV_COMPACTIONS] += 1
    return count


@_callee()
def _check_pages(st: I64, b: int, slots: I64, scratch: I64, staging: bool) -> int:
    """Whole pages of side ``b``, in range and live (and, when ``staging``, each once: marked, and each page's
    logical id and distance kept in ``scratch[2j]``, ``scratch[2j + 1]``); 0, or a failure with every mark undone.

    Each slot is read once: a caller's thread writing its array meanwhile cannot make a page pass unchecked.
    """
    ps: int = st[b + S_PAGE_SIZE]
    n: int = st[b + S_PAGE_NUM]
    base: int = st[b + S_BASE]
    size = slots.shape[0]
    if size % ps != 0:
        return fail(E_LENGTH, size)
    code = 0
    at = 0
    staged = 0
    for j in range(size // ps):
        at = j * ps
        first = slots[at]
        if first < 0 or first >= n * ps:
            code = E_RANGE
        elif first % ps != 0:
            code = E_MISALIGNED
        else:
            for t in range(1, ps):
                if slots[at + t] != first + t:
                    code, at = E_PARTIAL, at + t
                    break
        if code == 0:
            d: int = st[base + first // ps]
            if d < -1:
                code = E_DUPLICATE
            elif d == -1:
                code = E_NOT_ALLOCATED
            elif staging:
                scratch[2 * j] = first // ps
                scratch[2 * j + 1] = d
                st[base + first // ps] = -2 - d
                staged += 1
        if code != 0:
            break
    for j in range(staged):  # the marks undone (a free then applies what scratch kept)
        st[base + scratch[2 * j]] = scratch[2 * j + 1]
    return fail(code, at) if code != 0 else 0


@_jit("i8(i8[::1], i8, i8[::1], i8[::1])", nogil=False)
def free(st: I64, s: int, slots: I64, scratch: I64) -> int:
    """Free whole pages of side ``s``: each physical page becomes a hole, then the holes at the mark are given up.

    Every slot is checked first, and read once; a failure is
    ``fail(code, position)`` and changes nothing. ``scratch`` holds two
    words for each page freed.
    """
    b = _block(s)
    status = _check_pages(st, b, slots, scratch, True)
    if status != 0:
        return status
    ps: int = st[b + S_PAGE_SIZE]
    n: int = st[b + S_PAGE_NUM]
    base: int = st[b + S_BASE]
    lbits = base + 2 * n
    hbits = lbits + _bitmap_words(n)
    pages = slots.shape[0] // ps
    for j in range(pages):
        logical = scratch[2 * j]
        d = scratch[2 * j + 1]
        st[base + logical] = -1
        st[base + n + d] = -1
        _set_bit(st, lbits, logical)
        _set_bit(st, hbits, d)
        st[b + S_LOW_FREE] = min(st[b + S_LOW_FREE], logical // EV_BITS)
        st[b + S_LOW_HOLE] = min(st[b + S_LOW_HOLE], d // EV_BITS)
    st[b + S_LIVE] -= pages
    st[b + S_FREE] += pages
    st[b + S_HOLES] += pages
    mark: int = st[b + S_MARK]
    while mark > 0 and _has_bit(st, hbits, mark - 1):  # holes at the mark give their bytes back to the gap
        mark -= 1
        _clear_bit(st, hbits, mark)
        st[b + S_HOLES] -= 1
    st[b + S_MARK] = mark
    if pages > 0:
        st[EV_FREE_CALLS] += 1
    freed: int = slots.shape[0]
    return freed


@_jit("i8(i8[::1], i8, i8[::1], i8[::1])", nogil=False)
def translate(st: I64, s: int, slots: I64, out: I64) -> int:
    """Each slot's physical slot into ``out``: whole pages of side ``s``, each live (checked first)."""
    b = _block(s)
    status = _check_pages(st, b, slots, out, False)
    if status != 0:
        return status
    ps: int = st[b + S_PAGE_SIZE]
    n: int = st[b + S_PAGE_NUM]
    base: int = st[b + S_BASE]
    down: int = st[b + S_DOWN]
    for i in range(slots.shape[0]):
        d = st[base + slots[i] // ps]
        out[i] = (n - 1 - d if down else d) * ps + slots[i] % ps
    done: int = slots.shape[0]
    return done


class EnvelopeKernels(NamedTuple):
    """A page-envelope pool's kernels, for its class."""

    reset_side: Any
    alloc: Any
    compact: Any
    free: Any
    translate: Any


KERNELS = EnvelopeKernels(reset_side, alloc, compact, free, translate)
