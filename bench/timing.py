"""Timing machinery: interleaved repeats, medians, and a progress bar.

The machine is shared and noisy, so every comparison is made side by side in
one process: each repeat runs every implementation once, in an order that
rotates from repeat to repeat, and the reported figure is the median of the
repeats. The garbage collector is paused inside timed regions, as ``timeit``
does (it would otherwise charge the baselines, whose release lists hold many
small arrays, for collections the pool did not cause).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence


def median(samples: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(samples))


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic garbage collector for the duration (as timeit does)."""
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
    runners: dict[str, Callable[[], float]],
    repeats: int,
    tick: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Run each runner ``repeats`` times, interleaved; return every sample.

    Each runner performs one timed measurement and returns its result (for
    example seconds per operation). Repeat ``r`` starts at the ``r``-th
    runner so no implementation always goes first (after a slow one, caches
    and CPU frequency differ). ``tick`` is called after every measurement.
    """
    names = list(runners)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(runners[name]())
            if tick is not None:
                tick()
    return samples


class Progress:
    """A progress bar on stderr: tqdm when importable, else a tiny one.

    Counts abstract steps; :meth:`step` advances by one and shows a label.
    The fallback redraws one line on a terminal and prints a line per label
    change otherwise (so logs stay readable), all on stderr.
    """

    def __init__(self, total: int, enabled: bool = True, stream: Any = None, use_tqdm: bool = True) -> None:
        self.total = max(int(total), 1)
        self.done = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._tqdm = None
        self._label = ""
        self._last_label = None
        self._start = time.perf_counter()
        if not enabled:
            return
        tqdm = None
        if use_tqdm:
            try:
                from tqdm import tqdm  # optional: the ``bench`` extra lists it
            except ImportError:
                pass
        if tqdm is not None:
            self._tqdm = tqdm(total=self.total, file=self.stream, unit="step", leave=False)

    def label(self, text: str) -> None:
        """Show what is being measured now, without advancing."""
        self._label = text
        if self._tqdm is not None:
            self._tqdm.set_description_str(text, refresh=True)
        else:
            self._draw()

    def step(self, n: int = 1) -> None:
        """Advance by ``n`` steps."""
        self.done = min(self.done + n, self.total)
        if self._tqdm is not None:
            self._tqdm.update(n)
        else:
            self._draw()

    def close(self) -> None:
        """Finish the bar, leaving the terminal line clean."""
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._is_tty():
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()

    def _is_tty(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def _draw(self) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self._start
        frac = self.done / self.total
        width = 24
        fill = int(round(frac * width))
        line = f"[{'#' * fill}{'.' * (width - fill)}] {frac:4.0%} {elapsed:5.1f}s {self._label}"
        if self._is_tty():
            self.stream.write("\r" + line[:79].ljust(79))
        elif self._label != self._last_label:
            self.stream.write(line + "\n")
            self._last_label = self._label
        else:
            return
        self.stream.flush()
