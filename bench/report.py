"""Results as one printed table, a JSON document and a PNG plot.

A result row is a plain dict (so the JSON is the rows as they are):

``workload``, ``params`` (short text), ``unit`` (``"s/op"``, ``"s/batch"``,
``"s/call"``, ``"B/page"``, ``"B/tag"`` or ``"s"``), ``values`` (implementation -> number, missing when not run),
``ratios`` (baseline -> baseline / hostpool_nb: above 1 means hostpool_nb is
faster or smaller), ``target`` (text, empty when the row only informs),
``met`` (True, False or None) and ``note``; optionally ``columns`` (the
implementations the row is about) and extra figures for the JSON.

Every ratio points one way - baseline / hostpool_nb, higher is better - and
targets are written as bounds on those same ratios (``>=2x torch``), so a
reader never has to work out which way a figure goes. The one exception is
the tracking workload, hostpool_nb against itself: its rows show no ratio
columns, and its target names both sides (``tracked <=3x untracked``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from .cli import TABLE_WIDTH, wrap

IMPL_COLUMNS = ("hostpool_nb", "numpy", "torch")


def row(
    workload: str,
    params: str,
    unit: str,
    values: dict[str, float],
    target: str = "",
    met: bool | None = None,
    note: str = "",
    samples: dict[str, list[float]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Build a result row; ratios are computed against ``values['hostpool_nb']``.

    With interleaved ``samples``, the row also gets ``paired_ratios``: the
    ratio within each repeat (min, median, max), which shows how much the
    machine's noise moved the headline ratio of medians.
    """
    ours = values.get("hostpool_nb")
    ratios = {}
    for name in IMPL_COLUMNS[1:]:
        if ours and values.get(name) is not None:
            ratios[name] = values[name] / ours
    if samples and "hostpool_nb" in samples:
        paired = {}
        for name in IMPL_COLUMNS[1:]:
            if name in samples:
                rs = sorted(b / a for a, b in zip(samples["hostpool_nb"], samples[name], strict=True) if a > 0)
                if rs:
                    paired[name] = {
                        "min": rs[0],
                        "median": rs[len(rs) // 2] if len(rs) % 2 else (rs[len(rs) // 2 - 1] + rs[len(rs) // 2]) / 2,
                        "max": rs[-1],
                    }
        extra["paired_ratios"] = paired
    return {
        "workload": workload,
        "params": params,
        "unit": unit,
        "values": values,
        "ratios": ratios,
        "target": target,
        "met": met,
        "note": note,
        **extra,
    }


# -- formatting ------------------------------------------------------------


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{seconds:.3g} s"


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit.startswith("B/"):
        label = "B/pg" if unit == "B/page" else unit
        return f"{value:.1f} {label}" if value < 100 else f"{value:.0f} {label}"
    return fmt_time(value)


def fmt_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "n/a"
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.1f}x" if ratio < 100 else f"{ratio:.0f}x"


def fmt_met(met: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[met]


# Longest params and target texts shown in their cells; longer ones become a
# numbered note under the table, so that a new workload with a long text
# cannot widen the table past TABLE_WIDTH (the columns add up to at most 111
# with a 16-character workload name).
PARAMS_MAX = 28
TARGET_MAX = 26
TABLE_HEADER = ("workload", "params", "hostpool_nb", "x numpy", "x torch", "target", "met?")


def render_table(rows: Iterable[dict[str, Any]], torch_present: bool) -> str:
    """The results as one fixed-width text table, at most ``TABLE_WIDTH`` wide.

    Each row shows hostpool_nb's value and the ratios to the baselines
    (``baseline / hostpool_nb``); the baselines' own values, the paired
    ratios and everything else stay in the JSON, since the ratios are what
    the targets are about. A cell reads ``-`` when the row does not apply to
    that implementation (its ``columns`` leave it out, or the row has no
    target) and ``n/a`` when torch was not run. Params and targets longer
    than their column become ``[n]`` with the text in a note below.
    """
    footnotes: list[str] = []

    def fit(text: str, limit: int) -> str:
        if len(text) <= limit:
            return text
        footnotes.append(text)
        return f"[{len(footnotes)}]"

    lines = []
    for r in rows:
        shown = r.get("columns", IMPL_COLUMNS)
        cells = [fmt_value(r["values"].get("hostpool_nb"), r["unit"]) if "hostpool_nb" in shown else "-"]
        for name in IMPL_COLUMNS[1:]:
            if name not in shown:
                cells.append("-")
            elif name == "torch" and not torch_present:
                cells.append("n/a")
            else:
                cells.append(fmt_ratio(r["ratios"].get(name)))
        params = fit(r["params"], PARAMS_MAX) or "-"
        target = fit(r["target"], TARGET_MAX) or "-"
        lines.append([r["workload"], params, *cells, target, fmt_met(r["met"])])
    widths = [max(len(x) for x in col) for col in zip(TABLE_HEADER, *lines, strict=True)]
    right = {2, 3, 4}

    def fmt(cols: list[str] | tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths, strict=True))
        ).rstrip()

    out = [fmt(TABLE_HEADER), "  ".join("-" * w for w in widths), *(fmt(line) for line in lines)]
    for i, text in enumerate(footnotes, 1):
        first = f"[{i}] "
        out.append(wrap(text, first, " " * len(first), TABLE_WIDTH))
    return "\n".join(out)


# -- machine and JSON --------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        mod = sys.modules.get(dist)
        return getattr(mod, "__version__", None)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_revision() -> str | None:
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


def machine_info() -> dict[str, Any]:
    """CPU, cores, OS and library versions, and the date (UTC)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    import hostpool_nb

    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "torch": _version("torch"),
        "hostpool_nb": hostpool_nb.__version__,
        "git": git_revision(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_line(info: dict[str, Any], torch_used: bool = True) -> str:
    torch = info["torch"] or "not installed"
    if info["torch"] and not torch_used:
        torch += " (not used)"
    return (
        f"{info['cpu_model']}, {info['cpus_usable']} cores; Python {info['python']}, numpy {info['numpy']}, "
        f"numba {info['numba']}, torch {torch}; hostpool_nb {info['hostpool_nb']} "
        f"({info['git'] or 'no git'}); {info['date']}"
    )


def write_json(path: str | os.PathLike[str], document: dict[str, Any]) -> None:
    """Write the results document as indented JSON (NaN-free)."""
    Path(path).write_text(json.dumps(document, indent=2, allow_nan=False, default=_jsonable) + "\n")


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


# -- plot ------------------------------------------------------------------


def write_plot(
    path: str | os.PathLike[str], cells: list[dict[str, Any]], floors: dict[int, float], info: dict[str, Any]
) -> None:
    """Time per round trip against allocation size, log-log, one panel per page size.

    ``cells`` are round-trip cells (``params`` with ``page_size`` and ``k``;
    ``per_op`` per implementation); ``floors`` maps ``k`` to the copy floor.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install matplotlib (or the bench extra: pip install -e '.[bench]')"
        ) from None

    page_sizes = sorted({c["params"]["page_size"] for c in cells})
    fig, axes = plt.subplots(1, len(page_sizes), figsize=(4.6 * len(page_sizes), 4.2), sharey=True, squeeze=False)
    styles = {"hostpool_nb": ("C0", "o"), "numpy": ("C1", "s"), "torch": ("C3", "^")}
    for ax, ps in zip(axes[0], page_sizes, strict=True):
        mine = sorted((c for c in cells if c["params"]["page_size"] == ps), key=lambda c: c["params"]["k"])
        for name in IMPL_COLUMNS:
            pts = [(c["params"]["k"], c["per_op"][name]) for c in mine if name in c["per_op"]]
            if pts:
                color, marker = styles[name]
                ax.plot(*zip(*pts, strict=True), marker=marker, color=color, label=name)
        fl = [(c["params"]["k"], floors[c["params"]["k"]]) for c in mine if c["params"]["k"] in floors]
        if fl:
            ax.plot(*zip(*fl, strict=True), linestyle="--", color="0.5", label="copy floor (np.copyto)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"page size {ps}")
        ax.set_xlabel("slots per alloc + free (k)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("seconds per round trip (alloc + free)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"round trip, median time per op - {info['cpu_model']}, {info['cpus_usable']} cores, {info['date']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
