"""sglang's own host-pool bookkeeping, read from its released wheel: the oracle the tests and the bench run.

``clear``, ``available_size``, ``_merge_release_slots``, ``alloc`` and
``free`` of each class :data:`hostpool_nb.integrations.sglang.BOOKKEEPINGS`
names (with the ``logical_*`` properties, and the ``synchronized`` decorator
they use) are read from the wheel's source, compiled, and put on minimal
classes whose constructors (the stand-ins') set the attributes those methods
read. Nothing of sglang's code is in this repository, and sglang itself
(which needs a GPU stack) is never imported: only its methods' text, from
the wheel the user or CI downloaded.
"""

from __future__ import annotations

import ast
import functools
import logging
import os
import zipfile
from pathlib import Path
from typing import Any

from hostpool_nb.integrations import sglang
from hostpool_nb.originals import sglang_host

WHEEL_ENV = "HOSTPOOL_NB_SGLANG_WHEEL"
_BASE_MODULE = "sglang/srt/mem_cache/pool_host/base.py"


def wheel_path() -> Path | None:
    """The sglang wheel ``HOSTPOOL_NB_SGLANG_WHEEL`` names (a file, or a folder holding it), if any."""
    where = os.environ.get(WHEEL_ENV)
    if not where:
        return None
    path = Path(where)
    if path.is_dir():
        found = sorted(path.glob("sglang-*.whl"))
        return found[-1] if found else None
    return path


def version(path: Path) -> str:
    """The release a wheel's file name says it holds."""
    return path.name.split("-")[1]


def _compiled(nodes: list[ast.stmt], where: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """``nodes`` (functions, decorators and all) compiled and run in a copy of ``namespace``; what they define."""
    future = ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")], level=0)
    module = ast.Module(body=[future, *nodes], type_ignores=[])
    ast.fix_missing_locations(module)
    run = dict(namespace)
    exec(compile(module, f"<sglang wheel: {where}>", "exec"), run)  # sglang's released code, run as the oracle
    return {node.name: run[node.name] for node in nodes if isinstance(node, ast.FunctionDef)}


def _class_functions(source: str, class_name: str, names: tuple[str, ...]) -> list[ast.stmt]:
    tree = ast.parse(source)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise LookupError(f"the sglang wheel defines no class {class_name}")
    found: list[ast.stmt] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in found if isinstance(n, ast.FunctionDef)}
    if missing:
        raise LookupError(f"{class_name} of the sglang wheel does not define {sorted(missing)}")
    return found


@functools.cache
def functions(path: Path) -> dict[str, dict[str, Any]]:
    """Class name -> its bookkeeping methods, compiled from the wheel at ``path``."""
    import torch  # noqa: PLC0415 - torch only where the wheel is read, not with the module

    with zipfile.ZipFile(path) as wheel:
        base = wheel.read(_BASE_MODULE).decode()
        helpers: list[ast.stmt] = [
            n for n in ast.parse(base).body if isinstance(n, ast.FunctionDef) and n.name == "synchronized"
        ]
        namespace: dict[str, Any] = {"torch": torch, "Optional": Any, "logger": logging.getLogger("sglang-wheel")}
        namespace.update(_compiled(helpers, "synchronized", {"wraps": functools.wraps}))
        made = {}
        for b in sglang.BOOKKEEPINGS:
            source = wheel.read(b.module.replace(".", "/") + ".py").decode()
            names = b.methods + (("logical_size", "logical_page_size") if b.logical else ())
            made[b.defined_by] = _compiled(_class_functions(source, b.defined_by, names), b.defined_by, namespace)
    return made


def hierarchy(path: Path) -> dict[str, type]:
    """Fresh classes with the stand-ins' names, constructors and hierarchy, and the wheel's bookkeeping methods."""
    classes = sglang_host.hierarchy()
    found = functions(path)
    base = type("HostKVCache", (), {"dcp_size": 1, "dcp_rank": 0, "__init__": vars(classes["HostKVCache"])["__init__"]})
    for name, fn in found["HostKVCache"].items():
        setattr(base, name, fn)
    made: dict[str, type] = {"HostKVCache": base}
    for name in ("MambaPoolHost", "DeepSeekV4PagedHostPool"):
        made[name] = type(name, (base,), {"__init__": vars(classes[name])["__init__"], **found[name]})
    made["MHATokenToKVPoolHost"] = type("MHATokenToKVPoolHost", (base,), {})
    made["MLATokenToKVPoolHost"] = type("MLATokenToKVPoolHost", (classes["HiSparseHostPoolMixin"], base), {})
    made["QSAIndexerPoolHost"] = type("QSAIndexerPoolHost", (made["DeepSeekV4PagedHostPool"],), {})
    return made


_INTERLEAVE_ALLOCATOR = "sglang/srt/mem_cache/allocator/page_interleave.py"
_INTERLEAVE_POOL = "sglang/srt/mem_cache/pool_host/page_interleave.py"
#: What the interleaved host pool runs of the wheel: the allocator's classed bookkeeping, the facade's four methods.
INTERLEAVE_ALLOCATOR_METHODS = (
    "clear",
    "class_free_page_counts",
    "available_size",
    "_class_counts",
    "alloc_extend",
    "alloc_cyclic",
    "free",
)
INTERLEAVE_POOL_METHODS = ("__getattr__", "clear", "available_size", "alloc", "free")


class _PagedAllocatorBase:
    """What ``PageInterleavePoolAllocator``'s constructor gets from its bases: the attributes its methods read."""

    def __init__(self, size: int, page_size: int, dtype: Any, device: str, kvcache: Any, need_sort: bool) -> None:  # noqa: PLR0913, PLR0917 - the wheel's base constructor's parameters
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self._kvcache = kvcache
        self.need_sort = need_sort
        self.free_group = None
        self.num_pages = size // page_size
        self.debug_mode = False
        self.clear()  # type: ignore[attr-defined]


def interleave_classes(path: Path) -> dict[str, type]:
    """Fresh ``PageInterleavePoolAllocator`` and ``PageInterleaveHostPool`` classes with the wheel's methods (the
    stand-in's constructor for the pool: ``shard_size`` for the placement)."""
    allocator_methods, pool_methods = _interleave_functions(path)
    allocator = type("PageInterleavePoolAllocator", (_PagedAllocatorBase,), dict(allocator_methods))
    # The wheel's __init__ calls the zero-argument super(), which needs a class body: what it does, by hand.
    allocator.__init__ = _allocator_init()  # type: ignore[misc]
    namespace = {**pool_methods["namespace"], "PageInterleavePoolAllocator": allocator}
    methods = _compiled(pool_methods["nodes"], "PageInterleaveHostPool", namespace)
    stand_in = sglang_host.hierarchy()["PageInterleaveHostPool"]
    pool = type(
        "PageInterleaveHostPool",
        (),
        {"__init__": vars(stand_in)["__init__"], "logical_size": vars(stand_in)["logical_size"], **methods},
    )
    return {"PageInterleavePoolAllocator": allocator, "PageInterleaveHostPool": pool}


@functools.cache
def _interleave_functions(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch  # noqa: PLC0415 - torch only where the wheel is read

    with zipfile.ZipFile(path) as wheel:
        base = wheel.read(_BASE_MODULE).decode()
        allocator_source = wheel.read(_INTERLEAVE_ALLOCATOR).decode()
        pool_source = wheel.read(_INTERLEAVE_POOL).decode()
    helpers: list[ast.stmt] = [
        n for n in ast.parse(base).body if isinstance(n, ast.FunctionDef) and n.name == "synchronized"
    ]
    namespace: dict[str, Any] = {"torch": torch, "Optional": Any, "List": list, "Tuple": tuple}
    namespace.update(_compiled(helpers, "synchronized", {"wraps": functools.wraps}))
    found = _compiled(
        _class_functions(allocator_source, "PageInterleavePoolAllocator", INTERLEAVE_ALLOCATOR_METHODS),
        "PageInterleavePoolAllocator",
        namespace,
    )
    nodes = _class_functions(pool_source, "PageInterleaveHostPool", INTERLEAVE_POOL_METHODS)
    return found, {"namespace": namespace, "nodes": nodes}


def _allocator_init() -> Any:
    def __init__(  # noqa: PLR0913, PLR0917 - the wheel's constructor's parameters
        self: Any,
        size: int,
        physical_page_size: int,
        shard_size: int,
        dtype: Any,
        device: str,
        kvcache: Any,
        need_sort: bool,
        shard_spec: Any = None,
    ) -> None:
        assert shard_size > 1, "PageInterleavePoolAllocator requires shard_size > 1"
        self.physical_page_size = physical_page_size
        self.shard_size = shard_size
        self.shard_spec = shard_spec
        _PagedAllocatorBase.__init__(self, size * shard_size, physical_page_size, dtype, device, kvcache, need_sort)

    return __init__


_UNIFIED = "sglang/srt/mem_cache/pool_host/unified.py"


@functools.cache
def _backing_class_node(path: Path) -> ast.ClassDef:
    with zipfile.ZipFile(path) as wheel:
        source = wheel.read(_UNIFIED).decode()
    node = next(
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "_SharedPageEnvelopeHostBacking"
    )
    return node


def envelope_backing_class(path: Path) -> type:
    """A fresh ``_SharedPageEnvelopeHostBacking`` class, compiled whole from the wheel (its own constructor)."""
    import contextlib  # noqa: PLC0415
    import threading  # noqa: PLC0415
    from collections.abc import Sequence  # noqa: PLC0415

    import torch  # noqa: PLC0415 - torch only where the wheel is read

    def alloc_memory(shape: tuple[int, ...], *, dtype: Any, device: str, pin_memory: bool, allocator: Any) -> Any:
        return torch.zeros(shape, dtype=dtype, device=device)

    namespace: dict[str, Any] = {
        "torch": torch,
        "threading": threading,
        "contextmanager": contextlib.contextmanager,
        "Sequence": Sequence,
        "host_memory_budget_bytes": lambda requested=None: 1 << 40,
        "ALLOC_MEMORY_FUNCS": {torch.device("cpu"): alloc_memory},
        "_cuda_host_unregister": lambda raw: None,
        "get_allocator_from_storage": lambda allocator_type: None,
        "_is_cuda": False,
        "_is_hip": False,
    }
    future = ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")], level=0)
    module = ast.Module(body=[future, _backing_class_node(path)], type_ignores=[])
    ast.fix_missing_locations(module)
    exec(compile(module, "<sglang wheel: _SharedPageEnvelopeHostBacking>", "exec"), namespace)  # sglang's own
    return namespace["_SharedPageEnvelopeHostBacking"]  # type: ignore[no-any-return]


def envelope_backing(cls: type, total_bytes: int, sides: dict[str, tuple[int, int, str]]) -> Any:
    """``cls`` (the wheel's backing class) built over CPU stand-ins of its device pools: ``total_bytes`` in all,
    each side ``name: (page_size, page_bytes, "up" | "down")``."""
    return cls(
        device_pools=sglang_host.envelope_device_pools(total_bytes, sides),
        pool_names=list(sides),
        host_to_device_ratio=1.0,
        host_size=0,
        pin_memory=False,
        device="cpu",
        allocator_type="default",
    )
