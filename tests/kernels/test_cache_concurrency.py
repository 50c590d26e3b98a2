"""``cache=True`` is safe when several processes start at once on an empty cache.

numba issue 4807 reports crashes when processes compile and write the same
cache files concurrently. Here four processes wait at a start gate (a file
the test creates once all of them are running), then import hostpool_nb on
the same fresh ``NUMBA_CACHE_DIR`` - so all of them compile and write the
kernels' cache files at the same time - and run alloc/free sequences whose
results they print. A second wave then starts together on the now-warm
cache: it must work too, and load every kernel from the cache.

Needs no torch. Skipped under ``NUMBA_DISABLE_JIT=1`` (no JIT, no cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hostpool_nb

pytestmark = [
    pytest.mark.slow,  # child processes compiling into an empty cache
    pytest.mark.skipif(
        os.environ.get("NUMBA_DISABLE_JIT") == "1", reason="the numba cache exists only with the JIT on"
    ),
]

N_PROCS = 4
# Whole test under a minute. On a loaded 2-core machine a cold wave (four
# concurrent compiles) takes ~5-15 s and a warm one ~3-8 s.
COLD_TIMEOUT_S = 150.0  # 3-4 processes compiling every kernel on 2 shared cores
TOTAL_TIMEOUT_S = 240.0

# Runs in each child. Waits for the gate file, then imports (and so compiles
# or loads) the kernels, and prints one JSON line of results.
CHILD = r"""
import json, os, sys, time
gate = sys.argv[1]
deadline = time.monotonic() + 30
open(sys.argv[2], "w").close()  # "I am running"
while not os.path.exists(gate):
    if time.monotonic() > deadline:
        sys.exit("start gate never opened")
    time.sleep(0.002)

import numpy as np
import hostpool_nb
from hostpool_nb._kernels import pool as K
from hostpool_nb._kernels.jit import Kernel

p = hostpool_nb.LogicalHostPool(1024, 16)
a = p.alloc(64)
b = p.alloc(32)
freed = p.free(a)
c = p.alloc(960)  # more than the free list: merges the release list (FIFO)
short = p.alloc(48)  # only 32 slots left: None
p.free(b)
p.free(c)
try:
    p.free(b)
    double = "accepted"
except hostpool_nb.DoubleFreeError:
    double = "DoubleFreeError"
p.check_invariants()
# The kernels this process used: each compiled, or loaded from the cache, on first use.
kernels = {n: v.dispatcher for n, v in vars(K).items() if isinstance(v, Kernel) and v.compiled}
print(json.dumps({
    "a": a.tolist(), "b": b.tolist(), "c": c.tolist(), "freed": freed,
    "short": short is None, "double": double, "available": p.available_size(),
    "kernels": len(kernels),
    "not_from_cache": sorted(n for n, k in kernels.items() if k.stats.cache_misses or not k.stats.cache_hits),
}))
"""

EXPECTED = {
    "a": list(range(64)),
    "b": list(range(64, 96)),
    "c": list(range(96, 1024)) + list(range(32)),
    "freed": 64,
    "short": True,
    "double": "DoubleFreeError",
    "available": 1024,
}


def _child_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["NUMBA_CACHE_DIR"] = str(cache_dir)
    env.pop("NUMBA_DISABLE_JIT", None)
    # Import the same hostpool_nb as this test does (checkout or installed).
    root = str(Path(hostpool_nb.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _wave(tmp: Path, cache_dir: Path, name: str, timeout: float) -> list[dict]:
    """Start N_PROCS children, open the gate when all run, return their results.

    Fails (and kills the children) if the wave takes over ``timeout`` seconds.
    """
    gate = tmp / f"{name}.go"
    env = _child_env(cache_dir)
    procs, ready = [], []
    try:
        for i in range(N_PROCS):
            r = tmp / f"{name}.{i}.ready"
            ready.append(r)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", CHILD, str(gate), str(r)],
                    env=env,
                    cwd=str(tmp),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        end = time.monotonic() + timeout
        deadline = min(end, time.monotonic() + 20)
        while not all(r.exists() for r in ready):
            assert time.monotonic() < deadline, "children did not start"
            assert all(p.poll() is None for p in procs), "a child exited before the gate opened"
            time.sleep(0.005)
        gate.touch()
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=max(end - time.monotonic(), 0.1))
            assert p.returncode == 0, f"{name}: child exited {p.returncode}:\n{err[-3000:]}"
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert lines, f"{name}: child printed no result; stdout={out!r} stderr={err[-3000:]}"
            outs.append(json.loads(lines[-1]))
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            # Unclosed pipes of killed children would surface later as
            # ResourceWarnings (errors here) blamed on an unrelated test.
            for pipe in (p.stdout, p.stderr):
                if pipe is not None:
                    pipe.close()


def test_concurrent_cold_then_warm_cache(tmp_path: Path) -> None:
    start = time.monotonic()
    cache_dir = tmp_path / "numba_cache"
    cold = _wave(tmp_path, cache_dir, "cold", COLD_TIMEOUT_S)
    for res in cold:
        assert {k: res[k] for k in EXPECTED} == EXPECTED
        assert res["kernels"] == 2  # the page-size class's short alloc and free: only what the calls used
    assert any(res["not_from_cache"] for res in cold), "the cold wave found a warm cache"
    written = sorted(p.name for p in cache_dir.rglob("*") if p.suffix in (".nbi", ".nbc"))
    assert any(n.endswith(".nbi") for n in written), written
    assert any(n.endswith(".nbc") for n in written), written

    warm = _wave(tmp_path, cache_dir, "warm", TOTAL_TIMEOUT_S - (time.monotonic() - start))
    for res in warm:
        assert {k: res[k] for k in EXPECTED} == EXPECTED
        # Every kernel came from the cache the cold wave wrote concurrently.
        assert res["not_from_cache"] == [], res
