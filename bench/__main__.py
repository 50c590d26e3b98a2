"""``python -m bench``: hostpool_nb against the original algorithm, side by side.

Quick mode (the default) runs every workload at reduced sizes in under a
minute on 2 cores and prints one table; ``--full`` runs the complete sizes.
Ratios are baseline time / hostpool_nb time (above 1: hostpool_nb is
faster), each the median of interleaved repeats in this one process.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from . import report
from .impls import torch_available
from .suite import WORKLOADS, _steps, full_config, quick_config, run_suite
from .timing import Progress


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="complete sizes (several minutes) instead of the quick run")
    ap.add_argument("--json", metavar="PATH", help="write machine-readable results (with machine info) to PATH")
    ap.add_argument("--plot", metavar="PATH", help="write a PNG of round-trip time per op against k (needs matplotlib)")
    ap.add_argument(
        "--only",
        metavar="NAMES",
        help=f"comma-separated subset of workloads: {','.join(WORKLOADS)}",
    )
    ap.add_argument("--no-torch", action="store_true", help="skip the torch baseline even if torch is installed")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads (default 1, like the others; 0: torch's default)",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    ap.add_argument("--seed", type=int, default=0, help="seed of the trace and the memory workload's free order")
    args = ap.parse_args(argv)
    if args.only:
        chosen = tuple(w.strip() for w in args.only.split(",") if w.strip())
        unknown = set(chosen) - set(WORKLOADS)
        if unknown:
            ap.error(f"--only: unknown workload(s) {sorted(unknown)}; choose from {','.join(WORKLOADS)}")
        args.only = chosen
    if args.plot and args.only and "roundtrip" not in args.only:
        ap.error("--plot needs the roundtrip workload")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:  # fail before measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "--plot needs matplotlib: pip install matplotlib (or the bench extra: pip install -e '.[bench]')",
                file=sys.stderr,
            )
            return 2
    cfg = full_config() if args.full else quick_config()
    cfg.seed = args.seed
    if args.only:
        cfg.workloads = args.only
    with_torch = torch_available() and not args.no_torch
    nimpl = 3 if with_torch else 2
    progress = Progress(_steps(cfg, nimpl), enabled=not args.no_progress)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's import-time chatter would break the bar
        doc = run_suite(cfg, with_torch, progress, torch_threads=args.torch_threads or None)

    info = doc["machine"]
    print(f"hostpool_nb benchmark, {doc['mode']} mode ({doc['elapsed_s']:.0f} s); {report.machine_line(info, with_torch)}")
    print("ratio = baseline time / hostpool_nb time (higher: hostpool_nb faster or smaller); medians of interleaved repeats")
    print()
    print(report.render_table(doc["rows"], with_torch))
    print()
    for note in doc["notes"]:
        print(f"- {note}")
    if not with_torch:
        print("- torch not installed (or --no-torch): torch columns are n/a")
    if args.json:
        report.write_json(args.json, doc)
        print(f"- results written to {args.json}")
    if args.plot:
        cells = [c for c in doc["raw"]["roundtrip"] if c["workload"] == "round trip"]
        floors = {k: v["copy"] for k, v in doc["raw"]["floors"].items()}
        report.write_plot(args.plot, cells, floors, info)
        print(f"- plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
