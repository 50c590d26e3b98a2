"""The core pool's workloads: the alloc/free round trip, from sorted and shuffled free lists, and batches.

Every timed loop covers whole pool cycles (three at least), so each holds
exactly as many of the originals' deferred merges as cycles: the
concatenation is paid inside the measurement, never outside. The
implementations are hostpool_nb's pool and the original algorithm
(``hostpool_nb.originals.sglang``) on numpy and, when torch imports, on
torch; before a cell is timed, every implementation must hand out the same
slots, and the loops must have merged equally often.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import numpy as np

from .core import HOSTPOOL, NUMPY, TORCH, Context, Row, fmt_count, workload
from .timing import interleaved, loop_count, median, timed

MIB_SLOTS = 1 << 20
BIG_K = 65536


@functools.cache
def torch_available() -> bool:
    """Whether torch imports (a broken install counts as absent)."""
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import torch  # noqa: F401
    except Exception:  # noqa: BLE001 - whatever a broken torch install raises, torch is absent
        return False
    return True


def implementations(with_torch: bool | None = None, pool: Any = None) -> dict[str, Callable[[int, int], Any]]:
    """Name -> pool constructor ``(size, page_size)``: hostpool_nb (or ``pool``) first, then the originals."""
    from hostpool_nb import LogicalHostPool
    from hostpool_nb.originals.sglang import LogicalHostPool as Original

    impls: dict[str, Callable[[int, int], Any]] = {HOSTPOOL: pool or LogicalHostPool, NUMPY: Original}
    if torch_available() if with_torch is None else with_torch:
        impls[TORCH] = functools.partial(Original, backend="torch")
    return impls


def merges_of(pool: Any) -> int:
    """Merges a pool made (hostpool_nb's from its stats; the originals count theirs)."""
    stats = getattr(pool, "stats", None)
    return stats().merges if stats is not None else pool.merges


class Divergence(RuntimeError):
    """Implementations handed out different slots, or merged unequally: their times would not compare."""


def same_slots(got: dict[str, Any], when: str) -> None:
    ref_name, first = next(iter(got.items()))
    ref = np.asarray(first).reshape(-1)
    for name, value in got.items():
        mine = np.asarray(value).reshape(-1)
        if mine.shape != ref.shape or not np.array_equal(mine, ref):
            raise Divergence(f"{when}: {name} handed out other slots than {ref_name}")


def _merged_alike(pools: dict[str, Any], before: dict[str, int], when: str) -> None:
    merges = {name: merges_of(pool) - before[name] for name, pool in pools.items()}
    if len(set(merges.values())) > 1:
        raise Divergence(f"{when}: merges differ {merges}")


def roundtrip_loop(pool: Any, k: int, n: int) -> None:
    alloc, free = pool.alloc, pool.free
    for _ in range(n):
        free(alloc(k))


def shuffle_free_list(pool: Any, page_size: int, size: int, seed: int = 0) -> None:
    """Leave ``pool``'s free list in a random page order: the worst case for anything built on runs."""
    slots = pool.alloc(size)
    order = np.random.default_rng(seed).permutation(size // page_size)
    pool.free(np.asarray(slots).reshape(-1, page_size)[order].reshape(-1))


def measure_roundtrip(
    impls: dict[str, Callable[[int, int], Any]],
    page_size: int,
    k: int,
    size: int,
    repeats: int,
    min_loop_s: float,
    max_loop_s: float,
    shuffled: bool = False,
    tick: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per ``free(alloc(k))``, sampled ``repeats`` times per implementation, interleaved."""
    per_cycle = size // k
    pools = {name: make(size, page_size) for name, make in impls.items()}
    if shuffled:
        for pool in pools.values():
            shuffle_free_list(pool, page_size, size)
    same_slots({name: p.alloc(k) for name, p in pools.items()}, f"round trip p{page_size} k={k}")
    cycle_s = {}
    for name, pool in pools.items():
        pool.clear()
        if shuffled:
            shuffle_free_list(pool, page_size, size)
        roundtrip_loop(pool, k, per_cycle)  # compiles or loads kernels; pays the first merge
        cycle_s[name] = timed(roundtrip_loop, pool, k, per_cycle)
    n = loop_count(cycle_s, min_loop_s, max_loop_s) * per_cycle
    before = {name: merges_of(pool) for name, pool in pools.items()}
    samples = interleaved({name: _loop_runner(pool, k, n) for name, pool in pools.items()}, repeats, tick)
    _merged_alike(pools, before, f"round trip p{page_size} k={k}")
    return samples


def _loop_runner(pool: Any, k: int, n: int) -> Callable[[], float]:
    return lambda: timed(roundtrip_loop, pool, k, n) / n


def roundtrip_pool_size(page_size: int, k: int, max_ops_per_cycle: int) -> int:
    """1M slots, unless a cycle of ``k``-slot round trips would take too many calls: then smaller."""
    size = max(min(MIB_SLOTS, k * max_ops_per_cycle), k)
    return size - size % page_size


def roundtrip_cells(scale: float) -> list[tuple[int, int]]:
    """(page size, k): from one page to 65,536 slots, every 4x at scale 2 and more, else three sizes."""
    cells = []
    for ps in (1, 16, 64):
        if scale >= 2:
            ks, k = [], ps
            while k < BIG_K:
                ks.append(k)
                k *= 4
            cells += [(ps, k) for k in [*ks, BIG_K]]
        else:
            cells += [(ps, k) for k in sorted({ps, 1024, BIG_K})]
    return cells


def row_of(workload_name: str, params: str, samples: dict[str, list[float]], **extra: Any) -> Row:
    return Row(workload_name, params, "s", {n: median(s) for n, s in samples.items()}, samples=samples, extra=extra)


@workload("roundtrip", seconds=12)
def roundtrip(ctx: Context) -> list[Row]:
    rows = []
    max_ops = ctx.size(16384 if ctx.scale >= 2 else 4096, 16)
    big = ctx.size(BIG_K, 256)
    cells = [(ps, k) for ps, k in roundtrip_cells(ctx.scale) if k <= big]
    shuffled = [k for k in ([64, 4096, BIG_K] if ctx.scale >= 2 else [BIG_K]) if k <= big] or [big]
    share = 1.0 / (len(cells) + len(shuffled) + 1)
    for ps, k in cells:
        size = ctx.size(MIB_SLOTS, 4096) if (ps, k) == (64, 64) else roundtrip_pool_size(ps, k, max_ops)
        ctx.label(f"round trip p{ps} k={k}")
        s = measure_roundtrip(ctx.impls, ps, k, size, ctx.repeats(), ctx.loop_s(), ctx.loop_s(0.25))
        row = row_of("round trip", f"p{ps} k={k} pool={fmt_count(size)}", s, page_size=ps, k=k, pool=size)
        bound = 1.5 if k == BIG_K and ps > 1 else 1.0
        rows.append(row.at_least(TORCH, bound).at_least(NUMPY, bound))
        ctx.tick(share)
    for k in shuffled:
        ctx.label(f"round trip p1 k={k}, shuffled")
        size = ctx.size(MIB_SLOTS, 4096)
        s = measure_roundtrip(ctx.impls, 1, k, size, ctx.repeats(), ctx.loop_s(), ctx.loop_s(0.25), True)
        row = row_of("round trip", f"p1 k={k} shuffled", s, page_size=1, k=k, pool=size)
        # Where hostpool_nb is slower: no runs to take, an owner flag per slot (docs/benchmarks.md).
        rows.append(row.at_least(TORCH, 0.5).at_least(NUMPY, 0.15) if k == BIG_K else row)
        ctx.tick(share)
    rows.append(memory_floor(big, ctx.repeats()))
    rows.append(checked_floor(big, ctx.size(MIB_SLOTS, 4096), ctx.repeats()))
    ctx.notes.append(
        "round trip: free(alloc(k)) in loops of whole pool cycles, so the originals' deferred merges are paid "
        "inside; shuffled: a 1M-slot pool's free list in random page order (no runs of consecutive pages). "
        "memory floor: "
        f"np.copyto of {BIG_K:,} int64, the memory traffic a {BIG_K:,}-slot round trip cannot avoid; "
        "checked floor: a kernel that only tests and sets an owner byte per id and copies the ids, out of a "
        "shuffled ring of a 1M-slot pool and back: what a shuffled round trip cannot go below"
    )
    return rows


def memory_floor(k: int, repeats: int) -> Row:
    """One ``np.copyto`` of ``k`` int64: the memory traffic a round trip of ``k`` slots must pay."""
    src = np.arange(k, dtype=np.int64)
    dst = np.empty_like(src)

    def loop(n: int) -> None:
        for _ in range(n):
            np.copyto(dst, src)

    n = 16
    while timed(loop, n) < 0.01 and n < 1 << 20:
        n *= 4
    value = median([timed(loop, n) / n for _ in range(repeats)])
    return Row("memory floor", f"k={k} np.copyto", "s", {HOSTPOOL: value}, columns=(HOSTPOOL,))


@functools.cache
def _checked_copy() -> Callable[..., int]:
    """The checked floor: copy ids out of a ring and back, testing and setting a flag per id (compiled on first use)."""
    from numba import njit

    @njit("i8(i4[::1], i8[::1], u1[::1], u1, u1)", nogil=True, cache=False)
    def take(src, dst, flags, want, flag):  # type: ignore[no-untyped-def]
        for i in range(src.shape[0]):
            p = src[i]
            if flags[p] != want:
                return i
            flags[p] = flag
            dst[i] = p
        return src.shape[0]

    @njit("i8(i8[::1], i4[::1], u1[::1], u1, u1)", nogil=True, cache=False)
    def give(src, dst, flags, want, flag):  # type: ignore[no-untyped-def]
        for i in range(src.shape[0]):
            p = src[i]
            if p < 0 or p >= flags.shape[0] or flags[p] != want:
                return i
            flags[p] = flag
            dst[i] = p
        return src.shape[0]

    def round_trip(ring: Any, out: Any, flags: Any, at: int) -> int:
        window = ring[at : at + out.shape[0]]
        return int(take(window, out, flags, 0, 1)) + int(give(out, window, flags, 1, 0))

    return round_trip


def checked_floor(k: int, size: int, repeats: int) -> Row:
    """A ``k``-slot round trip through a shuffled ring that does nothing but the per-id checks and copies."""
    ring = np.random.default_rng(0).permutation(size).astype(np.int32)
    flags = np.zeros(size, dtype=np.uint8)
    out = np.empty(k, dtype=np.int64)
    trip = _checked_copy()
    if trip(ring, out, flags, 0) != 2 * k:
        raise AssertionError("the checked floor's kernel stopped early")
    windows = size // k  # each round trip reads the next part of the ring, as a pool's does

    def loop(n: int) -> None:
        for i in range(n):
            trip(ring, out, flags, (i % windows) * k)

    n = 16
    while timed(loop, n) < 0.01 and n < 1 << 20:
        n *= 4
    value = median([timed(loop, n) / n for _ in range(repeats)])
    return Row("checked floor", f"k={k} shuffled", "s", {HOSTPOOL: value}, columns=(HOSTPOOL,))


# -- a batch of requests --------------------------------------------------------------------


def measure_batch(
    impls: dict[str, Callable[[int, int], Any]], page_size: int, requests: int, size: int, ctx: Context
) -> dict[str, list[float]]:
    """Seconds per batch of one-page requests, allocated then freed.

    hostpool_nb makes one ``alloc_many`` and one ``free`` of all the slots
    (with sizes as an int64 array, and as a list: ``hostpool_nb (list)``);
    the originals, which have no batch call, loop ``alloc`` and ``free``
    per request. Every implementation's first batch must hold the same slots.
    """
    sizes = np.full(requests, page_size, dtype=np.int64)
    runs: dict[str, tuple[Any, Any]] = {}
    for name, make in impls.items():
        if name == HOSTPOOL:
            runs[HOSTPOOL] = (make(size, page_size), sizes)
            runs[HOSTPOOL + " (list)"] = (make(size, page_size), sizes.tolist())
        else:
            runs[name] = (make(size, page_size), None)

    def loop(name: str, n: int) -> None:
        pool, batch = runs[name]
        if batch is not None:
            alloc_many, free = pool.alloc_many, pool.free
            for _ in range(n):
                free(alloc_many(batch)[0])
            return
        alloc, free = pool.alloc, pool.free
        for _ in range(n):
            for held in [alloc(page_size) for _ in range(requests)]:
                free(held)

    first = {}
    for name, (pool, batch) in runs.items():
        got = pool.alloc_many(batch)[0] if batch is not None else [pool.alloc(page_size) for _ in range(requests)]
        first[name] = np.concatenate([np.asarray(g).reshape(-1) for g in got]) if batch is None else got
        pool.clear()
    same_slots(first, f"batch of {requests}")
    per_cycle = size // (requests * page_size)
    cycle_s = {name: timed(loop, name, per_cycle) for name in runs}
    n = loop_count(cycle_s, ctx.loop_s(), ctx.loop_s(0.25)) * per_cycle
    before = {name: merges_of(pool) for name, (pool, _) in runs.items()}
    samples = interleaved({name: functools.partial(_per_batch, loop, name, n) for name in runs}, ctx.repeats())
    _merged_alike({name: pool for name, (pool, _) in runs.items()}, before, f"batch of {requests}")
    return samples


def _per_batch(loop: Callable[[str, int], None], name: str, n: int) -> float:
    return timed(loop, name, n) / n


@workload("batch", seconds=9)
def batch(ctx: Context) -> list[Row]:
    rows = []
    size = ctx.size(MIB_SLOTS, 4096)
    for requests in (16, 256, 1024) if not ctx.tiny else (4, 16):
        ctx.label(f"batch of {requests} requests")
        s = measure_batch(ctx.impls, 64, requests, size, ctx)
        for name, params in ((HOSTPOOL, ""), (HOSTPOOL + " (list)", " list")):
            mine = {HOSTPOOL: s[name], **{n: v for n, v in s.items() if not n.startswith(HOSTPOOL)}}
            row = row_of("batch round trip", f"p64 {requests} reqs pool={fmt_count(size)}{params}", mine)
            rows.append(row.at_least(TORCH, 50).at_least(NUMPY, 50) if requests == 256 and not params else row)
        ctx.tick(1 / 3)
    ctx.notes.append(
        "batch round trip: hostpool_nb allocates a batch of one-page requests with one alloc_many and frees it "
        "with one free (list: the sizes as a Python list); the originals loop alloc and free per request"
    )
    return rows
