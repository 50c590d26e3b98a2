"""Compare this checkout's hostpool_nb with an earlier revision's, side by side.

``python -m bench.compare [REV] [--only-cells ...]`` (REV defaults to HEAD)

Every change to the hot path must say what it cost or saved. Absolute times
on a shared machine move by tens of percent between runs, so the working
tree's pool and REV's pool are timed in the same process, interleaved, on
the same round-trip cells as ``python -m bench``: the ratio REV time / this
time is what a change is judged by (above 1: this checkout is faster).

REV's package is extracted with ``git archive`` into a cache folder under
the system's temporary directory, renamed so both can be imported at once;
its kernels are compiled there once (about 10 s) and cached for later runs.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import Any

from .cli import Parser
from .report import fmt_ratio, fmt_time
from .workloads import MIB_SLOTS, measure_roundtrip

ROOT = Path(__file__).resolve().parent.parent
# (page_size, k, pool slots): the single-page headline cell and the
# 65,536-slot cells of every page size, the two ends the issues track.
DEFAULT_CELLS = [
    (64, 64, MIB_SLOTS),
    (16, 16, MIB_SLOTS),
    (1, 1, 1 << 16),
    (64, 65536, MIB_SLOTS),
    (16, 65536, MIB_SLOTS),
    (1, 65536, MIB_SLOTS),
]


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True).stdout


def load_revision(rev: str) -> tuple[str, Callable[[int, int], Any]]:
    """``(short sha, LogicalHostPool class)`` of ``rev``'s package."""
    try:
        sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    except subprocess.CalledProcessError:
        raise SystemExit(f"python -m bench.compare: error: {rev!r} is not a git revision of {ROOT}") from None
    short = sha[:10]
    name = f"hostpool_nb_{short}"
    base = Path(tempfile.gettempdir()) / "hostpool_nb-compare"
    target = base / name
    if not (target / "__init__.py").is_file():
        tmp = base / f".{name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with tarfile.open(fileobj=BytesIO(_git("archive", "--format=tar", sha, "hostpool_nb"))) as tar:
            tar.extractall(tmp, filter="data")
        (tmp / "hostpool_nb").rename(target)
        tmp.rmdir()
    sys.path.insert(0, str(base))
    module = importlib.import_module(name)
    return short, module.LogicalHostPool


def main(argv: list[str] | None = None) -> int:
    ap = Parser("python -m bench.compare", __doc__ or "")
    ap.add_argument("rev", nargs="?", default="HEAD", help="git revision to compare against (default: HEAD)")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats per cell (default: 7)")
    ap.add_argument(
        "--min-loop", type=float, default=0.05, metavar="S", help="shortest timed loop, seconds (default: 0.05)"
    )
    args = ap.parse_args(argv)
    from hostpool_nb import LogicalHostPool

    short, old = load_revision(args.rev)
    impls: dict[str, Callable[[int, int], Any]] = {"this": LogicalHostPool, short: old}
    print(f"round trip free(alloc(k)): this checkout vs {args.rev} ({short}); ratio = {short} time / this time")
    print(f"{'page':>4}  {'k':>6}  {'pool':>8}  {'this':>9}  {short:>10}  {'ratio':>6}  paired min..max")
    for ps, k, pool in DEFAULT_CELLS:
        cell = measure_roundtrip(impls, ps, k, pool, args.repeats, min_loop_s=args.min_loop, max_loop_s=1.0)
        a, b = cell.samples["this"], cell.samples[short]
        paired = sorted(y / x for x, y in zip(a, b, strict=True))
        print(
            f"{ps:>4}  {k:>6}  {pool:>8}  {fmt_time(cell.per_op['this']):>9}  {fmt_time(cell.per_op[short]):>10}  "
            f"{fmt_ratio(cell.per_op[short] / cell.per_op['this']):>6}  {paired[0]:.2f}..{paired[-1]:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
