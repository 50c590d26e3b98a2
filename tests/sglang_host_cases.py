"""sglang's host pools for tests: the original bookkeeping (stand-in, or sglang's own from its wheel), and ours.

Two sources of the original methods:

- ``"stand-in"``: :mod:`hostpool_nb.originals.sglang_host`, written from
  docs/behaviour.md section 5;
- ``"wheel"``: ``clear``, ``available_size``, ``_merge_release_slots``,
  ``alloc`` and ``free`` (and the ``logical_*`` properties, and the
  ``synchronized`` decorator they use) read from the pinned sglang wheel's
  source at test time (``HOSTPOOL_NB_SGLANG_WHEEL``), compiled, and put on
  minimal classes with the stand-ins' constructors, which set the attributes
  those methods read: nothing of sglang's code is in the repository, and
  sglang itself (which needs a GPU stack) is never imported.

Each call of :func:`hierarchy` makes fresh classes, so that keeping the books
on hostpool_nb (:func:`keep_books`, as ``install()`` does: the methods
replaced on the classes that define them) never touches another test's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hostpool_nb.integrations import sglang
from hostpool_nb.originals import _sglang_wheel, sglang_host

SOURCES = ("stand-in", "wheel")


def wheel_path() -> Path | None:
    """The pinned sglang wheel ``HOSTPOOL_NB_SGLANG_WHEEL`` names, if any."""
    return _sglang_wheel.wheel_path()


def need_wheel() -> Path:
    """The wheel's path; the test skips (saying why) without one."""
    path = wheel_path()
    if path is None:
        pytest.skip(
            "HOSTPOOL_NB_SGLANG_WHEEL names no sglang wheel: sglang's own methods are not run (CI downloads it)"
        )
    found = _sglang_wheel.version(path)
    assert found == sglang.TESTED_VERSION, (
        f"{path.name} is sglang {found}; the integration pins {sglang.TESTED_VERSION}"
    )
    return path


def hierarchy(source: str) -> dict[str, type]:
    """Fresh classes of the three bookkeepings (and the stand-in's subclasses), their methods from ``source``."""
    if source == "stand-in":
        return sglang_host.hierarchy()
    return _sglang_wheel.hierarchy(need_wheel())


def keep_books(classes: dict[str, type], announce: Callable[[Any, Any], None] | None = None) -> None:
    """Replace the bookkeeping methods on the classes that define them, as ``install()`` does."""
    from hostpool_nb.integrations import _sglang_host

    _sglang_host.take_over(classes, announce)


@dataclass(frozen=True)
class Geometry:
    """A pool's shape: which class, its constructor's arguments, and the unit an allocation comes in."""

    cls: str
    kwargs: tuple[tuple[str, Any], ...]
    unit: int  # slots a page: the logical page for the base class
    slots: int  # logical slot ids: [0, slots)

    @property
    def bookkeeping(self) -> sglang.Bookkeeping:
        return {
            "MambaPoolHost": sglang.MAMBA,
            "DeepSeekV4PagedHostPool": sglang.DEEPSEEK_V4_PAGED,
            "QSAIndexerPoolHost": sglang.DEEPSEEK_V4_PAGED,
        }.get(self.cls, sglang.HOST_KV_CACHE)

    def build(self, classes: dict[str, type]) -> Any:
        kwargs = dict(self.kwargs)
        args = kwargs.pop("args", ())
        return classes[self.cls](*args, **kwargs)

    def __str__(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.kwargs if k != "args")
        return f"{self.cls}({shown})" if shown else self.cls


def base(cls: str = "MHATokenToKVPoolHost", page_size: int = 4, pages: int = 6, dcp: int = 1) -> Geometry:
    physical = page_size // dcp
    kwargs = (("page_size", page_size), ("host_token_capacity", pages * physical), ("dcp_size", dcp))
    return Geometry(cls, kwargs, page_size, pages * physical * dcp)


def mamba(slots: int = 8) -> Geometry:
    return Geometry("MambaPoolHost", (("host_token_capacity", slots),), 1, slots)


def paged(page_size: int = 4, pages: int = 5, cls: str = "DeepSeekV4PagedHostPool") -> Geometry:
    return Geometry(cls, (("args", ("c4", pages, page_size)),), page_size, pages * page_size)


GEOMETRIES = (
    base(page_size=1, pages=8),
    base(page_size=4, pages=6),
    base("MLATokenToKVPoolHost", page_size=8, pages=4, dcp=2),
    mamba(8),
    paged(page_size=4, pages=5),
    paged(page_size=1, pages=6, cls="QSAIndexerPoolHost"),
)


def lock_of(pool: Any) -> threading.RLock:
    return pool.lock  # type: ignore[no-any-return]


__all__ = [
    "GEOMETRIES",
    "SOURCES",
    "Geometry",
    "base",
    "hierarchy",
    "keep_books",
    "lock_of",
    "mamba",
    "need_wheel",
    "paged",
    "wheel_path",
]


def interleave_class(source: str) -> type:
    """A fresh ``PageInterleaveHostPool`` class, its methods from ``source`` (the stand-in's, or the wheel's)."""
    if source == "stand-in":
        return sglang_host.hierarchy()["PageInterleaveHostPool"]
    return _sglang_wheel.interleave_classes(need_wheel())["PageInterleaveHostPool"]


def keep_interleave_books(cls: type, announce: Callable[[Any, Any], None] | None = None) -> None:
    """Replace ``cls``'s bookkeeping methods with hostpool_nb's, as ``install()`` does on sglang's class."""
    from hostpool_nb.integrations import _sglang_interleave

    own = {name: vars(cls)[name] for name in sglang.PAGE_INTERLEAVE.methods}
    for name, fn in _sglang_interleave.methods(own, announce or (lambda pool, kept: None)).items():
        setattr(cls, name, fn)


def interleaved(cls: type, page_size: int, pages_per_class: int, shard_size: int) -> Any:
    """A ``cls`` pool over a stand-in host pool of one rank's rows (its first page left out, as sglang's)."""
    host = sglang_host.hierarchy()["MHATokenToKVPoolHost"](
        page_size=page_size, host_token_capacity=(pages_per_class + 1) * page_size
    )
    return cls(host, shard_size=shard_size)


def envelope_class(source: str) -> type:
    """A fresh ``_SharedPageEnvelopeHostBacking`` class: the stand-in's, or the wheel's own (compiled whole)."""
    if source == "stand-in":
        return sglang_host.hierarchy()["_SharedPageEnvelopeHostBacking"]
    return _sglang_wheel.envelope_backing_class(need_wheel())


def keep_envelope_books(cls: type, announce: Callable[[Any, Any], None] | None = None) -> None:
    """Replace the backing's bookkeeping methods with hostpool_nb's, as ``install()`` does on sglang's class."""
    from hostpool_nb.integrations import _sglang_envelope

    own = {name: vars(cls)[name] for name in sglang.UNIFIED_ENVELOPE.methods}
    for name, fn in _sglang_envelope.methods(own, announce or (lambda pool, kept: None)).items():
        setattr(cls, name, fn)


def envelope(cls: type, total_bytes: int, sides: dict[str, tuple[int, int, str]]) -> Any:
    """A ``cls`` backing of exactly ``total_bytes`` over CPU stand-ins of its device pools."""
    return _sglang_wheel.envelope_backing(cls, total_bytes, sides)
