"""``python -m hostpool_nb.warmup``: compile every kernel now and fill numba's cache.

Importing hostpool_nb compiles nothing: each kernel compiles (or loads from
numba's on-disk cache) on its first use, so a process pays only for what it
calls. On a machine whose cache is empty (a fresh container, a CI job, a
new virtual environment) the first calls then take seconds. Run this once
where the cache will persist (a container build step, after ``pip
install``), and every later process loads every kernel in milliseconds.

The cache lives next to the package (``__pycache__``), or under
``~/.cache/numba`` when the package directory is not writable, or in
``NUMBA_CACHE_DIR`` when that is set; see the README.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from typing import Any


def compile_all(quiet: bool = False) -> float:
    """Compile (or load from the cache) every kernel of the package; return the seconds it took.

    Safe to call more than once and from several threads: a kernel is
    compiled once per process. Under ``NUMBA_DISABLE_JIT=1`` there is
    nothing to compile and it returns at once.
    """
    started = time.perf_counter()
    from ._kernels import MODULES  # noqa: PLC0415
    from ._kernels.jit import _COMPILER, KERNELS  # noqa: PLC0415

    for module in MODULES:  # every module that defines kernels, so that every kernel is listed
        importlib.import_module(f"._kernels.{module}", __package__)

    _COMPILER.announced = True  # this says what it does itself: no first-use notice
    if not quiet:
        print(f"hostpool_nb: compiling or loading {len(KERNELS)} kernels...", file=sys.stderr, flush=True)
    loaded = compiled = 0
    kernels = list(KERNELS)
    for i, made in enumerate(kernels, 1):
        began = time.perf_counter()
        dispatcher = made.dispatcher
        stats = getattr(dispatcher, "stats", None)
        if stats is not None and stats.cache_hits and not stats.cache_misses:
            loaded += 1
            how = "loaded"
        else:
            compiled += 1
            how = "compiled"
        if not quiet:  # a line per kernel: a cold run takes a minute
            name = f"{made.__module__.rpartition('.')[2]}.{made.__qualname__}"
            took = time.perf_counter() - began
            print(f"hostpool_nb: [{i}/{len(kernels)}] {name} {how} in {took:.2f} s", file=sys.stderr, flush=True)
    took = time.perf_counter() - started
    if not quiet:
        done = f"{compiled} compiled, {loaded} loaded from the cache"
        print(f"hostpool_nb: {len(KERNELS)} kernels ready in {took:.1f} s ({done})", file=sys.stderr)
    return took


def load(pool: Any) -> float:
    """Load (or compile) every kernel ``pool`` may call, now; return the seconds it took.

    Kernels load on their first use: the first ``alloc``, ``free`` or batch
    call of a new process would wait for its kernel. A server calls this
    while it starts, so its first requests wait for none; the pools an
    engine builds after ``install()`` (``hostpool_nb.integrations``) do it
    when they are built. With the kernels in numba's cache it takes
    milliseconds; with an empty cache it compiles them, seconds each
    (:func:`compile_all` ahead of time avoids that).

    Parameters
    ----------
    pool : LogicalHostPool, HostPagePool, a ``hostpool_nb.paged`` allocator, or a host pool under ``HostKVPoolMixin``
        The pool whose kernels to load.

    Examples
    --------
    >>> from hostpool_nb.paged import PagedTokenToKVPoolAllocator
    >>> from hostpool_nb.warmup import load
    >>> seconds = load(PagedTokenToKVPoolAllocator(1 << 16, 16, None))
    """
    calls = getattr(pool, "_kernel_calls", None)
    if calls is None:
        raise TypeError(f"load takes a hostpool_nb pool or allocator, got {type(pool).__name__}")
    started = time.perf_counter()
    for table, name in calls():
        getattr(table, name)  # an Entries attribute: compiled or loaded on first access
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hostpool_nb.warmup",
        description="Compile every hostpool_nb kernel now, filling numba's on-disk cache for later processes.",
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    args = parser.parse_args(argv)
    compile_all(quiet=args.quiet)
    return 0


__all__ = ["compile_all", "load"]

if __name__ == "__main__":
    sys.exit(main())
