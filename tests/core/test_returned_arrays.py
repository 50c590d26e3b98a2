"""alloc() returns fresh, caller-owned int64 arrays (docs/behaviour.md's table, last row).

The original returned a view of its free list. Ours must return a 1-D,
C-contiguous, writeable int64 array that shares no memory with the pool or
with any other result, that the pool never writes again, and whose later
mutation by the caller cannot affect the pool. Likewise the pool keeps no
reference to an array passed to free().
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from hostpool_nb import LogicalHostPool
from hostpool_nb._core import pool as _pool
from hostpool_nb._kernels import layout as L
from tests.reference import ReferencePool


def assert_fresh(out: Any, pool: LogicalHostPool, others: list[np.ndarray]) -> None:
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.int64
    assert out.ndim == 1
    assert out.flags.c_contiguous
    assert out.flags.writeable
    assert out.base is None or not np.shares_memory(out.base, pool._st)
    assert not np.shares_memory(out, pool._st)
    assert not np.shares_memory(out, pool._owner)
    for other in others:
        assert not np.shares_memory(out, other)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_every_result_is_fresh(page_size: int) -> None:
    pool = LogicalHostPool(8 * page_size, page_size)
    results: list[np.ndarray] = []
    for pages in (0, 1, 3, 0, 4):
        out = pool.alloc(pages * page_size)
        assert out is not None
        assert out.shape == (pages * page_size,)
        assert_fresh(out, pool, results)
        results.append(out)
    assert pool.alloc(page_size) is None  # exhausted; now exercise merged pages
    pool.free(results[2])
    pool.free(results[1])
    out = pool.alloc(2 * page_size)
    assert_fresh(out, pool, results)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_writing_into_results_never_reaches_the_pool(page_size: int) -> None:
    pool = LogicalHostPool(4 * page_size, page_size)
    out = pool.alloc(4 * page_size)
    kept = out.copy()
    before = (pool._st.copy(), pool._owner.copy())  # byte for byte, scratch included
    out[:] = -12345
    out.resize(0, refcheck=False)  # owning the buffer means it may even be resized
    assert np.array_equal(pool._st, before[0])
    assert np.array_equal(pool._owner, before[1])
    pool.check_invariants()
    assert pool.free(kept) == 4 * page_size
    assert pool.alloc(4 * page_size).tolist() == kept.tolist()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_pool_keeps_no_reference_to_freed_input(page_size: int) -> None:
    pool = LogicalHostPool(4 * page_size, page_size)
    ref = ReferencePool(4 * page_size, page_size)
    out = pool.alloc(4 * page_size)
    assert out.tolist() == ref.alloc(4 * page_size)
    freed = out[: 2 * page_size].copy()  # int64, 1-D, C-contiguous: the no-copy path
    assert pool.free(freed) == ref.free(freed.tolist())
    freed[:] = 10**9  # scribble after the call
    assert pool.alloc(4 * page_size) is None
    assert pool.alloc(2 * page_size).tolist() == ref.alloc(2 * page_size)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_held_results_survive_later_calls(page_size: int) -> None:
    """Many results held across allocs, frees, merges and clears stay intact.

    Results the test still owns are compared with copies after every call;
    half the results are scribbled on right after they are copied; and the pool's
    answers must match the reference model throughout.
    """
    rng = random.Random(page_size)
    n_pages = 6
    pool = LogicalHostPool(n_pages * page_size, page_size)
    ref = ReferencePool(n_pages * page_size, page_size)
    held: list[tuple[np.ndarray, list[int]]] = []  # (result as returned, its values)
    graveyard: list[tuple[np.ndarray, list[int]]] = []  # freed or cleared, still kept alive
    steps = 150
    for _ in range(steps):
        op = rng.random()
        if op < 0.5:
            need = rng.randint(0, n_pages) * page_size
            out = pool.alloc(need)
            want = ref.alloc(need)
            if want is None:
                assert out is None
            else:
                assert out.tolist() == want
                assert_fresh(out, pool, [a for a, _ in held + graveyard])
                if rng.random() < 0.5:
                    kept = out.copy()
                    out[:] = -1  # the caller scribbles on the result and keeps a copy
                    out = kept
                held.append((out, want))
        elif op < 0.9 and held:
            arr, values = held.pop(rng.randrange(len(held)))
            assert pool.free(arr) == ref.free(values)
            graveyard.append((arr, values))
        elif op >= 0.97:
            pool.clear()
            ref.clear()
            graveyard.extend(held)
            held.clear()
        for arr, values in held + graveyard:
            assert arr.tolist() == values
        assert pool.available_size() == ref.available_size()
        pool.check_invariants()
    assert pool._st[L.H_MERGES] > 0, "test too weak: no allocation needed a merge"


def test_int64_input_takes_the_no_copy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1-D contiguous int64 array goes to the kernel as it is: no conversion step at all."""
    pool = LogicalHostPool(64, 16)
    held = pool.alloc(32)
    converted: list[object] = []
    real = _pool.as_slots

    def spy(indices: object) -> object:
        converted.append(indices)
        return real(indices)

    monkeypatch.setattr(_pool, "as_slots", spy)
    assert pool.free(held[:16]) == 16  # a view: still 1-D contiguous int64
    assert converted == []
    assert pool.free(held[16:].astype(np.int32)) == 16  # anything else converts once
    assert len(converted) == 1
