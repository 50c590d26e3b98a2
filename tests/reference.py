"""A slow, obviously correct model of hostpool_nb.LogicalHostPool.

Written from docs/behaviour.md, sections 1 and 2, not from the package's
code: the free list is a Python list of slot ids, the release list and the
pending list are lists of freed chunks (lists), and chunks are merged onto
the free list only when an allocation needs more slots than the free list
holds (or on ``merge()``), exactly as docs/behaviour.md, section 1 describes the original.
On top of that it applies hostpool_nb's stricter checks (docs/behaviour.md, section 2),
with a set of allocated page ids for ownership, and raises the package's
exception classes in the package's check order:

``alloc(need)``: not an integer -> TypeError; not a multiple of page_size ->
AlignmentError; negative -> HostPoolError; more than available -> None.

``alloc_many(sizes)``: not a list, tuple or 1-D integer array, or an element
that is not an integer -> TypeError (naming the element's position); then,
element by element, the checks of ``alloc`` naming ``sizes[i]``; then one
``alloc(sum(sizes))``, cut into requests by the prefix sums of ``sizes``.

``free(indices)``: conversion (scalar, non-integer dtype, ragged -> TypeError;
an integer beyond int64 -> SlotRangeError); flattened length not a
multiple of page_size -> AlignmentError; empty -> 0; then each run of
page_size entries, in order: first slot outside [0, size) -> SlotRangeError;
first slot not a multiple of page_size -> PartialPageError; the next slots
not first+1, first+2, ... -> PartialPageError; page already named in this call
-> DoubleFreeError; page not currently allocated (this includes a page freed
earlier in an open free group) -> DoubleFreeError.

Free groups: ``free_group_begin()`` deepens the group count; a free inside
a group appends its chunk to the pending list instead of the release list;
``free_group_end()`` without a group -> HostPoolError; the outermost end
appends the pending chunks to the release list, in order. ``clear()`` ends
every group.

Merge order ``"sorted"``: a merge sorts all free and released slots
(ascending slot ids are ascending pages, each page's slots in order).

Snapshots are deep copies of the whole model; statistics are plain counters
bumped where the issue says they count.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from hostpool_nb import AlignmentError, DoubleFreeError, HostPoolError, PartialPageError, SlotRangeError

INT64_MAX = 2**63 - 1


def model_error(cls: type[Exception], kind: str, message: str, position: int | None = None) -> Exception:
    """An exception of the package's class, tagged with what went wrong and where.

    ``kind`` names the check that failed (``"alignment"``, ``"negative"``,
    ``"range"``, ``"int64"``, ``"misaligned"``, ``"partial"``, ``"twice"``,
    ``"not_allocated"``, ``"no_group"``, ``"foreign"``, ``"type"``) and
    ``position`` the index it failed at (into the flattened slots for
    ``free``, into ``sizes`` for ``alloc_many``), so a test can check that
    the pool failed the same check at the same place, not only with the
    same class.
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


def to_size_list(sizes: Any) -> list[int]:
    """``alloc_many``'s sizes as Python ints: a list or tuple of integers, or a 1-D integer array."""
    if isinstance(sizes, (list, tuple)):
        for i, value in enumerate(sizes):
            # Each element is an integer as alloc's need_size is: bools are not.
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise model_error(TypeError, "type", f"sizes[{i}] must be an integer, got {value!r}", i)
        return [int(value) for value in sizes]
    if isinstance(sizes, np.generic) or not hasattr(type(sizes), "__array__"):
        raise model_error(TypeError, "type", f"sizes must be a sequence or an array, got {sizes!r}")
    arr = np.asarray(sizes)
    if arr.ndim != 1:
        raise model_error(TypeError, "type", f"sizes must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise model_error(TypeError, "type", f"sizes must hold integers, got dtype {arr.dtype}")
    return [int(value) for value in arr]


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
    """The model: slot-level free list, chunked release and pending lists, owned-page set."""

    def __init__(self, size: Any, page_size: Any, layout: str = "layer_first", *, merge: str = "fifo") -> None:
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
        if merge not in ("fifo", "sorted"):
            raise HostPoolError(f"merge must be 'fifo' or 'sorted', got merge={merge!r}")
        self.size = size
        self.page_size = page_size
        self.layout = layout
        self.merge_order = merge
        # Counters since construction: they only grow, and clear() keeps them.
        self.merges = 0  # merges that moved at least one page
        self.alloc_calls = 0  # alloc/alloc_many calls answered, with slots or None
        self.failed_allocs = 0  # of those, answered None
        self.free_calls = 0  # free calls that freed at least one page
        self.peak_allocated_pages = 0
        self.clears = 0  # clear() calls: how a free_group() block learns its group was ended
        self._all_free()

    def _all_free(self) -> None:
        self.free_slots: list[int] = list(range(self.size))
        self.release_list: list[list[int]] = []  # chunks freed outside groups, in order
        self.pending: list[list[int]] = []  # chunks freed inside the open groups, in order
        self.group_depth = 0
        self.allocated: set[int] = set()

    def clear(self) -> None:
        self._all_free()
        self.clears += 1

    # -- queries -------------------------------------------------------------

    def released_slots(self) -> list[int]:
        return [slot for chunk in self.release_list for slot in chunk]

    def pending_slots(self) -> list[int]:
        return [slot for chunk in self.pending for slot in chunk]

    def available_size(self) -> int:
        return len(self.free_slots) + len(self.released_slots())

    def held_pages(self) -> list[int]:
        return sorted(self.allocated)

    def stats(self) -> dict[str, int]:
        """``PoolStats``'s fields, from the lists and the counters."""
        ps = self.page_size
        return {
            "size": self.size,
            "page_size": ps,
            "num_pages": self.size // ps,
            "free_pages": len(self.free_slots) // ps,
            "released_pages": len(self.released_slots()) // ps,
            "pending_pages": len(self.pending_slots()) // ps,
            "allocated_pages": len(self.allocated),
            "available_size": self.available_size(),
            "merges": self.merges,
            "alloc_calls": self.alloc_calls,
            "failed_allocs": self.failed_allocs,
            "free_calls": self.free_calls,
            "peak_allocated_pages": self.peak_allocated_pages,
        }

    # -- allocation ----------------------------------------------------------

    def merge(self) -> int:
        """Move the release list onto the free list; return the slots moved."""
        released = self.released_slots()
        if not released:
            return 0
        merged = self.free_slots + released
        if self.merge_order == "sorted":
            merged = sorted(merged)  # slot ids ascend by page, then by slot within the page
        self.free_slots = merged
        self.release_list = []
        self.merges += 1
        return len(released)

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
        self.alloc_calls += 1
        if need > self.available_size():
            self.failed_allocs += 1
            return None
        if need > len(self.free_slots):
            self.merge()
        taken = self.free_slots[:need]
        self.free_slots = self.free_slots[need:]
        for slot in taken:
            if slot % self.page_size == 0:
                page = slot // self.page_size
                assert page not in self.allocated, "model bug: page handed out twice"
                self.allocated.add(page)
        self.peak_allocated_pages = max(self.peak_allocated_pages, len(self.allocated))
        return taken

    def alloc_many(self, sizes: Any) -> tuple[list[int], list[int]] | None:
        values = to_size_list(sizes)
        ps = self.page_size
        for i, size in enumerate(values):
            if size % ps != 0:
                raise model_error(
                    AlignmentError,
                    "alignment",
                    f"LogicalHostPool allocation must be page-aligned, got sizes[{i}]={size}, page_size={ps}",
                    i,
                )
            if size < 0:
                raise model_error(HostPoolError, "negative", f"sizes[{i}] must be non-negative, got {size}", i)
        slots = self.alloc(sum(values))  # one allocation of the total: same slots, same counting
        if slots is None:
            return None
        offsets = [0]
        for size in values:
            offsets.append(offsets[-1] + size)
        return slots, offsets

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
        if self.group_depth > 0:
            self.pending.append(list(slots))
        else:
            self.release_list.append(list(slots))
        self.free_calls += 1
        return len(slots)

    # -- free groups ---------------------------------------------------------

    def free_group_begin(self) -> None:
        self.group_depth += 1

    def free_group_end(self) -> None:
        if self.group_depth == 0:
            raise model_error(HostPoolError, "no_group", "free_group_end() without a free group")
        self.group_depth -= 1
        if self.group_depth == 0:
            self.release_list.extend(self.pending)
            self.pending = []

    @contextmanager
    def free_group(self) -> Iterator[None]:
        self.free_group_begin()
        clears = self.clears
        try:
            yield
        finally:
            if self.clears == clears:  # a clear() in the body ended the group already
                self.free_group_end()

    # -- snapshots -----------------------------------------------------------

    def backup_state(self) -> ReferencePool:
        return copy.deepcopy(self)

    def restore_state(self, state: Any) -> None:
        if not isinstance(state, ReferencePool):
            raise model_error(TypeError, "type", f"state must come from backup_state(), got {state!r}")
        if (state.size, state.page_size, state.merge_order) != (self.size, self.page_size, self.merge_order):
            raise model_error(HostPoolError, "foreign", "the state is from a pool of another shape")
        restored = copy.deepcopy(vars(state))  # a copy, so the same backup can be restored again later
        vars(self).clear()
        vars(self).update(restored)
