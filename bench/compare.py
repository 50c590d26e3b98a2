"""python -m bench.compare [REV]: this checkout's pool against a revision's, side by side.

Every change to the hot path says what it cost or saved. The two pools are
timed in one process, interleaved, on the cells of python -m bench; the
ratio REV time / this time is what a change is judged by (above 1: this
checkout is faster). REV's package is extracted with git archive into a
folder under the system's temporary directory, under another name, so both
import at once; its kernels compile there once.

Cells (--only-cells, comma-separated): 64:64, 16:16, 1:1 (one page);
1:4096, 1:16384 (the GIL kept; released, the capacity unchecked);
64:65536, 16:65536, 1:65536; 1:65536s (from a free list shuffled page by
page); 1:trace, 16:trace, 64:trace (the KV-cache trace, per call); 64:64t
(one page on a pool made with track=True); paged:free, paged:extend,
paged:decode (hostpool_nb.paged's untracked allocator at page size 16, as
the paged rows of python -m bench time it); swa:extend, swa:decode,
swa:free, swa:free_swa (the sliding-window allocator, as the swa rows).

--runs N times every cell in N fresh processes and gives each cell's
median ratio over them, with the runs' range: the cells after a 1M-slot
restore (paged, swa) and the 65,536-slot ones move a few percent with the
process's memory layout, more than a change under test. Half the runs
take the revision first (import, pools, first calls, kernel loads), half
this checkout, so neither always gets the place that comes with being
first.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from typing import Any

from .kvtrace import make_trace, measure_trace
from .paged import compare_cell as paged_cell
from .paged import swa_compare_cell
from .pool import MIB_SLOTS, measure_roundtrip
from .report import fmt_ratio, fmt_value
from .timing import median

ROOT = Path(__file__).resolve().parent.parent
CELLS = [
    "64:64",
    "16:16",
    "1:1",
    "1:4096",
    "1:16384",
    "64:65536",
    "16:65536",
    "1:65536",
    "1:65536s",
    "1:trace",
    "16:trace",
    "64:trace",
    "64:64t",
    "paged:free",
    "paged:extend",
    "paged:decode",
    "swa:extend",
    "swa:decode",
    "swa:free",
    "swa:free_swa",
]
TRACE_OPS = 30_000


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True).stdout


def load_revision(rev: str) -> tuple[str, Any]:
    """``(short sha, package)`` of ``rev``'s hostpool_nb, imported under another name."""
    try:
        sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    except subprocess.CalledProcessError:
        raise SystemExit(f"python -m bench.compare: error: {rev!r} is not a git revision of {ROOT}") from None
    name = f"hostpool_nb_{sha[:10]}"
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
    return sha[:10], importlib.import_module(name)


def measure_cell(
    cell: str, impls: dict[str, Callable[..., Any]], repeats: int, min_loop_s: float
) -> dict[str, list[float]]:
    ps_text, k_text = cell.split(":")
    if ps_text == "paged":
        return paged_cell(k_text, impls, repeats, min_loop_s)
    if ps_text == "swa":
        return swa_compare_cell(k_text, impls, repeats, min_loop_s)
    ps = int(ps_text)
    if k_text == "trace":
        return measure_trace(impls, make_trace(MIB_SLOTS, ps, TRACE_OPS), repeats, floors=False)
    tracked = k_text.endswith("t")
    shuffled = k_text.endswith("s")
    k = int(k_text.rstrip("ts"))
    if tracked:
        impls = {n: functools.partial(cls, track=True) for n, cls in impls.items()}
    size = MIB_SLOTS if k > 1 else 1 << 16
    return measure_roundtrip(impls, ps, k, size, repeats, min_loop_s, 1.0, shuffled)


def main(argv: list[str] | None = None) -> int:
    os.environ.pop("HOSTPOOL_NB_RECORD", None)  # the timed processes' pools are never recorded: they would time it
    ap = argparse.ArgumentParser(
        prog="python -m bench.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("rev", nargs="?", default="HEAD", help="the git revision to compare against (default: HEAD)")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats per cell (default: 7)")
    ap.add_argument("--min-loop", type=float, default=0.05, metavar="S", help="shortest timed loop (default 0.05 s)")
    ap.add_argument("--only-cells", metavar="CELLS", help="comma-separated cells (default: all)")
    ap.add_argument("--runs", type=int, default=1, help="fresh processes per cell (default: 1)")
    ap.add_argument("--run", choices=("this-first", "rev-first"), help=argparse.SUPPRESS)  # one of --runs' processes
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: {args.repeats} is not a positive number")
    if args.runs < 1:
        ap.error(f"--runs: {args.runs} is not a positive number")
    if not 0 <= args.min_loop <= 60:  # nan fails both; 0 is one pass a sample (the smoke tests)
        ap.error(f"--min-loop: {args.min_loop} is not a number of seconds from 0 to 60")
    cells = CELLS
    if args.only_cells is not None:
        cells = list(dict.fromkeys(c.strip() for c in args.only_cells.split(",") if c.strip()))
        unknown = [c for c in cells if c not in CELLS]
        if not cells or unknown:
            ap.error(f"--only-cells: unknown cell(s) {','.join(unknown) or '(none)'}; choose from {','.join(CELLS)}")
    if args.runs > 1:
        return _runs(args, cells)
    if args.run == "rev-first":
        short, old = load_revision(args.rev)
    import hostpool_nb

    if args.run != "rev-first":
        short, old = load_revision(args.rev)
    # In that order every cell makes its pools, calls them first and loads their kernels: a --runs process
    # that imports the revision first also serves it first.
    packages = (
        {short: old, "hostpool_nb": hostpool_nb}
        if args.run == "rev-first"
        else {"hostpool_nb": hostpool_nb, short: old}
    )
    if args.run is None:
        print(f"this checkout against {args.rev} ({short}): ratio = {short} time / this time, paired min..max")
        print(f"{'cell':>9}  {'this':>9}  {short:>10}  {'ratio':>6}  paired")
    for cell in cells:
        if cell.startswith(("paged:", "swa:")):
            kind = "PagedTokenToKVPoolAllocator" if cell.startswith("paged:") else "SWATokenToKVPoolAllocator"
            impls = {n: getattr(importlib.import_module(f"{p.__name__}.paged"), kind) for n, p in packages.items()}
        else:
            impls = {n: p.LogicalHostPool for n, p in packages.items()}
        s = measure_cell(cell, impls, args.repeats, args.min_loop)
        mine, theirs = s["hostpool_nb"], s[short]
        if args.run is not None:  # for the parent of --runs: one line per cell
            print(json.dumps({"cell": cell, "sha": short, "this": median(mine), "rev": median(theirs)}), flush=True)
            continue
        paired = sorted(b / a for a, b in zip(mine, theirs, strict=True))
        print(
            f"{cell:>9}  {fmt_value(median(mine), 's'):>9}  {fmt_value(median(theirs), 's'):>10}  "
            f"{fmt_ratio(median(theirs) / median(mine)):>6}  {paired[0]:.2f}..{paired[-1]:.2f}"
        )
    return 0


def _runs(args: argparse.Namespace, cells: list[str]) -> int:
    """``--runs N``: each cell timed in N fresh processes, half importing the revision first; medians over runs."""
    print(
        f"this checkout against {args.rev}, {args.runs} runs: ratio = the median over runs of "
        "(revision time / this time), runs min..max"
    )
    head = False
    for cell in cells:
        found: list[dict[str, Any]] = []
        for i in range(args.runs):
            order = "rev-first" if i % 2 else "this-first"
            command = [sys.executable, "-m", "bench.compare", args.rev, "--repeats", str(args.repeats)]
            command += ["--min-loop", str(args.min_loop), "--only-cells", cell, "--run", order]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or len(lines) != 1:
                sys.stderr.write(done.stderr)
                raise SystemExit(f"python -m bench.compare: run {i + 1} of {cell} failed (exit {done.returncode})")
            found.append(json.loads(lines[0]))
        short = found[0]["sha"]
        if not head:
            print(f"{'cell':>12}  {'this':>9}  {short:>10}  {'ratio':>6}  runs")
            head = True
        ratios = sorted(f["rev"] / f["this"] for f in found)
        this, theirs = median([f["this"] for f in found]), median([f["rev"] for f in found])
        print(
            f"{cell:>12}  {fmt_value(this, 's'):>9}  {fmt_value(theirs, 's'):>10}  "
            f"{fmt_ratio(median(ratios)):>6}  {ratios[0]:.2f}..{ratios[-1]:.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
