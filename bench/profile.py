"""Where hostpool_nb's time goes: the pieces of its calls, timed apart.

``python -m bench.profile [--page-size 64] [--k 64] [--pool 1048576] [--trace-ops 30000]``

Times, each as the median of repeated ``timeit`` loops, the Python-level
steps an ``alloc(k)`` + ``free(result)`` goes through (argument checks, the
lock, the output buffer, the kernel calls through numba's compiled entry
point and through the dispatcher) and the cost of numba's argument handling
per array argument, next to the measured round trip. The pieces are
measured in isolation, so their sum only approximates the whole; the gap is
the interpreter's own work between them (attribute loads, calls, returns).

Then the large round trips, and the KV-cache trace of ``python -m bench``
replayed whole by stand-ins that each leave out part of the pool: its
kernels alone (no lock, no argument checks), its kernels under
``pool.lock``, and the trace floor with and without an ``RLock``; next to
the pool and, when torch imports, the original. Within a replay the Python
steps cost about twice what they do in the loops above (``pool.lock``
~0.11 us a call against ~0.06 us), whatever the calls' size, so the
trace's differences are the figures to budget with.

Private names of ``hostpool_nb`` are used read-only; a piece whose name has
changed is reported as unavailable rather than failing.
"""

from __future__ import annotations

import argparse
import functools
import operator
import sys
import threading
import timeit
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .cli import Parser
from .timing import gc_paused, interleaved, median, timed


class Piece(NamedTuple):
    """One timed step: ``fn`` is called ``number`` times per round."""

    name: str
    fn: Callable[[], Any] | None
    comment: str
    number: int
    setup: Callable[[], Any] | None = None


def _tiny_kernels() -> dict[int, Callable[..., int]]:
    """Entry points of trivial kernels taking 1, 2 and 3 int64 arrays.

    Compiled with the options of the pool's short kernels (``_jit._njit``:
    no reference counting of arrays, the GIL kept), so their call cost is
    the one the pool pays.
    """
    from hostpool_nb._jit import _njit

    def one(a):
        return a[0]

    def two(a, b):
        return a[0] + b[0]

    def three(a, b, c):
        return a[0] + b[0] + c[0]

    def scalar(x):
        return x

    sigs = {0: "i8(i8)", 1: "i8(i8[::1])", 2: "i8(i8[::1], i8[::1])", 3: "i8(i8[::1], i8[::1], i8[::1])"}
    out: dict[int, Callable[..., int]] = {}
    for n, fn in ((0, scalar), (1, one), (2, two), (3, three)):
        compiled = _njit([sigs[n]], cache=False, nogil=False)(fn)
        (cres,) = compiled.overloads.values()
        out[n] = getattr(cres, "entry_point", compiled)
    return out


def profile_roundtrip(
    page_size: int = 64, k: int = 64, pool_slots: int = 1 << 20, number: int = 20000, repeat: int = 7
) -> list[tuple[str, float | None, str]]:
    """``(piece, ns per call or None, comment)`` for one round trip's steps."""
    import hostpool_nb._kernels as K
    from hostpool_nb import LogicalHostPool
    from hostpool_nb._convert import as_count, as_slots

    pieces: list[Piece] = []

    def add(
        name: str,
        fn: Callable[[], Any] | None,
        comment: str = "",
        n: int = number,
        setup: Callable[[], Any] | None = None,
    ) -> None:
        if fn is not None:
            try:
                if setup is not None:
                    setup()
                fn()
            except Exception as exc:  # noqa: BLE001 - a renamed private piece: report, don't fail
                fn, comment = None, f"unavailable: {type(exc).__name__}: {exc}"
        pieces.append(Piece(name, fn, comment, n, setup))

    pool = LogicalHostPool(pool_slots, page_size)
    for _ in range(pool_slots // k):  # one cycle: steady state
        pool.free(pool.alloc(k))
    big = max(1, number * 64 // max(k, 64))

    add("round trip: pool.free(pool.alloc(k))", lambda: pool.free(pool.alloc(k)), "the whole thing", big)
    held = pool.alloc(k)
    add("  alloc(k) + free (as above, again)", lambda: pool.free(pool.alloc(k)), "repeat: noise check", big)
    pool.free(held)

    # alloc alone and free alone, each on its own pool; the untimed setup
    # before every round gives back (or hands out) what the round needs.
    n_split = min(big, pool_slots // k - 1)
    apool, fpool = LogicalHostPool(pool_slots, page_size), LogicalHostPool(pool_slots, page_size)
    a_held: list[Any] = []
    f_todo: list[Any] = [iter(())]

    def a_setup() -> None:
        for r in a_held:
            apool.free(r)
        a_held.clear()

    def f_setup() -> None:
        for r in f_todo[0]:  # what the last round left unfreed
            fpool.free(r)
        f_todo[0] = iter([fpool.alloc(k) for _ in range(n_split + 1)])

    a_append = a_held.append
    add("  alloc(k) alone", lambda: a_append(apool.alloc(k)), "incl. a list append (~30 ns)", n_split, a_setup)
    add(
        "  free(result) alone",
        lambda: fpool.free(next(f_todo[0])),
        "incl. next() on an iterator (~30 ns)",
        n_split,
        f_setup,
    )

    class _Dummy:
        def method(self, x: Any) -> Any:
            return x

    d = _Dummy()
    add("python: bound method call", lambda: d.method(k), "x2 per round trip")
    add("python: lambda call (timing harness)", lambda: None, "subtract from every row")
    add("as_count(k, 'need_size')", lambda: as_count(k, "need_size"))
    add("type(k) is int", lambda: type(k) is int)
    ps = page_size
    size = pool.size
    add("alloc's checks: alignment, sign, size", lambda: k % ps != 0 or k < 0 or k > size)
    lock = threading.RLock()

    def with_lock() -> None:
        with lock:
            pass

    def acq_rel() -> None:
        lock.acquire()
        lock.release()

    add("RLock: with lock", with_lock, "x2 per round trip")
    add("RLock: acquire()/release()", acq_rel, "x2 per round trip")
    i64 = np.dtype(np.int64)
    add("np.empty(k, dtype=np.int64)", lambda: np.empty(k, dtype=np.int64), "the returned buffer")
    add("np.empty(k, dtype=<dtype obj>)", lambda: np.empty(k, dtype=i64))
    add("np.empty(k, np.int64) positional", lambda: np.empty(k, np.int64))
    out = np.empty(k, dtype=np.int64)
    add("as_slots(int64 1-D array)", lambda: as_slots(out), "free's input conversion")
    one_d = (8,)
    add(
        "free's fast-path test (type, dtype is, strides)",
        lambda: type(out) is np.ndarray and out.dtype is i64 and out.strides == one_d,
    )
    add("arr.flags.c_contiguous", lambda: out.flags.c_contiguous)
    add("arr.shape[0]", lambda: out.shape[0])

    # Kernels, on a private pool so the measured pool's state is untouched.
    kpool = LogicalHostPool(pool_slots, page_size)
    kst = kpool._st
    kout = np.empty(k, dtype=np.int64)
    # The kernels the pool calls for k slots: those keeping the GIL up to
    # K.SHORT_SLOTS, the nogil ones above.
    short = k <= K.SHORT_SLOTS
    try:
        ep_alloc = K.entry_point(K.alloc_pages_short if short else K.alloc_pages)
        ep_free = K.entry_point(K.free_pages_short if short else K.free_pages)
        ep_nogil = K.entry_point(K.alloc_pages)
        ep_short = K.entry_point(K.alloc_pages_short)
    except Exception:  # noqa: BLE001 - numba internals moved: leave these pieces out
        ep_alloc = ep_free = ep_nogil = ep_short = None
    empty = np.empty(0, dtype=np.int64)
    if ep_alloc is not None and ep_free is not None and ep_nogil is not None and ep_short is not None:
        add(
            "kernels via entry point: alloc_pages + free_pages",
            lambda: (ep_alloc(kst, kout), ep_free(kst, kout)),
            f"both kernels, k slots of work ({'_short: GIL kept' if short else 'nogil'})",
        )
        add(
            "kernels via dispatcher: alloc_pages + free_pages",
            lambda: (K.alloc_pages(kst, kout), K.free_pages(kst, kout)),
            "numba type resolution per call",
        )
        flock = kpool.lock

        def floor() -> None:
            fresh = np.empty(k, dtype=i64)
            flock.acquire()
            ep_alloc(kst, fresh)
            flock.release()
            flock.acquire()
            ep_free(kst, fresh)
            flock.release()

        add(
            "floor: np.empty + lock + kernel, twice",
            floor,
            "a round trip with no argument checks: the least one under pool.lock can cost",
        )
        add("alloc_pages entry point, k=0 (call only)", lambda: ep_nogil(kst, empty), "2 array args, no work")
        add(
            "alloc_pages_short entry point, k=0",
            lambda: ep_short(kst, empty),
            "the same, keeping the GIL",
        )
        add("alloc_pages dispatcher, k=0 (call only)", lambda: K.alloc_pages(kst, empty))
    try:
        tiny = _tiny_kernels()
        a = np.zeros(4, dtype=np.int64)
        add("entry point, scalar arg (numba call floor)", lambda: tiny[0](1))
        add("entry point, 1 array arg", lambda: tiny[1](a))
        add("entry point, 2 array args", lambda: tiny[2](a, a))
        add("entry point, 3 array args", lambda: tiny[3](a, a, a), "cost per array arg = slope of these")
    except Exception as exc:  # noqa: BLE001 - NUMBA_DISABLE_JIT=1, or numba internals moved
        add("entry point per array argument", None, f"unavailable: {type(exc).__name__}: {exc}")
    return _interleaved_ns(pieces, repeat)


def _interleaved_ns(pieces: list[Piece], repeat: int) -> list[tuple[str, float | None, str]]:
    """Time every piece once per round, ``repeat`` rounds; medians in ns."""
    samples: dict[int, list[float]] = {i: [] for i, p in enumerate(pieces) if p.fn is not None}
    timers = {i: timeit.Timer(pieces[i].fn) for i in samples}
    with gc_paused():
        for _ in range(repeat):
            for i, timer in timers.items():
                p = pieces[i]
                if p.setup is not None:
                    p.setup()
                samples[i].append(timer.timeit(p.number) / p.number * 1e9)
    return [(p.name, median(samples[i]) if i in samples else None, p.comment) for i, p in enumerate(pieces)]


def profile_big(
    page_size: int = 64, k: int = 65536, pool_slots: int = 1 << 20, repeat: int = 7
) -> list[tuple[str, float | None, str]]:
    """Pieces of a large round trip: the output buffer, the kernels, the copy floor."""
    import hostpool_nb._kernels as K
    from hostpool_nb import LogicalHostPool

    number = max(20, 2_000_000 // k)
    pool = LogicalHostPool(pool_slots, page_size)
    src = np.arange(k, dtype=np.int64)
    dst = np.empty_like(src)
    kpool = LogicalHostPool(pool_slots, page_size)
    kst = kpool._st
    kout = np.empty(k, dtype=np.int64)
    ep_alloc = K.entry_point(K.alloc_pages)
    ep_free = K.entry_point(K.free_pages)
    n_pages = k // page_size
    pieces = [
        Piece("round trip: pool.free(pool.alloc(k))", lambda: pool.free(pool.alloc(k)), "", number),
        Piece("np.empty(k) fresh each call", lambda: np.empty(k, dtype=np.int64), "allocation only", number),
        Piece("np.empty(k) + fill", lambda: np.empty(k, dtype=np.int64).fill(1), "incl. page faults, if any", number),
        Piece("floor: np.copyto(dst, src)", lambda: np.copyto(dst, src), "write k + read k int64", number),
        Piece(
            "kernels: alloc_pages + free_pages",
            lambda: (ep_alloc(kst, kout), ep_free(kst, kout)),
            "entry points, reused buffer",
            number,
        ),
    ]
    rows = _interleaved_ns(pieces, repeat)
    kern = rows[4][1]
    if kern:
        rows.append(("  kernels per page", kern / n_pages, f"{n_pages} pages"))
        rows.append(("  kernels per slot", kern / k, f"{k} slots"))
    return rows


def _kernel_standins() -> tuple[type, type]:
    """Two trace stand-ins: the pool's own kernels on its own state, without its Python layer.

    ``alloc`` makes its output with ``np.empty`` and ``free`` passes the
    caller's array on, each to the kernel the pool itself calls for that
    many slots (``_short`` up to ``K.SHORT_SLOTS``): no argument checks, no
    tracking, and in the first no lock; the second takes ``pool.lock``
    around each kernel call, as the pool does. Written like the pool's hot
    paths (kernels and constants bound once, no helper calls), so what they
    save over the pool is what the left-out steps cost. Their answers are
    the pool's (the tests compare them).
    """
    import hostpool_nb._kernels as K
    from hostpool_nb import LogicalHostPool

    empty, i64, limit = np.empty, np.dtype(np.int64), K.SHORT_SLOTS
    alloc_short, alloc_long = K.entry_point(K.alloc_pages_short), K.entry_point(K.alloc_pages)
    free_short, free_long = K.entry_point(K.free_pages_short), K.entry_point(K.free_pages)
    refused = -1 - K.E_SHORT

    class KernelsAlone:
        def __init__(self, size: int, page_size: int) -> None:
            pool = LogicalHostPool(size, page_size)
            self._st = pool._st
            self.lock = pool.lock
            self.page_size = page_size

        def alloc(self, need_size: int) -> Any:
            out = empty(need_size, i64)
            status = (alloc_short if need_size <= limit else alloc_long)(self._st, out)
            if status >= 0:
                return out
            if status == refused:
                return None
            raise RuntimeError(f"alloc kernel failed with status {status}")

        def free(self, indices: Any) -> int:
            status: int = (free_short if indices.shape[0] <= limit else free_long)(self._st, indices)
            if status < 0:
                raise RuntimeError(f"free kernel failed with status {status}")
            return status

    class KernelsLocked(KernelsAlone):
        def alloc(self, need_size: int) -> Any:
            out = empty(need_size, i64)
            kernel = alloc_short if need_size <= limit else alloc_long
            lock = self.lock
            lock.acquire()
            try:
                status = kernel(self._st, out)
            finally:
                lock.release()
            if status >= 0:
                return out
            if status == refused:
                return None
            raise RuntimeError(f"alloc kernel failed with status {status}")

        def free(self, indices: Any) -> int:
            kernel = free_short if indices.shape[0] <= limit else free_long
            lock = self.lock
            lock.acquire()
            try:
                status: int = kernel(self._st, indices)
            finally:
                lock.release()
            if status < 0:
                raise RuntimeError(f"free kernel failed with status {status}")
            return status

    return KernelsAlone, KernelsLocked


def _floor_locked() -> type:
    """``bench.workloads.TraceFloor`` with an ``RLock`` taken around each of its compiled calls."""
    from .workloads import TraceFloor

    class FloorLocked(TraceFloor):
        def __init__(self, size: int, page_size: int) -> None:
            super().__init__(size, page_size)
            self.lock = threading.RLock()

        def alloc(self, need_size: int) -> Any:
            if need_size > self._available:
                return None
            out = np.empty(need_size, dtype=np.int64)
            lock = self.lock
            lock.acquire()
            try:
                self._write(out)
            finally:
                lock.release()
            self._available -= need_size
            return out

        def free(self, indices: Any) -> int:
            lock = self.lock
            lock.acquire()
            try:
                self._read(indices)
            finally:
                lock.release()
            self._available += indices.shape[0]
            return int(indices.shape[0])

    return FloorLocked


# The stand-ins of the trace section, in the order of its rows.
POOL, KERNELS, KERNELS_LOCKED, FLOOR, FLOOR_LOCKED, TORCH = (
    "hostpool_nb: pool.alloc / pool.free",
    "  its kernels alone",
    "  its kernels + pool.lock",
    "trace floor",
    "  trace floor + an RLock",
    "torch original",
)


def trace_standins(with_torch: bool) -> dict[str, Callable[[int, int], Any]]:
    """Constructors ``(size, page_size) -> pool-like`` for each row of the trace section."""
    from hostpool_nb import LogicalHostPool

    from .workloads import TraceFloor

    kernels_alone, kernels_locked = _kernel_standins()
    makers: dict[str, Callable[[int, int], Any]] = {
        POOL: LogicalHostPool,
        KERNELS: kernels_alone,
        KERNELS_LOCKED: kernels_locked,
        FLOOR: TraceFloor,
        FLOOR_LOCKED: _floor_locked(),
    }
    if with_torch:
        from .impls import implementations

        makers[TORCH] = implementations(with_torch=True)["torch"]
    return makers


def profile_trace(
    page_size: int = 64, pool_slots: int = 1 << 20, n_ops: int = 30_000, repeat: int = 7, with_torch: bool | None = None
) -> list[tuple[str, float | None, str]]:
    """Where a KV-cache trace call's time goes: the pool, its kernels alone, with the lock, the floor.

    Every stand-in replays the same trace (``bench.workloads.make_trace``)
    from a fresh pool, interleaved, ``repeat`` times; medians per call. Then
    three differences, each the median of the repeats' differences: the
    lock's share, what the argument checks and the rest of the Python layer
    take, and the kernels' time over the floor. With torch (when importable,
    at one thread, as the bench runs it), each row's comment gives torch's
    time over it, the median of the repeats' ratios.
    """
    from .impls import torch_available
    from .workloads import make_trace, replay

    if with_torch is None:
        with_torch = torch_available()
    if with_torch:
        import torch

        torch.set_num_threads(1)
    trace = make_trace(pool_slots, page_size, n_ops)
    makers = trace_standins(with_torch)
    comments = {
        POOL: "the whole call",
        KERNELS: "np.empty + the pool's kernel: no lock, no checks",
        KERNELS_LOCKED: "the same under pool.lock",
        FLOOR: "bench's TraceFloor: no free list",
        FLOOR_LOCKED: "the same under an RLock: a bound for locking pools",
        TORCH: "the original, on torch tensors",
    }
    for make in makers.values():  # warm-up: compiles, and fills the allocator's caches
        with gc_paused():
            replay(make(pool_slots, page_size), trace)

    def runner(make: Callable[[int, int], Any]) -> Callable[[], float]:
        def run() -> float:
            pool = make(pool_slots, page_size)
            return timed(replay, pool, trace) / len(trace.ops) * 1e9

        return run

    samples = interleaved({name: runner(make) for name, make in makers.items()}, repeat)

    def paired(a: str, b: str, op: Callable[[float, float], float]) -> float:
        # Repeat r of every stand-in ran back to back, so pairs share the
        # machine's state of the moment: their median is steadier than an
        # operation on two medians.
        return median([op(x, y) for x, y in zip(samples[a], samples[b], strict=True)])

    rows: list[tuple[str, float | None, str]] = []
    for name in makers:
        comment = comments[name]
        if TORCH in samples and name != TORCH:
            comment += f"; torch / this {paired(TORCH, name, operator.truediv):.2f}x"
        rows.append((name, median(samples[name]), comment))
    rows += [
        ("the lock's share", paired(KERNELS_LOCKED, KERNELS, operator.sub), "kernels + pool.lock - kernels alone"),
        ("argument checks and the rest", paired(POOL, KERNELS_LOCKED, operator.sub), "pool - (kernels + pool.lock)"),
        ("kernels over the floor", paired(KERNELS, FLOOR, operator.sub), "kernels alone - trace floor"),
    ]
    return rows


def render(title: str, rows: list[tuple[str, float | None, str]]) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [title, "-" * len(title)]
    for name, ns, comment in rows:
        val = "n/a" if ns is None else f"{ns:10.0f} ns" if abs(ns) >= 10 else f"{ns:10.2f} ns"
        lines.append(f"{name.ljust(width)}  {val:>13}  {comment}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked: sizes the pools cannot take exit with one line, not a traceback mid-run."""
    ap = Parser("python -m bench.profile", __doc__)
    ap.add_argument("--page-size", type=int, default=64, metavar="N", help="slots per page (default 64)")
    ap.add_argument(
        "--k", type=int, default=64, metavar="N", help="slots per alloc in the single round trip (default 64)"
    )
    ap.add_argument("--pool", type=int, default=1 << 20, metavar="N", help="pool size in slots (default 1048576)")
    ap.add_argument(
        "--big-k",
        type=int,
        default=65536,
        metavar="N",
        help="slots per alloc in the large round trips, at page size 1 and --page-size (default 65536)",
    )
    ap.add_argument(
        "--trace-ops",
        type=int,
        default=30_000,
        metavar="N",
        help="calls in the KV-cache trace, at page size 1 and --page-size (default 30000; 0 skips it)",
    )
    args = ap.parse_args(argv)
    if args.trace_ops < 0:
        ap.error(f"--trace-ops must be 0 or more, not {args.trace_ops}")
    ps = args.page_size
    if ps < 1:
        ap.error(f"--page-size must be at least 1, not {ps}")
    for option, k in (("--k", args.k), ("--big-k", args.big_k)):
        if k < ps or k % ps:
            ap.error(f"{option} must be a positive multiple of --page-size ({ps}), not {k}")
        if args.pool < 2 * k:
            ap.error(f"--pool must hold at least two allocations of {option} ({2 * k} slots), not {args.pool}")
    if args.pool % ps:
        ap.error(f"--pool must be a multiple of --page-size ({ps}), not {args.pool}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    page_sizes = sorted({1, args.page_size})
    sections: list[tuple[str, Callable[[], list[tuple[str, float | None, str]]]]] = [
        (
            f"single round trip, page size {args.page_size}, k={args.k}, pool={args.pool}",
            functools.partial(profile_roundtrip, args.page_size, args.k, args.pool),
        )
    ]
    sections += [
        (
            f"large round trip, page size {ps}, k={args.big_k}, pool={args.pool}",
            functools.partial(profile_big, ps, args.big_k, args.pool),
        )
        for ps in page_sizes
    ]
    if args.trace_ops:
        sections += [
            (
                f"KV-cache trace, page size {ps}, pool={args.pool}, {args.trace_ops} calls: time per call",
                functools.partial(profile_trace, ps, args.pool, args.trace_ops),
            )
            for ps in page_sizes
        ]
    for title, rows in sections:
        print(render(title, rows()))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
