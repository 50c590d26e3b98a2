"""hostpool_nb: page allocators for LLM serving's KV caches, on numpy arrays changed only by Numba kernels.

Each gives the results of the allocator it replaces for every correct call,
and raises a clear error, before anything changes, for every misuse the
original accepts (a double free, a negative size, a partial page, a stale
free). Three tiers:

- the host tier's token slots: :class:`LogicalHostPool`, sglang's, torch-free
  (:mod:`hostpool_nb.torch` for code that passes tensors);
- the device tier: :mod:`hostpool_nb.paged`, sglang-jax's
  ``PagedTokenToKVPoolAllocator``, ``TokenToKVPoolAllocator`` and
  ``SWATokenToKVPoolAllocator``;
- sglang-jax's host tier (HiCache L2, PD staging): :class:`HostPagePool`, with
  pins and generations, and ``hostpool_nb.paged.HostKVPoolMixin`` to put an
  engine's own host pool on it;
- pages striped over owner classes (sglang's page-interleaved KV sharding):
  :class:`InterleavedPagePool`; two page sizes sharing one byte envelope
  (sglang's unified host pool for hybrid sliding-window models):
  :class:`EnvelopePagePool`.

Diagnostics: who holds each page (``track=True``, or ``HOSTPOOL_NB_TRACK=1``),
double frees that name both call sites, leak reports, and recordings of a
real workload to replay and time (:mod:`hostpool_nb.trace`,
``python -m hostpool_nb.replay``). :mod:`hostpool_nb.integrations` swaps the
allocators into sglang or sglang-jax with one call before the engine starts.

``import hostpool_nb`` never imports torch or jax.
"""

import sys as _sys

from ._core import host as _host
from ._core import pool as _pool
from ._core.host import HostPagePool
from ._core.pool import LogicalHostPool
from ._core.stats import HostPageStats, PoolStats
from ._diagnostics import snapshot as _snapshot
from ._diagnostics.snapshot import EnvelopePageState, HostPageState, InterleavedPageState, PoolState
from ._errors import (
    AlignmentError,
    DoubleFreeError,
    HostKVAlignmentError,
    HostKVArgumentError,
    HostKVDoubleFreeError,
    HostKVSlotRangeError,
    HostKVUnknownPoolError,
    HostPoolError,
    KernelCacheWarning,
    LockRefUnderflowError,
    PagedOnlyError,
    PageDoubleFreeError,
    PageNotAllocatedError,
    PageStateError,
    PartialPageError,
    PinnedPageError,
    PoolForkedError,
    SlotRangeError,
    StaleFreeError,
)

__version__ = "0.1.0"

# Pickles written before these modules moved into packages name them by their old paths.
_sys.modules.setdefault(f"{__name__}._host", _host)
_sys.modules.setdefault(f"{__name__}._pool", _pool)
_sys.modules.setdefault(f"{__name__}._snapshot", _snapshot)

# help(), reprs and tracebacks name the public path, where each is imported from (pickles find it there too).
for _cls in (
    EnvelopePageState,
    HostPagePool,
    HostPageState,
    HostPageStats,
    InterleavedPageState,
    LogicalHostPool,
    PoolState,
    PoolStats,
):
    _cls.__module__ = __name__
del _cls

# The pools only sglang's two host pools use are imported on first use: their kernels' definitions cost every
# other process some 13 ms at import (2026-12-07, python -X importtime).
_ON_FIRST_USE = {"EnvelopePagePool": "._core.envelope", "InterleavedPagePool": "._core.interleaved"}


def __getattr__(name: str) -> object:
    where = _ON_FIRST_USE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib  # noqa: PLC0415 - only on first use

    found: object = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = found
    return found


def __dir__() -> list[str]:
    return sorted({*globals(), *_ON_FIRST_USE})


__all__ = [
    "AlignmentError",
    "DoubleFreeError",
    "EnvelopePagePool",
    "EnvelopePageState",
    "HostKVAlignmentError",
    "HostKVArgumentError",
    "HostKVDoubleFreeError",
    "HostKVSlotRangeError",
    "HostKVUnknownPoolError",
    "HostPagePool",
    "HostPageState",
    "HostPageStats",
    "HostPoolError",
    "InterleavedPagePool",
    "InterleavedPageState",
    "KernelCacheWarning",
    "LockRefUnderflowError",
    "LogicalHostPool",
    "PageDoubleFreeError",
    "PageNotAllocatedError",
    "PageStateError",
    "PagedOnlyError",
    "PartialPageError",
    "PinnedPageError",
    "PoolForkedError",
    "PoolState",
    "PoolStats",
    "SlotRangeError",
    "StaleFreeError",
    "__version__",
]
