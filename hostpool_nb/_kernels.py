"""Numba kernels that own every change to a pool's page state.

This module is the only place that touches the state arrays, and the only
place that uses numba. Kernels move integers and return status codes; they
never raise and never allocate Python objects, so the class in ``_pool.py``
can validate, lock, and turn a status code into the right exception.

State layout
------------
A pool of ``n`` pages of ``page_size`` slots keeps two arrays:

``st`` : int64, length ``HEADER + n``
    ``st[:HEADER]`` is a header of scalars (the ``H_*`` offsets below);
    ``st[HEADER:]`` is a ring of page ids. Starting at ring position
    ``st[H_HEAD]``, the next ``st[H_NFREE]`` entries are the free list and the
    ``st[H_NREL]`` entries after them are the release list (pages given back
    by ``free`` and not yet merged). The concatenation of the two is the FIFO
    order that allocation follows, as in the original pool, where merging
    appends released chunks after the remaining free slots.
``owner`` : uint8, length ``n``
    ``OWNER_ALLOCATED`` for a page a caller holds, ``OWNER_FREE`` for a page
    on the free or release list. ``OWNER_PENDING`` exists only inside
    ``free_pages`` while it validates a call.

Because a page is pushed on the ring only when ``owner`` says it was
allocated, the ring never holds a page twice and never overflows.

Status codes
------------
A kernel returns a value ``>= 0`` on success. A failure is encoded as
``-1 - (position << 4 | code)``, where ``code`` is one of the ``E_*``
constants and ``position`` is the offending index into the kernel's input
(0 when there is none); see :func:`decode_status`. On failure the state is
exactly as it was before the call.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Header offsets into ``st``.
H_HEAD = 0  # ring position of the first free page
H_NFREE = 1  # pages on the free list
H_NREL = 2  # pages on the release list (freed, not merged yet)
H_NPAGES = 3  # ring capacity: size // page_size
H_PAGE_SIZE = 4
H_MERGES = 5  # merges performed since construction
HEADER = 8  # header length; the spare slots keep room for later counters

OWNER_FREE = 0
OWNER_ALLOCATED = 1
OWNER_PENDING = 2

E_SHORT = 1  # fewer available pages than requested
E_RANGE = 2  # slot outside [0, size)
E_MISALIGNED = 3  # a page's first slot is not a multiple of page_size
E_PARTIAL = 4  # the slots after a page's first are not that page's, in order
E_NOT_ALLOCATED = 5  # page is free or released: double free / never allocated
E_DUPLICATE = 6  # page appears twice in one free call
E_CORRUPT = 7  # internal state is inconsistent (never through the public API)


def _jit(signature):
    """Compile a kernel: the one place that sets numba options.

    ``nogil`` lets other threads run while a kernel works (the pool's lock
    already serialises state changes); ``cache`` keeps start-up to a cache
    load. No ``fastmath``: this is integer code.
    """
    return njit(signature, nogil=True, cache=True)


def decode_status(status: int) -> tuple[int, int]:
    """Split a negative kernel status into ``(code, position)``."""
    err = -1 - int(status)
    return err & 15, err >> 4


@_jit("i8(i8, i8)")
def _fail(code, position):
    return -1 - ((position << 4) | code)


@_jit("i8(i8[::1], u1[::1])")
def reset(st, owner):
    """Make every page free, in ascending order, and empty the release list.

    Returns the number of free pages.
    """
    n = st[H_NPAGES]
    for p in range(n):
        st[HEADER + p] = p
        owner[p] = OWNER_FREE
    st[H_HEAD] = 0
    st[H_NFREE] = n
    st[H_NREL] = 0
    return n


@_jit("i8(i8[::1])")
def merge(st):
    """Fold the release list into the free list, after the free pages.

    The release list already sits right behind the free list on the ring, in
    the order it was freed, so merging moves a boundary and copies nothing.
    Returns the number of pages merged.
    """
    moved = st[H_NREL]
    if moved > 0:
        st[H_NFREE] += moved
        st[H_NREL] = 0
        st[H_MERGES] += 1
    return moved


@_jit("i8(i8[::1], u1[::1], i8[::1])")
def alloc_pages(st, owner, out):
    """Pop ``len(out) // page_size`` pages from the front of the free list.

    ``out`` (int64, caller-provided, length a multiple of ``page_size``)
    receives the slot ids ``p * page_size + 0 .. page_size - 1`` of each
    page ``p``, pages in FIFO order. Merges the release list first if the
    free list alone is too short. Returns ``len(out)``, or a failure
    (``E_SHORT``, ``E_CORRUPT``) with the state unchanged.
    """
    page_size = st[H_PAGE_SIZE]
    n = st[H_NPAGES]
    need = out.shape[0] // page_size
    if need == 0:
        return 0
    if need > st[H_NFREE] + st[H_NREL]:
        return _fail(E_SHORT, 0)
    head = st[H_HEAD]
    # Check every page before touching anything, so a corrupted state is
    # reported without being made worse. The release list follows the free
    # list on the ring, so this reads the pages a merge would provide too.
    pos = head
    for i in range(need):
        p = st[HEADER + pos]
        if p < 0 or p >= n or owner[p] != OWNER_FREE:
            return _fail(E_CORRUPT, i)
        pos += 1
        if pos == n:
            pos = 0
    if need > st[H_NFREE]:
        merge(st)
    pos = head
    for i in range(need):
        p = st[HEADER + pos]
        owner[p] = OWNER_ALLOCATED
        base = p * page_size
        k = i * page_size  # written as base + j so LLVM vectorises the fill
        for j in range(page_size):
            out[k + j] = base + j
        pos += 1
        if pos == n:
            pos = 0
    st[H_HEAD] = pos
    st[H_NFREE] -= need
    return need * page_size


@_jit("i8(i8[::1], u1[::1], i8[::1])")
def free_pages(st, owner, slots):
    """Validate ``slots`` as whole allocated pages, then release them.

    ``slots`` (int64, length a multiple of ``page_size``) is read in runs of
    ``page_size``; each run must be one page's slots in ascending order, of
    a page that is currently allocated and not named earlier in the call.
    Pages may come in any order; they are appended to the release list in
    the order given. Returns the number of slots released, or a failure
    (``E_RANGE``, ``E_MISALIGNED``, ``E_PARTIAL``, ``E_NOT_ALLOCATED``,
    ``E_DUPLICATE``) at the offending position, with the state unchanged.
    """
    page_size = st[H_PAGE_SIZE]
    n = st[H_NPAGES]
    size = n * page_size
    count = slots.shape[0] // page_size
    # Pass 1: validate, marking pages PENDING so a repeat within the call is
    # caught. On failure the marks are rolled back before returning.
    status = 0
    checked = 0
    for c in range(count):
        start = c * page_size
        first = slots[start]
        if first < 0 or first >= size:
            status = _fail(E_RANGE, start)
            break
        if first % page_size != 0:
            status = _fail(E_MISALIGNED, start)
            break
        # One branch-free pass per page (vectorised); the scan for the exact
        # position runs only when the page is already known to be wrong.
        bad = 0
        for j in range(page_size):
            bad |= slots[start + j] ^ (first + j)
        if bad != 0:
            for j in range(1, page_size):
                if slots[start + j] != first + j:
                    status = _fail(E_PARTIAL, start + j)
                    break
            break
        p = first // page_size
        if owner[p] == OWNER_PENDING:
            status = _fail(E_DUPLICATE, start)
            break
        if owner[p] != OWNER_ALLOCATED:
            status = _fail(E_NOT_ALLOCATED, start)
            break
        owner[p] = OWNER_PENDING
        checked += 1
    if status != 0:
        for c in range(checked):
            owner[slots[c * page_size] // page_size] = OWNER_ALLOCATED
        return status
    # Pass 2: commit. Each page was allocated, so the ring has room for it.
    tail = st[H_HEAD] + st[H_NFREE] + st[H_NREL]
    if tail >= n:
        tail -= n
    for c in range(count):
        p = slots[c * page_size] // page_size
        owner[p] = OWNER_FREE
        st[HEADER + tail] = p
        tail += 1
        if tail == n:
            tail = 0
    st[H_NREL] += count
    return count * page_size


def entry_point(kernel):
    """Return the fastest callable for a kernel compiled from one signature.

    numba's dispatcher resolves argument types on every call, which costs
    more than a small kernel's work. The compiled entry point skips that, but
    it trusts its arguments: callers must pass exactly the signature's types
    (C-contiguous int64/uint8 arrays), which ``_pool.py`` guarantees. Falls
    back to the dispatcher itself when numba offers no single entry point,
    and to the plain function under ``NUMBA_DISABLE_JIT=1``.
    """
    overloads = getattr(kernel, "overloads", None)
    if not overloads or len(overloads) != 1:
        return kernel
    (compiled,) = overloads.values()
    return getattr(compiled, "entry_point", kernel)
