"""The sliding-window allocator's state as others see it: tracking reports, traces, snapshots, invariants."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._convert import own_slots
from .._core.protocol import ArrayStatePool, Recordable, recorded_kind, start_words
from .._diagnostics.snapshot import SWAState
from .._diagnostics.tracking import Outstanding
from .._errors import HostPoolError
from .._kernels import layout as _layout
from ._base import _lists_of, _RankedAllocator

_NO_PICKLE = (
    "SWATokenToKVPoolAllocator does not pickle or copy: the KV pool and the attention backend hold its mapping "
    "array by identity, and a copy's mapping would be one no allocator updates; use backup_state() and "
    "restore_state() for a snapshot"
)


def _swa_words(depth: int, full: Any, swa: Any, mappings: Any) -> NDArray[np.int64]:
    """A sliding-window allocator's trace words: per rank its full side's lists, its SWA side's, its mapping."""
    none = np.empty(0, dtype=np.int64)
    parts = []
    for f, w, m in zip(full, swa, mappings, strict=True):
        parts.append(start_words([(depth, *_lists_of(f), none), (depth, *_lists_of(w), none)]))
        parts.append(np.asarray(m, dtype=np.int64))
    return np.concatenate(parts)


class _SWAStateKeeping(Recordable, ArrayStatePool):
    """What the sliding-window allocator shows and keeps of its state: leak reports, recordings, snapshots,
    invariants, its refusal to pickle. The calls that change the state are ``_swa.SWATokenToKVPoolAllocator``'s."""

    # Set, or defined, by the allocator's class.
    full_attn_allocator: Any
    swa_attn_allocator: Any
    _maps: list[NDArray[np.int32]]
    _group_frees: list[list[NDArray[np.int64]]]
    _in_group: bool
    _rank: Callable[[Any], int]
    dp_size: int
    page_size: int
    track: bool

    @property
    def size_full(self) -> int:
        """The full sub-allocator's slots."""
        return int(self.full_attn_allocator.size)

    @property
    def size_swa(self) -> int:
        """The SWA sub-allocator's slots."""
        return int(self.swa_attn_allocator.size)

    # -- who holds each page (track=True): each side's own tracking, from the same call sites -------

    def _where(self, r: int, tag: Hashable) -> Any:
        """Before the lock: the caller's site key with ``tag`` (``None`` untracked); a bad tag raises."""
        trackers = self.full_attn_allocator._trackers
        return None if trackers is None else trackers[r].where(tag, 2)

    def _sites(self, r: int, where: Any, tag: Hashable) -> tuple[int, int]:
        """Under the lock: the site's id on each side (a tracked call that fails then calls :meth:`_failed`)."""
        return self.full_attn_allocator._site_of(r, where, tag), self.swa_attn_allocator._site_of(r, where, tag)

    def _batch_keys(self, r: int, tags: Any, n: int) -> Any:
        """Before the lock: each side's keys for a batch's ``tags`` (``None`` untracked); bad tags raise."""
        if self.full_attn_allocator._trackers is None:
            return None
        return self.full_attn_allocator._keys(r, tags, n), self.swa_attn_allocator._keys(r, tags, n)

    def _batch_sites(self, r: int, keys: Any, tags: Any) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Under the lock: each side's site array for a batch of a tracking allocator."""
        full, swa = self.full_attn_allocator, self.swa_attn_allocator
        return full._request_sites(r, keys[0], tags), swa._request_sites(r, keys[1], tags)

    def _failed(self, r: int) -> None:
        """A tracked call on rank ``r`` refused or failed: both sides' tables as they were."""
        self.full_attn_allocator._failed(r)
        self.swa_attn_allocator._failed(r)

    def outstanding(self, dp_rank: Any = 0, *, exclude: Any = None) -> list[Outstanding]:
        """What the full side holds on ``dp_rank``, by call site and tag (``track=True``).

        As :meth:`PagedTokenToKVPoolAllocator.outstanding` of
        :attr:`full_attn_allocator`; :attr:`swa_attn_allocator`'s
        ``outstanding`` gives the SWA side's.
        """
        return list(self.full_attn_allocator.outstanding(dp_rank, exclude=exclude))

    def leak_report(self, dp_rank: Any = 0, *, exclude: Any = None, limit: int = 20) -> str:
        """Both sides' leak reports: the full slots not in ``exclude``, then the SWA slots not mapped from them.

        ``exclude`` (full slots held legitimately, such as the radix
        cache's) leaves out those full slots and the SWA slots they map to.
        """
        r = self._rank(dp_rank)
        full = self.full_attn_allocator.leak_report(r, exclude=exclude, limit=limit)
        swa_exclude = None
        if exclude is not None:
            held = own_slots(exclude, "exclude")  # checked, then indexed: read once
            mapping = self._maps[r]
            inside = held[(held >= 0) & (held < mapping.shape[0])]
            with self.lock:
                mapped = mapping[inside]
            swa_exclude = mapped[mapped > 0].astype(np.int64)
        swa = self.swa_attn_allocator.leak_report(r, exclude=swa_exclude, limit=limit)
        return f"full side: {full}\nSWA side: {swa}"

    # -- recording (``pool.recording(path)``, from Recordable) -------------------------------

    _recorded = (
        *_RankedAllocator._recorded,
        "alloc_extend",
        "alloc_decode",
        "merge_and_sort_free",
        "free_swa",
        "full_available_size",
        "swa_available_size",
    )

    def _trace_shape(self) -> dict[str, Any]:
        return {
            **self.full_attn_allocator._trace_shape(),
            "pool": recorded_kind(self),
            "size_swa": self.size_swa,
        }

    def _trace_start(self) -> NDArray[np.int64]:
        """Per rank: the full side's state, the SWA side's, the mapping. Under the lock.

        A free pending in a group is refused: the group's end frees the SWA
        slots of exactly the slots freed, which a trace's pages do not say.
        """
        if any(self._group_frees) or any(gp[_layout.GP_COUNT] for gp in self.full_attn_allocator._gp):
            raise HostPoolError(
                "an SWATokenToKVPoolAllocator records from a state with no frees pending in a free group: "
                "start the recording before the group's frees, or after free_group_end()"
            )
        full, swa = self.full_attn_allocator._st, self.swa_attn_allocator._st
        return _swa_words(int(self._in_group), full, swa, self._maps)

    def _trace_state(self, state: Any) -> NDArray[np.int64] | None:
        """A snapshot's lists and mappings in ``start``'s layout, or ``None`` if it is not one of this shape."""
        dp = self.dp_size
        if (
            not isinstance(state, SWAState)
            or not len(state._mappings) == len(state.full._ranks) == len(state.swa._ranks) == dp
        ):
            return None
        try:
            return _swa_words(0, state.full._ranks, state.swa._ranks, state._mappings)
        except (ValueError, IndexError):  # a state restore_state refuses: its record is its error alone
            return None

    # -- snapshots, invariants ------------------------------------------------------------

    def _snapshot(self) -> SWAState:
        return SWAState(
            self.full_attn_allocator._snapshot(),
            self.swa_attn_allocator._snapshot(),
            tuple(m.copy() for m in self._maps),
        )

    def _checked(self, state: SWAState) -> tuple[Any, Any, list[NDArray[np.int32]]]:
        if type(state) is not SWAState:
            raise TypeError(f"restore_state needs an SWAState from backup_state(), got {type(state).__name__}")
        full = self.full_attn_allocator._checked(state.full)
        swa = self.swa_attn_allocator._checked(state.swa)
        maps = list(state._mappings)
        if len(maps) != self.dp_size:
            raise HostPoolError(f"the state holds {len(maps)} mappings; this allocator has dp_size={self.dp_size}")
        for r, m in enumerate(maps):
            found = self._mapping_problems(m, full[0][r], swa[0][r])
            if found:
                raise HostPoolError(f"the state's mapping of rank {r} fails the invariants: {found}")
        return full, swa, maps

    def _load(self, checked: tuple[Any, Any, list[NDArray[np.int32]]]) -> None:
        full, swa, maps = checked
        self.full_attn_allocator._load(full)
        self.swa_attn_allocator._load(swa)
        for mine, saved in zip(self._maps, maps, strict=True):
            mine[:] = saved  # in place: the KV pool and the backend hold these arrays

    def _mapping_problems(  # noqa: PLR0911 - one return per way a mapping can be wrong
        self, m: NDArray[np.int32], full: NDArray[np.int64], swa: NDArray[np.int64]
    ) -> str | None:
        """Why ``m`` is not a mapping between the ranks' states ``full`` and ``swa``; ``None`` if it is one."""
        ps = self.page_size
        if m.shape != self._maps[0].shape:
            return f"it has {m.shape[0]} entries, expected {self._maps[0].shape[0]}"
        mapped = np.flatnonzero(m)
        values = m[mapped].astype(np.int64)
        swa_pages = int(swa[_layout.H_NPAGES])
        if values.size and (values.min() < 1 or values.max() >= swa_pages * ps):
            return "an SWA slot is outside the SWA rank"
        if ps > 1:
            # Frees act on whole pages, the mapping on the slots named (as the
            # original's): entries of a page's other slots may outlive it, and a
            # request whose last SWA slot went continues from slot 0's page.
            return None
        if np.unique(values).size != values.size:
            return "two full slots map to one SWA slot"
        full_owner = _layout.owner_flags(full, int(full[_layout.H_NPAGES]))
        if mapped.size and (
            mapped.max() >= full_owner.shape[0] * ps or (full_owner[mapped // ps] != _layout.OWNER_ALLOCATED).any()
        ):
            return "a full slot that is not allocated has an SWA slot"
        swa_owner = _layout.owner_flags(swa, swa_pages)
        if values.size and (swa_owner[values // ps] != _layout.OWNER_ALLOCATED).any():
            return "a mapped SWA slot is not allocated"
        return None

    def _corruption(self) -> str | None:
        for sub in (self.full_attn_allocator, self.swa_attn_allocator):
            found: str | None = sub._corruption()
            if found is not None:
                return found
        for r, m in enumerate(self._maps):
            problem = self._mapping_problems(m, self.full_attn_allocator._st[r], self.swa_attn_allocator._st[r])
            if problem is not None:
                return f"{self._kind} rank {r} is corrupted: its mapping: {problem}"
        return None

    def __repr__(self) -> str:
        dp = self.dp_size
        sides = [
            (name, [sub.available_size(r) for r in range(dp)])
            for name, sub in (("full", self.full_attn_allocator), ("swa", self.swa_attn_allocator))
        ]
        with self.lock:
            said = ", ".join(f"available_{name}={got if dp > 1 else got[0]}" for name, got in sides)
        return (
            f"SWATokenToKVPoolAllocator(size={self.size_full}, size_swa={self.size_swa}, page_size={self.page_size}, "
            f"dp_size={dp}: {said}" + (", tracking" if self.track else "") + ")"
        )

    def _pickled(self) -> dict[str, Any]:
        raise TypeError(_NO_PICKLE)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NO_PICKLE)

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(_NO_PICKLE)
