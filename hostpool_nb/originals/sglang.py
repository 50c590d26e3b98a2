"""sglang's ``LogicalHostPool`` algorithm: a free-slot array and a lazy release list.

Allocation slices the front of the free slots; ``free`` appends the freed
chunk to a release list, which is concatenated onto the free slots only
when an allocation needs more than they hold. ``available_size`` is kept as
a running count of released slots (what it returns is the original's; a
sum over the release list would make every allocation slower and flatter
hostpool_nb). No double-free, range or whole-page checks: the original has
none. ``merges`` counts the concatenations, so comparisons can see that
every implementation merged as often.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


class _Numpy:
    """The array operations the algorithm needs, on numpy."""

    def arange(self, n: int) -> Any:
        return np.arange(n, dtype=np.int64)

    def concat(self, parts: list[Any]) -> Any:
        return np.concatenate(parts)

    def flat(self, indices: Any) -> Any:
        return np.asarray(indices, dtype=np.int64).reshape(-1)


class _Torch:
    """The same on torch CPU tensors: the original's own shape (torch is imported here, when asked for)."""

    def __init__(self) -> None:
        import torch  # noqa: PLC0415 - only for backend="torch": importing this module never imports torch

        self.torch = torch

    def arange(self, n: int) -> Any:
        return self.torch.arange(n, dtype=self.torch.int64)

    def concat(self, parts: list[Any]) -> Any:
        return self.torch.cat(parts)

    def flat(self, indices: Any) -> Any:
        return self.torch.as_tensor(indices).to(device="cpu", dtype=self.torch.int64).flatten()


_BACKENDS: dict[str, type[_Numpy] | type[_Torch]] = {"numpy": _Numpy, "torch": _Torch}


class LogicalHostPool:
    """The original pool's algorithm on ``backend`` arrays (``"numpy"`` or ``"torch"``).

    Examples
    --------
    A free slips through unchecked, as in the original:

    >>> from hostpool_nb.originals.sglang import LogicalHostPool
    >>> pool = LogicalHostPool(64, 16)
    >>> slots = pool.alloc(16)
    >>> pool.free(slots), pool.free(slots)  # a double free, accepted
    (16, 16)
    >>> pool.available_size()  # more than the pool holds
    80
    """

    def __init__(self, size: int, page_size: int, backend: str = "numpy") -> None:
        if size % page_size != 0:
            raise ValueError(f"LogicalHostPool size must be page-aligned, got size={size}, page_size={page_size}")
        self._xp = _BACKENDS[backend]()
        self.backend = backend
        self.size = size
        self.page_size = page_size
        self.lock = threading.RLock()
        self.merges = 0
        self.clear()

    def clear(self) -> None:
        with self.lock:
            self.free_slots = self._xp.arange(self.size)
            self.release_list: list[Any] = []
            self.released = 0

    def available_size(self) -> int:
        return len(self.free_slots) + self.released

    def _merge(self) -> None:
        if self.release_list:
            self.free_slots = self._xp.concat([self.free_slots, *self.release_list])
            self.release_list = []
            self.released = 0
            self.merges += 1

    def alloc(self, need_size: int) -> Any:
        with self.lock:
            if need_size % self.page_size != 0:
                raise ValueError(
                    "LogicalHostPool allocation must be page-aligned, "
                    f"got need_size={need_size}, page_size={self.page_size}"
                )
            if need_size > self.available_size():
                return None
            if need_size > len(self.free_slots):
                self._merge()
            select = self.free_slots[:need_size]
            self.free_slots = self.free_slots[need_size:]
            return select

    def free(self, indices: Any) -> int:
        with self.lock:
            if len(indices) % self.page_size != 0:
                raise ValueError(
                    "LogicalHostPool free must be page-aligned, "
                    f"got len(indices)={len(indices)}, page_size={self.page_size}"
                )
            flat = self._xp.flat(indices)
            if len(flat) == 0:
                return 0
            self.release_list.append(flat)
            self.released += len(flat)
            return len(indices)


__all__ = ["LogicalHostPool"]
