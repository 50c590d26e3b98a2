"""sglang's bookkeepings of host slots that ``sglang.install()`` puts on hostpool_nb: one row each.

Read by :mod:`hostpool_nb.integrations.sglang` (which classes to replace)
and by the books it builds; imports neither torch nor sglang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Documented where they are public, in integrations/sglang.py.
MODULE = "sglang.srt.mem_cache.memory_pool_host"
DOUBLE_FREES = "HOSTPOOL_NB_SGLANG_DOUBLE_FREE"


@dataclass(frozen=True)
class Bookkeeping:
    """One of sglang's three bookkeepings of host slots (docs/behaviour.md, section 5), and what hostpool_nb keeps.

    ``defined_by`` is the sglang class that defines it, in ``module``;
    ``methods`` the methods it defines there in the tested release,
    which ``install()`` replaces. The books span ``logical_size`` slots in
    pages of ``logical_page_size`` where ``logical`` (the base class: decode
    context parallelism widens both), else ``size`` and ``page_size``.
    ``rounds_up``: an allocation is rounded up to whole pages, not refused.
    ``checks_frees``: the original refuses a double free, so hostpool_nb
    always does; else a setting may make hostpool_nb accept them too.

    Examples
    --------
    >>> from hostpool_nb.integrations.sglang import HOST_KV_CACHE, MAMBA
    >>> HOST_KV_CACHE.defined_by, HOST_KV_CACHE.checks_frees, MAMBA.checks_frees
    ('HostKVCache', True, False)
    """

    defined_by: str
    module: str
    methods: tuple[str, ...]
    logical: bool
    rounds_up: bool
    checks_frees: bool

    def geometry(self, pool: Any) -> tuple[int, int]:
        """``(slots, page_size)`` of the books of the engine's ``pool``."""
        if self.logical:
            return int(pool.logical_size), int(pool.logical_page_size)
        return int(pool.size), int(pool.page_size)


_ALL = ("clear", "available_size", "_merge_release_slots", "alloc", "free")
HOST_KV_CACHE = Bookkeeping(
    "HostKVCache", "sglang.srt.mem_cache.pool_host.base", _ALL, logical=True, rounds_up=False, checks_frees=True
)
MAMBA = Bookkeeping(
    "MambaPoolHost",
    "sglang.srt.mem_cache.pool_host.mamba",
    ("clear", "available_size", "alloc", "free"),
    logical=False,
    rounds_up=False,
    checks_frees=False,
)
DEEPSEEK_V4_PAGED = Bookkeeping(
    "DeepSeekV4PagedHostPool",
    MODULE,
    ("clear", "available_size", "alloc", "free"),
    logical=False,
    rounds_up=True,
    checks_frees=False,
)
BOOKKEEPINGS = (HOST_KV_CACHE, MAMBA, DEEPSEEK_V4_PAGED)
# Not HostKVCaches: a facade whose books are an InterleavedPagePool (integrations/_sglang_interleave.py), and the
# backing unified host pools share, whose books are an EnvelopePagePool (integrations/_sglang_envelope.py).
PAGE_INTERLEAVE = Bookkeeping(
    "PageInterleaveHostPool",
    "sglang.srt.mem_cache.pool_host.page_interleave",
    ("clear", "available_size", "alloc", "free"),
    logical=False,
    rounds_up=False,
    checks_frees=False,
)
UNIFIED_ENVELOPE = Bookkeeping(
    "_SharedPageEnvelopeHostBacking",
    "sglang.srt.mem_cache.pool_host.unified",
    (
        "__init__",
        "clear",
        "available_size",
        "free_bytes",
        "alloc",
        "alloc_many",
        "can_fit_many_then",
        "free",
        "translate_indices",
        "translate_index",
    ),
    logical=False,
    rounds_up=False,
    checks_frees=True,
)
