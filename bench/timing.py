"""The method: every implementation timed side by side in one process, interleaved, medians.

The machine is shared and noisy, so each repeat runs every implementation
once, in an order that rotates from repeat to repeat, and a figure is the
median of its repeats; the garbage collector is paused inside timed
regions, as ``timeit`` does.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO


def median(samples: Sequence[float]) -> float:
    return float(statistics.median(samples))


@contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def timed(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds taken by ``fn(*args)``, with the collector paused."""
    with gc_paused():
        t0 = time.perf_counter()
        fn(*args)
        return time.perf_counter() - t0


def interleaved(
    runners: dict[str, Callable[[], float]], repeats: int, tick: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """Run each runner ``repeats`` times, repeat ``r`` starting at runner ``r``; every sample, by name."""
    names = list(runners)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(runners[name]())
            if tick is not None:
                tick()
    return samples


def loop_count(cycle_s: dict[str, float], min_loop_s: float, max_loop_s: float, min_cycles: int = 3) -> int:
    """Whole cycles per timed loop: the fastest loop lasts ``min_loop_s``, the slowest at most ``max_loop_s``."""
    fastest = max(min(cycle_s.values()), 1e-9)
    slowest = max(*cycle_s.values(), 1e-9)
    return max(min_cycles, min(math.ceil(min_loop_s / fastest), int(max_loop_s / slowest)))


class Progress:
    """A tqdm bar on stderr, when stderr is a terminal and tqdm is installed; counted in estimated seconds.

    Each workload advances the bar by its share of its estimate as its cells
    finish, so the ETA is that of the work left, not of a count of steps
    whose lengths differ a thousandfold. The label says what runs now.
    """

    def __init__(self, total_s: float, enabled: bool = True, stream: TextIO | None = None) -> None:
        stream = sys.stderr if stream is None else stream
        self._bar: Any = None
        self._done = 0.0
        self._lines: TextIO | None = None  # a terminal too narrow for a bar: a line per label instead
        self._said = ""
        if not (enabled and is_terminal(stream)):
            return
        if _columns(stream) < _BAR_COLUMNS:  # a bar of no width draws nothing (a pseudo-terminal of 0 columns)
            self._lines = stream
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._total = max(total_s, 1.0)
        # The ETA is the estimates of the work left, not tqdm's extrapolation of the rate so far: the first
        # workload compiles the kernels, and a rate taken then says an hour for minutes of work.
        self._bar = tqdm(
            total=self._total,
            file=stream,
            leave=False,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} elapsed{postfix}",
        )
        self._bar.set_postfix_str(self._left(), refresh=False)

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def label(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(text, refresh=True)
        elif self._lines is not None and text != self._said:
            self._said = text
            print(text, file=self._lines, flush=True)

    def _left(self) -> str:  # tqdm puts ", " before a postfix
        left = max(0.0, self._total - self._done)
        return f"about {int(left) // 60}:{int(left) % 60:02d} left by the estimates"

    def advance(self, seconds: float) -> None:
        if self._bar is None:
            self._done += seconds
            return
        seconds = max(0.0, min(seconds, self._total - self._done))  # never past the end: an estimate is one
        self._done += seconds
        self._bar.update(seconds)
        self._bar.set_postfix_str(self._left())  # drawn now, with the count it goes with

    def reach(self, seconds: float) -> None:
        """Move to ``seconds`` done (a workload's end), whatever its cells reported."""
        if seconds > self._done:
            self.advance(seconds - self._done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


_BAR_COLUMNS = 40  # the label, a bar and the times: fewer columns show none of it


def _columns(stream: Any) -> int:
    """The width of the terminal ``stream`` is (0 if it cannot say)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (a closed, detached or odd stream is not)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False
