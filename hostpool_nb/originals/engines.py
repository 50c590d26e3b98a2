"""Stand-in engines: the originals at sglang's and sglang-jax's module paths, to try the integrations without them.

``stand_in_engine("sglang")`` or ``stand_in_engine("sgl_jax")`` puts, for
the length of a ``with`` block, modules at the engine's paths holding its
classes as hostpool_nb's originals describe them, plus one module of the
engine that imported them by name and builds them, as the engine's own
modules do (sglang's ``hybrid_pool_assembler``, sglang-jax's
``model_runner``). sglang's host pools (``sglang.srt.mem_cache.pool_host``)
are a fresh copy of :mod:`~hostpool_nb.originals.sglang_host`'s hierarchy
in each block:

>>> import logging
>>> from hostpool_nb.integrations import sgl_jax
>>> from hostpool_nb.originals.engines import stand_in_engine
>>> with stand_in_engine("sgl_jax") as engine:
...     replaced = sgl_jax.install()
...     allocator = engine.build("PagedTokenToKVPoolAllocator", 1 << 16, 16, None)
...     type(allocator).__module__
'hostpool_nb.integrations.sgl_jax'

Neither sglang, sglang-jax, torch nor jax is imported; what was in
``sys.modules`` at those paths is put back at the end (an integration
installed inside the block is uninstalled then too).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

from .._hooks import DataPlaneHooks
from . import host_tier, paged
from . import sglang as _sglang
from . import sglang_host as _sglang_host

#: The engines :func:`stand_in_engine` stands in for.
ENGINES = ("sglang", "sgl_jax")


class LogicalHostPool(DataPlaneHooks, _sglang.LogicalHostPool):
    """sglang's host pool as sglang 0.5.23 shapes it: ``(size, page_size, layout)``, the data-plane hooks.

    Examples
    --------
    >>> from hostpool_nb.originals.engines import LogicalHostPool
    >>> pool = LogicalHostPool(64, 16, "layer_first")
    >>> pool.alloc(16)[:4], pool.get_ksize_per_token()
    (array([0, 1, 2, 3]), 0)
    """

    def __init__(self, size: int, page_size: int, layout: str = "layer_first") -> None:
        super().__init__(size, page_size)
        self.layout = layout


class StandIn:
    """The engine's module that builds its classes from names it imported: ``build(name, *args, **kwargs)``.

    Examples
    --------
    >>> from hostpool_nb.originals.engines import stand_in_engine
    >>> with stand_in_engine("sglang") as engine:
    ...     pool = engine.build("LogicalHostPool", 64, 16)
    >>> engine.module.__name__
    'sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler'
    >>> type(pool).__module__
    'hostpool_nb.originals.engines'
    """

    def __init__(self, engine: str, builder: types.ModuleType) -> None:
        self.engine = engine
        self.module = builder

    def build(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Construct the class the engine's module knows as ``name``, as the engine would."""
        return getattr(self.module, name)(*args, **kwargs)


def _modules(engine: str) -> dict[str, dict[str, Any]]:
    """Module path -> its attributes, parents first; the last is the module that imported the classes by name."""
    if engine == "sglang":
        # A fresh copy of the host pools' hierarchy each time: install() replaces methods on those classes.
        classes = _sglang_host.hierarchy()
        pools = {
            f"sglang.srt.mem_cache.{where}": {name: classes[name] for name in names}
            for where, names in _sglang_host.MODULES.items()
        }
        pools["sglang.srt.mem_cache.memory_pool_host"]["LogicalHostPool"] = LogicalHostPool
        return {
            "sglang": {},
            "sglang.srt": {},
            "sglang.srt.mem_cache": {},
            "sglang.srt.mem_cache.pool_host": {},
            **pools,
            "sglang.srt.mem_cache.hybrid_cache": {},
            # What builds them: the modules of sglang that import them by name, in one.
            "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler": {"LogicalHostPool": LogicalHostPool, **classes},
        }
    allocators = {name: getattr(paged, name) for name in paged.__all__}
    host_pools = {"LRUHostKVPool": host_tier.LRUHostKVPool, "QueueHostKVPool": host_tier.QueueHostKVPool}
    return {
        "sgl_jax": {},
        "sgl_jax.srt": {},
        "sgl_jax.srt.mem_cache": {},
        "sgl_jax.srt.mem_cache.allocator": allocators,
        "sgl_jax.srt.mem_cache.host_kv_pool": host_pools,
        "sgl_jax.srt.model_executor": {},
        "sgl_jax.srt.model_executor.model_runner": {**allocators, **host_pools},
    }


@contextlib.contextmanager
def stand_in_engine(engine: str) -> Iterator[StandIn]:
    """Stand-in modules at ``engine``'s paths for the ``with`` block (``"sglang"`` or ``"sgl_jax"``).

    Yields a :class:`StandIn` whose ``build`` constructs a class through
    the module that imported it by name.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got engine={engine!r}")
    layout = _modules(engine)
    saved = {name: sys.modules.get(name) for name in layout}
    made = {}
    for name, attributes in layout.items():
        module = made[name] = types.ModuleType(name)
        vars(module).update(attributes)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(made[parent], child, module)
        sys.modules[name] = module
    metrics = host_tier.stand_in_pd_metrics(keep_calls=False) if engine == "sgl_jax" else contextlib.nullcontext()
    try:
        with metrics:
            yield StandIn(engine, made[next(reversed(layout))])
    finally:
        importlib.import_module(f"hostpool_nb.integrations.{engine}").uninstall()
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


__all__ = ["ENGINES", "LogicalHostPool", "StandIn", "stand_in_engine"]
