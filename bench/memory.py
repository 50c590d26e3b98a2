"""Metadata memory of a pool: held after construction, and the peak while the originals merge.

One cycle per implementation, 16M slots of page size 64: build the pool,
allocate every slot, free every page in random order (one page per call,
the most release-list entries a caller can make), then allocate one page,
which makes the originals concatenate their release list. ``pool_bytes``
walks the pool's live arrays; ``tracemalloc`` measures the merge, where a
concatenation allocates its output while every input is alive. The slots
callers hold are theirs, not the pool's metadata, and are not counted.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from .core import HOSTPOOL, TORCH, Context, Row, fmt_count, workload

MEMORY_POOL_SLOTS = 1 << 24
PAGE_SIZE = 64


def pool_bytes(pool: Any) -> int:
    """Bytes a pool's arrays hold: hostpool_nb's state arrays; the originals' free list and release chunks."""
    if hasattr(pool, "_st"):
        return sum(int(v.nbytes) for v in vars(pool).values() if isinstance(v, np.ndarray) and v.base is None)
    arrays = [pool.free_slots, *pool.release_list]
    total = sys.getsizeof(pool.release_list)
    if type(pool.free_slots).__module__.startswith("torch"):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in arrays}
        return total + sum(sys.getsizeof(t) for t in arrays) + sum(storages.values())
    seen: set[int] = set()
    for arr in arrays:
        a = arr
        while a is not None and id(a) not in seen:
            seen.add(id(a))
            total += sys.getsizeof(a)  # the data too, when ``a`` owns it
            a = a.base if isinstance(a.base, np.ndarray) else None
    return total


def measure_memory(make: Callable[[int, int], Any], size: int, page_size: int = PAGE_SIZE) -> dict[str, float]:
    """Bytes per page held after construction, and at the highest point of a full cycle."""
    pages = size // page_size
    warm = make(page_size, page_size)  # imports torch, loads kernels: outside the count
    warm.free(warm.alloc(page_size))
    pool = make(size, page_size)
    built = pool_bytes(pool)
    out = pool.alloc(size)
    for p in np.random.default_rng(0).permutation(pages).tolist():
        pool.free(out[p * page_size : (p + 1) * page_size])
    del out
    gc.collect()
    released = pool_bytes(pool)
    owner = not tracemalloc.is_tracing()
    if owner:
        tracemalloc.start(1)
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        got = pool.alloc(page_size)
        grown = tracemalloc.get_traced_memory()[1] - base
    finally:
        if owner:
            tracemalloc.stop()
    if isinstance(got, np.ndarray) and got.base is None:
        grown -= got.nbytes  # the caller's slots
    merge_peak = released + grown
    if type(got).__module__.startswith("torch"):  # torch.cat's output is invisible to tracemalloc
        merge_peak += 8 * (len(pool.free_slots) + page_size)
    peak = max(built, released, merge_peak, pool_bytes(pool))
    return {"built": built / pages, "peak": peak / pages}


@workload("memory", seconds=4)
def memory(ctx: Context) -> list[Row]:
    held: dict[str, float] = {}
    peak: dict[str, float] = {}
    slots = fmt_count(ctx.size(MEMORY_POOL_SLOTS, 4096))
    for name, make in ctx.impls.items():
        ctx.label(f"metadata memory, {name}")
        size = ctx.size(MEMORY_POOL_SLOTS if name != TORCH else MEMORY_POOL_SLOTS // 16, 4096)  # torch: slow frees
        got = measure_memory(make, size)
        held[name], peak[name] = got["built"], got["peak"]
        ctx.tick(1 / len(ctx.impls))
    row = Row("metadata peak", f"{slots} slots p64 merge", "B/page", peak)
    row.target, row.met = "<=24 B/page", peak[HOSTPOOL] <= 24
    ctx.notes.append(
        "metadata: bytes per page a pool holds after construction, and at the peak of a full cycle (every page "
        "freed one by one in random order, then the merge an allocation makes); torch's on a 1M-slot pool, "
        "whose per-page frees are slow"
    )
    return [Row("metadata held", f"{slots} slots p64 built", "B/page", held), row]
