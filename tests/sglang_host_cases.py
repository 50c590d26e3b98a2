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

import ast
import logging
import os
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hostpool_nb.integrations import sglang
from hostpool_nb.originals import sglang_host

SOURCES = ("stand-in", "wheel")
# The modules of sglang (inside the wheel) that define each bookkeeping's methods, and those methods' helpers.
_BASE_MODULE = "sglang/srt/mem_cache/pool_host/base.py"


def wheel_path() -> Path | None:
    """The pinned sglang wheel ``HOSTPOOL_NB_SGLANG_WHEEL`` names (a file, or a folder holding it), if any."""
    where = os.environ.get("HOSTPOOL_NB_SGLANG_WHEEL")
    if not where:
        return None
    path = Path(where)
    if path.is_dir():
        found = sorted(path.glob("sglang-*.whl"))
        return found[-1] if found else None
    return path


def need_wheel() -> zipfile.ZipFile:
    """The wheel, opened; the test skips (saying why) without one."""
    path = wheel_path()
    if path is None:
        pytest.skip(
            "HOSTPOOL_NB_SGLANG_WHEEL names no sglang wheel: sglang's own methods are not run (CI downloads it)"
        )
    version = path.name.split("-")[1]
    assert version == sglang.TESTED_VERSION, (
        f"{path.name} is sglang {version}; the integration pins {sglang.TESTED_VERSION}"
    )
    return zipfile.ZipFile(path)


def _module_path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _compiled(source: str, nodes: list[ast.stmt], where: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """``nodes`` (functions of ``source``, decorators and all) compiled and run in ``namespace``; what they define."""
    future = ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")], level=0)
    module = ast.Module(body=[future, *nodes], type_ignores=[])
    ast.fix_missing_locations(module)
    run = dict(namespace)
    exec(compile(module, f"<sglang wheel: {where}>", "exec"), run)  # sglang's released code, run as the oracle
    return {node.name: run[node.name] for node in nodes if isinstance(node, ast.FunctionDef)}


def _class_functions(source: str, class_name: str, names: tuple[str, ...]) -> list[ast.stmt]:
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    found = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in found}
    assert not missing, f"{class_name} of the wheel does not define {sorted(missing)}"
    return found  # type: ignore[return-value]


def _wheel_functions(wheel: zipfile.ZipFile) -> dict[str, dict[str, Any]]:
    """Class name -> its bookkeeping methods, compiled from the wheel's source."""
    import torch

    base = wheel.read(_BASE_MODULE).decode()
    helpers = [n for n in ast.parse(base).body if isinstance(n, ast.FunctionDef) and n.name == "synchronized"]
    namespace: dict[str, Any] = {"torch": torch, "Optional": Any, "logger": logging.getLogger("sglang-wheel")}
    namespace.update(_compiled(base, helpers, "synchronized", {"wraps": __import__("functools").wraps}))
    made = {}
    for b in sglang.BOOKKEEPINGS:
        source = wheel.read(_module_path(b.module)).decode()
        names = b.methods + (("logical_size", "logical_page_size") if b.logical else ())
        made[b.defined_by] = _compiled(source, _class_functions(source, b.defined_by, names), b.defined_by, namespace)
    return made


_wheel_cache: dict[str, dict[str, dict[str, Any]]] = {}


def hierarchy(source: str) -> dict[str, type]:
    """Fresh classes of the three bookkeepings (and the stand-in's subclasses), their methods from ``source``."""
    classes = sglang_host.hierarchy()
    if source == "stand-in":
        return classes
    wheel = need_wheel()
    key = str(wheel.filename)
    if key not in _wheel_cache:
        _wheel_cache[key] = _wheel_functions(wheel)
    functions = _wheel_cache[key]
    # The stand-ins' constructors (the attributes the methods read), sglang's methods.
    base = type("HostKVCache", (), {"dcp_size": 1, "dcp_rank": 0, "__init__": vars(classes["HostKVCache"])["__init__"]})
    for name, fn in functions["HostKVCache"].items():
        setattr(base, name, fn)
    made = {"HostKVCache": base}
    for name in ("MambaPoolHost", "DeepSeekV4PagedHostPool"):
        made[name] = type(name, (base,), {"__init__": vars(classes[name])["__init__"], **functions[name]})
    hisparse = classes["HiSparseHostPoolMixin"]
    made["MHATokenToKVPoolHost"] = type("MHATokenToKVPoolHost", (base,), {})
    made["MLATokenToKVPoolHost"] = type("MLATokenToKVPoolHost", (hisparse, base), {})
    made["QSAIndexerPoolHost"] = type("QSAIndexerPoolHost", (made["DeepSeekV4PagedHostPool"],), {})
    return made


def keep_books(classes: dict[str, type], announce: Callable[[Any, Any], None] | None = None) -> None:
    """Replace the bookkeeping methods on the classes that define them, as ``install()`` does."""
    from hostpool_nb.integrations import _sglang_host

    for b in sglang.BOOKKEEPINGS:
        cls = classes[b.defined_by]
        own = {name: vars(cls)[name] for name in b.methods}
        for name, fn in _sglang_host.methods(b, own, announce or (lambda pool, kept: None)).items():
            setattr(cls, name, fn)


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
