"""sglang-jax: its device allocators from ``hostpool_nb.paged``, its host pools on a ``HostPagePool``, from outside it.

::

    from hostpool_nb.integrations import sgl_jax
    sgl_jax.install()   # before sglang-jax builds its allocators and host pools

In ``sgl_jax.srt.mem_cache.allocator``, ``TokenToKVPoolAllocator``,
``PagedTokenToKVPoolAllocator`` and ``SWATokenToKVPoolAllocator`` become
hostpool_nb.paged's; in ``sgl_jax.srt.mem_cache.host_kv_pool``,
``LRUHostKVPool`` and ``QueueHostKVPool`` become the engine's own classes
under :class:`~hostpool_nb.paged.HostKVPoolMixin` (their data plane, metrics
and log lines kept, the bookkeeping on a ``HostPagePool``). So do the same
names in every sglang-jax module imported so far that imported them by
name. Each one sglang-jax then builds logs one INFO line on the
``hostpool_nb`` logger.

Tested against stand-ins written from the behaviour hostpool_nb's
specifications describe (docs/behaviour.md; ``hostpool_nb.originals.engines``):
sglang-jax's allocators with ``dp_size`` and the sliding-window allocator,
and its host tier. The one release on the package index, 0.0.1.post1, is
older: its allocators take a ``dtype`` and no ``dp_size``, and ``install()``
refuses it, naming the parameter.
"""

from __future__ import annotations

from typing import Any

from .. import paged
from . import _patch
from ._patch import Target, announcing

ENGINE = "sgl_jax"
#: Where sglang-jax defines its device allocators.
ALLOCATORS = "sgl_jax.srt.mem_cache.allocator"
#: Where sglang-jax defines its host pools.
HOST_POOLS = "sgl_jax.srt.mem_cache.host_kv_pool"


def _tracking(pool: Any) -> str:
    return f"tracking {'on' if pool.track else 'off'}"


def _describe_allocator(a: Any) -> str:
    return (
        f"{type(a).__name__} (hostpool_nb.paged): size={a.size}, page_size={a.page_size}, "
        f"dp_size={a.dp_size}, {_tracking(a)}"
    )


def _describe_swa(a: Any) -> str:
    return (
        f"SWATokenToKVPoolAllocator (hostpool_nb.paged): size={a.size_full}, size_swa={a.size_swa}, "
        f"page_size={a.page_size}, dp_size={a.dp_size}, {_tracking(a)}"
    )


def _describe_host_pool(pool: Any) -> str:
    page_size = getattr(pool, "page_size", None)
    per_page = "" if page_size is None else f", page_size={page_size}"
    return (
        f"{type(pool).__name__} on a HostPagePool (hostpool_nb): {pool._pool_size} pages{per_page}, "
        "tracking off (generations catch stale frees)"
    )


TokenToKVPoolAllocator = announcing(paged.TokenToKVPoolAllocator, ENGINE, _describe_allocator, __name__)
PagedTokenToKVPoolAllocator = announcing(paged.PagedTokenToKVPoolAllocator, ENGINE, _describe_allocator, __name__)
SWATokenToKVPoolAllocator = announcing(paged.SWATokenToKVPoolAllocator, ENGINE, _describe_swa, __name__)


def _under_the_mixin(original: type) -> type:
    """The engine's host class with its bookkeeping on a HostPagePool, bound here under its name (it pickles)."""
    mixed = type(original.__name__, (paged.HostKVPoolMixin, original), {"__module__": __name__})
    made = announcing(mixed, ENGINE, _describe_host_pool, __name__)
    globals()[original.__name__] = made
    return made


# What each host class must have for the mixin to keep its books (docs/behaviour.md, section 4).
_HOST_METHODS = ("reserve", "release", "available_size", "total_size")

TARGETS = (
    Target(ALLOCATORS, "TokenToKVPoolAllocator", lambda original: TokenToKVPoolAllocator),
    Target(ALLOCATORS, "PagedTokenToKVPoolAllocator", lambda original: PagedTokenToKVPoolAllocator),
    Target(ALLOCATORS, "SWATokenToKVPoolAllocator", lambda original: SWATokenToKVPoolAllocator),
    Target(HOST_POOLS, "LRUHostKVPool", _under_the_mixin, (*_HOST_METHODS, "alloc", "free", "inc_lock_ref")),
    Target(HOST_POOLS, "QueueHostKVPool", _under_the_mixin, _HOST_METHODS),
)


def install() -> dict[str, type]:
    """Put hostpool_nb's classes where sglang-jax looks its allocators and host pools up; what was replaced.

    Everything is checked before anything is replaced: a module that does
    not import, a class that is missing, or one whose public methods and
    attributes hostpool_nb's does not offer with the same parameters, is an
    :class:`~hostpool_nb.integrations.IntegrationError` naming the
    attribute. Installed already: nothing changes, the same mapping returns.

    Returns
    -------
    dict
        ``"module.attribute"`` -> the class that was there.
    """
    return _patch.install(ENGINE, "sgl_jax", TARGETS)


def uninstall() -> dict[str, type]:
    """Put sglang-jax's own classes back where ``install`` replaced them (and they are still in place)."""
    return _patch.uninstall(ENGINE)


# The classes install() puts in place are attributes here too (so their instances pickle), not API of their own.
__all__ = ["ALLOCATORS", "HOST_POOLS", "install", "uninstall"]
