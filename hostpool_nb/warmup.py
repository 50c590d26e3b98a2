"""``python -m hostpool_nb.warmup``: compile every kernel now and fill numba's cache.

Importing hostpool_nb compiles nothing; each kernel compiles (or loads from
the cache) on its first use. A container build step or a CI job that runs
this once starts every later process with every kernel cached.
"""

from __future__ import annotations

import sys
import time


def compile_all(quiet: bool = False) -> float:
    """Compile (or load) every kernel of the package; return the seconds it took."""
    started = time.perf_counter()
    import hostpool_nb.paged  # noqa: F401, PLC0415 - importing the kernel modules compiles their kernels

    took = time.perf_counter() - started
    if not quiet:
        print(f"hostpool_nb: every kernel compiled or loaded in {took:.1f} s", file=sys.stderr)
    return took


if __name__ == "__main__":
    compile_all()
