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

FIRST_CALLS = {
    "import + alloc/free": "import hostpool_nb; p = hostpool_nb.LogicalHostPool(1 << 20, 64); p.free(p.alloc(64))",
}
WARM = FIRST_CALLS["import + alloc/free"]


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


def measure_startup(repeats: int, with_torch: bool) -> dict[str, list[float]]:
    """Samples of each start-up: ``warm``, each of :data:`FIRST_CALLS` cold, ``torch``, ``python``."""
    tmp = Path(tempfile.mkdtemp(prefix="hostpool_nb_bench_"))
    counter = iter(range(1 << 30))
    try:
        warm_dir = str(tmp / "warm")
        run_python(WARM, warm_dir)  # fills the warm cache

        def cold(code: str) -> Callable[[], float]:
            def run() -> float:
                d = str(tmp / f"cold{next(counter)}")
                try:
                    return run_python(code, d)
                finally:
                    shutil.rmtree(d, ignore_errors=True)

            return run

        runners: dict[str, Callable[[], float]] = {"warm": lambda: run_python(WARM, warm_dir)}
        runners.update({name: cold(code) for name, code in FIRST_CALLS.items()})
        if with_torch:
            runners["torch"] = lambda: run_python("import torch")
        runners["python"] = lambda: run_python("pass")
        return interleaved(runners, repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@workload("startup", seconds=60)
def startup(ctx: Context) -> list[Row]:
    ctx.label("start-up (fresh processes)")
    s = measure_startup(ctx.repeats(), TORCH in ctx.impls)
    torch_s = {TORCH: s[TORCH]} if TORCH in s else {}
    warm = Row(
        "start-up",
        "warm numba cache",
        "s",
        {HOSTPOOL: median(s["warm"]), **{k: median(v) for k, v in torch_s.items()}},
        samples={HOSTPOOL: s["warm"], **torch_s},
        columns=(HOSTPOOL, TORCH),
    )
    rows = [warm.at_least(TORCH, 2)]
    for name in FIRST_CALLS:
        row = Row("cold start", name, "s", {HOSTPOOL: median(s[name])}, columns=(HOSTPOOL,))
        if name == "import + alloc/free":
            row.target, row.met = "<=3 s", row.values[HOSTPOOL] <= 3
        rows.append(row)
    ctx.tick(1)
    ctx.notes.append(
        f"start-up: wall time of a fresh python -c, median of {ctx.repeats()}: warm numba cache, or cold (an "
        f"empty NUMBA_CACHE_DIR each run) for the first calls named; x torch = import torch / hostpool_nb's; "
        f"an empty interpreter takes {median(s['python']):.2f} s of each"
    )
    return rows
