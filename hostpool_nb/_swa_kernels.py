"""Numba kernels of ``hostpool_nb.paged.SWATokenToKVPoolAllocator``: both sub-allocators and the mapping at once.

Each call of the sliding-window allocator is one kernel here: it runs the
sub-allocators' kernels (``_paged_kernels.py``, as callees) on the full
rank's state ``stf`` / ``gpf`` and the SWA rank's ``sts`` / ``gps``, and
updates ``mp``, the rank's int32 full-to-SWA mapping (0: no SWA slot), in
place. A refusal changes neither side but for the merges it makes; a
failed check changes nothing. ``scratch`` is the allocator's own int64
buffer, at least as long as the call's input.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ._jit import callee as _callee
from ._jit import kernel as _jit
from ._layout import E_CORRUPT, E_RANGE, E_SHORT, H_NFREE, H_NREL, fail
from ._paged_kernels import (
    _alloc_decode,
    _alloc_extend,
    _alloc_slots,
    _alloc_tokens,
    _ceil_div,
    _end_group,
    _free_slots,
    _reset_rank,
)


@_callee()
def _available(st: NDArray[np.int64]) -> int:
    """Pages an allocation can take: free and released."""
    n: int = st[H_NFREE] + st[H_NREL]
    return n


@_callee()
def _map_all(
    mp: NDArray[np.int32], full: NDArray[np.int32] | NDArray[np.int64], swa: NDArray[np.int32] | NDArray[np.int64]
) -> None:
    for i in range(full.shape[0]):
        mp[full[i]] = swa[i]


@_jit("i8(i8[::1], i8[::1], i4[::1], i4[::1], i4[::1])")
def alloc_tokens(
    stf: NDArray[np.int64],
    sts: NDArray[np.int64],
    mp: NDArray[np.int32],
    out: NDArray[np.int32],
    swa: NDArray[np.int32],
) -> int:
    """``alloc`` at page size 1: ``len(out)`` full slots, as many SWA slots, mapped; both sides checked first."""
    n: int = out.shape[0]
    if n > _available(stf) or n > _available(sts):
        return fail(E_SHORT, 0)
    status = _alloc_tokens(stf, out)
    if status < 0:
        return status
    status = _alloc_tokens(sts, swa)
    if status < 0:
        return fail(E_CORRUPT, 0)  # checked above: the SWA side's lists are broken
    _map_all(mp, out, swa)
    return n


@_jit("i8(i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8)")
def alloc_pages(
    stf: NDArray[np.int64],
    sts: NDArray[np.int64],
    mp: NDArray[np.int32],
    out: NDArray[np.int64],
    swa: NDArray[np.int64],
    page_size: int,
) -> int:
    """``alloc`` above page size 1: whole pages on each side, slot by slot mapped; both sides checked first."""
    k = out.shape[0] // page_size
    if k > _available(stf) or k > _available(sts):
        return fail(E_SHORT, 0)
    status = _alloc_slots(stf, out, page_size)
    if status < 0:
        return status
    status = _alloc_slots(sts, swa, page_size)
    if status < 0:
        return fail(E_CORRUPT, 0)
    _map_all(mp, out, swa)
    n: int = out.shape[0]
    return n


@_callee()
def _mapped_last(mp: NDArray[np.int32], last: NDArray[np.int64], into: NDArray[np.int64]) -> int:
    """``into[i] = mp[last[i]]`` (``last[i] == -1``: the mapping's last entry, as the original reads it).

    ``E_RANGE`` at ``i`` for a ``last_loc`` outside ``-1 .. len(mp) - 1``.
    """
    m = mp.shape[0]
    for i in range(last.shape[0]):
        if last[i] < -1 or last[i] >= m:
            return fail(E_RANGE, i)
    for i in range(last.shape[0]):
        into[i] = mp[last[i]] if last[i] >= 0 else mp[m - 1]
    return 0


@_jit("i8(i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8[::1], i4[::1], i4[::1], i8[::1], i8, i8)")
def alloc_extend(
    stf: NDArray[np.int64],
    sts: NDArray[np.int64],
    mp: NDArray[np.int32],
    prefix: NDArray[np.int64],
    seq: NDArray[np.int64],
    last: NDArray[np.int64],
    out: NDArray[np.int32],
    swa: NDArray[np.int32],
    scratch: NDArray[np.int64],
    tokens: int,
    page_size: int,
) -> int:
    """``alloc_extend`` on the full side, then on the SWA side with the mapped ``last_loc``; the new slots mapped.

    When the full side could serve the new pages and the SWA side cannot,
    the call is refused after the SWA side's merge, the full side
    untouched (the original takes the full slots and frees them again).
    """
    n = seq.shape[0]
    last_swa = scratch[:n]
    status = _mapped_last(mp, last, last_swa)
    if status < 0:
        return status
    pages = 0
    for i in range(n):
        pages += _ceil_div(seq[i], page_size) - _ceil_div(prefix[i], page_size)
    if pages > _available(sts) and pages <= _available(stf):
        return _alloc_extend(sts, prefix, seq, last_swa, swa, tokens, page_size, 0)  # checks, merges, refuses
    status = _alloc_extend(stf, prefix, seq, last, out, tokens, page_size, 0)
    if status < 0:
        return status
    got = _alloc_extend(sts, prefix, seq, last_swa, swa, tokens, page_size, 0)
    if got != status:
        return fail(E_CORRUPT, 0)  # the same checks passed and the pages are there: the SWA side is broken
    _map_all(mp, out[:status], swa[:status])
    return status


@_jit("i8(i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i4[::1], i4[::1], i8[::1], i8)")
def alloc_decode(
    stf: NDArray[np.int64],
    sts: NDArray[np.int64],
    mp: NDArray[np.int32],
    seq: NDArray[np.int64],
    last: NDArray[np.int64],
    out: NDArray[np.int32],
    swa: NDArray[np.int32],
    scratch: NDArray[np.int64],
    page_size: int,
) -> int:
    """``alloc_decode`` on both sides as :func:`alloc_extend` does it."""
    n = seq.shape[0]
    last_swa = scratch[:n]
    status = _mapped_last(mp, last, last_swa)
    if status < 0:
        return status
    pages = 0
    for i in range(n):
        pages += 1 if (seq[i] - 1) % page_size == 0 else 0
    if pages > _available(sts) and pages <= _available(stf):
        return _alloc_decode(sts, seq, last_swa, swa, page_size, 0)
    status = _alloc_decode(stf, seq, last, out, page_size, 0)
    if status < 0:
        return status
    got = _alloc_decode(sts, seq, last_swa, swa, page_size, 0)
    if got != status:
        return fail(E_CORRUPT, 0)
    _map_all(mp, out, swa)
    return status


@_callee()
def _free_mapped(
    sts: NDArray[np.int64],
    gps: NDArray[np.int64],
    mp: NDArray[np.int32],
    slots: NDArray[np.int64],
    scratch: NDArray[np.int64],
    page_size: int,
    mode: int,
) -> int:
    """``free_swa``: the SWA slots of ``slots`` (those mapped) freed, their mapping zeroed; how many.

    An SWA slot in the padding page (a request continued after its last
    token's SWA slot went: the original maps it from slot 0) is never
    freed: the original would list the padding page.
    """
    j = 0
    for i in range(slots.shape[0]):
        v = mp[slots[i]]
        if v >= page_size:
            scratch[j] = v
            j += 1
    if j > 0:
        status = _free_slots(sts, gps, scratch[:j], page_size, mode, 0)
        if status < 0:
            return fail(E_CORRUPT, 0)  # mapped SWA slots are allocated, once each: the mapping is broken
    for i in range(slots.shape[0]):
        mp[slots[i]] = 0
    return j


@_jit("i8(i8[::1], i8[::1], i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i8, i8, i8)")
def free(
    stf: NDArray[np.int64],
    gpf: NDArray[np.int64],
    sts: NDArray[np.int64],
    gps: NDArray[np.int64],
    mp: NDArray[np.int32],
    slots: NDArray[np.int64],
    scratch: NDArray[np.int64],
    page_size: int,
    full_mode: int,
    swa_mode: int,
    in_group: int,
) -> int:
    """``free``: the full side frees ``slots`` (checked, as its ``free``), then their SWA slots go.

    In a group only the full side's check runs and its pages become
    pending; the SWA slots go at the group's end (:func:`end_group`).
    Returns what the full side's free returns.
    """
    status = _free_slots(stf, gpf, slots, page_size, full_mode, in_group)
    if status < 0 or in_group != 0:
        return status
    freed = _free_mapped(sts, gps, mp, slots, scratch, page_size, swa_mode)
    return freed if freed < 0 else status


@_jit("i8(i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i8)")
def free_swa(
    sts: NDArray[np.int64],
    gps: NDArray[np.int64],
    mp: NDArray[np.int32],
    slots: NDArray[np.int64],
    scratch: NDArray[np.int64],
    page_size: int,
    swa_mode: int,
) -> int:
    """``free_swa``: ``E_RANGE`` for a full slot outside the mapping, else :func:`_free_mapped`."""
    m = mp.shape[0]
    for i in range(slots.shape[0]):
        if slots[i] < 0 or slots[i] >= m:
            return fail(E_RANGE, i)
    return _free_mapped(sts, gps, mp, slots, scratch, page_size, swa_mode)


@_jit("i8(i8[::1], i8[::1], i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i8)")
def end_group(
    stf: NDArray[np.int64],
    gpf: NDArray[np.int64],
    sts: NDArray[np.int64],
    gps: NDArray[np.int64],
    mp: NDArray[np.int32],
    slots: NDArray[np.int64],
    scratch: NDArray[np.int64],
    page_size: int,
    swa_mode: int,
) -> int:
    """The group's end on one rank: the full side's pending pages released, then the SWA slots of ``slots``.

    ``slots`` are the group's frees of the rank, concatenated in order.
    """
    _end_group(stf, gpf)
    return _free_mapped(sts, gps, mp, slots, scratch, page_size, swa_mode)


@_jit("i8(i8[::1], i8[::1], i8[::1], i8[::1], i4[::1])")
def reset(
    stf: NDArray[np.int64],
    gpf: NDArray[np.int64],
    sts: NDArray[np.int64],
    gps: NDArray[np.int64],
    mp: NDArray[np.int32],
) -> int:
    """``clear`` of one rank: both sides reset, the mapping zeroed."""
    _reset_rank(stf, gpf)
    _reset_rank(sts, gps)
    mp[:] = 0
    return 0
