"""sglang: its whole HiCache host tier keeps its free slots in hostpool_nb, from outside sglang.

::

    from hostpool_nb.integrations import sglang
    sglang.install()   # before sglang builds its host pools; needs torch, as sglang does

Two kinds of replacement, both checked first against sglang
:data:`TESTED_VERSION`:

- ``LogicalHostPool`` (DeepSeek V4's logical host pool) becomes
  ``hostpool_nb.torch.LogicalHostPool``, in
  ``sglang.srt.mem_cache.memory_pool_host`` and in every sglang module
  imported so far that imported it by name (sglang 0.5.23 does in
  ``managers/cache_controller.py`` and
  ``mem_cache/hybrid_cache/hybrid_pool_assembler.py``);
- the bookkeeping methods (``clear``, ``available_size``,
  ``_merge_release_slots``, ``alloc``, ``free``) of the three classes that
  define them, :data:`HOST_KV_CACHE` (``HostKVCache``, whose bookkeeping the
  MHA, MLA, DSA and MiniMax pools inherit), :data:`MAMBA` and
  :data:`DEEPSEEK_V4_PAGED` (and ``QSAIndexerPoolHost``, which inherits
  it), are replaced on the classes themselves: every subclass, defined
  before the call or after, keeps its books on hostpool_nb
  (``docs/sglang.md``); :func:`books` gives a pool's.

Each pool sglang then builds logs one INFO line on the ``hostpool_nb``
logger. Tested with sglang :data:`TESTED_VERSION` (its source, checked
against hostpool_nb's by ``tests/integrations/test_sglang_surface.py``; its methods run
side by side with hostpool_nb's by ``tests/test_sglang_host_wheel.py``) and
with a stand-in engine (``hostpool_nb.originals.engines``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from . import _patch
from . import _sglang_books as _books
from ._patch import IntegrationError, MethodsTarget, Target, announcing
from ._sglang_books import Bookkeeping
from ._surface import NO_DEFAULT, Parameters

#: The sglang release whose ``LogicalHostPool`` hostpool_nb's is checked against (CI downloads its wheel),
#: bumped on purpose.
TESTED_VERSION = "0.5.23"
#: The module that defines sglang's ``LogicalHostPool``, where ``install()`` replaces it.
MODULE = _books.MODULE
#: The environment variable that, set to ``accept``, makes the Mamba and DeepSeek V4 paged pools accept double
#: frees, as their originals do.
DOUBLE_FREES = _books.DOUBLE_FREES
#: The bookkeeping ``HostKVCache`` defines and the MHA, MLA, DSA and MiniMax pools inherit.
HOST_KV_CACHE = _books.HOST_KV_CACHE
#: The bookkeeping ``MambaPoolHost`` defines, with no checks on ``free``.
MAMBA = _books.MAMBA
#: The bookkeeping ``DeepSeekV4PagedHostPool`` defines and ``QSAIndexerPoolHost`` inherits (allocations rounded
#: up, no checks on ``free``).
DEEPSEEK_V4_PAGED = _books.DEEPSEEK_V4_PAGED
#: The three, each defined by a class whose methods ``install()`` replaces.
BOOKKEEPINGS = _books.BOOKKEEPINGS
#: The bookkeeping of ``PageInterleaveHostPool`` (KV sharding), kept in a ``hostpool_nb.InterleavedPagePool``.
PAGE_INTERLEAVE = _books.PAGE_INTERLEAVE
#: The bookkeeping of ``_SharedPageEnvelopeHostBacking``, the byte envelope unified host pools share (hybrid
#: sliding-window models), kept in a ``hostpool_nb.EnvelopePagePool``.
UNIFIED_ENVELOPE = _books.UNIFIED_ENVELOPE
Bookkeeping.__module__ = __name__  # help() and reprs name the public path
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


def _host_pool_targets() -> tuple[MethodsTarget, ...]:
    """One target per bookkeeping: its class's methods, with their parameters in :data:`TESTED_VERSION`."""
    plain = Parameters((), (), var_positional=False, var_keyword=False)
    taking = {
        "alloc": Parameters((("need_size", NO_DEFAULT),), (), var_positional=False, var_keyword=False),
        "free": Parameters((("indices", NO_DEFAULT),), (), var_positional=False, var_keyword=False),
    }
    interleaved = {
        **taking,
        "alloc": Parameters(
            (("need_size", NO_DEFAULT), ("start_owner", "None")), (), var_positional=False, var_keyword=False
        ),
    }
    return (
        *(
            MethodsTarget(b.module, b.defined_by, {name: taking.get(name, plain) for name in b.methods}, _made_for(b))
            for b in BOOKKEEPINGS
        ),
        MethodsTarget(
            PAGE_INTERLEAVE.module,
            PAGE_INTERLEAVE.defined_by,
            {name: interleaved.get(name, plain) for name in PAGE_INTERLEAVE.methods},
            _made_for_interleave,
        ),
        MethodsTarget(UNIFIED_ENVELOPE.module, UNIFIED_ENVELOPE.defined_by, _ENVELOPE_PARAMETERS, _made_for_envelope),
    )


def _takes(*names: str, keyword_only: tuple[tuple[str, str], ...] = ()) -> Parameters:
    return Parameters(tuple((n, NO_DEFAULT) for n in names), keyword_only, var_positional=False, var_keyword=False)


_ENVELOPE_PARAMETERS = {
    "__init__": Parameters(
        (),
        tuple(
            (n, NO_DEFAULT)
            for n in (
                "device_pools",
                "pool_names",
                "host_to_device_ratio",
                "host_size",
                "pin_memory",
                "device",
                "allocator_type",
            )
        ),
        var_positional=False,
        var_keyword=False,
    ),
    "clear": _takes("name"),
    "available_size": _takes("name"),
    "free_bytes": _takes(),
    "alloc": _takes("name", "need_size"),
    "alloc_many": _takes("requests"),
    "can_fit_many_then": _takes("requests", "following_requests", keyword_only=(("empty", "False"),)),
    "free": _takes("name", "indices"),
    "translate_indices": _takes("name", "indices"),
    "translate_index": _takes("name", "index"),
}


def _made_for_envelope(cls: type, own: dict[str, Any]) -> dict[str, Any]:
    _host_books_module()  # torch, or the IntegrationError saying it is missing
    from . import _sglang_envelope  # noqa: PLC0415 - torch only when asked for

    return _sglang_envelope.methods(own, _announce_envelope)


def _announce_envelope(pool: Any, kept: Any) -> None:
    sides = ", ".join(
        f"{name} (page_size={ps}, {kept.total_bytes // pb} pages of {pb} bytes, grows {grow})"
        for name, (ps, pb, grow) in kept.sides.items()
    )
    _patch.log_in_use(
        ENGINE, f"{type(pool).__name__} on hostpool_nb (EnvelopePagePool): {kept.total_bytes} bytes; {sides}", kept
    )


def _made_for_interleave(cls: type, own: dict[str, Any]) -> dict[str, Any]:
    _host_books_module()  # torch, or the IntegrationError saying it is missing
    from . import _sglang_interleave  # noqa: PLC0415 - torch only when asked for

    return _sglang_interleave.methods(own, _announce_interleaved)


def _made_for(bookkeeping: Bookkeeping) -> Callable[[type, dict[str, Any]], dict[str, Any]]:
    """What makes hostpool_nb's methods of ``bookkeeping`` from the class's own (at ``install()``: torch then)."""

    def made(cls: type, own: dict[str, Any]) -> dict[str, Any]:
        return _host_books_module().methods(bookkeeping, own, _announce_books)  # type: ignore[no-any-return]

    return made


def _host_books_module() -> Any:
    try:
        from . import _sglang_host  # noqa: PLC0415 - torch only when asked for
    except ImportError as error:
        raise IntegrationError(
            f"sglang's integration keeps its host pools' books with hostpool_nb.torch, which needs torch ({error})",
            name="torch",
        ) from error
    return _sglang_host


def _announce_books(pool: Any, kept: Any) -> None:
    extra = ", double frees accepted" if kept.accept_double_frees else ""
    _patch.log_in_use(
        ENGINE,
        f"{type(pool).__name__} on hostpool_nb ({kept.bookkeeping.defined_by}'s bookkeeping): {kept.size} slots, "
        f"page_size={kept.page_size}, tracking {'on' if kept.track else 'off'}{extra}",
        kept,
    )


def _announce_interleaved(pool: Any, kept: Any) -> None:
    _patch.log_in_use(
        ENGINE,
        f"{type(pool).__name__} on hostpool_nb (InterleavedPagePool): {kept.shard_size} owner classes of "
        f"{kept.pages_per_class} pages, page_size={kept.page_size}",
        kept,
    )


TARGETS: tuple[Target | MethodsTarget, ...] = (
    Target(MODULE, "LogicalHostPool", lambda original: _announcing_pool()),
    *_host_pool_targets(),
)


def books(pool: Any) -> Any:
    """The hostpool_nb books of one of sglang's host pools built after :func:`install`: a ``hostpool_nb.torch`` pool.

    For the diagnostics a :class:`hostpool_nb.LogicalHostPool` offers:
    ``check_invariants()``, ``leak_report()`` and ``outstanding()`` (with
    ``HOSTPOOL_NB_TRACK=1`` set before the pool is built), ``recording()``,
    ``stats()``. Its ``accept_double_frees`` may be set for a Mamba or
    DeepSeek V4 paged pool (whose originals accept double frees; see
    :data:`DOUBLE_FREES` for all of them).

    Raises
    ------
    HostPoolError
        If ``pool`` keeps its own books (not one of sglang's host pools, or
        one built before ``install()``).
    IntegrationError
        If torch is not importable.

    Examples
    --------
    >>> from hostpool_nb.integrations import sglang
    >>> sglang.books(object())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hostpool_nb.HostPoolError: object keeps its own books: ...
    """
    from .._errors import HostPoolError  # noqa: PLC0415 - the check needs no torch

    if not hasattr(pool, "_hostpool_nb") and not hasattr(getattr(pool, "_shared_backing", None), "_hostpool_nb"):
        raise HostPoolError(
            f"{type(pool).__name__} keeps its own books: hostpool_nb keeps those of sglang's host pools built "
            "after hostpool_nb.integrations.sglang.install()"
        )
    return _host_books_module().books(pool)


def install() -> dict[str, Any]:
    """Put hostpool_nb's ``LogicalHostPool`` where sglang looks it up; ``{"module.attribute": original}``.

    Checked whole first, as every ``install()`` (:mod:`hostpool_nb.integrations`):
    sglang or torch not importable, or a class sglang defines unlike what
    hostpool_nb offers for it, is an :class:`~hostpool_nb.integrations.IntegrationError`
    and replaces nothing. The host tier's pool classes (:data:`HOST_KV_CACHE`) keep
    their books on hostpool_nb's kernels once installed.

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
    ...         mha = engine.build("MHATokenToKVPoolHost", page_size=16, host_token_capacity=64)
    ...         slots = mha.alloc(32).tolist()  # on hostpool_nb's books now
    ...     except IntegrationError as error:  # no torch here: nothing replaced, and it says so
    ...         replaced, built, slots = [], f"{error.name} missing", list(range(32))
    >>> [w for w in replaced if w.endswith("LogicalHostPool")] in ([], [  # where defined, where imported by name
    ...     "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.LogicalHostPool",
    ...     "sglang.srt.mem_cache.memory_pool_host.LogicalHostPool",
    ... ])
    True
    >>> sorted({w.rsplit(".", 2)[1] for w in replaced if not w.endswith("LogicalHostPool")}) in ([], [
    ...     "DeepSeekV4PagedHostPool", "HostKVCache", "MambaPoolHost",  # the classes whose methods keep books
    ...     "PageInterleaveHostPool", "_SharedPageEnvelopeHostBacking",
    ... ])
    True
    >>> built in ("hostpool_nb.integrations.sglang", "torch missing"), slots == list(range(32))
    (True, True)
    """
    return _patch.install(ENGINE, "sglang", TARGETS, f'pip install "sglang=={TESTED_VERSION}"')


def uninstall() -> dict[str, Any]:
    """Put sglang's own class and methods back where ``install`` replaced them (and they are still in place).

    Every host pool that keeps its books on hostpool_nb gets the original
    bookkeeping's lists back first (its free slots in the order allocation
    would take them, its slots in use), so it goes on under sglang's own
    methods. Returns what was put back.

    Examples
    --------
    >>> from hostpool_nb.integrations import sglang
    >>> sglang.uninstall()  # nothing installed: nothing to put back
    {}
    """
    if "hostpool_nb.integrations._sglang_host" in sys.modules:  # pools have books only if it was imported
        sys.modules["hostpool_nb.integrations._sglang_host"].hand_back_all()
    return _patch.uninstall(ENGINE)


__all__ = [
    "BOOKKEEPINGS",
    "DEEPSEEK_V4_PAGED",
    "DOUBLE_FREES",
    "HOST_KV_CACHE",
    "MAMBA",
    "MODULE",
    "PAGE_INTERLEAVE",
    "TESTED_VERSION",
    "UNIFIED_ENVELOPE",
    "Bookkeeping",
    "books",
    "install",
    "uninstall",
]
