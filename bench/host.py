"""The host tier workload: HostPagePool against sglang-jax's host pool bookkeeping, side by side.

Each cell is one pair of calls on a pool with half its pages free (the
other half held, as a warm L2 tier is): ``alloc(32)`` then ``free`` of those
pages, or ``reserve()`` then ``release``; freed pages go to the back of the
free list, so the pool stays half free. Both implementations keep per-page
allocated flags, generations and pin counts (``LRUHostKVPool``): every
figure includes their upkeep. The original's algorithm (``host_baselines``)
pops from the front of a Python list and tests ``id in free_list``, so its
calls grow with the pool; ``HostPagePool``'s should not. The ``mixin``
cells run the same calls through ``HostKVPoolMixin`` on the original's
class, whose ``free`` and ``release`` also drop each page's pending
transfers and payload.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hostpool_nb import HostPagePool
from hostpool_nb.originals.host_tier import LRUHostKVPool

from .core import HOSTPOOL, NUMPY, Context, Row, workload
from .timing import gc_paused, interleaved, median

ORIGINAL = NUMPY  # the table's "x numpy" column holds the ratio to the original


# Each operation of the mixin cells, and the host class it runs on.
MIXIN_OPS = ("reserve", "release", "alloc+free 1", "alloc+free 32", "available_size", "staging 8")


@dataclass
class HostConfig:
    alloc_sizes: tuple[int, ...] = (8192, 32768, 131072, 1 << 20)
    reserve_sizes: tuple[int, ...] = (32768,)
    mixin_sizes: tuple[int, ...] = (64, 8192, 131072)
    pages: int = 32  # pages per alloc
    repeats: int = 3
    min_loop_s: float = 0.02
    max_calls: int = 20000  # per timed loop of the fast side


def implementations() -> dict[str, Callable[[int], Any]]:
    """Name -> pool constructor ``(pool_size)``: HostPagePool and the original's bookkeeping."""
    from hostpool_nb import HostPagePool

    return {HOSTPOOL: HostPagePool, ORIGINAL: LRUHostKVPool}


def mixin_implementations(queue: bool = False) -> dict[str, Callable[[int], Any]]:
    """The original's class with ``HostKVPoolMixin``, against the class alone (the PD pool's with ``queue``)."""
    from hostpool_nb.originals.host_tier import QueueHostKVPool
    from hostpool_nb.paged import HostKVPoolMixin

    class FastLRU(HostKVPoolMixin, LRUHostKVPool):
        pass

    class FastQueue(HostKVPoolMixin, QueueHostKVPool):
        pass

    if queue:
        return {HOSTPOOL: FastQueue, ORIGINAL: QueueHostKVPool}
    return {HOSTPOOL: FastLRU, ORIGINAL: LRUHostKVPool}


def pd_metrics_module() -> contextlib.AbstractContextManager[Any]:
    """sglang-jax's PD metrics module, where the host classes report to it: the real one, or the originals'
    counting stand-in. Without one every reserve and release of the PD pool would pay a failed import, which no
    server does."""
    from hostpool_nb.originals.host_tier import PD_METRICS, stand_in_pd_metrics

    try:
        importlib.import_module(PD_METRICS)
    except ImportError:
        return stand_in_pd_metrics(keep_calls=False)
    return contextlib.nullcontext()


def half_full(make: Callable[[int], Any], n: int) -> Any:
    """A pool of ``n`` pages with the first half held, as ``alloc(n // 2)`` leaves it.

    The original's books are set directly: its ``alloc`` of half a 1M-page
    pool, a ``pop(0)`` per page, would take minutes of set-up.
    """
    from hostpool_nb.paged import HostKVPoolMixin

    pool = make(n)
    half = n // 2
    if not isinstance(pool, (HostKVPoolMixin, HostPagePool)):
        pool._free_list = list(range(half, n))
        if hasattr(pool, "_allocated"):
            pool._allocated[:half] = [True] * half
            pool._generation[:half] = [1] * half
        pool._peak_used = half
    elif pool.alloc(half) is None:
        raise RuntimeError(f"could not fill half of a {n}-page pool")
    if pool.available_size() != n - half:
        raise RuntimeError(f"could not fill half of a {n}-page pool")
    return pool


def alloc_free(pool: Any, pages: int, calls: int) -> None:
    alloc, free = pool.alloc, pool.free
    for _ in range(calls):
        free(alloc(pages))


def reserve_release(pool: Any, pages: int, calls: int) -> None:
    reserve, release = pool.reserve, pool.release
    for _ in range(calls):
        release(reserve())


def _runner(pool: Any, op: Callable[[Any, int, int], None], pages: int, cfg: HostConfig) -> Callable[[], float]:
    """A sample: seconds per call pair, over a loop long enough to time (one pair for a slow original)."""
    calls = 1

    def one() -> float:
        nonlocal calls
        while True:
            with gc_paused():
                t0 = time.perf_counter()
                op(pool, pages, calls)
                elapsed = time.perf_counter() - t0
            if elapsed >= cfg.min_loop_s or calls >= cfg.max_calls:
                return elapsed / calls
            calls = min(cfg.max_calls, max(calls * 2, int(calls * cfg.min_loop_s / max(elapsed, 1e-9))))

    return one


def measure_cell(
    impls: dict[str, Callable[[int], Any]], call: str, n: int, cfg: HostConfig, tick: Callable[[], None] | None
) -> dict[str, list[float]]:
    """Samples of ``call`` ("alloc+free" or "reserve+release") on half-full pools of ``n`` pages, by name."""
    op, pages = (alloc_free, cfg.pages) if call == "alloc+free" else (reserve_release, 1)
    pools = {name: half_full(make, n) for name, make in impls.items()}
    first = {name: _first_pair(pool, call, pages) for name, pool in pools.items()}
    if len({repr(v) for v in first.values()}) != 1:
        raise RuntimeError(f"host tier {call} on {n} pages: the implementations disagree: {first}")
    runners = {name: _runner(pool, op, pages, cfg) for name, pool in pools.items()}
    return interleaved(runners, cfg.repeats, tick)


def _first_pair(pool: Any, call: str, pages: int) -> Any:
    """The ids one call pair hands out: both sides must agree before they are timed."""
    if call == "alloc+free":
        got = pool.alloc(pages)
        pool.free(got)
        return got.tolist()
    page = pool.reserve()
    pool.release(page)
    return page


def cases(cfg: HostConfig) -> list[tuple[str, str, int]]:
    """(kind, call, pool pages) of every cell, in the order they run."""
    out = [("pool", "alloc+free", n) for n in cfg.alloc_sizes]
    out += [("pool", "reserve+release", n) for n in cfg.reserve_sizes]
    out += [("mixin", op, n) for n in cfg.mixin_sizes for op in MIXIN_OPS if op != "release"]
    return out


def _mixin_runners(pool: Any, op: str, cfg: HostConfig) -> dict[str, Callable[[], float]]:
    """Per-call samplers of a mixin cell's operation (two for "reserve": reserve, then release)."""
    if op == "reserve":  # reserve every free page of a burst, then release them: each timed on its own
        burst = min(16, pool.available_size())
        spent = {"reserve": 0.0, "release": 0.0, "calls": 0}

        def sample() -> None:
            reserve, release = pool.reserve, pool.release
            t0 = time.perf_counter()
            got = [reserve() for _ in range(burst)]
            t1 = time.perf_counter()
            for page in got:
                release(page)
            spent["reserve"] += t1 - t0
            spent["release"] += time.perf_counter() - t1
            spent["calls"] += burst

        def one(which: str) -> Callable[[], float]:
            def run() -> float:
                if which == "reserve":
                    spent.update(reserve=0.0, release=0.0, calls=0)
                    with gc_paused():
                        deadline = time.perf_counter() + cfg.min_loop_s
                        sample()
                        while time.perf_counter() < deadline and spent["calls"] < cfg.max_calls:
                            sample()
                return spent[which] / max(spent["calls"], 1)

            return run

        return {"reserve": one("reserve"), "release": one("release")}
    if op.startswith("alloc+free"):
        pages = int(op.split()[1])
        return {op: _runner(pool, alloc_free, pages, cfg)}
    if op == "available_size":

        def available(pool: Any, _pages: int, calls: int) -> None:
            size = pool.available_size
            for _ in range(calls):
                size()

        return {op: _runner(pool, available, 0, cfg)}
    held = [int(p) for p in pool.alloc(8)]  # the pages a HiCache transfer moves: staged, stored, loaded back

    def staging(pool: Any, _pages: int, calls: int) -> None:
        for _ in range(calls):
            pool.stage_backup(held, held)
            pool.flush_backup(held)
            pool.stage_load(held)
            pool.flush_load(held)

    return {op: _runner(pool, staging, 0, cfg)}


def measure_mixin_cell(op: str, n: int, cfg: HostConfig) -> dict[str, dict[str, list[float]]]:
    """Samples of a mixin cell, by operation (reserve gives reserve and release) and implementation."""
    impls = mixin_implementations(queue=op == "reserve")
    pools = {name: half_full(make, n) for name, make in impls.items()}
    runners = {name: _mixin_runners(pool, op, cfg) for name, pool in pools.items()}
    ops = list(next(iter(runners.values())))
    out: dict[str, dict[str, list[float]]] = {o: {name: [] for name in pools} for o in ops}
    names = list(pools)
    for r in range(cfg.repeats):
        for name in names[r % 2 :] + names[: r % 2]:
            for o in ops:  # reserve's sampler runs the burst; release's reads what it spent
                out[o][name].append(runners[name][o]())
    if pools[HOSTPOOL].available_size() != pools[ORIGINAL].available_size():
        raise RuntimeError(f"host tier mixin {op} on {n} pages: the implementations disagree")
    return out


@workload("host", seconds=6)
def host_tier(ctx: Context) -> list[Row]:
    cfg = HostConfig(repeats=ctx.repeats(), min_loop_s=ctx.loop_s())
    if ctx.tiny:
        cfg = HostConfig(alloc_sizes=(64, 256), reserve_sizes=(64,), mixin_sizes=(64,), repeats=1, min_loop_s=0.0)
    rows = []
    todo = cases(cfg)
    with pd_metrics_module():
        for kind, call, n in todo:
            ctx.label(f"host tier {call}, {n} pages" + (" (mixin)" if kind == "mixin" else ""))
            if kind == "pool":
                measured = {call: measure_cell(implementations(), call, n, cfg, None)}
            else:
                measured = measure_mixin_cell(call, n, cfg)
            for op, samples in measured.items():
                pages = cfg.pages if op == "alloc+free" else 1
                params = {"call": op, "pool_pages": n, "pages": pages, "through": kind}
                row = Row(
                    "host tier",
                    params_text(params),
                    "s",
                    {k: median(v) for k, v in samples.items()},
                    samples=samples,
                    columns=(HOSTPOOL, NUMPY),
                    extra=params,
                )
                row.target, row.met = target(params, row.ratios.get(NUMPY))
                rows.append(row)
            ctx.tick(1 / len(todo))
    ctx.notes.append(
        "host tier: hostpool_nb.HostPagePool against the original bookkeeping (hostpool_nb.originals.host_tier, "
        f"Python lists; x numpy is against it). Each pool has half its pages held; a call pair is alloc({cfg.pages}) "
        "then free of those pages, or reserve() then release; both keep allocated flags, generations and pins. "
        "mixin: each operation of the original's class with HostKVPoolMixin against the class alone, side effects "
        "included (PD metrics on the Queue pool, pending transfers and payloads dropped); staging 8 is "
        "stage_backup, flush_backup, stage_load and flush_load of 8 held pages"
    )
    return rows


def params_text(p: dict[str, Any]) -> str:
    """``alloc+free 32, 32K pages``; ``mixin alloc+free 32, 32K`` through the mixin."""
    what = f"{p['call']} {p['pages']}" if p["call"] == "alloc+free" else p["call"]
    size = p["pool_pages"]
    pool = f"{size >> 20}M" if size % (1 << 20) == 0 else f"{size >> 10}K" if size % 1024 == 0 else str(size)
    if p["through"] == "mixin":
        return f"mixin {what}, {pool}"
    return f"{what}, {pool} pages"


def target(p: dict[str, Any], ratio: float | None) -> tuple[str, bool | None]:
    """The host tier's targets: 1000x on alloc+free of 32 at 32,768 pages, 50x on reserve+release there;
    every operation through the mixin at least as fast as the host class alone."""
    if p["through"] == "mixin":
        return ">=1x numpy", None if ratio is None else ratio >= 1.0
    if p["pool_pages"] != 32768:
        return "", None
    bound = 1000.0 if p["call"] == "alloc+free" else 50.0
    return f">={bound:g}x numpy", None if ratio is None else ratio >= bound
