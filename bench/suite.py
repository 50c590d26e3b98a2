"""What to measure in each mode, and the run that turns it into result rows."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import recorded as rec
from . import report
from .compare import revision_before
from .host import HOST_WORKLOAD, HostConfig, measure_host
from .host import cases as host_cases
from .host import params_text as host_params
from .host import target as host_target
from .impls import HOSTPOOL, NUMPY, TORCH, implementations, torch_available
from .memory import MEMORY_PAGE_SIZE, MEMORY_POOL_SLOTS, measure_memory
from .paged_workloads import (
    PAGED_WORKLOAD,
    PagedConfig,
    measure_paged,
    paged_cases,
    paged_implementations,
    paged_steps,
    timer_overhead,
)
from .startup import measure_startup
from .timing import Progress
from .tracking import (
    NEW_TAGS,
    REQUEST_IDS,
    TRACKED,
    UNTRACKED,
    measure_tracking,
    paired,
    site_table_bytes,
    state_bytes_per_page,
)
from .workloads import (
    HOSTPOOL_LIST,
    MIB_SLOTS,
    TRACE_FLOOR,
    Cell,
    make_trace,
    measure_batch,
    measure_floor,
    measure_roundtrip,
    measure_trace,
    roundtrip_pool_size,
)

WORKLOADS = ("roundtrip", "batch", "trace", "tracking", "memory", "startup", "paged", "host")

# The headline cell: single-page round trip, page size 64, 1M-slot pool.
TARGET_CELL = (64, 64, MIB_SLOTS)
BIG_K = 65536
# The batch workload's targeted batch size: one-page requests per batch.
BATCH_TARGET_REQUESTS = 256


@dataclass
class Config:
    """Sizes and repeat counts of one run."""

    mode: str
    roundtrip_cells: list[tuple[int, int, int]]  # (page_size, k, pool_slots)
    # The same round trip from a free list shuffled page by page: no runs.
    shuffled_cells: list[tuple[int, int, int]]
    roundtrip_repeats: int
    roundtrip_min_loop_s: float
    roundtrip_max_loop_s: float
    # Batches of one-page requests; timed loops sized by the round-trip bounds.
    batch_page_size: int
    batch_requests: tuple[int, ...]
    batch_pool_slots: int
    batch_repeats: int
    trace_page_sizes: tuple[int, ...]
    trace_pool_slots: int
    trace_ops: int
    trace_repeats: int
    # The tracking workload: the headline round-trip cell, (page_size, k, pool_slots).
    tracking_cell: tuple[int, int, int]
    tracking_repeats: int
    tracking_new_tags: int  # new tags whose site-table bytes tracemalloc counts
    memory_pool_slots: int
    memory_page_size: int
    memory_torch_pool_slots: int
    startup_repeats: int
    startup_references: tuple[str, ...]
    floor_repeats: int = 5
    min_cycles: int = 3
    seed: int = 0
    workloads: tuple[str, ...] = WORKLOADS
    # --trace PATH: a recorded trace, timed with trace_repeats repeats.
    recorded_trace: str | None = None
    notes: list[str] = field(default_factory=list)
    # hostpool_nb.paged against its numpy oracle (bench/paged_workloads.py).
    paged: PagedConfig = field(default_factory=PagedConfig)
    # HostPagePool against the host tier's original bookkeeping (bench/host.py).
    host: HostConfig = field(default_factory=HostConfig)


def _grid(page_size: int, full: bool) -> list[int]:
    if not full:
        return sorted({page_size, 1024, BIG_K})
    ks, k = [], page_size
    while k < BIG_K:
        ks.append(k)
        k *= 4
    return [*ks, BIG_K]


def quick_config() -> Config:
    cells = []
    for ps in (1, 16, 64):
        for k in _grid(ps, full=False):
            pool = MIB_SLOTS if (ps, k) == TARGET_CELL[:2] else roundtrip_pool_size(ps, k, 4096)
            cells.append((ps, k, pool))
    return Config(
        mode="quick",
        roundtrip_cells=cells,
        shuffled_cells=[(1, BIG_K, MIB_SLOTS)],
        roundtrip_repeats=3,
        roundtrip_min_loop_s=0.02,
        roundtrip_max_loop_s=0.25,
        batch_page_size=64,
        batch_requests=(16, BATCH_TARGET_REQUESTS, 1024),
        batch_pool_slots=MIB_SLOTS,
        batch_repeats=3,
        trace_page_sizes=(1, 64),
        trace_pool_slots=MIB_SLOTS,
        trace_ops=30_000,
        trace_repeats=3,
        tracking_cell=TARGET_CELL,
        tracking_repeats=5,
        tracking_new_tags=4096,
        memory_pool_slots=MEMORY_POOL_SLOTS,
        memory_page_size=MEMORY_PAGE_SIZE,
        memory_torch_pool_slots=MIB_SLOTS,
        startup_repeats=3,
        startup_references=("python",),
        floor_repeats=3,
        paged=PagedConfig(repeats=3, min_iters=1, min_loop_s=0.02, max_loop_s=0.25),
        host=HostConfig(alloc_sizes=(8192, 32768, 131072), repeats=3, min_loop_s=0.02),
    )


def full_config() -> Config:
    cells = [(ps, k, roundtrip_pool_size(ps, k, 16384)) for ps in (1, 16, 64) for k in _grid(ps, full=True)]
    return Config(
        mode="full",
        roundtrip_cells=cells,
        shuffled_cells=[(1, k, MIB_SLOTS) for k in (64, 4096, BIG_K)],
        roundtrip_repeats=7,
        roundtrip_min_loop_s=0.1,
        roundtrip_max_loop_s=2.0,
        batch_page_size=64,
        batch_requests=(16, BATCH_TARGET_REQUESTS, 1024),
        batch_pool_slots=MIB_SLOTS,
        batch_repeats=7,
        trace_page_sizes=(1, 16, 64),
        trace_pool_slots=MIB_SLOTS,
        trace_ops=200_000,
        trace_repeats=5,
        tracking_cell=TARGET_CELL,
        tracking_repeats=9,
        tracking_new_tags=16384,
        memory_pool_slots=MEMORY_POOL_SLOTS,
        memory_page_size=MEMORY_PAGE_SIZE,
        memory_torch_pool_slots=MEMORY_POOL_SLOTS,
        startup_repeats=7,
        startup_references=("python", "numba"),
        floor_repeats=9,
        paged=PagedConfig(repeats=7, min_iters=1, min_loop_s=0.1, max_loop_s=1.0),
        host=HostConfig(repeats=7, min_loop_s=0.1),
    )


def tiny_config(
    workloads: tuple[str, ...] = ("roundtrip", "batch", "trace", "tracking", "memory", "paged", "host"),
) -> Config:
    """Seconds-long sizes for the smoke test (works under NUMBA_DISABLE_JIT=1)."""
    return Config(
        mode="tiny",
        roundtrip_cells=[(16, 16, 1024), (16, 256, 4096)],
        shuffled_cells=[(1, 64, 1024)],
        roundtrip_repeats=1,
        roundtrip_min_loop_s=0.0,
        roundtrip_max_loop_s=0.0,
        batch_page_size=16,
        batch_requests=(4, 16),
        batch_pool_slots=1024,
        batch_repeats=1,
        trace_page_sizes=(16,),
        trace_pool_slots=4096,
        trace_ops=400,
        trace_repeats=1,
        tracking_cell=(16, 16, 1024),
        tracking_repeats=1,
        tracking_new_tags=256,
        memory_pool_slots=4096,
        memory_page_size=16,
        memory_torch_pool_slots=4096,
        startup_repeats=1,
        startup_references=(),
        floor_repeats=1,
        min_cycles=1,
        workloads=workloads,
        paged=PagedConfig(
            free_pages=(32, 128),
            free_request_tokens=64,
            extend_requests=4,
            extend_max_prefix=64,
            extend_max_tokens=48,
            extend_pool_pages=64,
            decode_seqs=16,
            decode_max_len=64,
            decode_pool_pages=128,
            merge_released=48,
            merge_free=32,
            merge_held=16,
            merge_chunk_pages=16,
            repeats=1,
            min_iters=1,
            min_loop_s=0.0,
            max_loop_s=0.0,
        ),
        host=HostConfig(alloc_sizes=(64, 256), reserve_sizes=(64,), mixin_size=64, repeats=1, min_loop_s=0.0),
    )


def _steps(cfg: Config, nimpl: int, recorded: Any = None) -> int:
    """Progress steps of a run (``recorded``: the loaded ``--trace``, if any)."""
    n = 0
    if "roundtrip" in cfg.workloads:
        n += len(cfg.roundtrip_cells) * cfg.roundtrip_repeats * nimpl + len({k for _, k, _ in cfg.roundtrip_cells})
        n += len(cfg.shuffled_cells) * cfg.roundtrip_repeats * nimpl
    if "batch" in cfg.workloads:  # hostpool_nb runs twice: sizes as an array and as a list
        n += len(cfg.batch_requests) * cfg.batch_repeats * (nimpl + 1)
    if "trace" in cfg.workloads:  # the implementations and the trace floor
        n += len(cfg.trace_page_sizes) * cfg.trace_repeats * (nimpl + 1)
    if "tracking" in cfg.workloads:
        n += cfg.tracking_repeats * 3 + 1
    if recorded is not None:
        n += rec.steps_of(recorded, nimpl, cfg.trace_repeats)
    if "memory" in cfg.workloads:
        n += 3 * nimpl
    if "startup" in cfg.workloads:
        n += cfg.startup_repeats * (2 + (nimpl > 2) + len(cfg.startup_references))
    if "paged" in cfg.workloads:  # no torch baseline: always two implementations
        n += paged_steps(cfg.paged)
    if "host" in cfg.workloads:
        n += len(host_cases(cfg.host)) * cfg.host.repeats * 2
    return n


def _at_least(ratios: dict[str, float], name: str, bound: float) -> bool | None:
    r = ratios.get(name)
    return None if r is None else r >= bound


def _slots(n: int) -> str:
    return (
        f"{n >> 20}M"
        if n >= 1 << 20 and n % (1 << 20) == 0
        else f"{n // 1024}K"
        if n >= 1024 and n % 1024 == 0
        else str(n)
    )


def _signed_time(seconds: float) -> str:
    return ("-" if seconds < 0 else "+") + report.fmt_time(abs(seconds))


# -- the texts of the rows ---------------------------------------------------
# Kept here, apart from the measuring, so that the table test can build every
# row a --full run makes. Targets bound the table's ratios, baseline /
# hostpool_nb (higher: hostpool_nb better), and are written that way round.

HEADLINE_TARGET = ">=2x numpy, >=8x torch"
ROUNDTRIP_TARGET = ">=1x torch"  # every round-trip cell, page sizes 1, 16 and 64
BIG_K_TARGET = ">=1.5x torch"  # 65,536 slots at page sizes 16 and 64 (page size 1: ROUNDTRIP_TARGET)
BATCH_TARGET = ">=50x torch"
TRACE_TARGET = ">=5x torch"  # page sizes 16 and 64
TRACE_P1_TARGET = ">=4x torch"
METADATA_TARGET = "<=24 B/page"
# The one target that is no bound on the table's ratios: the tracking rows
# compare hostpool_nb with itself, have no ratio columns, and say so.
TRACKING_TARGET = "tracked <=3x untracked"
TRACKING_BOUND = 3.0
STARTUP_TARGET = ">=2x torch"  # start-up under half of a fresh `import torch`
STARTUP_PARAMS = {"warm": "warm numba cache", "cold": "empty numba cache"}


def roundtrip_params(page_size: int, k: int, pool_slots: int) -> str:
    return f"p{page_size} k={k} pool={_slots(pool_slots)}"


def roundtrip_target(page_size: int, k: int, pool_slots: int, ratios: dict[str, float]) -> tuple[str, bool | None]:
    """The target of a round-trip cell and whether ``ratios`` meet it ("" and None: no target)."""
    if (page_size, k, pool_slots) == TARGET_CELL:
        parts = [_at_least(ratios, NUMPY, 2.0), _at_least(ratios, TORCH, 8.0)]
        return HEADLINE_TARGET, None if parts[0] is None else all(x for x in parts if x is not None)
    if k == BIG_K and page_size > 1:
        return BIG_K_TARGET, _at_least(ratios, TORCH, 1.5)
    return ROUNDTRIP_TARGET, _at_least(ratios, TORCH, 1.0)


def shuffled_params(page_size: int, k: int, pool_slots: int) -> str:
    return f"{roundtrip_params(page_size, k, pool_slots)} shuffled"


def trace_target(page_size: int, ratios: dict[str, float]) -> tuple[str, bool | None]:
    """The target of a KV-cache trace row and whether ``ratios`` meet it."""
    if page_size == 1:
        return TRACE_P1_TARGET, _at_least(ratios, TORCH, 4.0)
    return TRACE_TARGET, _at_least(ratios, TORCH, 5.0)


def floor_params(k: int) -> str:
    return f"k={k} np.copyto"


def trace_floor_row(c: Cell, page_size: int, pool_slots: int, n_ops: int) -> dict[str, Any]:
    """The trace floor's row: the floor's time per call where hostpool_nb's would be.

    Its ratio columns are each baseline's time / the floor's: the most any
    pool at the floor could show against that baseline, to read beside the
    trace row's target. The JSON adds ``hostpool_over_floor``.
    """
    fl = c.extra[TRACE_FLOOR]["per_op"]
    baselines = {name: t for name, t in c.per_op.items() if name != HOSTPOOL}
    return report.row(
        "trace floor",
        trace_params(page_size, pool_slots, n_ops),
        "s/op",
        {HOSTPOOL: fl, **baselines},
        floor_samples=c.extra[TRACE_FLOOR]["samples"],
        hostpool_over_floor=c.per_op[HOSTPOOL] / fl if HOSTPOOL in c.per_op else None,
    )


def trace_floor_note(floor_row: dict[str, Any], page_size: int) -> str:
    """What a trace floor row (:func:`trace_floor_row`) measures, and what it bounds."""
    fl = floor_row["values"][HOSTPOOL]
    best = ", ".join(f"{name} / floor {report.fmt_ratio(r)}" for name, r in floor_row["ratios"].items())
    over_ratio = floor_row["hostpool_over_floor"]
    over = (
        f"; hostpool_nb takes the floor + {report.fmt_time(fl * (over_ratio - 1))} per call "
        f"({report.fmt_ratio(over_ratio)})"
        if over_ratio is not None
        else ""
    )
    return (
        f"trace floor p{page_size}: the same trace on a stand-in that only allocates each alloc's new array, "
        "writes every slot of it and reads every slot a free is given, in one compiled call each, and counts "
        f"the available slots (no lock, no checks, no free list): {report.fmt_time(fl)} per call, a lower bound "
        "for any pool that returns new arrays and checks whole pages. A baseline's time / the floor bounds "
        f"the ratio such a pool can show against it: {best}{over}"
    )


def batch_params(page_size: int, n_requests: int, pool_slots: int, sizes_as_list: bool = False) -> str:
    return f"p{page_size} {n_requests} reqs pool={_slots(pool_slots)}" + (" list" if sizes_as_list else "")


def batch_target(n_requests: int, sizes_as_list: bool, ratios: dict[str, float]) -> tuple[str, bool | None]:
    """The target of a batch row (the int64-sizes row of 256 requests) and whether ``ratios`` meet it."""
    if n_requests == BATCH_TARGET_REQUESTS and not sizes_as_list:
        return BATCH_TARGET, _at_least(ratios, TORCH, 50.0)
    return "", None


def trace_params(page_size: int, pool_slots: int, n_ops: int) -> str:
    return f"p{page_size} pool={_slots(pool_slots)} {n_ops // 1000}K ops"


def memory_params(pool_slots: int, page_size: int, phase: str) -> str:
    return f"{_slots(pool_slots)} slots p{page_size} {phase}"


# The paged rows: hostpool_nb.paged against its numpy oracle, page size 16.
# Each target is stated at one size (the issue tracker's); the other rows
# report. Decimal counts: 62.5k free pages are 1M tokens at page size 16.
PAGED_PAGE_SIZE = 16
PAGED_FREE_TARGET = ">=300x numpy"
PAGED_EXTEND_TARGET = ">=25x numpy"
PAGED_DECODE_TARGET = ">=4x numpy"
PAGED_MERGE_TARGET = ">=4x numpy"
# call -> (the row's params that carry a target, the bound, its text)
PAGED_TARGETS: dict[str, tuple[dict[str, Any], float, str]] = {
    "free": ({"free_pages": 62_500, "request_tokens": 2048}, 300.0, PAGED_FREE_TARGET),
    "alloc_extend": ({"requests": 32, "inputs": "lists"}, 25.0, PAGED_EXTEND_TARGET),
    "alloc_decode": ({"sequences": 256, "inputs": "lists"}, 4.0, PAGED_DECODE_TARGET),
    "merge_and_sort_free": ({"released_pages": 100_000}, 4.0, PAGED_MERGE_TARGET),
}


def _count(n: int) -> str:
    """A decimal count, short: 10k, 62.5k, 1M."""
    if n >= 1_000_000 and n % 100_000 == 0:
        return f"{n / 1_000_000:g}M"
    if n >= 1000 and n % 100 == 0:
        return f"{n / 1000:g}k"
    return str(n)


def paged_params(p: dict[str, Any]) -> str:
    """The params text of a paged row, from its cell's ``params``."""
    call = p["call"]
    if call == "free":
        return f"free {p['request_tokens']} tok, {_count(p['free_pages'])} free"
    if call == "alloc_extend":
        return f"extend {p['requests']} reqs, {p['inputs']}"
    if call == "alloc_decode":
        return f"decode {p['sequences']} seqs, {p['inputs']}"
    return f"merge {_count(p['released_pages'])} released"


def paged_target(p: dict[str, Any], ratios: dict[str, float]) -> tuple[str, bool | None]:
    """The target of a paged row (page size 16, at the issue's sizes) and whether ``ratios`` meet it."""
    where, bound, text = PAGED_TARGETS[p["call"]]
    if p["page_size"] != PAGED_PAGE_SIZE or any(p.get(k) != v for k, v in where.items()):
        return "", None
    return text, _at_least(ratios, NUMPY, bound)


def tracking_params(page_size: int, k: int, pool_slots: int, variant: str) -> str:
    """A tracking time row: the round-trip cell and ``untracked``, ``tracked`` or ``new tags``."""
    return f"{roundtrip_params(page_size, k, pool_slots)} {variant}"


def tracking_state_params(pool_slots: int, page_size: int, variant: str) -> str:
    return f"pool={_slots(pool_slots)} p{page_size} {variant}"


TRACKING_SITES_PARAMS = "site table, per live tag"


def tracking_target(variant: str, tracked_over_untracked: float | None) -> tuple[str, bool | None]:
    """The target of a tracking time row (the reused-tag row only) and whether the ratio meets it."""
    if variant != TRACKED:
        return "", None
    return TRACKING_TARGET, None if tracked_over_untracked is None else tracked_over_untracked <= TRACKING_BOUND


def recorded_params(path: str, n_ops: int) -> str:
    """A recorded trace's row: the file's name and its replayed operations."""
    name = Path(path).name
    count = str(n_ops) if n_ops < 100_000 else f"{n_ops // 1000}K"
    return f"{name} {count} ops"


def run_suite(
    cfg: Config,
    with_torch: bool | None = None,
    progress: Progress | None = None,
    torch_threads: int | None = 1,
    recorded: Any = None,
) -> dict[str, Any]:
    """Run every workload of ``cfg``; return the results document.

    ``recorded`` is ``cfg.recorded_trace`` already loaded (by the command
    line, which checks it before measuring); loaded here when not given.

    ``torch_threads`` sets torch's intra-op threads (``None``: torch's
    default). One thread by default: hostpool_nb and numpy use one, and on a
    shared 2-core machine torch's OpenMP threads wait for each other when a
    core is busy elsewhere (a 1M-slot ``torch.cat`` measured ~125 ms with 2
    threads under load against ~8 ms with 1), which would flatter the ratios.
    """
    if with_torch is None:
        with_torch = torch_available()
    if with_torch and torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)
    impls = implementations(with_torch)
    names = list(impls)
    if cfg.recorded_trace is not None and recorded is None:
        recorded = rec.read(cfg.recorded_trace)
    progress = progress or Progress(_steps(cfg, len(names), recorded), enabled=False)
    tick = progress.step
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    notes = list(cfg.notes)

    if "roundtrip" in cfg.workloads:

        def roundtrip(ps: int, k: int, pool: int, shuffle_seed: int | None = None) -> Cell:
            return measure_roundtrip(
                impls,
                ps,
                k,
                pool,
                cfg.roundtrip_repeats,
                cfg.min_cycles,
                cfg.roundtrip_min_loop_s,
                tick,
                max_loop_s=cfg.roundtrip_max_loop_s,
                shuffle_seed=shuffle_seed,
            )

        cells: list[Cell] = []
        for ps, k, pool in cfg.roundtrip_cells:
            progress.label(f"round trip p{ps} k={k}")
            cells.append(roundtrip(ps, k, pool))
        shuffled: list[Cell] = []
        for ps, k, pool in cfg.shuffled_cells:
            progress.label(f"round trip p{ps} k={k} shuffled")
            shuffled.append(roundtrip(ps, k, pool, shuffle_seed=cfg.seed))
        floors = {}
        for k in sorted({k for _, k, _ in cfg.roundtrip_cells}):
            progress.label(f"copy floor k={k}")
            floors[k] = measure_floor(k, cfg.floor_repeats, cfg.roundtrip_min_loop_s)
            tick()
        for c in cells:
            p = c.params
            ratios = report.row("", "", "s/op", c.per_op)["ratios"]
            target, met = roundtrip_target(p["page_size"], p["k"], p["pool_slots"], ratios)
            rows.append(
                report.row(
                    "round trip",
                    roundtrip_params(p["page_size"], p["k"], p["pool_slots"]),
                    "s/op",
                    c.per_op,
                    target,
                    met,
                    samples=c.samples,
                    cycles_per_loop=p["cycles_per_loop"],
                )
            )
        for c in shuffled:
            p = c.params
            rows.append(
                report.row(
                    "round trip",
                    shuffled_params(p["page_size"], p["k"], p["pool_slots"]),
                    "s/op",
                    c.per_op,
                    samples=c.samples,
                    cycles_per_loop=p["cycles_per_loop"],
                    free_list=p["free_list"],
                )
            )
        if shuffled:
            notes.append(
                "round trip ... shuffled: the same loop on pools whose free list was shuffled page by page first "
                f"(seed {cfg.seed}; FIFO round trips keep it so), so no allocation hands out consecutive pages: "
                "the worst case for hostpool_nb's run paths, which then check and flag every page on its own. "
                "The baselines' slicing and concatenation do not look at the ids, so it costs them nothing; "
                "the row has no target and is there to show what input without runs costs"
            )
        # The memory-traffic floor of the largest allocation, and how close
        # hostpool_nb comes to it at each page size. The row's value is the
        # floor's time; the comparison, floor / hostpool_nb like every other
        # ratio (1x: at the floor), goes to a note.
        kb = max((c.params["k"] for c in cells if HOSTPOOL in c.per_op), default=None)
        if kb is not None:
            fl = floors[kb]
            over = {
                c.params["page_size"]: c.per_op[HOSTPOOL] / fl["copy"]
                for c in cells
                if c.params["k"] == kb and HOSTPOOL in c.per_op
            }
            rows.append(
                report.row(
                    "memory floor",
                    floor_params(kb),
                    "s/op",
                    {HOSTPOOL: fl["copy"]},
                    columns=(HOSTPOOL,),
                    floor_fresh_buffer=fl["fresh"],
                    hostpool_over_floor={f"p{ps}": x for ps, x in over.items()},
                    floor_over_hostpool={f"p{ps}": 1 / x for ps, x in over.items()},
                )
            )
            notes.append(
                f"memory floor: np.copyto of {kb} int64 into a reused buffer (write + read once) takes "
                f"{report.fmt_time(fl['copy'])}, a lower bound for any k={kb} round trip (the row's value); "
                "floor / hostpool_nb round trip (1x: as fast as the copy): "
                + ", ".join(f"p{ps} {report.fmt_ratio(1 / x)}" for ps, x in sorted(over.items(), reverse=True))
            )
        raw["roundtrip"] = [asdict(c) for c in cells]
        raw["roundtrip_shuffled"] = [asdict(c) for c in shuffled]
        raw["floors"] = floors

    if "batch" in cfg.workloads:
        ps, pool = cfg.batch_page_size, cfg.batch_pool_slots
        bcells: list[Cell] = []
        for nreq in cfg.batch_requests:
            progress.label(f"batch p{ps} {nreq} reqs")
            bcells.append(
                measure_batch(
                    impls,
                    ps,
                    nreq,
                    pool,
                    cfg.batch_repeats,
                    cfg.min_cycles,
                    cfg.roundtrip_min_loop_s,
                    tick,
                    max_loop_s=cfg.roundtrip_max_loop_s,
                )
            )
        for c in bcells:
            nreq = c.params["n_requests"]
            baselines = [n for n in c.per_op if n not in (HOSTPOOL, HOSTPOOL_LIST)]
            for as_list in (False, True):
                ours = HOSTPOOL_LIST if as_list else HOSTPOOL
                values = {HOSTPOOL: c.per_op[ours], **{n: c.per_op[n] for n in baselines}}
                samples = {HOSTPOOL: c.samples[ours], **{n: c.samples[n] for n in baselines}}
                ratios = report.row("", "", "s/batch", values)["ratios"]
                target, met = batch_target(nreq, as_list, ratios)
                rows.append(
                    report.row(
                        "batch round trip",
                        batch_params(ps, nreq, pool, as_list),
                        "s/batch",
                        values,
                        target,
                        met,
                        samples=samples,
                        sizes="list" if as_list else "int64 array",
                        cycles_per_loop=c.params["cycles_per_loop"],
                        merges_per_loop=c.extra["merges_per_loop"],
                    )
                )
        extra_cost = ", ".join(
            f"{c.params['n_requests']} reqs {_signed_time(c.per_op[HOSTPOOL_LIST] - c.per_op[HOSTPOOL])} "
            f"({c.per_op[HOSTPOOL_LIST] / c.per_op[HOSTPOOL] - 1:+.0%})"
            for c in bcells
        )
        notes.append(
            f"batch round trip p{ps}: per batch of n one-page requests on a {_slots(pool)}-slot pool, hostpool_nb "
            "runs slots, offsets = pool.alloc_many(sizes) with sizes a prebuilt int64 array, then one "
            f"pool.free(slots); the baselines, which have no batch call, run n alloc({ps}) then n free calls. "
            "Rows marked list: hostpool_nb given sizes as a Python list, which alloc_many converts on every "
            f"call: {extra_cost} per batch over the int64 array. Timed loops cover whole pool cycles (one "
            "merge per cycle everywhere); the slots of the first batch on a fresh pool and of the first batch "
            "after the timed loops, and the merge counts, were checked equal on every implementation"
        )
        raw["batch"] = [asdict(c) for c in bcells]

    if "trace" in cfg.workloads:
        raw["trace"] = []
        for ps in cfg.trace_page_sizes:
            progress.label(f"trace p{ps}: generating")
            trace = make_trace(cfg.trace_pool_slots, ps, cfg.trace_ops, cfg.seed)
            progress.label(f"trace p{ps}: {len(trace.ops)} ops")
            c = measure_trace(impls, trace, cfg.trace_repeats, tick, floor=True)
            raw["trace"].append(asdict(c))
            ratios = report.row("", "", "s/op", c.per_op)["ratios"]
            rows.append(
                report.row(
                    "KV-cache trace",
                    trace_params(ps, cfg.trace_pool_slots, len(trace.ops)),
                    "s/op",
                    c.per_op,
                    *trace_target(ps, ratios),
                    samples=c.samples,
                    trace=trace.stats,
                    merges=c.extra["merges_per_replay"],
                )
            )
            rows.append(trace_floor_row(c, ps, cfg.trace_pool_slots, len(trace.ops)))
            notes.append(trace_floor_note(rows[-1], ps))
            st = trace.stats
            notes.append(
                f"trace p{ps}: {st['ops']} ops ({st['allocs']} allocs, {st['frees']} frees, "
                f"{st['failed_allocs']} allocs answered None then retried), "
                f"mean request {st['mean_request_slots']:.0f} slots, "
                f"pool {st['mean_fill']:.0%} full on average at arrivals, {st['pool_cycles']:.1f} pool cycles, "
                f"merges per replay {c.extra['merges_per_replay']}"
                + ("" if st["ops"] >= 100_000 else "; quick mode: fewer than 100,000 ops (--full runs 200,000)")
            )

    if recorded is not None:
        path = cfg.recorded_trace or "trace"
        progress.label(f"recorded trace {Path(path).name}")
        c = rec.measure_recorded(impls, recorded, path, cfg.trace_repeats, tick)
        raw["recorded_trace"] = asdict(c)
        p = c.params
        skipped = c.extra["baselines_skipped"]
        rows.append(
            report.row(
                "recorded trace",
                recorded_params(path, p["replayed"]),
                "s/op",
                c.per_op,
                samples=c.samples,
                columns=(HOSTPOOL,) if skipped else report.IMPL_COLUMNS,
                trace=p,
                merges=c.extra["merges_per_replay"],
                calls_per_replay=c.extra["calls_per_replay"],
                baselines_skipped=skipped,
            )
        )
        calls = ", ".join(f"{n} {name}" for name, n in p["calls"].items())
        unreadable = (
            f"; {p['not_replayable']} not replayable (unreadable argument), left out" if p["not_replayable"] else ""
        )
        notes.append(
            f"recorded trace {path}: {p['replayed']} calls ({calls}; {p['errors']} raised) on "
            f"{p['pool']}(size={p['size']}, page_size={p['page_size']}, merge={p['merge']!r}, track={p['track']})"
            f"{unreadable}, each repeat on a fresh pool; time per recorded call. hostpool_nb makes every call, "
            "the ones that raised included (expecting their errors), on a pool made as the recorded one"
            + (
                f"; the baselines were not run: {skipped}"
                if skipped
                else "; the baselines make the calls a scheduler on the original would: alloc_many as one alloc "
                "of the total, a free group's frees at its end, merge() as nothing (they merge when needed), "
                "calls that raised left out"
            )
            + ". Every allocation's slots were checked against the trace, on every implementation, before timing"
        )

    if "tracking" in cfg.workloads:
        ps, k, pool = cfg.tracking_cell
        progress.label(f"tracking p{ps} k={k}")
        c = measure_tracking(
            ps,
            k,
            pool,
            cfg.tracking_repeats,
            cfg.min_cycles,
            cfg.roundtrip_min_loop_s,
            tick,
            max_loop_s=cfg.roundtrip_max_loop_s,
        )
        progress.label("tracking: metadata")
        state = state_bytes_per_page(pool, ps)
        per_tag = site_table_bytes(ps, cfg.tracking_new_tags)
        tick()
        raw["tracking"] = {**asdict(c), "state_bytes_per_page": state, "site_table_bytes_per_live_tag": per_tag}
        over = {v: c.per_op[v] / c.per_op[UNTRACKED] for v in (TRACKED, NEW_TAGS)}
        spread = {v: paired(c.samples, v, UNTRACKED) for v in (TRACKED, NEW_TAGS)}
        for variant in (UNTRACKED, TRACKED, NEW_TAGS):
            target, met = tracking_target(variant, over.get(variant))
            rows.append(
                report.row(
                    "tracking",
                    tracking_params(ps, k, pool, variant),
                    "s/op",
                    {HOSTPOOL: c.per_op[variant]},
                    target,
                    met,
                    columns=(HOSTPOOL,),
                    variant=variant,
                    samples_s=c.samples[variant],
                    over_untracked=over.get(variant),
                    paired_over_untracked=spread.get(variant),
                    cycles_per_loop=c.params["cycles_per_loop"],
                )
            )
        rows.extend(
            report.row(
                "tracking state",
                tracking_state_params(pool, ps, variant),
                "B/page",
                {HOSTPOOL: state[variant]},
                columns=(HOSTPOOL,),
                variant=variant,
            )
            for variant in (UNTRACKED, TRACKED)
        )
        rows.append(
            report.row(
                "tracking state",
                TRACKING_SITES_PARAMS,
                "B/tag",
                {HOSTPOOL: per_tag},
                columns=(HOSTPOOL,),
                new_tags_counted=cfg.tracking_new_tags,
            )
        )

        def ratio(v: str) -> str:
            s = spread[v]
            return f"{report.fmt_ratio(over[v])}" + (f" (paired {s['min']:.2f}..{s['max']:.2f})" if s else "")

        cell = roundtrip_params(ps, k, pool)
        met = over[TRACKED] <= TRACKING_BOUND
        notes.append(
            f"tracking {cell}: free(alloc({k})) on an untracked pool and on pools made with track=True, "
            f"interleaved; no ratio columns (hostpool_nb against itself). tracked: alloc({k}, tag=request id), "
            f"{REQUEST_IDS} int ids reused, each already in the pool's site table: tracked / untracked = "
            f"{ratio(TRACKED)}, target {TRACKING_TARGET}: {'met' if met else 'NOT met'}. new tags: a "
            f"never-seen id on every call (each adds a table entry; a fresh pool per repeat): {ratio(NEW_TAGS)}"
        )
        notes.append(
            f"tracking metadata: the state array is {state[UNTRACKED]:.2f} B/page untracked and "
            f"{state[TRACKED]:.2f} B/page tracked (+{state['added']:.0f}: two int64 words per page, its "
            "allocation's number and the ids of the sites that allocated and last freed it), the pools' "
            "_st.nbytes, checked against _kernels.state_length; the site table keeps about "
            f"{per_tag:.0f} B per live (call site, tag) (tracemalloc over {cfg.tracking_new_tags} "
            "pages held with new tags, less the same untracked), for at most two entries per page "
            "plus those added since its last sweep: a tag per request does not grow it without bound"
        )
        rev = revision_before("hostpool_nb/_tracking.py") or "REV"
        notes.append(
            f"tracking off against the code before tracking: python -m bench.compare {rev} --only-cells "
            f"{ps}:{k} times this checkout's untracked pool and that revision's in one process, interleaved "
            "(target: within 5%, ratio >= 0.95x)"
        )

    if "memory" in cfg.workloads:
        mem = {}
        for name, make in impls.items():
            size = cfg.memory_torch_pool_slots if name == TORCH else cfg.memory_pool_slots
            progress.label(f"memory {name} {_slots(size)} slots")
            mem[name] = measure_memory(make, size, cfg.memory_page_size, cfg.seed, tick=tick)
        raw["memory"] = mem
        built = {n: m["built_per_page"] for n, m in mem.items()}
        peak = {n: m["peak_per_page"] for n, m in mem.items()}
        rows.append(
            report.row(
                "metadata held", memory_params(cfg.memory_pool_slots, cfg.memory_page_size, "built"), "B/page", built
            )
        )
        rows.append(
            report.row(
                "metadata peak",
                memory_params(cfg.memory_pool_slots, cfg.memory_page_size, "merge"),
                "B/page",
                peak,
                METADATA_TARGET,
                peak[HOSTPOOL] <= 24.0,
                released_per_page={n: m["released_per_page"] for n, m in mem.items()},
            )
        )
        if TORCH in mem and cfg.memory_torch_pool_slots != cfg.memory_pool_slots:
            notes.append(
                f"memory: torch measured on {_slots(cfg.memory_torch_pool_slots)} slots in {cfg.mode} mode "
                "(one-page torch frees are slow; bytes per page do not depend on the pool size); --full uses "
                f"{_slots(cfg.memory_pool_slots)}"
            )
        notes.append(
            "memory peak: every page freed one per call in random order, then an alloc forces the merge; "
            "baselines' release list holds one array object per chunk, and the merge copies the whole free list"
        )

    if "startup" in cfg.workloads:
        progress.label("start-up (fresh processes)")
        su = measure_startup(cfg.startup_repeats, with_torch, cfg.startup_references, tick)
        raw["startup"] = su
        torch_s = su[TORCH]["median"] if TORCH in su else None
        for key in ("warm", "cold"):
            values = {HOSTPOOL: su[key]["median"]}
            if torch_s is not None:
                values[TORCH] = torch_s
            target = STARTUP_TARGET if key == "warm" else ""
            met = _at_least(report.row("", "", "s", values)["ratios"], TORCH, 2.0) if target else None
            rows.append(
                report.row("start-up", STARTUP_PARAMS[key], "s", values, target, met, columns=(HOSTPOOL, TORCH))
            )
        refs = ", ".join(f"{n}: {report.fmt_time(su[n]['median'])}" for n in cfg.startup_references if n in su)
        notes.append(
            f"start-up: wall time of a fresh `python -c` process, median of {cfg.startup_repeats}, running "
            "import hostpool_nb; p=LogicalHostPool(1<<20,64); p.free(p.alloc(64)) - "
            "x torch = the same for `import torch` / hostpool_nb's" + (f"; references ({refs})" if refs else "")
        )

    if "paged" in cfg.workloads:
        _run_paged(cfg, progress, tick, rows, notes, raw)

    if "host" in cfg.workloads:
        _run_host(cfg, progress, tick, rows, notes, raw)

    if with_torch:
        import torch

        notes.append(f"torch runs with {torch.get_num_threads()} intra-op thread(s) (--torch-threads)")
    progress.close()
    return {
        "schema": 1,
        "mode": cfg.mode,
        "machine": report.machine_info(),
        "torch": with_torch,
        "torch_threads": torch_threads,
        "config": asdict(cfg),
        "rows": rows,
        "notes": notes,
        "raw": raw,
        "elapsed_s": time.perf_counter() - t_start,
    }


def _run_host(
    cfg: Config,
    progress: Progress,
    tick: Callable[[], None],
    rows: list[dict[str, Any]],
    notes: list[str],
    raw: dict[str, Any],
) -> None:
    """The host tier's rows: HostPagePool (and the mixin) against the original bookkeeping; no torch."""
    hc = cfg.host
    progress.label("host tier")
    cells = measure_host(hc, tick)
    for c in cells:
        ratio = report.row("", "", "s/call", c.per_op)["ratios"].get(NUMPY)
        target, met = host_target(c.params, ratio)
        rows.append(
            report.row(
                HOST_WORKLOAD,
                host_params(c.params),
                "s/call",
                c.per_op,
                target,
                met,
                samples=c.samples,
                columns=(HOSTPOOL, NUMPY),
                case=c.params,
            )
        )
    notes.append(
        "host tier: hostpool_nb.HostPagePool against bench/host_baselines.py, the bookkeeping of sglang-jax's "
        "LRUHostKVPool as SPEC-host describes it (x numpy is against that Python-list original; no torch). "
        f"Each pool has half its pages held; a call pair is alloc({hc.pages}) then free of those pages, or "
        "reserve() then release; both sides keep allocated flags, generations and pin counts. mixin: the same "
        "calls through HostKVPoolMixin on the original's class, which also drop each freed page's transfers "
        f"and payload. Medians of {hc.repeats} interleaved samples"
    )
    raw["host"] = {"cells": [asdict(c) for c in cells]}


def _run_paged(
    cfg: Config,
    progress: Progress,
    tick: Callable[[], None],
    rows: list[dict[str, Any]],
    notes: list[str],
    raw: dict[str, Any],
) -> None:
    """The paged workload's rows and notes (hostpool_nb.paged against the numpy oracle; no torch)."""
    pc = cfg.paged
    impls = paged_implementations()
    overhead = timer_overhead()
    cells: list[Cell] = []
    for case in paged_cases(pc):
        size = {k: v for k, v in case.items() if k not in ("page_size", "call")}
        progress.label(f"paged {case['call']} " + " ".join(f"{v}" for v in size.values()))
        cells.append(measure_paged(impls, pc, case, cfg.seed, tick))
    for c in cells:
        ratios = report.row("", "", "s/call", c.per_op)["ratios"]
        target, met = paged_target(c.params, ratios)
        rows.append(
            report.row(
                PAGED_WORKLOAD,
                paged_params(c.params),
                "s/call",
                c.per_op,
                target,
                met,
                samples=c.samples,
                columns=(HOSTPOOL, NUMPY),
                case=c.params,
                iterations_per_sample=c.extra["iterations_per_sample"],
                sample_means=c.extra["sample_means"],
            )
        )
    ps = pc.page_size
    by_call: dict[str, list[Cell]] = {}
    for c in cells:
        by_call.setdefault(c.params["call"], []).append(c)
    notes.append(
        f"paged allocator (page size {ps}): hostpool_nb.paged.PagedTokenToKVPoolAllocator against "
        "bench/paged_baselines.py, sglang-jax's allocator algorithm in numpy from SPEC-paged (no torch "
        "baseline: x torch reads -). Every iteration is one call, timed alone, on a state set up outside the "
        f"timed region; a sample is the median call of its iterations (the clock adds {report.fmt_time(overhead)} "
        f"per call), the row the median of {pc.repeats} interleaved samples; sample means, paired ratios and "
        "iteration counts are in --json. Before and after timing, one call's arguments (set-up results), "
        "result (values and dtype) and the lists after it and after a merge were checked equal on both"
    )
    raw["paged"] = {"cells": [asdict(c) for c in cells], "timer_overhead_s": overhead}
    if "free" in by_call:
        small, big = by_call["free"][0], by_call["free"][-1]
        flatness = {name: big.per_op[name] / small.per_op[name] for name in big.per_op}
        raw["paged"]["free_flatness"] = {"free_pages": [small.params["free_pages"], big.params["free_pages"]]}
        raw["paged"]["free_flatness"].update(flatness)
        tok = small.params["request_tokens"]
        notes.append(
            f"paged free: a pool of {ps}*(N + {tok // ps}) tokens; before each timed call a {tok}-token request "
            "is allocated (untimed), leaving exactly N pages on the free and release lists, which the oracle's "
            "free scans (the allocation merges them, untimed, when the free list runs short); timed: one free of "
            "the request's slots as an int32 array, as sglang-jax passes device indices. Flatness, time at "
            f"{_count(big.params['free_pages'])} free pages / at {_count(small.params['free_pages'])}: "
            f"hostpool_nb {report.fmt_ratio(flatness[HOSTPOOL])} ({report.fmt_time(small.per_op[HOSTPOOL])} -> "
            f"{report.fmt_time(big.per_op[HOSTPOOL])}), numpy {report.fmt_ratio(flatness[NUMPY])}"
        )
    batch_texts = []
    if "alloc_extend" in by_call:
        ext = by_call["alloc_extend"][0].params
        batch_texts.append(
            f"extend: {ext['requests']} requests (seed {ext['seed']}), prefixes 0-{pc.extend_max_prefix} tokens "
            f"({ext['prefix_tokens']} in all), extensions 1-{pc.extend_max_tokens} ({ext['extend_tokens']} "
            f"tokens, new pages: {ext['new_pages']}) on a {_count(ext['pool_tokens'])}-token pool"
        )
    if "alloc_decode" in by_call:
        dec = by_call["alloc_decode"][0].params
        batch_texts.append(
            f"decode: {dec['sequences']} sequences of 1-{pc.decode_max_len} tokens (seed {dec['seed']}) gain "
            f"one, new pages: {dec['new_pages']}, on a {_count(dec['pool_tokens'])}-token pool"
        )
    if batch_texts:
        notes.append(
            "paged extend/decode: the requests made first by alloc_extend from empty (last_loc their last "
            "slots), restore_state of that state before each call (untimed). "
            + ". ".join(batch_texts)
            + ". lists: Python lists, as sglang-jax passes them; arrays: int64 numpy arrays; both "
            "implementations get the same"
        )
    if "merge_and_sort_free" in by_call:
        mer = by_call["merge_and_sort_free"][0].params
        notes.append(
            f"paged merge: a pool of {_count(mer['free_pages'])} free, {_count(mer['released_pages'])} released "
            f"and {_count(mer['held_pages'])} allocated pages; the released ones picked at random (seed "
            f"{mer['seed']}) and freed {mer['chunk']} pages per call, every slot; restore_state before each merge "
            "(untimed). hostpool_nb merges by one pass over the pool's page flags (allocated pages included), "
            "the oracle by sorting the free and release lists together"
        )
