"""The torch adapter: ``LogicalHostPool`` for code that passes torch tensors.

Code written against sglang's pool changes one import::

    from hostpool_nb.torch import LogicalHostPool

and keeps passing and receiving torch tensors. The class is the core pool of
:mod:`hostpool_nb` with conversion at the boundary only; every check, error,
lock and kernel is the core's.

Where copies happen
-------------------
- ``alloc`` wraps the core's fresh, caller-owned int64 array with
  ``torch.from_numpy``: no copy, and the pool never touches that memory again.
- ``free`` of a CPU tensor views it with ``Tensor.numpy()``: no copy. The
  core then treats that view exactly as a numpy array: a 1-D contiguous int64
  one takes its no-copy fast path; another integer dtype, or a layout that
  does not flatten to a view (e.g. non-contiguous), is copied once into a
  flat int64 array.
- ``free`` of a tensor on another device (CUDA, MPS, ...) moves it to the
  host with one ``.to("cpu")``, then proceeds as above.

Importing this module needs torch; ``import hostpool_nb`` alone never imports
it.
"""

from __future__ import annotations

from typing import Any

try:
    import torch
except ImportError as exc:
    raise ImportError(
        f"hostpool_nb.torch needs torch, which could not be imported ({exc}). "
        "Install torch first: on Linux the package index's torch is a CUDA build of several GB, and the "
        "CPU-only build comes from PyTorch's own index: pip install torch --index-url "
        "https://download.pytorch.org/whl/cpu (README, 'Install'); from a clone of hostpool_nb, "
        'pip install ".[torch]" then adds the extra. '
        "The torch-free pool is hostpool_nb.LogicalHostPool."
    ) from exc

import numpy as np
from numpy.typing import NDArray

from ._core.pool import LogicalHostPool as _CorePool
from ._core.stats import PoolStats
from ._diagnostics.snapshot import PoolState
from ._errors import AlignmentError, DoubleFreeError, HostPoolError, PartialPageError, SlotRangeError

_Tensor = torch.Tensor
_INT64 = np.dtype(np.int64)
_from_numpy = torch.from_numpy
_strided = torch.strided


def _tensor_count(value: torch.Tensor) -> int:
    """A count given as a tensor: a 0-d integer tensor on a device with data.

    The core refuses arrays as counts; code written for sglang may hold a
    count in a 0-d tensor, so the adapter reads those (``.item()``, exact
    for every integer dtype, ``uint64`` included, where torch's own
    ``__index__`` fails beyond int64). torch's ``__index__`` would also
    accept bool tensors and one-element tensors of any shape: those are a
    ``TypeError`` here, as for the core.
    """
    dtype = value.dtype
    if value.ndim != 0 or dtype is torch.bool or dtype.is_floating_point or dtype.is_complex:
        raise TypeError(
            f"need_size must be an integer, got {type(value).__name__} {value!r}; "
            "a count given as a tensor must be 0-d with an integer dtype"
        )
    if value.device.type == "meta":
        raise TypeError("need_size must be an integer, got a tensor on the meta device, which holds no value")
    count = value.item()
    if type(count) is not int:  # a quantized or otherwise unusual integer tensor
        raise TypeError(f"need_size must be an integer, got {type(value).__name__} {value!r}")
    return count


def _tensor_as_numpy(tensor: torch.Tensor, name: str = "indices") -> NDArray[Any]:
    """The slow path of ``free`` (and of ``alloc_many``'s sizes): a tensor ``Tensor.numpy()`` refuses.

    That is a tensor on another device (moved to the host once), a tensor
    that requires grad (detached; only float and complex tensors can, and
    those are refused by dtype first), a conjugate or negative view
    (resolved), a sparse or meta tensor or a dtype numpy lacks
    (``TypeError`` naming ``name``). A plain CPU tensor never gets here.
    """
    if tensor.is_nested:
        raise TypeError(
            f"{name} must be a dense tensor, got a nested tensor; concatenate its components "
            "(torch.cat(list(t.unbind()))) first"
        )
    if tensor.layout is not _strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {tensor.layout}; call .to_dense() first")
    if tensor.device.type == "meta":
        raise TypeError(f"{name} must hold integers, got a tensor on the meta device, which holds no data")
    _check_tensor_dtype(tensor.dtype, name)
    tensor = tensor.detach()
    if not tensor.is_cpu:
        # One device-to-host copy, keeping the dtype so the core sees the
        # values exactly (an unsigned value beyond int64 is still reported).
        # NOT TESTED: the development and CI machines have no GPU.
        tensor = tensor.to("cpu")
    tensor = tensor.resolve_conj().resolve_neg()
    try:
        return tensor.numpy()
    except (TypeError, NotImplementedError, RuntimeError):  # quantized and other tensors numpy cannot view
        raise TypeError(
            f"{name} must hold integers, got dtype {tensor.dtype}; "
            f"convert with .long() (or .to(torch.int64)) if the values are whole {_UNITS[name]}"
        ) from None


_UNITS = {"indices": "slot ids", "sizes": "slot counts"}


def _check_tensor_dtype(dtype: torch.dtype, name: str = "indices") -> None:
    """Refuse non-integer tensors with advice a torch user can follow."""
    if dtype is torch.bool or dtype.is_floating_point or dtype.is_complex:
        raise TypeError(
            f"{name} must hold integers, got dtype {dtype}; "
            f"convert with .long() (or .to(torch.int64)) if the values are whole {_UNITS[name]}"
        )


class LogicalHostPool(_CorePool):
    """Page-aligned allocator of host KV-cache token slots, on torch tensors.

    The core :class:`hostpool_nb.LogicalHostPool` with torch at the
    boundary: ``alloc`` returns CPU ``torch.int64`` tensors, ``free`` takes
    tensors on any device as well as numpy arrays and lists, ``dtype`` is
    ``torch.uint8``. Allocation order, locking and every check and error are
    the core's, unchanged; see its documentation. So are its parameters
    (``size``, ``page_size``, ``layout``, and keyword-only ``merge`` and
    ``track``) and the errors they raise.

    Examples
    --------
    >>> import torch
    >>> from hostpool_nb.torch import LogicalHostPool
    >>> pool = LogicalHostPool(size=64, page_size=16)
    >>> slots = pool.alloc(32)
    >>> slots.dtype, slots.shape
    (torch.int64, torch.Size([32]))
    >>> pool.free(slots)
    32
    """

    # The adapter returns tensors where the core returns numpy arrays, as
    # sglang's pool does: a deliberate break of substitutability.
    def alloc(self, need_size: int | torch.Tensor, *, tag: Any = None) -> torch.Tensor | None:  # type: ignore[override]
        """Allocate ``need_size`` slots: whole pages, in FIFO order.

        Parameters
        ----------
        need_size : int or torch.Tensor
            Number of slots; a non-negative multiple of ``page_size``. An
            int, a numpy integer scalar or a 0-d integer tensor.
        tag : hashable, optional, keyword-only
            A label for this allocation (a request id, say) that a tracking
            pool records with its call site; ignored when the pool does not
            track.

        Returns
        -------
        torch.Tensor or None
            A new 1-D contiguous CPU ``torch.int64`` tensor of slot ids,
            made with ``torch.from_numpy`` (no copy). It is owned by the
            caller: the pool keeps no reference to its memory and never
            writes it again. ``None`` when fewer than ``need_size`` slots are
            available.

        Raises
        ------
        TypeError
            If ``need_size`` is not an integer (a bool, a float, or a tensor
            that is not 0-d integer).
        AlignmentError
            If ``need_size`` is not a multiple of ``page_size`` (sglang's
            message).
        HostPoolError
            If ``need_size`` is negative.
        """
        rec = self._recording
        if rec is not None and rec.takes():  # recording: the call, made through it, returns a tensor
            return rec.alloc(need_size, tag=tag)  # type: ignore[no-any-return]
        if type(need_size) is not int and isinstance(need_size, _Tensor):
            need_size = _tensor_count(need_size)
        out = super().alloc(need_size, tag=tag)
        return None if out is None else _from_numpy(out)

    def alloc_many(  # type: ignore[override]  # returns tensors, as alloc does
        self, sizes: Any, *, tag: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Allocate a batch of requests at once: all of them, or none.

        The core's ``alloc_many`` (see its documentation), with the two
        results wrapped as CPU ``torch.int64`` tensors without a copy.

        Parameters
        ----------
        sizes : torch.Tensor or sequence of int
            Slots per request, each a non-negative multiple of
            ``page_size``: a 1-D integer tensor (on any device), a numpy
            array or a list.
        tag : hashable, optional, keyword-only
            As for :meth:`alloc`: recorded for the whole batch by a tracking
            pool, ignored otherwise.

        Returns
        -------
        (torch.Tensor, torch.Tensor) or None
            ``(slots, offsets)``: request ``i`` owns
            ``slots[offsets[i]:offsets[i + 1]]``; ``None`` when the batch
            does not fit.
        """
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.alloc_many(sizes, tag=tag)  # type: ignore[no-any-return]
        if isinstance(sizes, _Tensor):
            try:
                arr = sizes.numpy()  # a plain CPU tensor: a view, which the core copies
            except (RuntimeError, TypeError):
                arr = _tensor_as_numpy(sizes, "sizes")
            if arr.dtype is not _INT64:
                _check_tensor_dtype(sizes.dtype, "sizes")
            sizes = arr
        got = super().alloc_many(sizes, tag=tag)
        if got is None:
            return None
        return _from_numpy(got[0]), _from_numpy(got[1])

    def free(self, indices: Any) -> int:
        """Give back slots from earlier allocations: whole pages only (:meth:`hostpool_nb.LogicalHostPool.free`).

        ``indices`` may also be a tensor of any integer dtype, shape
        (flattened in C order) and device: a CPU tensor is viewed without a
        copy, one on another device is copied to the host once. The pool
        keeps no reference to it. Returns, and raises, as the core's
        ``free``; its ``TypeError`` also covers a 0-d tensor, a float, bool
        or complex tensor and a sparse one.
        """
        rec = self._recording
        if rec is not None and rec.takes():
            return rec.free(indices)  # type: ignore[no-any-return]
        if isinstance(indices, _Tensor):
            try:
                # The hot path: a CPU tensor viewed as a numpy array, no copy.
                arr = indices.numpy()
            except (RuntimeError, TypeError):
                # Another device, requires grad, sparse, a dtype numpy lacks.
                arr = _tensor_as_numpy(indices)
            if arr.dtype is not _INT64:  # one identity test on the hot path
                _check_tensor_dtype(indices.dtype)
            indices = arr
        return super().free(indices)

    def _uint8_dtype(self) -> torch.dtype:
        """The ``dtype`` attribute: ``torch.uint8``, as in sglang."""
        return torch.uint8

    def _empty_page(self) -> torch.Tensor:
        """An empty ``torch.uint8`` tensor: a logical pool stores no KV data."""
        return torch.empty(0, dtype=torch.uint8)


__all__ = [
    "AlignmentError",
    "DoubleFreeError",
    "HostPoolError",
    "LogicalHostPool",
    "PartialPageError",
    "PoolState",
    "PoolStats",
    "SlotRangeError",
]
