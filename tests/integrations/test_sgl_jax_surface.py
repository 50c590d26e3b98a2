"""sglang-jax's allocators and host pools, read from the release the integration pins, against hostpool_nb's.

Runs when ``HOSTPOOL_NB_SGL_JAX_WHEEL`` names sglang-jax's wheel (or a
folder holding it) for ``hostpool_nb.integrations.sgl_jax.TESTED_VERSION``;
CI downloads it (``pip download --no-deps --pre --python-version 3.12
sglang-jax==<pin>``). The source is read with ``ast``, never imported:
neither sglang-jax nor jax need be installed. The release is written for
Python 3.12 and later, and some of its modules use 3.12 syntax: the scan of
every module (who imports the classes by name) needs a Python that parses
them; the two modules the integration replaces classes in parse on 3.10.
"""

from __future__ import annotations

import ast
import os
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hostpool_nb import paged
from hostpool_nb.integrations import sgl_jax
from hostpool_nb.integrations._surface import (
    attributes_set_in_init,
    methods_of_source,
    parameters_of,
    surface_of,
    surface_of_source,
    surface_problems,
)

ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator", "SWATokenToKVPoolAllocator")
HOST_POOLS = ("LRUHostKVPool", "QueueHostKVPool")
#: The engine's modules (tests aside) that import the replaced classes by name; install() rebinds those
#: imported before it runs, and the others read the replaced attribute when they import.
IMPORTED_BY_NAME = {
    "sgl_jax/srt/disaggregation/factory.py": {"QueueHostKVPool"},
    "sgl_jax/srt/disaggregation/pathways_scheduler.py": {"SWATokenToKVPoolAllocator"},
    "sgl_jax/srt/managers/schedule_batch.py": {"SWATokenToKVPoolAllocator"},
    "sgl_jax/srt/managers/schedule_policy.py": {"SWATokenToKVPoolAllocator"},
    "sgl_jax/srt/mem_cache/chunk_cache.py": {"SWATokenToKVPoolAllocator"},
    "sgl_jax/srt/mem_cache/common.py": {"SWATokenToKVPoolAllocator"},
    "sgl_jax/srt/mem_cache/kv_cache_builder.py": {"LRUHostKVPool"},
    "sgl_jax/srt/mem_cache/swa_radix_cache.py": {"SWATokenToKVPoolAllocator"},
    "sgl_jax/srt/model_executor/model_runner_kv_cache_mixin.py": {
        "PagedTokenToKVPoolAllocator",
        "SWATokenToKVPoolAllocator",
        "TokenToKVPoolAllocator",
    },
    "sgl_jax/srt/multimodal/model_executor/audio/audio_backbone_model_runner.py": {"TokenToKVPoolAllocator"},
}
#: Names the engine imports from those modules that install() leaves alone, and why that is safe.
NOT_REPLACED = {
    # Type hints only (no isinstance below): hostpool_nb's allocators derive from hostpool_nb's base of that name.
    "BaseTokenToKVPoolAllocator",
    # The host pools' base class: the classes install() puts in place derive from the engine's own host pools.
    "HostKVPool",
}


def _wheel() -> Path:
    where = os.environ.get("HOSTPOOL_NB_SGL_JAX_WHEEL")
    if not where:
        pytest.skip("HOSTPOOL_NB_SGL_JAX_WHEEL is not set: no sglang-jax wheel to read (CI downloads one)")
    path = Path(where)
    if path.is_dir():
        found = sorted(path.glob("sglang_jax-*.whl"))
        if not found:
            pytest.skip(f"no sglang-jax wheel in {path}")
        path = found[-1]
    return path


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    path = _wheel()
    version = path.name.split("-")[1]
    assert version == sgl_jax.TESTED_VERSION, f"{path.name} is sglang-jax {version}, not the pin"
    return zipfile.ZipFile(path)


def _source(wheel: zipfile.ZipFile, module: str) -> str:
    return wheel.read(module.replace(".", "/") + ".py").decode()


@pytest.fixture(scope="module")
def allocators(wheel: zipfile.ZipFile) -> str:
    return _source(wheel, sgl_jax.ALLOCATORS)


@pytest.fixture(scope="module")
def host_pools(wheel: zipfile.ZipFile) -> str:
    return _source(wheel, sgl_jax.HOST_POOLS)


def _built(name: str, cls: type) -> Any:
    kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    return {
        "TokenToKVPoolAllocator": lambda: cls(64, None, 2),
        "PagedTokenToKVPoolAllocator": lambda: cls(64, 4, None, False, 2),
        "SWATokenToKVPoolAllocator": lambda: cls(64, 32, kv, 4, 2),
    }[name]()


@pytest.mark.parametrize("name", ALLOCATORS)
def test_every_public_member_of_an_engine_allocator_is_hostpool_nbs_with_the_same_parameters(
    allocators: str, name: str
) -> None:
    theirs = surface_of_source(allocators, name)  # its base class's members included
    assert {"__init__", "alloc", "free", "debug_print", "merge_and_sort_free", "get_cpu_copy"} <= set(theirs)
    for mine in (getattr(paged, name), getattr(sgl_jax, name)):  # the class, and what install() puts in place
        assert surface_problems(theirs, surface_of(mine), f"{mine.__module__}.{name}") == []


@pytest.mark.parametrize("name", ALLOCATORS)
def test_every_attribute_an_engine_allocators_constructor_sets_is_set_on_hostpool_nbs(
    allocators: str, name: str
) -> None:
    public = {a for a in attributes_set_in_init(allocators, name) if not a.startswith("_")}
    assert {"size", "page_size", "dp_size", "size_per_rank", "free_group", "is_not_in_free_group"} <= public
    mine = _built(name, getattr(paged, name))
    assert sorted(a for a in public if not hasattr(mine, a)) == []


@pytest.mark.parametrize("name", HOST_POOLS)
def test_the_host_pools_have_what_the_mixin_takes_over_and_reads(host_pools: str, name: str) -> None:
    """The classes install() puts in place are the engine's own under HostKVPoolMixin: what it overrides of
    them takes the same parameters, and what it reads of them is there."""
    theirs = methods_of_source(host_pools, name)
    for method, value in vars(paged.HostKVPoolMixin).items():
        if method in theirs and callable(value) and method != "__init__":
            problems = theirs[method].problems(parameters_of(value))
            assert problems == [], f"{name}.{method}: {problems}"
    for need in next(t.needs for t in sgl_jax.TARGETS if t.attribute == name):
        assert need in theirs, f"{name}.{need} is missing"
    set_in_init = attributes_set_in_init(host_pools, name)
    assert {"_pool_size", "_lock", "_peak_used", "_exhaust_count"} <= set_in_init
    if name == "LRUHostKVPool":  # what the mixin keeps doing for each page freed
        assert {"_slots", "_allocated", "_generation", "_lock_ref"} <= set_in_init
        assert {"_drop_pending", "_require_allocated"} <= set(theirs)
    else:  # the PD metrics it keeps reporting
        assert "_pool_name" in set_in_init
        assert "_inc_alloc_metric" in theirs


def test_the_targets_are_classes_where_the_integration_looks(wheel: zipfile.ZipFile) -> None:
    for target in sgl_jax.TARGETS:
        tree = ast.parse(_source(wheel, target.module))
        assert target.attribute in {n.name for n in tree.body if isinstance(n, ast.ClassDef)}, target.where


def _imports_by_name(wheel: zipfile.ZipFile) -> dict[str, set[str]]:
    modules = {sgl_jax.ALLOCATORS, sgl_jax.HOST_POOLS}
    found: dict[str, set[str]] = {}
    for path in wheel.namelist():
        if not path.startswith("sgl_jax/srt/") or not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(wheel.read(path))):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                found.setdefault(path, set()).update(a.name for a in node.names)
    return found


@pytest.mark.skipif(sys.version_info < (3, 12), reason="sglang-jax's modules use Python 3.12 syntax")
def test_who_imports_the_replaced_classes_by_name_and_nothing_asks_isinstance_of_a_class_left_alone(
    wheel: zipfile.ZipFile,
) -> None:
    found = _imports_by_name(wheel)
    replaced = {t.attribute for t in sgl_jax.TARGETS}
    assert {path: names & replaced for path, names in found.items() if names & replaced} == IMPORTED_BY_NAME
    assert set().union(*found.values()) - replaced <= NOT_REPLACED
    left_alone = {"BaseTokenToKVPoolAllocator"}  # what hostpool_nb's classes do not derive from
    for path in wheel.namelist():
        if not path.startswith("sgl_jax/srt/") or not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(wheel.read(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("isinstance", "issubclass"):
                assert not (left_alone & {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}), (
                    f"{path}: {ast.unparse(node)}"
                )
