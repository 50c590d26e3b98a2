"""sglang's page-interleaved host pool (``PageInterleaveHostPool``) keeping its owner classes' pages in hostpool_nb.

sglang's pool is a facade over a native host pool; its slots come from a
``PageInterleavePoolAllocator`` it rebuilds in ``clear()``, whose ``free``
runs ``torch.unique`` and a ``torch.cat`` per class (docs/behaviour.md,
section 6). ``install()`` replaces the facade's ``clear``, ``alloc``,
``free`` and ``available_size`` on the class: a pool built while installed
gets :class:`InterleavedBooks` (an :class:`hostpool_nb.InterleavedPagePool`
taking and returning tensors, with sglang's exception types) at its
constructor's ``clear()``, sharing the wrapped pool's lock. ``uninstall()``
hands each such pool an allocator of sglang's own holding the same lists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _errors
from .._convert import as_count
from .._core.interleaved import InterleavedPagePool
from ..torch import _tensor_count
from ._sglang_host import KEY, keep_books, lock_of, one_d_slots, start_taking

_Tensor = torch.Tensor
_from_numpy = torch.from_numpy


class InterleavedBooks(InterleavedPagePool):
    """The books of one of sglang's ``PageInterleaveHostPool``: an :class:`~hostpool_nb.InterleavedPagePool` on tensors.

    ``alloc(need_size, start_owner)`` returns an int64 CPU tensor (or
    ``None``), ``free`` takes a 1-D tensor (any integer dtype, any device)
    or array. Misuse the original accepts is refused before anything
    changes, with the exception types code written against sglang
    catches: a page freed twice (or not allocated) is a
    :class:`~hostpool_nb.HostKVDoubleFreeError`, a slot out of range or
    negative a :class:`~hostpool_nb.HostKVSlotRangeError`, an ``alloc`` of
    part of a page a :class:`~hostpool_nb.HostKVAlignmentError`, a missing
    ``start_owner`` or an ``alloc`` of nothing (``assert``s in sglang) a
    :class:`~hostpool_nb.HostKVArgumentError`; a partial page in ``free``
    a :class:`~hostpool_nb.PartialPageError`.
    """

    #: sglang's own ``clear`` of the pool, which ``uninstall()`` runs to give it an allocator again.
    original_clear: Callable[[Any], None] | None = None

    def alloc(self, need_size: Any, start_owner: Any = None) -> Any:
        """``need_size`` slots (whole pages), page ``j`` owned by class ``(start_owner + j) % shard_size``."""
        if start_owner is None:
            raise _errors.HostKVArgumentError(
                "sharded host slots must follow the owners of the device pages they back up: pass start_owner, "
                "the first page's owner class"
            )
        need = _count(need_size, "need_size")
        start = _count(start_owner, "start_owner")
        if need <= 0:
            raise _errors.HostKVArgumentError(f"need_size must be positive (sglang asserts a page), got {need}")
        if need % self.page_size:
            raise _errors.HostKVAlignmentError(
                f"The requested size should be a multiple of the page size: need_size={need}, "
                f"page_size={self.page_size}"
            )
        out = super().alloc(need, start)
        return None if out is None else _from_numpy(out)

    def free(self, indices: Any) -> int:
        """Free whole pages (a 1-D tensor or array); the number of slots given, as sglang's returns."""
        slots = one_d_slots(indices)
        if slots is None:
            return 0  # an empty tensor of any dtype frees nothing, as sglang's
        try:
            return super().free(slots)
        except _errors.DoubleFreeError as error:
            raise _errors.HostKVDoubleFreeError(f"Double-free detected: {error}") from None
        except _errors.SlotRangeError as error:
            raise _errors.HostKVSlotRangeError(str(error)) from None

    def give_back(self, pool: Any) -> None:
        """Give the engine's ``pool`` an allocator of sglang's own with this state's lists (under the lock)."""
        lists = self.free_lists()
        if self.original_clear is None:
            raise _errors.HostPoolError("these books were not made by install(): there is no pool to give them to")
        self.original_clear(pool)
        slots = pool._slots  # sglang's allocator holds tensors; a stand-in's (hostpool_nb.originals), lists
        slots.class_free_pages = [
            torch.tensor(listed, dtype=torch.int64) if isinstance(fresh, _Tensor) else listed
            for fresh, listed in zip(slots.class_free_pages, lists, strict=True)
        ]


def _count(value: Any, name: str) -> int:
    if type(value) is int:
        return value
    if isinstance(value, _Tensor):
        return _tensor_count(value)
    return as_count(value, name)


def methods(originals: dict[str, Callable[..., Any]], announce: Callable[[Any, Any], None]) -> dict[str, Any]:
    """hostpool_nb's ``clear``, ``available_size``, ``alloc`` and ``free`` of ``PageInterleaveHostPool``.

    ``originals``: the class's own, which a pool built before ``install()``
    (it has its own allocator) goes on using.
    """
    original_clear = originals["clear"]
    start_taking()

    def _books_for(pool: Any) -> Any:
        kept = InterleavedBooks(int(pool.size) - int(pool.page_size), int(pool.page_size), int(pool.shard_size))
        kept.original_clear = original_clear
        return keep_books(pool, kept, announce)

    def clear(self: Any) -> None:
        with lock_of(self):
            kept = self.__dict__.get(KEY)
            if kept is None:
                if "_slots" in vars(self) or _books_for(self) is None:
                    original_clear(self)
                return
            kept.clear()

    # The books hold the wrapped pool's lock: taken through them, not through the facade's __getattr__. Checked
    # again under it, since uninstall() hands the books back under that lock.

    def available_size(self: Any) -> int:
        kept = self.__dict__.get(KEY)
        if kept is not None:
            with kept.lock:
                if self.__dict__.get(KEY) is kept:
                    return kept.available_size()  # type: ignore[no-any-return]
        return originals["available_size"](self)  # type: ignore[no-any-return]

    def alloc(self: Any, need_size: int, start_owner: int | None = None) -> Any:
        kept = self.__dict__.get(KEY)
        if kept is not None:
            with kept.lock:
                if self.__dict__.get(KEY) is kept:
                    return kept.alloc(need_size, start_owner)
        return originals["alloc"](self, need_size, start_owner)

    def free(self: Any, indices: Any) -> int:
        kept = self.__dict__.get(KEY)
        if kept is not None:
            with kept.lock:
                if self.__dict__.get(KEY) is kept:
                    return kept.free(indices)  # type: ignore[no-any-return]
        return originals["free"](self, indices)  # type: ignore[no-any-return]

    made: dict[str, Any] = {"clear": clear, "available_size": available_size, "alloc": alloc, "free": free}
    for name, fn in made.items():
        fn.__qualname__ = f"PageInterleaveHostPool.{name}"
        fn.__doc__ = f"hostpool_nb's {name} of sglang's PageInterleaveHostPool (hostpool_nb.integrations.sglang)."
    return made


__all__ = ["InterleavedBooks", "methods"]
