"""sglang's HiCache host tier: the ``HostKVCache`` family's bookkeeping, sglang's own against hostpool_nb's.

Both sides are the same classes (the stand-ins' constructors, so no KV bytes
are allocated) with their bookkeeping methods from one source: sglang's own
read from its wheel when ``HOSTPOOL_NB_SGLANG_WHEEL`` names it, else the
stand-ins written from docs/behaviour.md section 5. hostpool_nb's side has
those methods replaced as ``install()`` replaces them on the engine's
classes, so each call goes through what the engine calls: torch tensors in
and out, the pool's own lock. The "x torch" column is the original's time
over hostpool_nb's. Before a cell is timed both sides must hand out the
same slots.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .core import HOSTPOOL, TORCH, Context, Row, fmt_count, workload
from .timing import gc_paused, interleaved, median

TRACKED = "tracked"


@dataclass(frozen=True)
class Cell:
    """One timed operation: ``cls`` built with ``kwargs``, then ``pattern`` of ``slots`` slots a cycle."""

    cls: str
    kwargs: tuple[tuple[str, Any], ...]
    pattern: str  # "alloc+free": one alloc, its free; "write-back": many small allocs, freed shuffled
    slots: int
    target: float | None = None  # ratio to the original this cell must reach

    @property
    def page_size(self) -> int:
        kwargs = dict(self.kwargs)
        return int(kwargs["args"][2] if "args" in kwargs else kwargs.get("page_size", 1))

    @property
    def params(self) -> str:
        what = f"{self.pattern} {fmt_count(self.slots)}"
        cls = self.cls.replace("TokenToKVPoolHost", "").replace("HostPool", "").replace("PoolHost", "")
        return f"{cls} p{self.page_size} {what}"


def cells(tiny: bool) -> list[Cell]:
    capacity = (1 << 12) if tiny else (1 << 18)

    def base(page_size: int) -> tuple[tuple[str, Any], ...]:
        return (("page_size", page_size), ("host_token_capacity", capacity))

    big = (1 << 10) if tiny else 65536
    return [
        Cell("MHATokenToKVPoolHost", base(1), "alloc+free", 1, 5.0),
        Cell("MHATokenToKVPoolHost", base(16), "alloc+free", 16, 5.0),
        Cell("MHATokenToKVPoolHost", base(64), "alloc+free", 64, 5.0),
        Cell("MHATokenToKVPoolHost", base(64), "alloc+free", 4096),
        Cell("MHATokenToKVPoolHost", base(1), "alloc+free", big, None if tiny else 20.0),
        Cell("MHATokenToKVPoolHost", base(16), "write-back", 64 * 32),
        Cell("MambaPoolHost", (("host_token_capacity", capacity),), "alloc+free", 1),
        Cell("DeepSeekV4PagedHostPool", (("args", ("c4", capacity // 64, 64)),), "alloc+free", 64),
    ]


def _classes() -> tuple[dict[str, type], dict[str, type], str]:
    """The original's classes, hostpool_nb's (the same, with install()'s methods), and where the originals came from."""
    from hostpool_nb.integrations import _sglang_host, sglang
    from hostpool_nb.originals import _sglang_wheel, sglang_host

    path = _sglang_wheel.wheel_path()
    if path is not None and _sglang_wheel.version(path) == sglang.TESTED_VERSION:
        made: Callable[[], dict[str, type]] = lambda: _sglang_wheel.hierarchy(path)  # noqa: E731
        source = f"sglang {sglang.TESTED_VERSION}'s own methods, from {path.name}"
    else:
        made, source = sglang_host.hierarchy, "the stand-ins (hostpool_nb.originals.sglang_host; no sglang wheel named)"
    original, ours = made(), made()
    _sglang_host.take_over(ours)
    return original, ours, source


def _build(classes: dict[str, type], cell: Cell, track: bool = False) -> Any:
    kwargs = dict(cell.kwargs)
    args = kwargs.pop("args", ())
    before = os.environ.get("HOSTPOOL_NB_TRACK")
    os.environ["HOSTPOOL_NB_TRACK"] = "1" if track else "0"
    try:
        return classes[cell.cls](*args, **kwargs)  # the constructor's clear() reads the setting
    finally:
        if before is None:
            del os.environ["HOSTPOOL_NB_TRACK"]
        else:
            os.environ["HOSTPOOL_NB_TRACK"] = before


def _cycle(pool: Any, cell: Cell) -> Callable[[], list[int]]:
    """One cycle of the cell's pattern on ``pool``; the slots it handed out, in order."""
    alloc, free = pool.alloc, pool.free
    if cell.pattern == "alloc+free":

        def one() -> list[int]:
            got = alloc(cell.slots)
            free(got)
            return got

        return one
    # HiCache's write-back: a host copy per finished request's few pages, evicted later in LRU order, not allocation
    # order. 32 allocations of 64 slots (4 pages), freed in a fixed shuffled order.
    order = list(range(32))
    random.Random(0).shuffle(order)

    def write_back() -> list[int]:
        got = [alloc(64) for _ in range(32)]
        for i in order:
            free(got[i])
        return got

    return write_back


def _runner(step: Callable[[], Any], min_loop_s: float, max_calls: int = 20000) -> Callable[[], float]:
    calls = 1

    def one() -> float:
        nonlocal calls
        while True:
            with gc_paused():
                t0 = time.perf_counter()
                for _ in range(calls):
                    step()
                elapsed = time.perf_counter() - t0
            if elapsed >= min_loop_s or calls >= max_calls:
                return elapsed / calls
            calls = min(max_calls, max(calls * 2, int(calls * min_loop_s / max(elapsed, 1e-9))))

    return one


def _ids(got: Any) -> Any:
    if isinstance(got, list):
        return [_ids(g) for g in got]
    return None if got is None else got.tolist()


def measure(
    cell: Cell, original: dict[str, type], ours: dict[str, type], repeats: int, loop_s: float
) -> dict[str, Any]:
    pools = {TORCH: _build(original, cell), HOSTPOOL: _build(ours, cell), TRACKED: _build(ours, cell, track=True)}
    steps = {name: _cycle(pool, cell) for name, pool in pools.items()}
    firsts = {name: _ids(step()) for name, step in steps.items()}
    if firsts[TORCH] != firsts[HOSTPOOL] or firsts[TORCH] != firsts[TRACKED] or firsts[TORCH] is None:
        raise RuntimeError(f"hicache {cell.params}: the implementations disagree on the first cycle")
    samples = interleaved({name: _runner(step, loop_s) for name, step in steps.items()}, repeats)
    sizes = {name: pool.available_size() for name, pool in pools.items()}
    if len(set(sizes.values())) != 1:
        raise RuntimeError(f"hicache {cell.params}: available_size differs after timing: {sizes}")
    return samples


# -- the page-interleaved pool (KV sharding): its frees, one page and 64 pages, on a half-full pool ----------------

INTERLEAVE_PAGE = 64
INTERLEAVE_CLASSES = 4


def _interleave_classes() -> tuple[type, type]:
    """sglang's ``PageInterleaveHostPool`` (the wheel's methods, else the stand-in's), and the same with install()'s."""
    from hostpool_nb.integrations import _sglang_interleave, sglang
    from hostpool_nb.originals import _sglang_wheel, sglang_host

    path = _sglang_wheel.wheel_path()
    if path is not None and _sglang_wheel.version(path) == sglang.TESTED_VERSION:

        def made() -> type:
            return _sglang_wheel.interleave_classes(path)["PageInterleaveHostPool"]
    else:

        def made() -> type:
            return sglang_host.hierarchy()["PageInterleaveHostPool"]

    original, ours = made(), made()
    own = {name: vars(ours)[name] for name in sglang.PAGE_INTERLEAVE.methods}
    for name, fn in _sglang_interleave.methods(own, lambda pool, kept: None).items():
        setattr(ours, name, fn)
    return original, ours


def _interleaved(cls: type, pages: int) -> Any:
    from hostpool_nb.originals import sglang_host

    rows = (pages // INTERLEAVE_CLASSES + 1) * INTERLEAVE_PAGE
    host = sglang_host.hierarchy()["MHATokenToKVPoolHost"](page_size=INTERLEAVE_PAGE, host_token_capacity=rows)
    return cls(host, shard_size=INTERLEAVE_CLASSES)


def _half_full(pool: Any, pages: int) -> None:
    """Hold about half the pages, in chunks of 1-32 pages freed in a shuffled order: lists as a server's look."""
    rnd = random.Random(1)
    held = []
    while len(held) * INTERLEAVE_PAGE < pages * INTERLEAVE_PAGE // 2:
        got = pool.alloc(INTERLEAVE_PAGE * rnd.randint(1, 32), start_owner=rnd.randrange(INTERLEAVE_CLASSES))
        held += [got[i : i + INTERLEAVE_PAGE] for i in range(0, got.shape[0], INTERLEAVE_PAGE)]
    rnd.shuffle(held)
    for page in held[: len(held) // 4]:
        pool.free(page)


def _free_runner(pool: Any, pages: int, loop_s: float) -> Callable[[], float]:
    """The seconds of one ``free`` of ``pages`` pages just allocated (the alloc untimed)."""
    alloc, free, clock = pool.alloc, pool.free, time.perf_counter
    need = pages * INTERLEAVE_PAGE

    def one() -> float:
        spent, calls, owner = 0.0, 0, 0
        with gc_paused():
            while spent < loop_s or calls < 3:
                got = alloc(need, start_owner=owner)
                owner += 1
                t0 = clock()
                free(got)
                spent += clock() - t0
                calls += 1
        return spent / calls

    return one


def interleave_rows(ctx: Context) -> list[Row]:
    import torch

    pages = (1 << 10) if ctx.tiny else 65536
    original, ours = _interleave_classes()
    pools = {TORCH: _interleaved(original, pages), HOSTPOOL: _interleaved(ours, pages)}
    for pool in pools.values():
        _half_full(pool, pages)
    rows = []
    for freed in (1, 64):
        ctx.label(f"sglang host tier, PageInterleave free {freed} pages")
        firsts = {name: pool.alloc(freed * INTERLEAVE_PAGE, start_owner=3).tolist() for name, pool in pools.items()}
        if firsts[TORCH] != firsts[HOSTPOOL]:
            raise RuntimeError("hicache interleave: the implementations disagree on the first allocation")
        for name, pool in pools.items():
            pool.free(torch.tensor(firsts[name]))
        s = interleaved({name: _free_runner(pool, freed, ctx.loop_s()) for name, pool in pools.items()}, ctx.repeats(5))
        if pools[TORCH].available_size() != pools[HOSTPOOL].available_size():
            raise RuntimeError("hicache interleave: available_size differs after timing")
        row = Row(
            "sglang host tier",
            f"PageInterleave p{INTERLEAVE_PAGE} free {freed} page{'s' if freed > 1 else ''} of {fmt_count(pages)}",
            "s",
            {HOSTPOOL: median(s[HOSTPOOL]), TORCH: median(s[TORCH])},
            columns=(HOSTPOOL, TORCH),
            samples={HOSTPOOL: s[HOSTPOOL], TORCH: s[TORCH]},
            extra={"cls": "PageInterleaveHostPool", "pattern": "free", "slots": freed * INTERLEAVE_PAGE},
        )
        if not ctx.tiny:
            row.at_least(TORCH, 10.0)
        rows.append(row)
    return rows


# -- the unified backing (hybrid sliding-window models): alloc+free pairs on a 70%-full envelope -------------------

ENVELOPE_SIDES = {"full": (64, 1024, "up"), "swa": (64, 512, "down")}  # pages of 64 tokens; the full side's twice


def _envelope_classes() -> tuple[type, type]:
    """sglang's backing (the wheel's class, else the stand-in), and the same with install()'s methods."""
    from hostpool_nb.integrations import _sglang_envelope, sglang
    from hostpool_nb.originals import _sglang_wheel, sglang_host

    path = _sglang_wheel.wheel_path()
    if path is not None and _sglang_wheel.version(path) == sglang.TESTED_VERSION:

        def made() -> type:
            return _sglang_wheel.envelope_backing_class(path)
    else:

        def made() -> type:
            return sglang_host.hierarchy()["_SharedPageEnvelopeHostBacking"]

    original, ours = made(), made()
    own = {name: vars(ours)[name] for name in sglang.UNIFIED_ENVELOPE.methods}
    for name, fn in _sglang_envelope.methods(own, lambda pool, kept: None).items():
        setattr(ours, name, fn)
    return original, ours


class _Churn:
    """A server's host tier in miniature: requests of 1-32 pages on either side, one freed for each allocated."""

    def __init__(self, backing: Any, pages: int) -> None:
        import torch

        self.backing, self.rnd, self.held = backing, random.Random(7), []
        self.tensor = torch.tensor
        full = ENVELOPE_SIDES["full"][1] * pages
        while backing.free_bytes() > full * 0.3:  # about 70% of the envelope's bytes held
            self.alloc()
        self.rnd.shuffle(self.held)

    def alloc(self) -> Any:
        name = self.rnd.choice(("full", "swa"))
        got = self.backing.alloc(name, 64 * self.rnd.randint(1, 32))
        if got is not None:
            self.held.append((name, got))
        return got

    def pair(self) -> float:
        """One free of a random held request, then one allocation: the seconds they took (the draws untimed)."""
        name, slots = self.held.pop(self.rnd.randrange(len(self.held)))
        side, need = self.rnd.choice(("full", "swa")), 64 * self.rnd.randint(1, 32)
        backing, clock = self.backing, time.perf_counter
        t0 = clock()
        backing.free(name, slots)
        got = backing.alloc(side, need)
        took = clock() - t0
        if got is not None:
            self.held.append((side, got))
        if got is None and self.held:  # full: give one more back, untimed
            name, slots = self.held.pop(0)
            self.backing.free(name, slots)
        return took


def _pair_runner(churn: _Churn, loop_s: float) -> Callable[[], float]:
    def one() -> float:
        spent, calls = 0.0, 0
        with gc_paused():
            while spent < loop_s or calls < 3:
                spent += churn.pair()
                calls += 1
        return spent / calls

    return one


def envelope_rows(ctx: Context) -> list[Row]:
    from hostpool_nb.originals import _sglang_wheel

    original, ours = _envelope_classes()
    rows = []
    for pages in (1 << 10,) if ctx.tiny else (16384, 131072):
        ctx.label(f"sglang host tier, unified envelope {fmt_count(pages)} pages")
        total = ENVELOPE_SIDES["full"][1] * pages
        churns = {
            TORCH: _Churn(_sglang_wheel.envelope_backing(original, total, ENVELOPE_SIDES), pages),
            HOSTPOOL: _Churn(_sglang_wheel.envelope_backing(ours, total, ENVELOPE_SIDES), pages),
        }
        for _ in range(20):  # the same pairs give the same slots (the timing loops then run apart)
            for churn in churns.values():
                churn.pair()
            theirs, mine = ([s.tolist() for _, s in c.held] for c in churns.values())
            if theirs != mine:
                raise RuntimeError("hicache envelope: the implementations disagree")
        s = interleaved({name: _pair_runner(c, ctx.loop_s()) for name, c in churns.items()}, ctx.repeats(5))
        row = Row(
            "sglang host tier",
            f"unified envelope p64 free+alloc, 70% of {fmt_count(pages)} pages",
            "s",
            {HOSTPOOL: median(s[HOSTPOOL]), TORCH: median(s[TORCH])},
            columns=(HOSTPOOL, TORCH),
            samples={HOSTPOOL: s[HOSTPOOL], TORCH: s[TORCH]},
            extra={"cls": "_SharedPageEnvelopeHostBacking", "pattern": "free+alloc", "pages": pages},
        )
        if not ctx.tiny:
            row.at_least(TORCH, 20.0)
        rows.append(row)
    return rows


@workload("hicache", seconds=25)
def hicache(ctx: Context) -> list[Row]:
    if TORCH not in ctx.impls:
        ctx.notes.append("hicache: skipped, sglang's host pools keep torch tensors and torch is not in this run")
        return []
    original, ours, source = _classes()
    todo = cells(ctx.tiny)
    repeats = ctx.repeats(5)
    rows = []
    for cell in todo:
        ctx.label(f"sglang host tier, {cell.params}")
        s = measure(cell, original, ours, repeats, ctx.loop_s())
        row = Row(
            "sglang host tier",
            cell.params,
            "s",
            {HOSTPOOL: median(s[HOSTPOOL]), TORCH: median(s[TORCH])},
            columns=(HOSTPOOL, TORCH),
            samples={HOSTPOOL: s[HOSTPOOL], TORCH: s[TORCH]},
            extra={"cls": cell.cls, "pattern": cell.pattern, "slots": cell.slots, "page_size": cell.page_size},
        )
        if cell.target is not None:
            row.at_least(TORCH, cell.target)
        rows.append(row)
        if cell.pattern == "alloc+free" and cell.cls == "MHATokenToKVPoolHost" and cell.slots in (16, 4096):
            over = median([a / b for a, b in zip(s[TRACKED], s[HOSTPOOL], strict=True)])  # judged as shown
            rows.append(
                Row(
                    "sglang host tier",
                    f"{cell.params} tracked / untracked",
                    "x",
                    {HOSTPOOL: over},
                    "<=3x",
                    over <= 3,
                    columns=(HOSTPOOL,),
                )
            )
        ctx.tick(1 / (len(todo) + 1))
    rows += interleave_rows(ctx)
    rows += envelope_rows(ctx)
    ctx.tick(1 / (len(todo) + 1))
    ctx.notes.append(
        f"sglang host tier: the HostKVCache family's bookkeeping, {source}, against the same classes with "
        "hostpool_nb's methods as install() puts them (torch tensors in and out, the pool's lock held); x torch is "
        "against the original. Pools of 256K slots (the DeepSeek V4 pool 4K pages of 64); write-back is 32 "
        "allocations of 64 slots freed in a shuffled order, per cycle; tracked / untracked is the median paired "
        "ratio with HOSTPOOL_NB_TRACK=1. PageInterleave: sglang's page-interleaved host pool (4 owner classes, "
        "pages of 64 slots), about 3/8 of its pages held; each free of pages just allocated is timed alone. "
        "Unified envelope: sglang's shared backing of "
        "the hybrid sliding-window pools (full pages of 1 KB growing up, sliding-window pages of 512 B growing down, "
        "64 tokens each), about 70% of its bytes held, each pair a free of a random held request and an allocation "
        "of 1-32 pages on either side (compactions included)"
    )
    return rows
