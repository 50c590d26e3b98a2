"""sglang's HiCache host pools through ``install()``: the stand-in engine's hierarchy, misuse, threads and fork.

The stand-in engine puts a fresh copy of ``hostpool_nb.originals.sglang_host``
at sglang's module paths; ``install()`` replaces the bookkeeping methods of
the three classes that define them, so every pool class sglang 0.5.23 has
keeps its books on hostpool_nb, and so does a subclass defined after the
call. (The state machine against the original bookkeeping is
``test_sglang_host_state_machine.py``; the checks against sglang's own
source, ``test_sglang_surface.py``.)
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402 - after the skip without torch

from hostpool_nb import (  # noqa: E402
    AlignmentError,
    HostKVAlignmentError,
    HostKVDoubleFreeError,
    HostKVSlotRangeError,
    HostPoolError,
    PartialPageError,
    SlotRangeError,
)
from hostpool_nb.integrations import IntegrationError, sglang, status  # noqa: E402
from hostpool_nb.integrations._sglang_host import KEY, HostKVBooks  # noqa: E402
from hostpool_nb.originals.engines import StandIn, stand_in_engine  # noqa: E402
from tests.conftest import loaded, run_child  # noqa: E402

pytestmark = pytest.mark.torch

BASE = "sglang.srt.mem_cache.pool_host.base"
MHA = "sglang.srt.mem_cache.pool_host.mha"

# Every class of sglang 0.5.23 that keeps host slots with one of the three bookkeepings, how to build a small
# one on the stand-in engine, and the bookkeeping it must end up with.
POOLS: dict[str, tuple[tuple[Any, ...], dict[str, Any], sglang.Bookkeeping]] = {
    "MHATokenToKVPoolHost": ((), {"page_size": 4, "host_token_capacity": 32}, sglang.HOST_KV_CACHE),
    "MHATokenToKOnlyPoolHost": ((), {"page_size": 4, "host_token_capacity": 32}, sglang.HOST_KV_CACHE),
    "HiSparseMHATokenToKVPoolHost": ((), {"page_size": 4, "host_token_capacity": 32}, sglang.HOST_KV_CACHE),
    "AsymmetricMHATokenToKVPoolHost": ((), {"page_size": 4, "host_token_capacity": 32}, sglang.HOST_KV_CACHE),
    "MLATokenToKVPoolHost": ((), {"page_size": 8, "dcp_size": 2, "host_token_capacity": 16}, sglang.HOST_KV_CACHE),
    "DSAIndexerPoolHost": ((), {"page_size": 1, "host_token_capacity": 32}, sglang.HOST_KV_CACHE),
    "MiniMaxM3Nvfp4IndexKPoolHost": ((), {"page_size": 4, "host_token_capacity": 32}, sglang.HOST_KV_CACHE),
    "MiniMaxM3Nvfp4MainKVPoolHost": ((), {"page_size": 4, "host_token_capacity": 32}, sglang.HOST_KV_CACHE),
    "MambaPoolHost": ((), {"host_token_capacity": 32}, sglang.MAMBA),
    "DeepSeekV4PagedHostPool": (("c4", 8, 4), {}, sglang.DEEPSEEK_V4_PAGED),
    "QSAIndexerPoolHost": (("qsa", 8, 4), {}, sglang.DEEPSEEK_V4_PAGED),
}


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv(sglang.DOUBLE_FREES, raising=False)
    monkeypatch.delenv("HOSTPOOL_NB_TRACK", raising=False)
    with stand_in_engine("sglang") as made:
        yield made


def build(engine: StandIn, name: str) -> Any:
    args, kwargs, _ = POOLS[name]
    return engine.build(name, *args, **kwargs)


def unit(pool: Any) -> int:
    return int(sglang.books(pool).page_size)


# -- install --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(POOLS))
def test_every_host_pool_class_keeps_its_books_on_hostpool_nb_after_install(engine: StandIn, name: str) -> None:
    sglang.install()
    pool = build(engine, name)
    kept = sglang.books(pool)
    assert isinstance(kept, HostKVBooks)
    assert kept.bookkeeping is POOLS[name][2]
    slots, page = kept.bookkeeping.geometry(pool)
    assert (kept.size, kept.page_size) == (slots, page)
    assert kept.lock is pool.lock  # the engine's own lock guards the books
    got = pool.alloc(2 * page)
    assert got.tolist() == list(range(2 * page))
    assert pool.free(got) == 2 * page
    assert pool.available_size() == slots
    assert not any(hasattr(pool, old) for old in ("free_slots", "release_slots", "slot_used"))
    kept.check_invariants()


def test_a_subclass_defined_after_install_keeps_its_books_on_hostpool_nb_too(engine: StandIn) -> None:
    sglang.install()
    base = sys.modules[BASE].HostKVCache

    class LaterPool(base):  # type: ignore[misc,valid-type]
        pass

    pool = LaterPool(page_size=2, host_token_capacity=8)
    assert isinstance(sglang.books(pool), HostKVBooks)
    with pytest.raises(HostKVDoubleFreeError):
        pool.free(torch.tensor([0, 1]))


def test_a_pool_built_before_install_keeps_the_original_bookkeeping(engine: StandIn) -> None:
    before = build(engine, "MHATokenToKVPoolHost")
    held = before.alloc(8)
    sglang.install()
    assert not hasattr(before, KEY)
    assert before.free(held) == 8
    before.clear()  # its own books still
    assert not hasattr(before, KEY)
    assert before.available_size() == 32
    with pytest.raises(HostPoolError, match="keeps its own books"):
        sglang.books(before)
    with pytest.raises(AssertionError, match="Double-free detected"):  # the original's, unchanged
        before.free(held)


def test_install_names_every_method_it_replaced_and_status_lists_them(engine: StandIn) -> None:
    replaced = sglang.install()
    methods = {f"{b.module}.{b.defined_by}.{m}" for b in sglang.BOOKKEEPINGS for m in b.methods}
    assert methods <= set(replaced)
    assert {r.where for r in status()} == set(replaced)
    base = sys.modules[BASE].HostKVCache
    assert replaced[f"{BASE}.HostKVCache.alloc"].__qualname__.endswith("alloc")
    assert vars(base)["alloc"] is not replaced[f"{BASE}.HostKVCache.alloc"]
    assert sglang.install() == replaced  # twice: the same, nothing changes
    assert vars(base)["alloc"] is next(r.replacement for r in status() if r.where == f"{BASE}.HostKVCache.alloc")


def test_each_pool_built_says_so_once(engine: StandIn, caplog: pytest.LogCaptureFixture) -> None:
    sglang.install()
    caplog.set_level(logging.INFO, logger="hostpool_nb")
    pool = build(engine, "MLATokenToKVPoolHost")
    pool.clear()  # a later clear() is not a new pool
    said = [r.getMessage() for r in caplog.records if r.name == "hostpool_nb"]
    assert [line.partition("; ")[0] for line in said] == [
        "hostpool_nb in use: sglang builds MLATokenToKVPoolHost on hostpool_nb (HostKVCache's bookkeeping): "
        "32 slots, page_size=8, tracking off"
    ]
    assert [loaded(line) for line in said] == [len(sglang.books(pool)._kernel_calls())]


def test_uninstall_puts_the_methods_back_and_hands_each_pool_its_lists(engine: StandIn) -> None:
    originals = {name: vars(sys.modules[BASE].HostKVCache)[name] for name in sglang.HOST_KV_CACHE.methods}
    replaced = sglang.install()
    mha, mamba, v4 = (build(engine, n) for n in ("MHATokenToKVPoolHost", "MambaPoolHost", "DeepSeekV4PagedHostPool"))
    for pool in (mha, mamba, v4):
        first, second = pool.alloc(2 * unit(pool)), pool.alloc(2 * unit(pool))
        pool.free(first)  # released, not merged: after the free list in allocation order
        pool.held = second
    # The free list first, then the pages released (not merged yet), as allocation takes them.
    expected = {id(p): [*range(4 * unit(p), sglang.books(p).size), *range(2 * unit(p))] for p in (mha, mamba, v4)}
    assert sglang.uninstall() == replaced
    assert {name: vars(sys.modules[BASE].HostKVCache)[name] for name in originals} == originals
    for pool, name in ((mha, "MHATokenToKVPoolHost"), (mamba, "MambaPoolHost"), (v4, "DeepSeekV4PagedHostPool")):
        plain = build(engine, name)  # built under the original methods: the attributes they keep
        assert set(vars(pool)) - {"held"} == set(vars(plain)), name
        if hasattr(plain, "mem_state"):
            assert torch.equal(pool.mem_state, plain.mem_state), name
    for pool in (mha, mamba, v4):
        assert not hasattr(pool, KEY)
        assert pool.free_slots.tolist() == expected[id(pool)]
        assert pool.available_size() == len(expected[id(pool)])
        assert pool.free(pool.held) == len(pool.held)  # the original methods, on the lists handed back
    assert mha.slot_used.sum().item() == 0
    with pytest.raises(AssertionError, match="Double-free detected"):  # the original's check, on its flags
        mha.free(mha.held)
    assert sglang.uninstall() == {}


def _churn(pool: Any, held: list[Any], errors: list[BaseException], calls: Any, stop: Any) -> None:
    """Allocate a page and free the oldest of nine, until told to stop: a scheduler's thread."""
    try:
        while not stop.is_set():
            got = pool.alloc(16)
            if got is not None:
                held.append(got)
            if len(held) > 8:
                pool.free(held.pop(0))
            calls.set()
    except BaseException as exc:  # noqa: BLE001 - the test reports it
        errors.append(exc)


def test_uninstall_under_a_live_recording_makes_no_trace_of_its_own(
    engine: StandIn, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """uninstall() handed each pool back through a copy whose unpickling was recorded: a trace per pool, unasked."""
    from hostpool_nb._diagnostics.live import flush_all

    monkeypatch.setenv("HOSTPOOL_NB_RECORD", str(tmp_path))
    caplog.set_level(logging.WARNING, logger="hostpool_nb")
    sglang.install()
    pool = build(engine, "MHATokenToKVPoolHost")
    pool.free(pool.alloc(8))
    assert len(list(tmp_path.iterdir())) == 1  # the pool's own trace
    said = len([r for r in caplog.records if "recording every call" in r.getMessage()])
    sglang.uninstall()
    flush_all()
    assert len(list(tmp_path.iterdir())) == 1
    assert len([r for r in caplog.records if "recording every call" in r.getMessage()]) == said
    assert pool.alloc(8) is not None  # the pool goes on under sglang's own methods


def test_uninstall_while_another_thread_allocates_hands_no_slot_out_twice(engine: StandIn) -> None:
    """A call in flight when uninstall() hands the books back runs on the lists handed back, never on stale books.

    Before: the methods read the books, then waited on the pool's lock that uninstall() held; an alloc then
    returned slots the handed-back free list still held, a free leaked pages into books nobody read.
    """
    for attempt in range(5):
        sglang.install()
        pool = engine.build("MHATokenToKVPoolHost", page_size=16, host_token_capacity=1 << 16)
        held: list[Any] = []
        errors: list[BaseException] = []
        calls, stop = threading.Event(), threading.Event()
        worker = threading.Thread(target=_churn, args=(pool, held, errors, calls, stop))
        worker.start()
        calls.wait(10)
        sglang.uninstall()  # while the worker allocates and frees
        time.sleep(0.05)  # and goes on, under the original methods
        stop.set()
        worker.join(10)
        assert not worker.is_alive()
        assert errors == [], f"attempt {attempt}: {errors!r}"  # a spurious double free, say
        assert not hasattr(pool, KEY)
        # Free: the free list and the slots released since, not merged yet (the original's two lists).
        listed = pool.free_slots.tolist() + [int(s) for got in pool.release_slots for s in got.tolist()]
        in_use = [int(s) for got in held for s in got.tolist()]
        assert len(set(listed)) == len(listed)  # no slot listed twice
        assert not set(listed) & set(in_use), f"attempt {attempt}: slots held and free at once"
        assert sorted(listed + in_use) == list(range(1 << 16))  # none lost either
        for got in held:  # and each held slot frees once, under the original's own checks
            pool.free(got)
        assert pool.available_size() == 1 << 16


def test_a_changed_method_is_refused_naming_it_and_nothing_is_replaced(engine: StandIn) -> None:
    mamba = sys.modules["sglang.srt.mem_cache.pool_host.mamba"].MambaPoolHost

    def alloc(self: Any, need_size: int, start_owner: int | None = None) -> Any:  # another release's parameters
        return None

    mamba.alloc = alloc
    before = dict(vars(sys.modules[BASE].HostKVCache))
    with pytest.raises(IntegrationError, match=r"MambaPoolHost\.alloc takes other parameters") as caught:
        sglang.install()
    assert caught.value.name == "sglang.srt.mem_cache.pool_host.mamba"
    assert dict(vars(sys.modules[BASE].HostKVCache)) == before
    assert status() == []


def test_a_replacement_taking_other_parameters_than_the_original_is_refused_before_anything_changes(
    engine: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hostpool_nb's own mistake (a replacement method with other parameters) is said, and nothing is replaced."""
    import dataclasses

    from hostpool_nb.integrations import _patch

    def wrong(cls: type, originals: dict[str, Any]) -> dict[str, Any]:
        def alloc(self: Any) -> Any:  # need_size missing
            return None

        return {**originals, "alloc": alloc}

    targets = tuple(
        dataclasses.replace(t, replacement=wrong)
        if isinstance(t, _patch.MethodsTarget) and t.attribute == "MambaPoolHost"
        else t
        for t in sglang.TARGETS
    )
    monkeypatch.setattr(sglang, "TARGETS", targets)
    before = dict(vars(sys.modules[BASE].HostKVCache))
    with pytest.raises(IntegrationError) as caught:
        sglang.install()
    said = str(caught.value)
    where = "sglang.srt.mem_cache.pool_host.mamba.MambaPoolHost.alloc"
    assert f"hostpool_nb's {where} does not take what the original does" in said
    assert said.endswith(". Nothing was replaced.")
    assert dict(vars(sys.modules[BASE].HostKVCache)) == before
    assert status() == []


def test_a_method_the_class_no_longer_defines_is_refused(engine: StandIn) -> None:
    del sys.modules["sglang.srt.mem_cache.memory_pool_host"].DeepSeekV4PagedHostPool.available_size
    with pytest.raises(IntegrationError, match=r"DeepSeekV4PagedHostPool\.available_size is not defined there"):
        sglang.install()
    assert status() == []


def test_a_missing_host_pool_class_is_refused(engine: StandIn) -> None:
    del sys.modules["sglang.srt.mem_cache.pool_host.mamba"].MambaPoolHost
    with pytest.raises(IntegrationError, match=r"pool_host\.mamba\.MambaPoolHost is missing"):
        sglang.install()
    assert status() == []


def test_tracking_and_its_diagnostics_work_on_an_engines_pool(engine: StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOSTPOOL_NB_TRACK", "1")
    sglang.install()
    pool = build(engine, "MHATokenToKVPoolHost")
    kept = sglang.books(pool)
    assert kept.track
    held = pool.alloc(8)
    pool.free(held)
    with pytest.raises(HostKVDoubleFreeError, match=r"Double-free detected: .*it was allocated at .*then freed at"):
        pool.free(held)
    pool.alloc(4)
    assert sum(o.slots for o in kept.outstanding()) == 4
    assert "test_sglang_host.py" in kept.leak_report()  # the call site that holds them


# -- double frees accepted, where the original accepts them ---------------------------------------


@pytest.mark.parametrize("name", ["MambaPoolHost", "DeepSeekV4PagedHostPool"])
def test_the_environment_makes_the_unchecked_pools_accept_double_frees(
    engine: StandIn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    monkeypatch.setenv(sglang.DOUBLE_FREES, "accept")
    sglang.install()
    pool, mha = build(engine, name), build(engine, "MHATokenToKVPoolHost")
    assert sglang.books(pool).accept_double_frees
    assert not sglang.books(mha).accept_double_frees
    u = unit(pool)
    held = pool.alloc(2 * u)
    assert pool.free(held) == 2 * u
    caplog.set_level(logging.WARNING, logger="hostpool_nb")
    other = pool.alloc(u)  # the first page again: held, and freed with the page that is free
    twice = torch.cat([other, held[u:]])
    assert pool.free(twice) == 2 * u  # what the original returns
    assert pool.available_size() == sglang.books(pool).size  # each page free once
    assert sum("accepted a double free" in r.getMessage() for r in caplog.records) == 1
    pool.free(held[u:])
    assert sum("accepted a double free" in r.getMessage() for r in caplog.records) == 1  # said once a pool
    with pytest.raises(HostKVSlotRangeError):  # a range error is never accepted
        pool.free(torch.arange(-u, 0))
    size = sglang.books(pool).size
    before = _words(pool)
    for past in (size, size + u, 2 * size):  # after a double free, past the end: still refused, nothing changed
        with pytest.raises(HostKVSlotRangeError, match=f"slot {past} at indices\\[{u}\\]"):
            pool.free(torch.cat([held[u:], torch.arange(past, past + u)]))
        assert np.array_equal(_words(pool), before)
    sglang.books(mha).check_invariants()
    with pytest.raises(HostKVDoubleFreeError):  # the base class's original refuses them: so does hostpool_nb
        mha.free(torch.arange(0, 4))


@pytest.mark.parametrize("name", ["DeepSeekV4PagedHostPool", "QSAIndexerPoolHost"])  # Mamba's pages are 1 slot
def test_only_double_frees_are_accepted_a_partial_page_beside_one_is_refused(
    engine: StandIn, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A misaligned run after a double-freed page was dropped silently; alone it is a PartialPageError."""
    monkeypatch.setenv(sglang.DOUBLE_FREES, "accept")
    sglang.install()
    pool = build(engine, name)
    u = unit(pool)
    held = pool.alloc(3 * u)
    pool.free(held[:u])  # the first page free: freeing it again is accepted
    before = _words(pool)
    misaligned = held[1 : u + 1]  # a page's worth, straddling the free first page and the second
    with pytest.raises(PartialPageError):
        pool.free(misaligned)
    with pytest.raises(PartialPageError):
        pool.free(torch.cat([held[:u], misaligned]))
    assert np.array_equal(_words(pool), before)  # refused before anything changed
    assert pool.free(torch.cat([held[:u], held[u:]])) == 3 * u  # the double free alone: accepted


def test_a_uint64_slot_past_int64_is_sglangs_index_error(engine: StandIn) -> None:
    sglang.install()
    pool = build(engine, "MHATokenToKVPoolHost")
    held = pool.alloc(4)
    for slots in (np.array([2**63, 1, 2, 3], dtype=np.uint64), np.array([2**64 - 1, 1, 2, 3], dtype=np.uint64)):
        with pytest.raises(HostKVSlotRangeError) as raised:
            pool.free(slots)
        assert isinstance(raised.value, IndexError)
        assert str(2**63) in str(raised.value) or str(2**64 - 1) in str(raised.value)
    assert pool.free(held) == 4  # nothing changed


@pytest.mark.parametrize(
    ("value", "accepts"),
    [
        ("accept", True),
        ("1", True),
        ("TRUE", True),
        (" on ", True),
        ("refuse", False),
        ("0", False),
        ("no", False),
        ("", False),
    ],
)
def test_the_double_free_setting_reads_the_words_tracking_reads(
    engine: StandIn, monkeypatch: pytest.MonkeyPatch, value: str, accepts: bool
) -> None:
    monkeypatch.setenv(sglang.DOUBLE_FREES, value)
    sglang.install()
    assert sglang.books(build(engine, "MambaPoolHost")).accept_double_frees is accepts
    assert not sglang.books(build(engine, "MHATokenToKVPoolHost")).accept_double_frees


@pytest.mark.parametrize("value", ["accpet", "2", "maybe"])
def test_a_double_free_setting_it_cannot_mean_is_refused_for_every_pool(
    engine: StandIn, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(sglang.DOUBLE_FREES, value)
    sglang.install()
    for name in ("MambaPoolHost", "MHATokenToKVPoolHost"):
        with pytest.raises(HostPoolError, match=f"{sglang.DOUBLE_FREES}={value!r}"):
            build(engine, name)


@pytest.mark.parametrize(("name", "accept"), [("DeepSeekV4PagedHostPool", True), ("MHATokenToKVPoolHost", False)])
def test_the_books_trace_replays_as_the_pool_they_are(
    engine: StandIn, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, name: str, accept: bool
) -> None:
    """A trace of sglang's books named them HostKVBooks, which replay and bench --trace refused (exit 2)."""
    from hostpool_nb import replay
    from hostpool_nb import trace as T

    monkeypatch.setenv(sglang.DOUBLE_FREES, "accept" if accept else "refuse")
    sglang.install()
    pool = build(engine, name)
    u = unit(pool)
    path = tmp_path / "books.trace"
    with sglang.books(pool).recording(path):
        for _ in range(40):
            held = pool.alloc(2 * u)
            pool.free(held)
            if accept:
                assert pool.free(held) == 2 * u  # accepted: recorded as served
            else:
                with pytest.raises(HostKVDoubleFreeError):
                    pool.free(held)
        with pytest.raises(HostKVSlotRangeError):
            pool.free(torch.arange(-u, 0))
    recorded = T.load(path)
    assert recorded.pool in T.HOST_KV_BOOKS
    assert recorded.strict is not accept
    errors = {op.error for op in recorded.operations} - {None}
    assert errors == ({"HostKVSlotRangeError"} if accept else {"HostKVSlotRangeError", "HostKVDoubleFreeError"})
    assert replay.replay(recorded) == (len(recorded.operations), 0, None)
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-m", "hostpool_nb.replay", str(path)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"all {len(recorded.operations)} operations match" in done.stdout


def test_a_subclass_of_the_pool_records_as_the_pool_it_derives_from(tmp_path: Any) -> None:
    from hostpool_nb import replay
    from hostpool_nb import trace as T
    from hostpool_nb.torch import LogicalHostPool as TorchPool

    class Mine(TorchPool):
        pass

    pool = Mine(64, 4)
    with pool.recording(tmp_path / "mine.trace"):
        pool.free(pool.alloc(8))
    recorded = T.load(tmp_path / "mine.trace")
    assert recorded.pool == "LogicalHostPool"
    assert replay.replay(recorded) == (2, 0, None)


def test_accepting_double_frees_is_refused_where_the_original_refuses_them(engine: StandIn) -> None:
    sglang.install()
    kept = sglang.books(build(engine, "MHATokenToKVPoolHost"))
    with pytest.raises(HostPoolError, match="HostKVCache's refuses them"):
        kept.accept_double_frees = True
    with pytest.raises(TypeError, match="must be a bool"):
        sglang.books(build(engine, "MambaPoolHost")).accept_double_frees = 1  # type: ignore[assignment]
    assert not kept.accept_double_frees


# -- the bad-input matrix: refused with both kinds of error, nothing changed --------------------


def _words(pool: Any) -> np.ndarray:
    return sglang.books(pool).backup_state()._words.copy()


BAD_FREES: list[tuple[str, Any, tuple[type[BaseException], ...]]] = [
    ("free page", lambda p, u, held: torch.arange(3 * u, 4 * u), (HostKVDoubleFreeError, AssertionError)),
    ("page twice", lambda p, u, held: torch.cat([held[:u], held[:u]]), (HostKVDoubleFreeError, AssertionError)),
    ("negative", lambda p, u, held: torch.arange(-u, 0), (HostKVSlotRangeError, IndexError)),
    ("past the end", lambda p, u, held: torch.arange(p, p + u), (HostKVSlotRangeError, IndexError)),
    ("huge", lambda p, u, held: torch.tensor([2**62] * u), (HostKVSlotRangeError, SlotRangeError)),
    ("2-D", lambda p, u, held: held[: 2 * u].reshape(2, u), (HostPoolError,)),
    ("float", lambda p, u, held: held[:u].float(), (TypeError,)),
    ("bool", lambda p, u, held: torch.ones(u, dtype=torch.bool), (TypeError,)),
    ("scalar", lambda p, u, held: held[0], (TypeError,)),
    ("list of str", lambda p, u, held: ["0"] * u, (TypeError,)),
    ("None", lambda p, u, held: None, (TypeError,)),
]
PARTIAL: list[tuple[str, Any, tuple[type[BaseException], ...]]] = [
    ("part of a page", lambda p, u, held: held[: u - 1], (AlignmentError,)),
    ("straddling", lambda p, u, held: held[1 : u + 1], (PartialPageError,)),
    ("descending", lambda p, u, held: held[:u].flip(0), (PartialPageError,)),
]


@pytest.mark.parametrize(
    "name", ["MHATokenToKVPoolHost", "MLATokenToKVPoolHost", "MambaPoolHost", "QSAIndexerPoolHost"]
)
@pytest.mark.parametrize(("case", "make", "errors"), [pytest.param(*c, id=c[0]) for c in BAD_FREES + PARTIAL])
def test_a_bad_free_is_refused_as_both_errors_and_changes_nothing(
    engine: StandIn, name: str, case: str, make: Any, errors: tuple[type[BaseException], ...]
) -> None:
    sglang.install()
    pool = build(engine, name)
    u = unit(pool)
    if case in {c[0] for c in PARTIAL} and u == 1:
        pytest.skip("page size 1: every slot is a whole page")
    held = pool.alloc(2 * u)  # pages 0 and 1; page 3 is free in every pool here
    before = _words(pool)
    bad = make(sglang.books(pool).size, u, held)
    with pytest.raises(errors[0]) as caught:
        pool.free(bad)
    assert all(isinstance(caught.value, e) for e in errors), type(caught.value).__mro__
    assert np.array_equal(_words(pool), before)
    assert pool.free(held) == 2 * u  # and the pool goes on


@pytest.mark.parametrize("name", ["MHATokenToKVPoolHost", "MambaPoolHost", "DeepSeekV4PagedHostPool"])
@pytest.mark.parametrize(
    ("need", "errors", "said"),
    [
        (3, (HostKVAlignmentError, AssertionError), "need_size=3"),
        (-4, (HostPoolError,), "need_size=-4"),
        (2.5, (TypeError,), "2.5"),
        (True, (TypeError,), "bool"),
        ("4", (TypeError,), "'4'"),
        (torch.tensor([4, 4]), (TypeError,), "need_size"),
    ],
    ids=["partial page", "negative", "float", "bool", "str", "1-D tensor"],
)
def test_a_bad_alloc_is_refused_and_changes_nothing(
    engine: StandIn, name: str, need: Any, errors: tuple[type, ...], said: str
) -> None:
    """The error names the caller's value (not one rounded up first), in every class."""
    if type(need) is int and need == 3 and name != "MHATokenToKVPoolHost":
        pytest.skip("a whole page there: Mamba's page is one slot, DeepSeek V4's alloc rounds up")
    sglang.install()
    pool = build(engine, name)
    before = _words(pool)
    with pytest.raises(errors[0]) as caught:
        pool.alloc(need)
    assert all(isinstance(caught.value, e) for e in errors)
    assert said in str(caught.value)
    assert np.array_equal(_words(pool), before)


def test_counts_may_be_0_d_tensors_and_numpy_integers_rounded_up_where_the_original_rounds(engine: StandIn) -> None:
    sglang.install()
    v4, mha = build(engine, "DeepSeekV4PagedHostPool"), build(engine, "MHATokenToKVPoolHost")
    assert v4.alloc(torch.tensor(5)).tolist() == list(range(8))
    assert v4.alloc(np.int32(1)).tolist() == list(range(8, 12))
    assert v4.alloc(0).tolist() == []
    assert v4.alloc(-3).tolist() == []  # rounded up to 0, as the original rounds it
    with pytest.raises(HostPoolError, match="must be non-negative"):
        v4.alloc(-4)
    assert mha.alloc(torch.tensor(8, dtype=torch.int16)).tolist() == list(range(8))
    assert v4.alloc(10**6) is None
    assert mha.alloc(10**6) is None


def test_a_device_tensor_and_any_integer_dtype_are_freed(engine: StandIn) -> None:
    sglang.install()
    pool = build(engine, "MHATokenToKVPoolHost")
    for dtype in (torch.int8, torch.int16, torch.int32, torch.uint8, torch.int64):
        held = pool.alloc(4)
        assert pool.free(held.to(dtype)) == 4
    held = pool.alloc(8)
    assert pool.free(held[::2].repeat_interleave(2).view(-1)[:0]) == 0  # empty
    assert pool.free(held.view(2, 4).t().contiguous().t().reshape(-1)) == 8  # a copy of a strided view


# -- threads ------------------------------------------------------------------------------------


def test_a_caller_holding_the_pools_lock_holds_its_books(engine: StandIn) -> None:
    sglang.install()
    pool = build(engine, "MHATokenToKVPoolHost")
    got: list[Any] = []
    with pool.lock:  # as sglang's controller holds it around several calls
        worker = threading.Thread(target=lambda: got.append(pool.alloc(4)))
        worker.start()
        worker.join(0.2)
        assert worker.is_alive()  # blocked until the lock is let go
        assert got == []
        first = pool.alloc(4)
    worker.join(10)
    assert first.tolist() == [0, 1, 2, 3]
    assert got[0].tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("name", ["MHATokenToKVPoolHost", "MambaPoolHost", "DeepSeekV4PagedHostPool"])
def test_threads_allocating_and_freeing_at_once_lose_nothing(engine: StandIn, name: str) -> None:
    sglang.install()
    pool = build(engine, name)
    u = unit(pool)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        held: list[Any] = []
        try:
            for _ in range(400):
                if held and rng.random() < 0.5:
                    pool.free(held.pop(int(rng.integers(len(held)))))
                else:
                    got = pool.alloc(u * int(rng.integers(1, 3)))
                    if got is not None:
                        held.append(got)
            for h in held:
                pool.free(h)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    sglang.books(pool).check_invariants()
    assert pool.available_size() == sglang.books(pool).size


# -- fork ---------------------------------------------------------------------------------------

_FORK_CHILD = """
import json, os, sys, threading, time
import torch
from hostpool_nb import PoolForkedError
from hostpool_nb.integrations import sglang
from hostpool_nb.originals.engines import stand_in_engine

with stand_in_engine("sglang") as engine:
    sglang.install()
    pool = engine.build("MHATokenToKVPoolHost", page_size=4, host_token_capacity=32)
    held = pool.alloc(8)
    busy = threading.Event()
    done = threading.Event()
    holder = None
    if json.loads(sys.argv[1])["busy"]:
        def hold():
            with pool.lock:  # another thread inside the pool while the process forks
                busy.set()
                done.wait(30)
        holder = threading.Thread(target=hold)
        holder.start()
        busy.wait(10)
    r, w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            got = pool.alloc(4).tolist()
        except PoolForkedError as exc:
            got = "PoolForkedError: " + str(exc)[:40]
        try:
            with pool.lock:  # the engine's own lock follows the books': unusable too
                engine_lock = "usable"
        except PoolForkedError:
            engine_lock = "PoolForkedError"
        os.write(w, json.dumps({"child": got, "engine_lock": engine_lock}).encode())
        os._exit(0)
    os.close(w)
    forked_in = time.monotonic() - start
    done.set()
    if holder is not None:
        holder.join()
    _, status = os.waitpid(pid, 0)
    child = json.loads(os.read(r, 4096).decode())
    parent = pool.alloc(4).tolist()
    pool.free(held)
    print(json.dumps({**child, "parent": parent, "status": status, "forked_in": forked_in}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("busy", [False, True])
def test_a_fork_gives_the_child_the_pool_or_says_it_cannot(busy: bool) -> None:
    got = run_child(_FORK_CHILD, {"busy": busy}, timeout=120)
    assert got["status"] == 0
    assert got["parent"] == [8, 9, 10, 11]
    assert got["forked_in"] < 10  # a busy pool delays the fork by about a second, never hangs it
    if busy:
        assert got["child"].startswith("PoolForkedError: ")
        assert got["engine_lock"] == "PoolForkedError"
    else:
        assert got["child"] == [8, 9, 10, 11]
        assert got["engine_lock"] == "usable"


def test_the_errors_are_exported_where_the_others_are() -> None:
    import hostpool_nb

    for cls in (HostKVAlignmentError, HostKVDoubleFreeError, HostKVSlotRangeError):
        assert getattr(hostpool_nb, cls.__name__) is cls
        assert cls.__module__ == "hostpool_nb"
