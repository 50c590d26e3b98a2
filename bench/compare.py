"""Compare this checkout's hostpool_nb with an earlier revision's, side by side.

``python -m bench.compare [REV] [--only-cells PAGE:K,...]`` (REV defaults to HEAD)

Every change to the hot path must say what it cost or saved. Absolute times
on a shared machine move by tens of percent between runs, so the working
tree's pool and REV's pool are timed in the same process, interleaved, on
the same round-trip cells as ``python -m bench``: the ratio REV time / this
time is what a change is judged by (above 1: this checkout is faster).

``--only-cells 64:64`` times the single-page headline cell alone (page
size 64, 64 slots, 1M-slot pool); by default all eleven cells run: one page
and 65,536 slots at page sizes 64, 16 and 1; ``1:65536s``, 65,536 slots
of page size 1 from a free list shuffled page by page (no runs of
consecutive pages: the case a run-based shortcut must not make slower);
and ``64:64t``, the single page on a pool made with ``track=True``; and
``1:trace``, ``16:trace`` and ``64:trace``, the KV-cache trace of
``python -m bench`` (requests of about 1,300 slots arriving and finishing
out of order in a 1M-slot pool kept near full, whose free lists fragment
into runs of a few pages to a few hundred), timed per call.

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
from .workloads import MIB_SLOTS, make_trace, measure_roundtrip, measure_trace

ROOT = Path(__file__).resolve().parent.parent
TRACE = 0  # k of a KV-cache trace cell
TRACKED = 1 << 40  # k of the tracked single-page cell (its k is the page size)
# (page_size, k, pool slots): the single-page headline cell and the
# 65,536-slot cells of every page size, the two ends the issues track.
DEFAULT_CELLS = [
    (64, 64, MIB_SLOTS),
    (16, 16, MIB_SLOTS),
    (1, 1, 1 << 16),
    (64, 65536, MIB_SLOTS),
    (16, 65536, MIB_SLOTS),
    (1, 65536, MIB_SLOTS),
    (1, -65536, MIB_SLOTS),  # negative k: the same cell from a shuffled free list
    (1, TRACE, MIB_SLOTS),
    (16, TRACE, MIB_SLOTS),
    (64, TRACE, MIB_SLOTS),
    (64, TRACKED, MIB_SLOTS),  # the single page on a pool made with track=True
]
SHUFFLE_SEED = 0
TRACE_OPS = 30_000  # python -m bench's default trace length


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True).stdout


def revision_before(path: str) -> str | None:
    """``SHA^``, the revision before the commit that added ``path`` (relative to the root); ``None`` if unknown.

    What to compare against to see what a feature costs when it is off:
    read from git, so the note stays right when the history is rewritten.
    """
    try:
        added = _git("log", "--diff-filter=A", "--format=%h", "--", path).decode().split()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{added[-1]}^" if added else None


def cell_name(page_size: int, k: int) -> str:
    if k == TRACE:
        return f"{page_size}:trace"
    if k == TRACKED:
        return f"{page_size}:{page_size}t"
    return f"{page_size}:{k}" if k > 0 else f"{page_size}:{-k}s"


def _tracking(cls: Callable[..., Any]) -> Callable[[int, int], Any]:
    return lambda size, page_size: cls(size, page_size, track=True)


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
    ap.add_argument(
        "--only-cells",
        metavar="PAGE:K,...",
        help="comma-separated cells to time, as page size:k, of "
        + ",".join(cell_name(ps, k) for ps, k, _ in DEFAULT_CELLS)
        + " (default: all)",
    )
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: {args.repeats} is not a positive number")
    cells = DEFAULT_CELLS
    if args.only_cells is not None:
        by_name = {cell_name(ps, k): (ps, k, pool) for ps, k, pool in DEFAULT_CELLS}
        chosen = [c.strip() for c in args.only_cells.split(",") if c.strip()]
        unknown = [c for c in chosen if c not in by_name]
        if not chosen or unknown:
            ap.error(
                f"--only-cells: unknown cell(s) {','.join(unknown) or '(none given)'}; choose from {','.join(by_name)}"
            )
        cells = [by_name[c] for c in dict.fromkeys(chosen)]
    from hostpool_nb import LogicalHostPool

    short, old = load_revision(args.rev)
    impls: dict[str, Callable[[int, int], Any]] = {"this": LogicalHostPool, short: old}
    print(f"round trip free(alloc(k)): this checkout vs {args.rev} ({short}); ratio = {short} time / this time")
    print("k ending in s: the free list shuffled page by page; trace: the KV-cache trace, time per call")
    print(f"{'page':>4}  {'k':>6}  {'pool':>8}  {'this':>9}  {short:>10}  {'ratio':>6}  paired min..max")
    for ps, k, pool in cells:
        if k == TRACE:
            cell = measure_trace(impls, make_trace(pool, ps, TRACE_OPS), args.repeats)
        elif k == TRACKED:
            tracked = {name: _tracking(cls) for name, cls in impls.items()}
            cell = measure_roundtrip(tracked, ps, ps, pool, args.repeats, min_loop_s=args.min_loop, max_loop_s=1.0)
        else:
            seed = None if k > 0 else SHUFFLE_SEED
            cell = measure_roundtrip(
                impls, ps, abs(k), pool, args.repeats, min_loop_s=args.min_loop, max_loop_s=1.0, shuffle_seed=seed
            )
        a, b = cell.samples["this"], cell.samples[short]
        paired = sorted(y / x for x, y in zip(a, b, strict=True))
        shown = cell_name(ps, k).split(":")[1]
        print(
            f"{ps:>4}  {shown:>6}  {pool:>8}  {fmt_time(cell.per_op['this']):>9}  {fmt_time(cell.per_op[short]):>10}  "
            f"{fmt_ratio(cell.per_op[short] / cell.per_op['this']):>6}  {paired[0]:.2f}..{paired[-1]:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
