"""Every snapshot kind is immutable: each array it holds is a read-only copy, however the snapshot was made.

A snapshot is restored later, maybe many times (a scheduler's retry, a
test's fixture): an array of it written in between would restore a state
no pool was ever in. ``backup_state`` and unpickling both freeze what they
hold; these tests reach every array inside every kind (nested states, per
rank lists, the sliding-window mappings) and try to write it.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hostpool_nb import HostPagePool, LogicalHostPool
from hostpool_nb.paged import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator


def _arrays(obj: Any, where: str) -> Iterator[tuple[str, np.ndarray]]:
    """Each numpy array inside a snapshot, with the path of fields and items that reaches it."""
    if isinstance(obj, np.ndarray):
        yield where, obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _arrays(getattr(obj, f.name), f"{where}.{f.name}")
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _arrays(item, f"{where}[{i}]")


def _used(pool: Any, size: int) -> Any:
    """``pool`` after an allocation and a free, so its lists are not the fresh ones."""
    held = pool.alloc(size)
    pool.free(held[: len(held) // 2])
    return pool


def _swa(**kw: Any) -> SWATokenToKVPoolAllocator:
    kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    return SWATokenToKVPoolAllocator(size=128, size_swa=64, kvcache=kv, **kw)


# kind -> (a pool of that kind, in use; how many arrays its snapshot holds at least; a page's slots)
POOLS: dict[str, tuple[Callable[[], Any], int, int]] = {
    "core": (lambda: _used(LogicalHostPool(256, 16), 64), 1, 16),
    "core tracked": (lambda: _used(LogicalHostPool(256, 16, track=True), 64), 1, 16),
    "core sorted": (lambda: _used(LogicalHostPool(256, 1, merge="sorted"), 40), 1, 1),
    "paged": (lambda: _used(PagedTokenToKVPoolAllocator(256, 4, None), 16), 1, 4),
    "paged dp 2 tracked": (lambda: _used(PagedTokenToKVPoolAllocator(256, 4, None, dp_size=2, track=True), 16), 2, 4),
    "token dp 2": (lambda: _used(TokenToKVPoolAllocator(64, None, dp_size=2), 10), 2, 1),
    "swa": (lambda: _used(_swa(), 6), 3, 1),
    "swa paged dp 2": (lambda: _used(_swa(page_size=4, dp_size=2), 8), 6, 4),
    "host": (lambda: _used(HostPagePool(16), 5), 1, 1),
}


@pytest.mark.parametrize("how", ["backup_state", "pickled"])
@pytest.mark.parametrize("kind", list(POOLS))
def test_every_array_a_snapshot_holds_is_read_only_and_its_own(kind: str, how: str) -> None:
    make, at_least, unit = POOLS[kind]
    pool = make()
    state = pool.backup_state()
    if how == "pickled":
        state = pickle.loads(pickle.dumps(state))
    arrays = list(_arrays(state, type(state).__name__))
    assert len(arrays) >= at_least, [w for w, _ in arrays]
    before = [a.copy() for _, a in arrays]
    for where, arr in arrays:
        assert not arr.flags.writeable, f"{where} of a {kind} snapshot ({how}) is writable"
        with pytest.raises(ValueError, match="read-only"):
            arr[...] = arr + 1
        assert not np.shares_memory(arr, pool._st if hasattr(pool, "_st") else np.empty(0)), where
    # A snapshot is a copy: the pool going on changes nothing in it.
    pool.alloc(unit)
    pool.clear()
    assert all(np.array_equal(a, b) for (_, a), b in zip(arrays, before, strict=True))
    pool.restore_state(state)  # and it still restores
