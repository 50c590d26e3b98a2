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

Tested with sglang-jax :data:`TESTED_VERSION` (a pre-release for Python
3.12 and later: ``pip install --pre "sglang-jax[cpu]==0.1.0rc0"``): its
source checked against hostpool_nb's classes by
``tests/integrations/test_sgl_jax_surface.py``, and its engine run end to end, plain
and with ``install()``, on a CPU with tiny models (``tests/integrations/test_sgl_jax_engine.py``).
Also with stand-ins written from the behaviour docs/behaviour.md describes
(``hostpool_nb.originals.engines``). Its modules that import the classes by
name: ``model_runner_kv_cache_mixin`` (the allocators, when it builds
them), ``kv_cache_builder`` (``LRUHostKVPool``), ``disaggregation.factory``
(``QueueHostKVPool``), and the schedulers and radix caches that ask
``isinstance(allocator, SWATokenToKVPoolAllocator)``. The releases for
Python 3.11 (0.0.1, 0.0.1.post1) are older: their allocators take a
``dtype`` and no ``dp_size``, and ``install()`` refuses them, naming the
parameter.
"""

from __future__ import annotations

from typing import Any

from .. import paged
from . import _patch
from ._patch import Target, announcing

ENGINE = "sgl_jax"
#: The sglang-jax release whose source and engine hostpool_nb is checked against (CI installs it and downloads
#: its wheel), bumped on purpose.
TESTED_VERSION = "0.1.0rc0"
_HOW_TO_INSTALL = f'pip install --pre "sglang-jax[cpu]=={TESTED_VERSION}", on Python 3.12 or later'
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

    Checked whole first, as every ``install()`` (:mod:`hostpool_nb.integrations`):
    a module of sglang-jax that does not import, or a class of
    :data:`TARGETS` missing or unlike what hostpool_nb offers, is an
    :class:`~hostpool_nb.integrations.IntegrationError` and replaces nothing.

    Examples
    --------
    On the stand-in engine (sglang-jax's module paths, the original
    algorithms): sglang-jax's modules then build hostpool_nb's classes.

    >>> from hostpool_nb.integrations import sgl_jax
    >>> from hostpool_nb.originals.engines import stand_in_engine
    >>> with stand_in_engine("sgl_jax") as engine:
    ...     replaced = sgl_jax.install()
    ...     again = sgl_jax.install()  # installed already: the same mapping, nothing changes
    ...     built = engine.build("TokenToKVPoolAllocator", 64, None)
    >>> again == replaced, type(built).__module__
    (True, 'hostpool_nb.integrations.sgl_jax')
    >>> sorted(where.rpartition(".")[2] for where in replaced)[:3]
    ['LRUHostKVPool', 'LRUHostKVPool', 'PagedTokenToKVPoolAllocator']
    """
    return _patch.install(ENGINE, "sgl_jax", TARGETS, _HOW_TO_INSTALL)


def uninstall() -> dict[str, type]:
    """Put sglang-jax's own classes back where ``install`` replaced them (and they are still in place).

    Returns
    -------
    dict
        ``"module.attribute"`` -> the class put back (empty: nothing was installed).

    Examples
    --------
    >>> import sys
    >>> from hostpool_nb.integrations import sgl_jax
    >>> from hostpool_nb.originals.engines import stand_in_engine
    >>> with stand_in_engine("sgl_jax"):
    ...     replaced = sgl_jax.install()
    ...     put_back = sgl_jax.uninstall()
    ...     mine = sys.modules[sgl_jax.ALLOCATORS].TokenToKVPoolAllocator.__module__
    ...     twice = sgl_jax.uninstall()
    >>> put_back == replaced, mine, twice
    (True, 'hostpool_nb.originals.paged', {})
    """
    return _patch.uninstall(ENGINE)


# The classes install() puts in place are attributes here too (so their instances pickle), not API of their own.
__all__ = ["ALLOCATORS", "HOST_POOLS", "TESTED_VERSION", "install", "uninstall"]
