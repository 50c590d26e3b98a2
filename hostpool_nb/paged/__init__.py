"""Drop-ins for sglang-jax's device KV-cache allocators, on Numba kernels.

``PagedTokenToKVPoolAllocator``, ``TokenToKVPoolAllocator`` and
``SWATokenToKVPoolAllocator`` take the arguments, return the values and
allocate in the order of sglang-jax's numpy allocators (docs/behaviour.md
section 3), and refuse before changing anything the calls those get
silently wrong. Importing this imports neither torch nor jax. What differs,
what it costs, and the choices where the original leaves room:
docs/jax-serving.md.
"""

from __future__ import annotations

from .._core.host import HostPagePool
from .._diagnostics.snapshot import PagedState, SWAState
from ._allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from ._base import BaseTokenToKVPoolAllocator
from ._host import HostKVPoolMixin
from ._swa import SWATokenToKVPoolAllocator

# help(), reprs, tracebacks and pickles name the public path, where each is imported from.
for _cls in (
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
    HostKVPoolMixin,
    PagedState,
    SWAState,
):
    _cls.__module__ = __name__
del _cls

__all__ = [
    "BaseTokenToKVPoolAllocator",
    "HostKVPoolMixin",
    "HostPagePool",
    "PagedState",
    "PagedTokenToKVPoolAllocator",
    "SWAState",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
]
