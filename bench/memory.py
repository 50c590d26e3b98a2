"""Metadata memory of a pool, including the peak during a merge.

One full cycle per implementation: build the pool, allocate every slot,
free every page in random order (one page per call, the most release-list
entries a caller can make), then allocate one page, which forces the
baselines to concatenate their release list.

Two ways of counting, checked against each other by the tests:

- :func:`pool_bytes` walks the pool's live arrays: unique data buffers plus
  the array objects (``sys.getsizeof``) and the release list itself. For
  torch the tensor storages are counted; torch's C++ tensor headers are
  invisible to Python, so torch is slightly under-counted.
- ``tracemalloc`` (numpy reports its data buffers to it; torch does not)
  measures the construction and the merge, where the peak is: a
  concatenation allocates its output while every input is still alive.

Tracing the whole cycle (``trace_all=True``) gives the same figures, but the
per-call tracing overhead makes one-page frees of a 16M-slot pool take tens
of seconds, so the main job traces construction and merge only. Arrays owned
by the caller (hostpool_nb's returned slots) are never counted: they are not
the pool's metadata.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

MEMORY_POOL_SLOTS = 1 << 24  # 16M slots
MEMORY_PAGE_SIZE = 64


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def pool_bytes(pool: Any) -> int:
    """Bytes held by a pool's arrays, counted from the live objects.

    hostpool_nb: every numpy array attribute that owns its memory (``_st``;
    ``_owner`` is a view into it and is not counted twice).
    Baselines: the free list and every release-list chunk, each data buffer
    once (views share their base's), plus each array object and the list.
    """
    if hasattr(pool, "_st"):
        return sum(int(v.nbytes) for v in vars(pool).values() if isinstance(v, np.ndarray) and v.base is None)
    arrays = [pool.free_slots, *pool.release_list]
    total = sys.getsizeof(pool.release_list)
    if _is_torch(pool.free_slots):
        storages: dict[int, int] = {}
        for t in arrays:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            total += sys.getsizeof(t)
        return total + sum(storages.values())
    seen: set[int] = set()
    for arr in arrays:
        a = arr
        while a is not None and id(a) not in seen:
            seen.add(id(a))
            total += sys.getsizeof(a)  # includes the data when ``a`` owns it
            a = a.base if isinstance(a.base, np.ndarray) else None
    return total


def _caller_bytes(arr: Any) -> int:
    """Bytes a returned array owns (0 for a view into the pool's storage)."""
    if isinstance(arr, np.ndarray) and arr.base is None:
        return int(arr.nbytes)
    return 0


class _Tracer:
    """tracemalloc deltas from a starting point, started only if needed."""

    def __enter__(self) -> _Tracer:
        gc.collect()
        self.owner = not tracemalloc.is_tracing()
        if self.owner:
            tracemalloc.start(1)
        self.base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        return self

    def now(self) -> int:
        return tracemalloc.get_traced_memory()[0] - self.base

    def peak(self) -> int:
        return tracemalloc.get_traced_memory()[1] - self.base

    def __exit__(self, *exc: Any) -> None:
        if self.owner:  # idempotent: stops tracing once, if it started it
            self.owner = False
            tracemalloc.stop()


def measure_memory(
    make: Callable[[int, int], Any],
    size: int = MEMORY_POOL_SLOTS,
    page_size: int = MEMORY_PAGE_SIZE,
    seed: int = 0,
    trace_all: bool = False,
    tick: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Bytes the pool holds after each phase of a full cycle, and the peak.

    Returns bytes and bytes per page for: ``built`` (after construction),
    ``released`` (every page freed, release list full, before any merge),
    ``merge_peak`` (highest point while the next ``alloc`` merges),
    ``after_merge``, and ``peak`` (the highest of all). ``*_traced`` keys
    give tracemalloc's figures for the phases it watched.
    """
    npages = size // page_size
    order = np.random.default_rng(seed).permutation(npages).tolist()
    warm = make(page_size, page_size)  # imports torch / loads kernels outside the count
    warm.free(warm.alloc(page_size))
    del warm
    res: dict[str, Any] = {"pool_slots": size, "page_size": page_size, "pages": npages}

    tr = _Tracer().__enter__()
    try:
        pool = make(size, page_size)
        res["built_traced"] = tr.now()
        res["built"] = pool_bytes(pool)
        if not trace_all:
            tr.__exit__()
        if tick:
            tick()

        out = pool.alloc(size)
        free = pool.free
        for p in order:
            a = p * page_size
            free(out[a : a + page_size])
        del out
        gc.collect()
        res["released"] = pool_bytes(pool)
        if trace_all:
            res["released_traced"] = tr.now()
        if tick:
            tick()
    finally:
        tr.__exit__()

    with _Tracer() as tr:
        got = pool.alloc(page_size)
        grown = tr.peak() - _caller_bytes(got)
    merge_peak = res["released"] + grown
    if _is_torch(getattr(pool, "free_slots", None)):
        # torch.cat's output is invisible to tracemalloc; it is allocated
        # while every input is alive.
        merge_peak += 8 * (len(pool.free_slots) + page_size)
    res["merge_peak"] = merge_peak
    res["after_merge"] = pool_bytes(pool)
    merges = getattr(pool, "merges", None)
    if merges is not None:
        res["merges"] = merges
    del got, pool
    gc.collect()
    if tick:
        tick()

    res["peak"] = max(res["built"], res["released"], res["merge_peak"], res["after_merge"])
    for key in ("built", "released", "merge_peak", "after_merge", "peak"):
        res[key + "_per_page"] = res[key] / npages
    return res
