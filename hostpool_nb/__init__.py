"""hostpool_nb: a torch-free host KV-cache slot allocator on Numba kernels.

A drop-in for sglang's ``LogicalHostPool`` that keeps its free lists in numpy
int64 arrays changed only by ``@njit`` kernels, hands out caller-owned numpy
arrays, and raises a clear error for every misuse the original accepts.
``import hostpool_nb`` never imports torch; ``hostpool_nb.torch`` is the
optional adapter for code that passes torch tensors.
"""

from ._errors import (
    AlignmentError,
    DoubleFreeError,
    HostPoolError,
    KernelCacheWarning,
    LockRefUnderflowError,
    PageDoubleFreeError,
    PageNotAllocatedError,
    PageStateError,
    PartialPageError,
    PinnedPageError,
    PoolForkedError,
    SlotRangeError,
    StaleFreeError,
)
from ._host import HostPagePool
from ._pool import LogicalHostPool
from ._snapshot import HostPageState, PoolState
from ._stats import HostPageStats, PoolStats

__version__ = "0.1.0"

__all__ = [
    "AlignmentError",
    "DoubleFreeError",
    "HostPagePool",
    "HostPageState",
    "HostPageStats",
    "HostPoolError",
    "KernelCacheWarning",
    "LockRefUnderflowError",
    "LogicalHostPool",
    "PageDoubleFreeError",
    "PageNotAllocatedError",
    "PageStateError",
    "PartialPageError",
    "PinnedPageError",
    "PoolForkedError",
    "PoolState",
    "PoolStats",
    "SlotRangeError",
    "StaleFreeError",
    "__version__",
]
