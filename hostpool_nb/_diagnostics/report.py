"""What ``python -m hostpool_nb.replay --time`` reports: the timing it returns, and the lines it prints."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TraceTiming:
    """Seconds per recorded operation, by implementation (``samples``: each repeat's), and what to know.

    Examples
    --------
    >>> import os, tempfile
    >>> from hostpool_nb import LogicalHostPool
    >>> from hostpool_nb.replay import time_trace
    >>> from hostpool_nb.trace import load
    >>> pool = LogicalHostPool(256, 16)
    >>> path = os.path.join(tempfile.mkdtemp(), "batch.trace")
    >>> with pool.recording(path):
    ...     slots, offsets = pool.alloc_many([16, 32])
    >>> timing = time_trace(load(path), repeats=1, with_torch=False)
    >>> timing.per_op, timing.notes[1][:33]  # one call: a figure would mislead
    ({}, 'not timed: 1 operation is too few')
    """

    per_op: dict[str, float]
    samples: dict[str, list[float]]
    notes: list[str] = field(default_factory=list)


#: Repeats whose ratios spread wider than this (highest over lowest) are said to be too wide to give a figure.
TOO_WIDE = 1.3


def timing_lines(timing: TraceTiming, repeats: int) -> list[str]:
    """What ``replay --time`` prints: each side's median and range, each ratio's range, and what they allow."""
    ours = timing.per_op.get("hostpool_nb", 0.0)
    mine = timing.samples.get("hostpool_nb", [])
    lines, wide = [], []
    for name, seconds in timing.per_op.items():
        spread = timing.samples.get(name, [])
        of = (
            f"median of {repeats}, {shown_duration(min(spread))}-{shown_duration(max(spread))}"
            if spread
            else f"median of {repeats}"
        )
        label = name if name == "hostpool_nb" else f"original on {name}"
        ratio = ""
        if name != "hostpool_nb" and ours > 0:
            ratios = [a / b for a, b in zip(spread, mine, strict=False) if b > 0]  # repeat by repeat: interleaved
            ratio = f": {shown_ratio(seconds / ours)} {name}"
            if len(ratios) > 1:
                low, high = min(ratios), max(ratios)
                ratio += f" (repeats {shown_ratio(low)}-{shown_ratio(high)})"
                if low < 1 < high:
                    wide.append(f"against {name} the repeats fall either side of 1x: they cannot say which is faster")
                elif high / low > TOO_WIDE:
                    wide.append(
                        f"against {name} the repeats spread {high / low:.2f}-fold: the ratio is only known "
                        f"to lie between {shown_ratio(low)} and {shown_ratio(high)}"
                    )
        lines.append(f"{label:>17}: {shown_duration(seconds):>9} per operation ({of}){ratio}")
    others = [name for name in timing.per_op if name != "hostpool_nb"]
    if others:
        said = ", ".join(f"x {name}" for name in others)
        lines.append(f"{said} = the original's time / hostpool_nb's (above 1x: hostpool_nb is faster)")
    if wide:  # a busy machine, or a short trace
        lines += [*wide, "(a quiet machine and more --repeats narrow it)"]
    lines += timing.notes[1:]
    return lines


def shown_duration(seconds: float) -> str:
    """Seconds as ``replay --time`` and ``python -m bench`` print them: three significant digits, in s, ms, µs or ns."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


_THOUSANDS = 100  # from here a ratio is a whole number, with thousands separated


def shown_ratio(r: float) -> str:
    """A ratio as ``replay --time`` and ``python -m bench`` print it: ``2.31x``, ``105x``, ``1,004x``."""
    return f"{r:.3g}x" if r < _THOUSANDS else f"{r:,.0f}x"
