"""sglang: its host tier's ``LogicalHostPool`` becomes ``hostpool_nb.torch.LogicalHostPool``, from outside sglang.

::

    from hostpool_nb.integrations import sglang
    sglang.install()   # before sglang builds its host pool; needs torch, as sglang does

The class is replaced in ``sglang.srt.mem_cache.memory_pool_host`` and in
every sglang module imported so far that imported it by name (sglang
0.5.23 does in ``managers/cache_controller.py`` and
``mem_cache/hybrid_cache/hybrid_pool_assembler.py``). Each pool sglang then
builds logs one INFO line on the ``hostpool_nb`` logger. Tested with sglang
:data:`TESTED_VERSION` (its source, checked against hostpool_nb's class by
``tests/test_sglang_surface.py``) and with a stand-in engine
(``hostpool_nb.originals.engines``).
"""

from __future__ import annotations

from typing import Any

from . import _patch
from ._patch import IntegrationError, Target, announcing

#: The sglang release whose ``LogicalHostPool`` hostpool_nb's is checked against (CI downloads its wheel),
#: bumped on purpose.
TESTED_VERSION = "0.5.23"
#: The module that defines sglang's ``LogicalHostPool``, where ``install()`` replaces it.
MODULE = "sglang.srt.mem_cache.memory_pool_host"
ENGINE = "sglang"

_made: dict[str, type] = {}


def _describe(pool: Any) -> str:
    return (
        f"LogicalHostPool (hostpool_nb.torch): size={pool.size}, page_size={pool.page_size}, "
        f"tracking {'on' if pool.track else 'off'}"
    )


def _announcing_pool() -> type:
    """``hostpool_nb.torch.LogicalHostPool``, saying so when built: this module's ``LogicalHostPool``."""
    made = _made.get("LogicalHostPool")
    if made is None:
        try:
            from ..torch import LogicalHostPool as pool  # noqa: PLC0415 - torch only when asked for
        except ImportError as error:
            raise IntegrationError(
                f"sglang's integration installs hostpool_nb.torch.LogicalHostPool, which needs torch ({error})",
                name="torch",
            ) from error
        made = _made["LogicalHostPool"] = announcing(pool, ENGINE, _describe, __name__)
    return made


def __getattr__(name: str) -> Any:
    if name == "LogicalHostPool":  # made on first use, so that importing this module never imports torch
        return _announcing_pool()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


TARGETS = (Target(MODULE, "LogicalHostPool", lambda original: _announcing_pool()),)


def install() -> dict[str, type]:
    """Put hostpool_nb's ``LogicalHostPool`` where sglang looks it up; ``{"module.attribute": original}``.

    Everything is checked before anything is replaced: sglang not
    importable, no ``LogicalHostPool`` there, or one whose public methods
    and attributes hostpool_nb's does not offer with the same parameters,
    is an :class:`~hostpool_nb.integrations.IntegrationError` naming the
    attribute. Installed already: nothing changes, the same mapping returns.

    Returns
    -------
    dict
        ``"module.attribute"`` -> the class that was there.

    Examples
    --------
    On the stand-in engine (sglang's module paths, the original
    algorithm); sglang's pool is hostpool_nb.torch's, which needs torch:

    >>> from hostpool_nb.integrations import IntegrationError, sglang
    >>> from hostpool_nb.originals.engines import stand_in_engine
    >>> with stand_in_engine("sglang") as engine:
    ...     try:
    ...         replaced = sorted(sglang.install())
    ...         built = type(engine.build("LogicalHostPool", 64, 16)).__module__
    ...     except IntegrationError as error:  # no torch here: nothing replaced, and it says so
    ...         replaced, built = [], f"{error.name} missing"
    >>> replaced in ([], [  # the module that defines it, and one that imported it by name
    ...     "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.LogicalHostPool",
    ...     "sglang.srt.mem_cache.memory_pool_host.LogicalHostPool",
    ... ])
    True
    >>> built in ("hostpool_nb.integrations.sglang", "torch missing")
    True
    """
    return _patch.install(ENGINE, "sglang", TARGETS, f'pip install "sglang=={TESTED_VERSION}"')


def uninstall() -> dict[str, type]:
    """Put sglang's own class back where ``install`` replaced it (and it is still in place); what was put back.

    Examples
    --------
    >>> from hostpool_nb.integrations import sglang
    >>> sglang.uninstall()  # nothing installed: nothing to put back
    {}
    """
    return _patch.uninstall(ENGINE)


__all__ = ["MODULE", "TESTED_VERSION", "install", "uninstall"]
