"""The results as a table (tabulate), a summary of the targets, a JSON document and a plot.

Every ratio is baseline / hostpool_nb (above 1: hostpool_nb is faster, or
smaller), and every target is a bound on a ratio, so no figure has to be
read backwards; the tracking rows bound hostpool_nb against itself and say
so. The table shows hostpool_nb's value and the ratios; the baselines' own
figures and the spread of the paired ratios are in ``--json``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

import tabulate as _tabulate

from hostpool_nb._diagnostics.report import shown_duration, shown_ratio  # replay --time prints as the bench does

from .core import HOSTPOOL, IMPLS, NUMPY, TORCH, Row

WIDTH = 80  # the report's columns: a terminal's, a CI log's
WIDE = 110  # --wide: one line per row, with the workload's name on it
PARAMS_MAX = 24  # a row's params, and its target, longer than these become footnotes
TARGET_MAX = 16
WIDE_TARGET_MAX = 28


def wrap(text: str, first: str = "", rest: str = "", width: int = WIDTH) -> str:
    """``text`` filled to ``width`` columns; paths and names are never split."""
    return textwrap.fill(
        text, width, initial_indent=first, subsequent_indent=rest, break_long_words=False, break_on_hyphens=False
    )


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return shown_duration(value)
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:.3g} {unit.replace('/page', '/pg')}"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else shown_ratio(r)


def short_target(row: Row, torch_ran: bool) -> str:
    """A row's target as the narrow table shows it: the bounds it can judge, one bound for both if equal."""
    bounds = [(n, b) for n, b in row.bounds if n != TORCH or torch_ran]
    if not row.bounds:
        return row.target
    if len(bounds) > 1 and len({b for _, b in bounds}) == 1:
        return f">={bounds[0][1]:g}x both"
    return ", ".join(f">={b:g}x {n}" for n, b in bounds)


def table(rows: list[Row], torch_ran: bool, wide: bool = False) -> str:
    """The results: :data:`WIDTH` columns, each workload's name a line above its rows; ``wide``: one line a row.

    Without torch the torch column is left out of the narrow table; params
    and targets too long for their column become footnotes.
    """
    notes: list[str] = []

    def fit(text: str, limit: int) -> str:
        if len(text) <= limit:
            return text or "-"
        notes.append(text)
        return f"[{len(notes)}]"

    names = [NUMPY, TORCH] if wide or torch_ran else [NUMPY]
    lines = []
    last = None
    for r in rows:
        ratios = r.ratios
        cells = [fmt_value(r.values.get(HOSTPOOL), r.unit)]
        for name in names:
            shown = name in r.columns and (name != TORCH or torch_ran)
            cells.append(
                fmt_ratio(ratios.get(name)) if shown else ("n/a" if name == TORCH and name in r.columns else "-")
            )
        met = {True: "yes", False: "NO", None: "-"}[r.met]
        if wide:
            lines.append([r.workload, fit(r.params, PARAMS_MAX), *cells, fit(r.target, WIDE_TARGET_MAX), met])
            continue
        if r.workload != last:
            lines.append([r.workload] + [""] * (len(cells) + 2))
            last = r.workload
        lines.append([fit(r.params, PARAMS_MAX), *cells, fit(short_target(r, torch_ran), TARGET_MAX), met])
    _tabulate.MIN_PADDING = 0  # columns as wide as their widest cell
    headers = [HOSTPOOL, *(f"x {n}" for n in names), "target", "met?"]
    if not wide:  # a row's params indented under its workload's name: a mark, as cells are stripped
        lines = [[cells[0] if cells[1] == "" else "- " + cells[0], *cells[1:]] for cells in lines]
    text = _tabulate.tabulate(
        lines,
        headers=(["workload", "params"] if wide else ["workload / params"]) + headers,
        colalign=("left", "left")[: 2 if wide else 1] + ("right",) * (1 + len(names)) + ("left", "left"),
        disable_numparse=True,
    )
    width = WIDE if wide else WIDTH
    foot = [wrap(t, f"[{i}] ", "    ", width) for i, t in enumerate(notes, 1)]
    return "\n".join([text, *foot])


#: Targets a run may miss for a reason docs/benchmarks.md gives: (workload, text in params) -> why, in short.
KNOWN_MISSES = {
    ("round trip", "p1 k=65536 shuffled"): "page size 1 from a shuffled list: each slot is a page to check and "
    "flag at a random place; the checked floor alone is 0.26-0.77x torch",
    ("vs locked floor", "p1 "): "the page-size-1 trace's lists fragment into runs of a few dozen slots, and the "
    "work is per run",
    ("KV-cache trace", "p1 "): "the page-size-1 trace's lists fragment into runs of a few dozen slots, and the "
    "work is per run",
    ("host tier", "mixin staging"): "the host class's own staging methods read the per-page views element by "
    "element; only a list, a second copy of the state, reads faster",
    ("cold start", "page size 1"): "the page-size-1 kernels compile longer; python -m hostpool_nb.warmup in an "
    "image build removes it",
    ("tracking", "tracked / untracked"): "a tracked call reads its caller's frame: 2.7-3.6x across runs here, "
    "the bound in the middle",
    ("paged allocator", "tracked / untracked"): "each request's site and tag interned per call: 1.7-2.4x across "
    "runs here, the bound in the middle",
    ("paged allocator", "tagged / untracked"): "each request's site and tag interned per call: 1.7-2.4x across "
    "runs here, the bound in the middle",
    ("paged allocator", "decode 256 seqs, lists"): "two lists of 256 Python ints become arrays on every call, 11 of "
    "its 16 us after the 1M-slot restore; 2.5-3.5x here (arrays: 5.1x)",
}


def known_miss(row: Row) -> str | None:
    """Why ``row``'s target may be missed, if docs/benchmarks.md says so; ``None`` for a miss not known."""
    return next((why for (w, p), why in KNOWN_MISSES.items() if row.workload == w and p in row.params), None)


def summary(rows: list[Row]) -> str:
    """How many targets were met; each one missed, and whether docs/benchmarks.md knows why (a line each)."""
    met = [r for r in rows if r.met is True]
    missed = [r for r in rows if r.met is False]
    if not met and not missed:
        return "no targets judged here (a trace's rows have none)"
    lines = [f"targets: {len(met)} of {len(met) + len(missed)} met"]
    known = [(r, known_miss(r)) for r in missed]
    if any(why is not None for _, why in known):
        lines.append("missed, known (docs/benchmarks.md, 'Where it loses', says why):")
        lines += [f"- {r.workload} {r.params} ({r.target}): {why}" for r, why in known if why is not None]
    if any(why is None for _, why in known):
        lines.append(
            "missed, not known (a change, or a machine busy or unlike this project's: run it again, and "
            "python -m bench.compare REV judges a change):"
        )
        lines += [f"- {r.workload} {r.params} ({r.target})" for r, why in known if why is None]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """The machine and library versions, from numba's own system report, and the date."""
    info: dict[str, Any] = {}
    try:
        from numba.misc.numba_sysinfo import get_sysinfo

        sys_info = get_sysinfo()
        info = {
            "cpu": sys_info.get("CPU Name"),
            "cpu_count": sys_info.get("CPU Count"),
            "cpu_features": sys_info.get("CPU Features"),
            "memory_bytes": sys_info.get("Mem Total"),
            "os": f"{sys_info.get('OS Name')} {sys_info.get('OS Version')}",
        }
    except Exception:  # noqa: BLE001 - numba's report is a convenience: fall back to the platform's
        info = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    import numba
    import numpy

    import hostpool_nb

    info.update(
        python=platform.python_version(),
        numpy=numpy.__version__,
        numba=numba.__version__,
        hostpool_nb=hostpool_nb.__version__,
        git=_git_revision(),
        date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    try:
        from importlib.metadata import version

        info["torch"] = version("torch")
    except Exception:  # noqa: BLE001 - not installed
        info["torch"] = None
    return info


def _git_revision() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty" if dirty else "")) or None


def machine_line(info: dict[str, Any]) -> str:
    return (
        f"{info['cpu']}, {info['cpu_count']} cores; Python {info['python']}, numpy {info['numpy']}, "
        f"numba {info['numba']}, torch {info['torch'] or 'not installed'}; hostpool_nb {info['hostpool_nb']} "
        f"({info['git'] or 'no git'}); {info['date']}"
    )


def write_json(path: str, rows: list[Row], notes: list[str], info: dict[str, Any], **extra: Any) -> None:
    doc = {"schema": 2, "machine": info, "rows": [{**asdict(r), "ratios": r.ratios} for r in rows], "notes": notes}
    doc.update(extra)
    Path(path).write_text(json.dumps(doc, indent=2, allow_nan=False, default=_plain) + "\n")


def _plain(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def write_plot(path: str, rows: list[Row], info: dict[str, Any]) -> None:
    """Time per round trip against allocation size, log-log, one panel per page size (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or the bench extra)") from None
    cells = [r for r in rows if r.workload == "round trip" and "shuffled" not in r.params]
    floor = next((r.values[HOSTPOOL] for r in rows if r.workload == "memory floor"), None)
    page_sizes = sorted({r.extra["page_size"] for r in cells})
    fig, axes = plt.subplots(1, len(page_sizes), figsize=(4.6 * len(page_sizes), 4.2), sharey=True, squeeze=False)
    for ax, ps in zip(axes[0], page_sizes, strict=True):
        mine = sorted((r for r in cells if r.extra["page_size"] == ps), key=lambda r: r.extra["k"])
        for name, (color, marker) in zip(IMPLS, (("C0", "o"), ("C1", "s"), ("C3", "^")), strict=True):
            pts = [(r.extra["k"], r.values[name]) for r in mine if name in r.values]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=marker, color=color, label=name)
        if floor is not None:
            ax.plot([65536], [floor], "x", color="0.4", label="memory floor, 65,536 slots")
        ax.set(xscale="log", yscale="log", title=f"page size {ps}", xlabel="slots per alloc + free (k)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("seconds per round trip")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"round trip, median time per call - {info['cpu']}, {info['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
