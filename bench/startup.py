"""Start-up: fresh processes with a warm or an empty numba cache, against ``import torch``.

Each figure is the wall time of a whole ``python -c`` process, interleaved
with the others and the median of the repeats (pyperf and hyperfine time
commands too, but each wants to own the run; these are a handful of
processes). The cold rows start from a new, empty ``NUMBA_CACHE_DIR`` each
time: what a CI job or a fresh container pays, for the first calls of each
kind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .core import HOSTPOOL, TORCH, Context, Row, workload
from .timing import interleaved, median

_POOL = "import hostpool_nb; p = hostpool_nb.LogicalHostPool(1 << 20, {ps}{track}); "
# The first calls of each kind, each in a process of its own with an empty cache: what it compiles.
FIRST_CALLS = {
    "import + alloc/free": _POOL.format(ps=64, track="") + "p.free(p.alloc(64))",
    "page size 1 alloc/free": _POOL.format(ps=1, track="") + "p.free(p.alloc(64))",
    "tracked pool alloc/free": _POOL.format(ps=64, track=", track=True") + "p.free(p.alloc(64))",
    "alloc_many + free": _POOL.format(ps=64, track="") + "s, o = p.alloc_many([64, 128]); p.free(s)",
    "free group": _POOL.format(ps=64, track="") + "a = p.alloc(64)\nwith p.free_group():\n    p.free(a)",
    "paged alloc_extend": (
        "from hostpool_nb.paged import PagedTokenToKVPoolAllocator as A; "
        "a = A(1 << 20, 16, None); a.alloc_extend([0], [20], [-1], 20)"
    ),
    "host tier alloc/free": "import hostpool_nb; h = hostpool_nb.HostPagePool(1 << 15); h.free(h.alloc(32))",
}
WARM = FIRST_CALLS["import + alloc/free"]
COLD_TARGET_S = 3.0  # import and a first alloc/free of an untracked pool
WARM_TARGET_S = 1.0  # the same with a warm cache, when there is no torch import to compare it with


def run_python(code: str, cache_dir: str | None = None, timeout: float = 600.0) -> float:
    """Wall seconds of ``python -c code`` in a fresh process (from this checkout's package)."""
    import hostpool_nb

    env = dict(os.environ)
    env.pop("NUMBA_DISABLE_JIT", None)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=str(Path(hostpool_nb.__file__).resolve().parent.parent),
        env=env,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"python -c {code!r} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return dt


def _cold(tmp: Path) -> Callable[[str], Callable[[], float]]:
    """``cold(code)``: a runner of ``code`` in a fresh process with a new, empty numba cache under ``tmp`` each time."""
    counter = iter(range(1 << 30))

    def cold(code: str) -> Callable[[], float]:
        def run() -> float:
            d = str(tmp / f"cold{next(counter)}")
            try:
                return run_python(code, d)
            finally:
                shutil.rmtree(d, ignore_errors=True)

        return run

    return cold


def measure_startup(
    repeats: int, with_torch: bool, names: list[str], tick: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """Samples of each start-up: ``warm``, each of :data:`FIRST_CALLS` ``names`` cold, ``torch``, ``python``.

    ``tick()`` after each process: the progress bar moves through the minute this takes.
    """
    tmp = Path(tempfile.mkdtemp(prefix="hostpool_nb_bench_"))
    cold = _cold(tmp)
    try:
        warm_dir = str(tmp / "warm")
        run_python(WARM, warm_dir)  # fills the warm cache
        runners: dict[str, Callable[[], float]] = {"warm": lambda: run_python(WARM, warm_dir)}
        runners.update({name: cold(FIRST_CALLS[name]) for name in names})
        if with_torch:
            runners["torch"] = lambda: run_python("import torch")
        runners["python"] = lambda: run_python("pass")
        return interleaved(runners, repeats, tick)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@workload("startup", seconds=75)
def startup(ctx: Context) -> list[Row]:
    ctx.label("start-up (fresh processes)")
    names = list(FIRST_CALLS)[:1] if ctx.tiny else list(FIRST_CALLS)  # the tests' run: the target row only
    processes = ctx.repeats() * (len(names) + 2 + (TORCH in ctx.impls))
    s = measure_startup(ctx.repeats(), TORCH in ctx.impls, names, lambda: ctx.tick(1 / processes))
    torch_s = {TORCH: s[TORCH]} if TORCH in s else {}
    warm = Row(
        "start-up",
        "warm numba cache",
        "s",
        {HOSTPOOL: median(s["warm"]), **{k: median(v) for k, v in torch_s.items()}},
        samples={HOSTPOOL: s["warm"], **torch_s},
        columns=(HOSTPOOL, TORCH),
    )
    if TORCH in torch_s:
        warm.at_least(TORCH, 2)
    else:  # no torch to compare with: the bound the torch ratio stands for on this kind of machine
        warm.target, warm.met = f"<={WARM_TARGET_S:g} s", warm.values[HOSTPOOL] <= WARM_TARGET_S
    rows = [warm]
    for name in names:
        row = Row(
            "cold start", name, "s", {HOSTPOOL: median(s[name])}, samples={HOSTPOOL: s[name]}, columns=(HOSTPOOL,)
        )
        if name == "import + alloc/free":
            row.target, row.met = f"<={COLD_TARGET_S:g} s", row.values[HOSTPOOL] <= COLD_TARGET_S
        rows.append(row)
    ctx.notes.append(
        f"start-up: wall time of a fresh python -c, median of {ctx.repeats()}: warm numba cache, or cold (an "
        f"empty NUMBA_CACHE_DIR each run: what the first calls named compile; alloc/free is a page size 64 "
        f"pool's first alloc and free); x torch = import torch / hostpool_nb's; an empty interpreter takes "
        f"{median(s['python']):.2f} s of each"
    )
    return rows


# -- python -m bench.startup: the start-up times README and the docs quote, as ranges ---------------------

WARMUP = "import sys; from hostpool_nb.warmup import main; sys.exit(main(['--quiet']))"


def ranges(
    repeats: int, warmup_repeats: int, say: Callable[[str], None] | None = None
) -> list[tuple[str, list[float]]]:
    """(what, samples) for every start-up time the docs quote, each sample a fresh process.

    ``say(line)`` as each process ends: what it was and how long it took, and how many are left.
    """
    tmp = Path(tempfile.mkdtemp(prefix="hostpool_nb_startup_"))
    cold = _cold(tmp)
    quick = {
        "import + first alloc/free, page size 64, warm cache": WARM,
        "import + first alloc/free, page size 64, empty cache": FIRST_CALLS["import + alloc/free"],
        "import + first alloc/free, page size 1, empty cache": FIRST_CALLS["page size 1 alloc/free"],
        "paged alloc_extend, empty cache": FIRST_CALLS["paged alloc_extend"],
        "python -m hostpool_nb.warmup, warm cache": WARMUP,
    }
    slow = {"python -m hostpool_nb.warmup, empty cache": WARMUP}
    total = 1 + repeats * len(quick) + warmup_repeats * len(slow)
    done = [0]

    def told(what: str, run: Callable[[], float]) -> Callable[[], float]:
        def timed() -> float:
            seconds = run()
            done[0] += 1
            if say is not None:
                say(f"[{done[0]}/{total}] {what}: {_seconds(seconds)} s")
            return seconds

        return timed

    try:
        warm_dir = str(tmp / "warm")
        told("python -m hostpool_nb.warmup, filling the warm cache", lambda: run_python(WARMUP, warm_dir))()
        runners = {
            what: told(what, (lambda c=code: run_python(c, warm_dir)) if "warm cache" in what else cold(code))
            for what, code in quick.items()
        }
        got = interleaved(runners, repeats)
        late = interleaved({what: told(what, cold(code)) for what, code in slow.items()}, warmup_repeats)
        return [*got.items(), *late.items()]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _seconds(value: float) -> str:
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    import argparse

    from .report import machine_info, machine_line, wrap

    ap = argparse.ArgumentParser(
        prog="python -m bench.startup",
        description="Start-up times of fresh processes (warm and empty numba caches), as ranges: the times "
        "README and the docs quote. Takes about two minutes on 2 cores.",
    )
    ap.add_argument("--repeats", type=int, default=5, help="processes per figure (default 5)")
    ap.add_argument("--warmup-repeats", type=int, default=2, help="cold warmup runs, 40 s each here (default 2)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup_repeats < 1:
        ap.error("--repeats and --warmup-repeats must be at least 1")
    total = 1 + 5 * args.repeats + args.warmup_repeats
    print(f"{total} fresh processes, one after another; a line on stderr as each ends", file=sys.stderr, flush=True)
    found = ranges(args.repeats, args.warmup_repeats, lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    print(wrap(f"start-up of fresh processes, seconds, min-max (median) of each: {machine_line(machine_info())}"))
    width = max(len(what) for what, _ in found)
    for what, samples in found:
        lo, mid, hi = min(samples), median(samples), max(samples)
        print(f"  {what:<{width}}  {_seconds(lo)}-{_seconds(hi)} s ({_seconds(mid)}, {len(samples)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
