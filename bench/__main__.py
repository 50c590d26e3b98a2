"""``python -m bench``: hostpool_nb against the original algorithm, side by side.

Quick mode (the default) runs every workload at reduced sizes in under a
minute on 2 cores, plus about half a minute for the paged workload (at the
issue's sizes in both modes: the numpy oracle's ``free`` with 1M free pages
takes seconds), and prints one table; ``--full`` runs the complete sizes.
Ratios are baseline time / hostpool_nb time (above 1: hostpool_nb is
faster), each the median of interleaved repeats in this one process; targets
are bounds on those ratios (but the tracking workload's: hostpool_nb against
itself, it bounds tracked / untracked time). ``--json`` keeps every figure,
baselines' times included.

``--trace PATH`` times a trace recorded with ``pool.recording(PATH)`` the
same way, on hostpool_nb and the baselines: your own workload. Given
alone, it runs only that; with ``--only NAMES`` those workloads run too.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from . import report
from .cli import Parser, output_path_error, wrap
from .impls import torch_available
from .recorded import RecordedTraceError, ReplayDivergence, read
from .suite import WORKLOADS, _steps, full_config, quick_config, run_suite
from .timing import Progress

PROG = "python -m bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked: a mistake exits (status 2, one line) before anything is measured."""
    ap = Parser(PROG, __doc__)
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
    ap.add_argument(
        "--no-progress", action="store_true", help="no progress bar (there is one only on a terminal, with tqdm)"
    )
    ap.add_argument(
        "--trace",
        metavar="PATH",
        help="time a trace recorded with pool.recording(PATH) on hostpool_nb and the baselines; "
        "runs only that unless --only names workloads too",
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of the trace, the memory workload's free order and the paged batches"
    )
    args = ap.parse_args(argv)
    if args.only is not None:
        chosen = tuple(w.strip() for w in args.only.split(",") if w.strip())
        unknown = [w for w in chosen if w not in WORKLOADS]
        if not chosen:
            ap.error(f"--only: no workload given; choose from {','.join(WORKLOADS)}")
        if unknown:
            ap.error(f"--only: unknown workload(s) {','.join(unknown)}; choose from {','.join(WORKLOADS)}")
        args.only = chosen
    if args.torch_threads < 0:
        ap.error(f"--torch-threads: {args.torch_threads} is negative")
    running = args.only or (() if args.trace else WORKLOADS)
    if args.plot and "roundtrip" not in running:
        hint = "" if args.only else " (with --trace, add --only roundtrip)"
        ap.error("--plot needs the roundtrip workload" + hint)
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            problem = output_path_error(option, path)
            if problem:
                ap.error(problem)
    if args.json is not None and args.plot is not None and Path(args.json).resolve() == Path(args.plot).resolve():
        ap.error("--json and --plot name the same file")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path and args.trace and Path(path).resolve() == Path(args.trace).resolve():
            ap.error(f"{option} names the --trace file, which it would overwrite")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install matplotlib (or the bench extra: pip install -e '.[bench]')")
    # Last: reading a long trace takes a moment, and every cheaper check
    # should fail first.
    args.recorded = None
    if args.trace is not None:
        if not args.trace:
            ap.error("--trace: no path given")
        try:
            args.recorded = read(args.trace)
        except RecordedTraceError as exc:
            ap.error(f"--trace {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table and notes, write ``--json``/``--plot``; the exit status."""
    args = parse_args(argv)
    cfg = full_config() if args.full else quick_config()
    cfg.seed = args.seed
    if args.only:
        cfg.workloads = args.only
    elif args.trace:
        cfg.workloads = ()
    cfg.recorded_trace = args.trace
    with_torch = torch_available() and not args.no_torch
    nimpl = 3 if with_torch else 2
    progress = Progress(_steps(cfg, nimpl, args.recorded), enabled=not args.no_progress)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's import-time chatter would break the bar
            doc = run_suite(cfg, with_torch, progress, torch_threads=args.torch_threads or None, recorded=args.recorded)
    except KeyboardInterrupt:  # Ctrl-C is not an error worth a traceback
        progress.close()
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except ReplayDivergence as exc:  # the trace, not the benchmark: one line, like the checks above
        progress.close()
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    progress.close()

    info = doc["machine"]
    print(
        wrap(
            f"hostpool_nb benchmark, {doc['mode']} mode ({doc['elapsed_s']:.0f} s); "
            f"{report.machine_line(info, with_torch)}"
        )
    )
    print(
        wrap(
            "x numpy, x torch = baseline / hostpool_nb, of time (of bytes on the metadata rows): above 1x, "
            "hostpool_nb is faster (smaller); targets are bounds on these ratios, except on the tracking rows, "
            "hostpool_nb against itself, which have no ratio columns and whose target names both sides. "
            "hostpool_nb = its median time (bytes per page). Medians of interleaved repeats; the baselines' own "
            "figures and the spread of the paired ratios are in --json."
        )
    )
    print()
    print(report.render_table(doc["rows"], with_torch))
    print()
    for note in doc["notes"]:
        print(wrap(note, "- ", "  "))
    if not with_torch:
        print("- torch not installed (or --no-torch): torch columns are n/a")
    status = 0
    # The paths were checked before measuring; these still fail on a full
    # disk or a directory removed meanwhile, and the table is printed by then.
    if args.json:
        try:
            report.write_json(args.json, doc)
            print(wrap(f"results written to {args.json}", "- ", "  "))
        except OSError as exc:
            print(f"{PROG}: error: cannot write --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
            status = 1
    if args.plot:
        cells = [c for c in doc["raw"]["roundtrip"] if c["workload"] == "round trip"]
        floors = {k: v["copy"] for k, v in doc["raw"]["floors"].items()}
        try:
            report.write_plot(args.plot, cells, floors, info)
            print(wrap(f"plot written to {args.plot}", "- ", "  "))
        except OSError as exc:
            print(f"{PROG}: error: cannot write --plot {args.plot}: {exc.strerror or exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
