"""The KV-cache trace: requests arriving and finishing out of order in a pool kept near full.

Requests need lognormal prompt + decode tokens (medians 600 and 200),
rounded up to whole pages; each step a request arrives (p = 0.55) or a
random held one finishes, so the free lists fragment into runs of a few
pages to a few hundred. When a request does not fit, the trace records the
failing ``alloc`` (``None`` everywhere) and retires random requests until
it fits. Every replay starts on a fresh pool; the figure is seconds per
call. The trace floor replays it on a stand-in that only allocates each
returned array and writes it, and reads each freed one, in one compiled
call each: the least any pool that returns new arrays and checks whole
pages must do; ``locked floor`` takes an ``RLock`` around each call
as ``pool.lock`` does, the bound any pool that locks per call stays above.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .core import HOSTPOOL, TORCH, Context, Row, fmt_count, workload
from .pool import MIB_SLOTS, Divergence, merges_of
from .timing import gc_paused, interleaved, median, timed

FLOOR, LOCKED_FLOOR = "trace floor", "locked floor"
# The bounds on hostpool_nb / locked floor: any pool that takes a lock per call stays above 1.
FLOOR_BOUNDS = {1: 1.3, 16: 1.15, 64: 1.15}


@dataclass
class Trace:
    """``ops`` are ``(k, slot)``: ``k > 0`` allocates into ``held[slot]``, 0 frees it, ``k < 0`` expects ``None``."""

    ops: list[tuple[int, int]]
    nslots: int
    pool_slots: int
    page_size: int
    stats: dict[str, Any]


def make_trace(pool_slots: int, page_size: int, n_ops: int, seed: int = 0, p_arrive: float = 0.55) -> Trace:
    rng = np.random.default_rng(seed)
    capacity = pool_slots // page_size
    n_draw = n_ops + 16
    tokens = rng.lognormal(math.log(600), 1.0, n_draw) + rng.lognormal(math.log(200), 0.9, n_draw)
    pages = np.maximum(np.minimum(np.ceil(tokens / page_size).astype(np.int64), max(capacity // 8, 1)), 1).tolist()
    arrive = (rng.random(n_draw * 2) < p_arrive).tolist()
    picks = rng.random(n_draw * 4).tolist()
    ops: list[tuple[int, int]] = []
    held: list[tuple[int, int]] = []  # (slot, pages); random removal by swap
    spare: list[int] = []
    nslots = avail = 0
    avail = capacity
    i_req = i_step = i_pick = failed = 0

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
        else:
            npages = pages[i_req % len(pages)]
            i_req += 1
            if npages > avail:
                ops.append((-npages * page_size, 0))
                failed += 1
                while npages > avail:
                    retire()
            slot = spare.pop() if spare else nslots
            nslots = max(nslots, slot + 1)
            held.append((slot, npages))
            ops.append((npages * page_size, slot))
            avail -= npages
        i_step += 1
    allocs = [k for k, _ in ops if k > 0]
    stats = {
        "ops": len(ops),
        "allocs": len(allocs),
        "failed_allocs": failed,
        "mean_request_slots": float(np.mean(allocs)),
    }
    return Trace(ops, nslots, pool_slots, page_size, stats)


def replay(pool: Any, trace: Trace, record: list[Any] | None = None) -> None:
    """Run ``trace`` on ``pool``; ``record`` collects every ``alloc`` result (for the check, untimed)."""
    alloc, free = pool.alloc, pool.free
    held: list[Any] = [None] * trace.nslots
    for k, slot in trace.ops:
        if k > 0:
            r = alloc(k)
            if r is None:
                raise Divergence(f"alloc({k}) returned None where the trace expects slots")
            held[slot] = r
        elif k == 0:
            free(held[slot])
        elif alloc(-k) is not None:
            raise Divergence(f"alloc({-k}) returned slots where the trace expects None")
        if record is not None and k != 0:
            record.append(held[slot] if k > 0 else None)


@functools.cache
def _touch_kernels() -> tuple[Callable[[Any], int], Callable[[Any], int]]:
    """Two compiled calls, as the pool calls its kernels: write every slot of an array, read every one."""
    from hostpool_nb._kernels.jit import _njit, entry_point

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
    """No allocator, only what any pool returning new arrays and checking whole pages must do per call."""

    def __init__(self, size: int, page_size: int, locked: bool = False) -> None:
        self._write, self._read = _touch_kernels()
        self._available = size
        self.lock = threading.RLock() if locked else None

    def alloc(self, need_size: int) -> NDArray[np.int64] | None:
        if need_size > self._available:
            return None
        out = np.empty(need_size, dtype=np.int64)
        lock = self.lock
        if lock is None:
            self._write(out)
        else:
            lock.acquire()
            try:
                self._write(out)
            finally:
                lock.release()
        self._available -= need_size
        return out

    def free(self, indices: NDArray[np.int64]) -> int:
        lock = self.lock
        if lock is None:
            self._read(indices)
        else:
            lock.acquire()
            try:
                self._read(indices)
            finally:
                lock.release()
        self._available += indices.shape[0]
        return indices.shape[0]


def measure_trace(
    impls: dict[str, Callable[[int, int], Any]], trace: Trace, repeats: int, floors: bool = True, tick: Any = None
) -> dict[str, list[float]]:
    """Seconds per trace call on each implementation (and the floors), each replay on a fresh pool."""
    makers = dict(impls)
    if floors:
        makers[FLOOR] = TraceFloor
        makers[LOCKED_FLOOR] = functools.partial(TraceFloor, locked=True)
    records: dict[str, list[Any]] = {}
    merges = {}
    for name, make in makers.items():  # warm-up, with every alloc's result checked
        pool = make(trace.pool_slots, trace.page_size)
        records[name] = []
        with gc_paused():
            replay(pool, trace, records[name])
        if name not in (FLOOR, LOCKED_FLOOR):
            merges[name] = merges_of(pool)
    ref = records[HOSTPOOL]
    for name in impls:
        if any(
            (a is None) != (b is None) or (a is not None and not np.array_equal(np.asarray(a), b))
            for a, b in zip(records[name], ref, strict=True)
        ):
            raise Divergence(f"the KV-cache trace: {name} handed out other slots than {HOSTPOOL}")
    if len(set(merges.values())) > 1:
        raise Divergence(f"the KV-cache trace: merges differ {merges}")

    def runner(make: Callable[[int, int], Any]) -> Callable[[], float]:
        return lambda: timed(replay, make(trace.pool_slots, trace.page_size), trace) / len(trace.ops)

    return interleaved({name: runner(make) for name, make in makers.items()}, repeats, tick)


@workload("trace", seconds=10)
def kv_trace(ctx: Context) -> list[Row]:
    rows = []
    n_ops = ctx.size(int(30_000 * ctx.scale), 300)
    size = ctx.size(MIB_SLOTS, 1 << 14)
    for ps in (1, 16, 64):
        ctx.label(f"KV-cache trace p{ps}")
        trace = make_trace(size, ps, n_ops)
        s = measure_trace(ctx.impls, trace, ctx.repeats(5))
        params = f"p{ps} pool={fmt_count(size)} {fmt_count(len(trace.ops))} ops"
        mine = {n: v for n, v in s.items() if n not in (FLOOR, LOCKED_FLOOR)}
        rows.append(
            Row("KV-cache trace", params, "s", {n: median(v) for n, v in mine.items()}, samples=mine, extra=trace.stats)
        )
        for floor in (FLOOR, LOCKED_FLOOR):
            fs = {HOSTPOOL: s[floor], **{n: v for n, v in mine.items() if n != HOSTPOOL}}
            rows.append(Row(floor, params, "s", {n: median(v) for n, v in fs.items()}, samples=fs))
        over = median([a / b for a, b in zip(s[HOSTPOOL], s[LOCKED_FLOOR], strict=True)])
        bound = FLOOR_BOUNDS[ps]
        rows.append(
            Row(
                "vs locked floor",
                params,
                "x",
                {HOSTPOOL: over},
                f"<={bound:g}x",
                over <= bound,
                columns=(HOSTPOOL,),
            )
        )
        ctx.tick(1 / 3)
    ctx.notes.append(
        "KV-cache trace: requests of ~1,300 slots (lognormal) arriving and finishing out of order in a 1M-slot "
        "pool kept near full, time per call. trace floor: a stand-in that only allocates and writes each "
        "returned array and reads each freed one (its row's ratios are each implementation over the floor); "
        "locked floor: the same under an RLock per call, as pool.lock takes; vs locked floor: hostpool_nb's time "
        "over the locked floor's (the median of the paired ratios), which any pool that locks per call stays above"
    )
    return rows


@workload("recorded", seconds=0)
def recorded_trace(ctx: Context) -> list[Row]:
    """``--trace PATH``: a trace recorded with ``pool.recording(PATH)``, timed by ``hostpool_nb.replay``."""
    from hostpool_nb.replay import MAX_POOL_BYTES, time_trace

    path = ctx.raw.get("trace_path")
    if path is None:
        return []
    from hostpool_nb.trace import load

    ctx.label(f"recorded trace {path}")
    trace = load(path)
    bound = ctx.raw.get("max_pool_bytes") or MAX_POOL_BYTES
    timing = time_trace(trace, ctx.repeats(5), with_torch=TORCH in ctx.impls, max_pool_bytes=bound)
    ctx.notes.extend(f"recorded trace: {note}" for note in timing.notes)
    if not timing.per_op:  # too short to time: the note says so
        return []
    return [Row("recorded trace", f"{path} {len(trace)} ops", "s", timing.per_op, samples=timing.samples)]
