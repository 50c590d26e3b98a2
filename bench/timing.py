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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO


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
    """A tqdm progress bar on stderr, shown only where someone watches it.

    Counts abstract steps: :meth:`step` advances, :meth:`label` names what is
    measured now. The bar is drawn only when the stream is a terminal:
    tqdm redraws its line with carriage returns, which in a redirected log
    pile up as one long line of frames. tqdm comes with the ``bench`` extra;
    without it the run is the same, only without a bar.
    """

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        stream = sys.stderr if stream is None else stream
        self._bar: Any = None
        if not (enabled and _is_tty(stream)):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=max(int(total), 1), file=stream, unit="step", leave=False, dynamic_ncols=True)

    @property
    def shown(self) -> bool:
        """Whether a bar is being drawn."""
        return self._bar is not None

    def label(self, text: str) -> None:
        """Show what is being measured now, without advancing."""
        if self._bar is not None:
            self._bar.set_description_str(text, refresh=True)

    def step(self, n: int = 1) -> None:
        """Advance by ``n`` steps."""
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Remove the bar, leaving the terminal line clean; later calls do nothing."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _is_tty(stream: Any) -> bool:
    # sys.stderr is None under pythonw, and file-likes may lack isatty.
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False
