"""Stand-ins for sglang-jax's host KV pools, with transfer-like methods, written from docs/behaviour.md (section 4).

The bookkeeping is the original algorithm of ``hostpool_nb.originals.host_tier``,
with its side effects (the exhaustion log line, the PD metrics); on top,
each stand-in has what its data plane does to that bookkeeping
(docs/behaviour.md "Per-page state"): a transfer captures a page's
generation when it starts and, under ``_lock``, keeps its result only if the
page is still allocated at that generation; transfers staged for a page are
dropped when it is freed. ``HostKVPoolMixin`` must leave these methods
working unchanged.

:func:`pd_metrics` puts the originals' stand-in for sglang-jax's PD
metrics module where the host classes look it up, counting what each pool
reports.
"""

from __future__ import annotations

from typing import Any

from hostpool_nb.originals.host_tier import LRUHostKVPool, QueueHostKVPool, stand_in_pd_metrics
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


def pd_metrics() -> Any:
    """The originals' stand-in for sglang-jax's PD metrics module, every call kept (``stand_in_pd_metrics``)."""
    return stand_in_pd_metrics(keep_calls=True)
