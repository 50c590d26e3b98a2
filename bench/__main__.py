"""python -m bench: hostpool_nb against the original algorithms, side by side in one process.

Every workload runs hostpool_nb and the algorithm it replaces (on numpy,
and on torch when torch imports) in the same process, interleaved; each
figure is a median of repeats, each ratio baseline time / hostpool_nb time
(above 1: hostpool_nb is faster). The default run took 2.5 minutes on a
2-core VM, and 40 s more the first time, to compile the kernels; --scale
multiplies repeats, loop lengths and trace lengths, and from 2 on also
times every allocation size in steps of 4 (--full is --scale 3, 12
minutes there).
--trace PATH times a trace recorded with pool.recording(PATH) as well; your
own workload. The default run holds up to 1.5 GB of memory at its peak
(--full: 3 GB): the 1M-slot pools of every implementation, side by side.
Off a terminal (a CI log, | tee, > file) it prints a line as each workload
ends; the table fits 80 columns (--wide: one line a row).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from . import engine, hicache, host, kvtrace, memory, paged, pool, startup, tracking  # noqa: F401 - each registers its workloads
from .core import TORCH, WORKLOADS, Context
from .report import WIDE, WIDTH, machine_info, machine_line, summary, table, wrap, write_json, write_plot
from .timing import Progress, is_terminal

PROG = "python -m bench"
FULL_SCALE = 3.0


def _say(text: str) -> None:
    print(f"bench: {text}", flush=True)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} minutes" if seconds >= 90 else f"{seconds:.0f} s"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        fail(message)


def fail(message: str) -> None:
    """One line on stderr and exit status 2: a mistake is reported before anything is measured."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _writable(option: str, path: str | None) -> None:
    if path is None:
        return
    p = Path(path)
    if path.endswith(("/", os.sep)) or p.is_dir():
        fail(f"cannot write {option} {path}: it is a directory")
    if not p.parent.is_dir():
        fail(f"cannot write {option} {path}: directory {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK):
        fail(f"cannot write {option} {path}: directory {p.parent} is not writable")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=None, help="more repeats, longer loops and traces (default 1)")
    ap.add_argument("--full", action="store_true", help=f"the complete run: --scale {FULL_SCALE:g}")
    ap.add_argument("--only", metavar="NAMES", help=f"comma-separated workloads, of: {', '.join(WORKLOADS)}")
    ap.add_argument("--trace", metavar="PATH", help="time a trace recorded with pool.recording(PATH) too")
    ap.add_argument(
        "--max-pool-bytes",
        type=int,
        default=None,
        metavar="N",
        help="with --trace: refuse to build pools taking more memory than this (default 1 GiB)",
    )
    ap.add_argument("--json", metavar="PATH", help="write every figure, with the machine's details, to PATH")
    ap.add_argument("--plot", metavar="PATH", help="draw the round trips to a PNG (needs matplotlib)")
    ap.add_argument("--no-torch", action="store_true", help="leave the torch baseline out even if torch imports")
    ap.add_argument("--torch-threads", type=int, default=1, metavar="N", help="torch intra-op threads (default 1)")
    ap.add_argument(
        "--no-progress", action="store_true", help="no progress bar on a terminal, no progress lines off one"
    )
    ap.add_argument("--wide", action="store_true", help="the table one line a row, about 110 columns wide")
    args = ap.parse_args(argv)
    chosen = args.full or args.scale is not None or args.only is not None  # what runs, said by an option
    if args.scale is None:
        args.scale = 1.0
    if args.full:
        args.scale = FULL_SCALE
    if not args.scale > 0:
        fail(f"--scale must be positive, got {args.scale}")
    if args.torch_threads < 0:
        fail(f"--torch-threads must be 0 (torch's default) or more, got {args.torch_threads}")
    if args.only is not None:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in WORKLOADS]
        if not names or unknown:
            fail(f"--only: unknown workload(s) {','.join(unknown) or '(none)'}; choose from {','.join(WORKLOADS)}")
        args.only = names
    elif args.trace is not None and not chosen:
        args.only = ["recorded"]  # --trace with no option that says what else runs: only the trace
    if args.max_pool_bytes is not None and args.trace is None:
        fail("--max-pool-bytes bounds the pools of --trace: give --trace PATH too")
    if args.trace is not None:
        from hostpool_nb.replay import MAX_POOL_BYTES, check_buildable, original_problem
        from hostpool_nb.trace import TraceError, load

        if args.max_pool_bytes is None:
            args.max_pool_bytes = MAX_POOL_BYTES
        if args.max_pool_bytes < 1:
            fail(f"--max-pool-bytes must be positive, got {args.max_pool_bytes}")
        try:  # everything that can stop the trace's timing, said now in one line, not after the other workloads
            trace = load(args.trace)
            check_buildable(trace, args.max_pool_bytes, with_original=original_problem(trace) is None)
        except (OSError, TraceError) as exc:
            fail(f"--trace {args.trace}: {exc}")
    _writable("--json", args.json)
    _writable("--plot", args.plot)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.pop("HOSTPOOL_NB_RECORD", None):  # a server's shell: the bench's own pools are never recorded
        _say("HOSTPOOL_NB_RECORD is set; the bench's own pools are not recorded")
    with_torch = None if not args.no_torch else False
    impls = pool.implementations(with_torch)
    if TORCH in impls and args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)  # one thread, as hostpool_nb and numpy use
    names = args.only or [n for n in WORKLOADS if n != "recorded" or args.trace]
    chosen = [WORKLOADS[n] for n in names]
    total = sum(max(w.seconds, 1.0) * args.scale for w in chosen)
    progress = Progress(total, enabled=not args.no_progress)
    # Off a terminal there is no bar to watch: a line as each workload ends, into the log as it runs.
    lines = not args.no_progress and not is_terminal(sys.stdout)
    ctx = Context(args.scale, impls, progress.advance, progress.label)
    ctx.raw["trace_path"] = args.trace
    ctx.raw["max_pool_bytes"] = args.max_pool_bytes
    started = time.perf_counter()
    rows = []
    done = 0.0
    if lines:
        what = f"{len(chosen)} workload{'s' if len(chosen) != 1 else ''}"
        _say(f"{what}, about {_minutes(total)} on 2 cores; the first run compiles (40 s)")
    try:
        progress.label("compiling and loading kernels")
        from hostpool_nb import warmup

        warmup.compile_all(quiet=True)
        for i, w in enumerate(chosen, 1):
            ctx.tick = lambda share, w=w: progress.advance(share * max(w.seconds, 1.0) * args.scale)
            rows += w.run(ctx)
            done += max(w.seconds, 1.0) * args.scale
            progress.reach(done)
            if lines:
                _say(f"{w.name} done ({i} of {len(chosen)}, {time.perf_counter() - started:.0f} s so far)")
    finally:
        progress.close()
    info = machine_info()
    elapsed = time.perf_counter() - started
    width = WIDE if args.wide else WIDTH
    print(wrap(f"hostpool_nb benchmark, scale {args.scale:g} ({elapsed:.0f} s); {machine_line(info)}", width=width))
    print(
        wrap(
            f"{'x numpy, x torch' if TORCH in impls else 'x numpy'} = baseline time / hostpool_nb time "
            "(above 1x: hostpool_nb is faster or smaller)",
            width=width,
        )
    )
    print(
        wrap("target = the bound a figure should meet; met? = whether it did in this run (NO: it did not)", width=width)
    )
    print()
    print(table(rows, TORCH in impls, wide=args.wide))
    print()
    for line in summary(rows).splitlines():
        print(wrap(line, "", "  ", width))
    for note in ctx.notes:
        print(wrap(note, "- ", "  ", width))
    if args.json:
        write_json(args.json, rows, ctx.notes, info, scale=args.scale, elapsed_s=elapsed)
    if args.plot:
        write_plot(args.plot, rows, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
