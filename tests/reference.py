"""A slow, obviously correct model of hostpool_nb.LogicalHostPool.

Written from SPEC.md, not from the package's code: the free list is a Python
list of slot ids, the release list is a list of freed chunks (lists), and
chunks are merged onto the free list only when an allocation needs more
slots than the free list holds, exactly as SPEC section 1 describes the
original. On top of that it applies hostpool_nb's stricter checks (SPEC
section 2), with a set of allocated page ids for ownership, and raises the
package's exception classes in the package's check order:

``alloc(need)``: not an integer -> TypeError; not a multiple of page_size ->
AlignmentError; negative -> HostPoolError; more than available -> None.

``free(indices)``: conversion (scalar, non-integer dtype, ragged -> TypeError;
an integer beyond int64 -> SlotRangeError); flattened length not a
multiple of page_size -> AlignmentError; empty -> 0; then each run of
page_size entries, in order: first slot outside [0, size) -> SlotRangeError;
first slot not a multiple of page_size -> PartialPageError; the next slots
not first+1, first+2, ... -> PartialPageError; page already named in this call
-> DoubleFreeError; page not currently allocated -> DoubleFreeError.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from hostpool_nb import AlignmentError, DoubleFreeError, HostPoolError, PartialPageError, SlotRangeError

INT64_MAX = 2**63 - 1


def model_error(cls: type[Exception], kind: str, message: str, position: int | None = None) -> Exception:
    """An exception of the package's class, tagged with what went wrong and where.

    ``kind`` names the check that failed (``"alignment"``, ``"negative"``,
    ``"range"``, ``"int64"``, ``"misaligned"``, ``"partial"``, ``"twice"``,
    ``"not_allocated"``, ``"type"``) and ``position`` the flattened index it
    failed at, so a test can check that the pool failed the same check at
    the same place, not only with the same class.
    """
    exc = cls(message)
    exc.kind = kind  # type: ignore[attr-defined]
    exc.position = position  # type: ignore[attr-defined]
    return exc


def to_count(value: Any, name: str) -> int:
    """An integer argument: int or numpy integer scalar, never bool/array/float."""
    if isinstance(value, (bool, np.bool_, np.ndarray)):
        raise model_error(TypeError, "type", f"{name} must be an integer, got {value!r}")
    if not isinstance(value, np.generic) and any(
        hasattr(type(value), a) for a in ("__array__", "__array_interface__", "__dlpack__")
    ):
        raise model_error(TypeError, "type", f"{name} must be an integer, got an array {value!r}")
    try:
        return operator.index(value)  # int, numpy integer scalars, __index__
    except TypeError:
        raise model_error(TypeError, "type", f"{name} must be an integer, got {value!r}") from None


def to_slot_list(indices: Any) -> list[int]:
    """Flatten ``indices`` in C order into a list of Python ints."""
    if isinstance(indices, (str, bytes)):
        raise TypeError("indices must not be a string")
    try:
        arr = np.asarray(indices)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot convert indices: {exc}") from None
    if arr.size == 0 and isinstance(indices, (list, tuple)):
        return []  # an empty list is empty whatever dtype numpy guesses
    if arr.ndim == 0:
        raise TypeError("indices must be an array, got a scalar")
    if arr.dtype.kind == "O":
        items = arr.flatten(order="C").tolist()
        if all(type(v) is int for v in items):  # ints too big for int64
            for v in items:
                if not -INT64_MAX - 1 <= v <= INT64_MAX:
                    raise model_error(SlotRangeError, "int64", f"slot {v} is outside the int64 range")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"indices must hold integers, got dtype {arr.dtype}")
    values = [int(v) for v in arr.flatten(order="C")]
    for v in values:
        if v > INT64_MAX:
            raise model_error(SlotRangeError, "int64", f"slot {v} is outside the int64 range")
    return values


class ReferencePool:
    """The model: slot-level free list, chunked release list, owned-page set."""

    def __init__(self, size: Any, page_size: Any) -> None:
        size = to_count(size, "size")
        page_size = to_count(page_size, "page_size")
        if page_size < 1:
            raise HostPoolError(f"page_size must be at least 1, got page_size={page_size}")
        if size < 0:
            raise HostPoolError(f"size must be non-negative, got size={size}")
        if max(size, page_size) > INT64_MAX:
            raise HostPoolError(f"size and page_size must fit in int64, got {size}, {page_size}")
        if size % page_size != 0:
            raise AlignmentError(f"LogicalHostPool size must be page-aligned, got size={size}, page_size={page_size}")
        self.size = size
        self.page_size = page_size
        self.clear()

    def clear(self) -> None:
        self.free_slots: list[int] = list(range(self.size))
        self.release_list: list[list[int]] = []
        self.allocated: set[int] = set()
        if not hasattr(self, "merges"):
            self.merges = 0  # merges since construction: clear() does not reset it

    def available_size(self) -> int:
        return len(self.free_slots) + sum(len(chunk) for chunk in self.release_list)

    def held_pages(self) -> list[int]:
        return sorted(self.allocated)

    def alloc(self, need_size: Any) -> list[int] | None:
        need = to_count(need_size, "need_size")
        if need % self.page_size != 0:
            raise model_error(
                AlignmentError,
                "alignment",
                f"LogicalHostPool allocation must be page-aligned, got need_size={need}, page_size={self.page_size}",
            )
        if need < 0:
            raise model_error(HostPoolError, "negative", f"need_size must be non-negative, got need_size={need}")
        if need > self.available_size():
            return None
        if need > len(self.free_slots):
            self.merges += 1
            merged = list(self.free_slots)
            for chunk in self.release_list:
                merged.extend(chunk)
            self.free_slots = merged
            self.release_list = []
        taken = self.free_slots[:need]
        self.free_slots = self.free_slots[need:]
        for slot in taken:
            if slot % self.page_size == 0:
                page = slot // self.page_size
                assert page not in self.allocated, "model bug: page handed out twice"
                self.allocated.add(page)
        return taken

    def free(self, indices: Any) -> int:
        slots = to_slot_list(indices)
        ps = self.page_size
        if len(slots) % ps != 0:
            raise model_error(
                AlignmentError,
                "alignment",
                f"LogicalHostPool free must be page-aligned, got len(indices)={len(slots)}, page_size={ps}",
            )
        if not slots:
            return 0
        named: list[int] = []
        for start in range(0, len(slots), ps):
            first = slots[start]
            if first < 0 or first >= self.size:
                raise model_error(SlotRangeError, "range", f"slot {first} is outside [0, {self.size})", start)
            if first % ps != 0:
                raise model_error(PartialPageError, "misaligned", f"slot {first} does not start a page", start)
            for j in range(1, ps):
                if slots[start + j] != first + j:
                    raise model_error(PartialPageError, "partial", f"not slot {first + j}", start + j)
            page = first // ps
            if page in named:
                raise model_error(DoubleFreeError, "twice", f"page {page} is freed twice in one call", start)
            if page not in self.allocated:
                raise model_error(DoubleFreeError, "not_allocated", f"page {page} is not allocated", start)
            named.append(page)
        # Every check passed: commit.
        for page in named:
            self.allocated.remove(page)
        self.release_list.append(list(slots))
        return len(slots)
