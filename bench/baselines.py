"""The original pool's algorithm, as a user without hostpool_nb would run it.

Both classes follow SPEC section 1 (sglang's ``LogicalHostPool`` as
observed): a tensor of free slots, a release list of freed chunks that is
concatenated onto the free list only when an allocation needs more than the
free list holds, and a lock around every state change. They keep the
original's silent failure modes (no double-free, range or whole-page checks)
because they are what hostpool_nb is measured and checked against.

``available_size`` is kept as a running count of released slots rather than
a sum over the release list: SPEC section 1 fixes what it returns, not how,
and a sum would make every allocation O(release-list length), which would
flatter hostpool_nb in the benchmarks. The baselines get the cheaper choice.

``TorchHostPool`` is the differential oracle of ``tests/`` and the torch
baseline of ``bench/``; ``NumpyHostPool`` is the same algorithm on numpy,
which is what a user without numba would write. One copy serves both.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


class NumpyHostPool:
    """SPEC section 1's algorithm on numpy: slicing and ``np.concatenate``."""

    def __init__(self, size: int, page_size: int) -> None:
        if size % page_size != 0:
            raise ValueError(f"LogicalHostPool size must be page-aligned, got size={size}, page_size={page_size}")
        self.size = size
        self.page_size = page_size
        self.lock = threading.RLock()
        self.clear()

    def clear(self) -> None:
        with self.lock:
            self.free_slots = np.arange(self.size, dtype=np.int64)
            self.release_list: list[np.ndarray] = []
            self.released = 0

    def available_size(self) -> int:
        return len(self.free_slots) + self.released

    def _merge(self) -> None:
        if self.release_list:
            self.free_slots = np.concatenate([self.free_slots, *self.release_list])
            self.release_list = []
            self.released = 0

    def alloc(self, need_size: int) -> np.ndarray | None:
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
            flat = np.asarray(indices, dtype=np.int64).reshape(-1)
            if flat.size == 0:
                return 0
            self.release_list.append(flat)
            self.released += len(flat)
            return len(indices)


class TorchHostPool:
    """SPEC section 1's algorithm on torch CPU tensors: the original's shape.

    Imports torch when instantiated, so importing this module never does.
    """

    def __init__(self, size: int, page_size: int) -> None:
        import torch

        self._torch = torch
        if size % page_size != 0:
            raise ValueError(f"LogicalHostPool size must be page-aligned, got size={size}, page_size={page_size}")
        self.size = size
        self.page_size = page_size
        self.lock = threading.RLock()
        self.clear()

    def clear(self) -> None:
        with self.lock:
            self.free_slots = self._torch.arange(self.size, dtype=self._torch.int64)
            self.release_list: list[Any] = []
            self.released = 0

    def available_size(self) -> int:
        return len(self.free_slots) + self.released

    def _merge(self) -> None:
        if self.release_list:
            self.free_slots = self._torch.cat([self.free_slots, *self.release_list])
            self.release_list = []
            self.released = 0

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
            torch = self._torch
            flat = torch.as_tensor(indices).to(device="cpu", dtype=torch.int64).flatten()
            if flat.numel() == 0:
                return 0
            self.release_list.append(flat)
            self.released += len(flat)
            return len(indices)


__all__ = ["NumpyHostPool", "TorchHostPool"]
