"""Start-up cost: fresh processes, warm and empty numba caches, vs ``import torch``.

Each measurement is the wall time of a whole ``python -c`` subprocess, from
spawn to exit, so interpreter start and teardown are included for every
contender alike. The hostpool_nb snippet runs from the directory that holds
the imported package, with ``NUMBA_CACHE_DIR`` pointing at a pre-warmed
directory (warm) or a new empty one (cold, compiling every kernel).
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

from .timing import interleaved, median

POOL_SNIPPET = "import hostpool_nb; p = hostpool_nb.LogicalHostPool(1 << 20, 64); p.free(p.alloc(64))"
SNIPPETS = {
    "python": "pass",
    "numba": "import numba",
    "torch": "import torch",
}


def package_root() -> Path:
    """The directory from which ``import hostpool_nb`` finds this checkout's package."""
    import hostpool_nb

    return Path(hostpool_nb.__file__).resolve().parent.parent


def run_python(code: str, cache_dir: str | None = None, timeout: float = 300.0) -> float:
    """Wall seconds of ``python -c code`` in a fresh process; raises on failure."""
    env = dict(os.environ)
    env.pop("NUMBA_DISABLE_JIT", None)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=str(package_root()),
        env=env,
        capture_output=True,
        timeout=timeout,
        check=False,  # a failure is reported below, with its stderr
    )
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"python -c {code!r} failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return dt


def measure_startup(
    repeats: int,
    with_torch: bool,
    references: tuple[str, ...] = ("python",),
    tick: Callable[[], None] | None = None,
) -> dict[str, dict[str, float | list[float]]]:
    """Median and samples of each start-up, interleaved over ``repeats``.

    Keys: ``warm`` and ``cold`` (hostpool_nb with a warm / an empty numba
    cache), ``torch`` (a fresh ``import torch``, if ``with_torch``), and the
    ``references`` (``python``: an empty interpreter; ``numba``: ``import
    numba``), which show how much of the start-up is not hostpool_nb's.
    """
    tmp = Path(tempfile.mkdtemp(prefix="hostpool_nb_bench_"))
    try:
        warm_dir = str(tmp / "warm")
        counter = iter(range(1 << 30))

        def cold() -> float:
            # The first cold run, before any warm one, fills the warm cache.
            n = next(counter)
            if n == 0:
                return run_python(POOL_SNIPPET, warm_dir)
            d = str(tmp / f"cold{n}")
            try:
                return run_python(POOL_SNIPPET, d)
            finally:
                shutil.rmtree(d, ignore_errors=True)

        # "cold" first: repeat 0 starts with it, so the warm cache exists
        # before the first warm run.
        runners: dict[str, Callable[[], float]] = {
            "cold": cold,
            "warm": lambda: run_python(POOL_SNIPPET, warm_dir),
        }
        if with_torch:
            runners["torch"] = lambda: run_python(SNIPPETS["torch"])
        for name in references:
            runners[name] = lambda code=SNIPPETS[name]: run_python(code)
        samples = interleaved(runners, repeats, tick)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {name: {"median": median(s), "samples": s} for name, s in samples.items()}
