"""sglang's own ``LogicalHostPool``, read from the release the integration pins, against hostpool_nb's.

Runs when ``HOSTPOOL_NB_SGLANG_WHEEL`` names sglang's wheel (or a folder
holding it) for ``hostpool_nb.integrations.sglang.TESTED_VERSION``; CI
downloads it (``pip download --no-deps sglang==<pin>``). The source is read
with ``ast``, never imported: sglang need not be installed, nor run here.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

import hostpool_nb
from hostpool_nb.integrations._surface import (
    attributes_set_in_init,
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
