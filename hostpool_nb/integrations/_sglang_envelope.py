"""sglang's unified page-envelope host backing (``_SharedPageEnvelopeHostBacking``) keeping its books in hostpool_nb.

Hybrid sliding-window models with the unified memory layout share one host
byte envelope between their full and sliding-window host pools
(``UnifiedPageEnvelopeHostPool``): the backing keeps each side's free
extents as a Python list, dicts from logical to physical pages, a set of
holes, and compacts by moving pages (docs/behaviour.md, section 7). The
controller and the pipeline call the backing directly (``alloc_many``,
``free_bytes``, ``can_fit_many_then``), so ``install()`` replaces its
bookkeeping methods on its class: a backing built while installed gets an
:class:`EnvelopeBooks` (an :class:`hostpool_nb.EnvelopePagePool` taking and
returning tensors, with sglang's exception kinds) at the end of its
constructor, sharing its lock; a compaction still drains transfers and
moves the bytes of ``raw`` through the backing's own lease machinery.
``uninstall()`` gives each such backing its sides' books back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import _errors
from .._convert import as_count
from .._core.envelope import EnvelopePagePool
from ..torch import _tensor_count
from ._sglang_books import UNIFIED_ENVELOPE
from ._sglang_host import KEY, keep_books, one_d_slots, start_taking

_Tensor = torch.Tensor
_INT64 = np.dtype(np.int64)
_from_numpy = torch.from_numpy

#: What install() replaces on the backing's class: its constructor (which gives a backing its books) and its books.
METHODS = UNIFIED_ENVELOPE.methods


class _Compaction:
    """The backing's side of a compaction: its transfers drained first, its bytes moved, its leases let go."""

    def __init__(self, backing: Any) -> None:
        self.backing = backing

    def begin(self) -> None:
        for event in self.backing._begin_compaction():
            event.synchronize()

    def move(self, name: str, sources: np.ndarray, targets: np.ndarray) -> None:
        side = self.backing.sides[name]
        pages = self.backing.raw[: side.page_num * side.page_bytes].view(side.page_num, side.page_bytes)
        pages[_from_numpy(targets)] = pages[_from_numpy(sources)]  # gathered first: overlaps are safe

    def finish(self) -> None:
        self.backing._finish_compaction()


class EnvelopeBooks(EnvelopePagePool):
    """The books of one of sglang's unified host backings: an :class:`~hostpool_nb.EnvelopePagePool` on tensors.

    Results are CPU ``torch.int64`` tensors; ``free`` and the translations
    take a 1-D tensor (any integer dtype, any device) or array. Misuse is
    refused before anything changes, with the exception kinds sglang
    raises or asserts: a side it lacks is a
    :class:`~hostpool_nb.HostKVUnknownPoolError` (a ``ValueError`` and a
    ``KeyError``); a size or a free that is not whole pages a
    :class:`~hostpool_nb.HostKVAlignmentError`; a page freed twice, named
    twice, never allocated or out of range a
    :class:`~hostpool_nb.HostKVDoubleFreeError`; a translation of a page
    not allocated a :class:`~hostpool_nb.HostKVArgumentError` (all
    ``AssertionError`` s, as sglang's ``assert``).
    """

    def _named(self, name: Any) -> str:
        if name not in self._index:
            raise _errors.HostKVUnknownPoolError(f"Unknown unified host pool {name!r}.")
        return str(name)

    def _sglang_error(self, name: Any, error: _errors.HostPoolError) -> Exception:
        """A size's error as sglang's kinds: a side it lacks, or part of a page (``assert``); others as they are."""
        if name not in self._index:
            return _errors.HostKVUnknownPoolError(f"Unknown unified host pool {name!r}.")
        if isinstance(error, _errors.AlignmentError):
            return _errors.HostKVAlignmentError(f"The requested size should be a multiple of the page size: {error}")
        return error

    def _sizes(self, requests: Any) -> list[tuple[str, int]]:
        made = []
        for name, need in requests:
            size = need if type(need) is int else _count(need)
            try:
                self._requests(((name, size),))
            except _errors.HostPoolError as error:
                raise self._sglang_error(name, error) from None
            made.append((name, size))
        return made

    def alloc(self, name: str, need_size: Any) -> Any:
        size = need_size if type(need_size) is int else _count(need_size)
        try:
            got = EnvelopePagePool.alloc(self, name, size)
        except _errors.HostPoolError as error:
            raise self._sglang_error(name, error) from None
        return None if got is None else _from_numpy(got)

    def alloc_many(self, requests: Any) -> Any:
        got = EnvelopePagePool.alloc_many(self, self._sizes(requests))
        return None if got is None else [_from_numpy(slots) for slots in got]

    def can_fit_many_then(self, requests: Any, following_requests: Any, *, empty: bool = False) -> bool:
        return EnvelopePagePool.can_fit_many_then(
            self, self._sizes(requests), self._sizes(following_requests), empty=empty
        )

    def free(self, name: str, indices: Any) -> int:
        slots = one_d_slots(indices)
        try:
            s = self._index.get(name)
            if s is None:
                s = self._index[self._name(name)]  # raises: caught below as sglang's kind
            if slots is None:
                return 0
            if type(slots) is np.ndarray and slots.dtype is _INT64 and slots.flags.c_contiguous:
                return self._free(s, name, slots)  # a tensor's view, read once by the kernel
            return EnvelopePagePool.free(self, name, slots)
        except (_errors.AlignmentError, _errors.PartialPageError) as error:
            raise _errors.HostKVAlignmentError(f"Host indices must contain whole pages: {error}") from None
        except _errors.DoubleFreeError as error:
            text = "cannot be freed more than once" if "named twice" in str(error) else f"are not allocated in {name!r}"
            raise _errors.HostKVDoubleFreeError(f"Host pages {text}: {error}") from None
        except _errors.SlotRangeError as error:
            raise _errors.HostKVDoubleFreeError(f"Host pages are not allocated in {name!r}: {error}") from None
        except _errors.HostPoolError as error:
            raise self._sglang_error(name, error) from None

    def translate_indices(self, name: str, indices: Any) -> Any:
        self._named(name)
        slots = one_d_slots(indices)
        if slots is None:
            return torch.empty(0, dtype=torch.int64, device=indices.device)
        try:
            out = super().translate_indices(name, slots)
        except (_errors.AlignmentError, _errors.PartialPageError) as error:
            raise _errors.HostKVAlignmentError(f"Host indices must contain whole pages: {error}") from None
        except (_errors.DoubleFreeError, _errors.SlotRangeError) as error:
            raise _errors.HostKVArgumentError(f"Host pages are not allocated in {name!r}: {error}") from None
        got = _from_numpy(out)
        return got.to(device=indices.device) if isinstance(indices, _Tensor) else got

    def translate_index(self, name: str, index: Any) -> int:
        self._named(name)
        index = int(index) if isinstance(index, _Tensor) else as_count(index, "index")
        try:
            return super().translate_index(name, index)
        except (_errors.DoubleFreeError, _errors.SlotRangeError) as error:
            raise _errors.HostKVArgumentError(
                f"Host page of slot {index} is not allocated in {name!r}: {error}"
            ) from None

    def available_size(self, name: str) -> int:
        return super().available_size(self._named(name))

    def clear(self, name: str) -> None:
        super().clear(self._named(name))  # the compactor drains the backing's transfers first, as sglang's clear

    def give_back(self, backing: Any) -> None:
        """Give the engine's ``backing`` each side's books as sglang keeps them, from this state (under the lock)."""
        for name, side in backing.sides.items():
            state = self.side_state(name)
            side.free_logical_extents = state["free_extents"]
            side.logical_to_physical = dict(state["to_physical"])
            side.physical_to_logical = {p: lg for lg, p in state["to_physical"].items()}
            side.free_physical_pages = state["holes"]
            side.watermark = state["watermark"]


def _count(value: Any) -> int:
    return _tensor_count(value) if isinstance(value, _Tensor) else as_count(value, "need_size")


def methods(originals: dict[str, Callable[..., Any]], announce: Callable[[Any, Any], None]) -> dict[str, Any]:
    """hostpool_nb's versions of :data:`METHODS` for ``_SharedPageEnvelopeHostBacking``.

    ``originals``: the class's own, which a backing built before ``install()`` goes on using.
    """
    original_init = originals["__init__"]
    start_taking()

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        sides = {name: (side.page_size, side.page_bytes, side.grow_direction) for name, side in self.sides.items()}
        kept = EnvelopeBooks(int(self.capacity_bytes), sides)
        kept.compactor = _Compaction(self)
        keep_books(self, kept, announce)

    def routed(name: str) -> Callable[..., Any]:
        original = originals[name]

        # The books hold the backing's lock; checked again under it, since uninstall() hands the books back under it.
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            kept = self.__dict__.get(KEY)
            if kept is not None:
                with kept.lock:
                    if self.__dict__.get(KEY) is kept:
                        return getattr(kept, name)(*args, **kwargs)
            return original(self, *args, **kwargs)

        return call

    original_alloc, original_free = originals["alloc"], originals["free"]

    def alloc(self: Any, name: str, need_size: int) -> Any:  # the hot two, written out: no *args to pack
        kept = self.__dict__.get(KEY)
        if kept is not None:
            with kept.lock:
                if self.__dict__.get(KEY) is kept:
                    return kept.alloc(name, need_size)
        return original_alloc(self, name, need_size)

    def free(self: Any, name: str, indices: Any) -> int:
        kept = self.__dict__.get(KEY)
        if kept is not None:
            with kept.lock:
                if self.__dict__.get(KEY) is kept:
                    return kept.free(name, indices)  # type: ignore[no-any-return]
        return original_free(self, name, indices)  # type: ignore[no-any-return]

    made: dict[str, Any] = {"__init__": __init__, **{name: routed(name) for name in METHODS[1:]}}
    made["alloc"], made["free"] = alloc, free
    for name, fn in made.items():
        fn.__name__ = name
        fn.__qualname__ = f"_SharedPageEnvelopeHostBacking.{name}"
        fn.__doc__ = f"hostpool_nb's {name} of sglang's unified host backing (hostpool_nb.integrations.sglang)."
    return made


__all__ = ["METHODS", "EnvelopeBooks", "methods"]
