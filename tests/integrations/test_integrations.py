"""hostpool_nb.integrations: install, uninstall and status on stand-in engines at the engines' module paths.

The stand-ins (``hostpool_nb.originals.engines``) hold the originals under
sglang's and sglang-jax's module paths, and one module of the engine that
imported them by name, as the engines' own modules do.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st_
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import hostpool_nb
from hostpool_nb import HostPagePool, paged
from hostpool_nb.integrations import IntegrationError, Replacement, sgl_jax, status
from hostpool_nb.integrations._surface import (
    Parameters,
    parameters_of,
    surface_of,
    surface_of_source,
    surface_problems,
)
from hostpool_nb.originals import host_tier
from hostpool_nb.originals import paged as original_paged
from hostpool_nb.originals.engines import ENGINES, StandIn, stand_in_engine
from tests.conftest import loaded

ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator", "SWATokenToKVPoolAllocator")
HOST_POOLS = ("LRUHostKVPool", "QueueHostKVPool")
RUNNER = "sgl_jax.srt.model_executor.model_runner"


class HybridKV:
    """What the SWA allocator is given: a hybrid pool with its two pools."""

    full_kv_pool = None
    swa_kv_pool = None


@pytest.fixture
def engine() -> Iterator[StandIn]:
    with stand_in_engine("sgl_jax") as made:
        yield made
    assert status() == []  # the stand-in's end uninstalls


def _originals() -> dict[str, type]:
    return {
        **{f"{sgl_jax.ALLOCATORS}.{n}": getattr(original_paged, n) for n in ALLOCATORS},
        **{f"{sgl_jax.HOST_POOLS}.{n}": getattr(host_tier, n) for n in HOST_POOLS},
        **{f"{RUNNER}.{n}": getattr(original_paged, n) for n in ALLOCATORS},
        **{f"{RUNNER}.{n}": getattr(host_tier, n) for n in HOST_POOLS},
    }


def _held(where: str) -> Any:
    module, _, attribute = where.rpartition(".")
    return getattr(sys.modules[module], attribute)


def test_install_replaces_every_class_and_every_import_by_name(engine: StandIn) -> None:
    replaced = sgl_jax.install()
    assert replaced == _originals()
    for where in replaced:
        mine = _held(where)
        assert mine.__module__ == "hostpool_nb.integrations.sgl_jax"
        assert mine is getattr(sgl_jax, where.rpartition(".")[2])
    for name in ALLOCATORS:
        assert issubclass(_held(f"{sgl_jax.ALLOCATORS}.{name}"), getattr(paged, name))
    for name in HOST_POOLS:
        cls = _held(f"{sgl_jax.HOST_POOLS}.{name}")
        assert issubclass(cls, paged.HostKVPoolMixin)
        assert issubclass(cls, getattr(host_tier, name))  # the engine's own class, its data plane kept
    assert sorted(str(r) for r in status()) == sorted(
        f"sgl_jax: {w} -> hostpool_nb.integrations.sgl_jax.{w.rpartition('.')[2]}" for w in replaced
    )


def test_each_pool_the_engine_builds_says_so_once(engine: StandIn, caplog: pytest.LogCaptureFixture) -> None:
    sgl_jax.install()
    caplog.set_level(logging.INFO, logger="hostpool_nb")
    built = [
        engine.build("PagedTokenToKVPoolAllocator", 1 << 12, 16, None, dp_size=2),
        engine.build("TokenToKVPoolAllocator", 1 << 10, None, track=True),
        engine.build("SWATokenToKVPoolAllocator", 1 << 12, 1 << 10, HybridKV(), 16),
        engine.build("LRUHostKVPool", 64),
        engine.build("QueueHostKVPool", 32),
    ]
    lines = [r.getMessage() for r in caplog.records if r.name == "hostpool_nb"]
    # Each pool loaded every kernel it may call while it was built, and says how many and how long it took.
    assert [loaded(line) for line in lines] == [len(pool._kernel_calls()) for pool in built]
    assert all(name in vars(table) for pool in built for table, name in pool._kernel_calls())
    assert [line.partition("; ")[0] for line in lines] == [
        "hostpool_nb in use: sgl_jax builds PagedTokenToKVPoolAllocator (hostpool_nb.paged): size=4096, "
        "page_size=16, dp_size=2, tracking off",
        "hostpool_nb in use: sgl_jax builds TokenToKVPoolAllocator (hostpool_nb.paged): size=1024, "
        "page_size=1, dp_size=1, tracking on",
        "hostpool_nb in use: sgl_jax builds SWATokenToKVPoolAllocator (hostpool_nb.paged): size=4096, "
        "size_swa=1024, page_size=16, dp_size=1, tracking off",
        "hostpool_nb in use: sgl_jax builds LRUHostKVPool on a HostPagePool (hostpool_nb): 64 pages, "
        "tracking off (generations catch stale frees)",
        "hostpool_nb in use: sgl_jax builds QueueHostKVPool on a HostPagePool (hostpool_nb): 32 pages, "
        "tracking off (generations catch stale frees)",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "hostpool_nb")
    # And they are hostpool_nb's pools, serving as the originals would.
    slots = built[0].alloc_extend([0], [20], [-1], 20)
    assert slots is not None
    assert slots.tolist() == list(range(16, 36))
    assert isinstance(built[3]._host_pages, HostPagePool)
    assert built[3].alloc(3).tolist() == [0, 1, 2]
    assert built[4].reserve() == 0


def test_installing_twice_changes_nothing(engine: StandIn) -> None:
    first = sgl_jax.install()
    held = {where: _held(where) for where in first}
    assert sgl_jax.install() == first
    assert {where: _held(where) for where in first} == held


def test_uninstall_puts_back_every_original(engine: StandIn) -> None:
    replaced = sgl_jax.install()
    assert sgl_jax.uninstall() == replaced
    for where, original in replaced.items():
        assert _held(where) is original
    assert status() == []
    assert sgl_jax.uninstall() == {}  # again: nothing to put back


def test_uninstall_leaves_what_someone_else_put_there(engine: StandIn) -> None:
    sgl_jax.install()
    theirs = type("Theirs", (), {})
    sys.modules[sgl_jax.ALLOCATORS].TokenToKVPoolAllocator = theirs
    restored = sgl_jax.uninstall()
    assert f"{sgl_jax.ALLOCATORS}.TokenToKVPoolAllocator" not in restored
    assert sys.modules[sgl_jax.ALLOCATORS].TokenToKVPoolAllocator is theirs
    assert len(restored) == len(_originals()) - 1


def test_a_module_imported_after_install_gets_hostpool_nbs_class(engine: StandIn) -> None:
    sgl_jax.install()
    late = types.ModuleType("sgl_jax.srt.late")
    exec("from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator", vars(late))
    assert late.PagedTokenToKVPoolAllocator is sgl_jax.PagedTokenToKVPoolAllocator


def test_install_rebinds_names_only_in_the_engines_own_package(
    engine: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package whose name only starts as the engine's (sgl_jax_extra) keeps what it imported, on every install."""
    original = sys.modules[sgl_jax.ALLOCATORS].PagedTokenToKVPoolAllocator
    inside, outside = types.ModuleType("sgl_jax.srt.by_name"), types.ModuleType("sgl_jax_extra")
    for module in (inside, outside):
        module.PagedTokenToKVPoolAllocator = original  # type: ignore[attr-defined]  # as `from ... import` leaves it
        monkeypatch.setitem(sys.modules, module.__name__, module)
    for _ in range(2):  # and again on a re-install
        sgl_jax.install()
        assert inside.PagedTokenToKVPoolAllocator is sgl_jax.PagedTokenToKVPoolAllocator  # type: ignore[attr-defined]
        assert outside.PagedTokenToKVPoolAllocator is original  # type: ignore[attr-defined]
        sgl_jax.uninstall()
        assert inside.PagedTokenToKVPoolAllocator is original  # type: ignore[attr-defined]


def test_an_allocator_built_through_the_integration_pickles(engine: StandIn) -> None:
    sgl_jax.install()
    made = engine.build("PagedTokenToKVPoolAllocator", 1 << 10, 16, None)
    made.alloc(32)
    copy = pickle.loads(pickle.dumps(made))
    assert type(copy) is sgl_jax.PagedTokenToKVPoolAllocator
    assert copy.available_size() == made.available_size()


def _nothing_replaced() -> None:
    for where, original in _originals().items():
        assert _held(where) is original, where
    assert status() == []


def test_a_missing_class_is_an_error_naming_it_and_nothing_is_replaced(engine: StandIn) -> None:
    del sys.modules[sgl_jax.ALLOCATORS].SWATokenToKVPoolAllocator
    with pytest.raises(IntegrationError, match=r"sgl_jax\.srt\.mem_cache\.allocator\.SWATokenToKVPoolAllocator is "):
        sgl_jax.install()
    for where, original in _originals().items():
        if not where.endswith(".allocator.SWATokenToKVPoolAllocator"):
            assert _held(where) is original
    assert status() == []


def test_a_name_that_is_not_a_class_is_an_error_saying_what_it_is(engine: StandIn) -> None:
    sys.modules[sgl_jax.ALLOCATORS].TokenToKVPoolAllocator = 3
    with pytest.raises(IntegrationError, match=r"TokenToKVPoolAllocator is a int, not a class; this version"):
        sgl_jax.install()
    assert status() == []


def test_a_class_lacking_much_names_the_first_five_differences(engine: StandIn) -> None:
    class Many(original_paged.TokenToKVPoolAllocator):
        def one(self) -> None: ...
        def two(self) -> None: ...
        def three(self) -> None: ...
        def four(self) -> None: ...
        def five(self) -> None: ...
        def six(self) -> None: ...

    sys.modules[sgl_jax.ALLOCATORS].TokenToKVPoolAllocator = Many
    with pytest.raises(IntegrationError) as raised:
        sgl_jax.install()
    message = str(raised.value)
    assert message.count(" is missing") == 5
    assert message.endswith("; .... Nothing was replaced.")
    del Many.six  # five differences: each named, nothing left to elide
    with pytest.raises(IntegrationError) as raised:
        sgl_jax.install()
    assert str(raised.value).count(" is missing") == 5
    assert str(raised.value).endswith("five is missing. Nothing was replaced.")


def test_the_stand_in_allocators_derive_from_the_engines_base_class_as_the_engines_do(engine: StandIn) -> None:
    base = sys.modules[sgl_jax.ALLOCATORS].BaseTokenToKVPoolAllocator
    assert base is original_paged.BaseTokenToKVPoolAllocator
    assert sys.modules[RUNNER].BaseTokenToKVPoolAllocator is base  # imported by name, as the engine's
    for name in ALLOCATORS:
        assert issubclass(getattr(original_paged, name), base)


def _built_alike(name: str, cls: type) -> Any:
    """An allocator of class ``name``'s kind built with the same arguments, stand-in or hostpool_nb's."""
    if name == "SWATokenToKVPoolAllocator":
        return cls(64, 32, HybridKV(), 4, 2)
    if name == "PagedTokenToKVPoolAllocator":
        return cls(64, 4, None, False, 2)
    return cls(64, None, 2)


@pytest.mark.parametrize("name", ALLOCATORS)
def test_every_public_attribute_of_a_stand_in_allocator_is_on_hostpool_nbs(name: str) -> None:
    """What install() cannot see on a class (what the constructor sets) checked on objects built alike."""
    theirs, mine = _built_alike(name, getattr(original_paged, name)), _built_alike(name, getattr(paged, name))
    public = {n for n in dir(theirs) if not n.startswith("_")}
    assert {"size", "page_size", "dp_size", "size_per_rank", "free_group", "is_not_in_free_group"} <= public
    assert sorted(public - set(dir(mine))) == []
    for attribute in ("size", "page_size", "dp_size", "size_per_rank", "is_not_in_free_group", "debug_print"):
        value = getattr(theirs, attribute)
        assert (value() if callable(value) else value) == (
            getattr(mine, attribute)() if callable(value) else getattr(mine, attribute)
        ), attribute
    for attribute in ("free_pages", "release_pages", "origin_size"):
        if getattr(theirs, attribute, None) is None:  # not the paged allocator's page lists: the same value
            assert getattr(mine, attribute, None) == getattr(theirs, attribute, None), attribute


@pytest.mark.parametrize("missing", ["debug_print", "merge_and_sort_free", "alloc_extend"])
def test_a_method_of_the_engines_base_class_missing_from_hostpool_nbs_is_refused(
    engine: StandIn, missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gap sglang-jax 0.1.0rc0 found in hostpool_nb, made again: the stand-in engine finds it too."""
    monkeypatch.delattr(paged.BaseTokenToKVPoolAllocator, missing)
    with pytest.raises(IntegrationError, match=rf"TokenToKVPoolAllocator\.{missing} is missing"):
        sgl_jax.install()
    _nothing_replaced()


def test_what_install_replaced_is_a_record_that_cannot_change(engine: StandIn) -> None:
    sgl_jax.install()
    first = status()[0]
    with pytest.raises(AttributeError):
        first.where = "elsewhere"  # type: ignore[misc]
    assert hash(first) == hash(status()[0])


def test_an_older_engine_whose_constructor_takes_a_dtype_is_refused(engine: StandIn) -> None:
    """sglang-jax 0.0.1.post1's allocators take ``(size, page_size, dtype, kvcache, debug_mode)``."""

    class Older(original_paged.PagedTokenToKVPoolAllocator):
        def __init__(self, size: int, page_size: int, dtype: Any, kvcache: Any, debug_mode: bool = False) -> None:
            super().__init__(size, page_size, kvcache, debug_mode)

    sys.modules[sgl_jax.ALLOCATORS].PagedTokenToKVPoolAllocator = Older
    with pytest.raises(IntegrationError, match=r"PagedTokenToKVPoolAllocator\.__init__: positional parameter 2 is"):
        sgl_jax.install()
    assert sys.modules[sgl_jax.ALLOCATORS].PagedTokenToKVPoolAllocator is Older
    assert sys.modules[sgl_jax.ALLOCATORS].TokenToKVPoolAllocator is original_paged.TokenToKVPoolAllocator
    assert status() == []


def test_a_host_class_without_what_the_mixin_needs_is_refused(engine: StandIn) -> None:
    bare = type("QueueHostKVPool", (), {"reserve": lambda self: 0, "available_size": lambda self: 0})
    sys.modules[sgl_jax.HOST_POOLS].QueueHostKVPool = bare
    with pytest.raises(IntegrationError, match=r"host_kv_pool\.QueueHostKVPool\.release is missing"):
        sgl_jax.install()
    assert status() == []
    assert sys.modules[sgl_jax.ALLOCATORS].TokenToKVPoolAllocator is original_paged.TokenToKVPoolAllocator


def test_an_engine_that_is_not_there_is_an_import_error_saying_so() -> None:
    assert "sgl_jax" not in sys.modules
    with pytest.raises(
        ImportError, match=r"sgl_jax is not importable here: import sgl_jax\.srt\.mem_cache\.allocator"
    ) as raised:
        sgl_jax.install()
    said = str(raised.value)
    assert f'(pip install --pre "sglang-jax[cpu]=={sgl_jax.TESTED_VERSION}", on Python 3.12 or later)' in said
    assert "stand_in_engine('sgl_jax')" in said
    assert issubclass(IntegrationError, ImportError)
    assert status() == []


def test_stand_in_engine_takes_only_the_engines_it_knows() -> None:
    for bad in ("sglang-jax", "", "torch"):
        with (
            pytest.raises(ValueError, match=r"engine must be one of \('sglang', 'sgl_jax'\), got engine="),
            stand_in_engine(bad),
        ):
            pass
    assert ENGINES == ("sglang", "sgl_jax")


def test_the_stand_ins_leave_sys_modules_as_they_found_it() -> None:
    before = {name for name in sys.modules if name.split(".")[0] in ENGINES}
    for name in ENGINES:
        with stand_in_engine(name):
            importlib.import_module(f"hostpool_nb.integrations.{name}")
            assert name in sys.modules
    assert {name for name in sys.modules if name.split(".")[0] in ENGINES} == before


def test_the_errors_and_records_are_public() -> None:
    assert IntegrationError.__module__ == "hostpool_nb.integrations"
    assert Replacement.__module__ == "hostpool_nb.integrations"


# -- sglang (hostpool_nb.torch, so torch) -----------------------------------------------------


@pytest.mark.torch
def test_sglang_builds_hostpool_nbs_torch_pool(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("torch")
    from hostpool_nb.integrations import sglang
    from hostpool_nb.torch import LogicalHostPool

    with stand_in_engine("sglang") as made:
        replaced = sglang.install()
        books = (*sglang.BOOKKEEPINGS, sglang.PAGE_INTERLEAVE, sglang.UNIFIED_ENVELOPE)
        methods = {f"{b.module}.{b.defined_by}.{m}" for b in books for m in b.methods}
        assert set(replaced) == {
            "sglang.srt.mem_cache.memory_pool_host.LogicalHostPool",
            "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.LogicalHostPool",
            *methods,
        }
        # HostKVCache's five, Mamba's four, DeepSeek V4 paged's four (it inherits _merge_release_slots), the
        # page-interleaved pool's four, the unified backing's ten
        assert len(methods) == 27
        caplog.set_level(logging.INFO, logger="hostpool_nb")
        pool = made.build("LogicalHostPool", 1024, 16, "layer_first")
        assert isinstance(pool, LogicalHostPool)
        assert pool.alloc(32).tolist() == list(range(32))
        said = [r.getMessage() for r in caplog.records if r.name == "hostpool_nb"]
        assert [line.partition("; ")[0] for line in said] == [
            "hostpool_nb in use: sglang builds LogicalHostPool (hostpool_nb.torch): size=1024, page_size=16, "
            "tracking off"
        ]
        assert [loaded(line) for line in said] == [len(pool._kernel_calls())]
        assert sglang.uninstall() == replaced
    assert status() == []


def test_sglang_without_torch_is_refused_before_anything_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    from hostpool_nb.integrations import sglang

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails, as where it is not installed
    monkeypatch.delitem(sys.modules, "hostpool_nb.torch", raising=False)
    monkeypatch.setattr(sglang, "_made", {})
    with stand_in_engine("sglang") as made:
        with pytest.raises(IntegrationError, match=r"installs hostpool_nb\.torch\.LogicalHostPool, which needs torch"):
            sglang.install()
        assert made.module.LogicalHostPool.__module__ == "hostpool_nb.originals.engines"
        assert status() == []


# -- the surface comparison ---------------------------------------------------------------------


def _params(positional: tuple[tuple[str, str], ...] = (), keyword_only: tuple[tuple[str, str], ...] = ()) -> Parameters:
    return Parameters(positional, keyword_only, var_positional=False, var_keyword=False)


@pytest.mark.parametrize(
    ("theirs", "mine", "problem"),
    [
        (_params((("n", "<required>"),)), _params((("n", "<required>"),), (("tag", "None"),)), None),
        (_params((("n", "<required>"),)), _params((("size", "<required>"),)), "positional parameter 0 is 'size'"),
        (_params((("n", "1"),)), _params((("n", "2"),)), "parameter 'n' defaults to 2, not 1"),
        (_params((("n", "1"),)), _params(), "positional parameter 0 (n) is missing"),
        (_params(), _params((("n", "<required>"),)), "positional parameter 'n' is required"),
        (_params((), (("k", "False"),)), _params(), "keyword-only parameter 'k' is missing"),
        (_params((), (("k", "False"),)), _params((("k", "False"),)), None),
        # A keyword's default changed either way (defaults compared as text: neither order may pass).
        (_params((), (("k", "1"),)), _params((), (("k", "0"),)), "parameter 'k' defaults to 0, not 1"),
        (_params((), (("k", "0"),)), _params((), (("k", "1"),)), "parameter 'k' defaults to 1, not 0"),
        (_params((), (("k", "0"),)), _params((("k", "1"),)), "parameter 'k' defaults to 1, not 0"),
        (_params(), _params((), (("k", "<required>"),)), "keyword-only parameter 'k' is required"),
        (Parameters((), (), True, False), _params(), "*args is not taken"),
        (Parameters((), (), False, True), _params(), "**kwargs is not taken"),
        (_params((("a", "<required>"),), (("k", "1"),)), Parameters((), (), True, True), None),
    ],
)
def test_parameters_are_compatible_when_every_call_still_is(
    theirs: Parameters, mine: Parameters, problem: str | None
) -> None:
    found = theirs.problems(mine)
    assert (found == []) if problem is None else any(problem in p for p in found), found


SOURCE = """
class Pool:
    shared = None
    flag: bool = False
    _private = 1

    def __init__(self, size: int, page_size: int, layout: str = "layer_first"):
        self.size = size

    def alloc(self, need_size: int):
        ...

    def hook(self, a, b, *, is_draft: bool = False):
        ...

    @property
    def shape(self):
        ...

    def _inner(self):
        ...
"""


class Pool:
    shared = None
    flag: bool = False
    _private = 1

    def __init__(self, size: int, page_size: int, layout: str = "layer_first") -> None:
        self.size = size

    def alloc(self, need_size: int) -> None: ...

    def hook(self, a: Any, b: Any, *, is_draft: bool = False) -> None: ...

    @property
    def shape(self) -> None: ...

    def _inner(self) -> None: ...


def test_a_class_read_from_source_has_the_surface_of_the_same_class_imported() -> None:
    assert surface_of_source(SOURCE, "Pool") == surface_of(Pool)
    assert set(surface_of(Pool)) == {"__init__", "alloc", "hook", "shape", "shared", "flag"}
    with pytest.raises(LookupError, match="no class Missing"):
        surface_of_source(SOURCE, "Missing")


def test_surface_problems_name_the_attribute() -> None:
    class Mine:
        shared = None

        def __init__(self, size: int, page_size: int, layout: str = "head_first") -> None: ...

        def alloc(self, need_size: int, *, tag: Any = None) -> None: ...

    found = surface_problems(surface_of(Pool), surface_of(Mine), "engine.Pool")
    assert sorted(found) == [
        "engine.Pool.__init__: parameter 'layout' defaults to 'head_first', not 'layer_first'",
        "engine.Pool.flag is missing",
        "engine.Pool.hook is missing",
        "engine.Pool.shape is missing",
    ]
    assert parameters_of(Mine.alloc).keyword_only == (("tag", "None"),)


@pytest.mark.parametrize("name", [*ALLOCATORS, "LogicalHostPool"])
def test_hostpool_nbs_classes_offer_the_originals_surface(name: str) -> None:
    """What install() checks, for every class it installs, against the stand-ins it is tested on."""
    from hostpool_nb.originals import engines

    theirs = getattr(original_paged, name, None) or engines.LogicalHostPool
    mine = getattr(paged, name, None) or hostpool_nb.LogicalHostPool
    assert surface_problems(surface_of(theirs), surface_of(mine), name) == []


# -- install and uninstall in any order, against a model ------------------------------------------


class Integrations(RuleBasedStateMachine):
    """install, uninstall, build and another patcher, in any order, on the stand-in sglang-jax."""

    def __init__(self) -> None:
        super().__init__()
        self._engine = stand_in_engine("sgl_jax")
        self.engine = self._engine.__enter__()
        self.installed = False
        self.overwritten: set[str] = set()  # attributes someone else set after install

    @rule()
    def install(self) -> None:
        replaced = sgl_jax.install()
        if self.overwritten:  # installed afresh over what is there now: the other library's classes
            for where in self.overwritten:
                assert replaced[where] is not getattr(original_paged, where.rpartition(".")[2])
            self.overwritten = set()
        self.installed = True
        assert set(replaced) == set(_originals())
        for where in replaced:
            assert _held(where).__module__ == "hostpool_nb.integrations.sgl_jax"

    @rule()
    def uninstall(self) -> None:
        restored = sgl_jax.uninstall()
        want = set(_originals()) - self.overwritten if self.installed else set()
        assert set(restored) == want
        self.installed = False
        self.overwritten = set()

    @rule(name=st_.sampled_from(ALLOCATORS))
    def overwrite(self, name: str) -> None:
        if not self.installed:
            return
        # Another library's patch over ours, as thorough: a class of its own, as able as the engine's,
        # in the defining module and where the engine imported it by name.
        theirs = type(name, (getattr(original_paged, name),), {})
        for module in (sgl_jax.ALLOCATORS, RUNNER):
            setattr(sys.modules[module], name, theirs)
            self.overwritten.add(f"{module}.{name}")

    @rule()
    def build(self) -> None:
        made = self.engine.build("TokenToKVPoolAllocator", 64, None)
        assert (type(made) is sgl_jax.TokenToKVPoolAllocator) == self.installed
        assert np.asarray(made.alloc(4)).tolist() == [1, 2, 3, 4]

    @invariant()
    def status_matches(self) -> None:
        if not hasattr(self, "engine"):
            return
        want = set(_originals()) - self.overwritten if self.installed else set()
        assert {r.where for r in status()} == want

    def teardown(self) -> None:
        self._engine.__exit__(None, None, None)


Integrations.TestCase.settings = settings(max_examples=40, stateful_step_count=12, deadline=None)
TestIntegrations = Integrations.TestCase


# -- spawned workers ------------------------------------------------------------------------------

_ON_DISK = {  # a stand-in sglang-jax on disk, for processes that import it themselves
    "sgl_jax/__init__.py": "",
    "sgl_jax/srt/__init__.py": "",
    "sgl_jax/srt/mem_cache/__init__.py": "",
    "sgl_jax/srt/mem_cache/allocator.py": "from hostpool_nb.originals.paged import *  # noqa: F403\n",
    "sgl_jax/srt/mem_cache/host_kv_pool.py": "from hostpool_nb.originals.host_tier import LRUHostKVPool, "
    "QueueHostKVPool\n",
    "sgl_jax/srt/model_executor/__init__.py": "",
    "sgl_jax/srt/model_executor/model_runner.py": (
        "from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator\n\n\n"
        "def run(queue):\n"
        "    made = PagedTokenToKVPoolAllocator(1 << 10, 16, None)\n"
        "    queue.put(type(made).__module__)\n"
    ),
}

LAUNCHER = """
import multiprocessing
from hostpool_nb.integrations import sgl_jax

sgl_jax.install()  # at the top level: a spawned worker imports this file again, and installs too

if __name__ == "__main__":
    from sgl_jax.srt.model_executor import model_runner

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    worker = context.Process(target=model_runner.run, args=(queue,))
    worker.start()
    print(queue.get(timeout=120))
    worker.join(120)
"""


@pytest.mark.slow
def test_a_spawned_worker_builds_hostpool_nbs_allocator_when_the_launcher_installs_at_top_level(
    tmp_path: Path,
) -> None:
    """sglang-jax starts its schedulers as spawned processes: the docs' launcher pattern reaches them."""
    for name, text in _ON_DISK.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "serve.py").write_text(LAUNCHER)
    root = Path(hostpool_nb.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    done = subprocess.run(
        [sys.executable, "serve.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "hostpool_nb.integrations.sgl_jax"


def test_install_refused_after_a_replacement_was_displaced_changes_nothing(engine: StandIn) -> None:
    """Another library put a class at one target that hostpool_nb cannot stand in for: the others stay."""
    sgl_jax.install()
    before = {where: _held(where) for where in _originals()}
    before_status = status()

    class Theirs(original_paged.TokenToKVPoolAllocator):
        def only_theirs(self) -> None: ...

    sys.modules[sgl_jax.ALLOCATORS].TokenToKVPoolAllocator = Theirs
    with pytest.raises(IntegrationError, match=r"TokenToKVPoolAllocator\.only_theirs is missing"):
        sgl_jax.install()
    after = {where: _held(where) for where in _originals()}
    assert after == {**before, f"{sgl_jax.ALLOCATORS}.TokenToKVPoolAllocator": Theirs}
    assert [r for r in before_status if r.where != f"{sgl_jax.ALLOCATORS}.TokenToKVPoolAllocator"] == status()


def test_the_attributes_an_init_sets_are_read_from_init_alone() -> None:
    from hostpool_nb.integrations._surface import attributes_set_in_init

    source = """
class Base:
    def __init__(self):
        self.inherited = 1

class Pool(Base):
    def __init__(self, size):
        super().__init__()
        self.size = size
        self.flag: bool = False
        self.count += 1
        if size:
            self.nested = [size]

    def alloc(self, n):
        self.not_in_init = n

    async def later(self):
        self.nor_here = 1
"""
    found = attributes_set_in_init(source, "Pool")
    assert {"size", "flag", "count", "nested"} <= found
    assert not {"not_in_init", "nor_here"} & found


# -- python -m hostpool_nb.serve ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["uvicorn.main"], "'uvicorn.main' is not a module of an engine hostpool_nb installs into (sgl_jax, sglang)"),
        (["sglang_router.launch_router"], "'sglang_router.launch_router' is not a module of an engine"),
        (["sglang.no_such_server", "--port", "1"], "no module named 'sglang.no_such_server' here"),
        ([".relative"], "'.relative' is not a module of an engine"),
    ],
)
def test_the_launcher_refuses_what_it_cannot_start_in_one_line(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hostpool_nb import serve

    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m hostpool_nb.serve: error: {said}")
    assert err.count("\n") == 1


def test_the_launcher_says_its_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from hostpool_nb import serve

    assert serve.main([]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m hostpool_nb.serve MODULE")
    assert serve.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m hostpool_nb.serve MODULE")


def test_the_launcher_installs_then_runs_the_module_as_main_with_its_arguments(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The server module runs as __main__, with its own arguments, after install(); the children are told how."""
    from hostpool_nb import serve

    package = tmp_path / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(
        "import sys\nimport sglang\nif __name__ == '__main__':\n    sglang.ran = (sys.argv[1:], sglang.installed)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    monkeypatch.delenv(serve.ENGINE_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    calls: list[str] = []

    def install(engine: str) -> None:
        import sglang

        sglang.installed = engine  # type: ignore[attr-defined]
        calls.append(engine)

    monkeypatch.setattr(serve, "_install", install)
    assert serve.main(["sglang.launch_server", "--model-path", "m", "--port", "30000"]) == 0
    import sglang

    assert sglang.ran == (["--model-path", "m", "--port", "30000"], "sglang")  # type: ignore[attr-defined]
    assert calls == ["sglang"]
    assert os.environ[serve.ENGINE_ENV] == "sglang"
    monkeypatch.delitem(sys.modules, "sglang")
