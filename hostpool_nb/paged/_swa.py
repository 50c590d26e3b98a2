"""sglang-jax's sliding-window allocator: a full and an SWA side, one kernel per call for both and the mapping."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from .._convert import _INT64_MAX, as_count, as_int_vectors, as_slots, own_slots
from .._core.protocol import handed_off, unrecorded
from .._diagnostics.snapshot import SWAState
from .._diagnostics.tracking import wanted
from .._errors import AlignmentError, HostPoolError, SlotRangeError
from .._fork import register as _register_fork_lock
from .._kernels import layout as _layout
from .._kernels import paged as _paged_kernels
from .._kernels import swa as _swa_kernels
from .._kernels.jit import Entries
from ._allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from ._base import _CORE, _NONE, _STATUS_SHORT, BaseTokenToKVPoolAllocator, _BatchCalls, raise_unless_short
from ._swa_state import _SWAStateKeeping

_UNTRACKED, _NO_SITES = (-1, -1), (_NONE, _NONE)  # an untracked call's sites, no method call to get them
_SWA_KERNELS = tuple(Entries(kernels) for kernels in _swa_kernels.KERNELS)  # plain, tracked


class SWATokenToKVPoolAllocator(_BatchCalls, BaseTokenToKVPoolAllocator, _SWAStateKeeping):
    """sglang-jax's sliding-window allocator: a full and an SWA sub-allocator, and the mapping between them.

    For hybrid models that mix full and sliding-window attention: each
    token has a full slot and, while inside the window, an SWA slot.
    ``full_to_swa_index_mapping`` (int32, one array per rank when
    ``dp_size > 1``) gives each full slot's SWA slot, 0 for none; it is the
    same array object for the allocator's life, updated in place (the KV
    pool and the attention backend hold it). Each call is one kernel call
    for both sub-allocators and the mapping.

    As the original (docs/behaviour.md, section 3), for every call it handles: the
    sub-allocators are this module's token allocators at page size 1, else
    paged ones, on ``kvcache.full_kv_pool`` and ``kvcache.swa_kv_pool``;
    ``alloc`` checks both sides first; ``alloc_extend`` and
    ``alloc_decode`` allocate on both, the SWA side with the mapped
    ``last_loc``; ``free`` frees the full slots and their SWA slots;
    ``free_swa`` frees only the SWA slots (tokens that left the window).
    Above page size 1 both free whole pages while the mapping is per slot:
    the entries of a freed page's other slots stay, as in the original.
    Unlike the original: a full slot freed twice at page size 1, slots
    outside the ranks and batch arguments of different lengths are a
    :class:`HostPoolError` raised before anything changes; an
    ``alloc_extend`` or ``alloc_decode`` the SWA side cannot serve is
    refused without taking (and freeing again) the full side's pages;
    ``backup_state`` / ``restore_state`` work (the original raises
    ``NotImplementedError``). It does not pickle: the mapping's identity is
    what the KV pool and the backend rely on, and a copy would silently
    leave them reading a mapping no allocator updates.

    Parameters
    ----------
    size, size_swa : int
        Full and SWA token slots.
    kvcache : object
        The hybrid KV pool: ``full_kv_pool`` and ``swa_kv_pool`` are given
        to the sub-allocators, and ``full_to_swa_index_mapping`` is set to
        the mapping.
    page_size : int, optional
        Slots per page (1: token allocators).
    dp_size : int, optional
        Data-parallel ranks, each with both sides. A method's ``dp_rank``
        names one, in ``[0, dp_size)``; 0 by default.
    track : bool or None, optional, keyword-only
        Build both sub-allocators tracking: each side's pages know the call
        site and tag that allocated them (``tag=`` on :meth:`alloc`,
        ``tags=`` on the batch calls) and the site that last freed them.
        :meth:`outstanding` is the full side's (the SWA side's is
        ``swa_attn_allocator.outstanding()``), :meth:`leak_report` both
        sides', and a double free names both sites. ``None`` (the default):
        if ``HOSTPOOL_NB_TRACK=1`` is in the environment.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> from hostpool_nb.paged import SWATokenToKVPoolAllocator
    >>> kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    >>> a = SWATokenToKVPoolAllocator(size=64, size_swa=16, kvcache=kv)
    >>> full = a.alloc(3)
    >>> full, a.full_to_swa_index_mapping[full]
    (array([1, 2, 3], dtype=int32), array([1, 2, 3], dtype=int32))
    >>> a.free_swa(full[:1]), a.count_swa_mapped(full)  # the first left the window
    (1, 2)
    >>> a.free(full), a.available_size()
    (3, 16)
    """

    _kind = "SWATokenToKVPoolAllocator"

    def _kernel_calls(self) -> list[tuple[Any, str]]:
        """Its own kernels (the paged ones at page size > 1), and what its sides load and merge with."""
        paged = self.page_size > 1
        own = [n for n in self._k._kernels._fields if paged or n not in ("alloc_pages", "alloc_extend", "alloc_decode")]
        sides = self.full_attn_allocator._kernel_calls()
        return [(self._k, name) for name in own] + [(table, name) for table, name in sides if table is _CORE]

    _state_class = SWAState
    #: ``None``, as the original's (its base class's page lists, which the sub-allocators keep instead).
    free_pages: ClassVar[None] = None
    #: ``None``, as the original's (see :attr:`free_pages`).
    release_pages: ClassVar[None] = None

    def __init__(  # noqa: PLR0913 - sglang-jax's constructor, and track
        self, size: int, size_swa: int, kvcache: Any, page_size: int = 1, dp_size: int = 1, *, track: Any = None
    ) -> None:
        page_size = as_count(page_size, "page_size")
        track = wanted(track)
        full_pool, swa_pool = kvcache.full_kv_pool, kvcache.swa_kv_pool
        sub: Any
        with unrecorded():  # the sides are this allocator's: HOSTPOOL_NB_RECORD records it, not them
            if page_size == 1:
                self.full_attn_allocator: Any = TokenToKVPoolAllocator(size, full_pool, dp_size=dp_size, track=track)
                sub = TokenToKVPoolAllocator(size_swa, swa_pool, dp_size=dp_size, track=track)
                self._modes = (_paged_kernels.FREE_TOKENS, _paged_kernels.FREE_TOKENS)
            else:
                self.full_attn_allocator = PagedTokenToKVPoolAllocator(
                    size, page_size, full_pool, dp_size=dp_size, track=track
                )
                sub = PagedTokenToKVPoolAllocator(size_swa, page_size, swa_pool, dp_size=dp_size, track=track)
                self._modes = (_paged_kernels.FREE_PAGED, _paged_kernels.FREE_PAGED)
        self.swa_attn_allocator: Any = sub
        self.track = track
        self._k = _SWA_KERNELS[bool(track)]
        self.page_size = page_size
        self.dp_size = self.full_attn_allocator.dp_size
        self.size = self.full_attn_allocator.size  # the original's base class sets these two from the full side
        self.size_per_rank = self.full_attn_allocator.size_per_rank
        self._kvcache = kvcache
        self._recording = None  # an instance attribute, as the sub-allocators' (see _RankedAllocator)
        self.lock = self.full_attn_allocator.lock  # one lock for the three: each call holds both sides
        sub.lock = self.lock
        _register_fork_lock(self)
        length = self.full_attn_allocator.size_per_rank + page_size
        self._maps = [np.zeros(length, dtype=np.int32) for _ in range(self.dp_size)]
        self.full_to_swa_index_mapping: Any = self._maps[0] if self.dp_size == 1 else self._maps
        kvcache.full_to_swa_index_mapping = self.full_to_swa_index_mapping
        self._in_group = False
        self._group_frees = [[] for _ in range(self.dp_size)]
        self._scratch = np.zeros(max(64, page_size), dtype=np.int64)
        self._record_if_asked()

    # -- attributes and sizes --------------------------------------------------------

    def full_available_size(self, dp_rank: Any = 0) -> int:
        """The full sub-allocator's ``available_size(dp_rank)``."""
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.full_available_size(dp_rank)  # type: ignore[no-any-return]
        return int(self.full_attn_allocator.available_size(dp_rank))

    def swa_available_size(self, dp_rank: Any = 0) -> int:
        """The SWA sub-allocator's ``available_size(dp_rank)``."""
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.swa_available_size(dp_rank)  # type: ignore[no-any-return]
        return int(self.swa_attn_allocator.available_size(dp_rank))

    def available_size(self, dp_rank: Any = 0) -> int:
        """The smaller of the two sub-allocators' available sizes (read under the lock: both as of one moment)."""
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.available_size(dp_rank)  # type: ignore[no-any-return]
        with self.lock:
            full = self.full_attn_allocator.available_size(dp_rank)
            return min(full, self.swa_attn_allocator.available_size(dp_rank))  # type: ignore[no-any-return]

    @handed_off
    def merge_and_sort_free(self, dp_rank: Any = 0) -> None:
        """Merge each side's release list into its free list (page size > 1; at page size 1 nothing to merge).

        The original inherits its base class's method, which fails here with
        a ``TypeError`` (it keeps no lists of its own); the engine never
        calls it. This does what the name says, on both sub-allocators, in
        one hold of the lock.
        """
        r = self._rank(dp_rank)
        with self.lock:
            self.full_attn_allocator.merge_and_sort_free(r)
            self.swa_attn_allocator.merge_and_sort_free(r)

    def debug_print(self, dp_rank: Any = 0) -> str:
        """``"#swa-available-size: S, #full-attn-available-size: F, "``, as the original's."""
        with self.lock:
            swa, full = self.swa_available_size(dp_rank), self.full_available_size(dp_rank)
        return f"#swa-available-size: {swa}, #full-attn-available-size: {full}, "

    def _rank(self, dp_rank: Any) -> int:
        return int(self.full_attn_allocator._rank(dp_rank))

    def _states(self, r: int) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        full, swa = self.full_attn_allocator, self.swa_attn_allocator
        return full._st[r], full._gp[r], swa._st[r], swa._gp[r]

    def _scratch_for(self, n: int) -> NDArray[np.int64]:
        """The int64 buffer the kernels stage in, at least ``n`` long (grown, never per call). Under the lock."""
        if self._scratch.shape[0] < n:
            self._scratch = np.zeros(max(n, 2 * self._scratch.shape[0]), dtype=np.int64)
        return self._scratch

    # -- allocation -----------------------------------------------------------------------

    def _alloc(self, need_size: int, r: int, tag: Hashable) -> NDArray[Any] | None:
        """``alloc`` on both sides, mapped: the full slots."""
        ps = self.page_size
        if need_size < 0:
            raise HostPoolError(f"need_size must be non-negative, got need_size={need_size}")
        if need_size % ps != 0:
            raise AlignmentError(f"alloc must be page-aligned, got need_size={need_size}, page_size={ps}")
        if need_size > self.full_attn_allocator.size_per_rank + ps:
            return None  # more than a rank holds: refused before anything is allocated
        dtype = np.int32 if ps == 1 else np.int64
        where = self._where(r, tag)  # an unusable tag raises here
        out, swa = np.empty(need_size, dtype=dtype), np.empty(need_size, dtype=dtype)
        stf, _, sts, _ = self._states(r)
        with self.lock:
            sf, ss = _UNTRACKED if where is None else self._sites(r, where, tag)
            if ps == 1:
                status = self._k.alloc_tokens(stf, sts, self._maps[r], out, swa, sf, ss)
            else:
                status = self._k.alloc_pages(stf, sts, self._maps[r], out, swa, ps, sf, ss)
            if status < 0 and where is not None:
                self._failed(r)
        return out if status >= 0 else raise_unless_short(self, status)

    def _batch_args(self, lens: tuple[Any, ...], names: tuple[str, ...]) -> tuple[NDArray[np.int64], ...]:
        arrays = as_int_vectors(lens, names)
        if len({a.shape[0] for a in arrays}) != 1:
            got = ", ".join(str(a.shape[0]) for a in arrays)
            raise HostPoolError(f"{', '.join(names[:-1])} and {names[-1]} must have the same length, got {got}")
        return arrays

    def _needs_pages(self, op: str) -> None:
        if self.page_size == 1:
            raise self._paged_only(op)  # as the original's token sub-allocators raise

    def _refused(self, status: int, r: int, batch: tuple[NDArray[np.int64], ...], n: int, op: str) -> None:
        """A batch call the kernel did not serve: nothing if the ranks were short, else its error raised.

        ``batch`` is the call's per-request arrays, ``last_loc`` the last.
        """
        if status == _STATUS_SHORT:
            return
        code, i = _layout.decode_status(status)
        if code == _layout.E_RANGE:
            raise SlotRangeError(
                f"last_loc[{i}]={int(batch[-1][i])} is outside rank {r}'s full slots "
                f"(-1, or 0..{self._maps[r].shape[0] - 1})"
            )
        raise self.full_attn_allocator._batch_error(status, batch, n, op)

    def _extend(  # noqa: PLR0913, PLR0917 - alloc_extend's arguments, passed on as they came
        self, prefix_lens: Any, seq_lens: Any, last_loc: Any, extend_num_tokens: Any, dp_rank: Any, tags: Any
    ) -> NDArray[np.int32] | None:
        self._needs_pages("alloc_extend")
        prefix, seq, last = self._batch_args((prefix_lens, seq_lens, last_loc), ("prefix_lens", "seq_lens", "last_loc"))
        total = as_count(extend_num_tokens, "extend_num_tokens")
        r = self._rank(dp_rank)
        if total < 0:
            raise HostPoolError(f"extend_num_tokens must be non-negative, got extend_num_tokens={total}")
        ps = self.page_size
        fits = total <= (self.full_attn_allocator._pages + prefix.shape[0]) * ps
        keys = self._batch_keys(r, tags, prefix.shape[0])
        out = np.empty(total if fits else 0, dtype=np.int32)
        swa = np.empty(out.shape[0], dtype=np.int32)
        stf, _, sts, _ = self._states(r)
        mp = self._maps[r]
        with self.lock:
            scratch = self._scratch_for(prefix.shape[0])
            tokens = min(total, _INT64_MAX)
            sf, ss = _NO_SITES if keys is None else self._batch_sites(r, keys, tags)
            status = self._k.alloc_extend(stf, sts, mp, prefix, seq, last, out, swa, scratch, tokens, ps, sf, ss)
            if status < 0 and keys is not None:
                self._failed(r)
        if status >= 0:
            return out
        self._refused(status, r, (prefix, seq, last), total, "alloc_extend")
        return None

    def _decode(self, seq_lens: Any, last_loc: Any, dp_rank: Any, tags: Any) -> NDArray[np.int32] | None:
        self._needs_pages("alloc_decode")
        seq, last = self._batch_args((seq_lens, last_loc), ("seq_lens", "last_loc"))
        r = self._rank(dp_rank)
        keys = self._batch_keys(r, tags, seq.shape[0])
        out, swa = np.empty(seq.shape[0], dtype=np.int32), np.empty(seq.shape[0], dtype=np.int32)
        stf, _, sts, _ = self._states(r)
        mp, ps = self._maps[r], self.page_size
        with self.lock:
            scratch = self._scratch_for(seq.shape[0])
            sf, ss = _NO_SITES if keys is None else self._batch_sites(r, keys, tags)
            status = self._k.alloc_decode(stf, sts, mp, seq, last, out, swa, scratch, ps, sf, ss)
            if status < 0 and keys is not None:
                self._failed(r)
        if status >= 0:
            return out
        self._refused(status, r, (seq - 1, seq, last), seq.shape[0], "alloc_decode")
        return None

    # -- freeing ----------------------------------------------------------------------------

    def free(self, free_index: Any, dp_rank: Any = 0) -> int:
        """Free full slots and their SWA slots; in a free group, when it ends (checked now).

        Returns what the full sub-allocator's ``free`` returns (slots at
        page size 1, pages above). Page size 1: a slot not allocated is a
        :class:`DoubleFreeError`; slots outside the rank a
        :class:`SlotRangeError`; before anything changes.
        """
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.free(free_index, dp_rank)  # type: ignore[no-any-return]
        r = self._rank(dp_rank)
        slots = as_slots(free_index, "free_index")
        if slots.shape[0] == 0:
            return 0
        full_mode, swa_mode = self._modes
        stf, gpf, sts, gps = self._states(r)
        where = None if self.full_attn_allocator._trackers is None else self._where(r, None)
        mp, ps = self._maps[r], self.page_size
        with self.lock:
            in_group = self._in_group
            # One read of the caller's array, into a copy of ours: both sides work from it (and a free group keeps
            # it for its end), so a thread writing the caller's array meanwhile cannot make the SWA side index an
            # unchecked slot. A copy here costs a memcpy; one in the kernel cost more (docs/architecture.md).
            slots = slots.copy()
            scratch = self._scratch
            if scratch.shape[0] < slots.shape[0]:
                scratch = self._scratch_for(slots.shape[0])
            sf, ss = _UNTRACKED if where is None else self._sites(r, where, None)
            status = self._k.free(
                stf, gpf, sts, gps, mp, slots, scratch, ps, full_mode, swa_mode, int(in_group), sf, ss
            )
            if status < 0 and where is not None:
                self._failed(r)
            if status < 0:
                raise self._free_failed(status, r)
            if in_group:
                slots.flags.writeable = False
                self._group_frees[r].append(slots)
        return int(status)

    def _free_failed(self, status: int, r: int) -> Exception:
        code, _ = _layout.decode_status(status)
        if code == _layout.E_CORRUPT:
            return self._corrupt("free", status)
        full = self.full_attn_allocator
        outside, full._in_group = full._in_group, self._in_group  # the group is this allocator's: say so
        try:
            error: Exception = full._free_error(status, r)
        finally:
            full._in_group = outside
        return error

    def free_swa(self, free_index: Any, dp_rank: Any = 0) -> int:
        """Free the SWA slots of full slots (tokens that left the window); the full slots stay. How many went."""
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.free_swa(free_index, dp_rank)  # type: ignore[no-any-return]
        r = self._rank(dp_rank)
        slots = as_slots(free_index, "free_index")
        swa = self.swa_attn_allocator
        where = None if swa._trackers is None else self._where(r, None)
        mp, ps, mode = self._maps[r], self.page_size, self._modes[1]
        n = slots.shape[0]
        with self.lock:
            scratch = self._scratch  # the kernel reads the slots once, into scratch[n:2n]
            if scratch.shape[0] < 2 * n:
                scratch = self._scratch_for(2 * n)
            site = -1 if where is None else swa._site_of(r, where, None)
            status: int = self._k.free_swa(swa._st[r], swa._gp[r], mp, slots, scratch, ps, mode, site)
            if status < 0 and where is not None:
                swa._failed(r)
            if status >= 0:
                return status
            code, i = _layout.decode_status(status)
            if code == _layout.E_RANGE:  # the slot the kernel read and refused, not the caller's array again
                raise SlotRangeError(
                    f"free_swa got slot {int(scratch[n + i])} at free_index[{i}] (flattened), outside rank {r}'s "
                    f"full slots 0..{self._maps[r].shape[0] - 1}"
                )
        raise self._corrupt("free_swa", status)

    def count_swa_mapped(self, indices: Any, dp_rank: Any = 0) -> int:
        """How many of the full slots ``indices`` have an SWA slot."""
        r = self._rank(dp_rank)
        slots = own_slots(indices, "indices")  # checked, then indexed: read once
        mapping = self._maps[r]
        bad = (slots < 0) | (slots >= mapping.shape[0])
        if bad.any():
            i = int(np.argmax(bad))
            raise SlotRangeError(
                f"count_swa_mapped got slot {int(slots[i])} at indices[{i}] (flattened), outside rank {r}'s "
                f"full slots 0..{mapping.shape[0] - 1}"
            )
        with self.lock:
            return int(np.count_nonzero(mapping[slots]))

    # -- groups, clear ----------------------------------------------------------------------

    @handed_off
    def free_group_end(self) -> None:
        """Free, per rank, the group's frees as one: the full slots, then their SWA slots."""
        wheres = [self._where(r, None) for r in range(self.dp_size)]
        with self.lock:
            self._in_group = False
            for r, frees in enumerate(self._group_frees):
                if not frees:
                    continue
                slots = np.concatenate(frees)
                stf, gpf, sts, gps = self._states(r)
                site = -1 if wheres[r] is None else self.swa_attn_allocator._site_of(r, wheres[r], None)
                status = self._k.end_group(
                    stf,
                    gpf,
                    sts,
                    gps,
                    self._maps[r],
                    slots,
                    self._scratch_for(slots.shape[0]),
                    self.page_size,
                    self._modes[1],
                    site,
                )
                frees.clear()
                if status < 0:
                    raise self._corrupt("free_group_end", status)

    @handed_off
    def clear(self, dp_rank: Any = None) -> None:
        """Reset both sides of the rank (or every rank), zero its mapping, drop its pending frees, leave the group."""
        ranks = range(self.dp_size) if dp_rank is None else (self._rank(dp_rank),)
        with self.lock:
            for r in ranks:
                self._k.reset(*self._states(r), self._maps[r])
                self._group_frees[r].clear()
            self._in_group = False
