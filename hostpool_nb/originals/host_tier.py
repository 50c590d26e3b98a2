"""sglang-jax's host KV tier bookkeeping, in plain Python lists.

``LRUHostKVPool`` (the HiCache L2 tier) and ``QueueHostKVPool`` (the staging
slots of prefill/decode disaggregation) as ``docs/behaviour.md`` describes
them. The original's costs are kept: the free list is a Python list,
allocation pops from its front and the double-free check is
``id in free_list``, each O(free pages) per page.

It also keeps the original's failure modes: ``free`` frees the pages before
a bad one and then raises, and the errors are plain ``ValueError`` (range)
and ``RuntimeError`` (double free, pinned, underflow) with the original's
texts. There is no data plane: ``_slots`` holds whatever a caller stores,
and ``_pending`` the transfers a caller staged, which ``_drop_pending``
discards. The staging calls (``stage_backup`` / ``flush_backup``,
``stage_load`` / ``flush_load``) keep only their bookkeeping: they capture
each page's generation, and keep what they carry only while the page is
the allocation they started for.

The side effects beyond the bookkeeping are kept too, with the original's
order and conditions (docs/behaviour.md, section 4): an exhausted call logs
one INFO line at most once a second, under the lock; a successful
``QueueHostKVPool.reserve`` calls ``_inc_alloc_metric()`` and a successful
``release`` reports ``host_pool_free``, both after the lock is released, to
sglang-jax's PD metrics module (:data:`PD_METRICS`), looked up at each call
and ignored, as the original does, when it is missing or raises.

Readings of the behaviour chosen here:

1. The double-free test of ``LRUHostKVPool`` is ``id in free_list``, as the
   common section says; ``_allocated[id]`` agrees with it after every call.
2. ``free`` de-duplicates with ``dict.fromkeys``, keeping first
   occurrences; a numpy array's ids are read as Python ints first.
3. The peak is ``pool_size - len(free_list)`` after a successful
   allocation, the most pages held at once.
4. ``QueueHostKVPool`` keeps no per-page state: the original keeps it for the
   LRU pool only.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from ..paged import _host

#: Where sglang-jax's PD metrics live, ``host_pool_alloc(pool_name, n)`` and ``host_pool_free(pool_name, n)``.
PD_METRICS = _host.PD_METRICS

log = logging.getLogger(__name__)  # as the original: its module's logger


def pd_metric(name: str, pool_name: str) -> None:
    """Add 1 to the PD metric ``name`` of ``pool_name``; nothing if the metrics module is missing or raises."""
    with contextlib.suppress(Exception):  # metrics never fail a pool call, as in the original
        getattr(importlib.import_module(PD_METRICS), name)(pool_name, 1)


class Metrics:
    """What the PD metrics stand-in was told: counts by (metric, pool name), and a hook run at each call.

    ``calls`` lists every call in order when ``keep_calls`` (the tests'
    view; a benchmark's loops would fill it), ``fail`` makes every call
    raise, as a metrics backend that is down.

    Examples
    --------
    >>> from hostpool_nb.originals.host_tier import QueueHostKVPool
    >>> from hostpool_nb.originals.host_tier import stand_in_pd_metrics
    >>> with stand_in_pd_metrics() as seen:
    ...     pool = QueueHostKVPool(4, pool_name="pd")
    ...     page = pool.reserve()
    >>> seen.used_buffers("pd"), seen.calls
    (1, [('host_pool_alloc', 'pd', 1)])
    """

    def __init__(self, keep_calls: bool = True) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.calls: list[tuple[str, str, int]] = []
        self.keep_calls = keep_calls
        self.on_call: Callable[[str], None] | None = None
        self.fail = False

    def used_buffers(self, pool_name: str) -> int:
        """The ``pd_host_pool_used_buffers`` gauge these counters drive."""
        return self.counts["host_pool_alloc", pool_name] - self.counts["host_pool_free", pool_name]


@contextlib.contextmanager
def stand_in_pd_metrics(keep_calls: bool = True) -> Iterator[Metrics]:
    """Put a counting ``host_pool_alloc`` / ``host_pool_free`` module where sglang-jax's lives (:data:`PD_METRICS`).

    For tests and benchmarks without sglang-jax: the pools report to it as
    they would to the real one. What was in ``sys.modules`` before is put
    back at the end.
    """
    seen = Metrics(keep_calls)

    def metric(name: str) -> Callable[[str, int], None]:
        def record(pool_name: str, n: int) -> None:
            if seen.on_call is not None:
                seen.on_call(name)
            if seen.fail:
                raise RuntimeError("the metrics backend is down")
            seen.counts[name, pool_name] += n
            if seen.keep_calls:
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


class _HostPoolBase:
    """What both pools share: the FIFO free list, the lock, the peak and the exhaustion count."""

    def __init__(self, pool_size: int, *, pool_name: str = "default") -> None:
        if pool_size <= 0:
            raise ValueError(f"pool_size must be positive, got {pool_size}")
        self._pool_size = pool_size
        self._pool_name = pool_name
        self._free_list: list[int] = list(range(pool_size))
        self._lock = threading.Lock()
        self._peak_used = 0
        self._exhaust_count = 0
        self._last_exhaust_log = 0.0

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.endswith("_lock")}  # copies get locks of their own

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._lock = threading.Lock()

    def available_size(self) -> int:
        with self._lock:
            return len(self._free_list)

    def total_size(self) -> int:
        return self._pool_size

    def _exhausted(self, need: int) -> None:
        """Count an exhausted call and log it, at most once a second (under the lock)."""
        self._exhaust_count += 1
        now = time.time()
        if now - self._last_exhaust_log >= 1.0:
            self._last_exhaust_log = now
            log.info(
                "host pool %s exhausted: %d pages asked for, %d free (size=%d, peak_used=%d, exhaust_count=%d)",
                self._pool_name,
                need,
                len(self._free_list),
                self._pool_size,
                self._peak_used,
                self._exhaust_count,
            )

    def _note_peak(self) -> None:
        self._peak_used = max(self._peak_used, self._pool_size - len(self._free_list))


class QueueHostKVPool(_HostPoolBase):
    """One-shot staging slots: ``reserve`` the front id, ``release`` it back to the end.

    Examples
    --------
    >>> from hostpool_nb.originals.host_tier import QueueHostKVPool
    >>> pool = QueueHostKVPool(4)
    >>> pool.reserve(), pool.reserve()
    (0, 1)
    >>> pool.release(0)
    >>> pool.available_size()
    3
    """

    def reserve(self) -> int | None:
        with self._lock:
            if not self._free_list:
                self._exhausted(1)
                return None
            buffer_id = self._free_list.pop(0)
            self._note_peak()
        self._inc_alloc_metric()
        return buffer_id

    def release(self, buffer_id: int) -> None:
        with self._lock:
            if buffer_id in self._free_list:
                raise RuntimeError(f"double free of buffer_id={buffer_id}")
            if not 0 <= buffer_id < self._pool_size:
                raise ValueError(f"buffer_id={buffer_id} outside pool range [0, {self._pool_size})")
            self._free_list.append(buffer_id)
        pd_metric("host_pool_free", self._pool_name)

    def _inc_alloc_metric(self) -> None:
        pd_metric("host_pool_alloc", self._pool_name)


class LRUHostKVPool(_HostPoolBase):
    """The HiCache L2 tier: pages hold data until released; pinned pages cannot be freed.

    Examples
    --------
    >>> from hostpool_nb.originals.host_tier import LRUHostKVPool
    >>> pool = LRUHostKVPool(4)
    >>> pool.alloc(2).tolist()
    [0, 1]
    >>> pool.inc_lock_ref(0)
    >>> pool.free([1, 0])  # frees page 1, then refuses the pinned page 0
    Traceback (most recent call last):
    ...
    RuntimeError: free of locked page id=0 (lock_ref=1)
    >>> pool.available_size()
    3
    """

    def __init__(self, pool_size: int, *, pool_name: str = "hicache") -> None:
        super().__init__(pool_size, pool_name=pool_name)
        self._allocated = [False] * pool_size
        self._generation = [0] * pool_size
        self._lock_ref = [0] * pool_size
        self._slots: list[Any] = [None] * pool_size
        self._pending: dict[int, list[Any]] = {}
        # Transfers staged for a page, with the generation they started at (lock order: _lock, then these).
        self._pending_lock = threading.Lock()
        self._pending_gather: dict[int, tuple[int, Any]] = {}
        self._pending_load_lock = threading.Lock()
        self._pending_load: dict[int, tuple[int, Any]] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._pending_lock = threading.Lock()
        self._pending_load_lock = threading.Lock()

    def _drop_pending(self, page: int) -> None:
        """Discard what was staged for ``page``: called under ``_lock`` for each page freed."""
        self._pending.pop(page, None)
        with self._pending_lock:
            self._pending_gather.pop(page, None)
        with self._pending_load_lock:
            self._pending_load.pop(page, None)

    def _hand_out(self, page: int) -> None:
        self._allocated[page] = True
        self._generation[page] += 1

    def _give_back(self, page: int) -> None:
        self._drop_pending(page)
        self._slots[page] = None
        self._allocated[page] = False
        self._free_list.append(page)

    def reserve(self) -> int | None:
        with self._lock:
            if not self._free_list:
                self._exhausted(1)
                return None
            page = self._free_list.pop(0)
            self._hand_out(page)
            self._note_peak()
            return page

    def release(self, buffer_id: int) -> None:
        with self._lock:
            if not 0 <= buffer_id < self._pool_size:
                raise ValueError(f"buffer_id={buffer_id} outside pool range [0, {self._pool_size})")
            if buffer_id in self._free_list:
                raise RuntimeError(f"double free of buffer_id={buffer_id}")
            if self._lock_ref[buffer_id] > 0:
                raise RuntimeError(f"release of locked buffer_id={buffer_id} (lock_ref={self._lock_ref[buffer_id]})")
            self._give_back(buffer_id)

    def alloc(self, need_pages: int) -> np.ndarray | None:
        if need_pages <= 0:
            raise ValueError(f"need_pages must be positive, got {need_pages}")
        with self._lock:
            if len(self._free_list) < need_pages:
                self._exhausted(need_pages)
                return None
            pages = []
            for _ in range(need_pages):
                page = self._free_list.pop(0)
                self._hand_out(page)
                pages.append(page)
            self._note_peak()
            return np.array(pages, dtype=np.int64)

    def free(self, host_page_ids: Iterable[Any]) -> None:
        # Python ints, as the radix cache's page lists hold: numpy scalars would make each
        # ``in free_list`` test several times slower than the original's own timing.
        ids = host_page_ids.tolist() if isinstance(host_page_ids, np.ndarray) else host_page_ids
        unique = list(dict.fromkeys(int(page) for page in ids))  # read whole, and de-duplicated, before the lock
        with self._lock:
            for page in unique:
                if not 0 <= page < self._pool_size:
                    raise ValueError(f"page id={page} outside pool range [0, {self._pool_size})")
                if page in self._free_list:
                    raise RuntimeError(f"double free of page id={page}")
                if self._lock_ref[page] > 0:
                    raise RuntimeError(f"free of locked page id={page} (lock_ref={self._lock_ref[page]})")
                self._give_back(page)

    def _require_allocated(self, buffer_id: int) -> None:
        if not 0 <= buffer_id < self._pool_size:
            raise ValueError(f"buffer_id={buffer_id} outside pool range [0, {self._pool_size})")
        if not self._allocated[buffer_id]:
            raise RuntimeError(f"buffer_id={buffer_id} is not allocated (in free-list)")

    def inc_lock_ref(self, buffer_id: int) -> None:
        with self._lock:
            self._require_allocated(buffer_id)
            self._lock_ref[buffer_id] += 1

    def dec_lock_ref(self, buffer_id: int) -> None:
        with self._lock:
            self._require_allocated(buffer_id)
            if self._lock_ref[buffer_id] == 0:
                raise RuntimeError(f"dec_lock_ref underflow on buffer_id={buffer_id}")
            self._lock_ref[buffer_id] -= 1

    # -- the staging calls' bookkeeping: what they read and write of the pages, no data plane --

    def stage_backup(self, host_buffer_ids: list[int], payloads: list[Any]) -> None:
        """Stage one payload per page, for the allocation each page is now (its generation)."""
        with self._lock:
            for buffer_id in host_buffer_ids:
                self._require_allocated(buffer_id)
            gens = {bid: self._generation[bid] for bid in host_buffer_ids}
        staged = dict(zip(host_buffer_ids, payloads, strict=True))
        with self._lock, self._pending_lock:
            for buffer_id in host_buffer_ids:
                if self._allocated[buffer_id] and self._generation[buffer_id] == gens[buffer_id]:
                    self._pending_gather[buffer_id] = (gens[buffer_id], staged[buffer_id])

    def flush_backup(self, host_buffer_ids: list[int]) -> None:
        """Store each staged payload in its page, if the page is still the allocation it was staged for."""
        for buffer_id in host_buffer_ids:
            with self._pending_lock:
                entry = self._pending_gather.pop(buffer_id, None)
            if entry is None:
                raise RuntimeError(f"flush_backup with no staged gather for buffer_id={buffer_id}")
            gen, payload = entry
            with self._lock:
                if self._allocated[buffer_id] and self._generation[buffer_id] == gen:
                    self._slots[buffer_id] = payload

    def stage_load(self, host_buffer_ids: list[int]) -> None:
        """Stage each page's payload for loading, for the allocation each page is now."""
        with self._lock:
            for buffer_id in host_buffer_ids:
                self._require_allocated(buffer_id)
            gens = {bid: self._generation[bid] for bid in host_buffer_ids}
            slots = {bid: self._slots[bid] for bid in host_buffer_ids}
        for buffer_id in host_buffer_ids:
            if slots[buffer_id] is None:
                raise RuntimeError(f"stage_load from empty buffer_id={buffer_id}")
        with self._lock, self._pending_load_lock:
            for buffer_id in host_buffer_ids:
                if self._allocated[buffer_id] and self._generation[buffer_id] == gens[buffer_id]:
                    self._pending_load[buffer_id] = (gens[buffer_id], slots[buffer_id])

    def flush_load(self, host_buffer_ids: list[int]) -> list[Any]:
        """The staged payloads of pages still the allocation they were staged for (``None`` for a stale one)."""
        with self._lock:
            current = {bid: self._generation[bid] if self._allocated[bid] else None for bid in host_buffer_ids}
        out = []
        for buffer_id in host_buffer_ids:
            with self._pending_load_lock:
                entry = self._pending_load.pop(buffer_id, None)
            if entry is None:
                raise RuntimeError(f"flush_load with no staged page for buffer_id={buffer_id}")
            gen, payload = entry
            out.append(payload if current[buffer_id] == gen else None)
        return out


__all__ = ["PD_METRICS", "LRUHostKVPool", "Metrics", "QueueHostKVPool", "pd_metric", "stand_in_pd_metrics"]
