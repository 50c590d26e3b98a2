"""What every workload shares: result rows, the run's context, and the registry of workloads.

A workload is a small function that measures one thing and returns rows;
``@workload(name, seconds)`` registers it with a rough estimate of its run
time at scale 1, which drives the progress bar's ETA. ``python -m bench``
runs the registered workloads in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HOSTPOOL, NUMPY, TORCH = "hostpool_nb", "numpy", "torch"
IMPLS = (HOSTPOOL, NUMPY, TORCH)


@dataclass
class Row:
    """One line of the results table.

    ``values`` maps an implementation to its median (seconds, or bytes per
    page on the metadata rows); ratios are baseline / hostpool_nb, so above
    1 hostpool_nb is faster (smaller). ``target`` is a bound on a ratio and
    ``met`` whether the run meets it (``None``: no target, or not measured).
    ``columns`` are the implementations the row is about.
    """

    workload: str
    params: str
    unit: str
    values: dict[str, float]
    target: str = ""
    met: bool | None = None
    columns: tuple[str, ...] = IMPLS
    samples: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    bounds: list[tuple[str, float]] = field(default_factory=list)  # at_least's, in the order set

    @property
    def ratios(self) -> dict[str, float]:
        ours = self.values.get(HOSTPOOL)
        return {n: v / ours for n, v in self.values.items() if n != HOSTPOOL and ours and v is not None}

    def paired(self, name: str) -> tuple[float, float] | None:
        """The smallest and largest ratio within one interleaved repeat: how far the noise moved it."""
        mine, theirs = self.samples.get(HOSTPOOL), self.samples.get(name)
        if not mine or not theirs:
            return None
        rs = sorted(b / a for a, b in zip(mine, theirs, strict=True) if a > 0)
        return (rs[0], rs[-1]) if rs else None

    def at_least(self, name: str, bound: float) -> Row:
        """Add the target ``ratio to name >= bound``; met when every bound measured is (None: none was).

        A row may bound its ratio to numpy and to torch both: without torch,
        the numpy bound is still judged, so a run without torch checks every
        claim the README makes against some baseline.
        """
        self.bounds.append((name, bound))
        self.target = ", ".join(f">={b:g}x {n}" for n, b in self.bounds)
        ratios = self.ratios
        judged = [ratios[n] >= b for n, b in self.bounds if n in ratios]
        self.met = all(judged) if judged else None
        return self


@dataclass
class Context:
    """What a workload gets: the scale, the implementations, where to report progress and notes."""

    scale: float
    impls: dict[str, Callable[[int, int], Any]]
    tick: Callable[[float], None] = lambda seconds: None
    label: Callable[[str], None] = lambda text: None
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    tiny: bool = False  # the tests' run: every pool and trace a few thousand slots, one repeat

    def repeats(self, base: int = 3) -> int:
        return 1 if self.tiny else max(base, round(base * self.scale))

    def size(self, full: int, tiny: int) -> int:
        """A pool (or trace) size: ``full``, or ``tiny`` in the tests' run."""
        return tiny if self.tiny else full

    def loop_s(self, base: float = 0.02) -> float:
        return base * self.scale


@dataclass(frozen=True)
class Workload:
    name: str
    run: Callable[[Context], list[Row]]
    seconds: float  # its run time at scale 1 on a 2-core VM (2026-12-04), for the ETA


# The order a run takes, and the table shows: the core pool first, then what was built on it.
ORDER = (
    "roundtrip",
    "batch",
    "trace",
    "recorded",
    "tracking",
    "memory",
    "startup",
    "paged",
    "swa",
    "engine",
    "host",
    "hicache",
)
WORKLOADS: dict[str, Workload] = {}


def workload(name: str, seconds: float) -> Callable[[Callable[[Context], list[Row]]], Callable[[Context], list[Row]]]:
    """Register ``func`` as the workload ``name`` of :data:`ORDER` (``seconds``: its rough run time at scale 1)."""

    def register(func: Callable[[Context], list[Row]]) -> Callable[[Context], list[Row]]:
        WORKLOADS[name] = Workload(name, func, seconds)
        ordered = {n: WORKLOADS[n] for n in ORDER if n in WORKLOADS}
        WORKLOADS.clear()
        WORKLOADS.update(ordered)
        return func

    return register


def fmt_count(n: int) -> str:
    """``1M``, ``64K``, ``200K`` or the number: pool and trace sizes in params."""
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    for unit, size in (("M", 10**6), ("K", 10**3)):
        if n >= 10 * size // 10 and n % (size // 10) == 0:
            return f"{n / size:g}{unit}"
    return str(n)
