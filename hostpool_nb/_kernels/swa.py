"""Numba kernels of ``hostpool_nb.paged.SWATokenToKVPoolAllocator``: both sub-allocators and the mapping at once.

Each call of the sliding-window allocator is one kernel here: it runs the
sub-allocators' kernels (``_kernels/paged.py``, as callees) on the full
rank's state ``stf`` / ``gpf`` and the SWA rank's ``sts`` / ``gps``, and
updates ``mp``, the rank's int32 full-to-SWA mapping (0: no SWA slot), in
place. A refusal changes neither side but for the merges it makes; a
failed check changes nothing. ``scratch`` is the allocator's own int64
buffer, at least as long as the call's input (twice for ``free_swa``).

Each kernel is written once, calling the sub-allocators' kernels by the
names ``_alloc_tokens``, ``_free_slots``...: the plain ones
(``_kernels.paged.CALLEES[0]``). Its ``*_tracked`` variant is the same
code compiled with those names bound to the tracked ones (``CALLEES[1]``,
:data:`_TRACKED`), and records each side's pages under the sites it is
given; the plain kernels take the same arguments and ignore them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .jit import callee as _callee
from .jit import kernel as _jit
from .jit import variant as _variant
from .layout import E_CORRUPT, E_RANGE, E_SHORT, H_NFREE, H_NREL, fail
from .paged import CALLEES, I32, I64, _ceil_div, tracked

_alloc_tokens: Callable[..., int] = CALLEES[0].alloc_tokens
_alloc_slots: Callable[..., int] = CALLEES[0].alloc_slots
_alloc_extend: Callable[..., int] = CALLEES[0].alloc_extend
_alloc_decode: Callable[..., int] = CALLEES[0].alloc_decode
_free_slots: Callable[..., int] = CALLEES[0].free_slots
_reset_rank: Callable[..., int] = CALLEES[0].reset_rank
_end_group: Callable[..., int] = CALLEES[0].end_group


@_callee()
def _available(st: I64) -> int:
    """Pages an allocation can take: free and released."""
    n: int = st[H_NFREE] + st[H_NREL]
    return n


@_callee()
def _map_all(mp: I32, full: I32 | I64, swa: I32 | I64) -> None:
    for i in range(full.shape[0]):
        mp[full[i]] = swa[i]


@_jit("i8(i8[::1], i8[::1], i4[::1], i4[::1], i4[::1], i8, i8)")
def alloc_tokens(stf: I64, sts: I64, mp: I32, out: I32, swa: I32, site_full: int, site_swa: int) -> int:
    """``alloc`` at page size 1: ``len(out)`` full slots, as many SWA slots, mapped; both sides checked first."""
    n: int = out.shape[0]
    if n > _available(stf) or n > _available(sts):
        return fail(E_SHORT, 0)
    status = _alloc_tokens(stf, out, site_full)
    if status < 0:
        return status
    if _alloc_tokens(sts, swa, site_swa) < 0:
        return fail(E_CORRUPT, 0)  # checked above: the SWA side's lists are broken
    _map_all(mp, out, swa)
    return n


@_jit("i8(i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i8, i8)")
def alloc_pages(stf: I64, sts: I64, mp: I32, out: I64, swa: I64, page_size: int, site_full: int, site_swa: int) -> int:
    """``alloc`` above page size 1: whole pages on each side, slot by slot mapped; both sides checked first."""
    k = out.shape[0] // page_size
    if k > _available(stf) or k > _available(sts):
        return fail(E_SHORT, 0)
    status = _alloc_slots(stf, out, page_size, site_full)
    if status < 0:
        return status
    if _alloc_slots(sts, swa, page_size, site_swa) < 0:
        return fail(E_CORRUPT, 0)
    _map_all(mp, out, swa)
    n: int = out.shape[0]
    return n


@_callee()
def _mapped_last(mp: I32, last: I64, into: I64) -> int:
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


@_jit("i8(i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8[::1], i4[::1], i4[::1], i8[::1], i8, i8, i8[::1], i8[::1])")
def alloc_extend(
    stf: I64,
    sts: I64,
    mp: I32,
    prefix: I64,
    seq: I64,
    last: I64,
    out: I32,
    swa: I32,
    scratch: I64,
    tokens: int,
    page_size: int,
    sites_full: I64,
    sites_swa: I64,
) -> int:
    """``alloc_extend`` on the full side, then on the SWA side with the mapped ``last_loc``; the new slots mapped.

    When the full side could serve the new pages and the SWA side cannot,
    the call is refused after the SWA side's merge, the full side
    untouched (the original takes the full slots and frees them again).
    """
    last_swa = scratch[: seq.shape[0]]
    status = _mapped_last(mp, last, last_swa)
    if status < 0:
        return status
    pages = 0
    for i in range(seq.shape[0]):  # the pages the requests' extensions begin
        pages += _ceil_div(seq[i], page_size) - _ceil_div(prefix[i], page_size)
    if pages > _available(sts) and pages <= _available(stf):  # checks, merges, refuses
        return _alloc_extend(sts, prefix, seq, last_swa, swa, tokens, page_size, 0, sites_swa[:0])
    status = _alloc_extend(stf, prefix, seq, last, out, tokens, page_size, 0, sites_full)
    if status < 0:
        return status
    if _alloc_extend(sts, prefix, seq, last_swa, swa, tokens, page_size, 0, sites_swa) != status:
        return fail(E_CORRUPT, 0)  # the same checks passed and the pages are there: the SWA side is broken
    _map_all(mp, out[:status], swa[:status])
    return status


@_jit("i8(i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i4[::1], i4[::1], i8[::1], i8, i8[::1], i8[::1])")
def alloc_decode(
    stf: I64,
    sts: I64,
    mp: I32,
    seq: I64,
    last: I64,
    out: I32,
    swa: I32,
    scratch: I64,
    page_size: int,
    sites_full: I64,
    sites_swa: I64,
) -> int:
    """``alloc_decode`` on both sides as :func:`alloc_extend` does it."""
    last_swa = scratch[: seq.shape[0]]
    status = _mapped_last(mp, last, last_swa)
    if status < 0:
        return status
    pages = 0
    for s in seq:  # the requests whose new token starts a page
        pages += 1 if (s - 1) % page_size == 0 else 0
    if pages > _available(sts) and pages <= _available(stf):
        return _alloc_decode(sts, seq, last_swa, swa, page_size, 0, sites_swa[:0])
    status = _alloc_decode(stf, seq, last, out, page_size, 0, sites_full)
    if status < 0:
        return status
    if _alloc_decode(sts, seq, last_swa, swa, page_size, 0, sites_swa) != status:
        return fail(E_CORRUPT, 0)
    _map_all(mp, out, swa)
    return status


@_callee()
def _free_mapped(sts: I64, gps: I64, mp: I32, own: I64, scratch: I64, page_size: int, mode: int, site: int) -> int:
    """The SWA slots of the checked full slots ``own`` (those mapped) freed, their mapping zeroed; how many.

    One pass zeroes each mapping entry as it gathers the SWA slot. An SWA
    slot in the padding page (a request continued after its last token's
    SWA slot went: the original maps it from slot 0) is never freed: the
    original would list the padding page. Mapped SWA slots are allocated,
    once each: a refusal means the mapping is broken (``E_CORRUPT``, the
    allocator's state then reported corrupted, whatever this left).
    """
    j = 0
    for i in range(own.shape[0]):
        slot = own[i]
        v = mp[slot]
        mp[slot] = 0  # zeroed as gathered: one pass (a refusal below means the state is corrupt anyway)
        if v >= page_size:
            scratch[j] = v
            j += 1
    if j > 0 and _free_slots(sts, gps, scratch[:j], page_size, mode, 0, site) < 0:
        return fail(E_CORRUPT, 0)
    return j


@_jit("i8(i8[::1], i8[::1], i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i8, i8, i8, i8, i8)")
def free(
    stf: I64,
    gpf: I64,
    sts: I64,
    gps: I64,
    mp: I32,
    slots: I64,
    scratch: I64,
    page_size: int,
    full_mode: int,
    swa_mode: int,
    in_group: int,
    site_full: int,
    site_swa: int,
) -> int:
    """``free``: the full side frees ``slots`` (checked, as its ``free``), then their SWA slots go.

    ``slots`` is the allocator's own copy of the caller's array (made once,
    before the call: a memcpy, where a copy in the kernel measured slower):
    both sides read it, so a caller's thread writing its array meanwhile
    cannot make the SWA side index an unchecked slot. In a group only the
    full side's check runs and its pages become pending; the SWA slots go
    at the group's end (:func:`end_group`). Returns what the full side's
    free returns.
    """
    status = _free_slots(stf, gpf, slots, page_size, full_mode, in_group, site_full)
    if status < 0 or in_group != 0:
        return status
    freed = _free_mapped(sts, gps, mp, slots, scratch, page_size, swa_mode, site_swa)
    return freed if freed < 0 else status


@_jit("i8(i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i8, i8)")
def free_swa(sts: I64, gps: I64, mp: I32, slots: I64, scratch: I64, page_size: int, swa_mode: int, site: int) -> int:
    """``free_swa``: the SWA slots of the full slots ``slots`` freed, their mapping zeroed; how many.

    Each slot is read once, into ``scratch[n + i]`` (the slot an ``E_RANGE``
    at ``i`` refused, for a full slot outside the mapping), and checked
    before anything changes. ``scratch`` holds at least ``2n``.
    """
    n, m = slots.shape[0], mp.shape[0]
    own = scratch[n : 2 * n]
    for i in range(n):
        slot = slots[i]
        own[i] = slot
        if slot < 0 or slot >= m:
            return fail(E_RANGE, i)
    return _free_mapped(sts, gps, mp, own, scratch[:n], page_size, swa_mode, site)


@_jit("i8(i8[::1], i8[::1], i8[::1], i8[::1], i4[::1], i8[::1], i8[::1], i8, i8, i8)")
def end_group(
    stf: I64, gpf: I64, sts: I64, gps: I64, mp: I32, slots: I64, scratch: I64, page_size: int, swa_mode: int, site: int
) -> int:
    """The group's end on one rank: the full side's pending pages released, then the SWA slots of ``slots``.

    ``slots`` are the group's frees of the rank, concatenated in order;
    ``site`` >= 0 (a tracking allocator): the SWA pages freed record it.
    One kernel for both (a group's end is rare: no twin to compile).
    """
    _end_group(stf, gpf)
    if site < 0:
        return _free_mapped(sts, gps, mp, slots, scratch, page_size, swa_mode, site)
    return _free_mapped_tracked(sts, gps, mp, slots, scratch, page_size, swa_mode, site)


@_jit("i8(i8[::1], i8[::1], i8[::1], i8[::1], i4[::1])")
def reset(stf: I64, gpf: I64, sts: I64, gps: I64, mp: I32) -> int:
    """``clear`` of one rank: both sides reset, the mapping zeroed."""
    _reset_rank(stf, gpf)
    _reset_rank(sts, gps)
    mp[:] = 0
    return 0


# The tracked variants: the same code, the sub-allocators' kernels (and this module's callee that calls
# them) bound to their tracked variants.
_TRACKED = {f"_{name}": k for name, k in CALLEES[1]._asdict().items()}
_free_mapped_tracked = _variant(_free_mapped, name="_free_mapped_tracked", constants=_TRACKED)
_TRACKED["_free_mapped"] = _free_mapped_tracked


class SWAKernels(NamedTuple):
    """The sliding-window allocator's kernels in one variant: ``KERNELS[tracked]``, for its class."""

    alloc_tokens: Any
    alloc_pages: Any
    alloc_extend: Any
    alloc_decode: Any
    free: Any
    free_swa: Any
    end_group: Any
    reset: Any


_PLAIN = SWAKernels(alloc_tokens, alloc_pages, alloc_extend, alloc_decode, free, free_swa, end_group, reset)
# end_group and reset serve both: a group's end chooses at run time, a reset tracks nothing.
KERNELS = (_PLAIN, _PLAIN._replace(**{f: tracked(getattr(_PLAIN, f), _TRACKED) for f in _PLAIN._fields[:6]}))
