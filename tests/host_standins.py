"""Stand-ins for sglang-jax's host KV pools, with transfer-like methods, written from docs/behaviour.md (section 4).

The bookkeeping is the original algorithm of ``hostpool_nb.originals.host_tier``,
with its side effects (the exhaustion log line, the PD metrics); on top,
each stand-in has what its data plane does to that bookkeeping
(docs/behaviour.md "Per-page state"): a transfer captures a page's
generation when it starts and, under ``_lock``, keeps its result only if the
page is still allocated at that generation; transfers staged for a page are
dropped when it is freed. ``HostKVPoolMixin`` must leave these methods
working unchanged.

:func:`pd_metrics` puts a stand-in for sglang-jax's PD metrics module
where the originals look it up, counting what each pool reports.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from hostpool_nb.originals.host_tier import PD_METRICS, LRUHostKVPool, QueueHostKVPool
from hostpool_nb.paged import HostKVPoolMixin


class StandInLRU(LRUHostKVPool):
    """An L2 tier whose transfers read ``_allocated`` and ``_generation`` under ``_lock``."""

    def start_transfer(self, page: int) -> int:
        """Begin loading ``page``: the generation the result will belong to."""
        with self._lock:
            generation = int(self._generation[page])
            self._pending.setdefault(page, []).append(generation)
            return generation

    def finish_transfer(self, page: int, generation: int, payload: Any) -> bool:
        """Keep ``payload`` if ``page`` is still the allocation the transfer began for; say whether it was."""
        with self._lock:
            staged = self._pending.get(page)
            if not staged or generation not in staged:
                return False  # dropped when the page was freed
            staged.remove(generation)
            if not self._allocated[page] or int(self._generation[page]) != generation:
                return False
            self._slots[page] = (generation, payload)
            return True


class StandInQueue(QueueHostKVPool):
    """PD staging slots: no per-page state beyond the free list."""


class FastLRU(HostKVPoolMixin, StandInLRU):
    """The stand-in L2 tier with its bookkeeping on a HostPagePool."""


class FastQueue(HostKVPoolMixin, StandInQueue):
    """The stand-in staging pool with its bookkeeping on a HostPagePool."""


class Metrics:
    """What the PD metrics stand-in was told: counts by (metric, pool name), and a hook run at each call."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.calls: list[tuple[str, str, int]] = []
        self.on_call: Callable[[str], None] | None = None
        self.fail = False

    def used_buffers(self, pool_name: str) -> int:
        """The ``pd_host_pool_used_buffers`` gauge these counters drive."""
        return self.counts["host_pool_alloc", pool_name] - self.counts["host_pool_free", pool_name]


@contextlib.contextmanager
def pd_metrics() -> Iterator[Metrics]:
    """Install a PD metrics module (``host_pool_alloc``, ``host_pool_free``) where sglang-jax's lives."""
    seen = Metrics()

    def metric(name: str) -> Callable[[str, int], None]:
        def record(pool_name: str, n: int) -> None:
            if seen.on_call is not None:
                seen.on_call(name)
            if seen.fail:
                raise RuntimeError("the metrics backend is down")
            seen.counts[name, pool_name] += n
            seen.calls.append((name, pool_name, n))

        return record

    parts = PD_METRICS.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    module: Any = sys.modules[PD_METRICS]
    module.host_pool_alloc = metric("host_pool_alloc")
    module.host_pool_free = metric("host_pool_free")
    try:
        yield seen
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
