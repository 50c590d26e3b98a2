"""sglang's own ``LogicalHostPool``, read from the release the integration pins, against hostpool_nb's.

Runs when ``HOSTPOOL_NB_SGLANG_WHEEL`` names sglang's wheel (or a folder
holding it) for ``hostpool_nb.integrations.sglang.TESTED_VERSION``; CI
downloads it (``pip download --no-deps sglang==<pin>``). The source is read
with ``ast``, never imported: sglang need not be installed, nor run here.
"""

from __future__ import annotations

import ast
import os
import zipfile
from pathlib import Path

import pytest

import hostpool_nb
from hostpool_nb.integrations._surface import (
    attributes_set_in_init,
    own_methods_of_source,
    surface_of,
    surface_of_source,
    surface_problems,
)
from hostpool_nb.integrations.sglang import MODULE, TESTED_VERSION

IMPORTED_BY_NAME = (  # what the integration's docstring says sglang imports by name
    "sglang/srt/managers/cache_controller.py",
    "sglang/srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py",
)


def _wheel() -> Path:
    where = os.environ.get("HOSTPOOL_NB_SGLANG_WHEEL")
    if not where:
        pytest.skip("HOSTPOOL_NB_SGLANG_WHEEL is not set: no sglang wheel to read (CI downloads one)")
    path = Path(where)
    if path.is_dir():
        found = sorted(path.glob("sglang-*.whl"))
        if not found:
            pytest.skip(f"no sglang wheel in {path}")
        path = found[-1]
    return path


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    path = _wheel()
    version = path.name.split("-")[1]
    assert version == TESTED_VERSION, f"{path.name} is sglang {version}; the integration pins {TESTED_VERSION}"
    return zipfile.ZipFile(path)


@pytest.fixture(scope="module")
def source(wheel: zipfile.ZipFile) -> str:
    return wheel.read(MODULE.replace(".", "/") + ".py").decode()


def _ours() -> list[type]:
    classes: list[type] = [hostpool_nb.LogicalHostPool]
    try:
        from hostpool_nb.torch import LogicalHostPool
    except ImportError:
        return classes
    return [*classes, LogicalHostPool]


def test_every_public_member_of_sglangs_pool_is_hostpool_nbs_with_the_same_parameters(source: str) -> None:
    theirs = surface_of_source(source, "LogicalHostPool")
    assert {"__init__", "alloc", "free", "clear", "available_size"} <= set(theirs)  # the source was read
    for mine in _ours():
        where = f"{mine.__module__}.LogicalHostPool"
        assert surface_problems(theirs, surface_of(mine), where) == []


def test_every_attribute_sglangs_constructor_sets_is_set_on_hostpool_nbs(source: str) -> None:
    public = {name for name in attributes_set_in_init(source, "LogicalHostPool") if not name.startswith("_")}
    assert {"size", "page_size", "lock"} <= public
    for mine in _ours():
        pool = mine(64, 16)
        assert sorted(name for name in public if not hasattr(pool, name)) == []


def test_the_integrations_target_and_the_modules_that_import_it_by_name_exist(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert MODULE.replace(".", "/") + ".py" in names
    for path in IMPORTED_BY_NAME:
        text = wheel.read(path).decode()
        assert "from sglang.srt.mem_cache.memory_pool_host import" in text
        assert "LogicalHostPool" in text


# -- the HiCache host pools: the bookkeeping methods install() replaces on their classes ---------------

_BOOKKEEPING_NAMES = {"clear", "available_size", "_merge_release_slots", "alloc", "free"}


def _classes_in(wheel: zipfile.ZipFile) -> dict[str, tuple[str, tuple[str, ...], set[str]]]:
    """Every class of sglang's host pool modules: name -> (module, base names, the bookkeeping methods it defines)."""
    found = {}
    for path in wheel.namelist():
        if not (path.startswith("sglang/srt/mem_cache/pool_host/") or path == MODULE.replace(".", "/") + ".py"):
            continue
        if not path.endswith(".py"):
            continue
        source = wheel.read(path).decode()
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef):
                bases = tuple(ast.unparse(b).split("[")[0].rsplit(".", 1)[-1] for b in node.bases)
                own = set(own_methods_of_source(source, node.name)) & _BOOKKEEPING_NAMES
                found[node.name] = (path[: -len(".py")].replace("/", "."), bases, own)
    return found


def _derives_from(classes: dict[str, tuple[str, tuple[str, ...], set[str]]], name: str, ancestor: str) -> bool:
    if name == ancestor:
        return True
    return any(b in classes and _derives_from(classes, b, ancestor) for b in classes[name][1])


def test_each_bookkeeping_is_defined_where_and_as_install_expects(wheel: zipfile.ZipFile) -> None:
    """The class, its module, its methods and their parameters: what install() checks the running sglang for."""
    from hostpool_nb.integrations import sglang

    for b in sglang.BOOKKEEPINGS:
        source = wheel.read(b.module.replace(".", "/") + ".py").decode()
        own = own_methods_of_source(source, b.defined_by)
        assert set(own) & _BOOKKEEPING_NAMES == set(b.methods), b.defined_by
        pinned = {t.attribute: t for t in sglang.TARGETS if hasattr(t, "parameters")}[b.defined_by].parameters
        assert {name: own[name] for name in b.methods} == dict(pinned)


def test_the_stand_ins_mirror_sglangs_host_pool_hierarchy(wheel: zipfile.ZipFile) -> None:
    """Each stand-in class is in the same module, with the same bases and the same bookkeeping methods of its own."""
    from hostpool_nb.originals import sglang_host

    classes = _classes_in(wheel)
    for where, names in sglang_host.MODULES.items():
        for name in names:
            assert name in classes, name
            module, bases, own = classes[name]
            assert module == f"sglang.srt.mem_cache.{where}", name
            mine = getattr(sglang_host, name)
            # Bases that add no bookkeeping aside: sglang's abc.ABC, the stand-ins' private helper.
            ours = tuple(b.__name__ for b in mine.__bases__ if not b.__name__.startswith("_") and b is not object)
            assert ours == tuple(b for b in bases if b not in ("ABC", "object")), name
            assert set(vars(mine)) & _BOOKKEEPING_NAMES == own, name


def test_every_host_pool_with_its_own_bookkeeping_is_known(wheel: zipfile.ZipFile) -> None:
    """A class deriving from HostKVCache either inherits one of the three bookkeepings or is known not to use any.

    A new release adding a pool with a bookkeeping of its own fails here: install() would not cover it.
    """
    from hostpool_nb.integrations import sglang

    classes = _classes_in(wheel)
    mine = {b.defined_by for b in sglang.BOOKKEEPINGS}
    others = {  # their own algorithms (docs/sglang.md: out of scope) or no allocator at all
        "DeepSeekV4StateHostPool",
        "UnifiedPageEnvelopeHostPool",
    }
    own = {name for name, (_, _, methods) in classes.items() if methods and _derives_from(classes, name, "HostKVCache")}
    assert own == mine | others
    covered = [n for n in classes if _derives_from(classes, n, "HostKVCache") and n not in others]
    assert len(covered) >= 12  # the pools of docs/behaviour.md section 5, and those deriving from them
