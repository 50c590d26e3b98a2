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
    _alloc_decode_tracked,
    _alloc_extend,
    _alloc_extend_tracked,
    _alloc_slots,
    _alloc_slots_tracked,
    _alloc_tokens,
    _alloc_tokens_tracked,
    _ceil_div,
    _end_group,
    _free_slots,
    _free_slots_tracked,
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


@_callee()
def _tokens(
    stf: NDArray[np.int64],
    sts: NDArray[np.int64],
    mp: NDArray[np.int32],
    out: NDArray[np.int32],
    swa: NDArray[np.int32],
    site_full: int,
    site_swa: int,
) -> int:
    """:func:`alloc_tokens`; ``site_full`` / ``site_swa`` >= 0: each side's slots record that site."""
    n: int = out.shape[0]
    if n > _available(stf) or n > _available(sts):
        return fail(E_SHORT, 0)
    status = _alloc_tokens(stf, out) if site_full < 0 else _alloc_tokens_tracked(stf, out, site_full)
    if status < 0:
        return status
    status = _alloc_tokens(sts, swa) if site_swa < 0 else _alloc_tokens_tracked(sts, swa, site_swa)
    if status < 0:
        return fail(E_CORRUPT, 0)  # checked above: the SWA side's lists are broken
    _map_all(mp, out, swa)
    return n


@_jit("i8(i8[::1], i8[::1], i4[::1], i4[::1], i4[::1])")
def alloc_tokens(
    stf: NDArray[np.int64],
    sts: NDArray[np.int64],
    mp: NDArray[np.int32],
    out: NDArray[np.int32],
    swa: NDArray[np.int32],
) -> int:
    """``alloc`` at page size 1: ``len(out)`` full slots, as many SWA slots, mapped; both sides checked first."""
    return _tokens(stf, sts, mp, out, swa, -1, -1)


@_jit("i8(i8[::1], i8[::1], i4[::1], i4[::1], i4[::1], i8, i8)")
def alloc_tokens_tracked(
    stf: NDArray[np.int64],
    sts: NDArray[np.int64],
    mp: NDArray[np.int32],
    out: NDArray[np.int32],
    swa: NDArray[np.int32],
    site_full: int,
    site_swa: int,
) -> int:
    """:func:`alloc_tokens` of a tracking allocator: one allocation on each side, from its site."""
    return _tokens(stf, sts, mp, out, swa, site_full, site_swa)


@_callee()
def _slots_side(st: NDArray[np.int64], out: NDArray[np.int64], page_size: int, site: int) -> int:
    """One side's whole pages into ``out``; ``site`` >= 0: tracked."""
    if site < 0:
        return _alloc_slots(st, out, page_size)
    return _alloc_slots_tracked(st, out, page_size, site)


@_callee()
def _pages(
    stf: NDArray[np.int64],
    sts: NDArray[np.int64],
    mp: NDArray[np.int32],
    out: NDArray[np.int64],
    swa: NDArray[np.int64],
    page_size: int,
    site_full: int,
    site_swa: int,
) -> int:
    """:func:`alloc_pages`, tracked on the sides whose site is >= 0."""
    k = out.shape[0] // page_size
    if k > _available(stf) or k > _available(sts):
        return fail(E_SHORT, 0)
    status = _slots_side(stf, out, page_size, site_full)
    if status < 0:
        return status
    status = _slots_side(sts, swa, page_size, site_swa)
    if status < 0:
        return fail(E_CORRUPT, 0)
    _map_all(mp, out, swa)
    n: int = out.shape[0]
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
    return _pages(stf, sts, mp, out, swa, page_size, -1, -1)


@_jit("i8(i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i8, i8)")
def alloc_pages_tracked(
    stf: NDArray[np.int64],
    sts: NDArray[np.int64],
    mp: NDArray[np.int32],
    out: NDArray[np.int64],
    swa: NDArray[np.int64],
    page_size: int,
    site_full: int,
    site_swa: int,
) -> int:
    """:func:`alloc_pages` of a tracking allocator."""
    return _pages(stf, sts, mp, out, swa, page_size, site_full, site_swa)


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


@_callee()
def _extend_side(
    st: NDArray[np.int64],
    prefix: NDArray[np.int64],
    seq: NDArray[np.int64],
    last: NDArray[np.int64],
    out: NDArray[np.int32],
    tokens: int,
    page_size: int,
    sites: NDArray[np.int64],
) -> int:
    """One side's ``alloc_extend``; with ``sites`` (not empty), tracked."""
    if sites.shape[0] == 0:
        return _alloc_extend(st, prefix, seq, last, out, tokens, page_size, 0)
    return _alloc_extend_tracked(st, prefix, seq, last, out, tokens, page_size, 0, sites)


@_callee()
def _extend(
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
    sites_full: NDArray[np.int64],
    sites_swa: NDArray[np.int64],
) -> int:
    """:func:`alloc_extend`; each side tracked when its sites are given."""
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
    status = _extend_side(stf, prefix, seq, last, out, tokens, page_size, sites_full)
    if status < 0:
        return status
    got = _extend_side(sts, prefix, seq, last_swa, swa, tokens, page_size, sites_swa)
    if got != status:
        return fail(E_CORRUPT, 0)  # the same checks passed and the pages are there: the SWA side is broken
    _map_all(mp, out[:status], swa[:status])
    return status


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
    none = scratch[:0]
    return _extend(stf, sts, mp, prefix, seq, last, out, swa, scratch, tokens, page_size, none, none)


@_jit("i8(i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8[::1], i4[::1], i4[::1], i8[::1], i8, i8, i8[::1], i8[::1])")
def alloc_extend_tracked(
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
    sites_full: NDArray[np.int64],
    sites_swa: NDArray[np.int64],
) -> int:
    """:func:`alloc_extend` of a tracking allocator: each request that takes pages one allocation a side."""
    return _extend(stf, sts, mp, prefix, seq, last, out, swa, scratch, tokens, page_size, sites_full, sites_swa)


@_callee()
def _decode_side(
    st: NDArray[np.int64],
    seq: NDArray[np.int64],
    last: NDArray[np.int64],
    out: NDArray[np.int32],
    page_size: int,
    sites: NDArray[np.int64],
) -> int:
    """One side's ``alloc_decode``; with ``sites`` (not empty), tracked."""
    if sites.shape[0] == 0:
        return _alloc_decode(st, seq, last, out, page_size, 0)
    return _alloc_decode_tracked(st, seq, last, out, page_size, 0, sites)


@_callee()
def _decode(
    stf: NDArray[np.int64],
    sts: NDArray[np.int64],
    mp: NDArray[np.int32],
    seq: NDArray[np.int64],
    last: NDArray[np.int64],
    out: NDArray[np.int32],
    swa: NDArray[np.int32],
    scratch: NDArray[np.int64],
    page_size: int,
    sites_full: NDArray[np.int64],
    sites_swa: NDArray[np.int64],
) -> int:
    """:func:`alloc_decode`; each side tracked when its sites are given."""
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
    status = _decode_side(stf, seq, last, out, page_size, sites_full)
    if status < 0:
        return status
    got = _decode_side(sts, seq, last_swa, swa, page_size, sites_swa)
    if got != status:
        return fail(E_CORRUPT, 0)
    _map_all(mp, out, swa)
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
    none = scratch[:0]
    return _decode(stf, sts, mp, seq, last, out, swa, scratch, page_size, none, none)


@_jit("i8(i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i4[::1], i4[::1], i8[::1], i8, i8[::1], i8[::1])")
def alloc_decode_tracked(
    stf: NDArray[np.int64],
    sts: NDArray[np.int64],
    mp: NDArray[np.int32],
    seq: NDArray[np.int64],
    last: NDArray[np.int64],
    out: NDArray[np.int32],
    swa: NDArray[np.int32],
    scratch: NDArray[np.int64],
    page_size: int,
    sites_full: NDArray[np.int64],
    sites_swa: NDArray[np.int64],
) -> int:
    """:func:`alloc_decode` of a tracking allocator."""
    return _decode(stf, sts, mp, seq, last, out, swa, scratch, page_size, sites_full, sites_swa)


@_callee()
def _free_side(
    st: NDArray[np.int64],
    gp: NDArray[np.int64],
    slots: NDArray[np.int64],
    page_size: int,
    mode: int,
    in_group: int,
    site: int,
) -> int:
    """One side's ``free``; ``site`` >= 0: the pages freed record it as their freer."""
    if site < 0:
        return _free_slots(st, gp, slots, page_size, mode, in_group)
    return _free_slots_tracked(st, gp, slots, page_size, mode, in_group, site)


@_callee()
def _free_mapped(
    sts: NDArray[np.int64],
    gps: NDArray[np.int64],
    mp: NDArray[np.int32],
    slots: NDArray[np.int64],
    scratch: NDArray[np.int64],
    page_size: int,
    mode: int,
    site: int,
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
        status = _free_side(sts, gps, scratch[:j], page_size, mode, 0, site)
        if status < 0:
            return fail(E_CORRUPT, 0)  # mapped SWA slots are allocated, once each: the mapping is broken
    for i in range(slots.shape[0]):
        mp[slots[i]] = 0
    return j


@_callee()
def _free(
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
    site_full: int,
    site_swa: int,
) -> int:
    """:func:`free`; each side's pages record its site as their freer when it is >= 0.

    ``slots`` is the allocator's own copy of the caller's array (made once,
    before the call): both sides read it, so a caller's thread writing its
    array meanwhile cannot make the SWA side index an unchecked slot.
    """
    status = _free_side(stf, gpf, slots, page_size, full_mode, in_group, site_full)
    if status < 0 or in_group != 0:
        return status
    freed = _free_mapped(sts, gps, mp, slots, scratch, page_size, swa_mode, site_swa)
    return freed if freed < 0 else status


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
    return _free(stf, gpf, sts, gps, mp, slots, scratch, page_size, full_mode, swa_mode, in_group, -1, -1)


@_jit("i8(i8[::1], i8[::1], i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i8, i8, i8, i8, i8)")
def free_tracked(
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
    site_full: int,
    site_swa: int,
) -> int:
    """:func:`free` of a tracking allocator."""
    return _free(stf, gpf, sts, gps, mp, slots, scratch, page_size, full_mode, swa_mode, in_group, site_full, site_swa)


@_callee()
def _free_swa(
    sts: NDArray[np.int64],
    gps: NDArray[np.int64],
    mp: NDArray[np.int32],
    slots: NDArray[np.int64],
    scratch: NDArray[np.int64],
    page_size: int,
    swa_mode: int,
    site: int,
) -> int:
    n, m = slots.shape[0], mp.shape[0]
    own = scratch[n : 2 * n]  # read once: the check and the frees see the same slots
    for i in range(n):
        own[i] = slots[i]
        if own[i] < 0 or own[i] >= m:
            return fail(E_RANGE, i)
    return _free_mapped(sts, gps, mp, own, scratch[:n], page_size, swa_mode, site)


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
    """``free_swa``: ``E_RANGE`` for a full slot outside the mapping (the slot as read is ``scratch[n + i]``),
    else :func:`_free_mapped`. ``scratch`` holds at least ``2n``."""
    return _free_swa(sts, gps, mp, slots, scratch, page_size, swa_mode, -1)


@_jit("i8(i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i8, i8)")
def free_swa_tracked(
    sts: NDArray[np.int64],
    gps: NDArray[np.int64],
    mp: NDArray[np.int32],
    slots: NDArray[np.int64],
    scratch: NDArray[np.int64],
    page_size: int,
    swa_mode: int,
    site: int,
) -> int:
    """:func:`free_swa` of a tracking allocator: the SWA pages freed record ``site``."""
    return _free_swa(sts, gps, mp, slots, scratch, page_size, swa_mode, site)


@_jit("i8(i8[::1], i8[::1], i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i8, i8)")
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
    site: int,
) -> int:
    """The group's end on one rank: the full side's pending pages released, then the SWA slots of ``slots``.

    ``slots`` are the group's frees of the rank, concatenated in order;
    ``site`` >= 0 (a tracking allocator): the SWA pages freed record it.
    """
    _end_group(stf, gpf)
    return _free_mapped(sts, gps, mp, slots, scratch, page_size, swa_mode, site)


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
