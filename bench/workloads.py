"""Timed workloads: the alloc/free round trip, a batch of requests, a KV-cache trace.

Every timed loop covers a whole number of pool cycles (three at least), so
each measurement contains exactly as many of the baselines' deferred merges
as cycles: the concatenation is paid inside the measurement, never outside.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .impls import HOSTPOOL, merges_of
from .timing import gc_paused, interleaved, median, timed

MIB_SLOTS = 1 << 20  # the 1M-slot pool of the targets


# -- round trip ------------------------------------------------------------


@dataclass
class Cell:
    """One measured configuration and its medians (seconds per operation)."""

    workload: str
    params: dict[str, Any]
    per_op: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def roundtrip_loop(pool: Any, k: int, n: int) -> None:
    """``n`` times: ``free(alloc(k))`` on ``pool``."""
    alloc = pool.alloc
    free = pool.free
    for _ in range(n):
        free(alloc(k))


def roundtrip_pool_size(page_size: int, k: int, max_ops_per_cycle: int, pool_slots: int = MIB_SLOTS) -> int:
    """Pool size for a round-trip cell: 1M slots unless a cycle gets too long.

    One cycle (every slot handed out once) takes ``pool / k`` round trips;
    for small ``k`` the pool shrinks to ``k * max_ops_per_cycle`` so that
    several cycles still fit the time budget. The amortised merge cost per
    round trip is proportional to ``k`` either way.
    """
    size = min(pool_slots, k * max_ops_per_cycle)
    size = max(size, k)
    return size - size % page_size


def shuffle_free_list(pool: Any, page_size: int, pool_slots: int, seed: int) -> None:
    """Leave a fresh ``pool``'s free list in a random page order, the same for every implementation.

    Allocates every slot, then frees the pages in an order drawn from
    ``seed``: the next merge makes that the free list, and FIFO round trips
    keep it (each gives back what it took, in the order it took it). So
    allocations hand out pages that are not in address order, nor next to
    each other: the worst case for any shortcut that relies on runs of
    consecutive pages.
    """
    slots = pool.alloc(pool_slots)
    order = np.random.default_rng(seed).permutation(pool_slots // page_size)
    pool.free(slots.reshape(-1, page_size)[order].reshape(-1))


def measure_roundtrip(
    impls: dict[str, Callable[[int, int], Any]],
    page_size: int,
    k: int,
    pool_slots: int,
    repeats: int,
    min_cycles: int = 3,
    min_loop_s: float = 0.02,
    tick: Callable[[], None] | None = None,
    workload: str = "round trip",
    max_loop_s: float = 0.25,
    shuffle_seed: int | None = None,
) -> Cell:
    """Median seconds per ``alloc(k)`` + ``free`` for each implementation.

    Each implementation gets its own pool, warmed up by one full cycle
    (which also loads or compiles kernels). A timed loop is ``cycles`` whole
    cycles, ``cycles >= min_cycles`` and long enough that the fastest
    implementation's loop lasts ``min_loop_s``, unless that would make the
    slowest one's loop exceed ``max_loop_s``. Repeats are interleaved.
    With ``shuffle_seed``, every pool starts from a free list shuffled page
    by page (:func:`shuffle_free_list`).
    """
    ops_per_cycle = pool_slots // k
    pools = {name: make(pool_slots, page_size) for name, make in impls.items()}
    if shuffle_seed is not None:
        for pool in pools.values():
            shuffle_free_list(pool, page_size, pool_slots, shuffle_seed)
    cycle_s = {}
    for name, pool in pools.items():
        roundtrip_loop(pool, k, ops_per_cycle)  # warm-up: compile/load, first merge
        cycle_s[name] = timed(roundtrip_loop, pool, k, ops_per_cycle)
    fastest = max(min(cycle_s.values()), 1e-9)
    slowest = max(*cycle_s.values(), 1e-9)
    cycles = max(min_cycles, min(math.ceil(min_loop_s / fastest), int(max_loop_s / slowest)))
    n = cycles * ops_per_cycle

    def runner(pool: Any) -> Callable[[], float]:
        return lambda: timed(roundtrip_loop, pool, k, n) / n

    merges_before = {name: merges_of(pool) for name, pool in pools.items()}
    samples = interleaved({name: runner(pool) for name, pool in pools.items()}, repeats, tick)
    merges = {}
    for name, pool in pools.items():
        before, after = merges_before[name], merges_of(pool)
        if before is not None and after is not None:
            merges[name] = (after - before) / repeats
    return Cell(
        workload=workload,
        params={
            "page_size": page_size,
            "k": k,
            "pool_slots": pool_slots,
            "ops_per_loop": n,
            "cycles_per_loop": cycles,
            "free_list": "sorted" if shuffle_seed is None else f"shuffled (seed {shuffle_seed})",
        },
        per_op={name: median(s) for name, s in samples.items()},
        samples=samples,
        extra={"merges_per_loop": merges},
    )


def measure_floor(k: int, repeats: int, min_loop_s: float = 0.02) -> dict[str, float]:
    """Memory-traffic floor of a ``k``-slot round trip, seconds per op.

    ``copy``: ``np.copyto`` of ``k`` int64 into a preallocated buffer: the
    returned slots written once and the freed slots read once, nothing else.
    ``fresh``: the same into a new ``np.empty`` buffer each time, as an
    ``alloc`` that returns caller-owned memory must.
    """
    src = np.arange(k, dtype=np.int64)
    dst = np.empty_like(src)

    def copy_loop(n: int) -> None:
        for _ in range(n):
            np.copyto(dst, src)

    def fresh_loop(n: int) -> None:
        for _ in range(n):
            np.copyto(np.empty(k, dtype=np.int64), src)

    out = {}
    for name, loop in (("copy", copy_loop), ("fresh", fresh_loop)):
        loop(10)
        n = 1
        while timed(loop, n) < min_loop_s and n < 1 << 24:
            n *= 4
        out[name] = median([timed(loop, n) / n for _ in range(repeats)])
    return out


# -- batch of requests ----------------------------------------------------

# The row key of hostpool_nb given ``sizes`` as a Python list instead of an
# int64 array: the same pool and calls, plus the list's conversion per call.
HOSTPOOL_LIST = "hostpool_nb (list)"


class BatchDivergence(RuntimeError):
    """Implementations handed out different slots, or merged unequally, in the batch workload."""


def batch_loop_many(pool: Any, sizes: Any, n_batches: int) -> None:
    """``n_batches`` times: one ``alloc_many(sizes)``, then one ``free`` of all its slots."""
    alloc_many = pool.alloc_many
    free = pool.free
    for _ in range(n_batches):
        slots, _offsets = alloc_many(sizes)
        free(slots)


def batch_loop_each(pool: Any, size: int, n_requests: int, n_batches: int) -> None:
    """``n_batches`` times: ``alloc(size)`` per request, then ``free`` per request.

    What a scheduler does with a pool that has no batch call.
    """
    alloc = pool.alloc
    free = pool.free
    requests = range(n_requests)
    for _ in range(n_batches):
        held = [alloc(size) for _ in requests]
        for h in held:
            free(h)


def _batch_alloc(pool: Any, batched: bool, sizes: Any, size: int, n_requests: int) -> tuple[np.ndarray, list[Any]]:
    """Allocate one batch as the timed loops do: its slots concatenated in request order, and what to free.

    For ``alloc_many`` the offsets are checked too: request ``i`` must own
    ``slots[i * size:(i + 1) * size]``, as the loop's ``i``-th ``alloc`` does.
    """
    if batched:
        got = pool.alloc_many(sizes)
        if got is None:
            raise BatchDivergence(f"alloc_many of {n_requests} requests of {size} slots returned None")
        slots, offsets = got
        offsets = np.asarray(offsets)
        if not np.array_equal(offsets, np.arange(n_requests + 1, dtype=np.int64) * size):
            shown = str(offsets[:6].tolist())[:-1] + (", ...]" if offsets.size > 6 else "]")
            raise BatchDivergence(f"alloc_many returned offsets {shown}, not i * {size}")
        return np.array(slots, dtype=np.int64).reshape(-1), [slots]
    held = [pool.alloc(size) for _ in range(n_requests)]
    if any(h is None for h in held):
        raise BatchDivergence(f"alloc({size}) returned None within a batch of {n_requests} requests")
    return np.concatenate([np.asarray(h, dtype=np.int64).reshape(-1) for h in held]), held


def _check_same_slots(got: dict[str, np.ndarray], when: str) -> None:
    """Raise :class:`BatchDivergence` unless every implementation handed out ``got``'s first entry's slots."""
    names = list(got)
    ref = got[names[0]]
    for name in names[1:]:
        mine = got[name]
        if not np.array_equal(mine, ref):
            m = min(mine.size, ref.size)
            diff = np.flatnonzero(mine[:m] != ref[:m])
            i = int(diff[0]) if diff.size else m
            raise BatchDivergence(
                f"{when}: {name} handed out other slots than {names[0]} "
                f"({mine.size} vs {ref.size} slots; first difference at position {i}: "
                f"{mine[i] if i < mine.size else 'none'} vs {ref[i] if i < ref.size else 'none'})"
            )


def _check_same_merges(merges: dict[str, Any], when: str) -> None:
    if len(set(merges.values())) > 1:
        raise BatchDivergence(f"{when} differ: {merges}")


def measure_batch(
    impls: dict[str, Callable[[int, int], Any]],
    page_size: int,
    n_requests: int,
    pool_slots: int,
    repeats: int,
    min_cycles: int = 3,
    min_loop_s: float = 0.02,
    tick: Callable[[], None] | None = None,
    max_loop_s: float = 0.25,
) -> Cell:
    """Median seconds per batch of ``n_requests`` one-page requests, allocated then freed.

    hostpool_nb allocates the batch with one ``alloc_many`` of a prebuilt
    int64 ``sizes`` array and frees it with one ``free`` of all its slots;
    it is also run, on a pool of its own, with ``sizes`` as a Python list
    (key :data:`HOSTPOOL_LIST`). The baselines have no batch call: they loop
    ``alloc(page_size)`` per request, then ``free`` per request.

    ``pool_slots`` must be a whole number of batches, so that every timed
    loop covers whole pool cycles and pays one deferred merge per cycle, as
    the round-trip loops do (same rule for the number of cycles). Outside
    the timed region, the first batch on every fresh pool, and the first
    batch after the timed loops (which pays a merge), must hand out the same
    slots everywhere, and every pool must have merged equally often;
    otherwise :class:`BatchDivergence` is raised.
    """
    batch_slots = n_requests * page_size
    if n_requests < 1 or pool_slots < batch_slots or pool_slots % batch_slots:
        raise ValueError(f"a {pool_slots}-slot pool is no whole number of batches of {batch_slots} slots")
    batches_per_cycle = pool_slots // batch_slots
    sizes = np.full(n_requests, page_size, dtype=np.int64)
    sizes_list = sizes.tolist()

    # name -> (pool, batched?, sizes given to alloc_many)
    runs: dict[str, tuple[Any, bool, Any]] = {}
    for name, make in impls.items():
        if name == HOSTPOOL:
            runs[HOSTPOOL] = (make(pool_slots, page_size), True, sizes)
            runs[HOSTPOOL_LIST] = (make(pool_slots, page_size), True, sizes_list)
        else:
            runs[name] = (make(pool_slots, page_size), False, None)

    def loop(name: str, n_batches: int) -> None:
        pool, batched, sz = runs[name]
        if batched:
            batch_loop_many(pool, sz, n_batches)
        else:
            batch_loop_each(pool, page_size, n_requests, n_batches)

    def checked_batch(when: str) -> None:
        # One batch on every pool, compared before anything is freed (so a
        # wrong answer is reported as such, not as the free's complaint).
        got, to_free = {}, {}
        for name, (pool, batched, sz) in runs.items():
            got[name], to_free[name] = _batch_alloc(pool, batched, sz, page_size, n_requests)
        _check_same_slots(got, f"{n_requests} requests per batch, {when}")
        for name, (pool, _, _) in runs.items():
            for h in to_free[name]:
                pool.free(h)

    # Warm-up: one cycle per pool (compiles or loads kernels, first merge
    # excluded), its first batch checked.
    checked_batch("first batch on a fresh pool")
    cycle_s = {}
    for name in runs:
        loop(name, batches_per_cycle - 1)
        cycle_s[name] = timed(loop, name, batches_per_cycle)
    fastest = max(min(cycle_s.values()), 1e-9)
    slowest = max(*cycle_s.values(), 1e-9)
    cycles = max(min_cycles, min(math.ceil(min_loop_s / fastest), int(max_loop_s / slowest)))
    n = cycles * batches_per_cycle

    def runner(name: str) -> Callable[[], float]:
        return lambda: timed(loop, name, n) / n

    merges_before = {name: merges_of(pool) for name, (pool, _, _) in runs.items()}
    samples = interleaved({name: runner(name) for name in runs}, repeats, tick)
    merges = {}
    for name, (pool, _, _) in runs.items():
        before, after = merges_before[name], merges_of(pool)
        if before is not None and after is not None:
            merges[name] = (after - before) / repeats
    _check_same_merges(merges, f"{n_requests} requests per batch, merges per timed loop")
    # Every pool now stands at a cycle's end: the next batch merges first.
    checked_batch("first batch after the timed loops (it merges)")
    totals = {name: merges_of(pool) for name, (pool, _, _) in runs.items()}
    _check_same_merges({k: v for k, v in totals.items() if v is not None}, f"{n_requests} requests, merges in all")
    return Cell(
        workload="batch round trip",
        params={
            "page_size": page_size,
            "n_requests": n_requests,
            "pool_slots": pool_slots,
            "batches_per_loop": n,
            "cycles_per_loop": cycles,
        },
        per_op={name: median(s) for name, s in samples.items()},
        samples=samples,
        extra={"merges_per_loop": merges},
    )


# -- KV-cache trace --------------------------------------------------------


@dataclass
class Trace:
    """A pre-generated request trace, replayed identically on every pool.

    ``ops`` is a list of ``(k, slot)`` pairs: ``k > 0`` allocates ``k`` slots
    and holds them in ``held[slot]``; ``k == 0`` frees ``held[slot]``;
    ``k < 0`` is an ``alloc(-k)`` that must return ``None`` (the pool is too
    full: the generator then retires random held requests until the request
    fits, and retries). ``nslots`` bounds the concurrently held requests.
    """

    ops: list[tuple[int, int]]
    nslots: int
    pool_slots: int
    page_size: int
    seed: int
    stats: dict[str, Any]


def make_trace(pool_slots: int, page_size: int, n_ops: int, seed: int = 0, p_arrive: float = 0.55) -> Trace:
    """Generate a KV-cache trace of at least ``n_ops`` pool calls.

    Requests arrive with probability ``p_arrive`` per step, else a random
    held request finishes, so arrivals outpace completions and the pool
    stays near full. A request needs prompt + decode tokens (lognormal,
    medians 600 and 200 tokens), rounded up to whole pages. When it does not
    fit, the trace records the failing ``alloc`` (which returns ``None`` on
    every implementation, since all report the same ``available_size()``),
    then retires random held requests until it fits, then allocates.
    Retirements pick a random held request, so frees come in an order
    unlike arrivals.
    """
    rng = np.random.default_rng(seed)
    capacity = pool_slots // page_size
    n_draw = n_ops + 16
    tokens = rng.lognormal(math.log(600), 1.0, n_draw) + rng.lognormal(math.log(200), 0.9, n_draw)
    pages = np.minimum(np.ceil(tokens / page_size).astype(np.int64), max(capacity // 8, 1))
    pages = np.maximum(pages, 1).tolist()
    arrive = (rng.random(n_draw * 2) < p_arrive).tolist()
    picks = rng.random(n_draw * 4).tolist()

    ops: list[tuple[int, int]] = []
    held: list[tuple[int, int]] = []  # (slot, pages); random removal by swap
    spare: list[int] = []  # free slot ids of ``held`` storage
    nslots = 0
    avail = capacity
    i_req = i_step = i_pick = 0
    failed = retired = finished = 0
    fill_sum = 0  # held pages summed over arrivals: how full the pool runs

    def retire() -> None:
        nonlocal avail, i_pick
        j = int(picks[i_pick % len(picks)] * len(held))
        i_pick += 1
        slot, npages = held[j]
        held[j] = held[-1]
        held.pop()
        ops.append((0, slot))
        spare.append(slot)
        avail += npages

    while len(ops) < n_ops:
        if held and not arrive[i_step % len(arrive)]:
            retire()
            finished += 1
        else:
            npages = pages[i_req % len(pages)]
            i_req += 1
            fill_sum += capacity - avail
            if npages > avail:
                ops.append((-npages * page_size, 0))
                failed += 1
                while npages > avail:
                    retire()
                    retired += 1
            if spare:
                slot = spare.pop()
            else:
                slot = nslots
                nslots += 1
            held.append((slot, npages))
            ops.append((npages * page_size, slot))
            avail -= npages
        i_step += 1
    allocs = sum(1 for k, _ in ops if k > 0)
    stats = {
        "ops": len(ops),
        "allocs": allocs,
        "frees": sum(1 for k, _ in ops if k == 0),
        "failed_allocs": failed,
        "retired_for_space": retired,
        "finished": finished,
        "mean_request_slots": float(np.mean([k for k, _ in ops if k > 0])) if allocs else 0.0,
        "slots_allocated": int(sum(k for k, _ in ops if k > 0)),
        "pool_cycles": sum(k for k, _ in ops if k > 0) / pool_slots,
        "max_held_requests": nslots,
        "mean_fill": fill_sum / max(i_req, 1) / capacity,
    }
    return Trace(ops, nslots, pool_slots, page_size, seed, stats)


class TraceDivergence(RuntimeError):
    """An implementation answered an ``alloc`` differently from the trace."""


def replay(pool: Any, trace: Trace, record: list[Any] | None = None) -> None:
    """Run ``trace`` on ``pool``; ``record`` collects every ``alloc`` result."""
    alloc = pool.alloc
    free = pool.free
    held: list[Any] = [None] * trace.nslots
    if record is None:
        for k, slot in trace.ops:
            if k > 0:
                r = alloc(k)
                if r is None:
                    raise TraceDivergence(f"alloc({k}) returned None")
                held[slot] = r
            elif k == 0:
                free(held[slot])
                held[slot] = None
            elif alloc(-k) is not None:
                raise TraceDivergence(f"alloc({-k}) succeeded where the trace expects None")
        return
    for k, slot in trace.ops:
        if k > 0:
            r = alloc(k)
            record.append(r)
            if r is None:
                raise TraceDivergence(f"alloc({k}) returned None")
            held[slot] = r
        elif k == 0:
            free(held[slot])
            held[slot] = None
        else:
            r = alloc(-k)
            record.append(r)
            if r is not None:
                raise TraceDivergence(f"alloc({-k}) succeeded where the trace expects None")


# The key of the trace floor's median and samples in a trace Cell's ``extra``.
TRACE_FLOOR = "trace floor"


@functools.cache
def _touch_kernels() -> tuple[Callable[[Any], int], Callable[[Any], int]]:
    """Two compiled calls: write every slot of an int64 array, and read every one.

    Compiled once per process with the options of the pool's short kernels
    (no reference counting, the GIL kept) and called through their entry
    points (``_kernels.entry_point``), as the pool calls its kernels; plain
    Python under ``NUMBA_DISABLE_JIT=1``.
    """
    from hostpool_nb._jit import _njit
    from hostpool_nb._kernels import entry_point

    def write_every(out: Any) -> int:
        for i in range(out.shape[0]):
            out[i] = i
        return out.shape[0]

    def read_every(slots: Any) -> int:
        acc = 0
        for i in range(slots.shape[0]):
            acc |= slots[i]
        return acc

    compile_ = _njit(["i8(i8[::1])"], cache=False, nogil=False)
    return entry_point(compile_(write_every)), entry_point(compile_(read_every))


class TraceFloor:
    """A trace call with no allocator work: a lower bound for pools that return new arrays and check whole pages.

    ``alloc(k)`` allocates a new int64 array of ``k`` slots and writes every
    slot once, in one compiled call; ``free(slots)`` reads every slot once,
    in one compiled call (checking whole pages needs that much); both count
    the available slots, so ``alloc`` returns ``None`` exactly where every
    pool does on a trace. No lock, no checks, no free list: a stand-in, not
    an allocator. The slots it hands out are not page ids.
    """

    def __init__(self, size: int, page_size: int) -> None:
        self._write, self._read = _touch_kernels()
        self._available = size
        self.page_size = page_size

    def alloc(self, need_size: int) -> NDArray[np.int64] | None:
        if need_size > self._available:
            return None
        out = np.empty(need_size, dtype=np.int64)
        self._write(out)
        self._available -= need_size
        return out

    def free(self, indices: NDArray[np.int64]) -> int:
        self._read(indices)
        self._available += indices.shape[0]
        return indices.shape[0]

    def available_size(self) -> int:
        return self._available


def measure_trace(
    impls: dict[str, Callable[[int, int], Any]],
    trace: Trace,
    repeats: int,
    tick: Callable[[], None] | None = None,
    floor: bool = False,
) -> Cell:
    """Median seconds per trace operation for each implementation.

    Every replay starts on a fresh pool (built outside the timed region), so
    all implementations see the identical sequence of calls. With ``floor``,
    :class:`TraceFloor` replays the trace too, interleaved with the others;
    its median and samples go to ``extra[TRACE_FLOOR]``, not ``per_op``.
    """

    def runner(make: Callable[[int, int], Any]) -> Callable[[], float]:
        def run() -> float:
            pool = make(trace.pool_slots, trace.page_size)
            return timed(replay, pool, trace) / len(trace.ops)

        return run

    merges = {}
    for name, make in impls.items():  # warm-up, and count merges once
        pool = make(trace.pool_slots, trace.page_size)
        with gc_paused():
            replay(pool, trace)
        merges[name] = merges_of(pool)
    runners = {name: runner(make) for name, make in impls.items()}
    if floor:
        with gc_paused():  # warm-up (and the floor's compile)
            replay(TraceFloor(trace.pool_slots, trace.page_size), trace)
        runners[TRACE_FLOOR] = runner(TraceFloor)
    samples = interleaved(runners, repeats, tick)
    extra: dict[str, Any] = {"merges_per_replay": merges}
    if floor:
        floor_samples = samples.pop(TRACE_FLOOR)
        extra[TRACE_FLOOR] = {"per_op": median(floor_samples), "samples": floor_samples}
    return Cell(
        workload="KV-cache trace",
        params={"page_size": trace.page_size, "pool_slots": trace.pool_slots, "seed": trace.seed, **trace.stats},
        per_op={name: median(s) for name, s in samples.items()},
        samples=samples,
        extra=extra,
    )
