"""The torch-free ``LogicalHostPool``: validation, locking and errors.

All state changes happen in the kernels of ``_kernels.py``; this class checks
arguments before any of them runs, holds the lock around them, and turns
their status codes into exceptions.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import _kernels as K
from ._convert import _INT64_MAX, as_count, as_slots
from ._errors import AlignmentError, DoubleFreeError, HostPoolError, PartialPageError, SlotRangeError

_alloc_pages = K.entry_point(K.alloc_pages)
_free_pages = K.entry_point(K.free_pages)
_reset = K.entry_point(K.reset)

_UINT8 = np.dtype(np.uint8)
# Builtin dtypes are singletons, so ``arr.dtype is _INT64`` is an exact,
# cheap test for native-endian int64.
_INT64 = np.dtype(np.int64)
_STATUS_SHORT = -1 - K.E_SHORT
_STRIDES_1D = (8,)
# Above this many slots, ``alloc`` checks capacity before allocating its
# output: 256 KiB, past which np.empty maps fresh memory (microseconds, or a
# MemoryError for absurd sizes) instead of reusing the allocator's free
# blocks (about 100 ns, less than the extra lock round trip would cost).
_PRECHECK_SLOTS = 1 << 15


def _new_state(size: int, page_size: int, num_pages: int) -> NDArray[np.int64]:
    """A zeroed state array, or a clear error for a pool too large to hold."""
    words = K.state_length(num_pages)
    if words * 8 > sys.maxsize:  # numpy's own error would be about "dimensions"
        raise HostPoolError(
            f"LogicalHostPool(size={size}, page_size={page_size}) is too large: its {num_pages} pages "
            f"need {words * 8} bytes of metadata (9 per page), more than this platform can address"
        )
    try:
        return np.zeros(words, dtype=np.int64)
    except MemoryError as exc:
        raise MemoryError(
            f"LogicalHostPool(size={size}, page_size={page_size}) needs {words * 8 / 2**30:.3g} GiB "
            f"of metadata for its {num_pages} pages (9 bytes per page): {exc}"
        ) from exc


class LogicalHostPool:
    """Page-aligned allocator of host KV-cache token slots, without torch.

    Hands out integer slot ids in ``[0, size)``, a whole number of pages of
    ``page_size`` slots at a time, and takes them back. Behaves like sglang's
    ``LogicalHostPool`` for every correct call and raises a clear error for
    every incorrect one, before changing anything.

    Order: pages form one FIFO sequence, the free list followed by the
    release list (pages freed since the last merge, in the order they were
    freed). ``alloc`` takes pages from the front; ``free`` appends to the
    back; the release list is merged into the free list only when an
    allocation needs it. ``clear`` restores ascending order.

    Invariant: every page is exactly once either on the free list, on the
    release list, or held by a caller; only held pages may be freed.
    :meth:`check_invariants` verifies it.

    Cost: ``alloc(k)`` and ``free`` of ``k`` slots are O(k) with no
    allocation but the returned array; a merge is O(1). Metadata is 9 bytes
    per page (an int64 ring entry and a uint8 owner flag), with no peak.

    Thread safety: :attr:`lock` (a ``threading.RLock``) guards every state
    change; kernels release the GIL while they run.

    Parameters
    ----------
    size : int
        Number of token slots; a non-negative multiple of ``page_size``.
    page_size : int
        Slots per page, at least 1.
    layout : str, optional
        Stored as given, for compatibility with sglang's host pools.

    Raises
    ------
    TypeError
        If ``size`` or ``page_size`` is not an integer.
    HostPoolError
        If ``page_size < 1`` or ``size < 0``; :class:`AlignmentError` (with
        sglang's message) if ``size`` is not a multiple of ``page_size``.
    """

    def __init__(self, size: int, page_size: int, layout: str = "layer_first") -> None:
        size = as_count(size, "size")
        page_size = as_count(page_size, "page_size")
        if page_size < 1:
            raise HostPoolError(f"page_size must be at least 1, got page_size={page_size}")
        if size < 0:
            raise HostPoolError(f"size must be non-negative, got size={size}")
        for name, value in (("size", size), ("page_size", page_size)):
            if value > _INT64_MAX:  # the kernels compute slot ids in int64
                raise HostPoolError(f"{name} must fit in int64, got {name}={value}")
        if size % page_size != 0:
            raise AlignmentError(f"LogicalHostPool size must be page-aligned, got size={size}, page_size={page_size}")
        self.size = size
        self.logical_size = size
        self.page_size = page_size
        self.device = "cpu"
        self.layout = layout
        self.dtype = self._uint8_dtype()
        self.layer_num = 0
        self.start_layer = 0
        self.end_layer = 0
        self.kv_buffer = None
        self.size_per_token = 0
        self.allocator = None
        self.can_use_write_back_jit = True
        self.lock = threading.RLock()

        num_pages = size // page_size
        self._st = _new_state(size, page_size, num_pages)
        self._st[K.H_NPAGES] = num_pages
        self._st[K.H_PAGE_SIZE] = page_size
        self._st[K.H_PAGE_SHIFT] = K.page_shift(page_size)
        # A view for Python-side checks; the kernels find it inside ``_st``.
        self._owner = self._st[K.HEADER + num_pages :].view(np.uint8)[:num_pages]
        self.clear()

    # -- allocation -----------------------------------------------------

    def clear(self) -> None:
        """Free every slot, in ascending order, and empty the release list.

        Slots held by callers become free: freeing them afterwards raises
        :class:`DoubleFreeError`.
        """
        with self.lock:
            _reset(self._st)

    def available_size(self) -> int:
        """Number of slots an ``alloc`` can hand out now (free + released)."""
        st = self._st
        with self.lock:
            return int(st[K.H_NFREE] + st[K.H_NREL]) * self.page_size

    def alloc(self, need_size: int) -> NDArray[np.int64] | None:
        """Allocate ``need_size`` slots: whole pages, in FIFO order.

        Parameters
        ----------
        need_size : int
            Number of slots; a non-negative multiple of ``page_size``.

        Returns
        -------
        numpy.ndarray or None
            A new 1-D C-contiguous int64 array of slot ids, owned by the
            caller (the pool never reads or writes it again), or ``None``
            when fewer than ``need_size`` slots are available.

        Raises
        ------
        TypeError
            If ``need_size`` is not an integer.
        AlignmentError
            If ``need_size`` is not a multiple of ``page_size`` (sglang's
            message).
        HostPoolError
            If ``need_size`` is negative.
        """
        if type(need_size) is not int:
            need_size = as_count(need_size, "need_size")
        page_size = self.page_size
        if need_size % page_size != 0:
            raise AlignmentError(
                f"LogicalHostPool allocation must be page-aligned, got need_size={need_size}, page_size={page_size}"
            )
        if need_size < 0:
            raise HostPoolError(f"need_size must be non-negative, got need_size={need_size}")
        if need_size > self.size:
            return None
        lock = self.lock
        if need_size > _PRECHECK_SLOTS:
            # A refused request must cost microseconds whatever its size, not
            # a huge np.empty (or a MemoryError) first.
            st = self._st
            with lock:
                if need_size > (st[K.H_NFREE] + st[K.H_NREL]) * page_size:
                    return None
        # The output is allocated before taking the lock, so its page faults
        # are not paid while other threads wait; the kernel checks capacity
        # again and reports E_SHORT without touching the state.
        out = np.empty(need_size, dtype=_INT64)
        lock.acquire()  # acquire/release: measurably cheaper than ``with``
        try:
            status = _alloc_pages(self._st, out)
        finally:
            lock.release()
        if status >= 0:
            return out
        if status == _STATUS_SHORT:
            return None
        raise self._corrupt("alloc", status)

    def free(self, indices: Any) -> int:
        """Give back slots from earlier allocations: whole pages only.

        Parameters
        ----------
        indices : array_like of int
            Slot ids, any integer dtype and any shape (flattened in C
            order). Every run of ``page_size`` entries must be one page's
            slots in ascending order, of a page currently allocated; pages
            may come in any order.

        Returns
        -------
        int
            The number of slots freed.

        Raises
        ------
        TypeError
            If ``indices`` is a scalar or holds non-integers.
        AlignmentError
            If the number of slots is not a multiple of ``page_size``
            (sglang's message).
        SlotRangeError, PartialPageError, DoubleFreeError
            If a slot is outside ``[0, size)``, a run is not one whole page
            in order, or a page is not currently allocated (freed twice, in
            two calls or in this one, freed after ``clear()``, or never
            allocated).
        """
        # The hot path: strides == (8,) means 1-D and contiguous in one test
        # (a 0- or 1-element array may miss it and take the general path).
        if type(indices) is np.ndarray and indices.dtype is _INT64 and indices.strides == _STRIDES_1D:
            slots: NDArray[np.int64] = indices
        else:
            slots = as_slots(indices)
        n: int = slots.shape[0]
        page_size = self.page_size
        if n % page_size != 0:
            raise AlignmentError(
                f"LogicalHostPool free must be page-aligned, got len(indices)={n}, page_size={page_size}"
            )
        if n == 0:
            return 0
        lock = self.lock
        lock.acquire()
        try:
            status = _free_pages(self._st, slots)
        finally:
            lock.release()
        if status < 0:
            raise self._free_error(status, slots)
        return n

    # -- data-plane hooks: the pool holds no KV data ----------------------

    def destroy(self) -> None:
        """Release resources; the pool owns no buffers, so nothing happens."""
        return None

    def backup_from_device_all_layer(
        self, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: Any
    ) -> None:
        """No-op: a logical pool stores no KV data."""
        return None

    def load_to_device_per_layer(  # noqa: PLR0913 - sglang's hook signature, kept for drop-in use
        self,
        device_pool: Any,
        host_indices: Any,
        device_indices: Any,
        layer_id: int,
        io_backend: Any,
        *,
        is_draft: bool = False,
    ) -> None:
        """No-op: a logical pool stores no KV data."""
        return None

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        """Return an empty uint8 array: a logical pool stores no KV data."""
        return self._empty_page()

    def get_dummy_flat_data_page(self) -> Any:
        """Return an empty uint8 array: a logical pool stores no KV data."""
        return self._empty_page()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        """No-op: a logical pool stores no KV data."""
        return None

    def get_page_buffer_meta(self, indices: Any) -> None:
        """Return ``None``: a logical pool has no page buffers."""
        return None

    def get_ksize_per_token(self) -> int:
        """Return 0: a logical pool stores no KV data."""
        return 0

    # -- checks ----------------------------------------------------------

    def check_invariants(self) -> None:
        """Verify the internal state; raise ``RuntimeError`` if it is broken.

        Checks, independently of the kernels, that the counters agree, that
        every page id on the free and release lists is in range, free, and
        listed once, and that every page not listed is held by a caller.
        Costs O(number of pages).
        """
        with self.lock:
            st = self._st
            owner = self._owner
            n = self.size // self.page_size
            head, nfree, nrel = int(st[K.H_HEAD]), int(st[K.H_NFREE]), int(st[K.H_NREL])
            problems = []
            header = (int(st[K.H_NPAGES]), int(st[K.H_PAGE_SIZE]), int(st[K.H_PAGE_SHIFT]))
            if header != (n, self.page_size, K.page_shift(self.page_size)):
                problems.append(
                    f"header says (pages, page_size, shift) = {header}, pool has "
                    f"{(n, self.page_size, K.page_shift(self.page_size))}"
                )
            if st.shape[0] != K.state_length(n):
                problems.append(f"state array has length {st.shape[0]}, expected {K.state_length(n)}")
            if not (nfree >= 0 and nrel >= 0 and nfree + nrel <= n and (n == 0 or 0 <= head < n)):
                problems.append(f"counters out of range: head={head} nfree={nfree} nrel={nrel} pages={n}")
            else:
                listed = st[K.HEADER :][(head + np.arange(nfree + nrel)) % max(n, 1)]
                if listed.size and (listed.min() < 0 or listed.max() >= n):
                    problems.append("a listed page id is out of range")
                else:
                    times = np.bincount(listed, minlength=n)
                    if times.max(initial=0) > 1:
                        problems.append(f"page {int(np.argmax(times))} is listed {int(times.max())} times")
                    bad_owner = ((times == 1) & (owner != K.OWNER_FREE)) | ((times == 0) & (owner != K.OWNER_ALLOCATED))
                    if bad_owner.any():
                        p = int(np.argmax(bad_owner))
                        problems.append(f"page {p} has owner flag {int(owner[p])} but is listed {int(times[p])} times")
            if problems:
                raise RuntimeError("LogicalHostPool state is corrupted: " + "; ".join(problems))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, available={self.available_size()})"

    # -- internals -------------------------------------------------------

    def _uint8_dtype(self) -> Any:
        """The ``dtype`` attribute; the torch adapter returns ``torch.uint8``."""
        return _UINT8

    def _empty_page(self) -> Any:
        """An empty data page; the torch adapter returns a torch tensor."""
        return np.empty(0, dtype=np.uint8)

    def _page_text(self, page: int) -> str:
        ps = self.page_size
        return f"page {page} (slots {page * ps}..{page * ps + ps - 1})"

    def _free_error(self, status: int, slots: NDArray[np.int64]) -> Exception:
        code, pos = K.decode_status(status)
        ps = self.page_size
        start = pos - pos % ps
        slot = int(slots[pos])
        if code == K.E_RANGE:
            return SlotRangeError(f"free got slot {slot} at indices[{pos}] (flattened), outside [0, {self.size})")
        if code == K.E_MISALIGNED:
            return PartialPageError(
                f"free takes whole pages: indices[{pos}] (flattened) is slot {slot}, which is not "
                f"the first slot of a page (a multiple of page_size={ps}); each run of {ps} "
                "entries must be one page's slots in ascending order"
            )
        if code == K.E_PARTIAL:
            first = int(slots[start])
            return PartialPageError(
                f"free takes whole pages: indices[{pos}] (flattened) is slot {slot}, expected "
                f"{first + pos - start} to continue {self._page_text(first // ps)} in ascending order"
            )
        if code == K.E_NOT_ALLOCATED:
            return DoubleFreeError(
                f"{self._page_text(slot // ps)}, freed at indices[{pos}] (flattened), is not "
                "allocated: it was freed already, freed by clear(), or never allocated"
            )
        if code == K.E_DUPLICATE:
            return DoubleFreeError(
                f"{self._page_text(slot // ps)} is freed twice in one call (again at indices[{pos}], flattened)"
            )
        return self._corrupt("free", status)

    def _corrupt(self, op: str, status: int) -> RuntimeError:
        code, pos = K.decode_status(status)
        return RuntimeError(
            f"LogicalHostPool state is corrupted: {op} kernel failed with code {code} at {pos}; "
            "please report this with the calls that led to it"
        )
