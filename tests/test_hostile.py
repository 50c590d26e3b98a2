"""Hostile callers on the surfaces beyond the core calls: tags, snapshots, pickles, traces, paged, fork.

Each test here is a defect that was found by trying to break the pool's
promise (misuse is a clear ``TypeError`` or ``HostPoolError`` raised before
anything changes; no call sequence corrupts a pool; a ``RuntimeError``
means a bug in the pool). Races and forks run in child processes with
timeouts, so a hang or a crash fails the test instead of the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hostpool_nb import DoubleFreeError, HostPoolError, LogicalHostPool, PoolState
from hostpool_nb import replay as R
from hostpool_nb import trace as T
from hostpool_nb._diagnostics import recording as REC
from hostpool_nb._diagnostics.tracking import Site
from hostpool_nb._kernels import layout as L
from hostpool_nb._kernels import pool as K
from hostpool_nb._kernels.jit import callable_from_python
from hostpool_nb.originals import paged as original_paged
from hostpool_nb.paged import PagedState, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from tests.conftest import JIT_DISABLED, run_child
from tests.paged_model import assert_unchanged as paged_unchanged
from tests.paged_model import capture as paged_capture


@pytest.fixture(autouse=True)
def short_traces_are_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests time traces of a few calls, to test how timing works: the minimum it asks for is lifted
    (its own tests set it back)."""
    monkeypatch.setattr(R, "MIN_TIMED", 1)


PS = 16


def page(p: int, ps: int = PS) -> np.ndarray:
    return np.arange(p * ps, (p + 1) * ps, dtype=np.int64)


# -- 1. restore_state racing a tracked alloc ------------------------------------------


class _SlowHash:
    """A tag whose hash waits until it is told to go on: the window before alloc takes the lock."""

    def __init__(self, entered: threading.Event, go: threading.Event) -> None:
        self.entered, self.go = entered, go

    def __hash__(self) -> int:
        self.entered.set()
        assert self.go.wait(10)
        return 7

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        return "slow"


def test_a_restore_while_a_tracked_alloc_reads_its_tag_keeps_the_alloc_site() -> None:
    pool = LogicalHostPool(8 * PS, PS, track=True)
    s0 = pool.backup_state()
    entered, go = threading.Event(), threading.Event()
    tag = _SlowHash(entered, go)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(pool.alloc(PS, tag=tag)))
    t.start()
    assert entered.wait(10)
    pool.restore_state(s0)  # while the alloc is between its tag and its lock
    go.set()
    t.join(10)
    assert len(got) == 1
    assert got[0] is not None
    (rec,) = pool.outstanding()
    assert rec.tag is tag
    assert rec.function == "<lambda>"
    assert rec.site != "<unknown>:0 in ?"
    pool.check_invariants()


@pytest.mark.slow
def test_allocating_while_another_thread_restores_never_raises() -> None:
    # Pages enough that one is not handed out again before the site table's next sweep.
    pool = LogicalHostPool((1 << 14) * PS, PS, track=True)
    s0 = pool.backup_state()
    errors: list[BaseException] = []
    stop = threading.Event()

    def churn() -> None:
        i = 0
        try:
            while not stop.is_set():
                held = pool.alloc(PS, tag=("req", i))
                if held is not None:
                    with contextlib.suppress(DoubleFreeError):  # a restore in between freed it: the caller's race
                        pool.free(held)
                i += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + (1.0 if JIT_DISABLED else 2.0)
    while time.monotonic() < deadline and not errors:
        time.sleep(0.005)  # long enough for the churn to grow the site table to a sweep
        pool.restore_state(s0)
    stop.set()
    for t in threads:
        t.join(10)
    assert errors == []
    pool.check_invariants()


# -- 2, 3. tags whose hash changes, whose repr raises, memoryviews ---------------------


@dataclasses.dataclass(unsafe_hash=True)
class _Request:
    rid: int
    done: bool = False


def test_a_tag_whose_hash_changes_after_the_call_never_breaks_the_pool() -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    for rid in range(3000):  # past the site table's first sweeps
        req = _Request(rid)
        held = pool.alloc(PS, tag=req)
        assert held is not None
        req.done = True  # its hash changes
        assert pool.free(held) == PS
    held_req = _Request(-1)
    kept = pool.alloc(2 * PS, tag=held_req)
    held_req.done = True
    assert kept is not None
    # From a new call site, and still freeable.
    extra = pool.alloc(PS)
    assert extra is not None
    assert pool.free(extra) == PS
    (rec,) = pool.outstanding()
    assert rec.tag is held_req
    assert rec.tag_repr == "_Request(rid=-1, done=False)"  # as it was at the call
    assert "_Request(rid=-1, done=False)" in pool.leak_report()
    assert pool.free(kept) == 2 * PS
    pool.check_invariants()
    assert len(pool._tracker.table()) < 2100  # swept: not one entry per request


class _ReprRaisesLater:
    """Hashable; its repr works until it is broken."""

    broken = False

    def __hash__(self) -> int:
        return 11

    def __repr__(self) -> str:
        if self.broken:
            raise ZeroDivisionError("repr broke")
        return "later"


def test_a_read_only_memoryview_is_a_usable_tag() -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    tag = memoryview(b"ab")
    assert pool.alloc(PS, tag=tag) is not None
    assert pool.outstanding()[0].tag is tag


def test_a_tag_whose_repr_breaks_later_never_reaches_an_error_path(tmp_path: Path, capsys: Any) -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    path = tmp_path / "t.npz"
    tag = _ReprRaisesLater()
    with pool.recording(path):
        held = pool.alloc(PS, tag=tag)
        kept = pool.alloc(PS, tag=tag)
        assert held is not None
        assert kept is not None
        tag.broken = True
        pool.free(held)
        with pytest.raises(DoubleFreeError) as info:
            pool.free(held)
    assert "with tag later (allocation #1)" in str(info.value)
    assert "later" in pool.leak_report().splitlines()[-1]
    assert R.main([str(path)]) == 0
    assert "all 4 operations match" in capsys.readouterr().out


# -- 4, 5, 6. snapshots and pickles that load and then fail ----------------------------

_COUNTERS = [
    (L.H_ALLOC_CALLS, "alloc_calls"),
    (L.H_MERGES, "merges"),
    (L.H_FREE_CALLS, "free_calls"),
    (L.H_CLEARS, "clears"),
    (L.H_GROUP_DEPTH, "group depth"),
    (L.H_PEAK, "peak_allocated_pages"),
]
_FULL = "counters at or beyond 4611686018427387904 (2**62), more than a pool's calls reach: "
_LIVE = "counters at or beyond 6917529027641081856 (3 * 2**61), which later calls could overflow: "


def _state_with(pool: LogicalHostPool, word: int, value: int) -> PoolState:
    state = pool.backup_state()
    words = state._words.copy()
    words[word] = value
    return PoolState(state.size, state.page_size, state.merge, words, state.sites)


def _grow(pool: LogicalHostPool, word: int) -> None:
    """An ordinary call that adds one to the counter ``word`` (the peak cannot pass the pages: none)."""
    if word in (L.H_ALLOC_CALLS, L.H_SEQ):
        pool.alloc(PS)
    elif word == L.H_MERGES:
        pool.free(pool.alloc(PS))
        assert pool.merge() == PS
    elif word == L.H_FREE_CALLS:
        pool.free(pool.alloc(PS))
    elif word == L.H_CLEARS:
        pool.clear()
    elif word == L.H_GROUP_DEPTH:
        pool.free_group_begin()


@pytest.mark.parametrize(
    ("word", "name", "track"),
    [*((w, name, track) for w, name in _COUNTERS for track in (False, True)), (L.H_SEQ, "allocation number", True)],
)
def test_a_counter_that_would_wrap_is_refused(word: int, name: str, track: bool, snapshot: Any, unchanged: Any) -> None:
    pool = LogicalHostPool(4 * PS, PS, track=track)
    assert pool.alloc(PS) is not None
    if word == L.H_GROUP_DEPTH:
        pool.free_group_begin()
    before = snapshot(pool)
    for value in (2**63 - 1, 2**62 + 1, 2**62):
        bad = _state_with(pool, word, value)
        with pytest.raises(HostPoolError) as info:
            pool.restore_state(bad)
        assert str(info.value) == f"the state fails the pool's invariants: {_FULL}{name}={value}"
        unchanged(pool, before)
        # And a pickle that holds it.
        saved = pool.__getstate__()
        saved["state"] = bad._words.copy()
        blank = LogicalHostPool.__new__(LogicalHostPool)
        with pytest.raises(HostPoolError) as info:
            blank.__setstate__(saved)
        assert str(info.value) == f"the pickled LogicalHostPool fails the pool's invariants: {_FULL}{name}={value}"
    # Just below the limit loads, and the next ordinary calls take it past the limit on a state that stays sound.
    pool.restore_state(_state_with(pool, word, 2**62 - 1))
    pool.check_invariants()
    for _ in range(2):
        _grow(pool, word)
        pool.check_invariants()
    assert int(pool._st[word]) >= 2**62 or word == L.H_PEAK


def test_check_invariants_checks_the_counters_too() -> None:
    pool = LogicalHostPool(4 * PS, PS)
    pool._st[L.H_MERGES] = 2**63 - 1
    with pytest.raises(RuntimeError) as info:
        pool.check_invariants()
    assert str(info.value) == f"LogicalHostPool state is corrupted: {_LIVE}merges={2**63 - 1}"


@pytest.mark.parametrize("word", ["generation", L.HP_ALLOC_CALLS, L.HP_FREE_CALLS])
def test_a_host_pool_loaded_just_below_the_limit_stays_sound_past_it(word: Any) -> None:
    from hostpool_nb import HostPagePool, HostPageState

    pool = HostPagePool(4)
    page = pool.alloc(1)
    assert page is not None
    pool.free(page)
    words = pool.backup_state()._words.copy()
    at = L.host_offsets(4)[1] + int(page[0]) if word == "generation" else word
    for value in (2**62, 2**62 + 1):
        words[at] = value
        with pytest.raises(HostPoolError, match=r"at or beyond 4611686018427387904 \(2\*\*62\)"):
            pool.restore_state(HostPageState(4, words))
    words[at] = 2**62 - 1
    pool.restore_state(HostPageState(4, words))
    for _ in range(4):  # hand every page out and back: the generation, the calls counted, past the limit
        pool.free(pool.alloc(4))
        pool.check_invariants()
    assert int(pool._st[at]) >= 2**62


def test_a_spare_header_word_is_refused() -> None:
    pool = LogicalHostPool(4 * PS, PS)
    with pytest.raises(HostPoolError) as info:
        pool.restore_state(_state_with(pool, L.HEADER - 1, 1))
    assert str(info.value) == f"the state fails the pool's invariants: spare header word {L.HEADER - 1} is not zero"


def _tracked_pool() -> tuple[LogicalHostPool, np.ndarray]:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    held = pool.alloc(2 * PS, tag="held")
    assert held is not None
    pool.free(held[PS:])
    return pool, held


@pytest.mark.parametrize(("half", "what"), [(32, "allocation"), (0, "free")])
def test_a_pickle_whose_site_ids_point_past_its_table_is_refused(half: int, what: str) -> None:
    pool, _ = _tracked_pool()
    saved = pool.__getstate__()
    words = saved["state"].copy()
    t, n = int(words[L.H_TRACK]), 4
    table = len(saved["sites"])
    word = int(words[t + n + 1])
    words[t + n + 1] = (word & ~(0xFFFFFFFF << half)) | (5000 << half)
    blank = LogicalHostPool.__new__(LogicalHostPool)
    with pytest.raises(HostPoolError) as info:
        blank.__setstate__({**saved, "state": words})
    assert str(info.value) == (
        f"the pickled LogicalHostPool fails the pool's invariants: page 1's {what} site id 5000 "
        f"is not in its site table of {table}"
    )
    # A swept (None) entry is not a site either.
    sites = list(saved["sites"])
    sid = int(saved["state"][t + n + 0] >> 32)
    sites[sid] = None
    with pytest.raises(HostPoolError) as info:
        blank.__setstate__({**saved, "sites": tuple(sites)})
    assert str(info.value) == (
        f"the pickled LogicalHostPool fails the pool's invariants: page 0's allocation site id {sid} "
        f"is not in its site table of {table}"
    )


def test_a_tracked_state_without_a_site_table_is_refused(snapshot: Any, unchanged: Any) -> None:
    pool, _ = _tracked_pool()
    state = pool.backup_state()
    other = LogicalHostPool(4 * PS, PS, track=True)
    assert other.alloc(PS, tag="other's") is not None
    before = snapshot(other)
    rows = [(r.site, r.tag) for r in other.outstanding()]
    with pytest.raises(HostPoolError) as info:
        other.restore_state(PoolState(state.size, state.page_size, state.merge, state._words, None))
    assert str(info.value) == "the state has no site table, but this pool tracks: its site ids would index nothing"
    unchanged(other, before)
    assert [(r.site, r.tag) for r in other.outstanding()] == rows


@pytest.mark.parametrize(
    ("sites", "message"),
    [
        pytest.param(("x", "y", "z"), "entry 0 is a str, not a Site", id="strings"),
        pytest.param([], "it is a list, not a tuple", id="list"),
        pytest.param((None, None), "entry 0 is a NoneType, not a Site", id="fixed-entries-missing"),
        pytest.param(
            (Site("a.py", 1, "f"), Site("<clear()>", 0, "clear")),
            "entry 0 is a.py:1 in f, expected <unknown>:0 in ?",
            id="fixed-entry-replaced",
        ),
    ],
)
def test_a_damaged_site_table_is_refused(sites: Any, message: str, snapshot: Any, unchanged: Any) -> None:
    pool, _ = _tracked_pool()
    state = pool.backup_state()
    before = snapshot(pool)
    with pytest.raises(HostPoolError) as info:
        pool.restore_state(PoolState(state.size, state.page_size, state.merge, state._words, sites))
    assert str(info.value) == f"the state has a damaged site table: {message}"
    unchanged(pool, before)


def test_an_untracked_state_with_a_site_table_is_refused() -> None:
    pool = LogicalHostPool(4 * PS, PS)
    state = pool.backup_state()
    sites = LogicalHostPool(4 * PS, PS, track=True).backup_state().sites
    with pytest.raises(HostPoolError) as info:
        pool.restore_state(PoolState(state.size, state.page_size, state.merge, state._words, sites))
    assert str(info.value) == "the state has a site table, but this pool does not track"


def test_a_tracking_snapshot_pickled_restores_its_sites_in_a_fresh_pool() -> None:
    pool, held = _tracked_pool()
    (want,) = [(r.site, r.tag, r.pages) for r in pool.outstanding()]
    state = pickle.loads(pickle.dumps(pool.backup_state()))
    fresh = LogicalHostPool(4 * PS, PS, track=True)
    assert fresh.alloc(3 * PS, tag="fresh") is not None
    fresh.restore_state(state)
    assert [(r.site, r.tag, r.pages) for r in fresh.outstanding()] == [want]
    with pytest.raises(DoubleFreeError) as info:
        fresh.free(held[PS:])
    assert f"allocated at {want[0]} with tag 'held' (allocation #1)" in str(info.value)
    fresh.check_invariants()


# -- 7, and the paged snapshot gaps ---------------------------------------------------------


def test_paged_restore_of_another_rank_count_changes_no_rank() -> None:
    a = PagedTokenToKVPoolAllocator(64, 4, None, dp_size=2)
    state = a.backup_state()
    assert a.alloc(8) is not None
    assert a.alloc(4, dp_rank=1) is not None
    before = paged_capture(a)
    for ranks in (state._ranks[:1], state._ranks * 2):
        with pytest.raises(HostPoolError) as info:
            a.restore_state(PagedState(state.kind, state.size, state.page_size, state.dp_size, ranks))
        assert str(info.value) == f"the state holds {len(ranks)} ranks; this allocator has dp_size=2"
        paged_unchanged(a, before)


def test_a_paged_pending_page_0_fails_check_invariants() -> None:

    a = PagedTokenToKVPoolAllocator(64, 4, None)
    a.free_group_begin()
    assert a.free(a.alloc(4)) == 1
    a.check_invariants()
    gp = a._gp[0]
    gp[L.GP_HEADER] = 0
    with pytest.raises(RuntimeError) as info:
        a.check_invariants()
    assert str(info.value) == "PagedTokenToKVPoolAllocator rank 0 is corrupted: a pending page id is out of range"


@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("call", ["extend", "decode"])
def test_pages_left_pending_by_another_ranks_clear_and_freed_again_leave_room_to_allocate(
    page_size: int, call: str
) -> None:
    # Found by the paged state machine under NUMBA_BOUNDSCHECK: a page can be
    # pending in a group that clear() of another rank ended and free as well
    # (a non-strict free outside the group frees it, as the original does), so
    # pending + free pages can outnumber the rank's pages; the ids taken for
    # an allocation were once staged after the pending ones and overflowed.
    made = [
        cls(8 * page_size, page_size, None, dp_size=2)
        for cls in (PagedTokenToKVPoolAllocator, original_paged.PagedTokenToKVPoolAllocator)
    ]
    for a in made:
        held = a.alloc(4 * page_size, dp_rank=1)
        a.free_group_begin()
        a.free(held, dp_rank=1)  # pending in the group
        a.clear(dp_rank=0)  # ends the group; rank 1's pages stay pending
        a.free(held, dp_rank=1)  # outside any group now: freed
    lib, ora = made
    lib.check_invariants()
    for a in made:
        a.free_group_begin()  # a group again: the pending pages are freed at its end
    if call == "extend":
        args = ([0, 0], [page_size + 1, 2 * page_size], [-1, -1], 3 * page_size + 1)
        got, want = (a.alloc_extend(*args[:3], args[3], dp_rank=1) for a in made)
    else:
        seq, last = [1, page_size + 1, 1], [-1, page_size - 1, -1]
        got, want = (a.alloc_decode(seq, last, dp_rank=1) for a in made)
    assert want is not None
    assert got is not None
    assert got.tolist() == want.tolist()
    lib.check_invariants()
    for a in made:
        a.free_group_end()
    assert lib.available_size(dp_rank=1) == ora.available_size(dp_rank=1)
    lib.check_invariants()


@pytest.mark.parametrize("kind", ["paged", "token"])
def test_a_paged_alloc_far_beyond_the_rank_is_none_at_once(kind: str) -> None:
    a: Any = PagedTokenToKVPoolAllocator(64, 4, None) if kind == "paged" else TokenToKVPoolAllocator(64, None)
    before = paged_capture(a)
    ps = 4 if kind == "paged" else 1
    started = time.perf_counter()
    assert a.alloc(2**40 * ps) is None
    assert time.perf_counter() - started < 5  # no 8 TiB np.empty first (generous: a noisy machine)
    after = paged_capture(a)
    assert after[1:] == before[1:]  # the lists and sizes; only the counters of the refusal may move


# -- 8. recording into a directory or "" -------------------------------------------------


@pytest.mark.parametrize("kind", ["directory", "empty"])
def test_recording_to_a_directory_fails_before_the_block(kind: str, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    pool = LogicalHostPool(64, 16)
    path: Any = tmp_path if kind == "directory" else ""
    ran = []
    with pytest.raises(HostPoolError) as info, pool.recording(path):
        ran.append(True)
    assert ran == []
    assert str(info.value) == f"cannot record to {str(path)!r}: it is a directory, not a file name"
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind
    assert pool._recording is None


def test_a_trace_that_cannot_be_written_keeps_the_blocks_own_error(tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "gone"
    folder.mkdir()
    pool = LogicalHostPool(64, 16)

    def record() -> None:
        with pool.recording(folder / "t.npz"):
            assert pool.alloc(16) is not None
            shutil.rmtree(folder)
            raise KeyError("the body's own")

    with pytest.raises(KeyError) as info:
        record()
    assert info.value.args == ("the body's own",)
    if sys.version_info >= (3, 11):
        (note,) = info.value.__notes__
        assert note.startswith(f"hostpool_nb: the trace {folder / 't.npz'} could not be written: ")
    assert pool._recording is None


# -- 9, 10. loading what is not a trace ----------------------------------------------------


def _good_trace(path: Path) -> Path:
    """A trace of two calls, as version 3 wrote it: its members' sizes and types are the archive's own checks."""
    pool = LogicalHostPool(64, 16)
    with pool.recording(path):
        held = pool.alloc(32)
        assert held is not None
        pool.free(held)
    arrays = T.arrays(path)
    arrays["header"]["version"] = 3
    ops = np.zeros(arrays["ops"].shape, dtype=T.OP_DTYPE_3)
    for name in T.OP_DTYPE_3.names or ():
        ops[name] = arrays["ops"][name]
    arrays["ops"] = ops
    T.write_arrays(path, arrays)
    return path


def _zip_of(path: Path, members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, raw in members.items():
            z.writestr(name, raw)
    return path


def _members(good: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(good) as z:
        return {name: z.read(name) for name in z.namelist()}


def _huge_data_member() -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False, "shape": (2**45,)})
    return buf.getvalue() + b"\0" * 64


def _not_a_trace(case: str, tmp_path: Path) -> tuple[Path, str]:
    good = _good_trace(tmp_path / "good.npz")
    if case == "directory":
        return tmp_path, f"{tmp_path} cannot be read as a trace: Is a directory"
    if case == "symlink-loop":
        loop = tmp_path / "loop"
        loop.symlink_to(loop)
        return loop, f"{loop} cannot be read as a trace: Too many levels of symbolic links"
    if case == "text-file":
        text = tmp_path / "README.md"
        text.write_text("# A project\n\nSome prose that numpy would try to unpickle.\n")
        return text, f"{text} is not a hostpool_nb trace (not a readable .npz archive: no zip signature)"
    if case == "declares-2**45-entries":
        bad = _zip_of(tmp_path / "huge.npz", {**_members(good), "data.npy": _huge_data_member()})
        assert bad.stat().st_size < 4096
        return bad, f"{bad} is damaged: its 'data' array declares {2**45} entries ({2**48} bytes) but holds 64 bytes"
    if case == "compressed":
        bad = _zip_of(tmp_path / "zipped.npz", _members(good), zipfile.ZIP_DEFLATED)
        return bad, f"{bad} is damaged: its 'header' array is compressed; a trace's arrays are stored uncompressed"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["directory", "symlink-loop", "text-file", "declares-2**45-entries", "compressed"])
def test_loading_what_is_not_a_trace_is_one_trace_error(case: str, tmp_path: Path, capsys: Any) -> None:
    path, message = _not_a_trace(case, tmp_path)
    with pytest.raises(T.TraceError) as info:
        T.load(path)
    assert str(info.value) == message
    assert "allow_pickle" not in message
    assert R.main([str(path)]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"python -m hostpool_nb.replay: error: {message}\n")


def test_a_compressed_member_is_never_inflated(tmp_path: Path) -> None:
    good = _good_trace(tmp_path / "good.npz")
    members = _members(good)
    members["data.npy"] = members["data.npy"][:128] + b"\0" * (64 << 20)  # 64 MiB that deflate to kilobytes
    bad = _zip_of(tmp_path / "bomb.npz", members, zipfile.ZIP_DEFLATED)
    assert bad.stat().st_size < 1 << 20
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert "is compressed" in str(info.value)


def _forged_zip(
    path: Path, members: dict[str, bytes], declare: dict[str, int], encrypted: tuple[str, ...] = ()
) -> Path:
    """A stored zip of ``members`` whose central directory declares the sizes in ``declare`` (zip64 where they need
    it) and flags the members in ``encrypted`` as encrypted: what the file says, not what it holds."""
    import struct
    import zlib

    local, central = bytearray(), bytearray()
    for name, raw in members.items():
        offset, crc, size, flags = len(local), zlib.crc32(raw), declare.get(name, len(raw)), 0
        flags = 1 if name in encrypted else 0
        fname = name.encode()
        local += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, flags, 0, 0, 0x21, crc, len(raw), len(raw), len(fname), 0)
        local += fname + raw
        extra = b""
        small = size
        if size >= 0xFFFFFFFF:  # zip64: both sizes in the extra field
            extra = struct.pack("<HHQQ", 0x0001, 16, size, size)
            small = 0xFFFFFFFF
        central += struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            45,
            45,
            flags,
            0,
            0,
            0x21,
            crc,
            small,
            small,
            len(fname),
            len(extra),
            0,
            0,
            0,
            0,
            offset,
        )
        central += fname + extra
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), len(local), 0)
    path.write_bytes(bytes(local + central + end))
    return path


def _declaring(rows: int) -> bytes:
    """An ``ops`` member whose .npy header declares ``rows`` records, and holds none."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": T.OP_DTYPE.descr, "fortran_order": False, "shape": (rows,)})
    return buf.getvalue()


def test_a_member_declaring_more_bytes_than_the_file_holds_is_refused_before_it_is_read(
    tmp_path: Path, capsys: Any
) -> None:
    members = _members(_good_trace(tmp_path / "good.npz"))
    rows = (64 << 30) // T.OP_DTYPE.itemsize  # 64 GiB of operations, as the header and the zip64 record both say
    members["ops.npy"] = _declaring(rows)
    declared = len(members["ops.npy"]) + rows * T.OP_DTYPE.itemsize
    bad = _forged_zip(tmp_path / "huge.npz", members, {"ops.npy": declared})
    assert bad.stat().st_size < 4096
    with pytest.raises(T.TraceError) as info:  # not a MemoryError: nothing that size is ever allocated
        T.load(bad)
    assert f"its 'ops' array declares {declared} bytes, but the file holds {bad.stat().st_size} bytes" in str(
        info.value
    )
    assert R.main([str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert "Traceback" not in err


def test_a_member_flagged_encrypted_is_a_trace_error(tmp_path: Path, capsys: Any) -> None:
    members = _members(_good_trace(tmp_path / "good.npz"))
    bad = _forged_zip(tmp_path / "locked.npz", members, {}, encrypted=("data.npy",))
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert (
        str(info.value) == f"{bad} is damaged: its 'data' array is encrypted; a trace's arrays are stored in the clear"
    )
    assert R.main([str(bad)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_member_holding_more_bytes_than_its_header_declares_is_refused(tmp_path: Path) -> None:
    members = _members(_good_trace(tmp_path / "good.npz"))
    members["data.npy"] += b"\0" * 8  # one more int64 than its .npy header says
    bad = _zip_of(tmp_path / "long.npz", members)
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert str(info.value) == f"{bad} is damaged: its 'data' array declares 64 entries (512 bytes) but holds 520 bytes"


def test_a_restore_of_a_snapshot_the_trace_never_took_is_damage(tmp_path: Path) -> None:
    pool = LogicalHostPool(64, 16)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        pool.restore_state(pool.backup_state())
    arrays = T.arrays(path)
    arrays["ops"]["arg"][1] = 3
    bad = tmp_path / "bad.npz"
    T.write_arrays(bad, arrays)
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert str(info.value) == f"{bad} is damaged: operation 1 (restore) names snapshot 3, of 1 taken before it"


# -- 11. two threads starting a recording of one pool ------------------------------------------


def test_two_threads_cannot_both_start_recording_one_pool(tmp_path: Path, monkeypatch: Any) -> None:
    slow_init = REC.Recorder.__init__

    def dawdle(self: Any, pool: Any) -> None:
        time.sleep(0.002)  # widens any gap between the nesting check and the install
        slow_init(self, pool)

    monkeypatch.setattr(REC.Recorder, "__init__", dawdle)
    for attempt in range(20):
        pool = LogicalHostPool(64, 16)
        barrier = threading.Barrier(2)
        tried = [threading.Event(), threading.Event()]
        started: list[int] = []
        refused: list[int] = []

        def record(  # this attempt's objects, bound as defaults
            k: int,
            pool: LogicalHostPool = pool,
            barrier: Any = barrier,
            tried: Any = tried,
            started: list[int] = started,
            refused: list[int] = refused,
            attempt: int = attempt,
        ) -> None:
            barrier.wait(10)
            try:
                with pool.recording(tmp_path / f"{attempt}-{k}.npz"):
                    started.append(k)
                    tried[k].set()
                    tried[1 - k].wait(10)  # stay recording until the other thread has tried
            except HostPoolError:
                refused.append(k)
                tried[k].set()

        threads = [threading.Thread(target=record, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert len(started) == 1, f"attempt {attempt}: {started} both recorded"
        assert len(refused) == 1
        assert pool._recording is None


# -- 12. replay of a tracking pool's never-allocated double free ----------------------------------


def test_replay_of_a_never_allocated_double_free_on_a_tracking_pool_matches(tmp_path: Path, capsys: Any) -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    path = tmp_path / "t.npz"
    with pool.recording(path), pytest.raises(DoubleFreeError) as info:
        pool.free(page(3))
    assert str(info.value).endswith("; it was never allocated by this pool")
    assert R.main([str(path)]) == 0
    assert "the one operation matches" in capsys.readouterr().out


def test_replay_reports_a_changed_merge_result(tmp_path: Path, capsys: Any) -> None:
    pool = LogicalHostPool(4 * PS, PS)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        held = pool.alloc(2 * PS)
        assert held is not None
        pool.free(held)
        assert pool.merge() == 2 * PS
    arrays = T.arrays(path)
    assert T.OPS[int(arrays["ops"]["op"][2])] == "merge"
    arrays["ops"]["result"][2] = PS
    bad = tmp_path / "bad.npz"
    T.write_arrays(bad, arrays)
    assert R.main([str(bad)]) == 1
    assert f"DIVERGES at operation 2 (merge): expected {PS}, got {2 * PS}" in capsys.readouterr().out


def test_an_alloc_beyond_int64_inside_a_recording_is_unreadable(tmp_path: Path, capsys: Any) -> None:
    pool = LogicalHostPool(4 * PS, PS)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        assert pool.alloc(2**63) is None
        assert pool.alloc(PS) is not None
    ops = T.load(path).operations
    assert [(op.name, op.unreadable, op.result) for op in ops] == [("alloc", True, -1), ("alloc", False, PS)]
    assert R.main([str(path)]) == 0
    assert "1 not replayable" in capsys.readouterr().out


# -- 13. timing a trace decides as the replay does --------------------------------------------


def test_timing_a_trace_skips_what_replay_skips(tmp_path: Path) -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    path = tmp_path / "t.npz"
    with pool.recording(path):
        with pytest.raises(TypeError):
            pool.alloc(PS, tag=[1])  # unhashable: recorded with its arg, but unreadable
        assert pool.alloc(PS) is not None
    trace = T.load(path)
    assert trace.operations[0].arg == PS
    assert [op.replayable for op in trace.operations] == [False, True]
    timing = R.time_trace(trace, repeats=1, with_torch=False)  # the benchmark's --trace times it this way
    assert set(timing.per_op) == {"hostpool_nb", "numpy"}
    assert timing.notes[0] == "1 operations replayed, 1 not replayable skipped"


# -- 14. paged free while a thread writes its array ----------------------------------------------

_PAGED_WRITER = textwrap.dedent(
    """
    import json, sys, threading, time
    import numpy as np
    from hostpool_nb.paged import PagedTokenToKVPoolAllocator
    from hostpool_nb import HostPoolError
    args = json.loads(sys.argv[1])
    a = PagedTokenToKVPoolAllocator(1 << 16, 4, None, strict=True)
    held = a.alloc(1 << 15)
    a.free(held[-4:])                      # that page is free now: freeing it again is a double free
    x = np.array(held, dtype=np.int64)     # the free fails at the freed page, after a long kernel run
    far = 10**12
    stop = threading.Event()
    def flip(value):                       # a call: the writer may give up the GIL with either value in place
        x[-4] = value
    def write():
        while not stop.is_set():
            flip(far); flip(held[-4])
    t = threading.Thread(target=write, daemon=True); t.start()
    errors = {}
    deadline = time.monotonic() + args["seconds"]
    while time.monotonic() < deadline:
        try:
            a.free(x)
        except HostPoolError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
    stop.set(); t.join()
    a.check_invariants()
    print(json.dumps({"errors": errors}))
    """
)


@pytest.mark.slow
def test_a_paged_free_racing_a_writer_raises_only_its_own_errors() -> None:
    got = run_child(_PAGED_WRITER, {"seconds": 2.0}, timeout=120)
    assert set(got["errors"]) <= {"DoubleFreeError", "SlotRangeError"}
    assert sum(got["errors"].values()) > 0


# -- 16. nested tensors ---------------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("call", ["free", "alloc_many"])
def test_a_nested_tensor_is_a_type_error(call: str, snapshot: Any, unchanged: Any) -> None:
    torch = pytest.importorskip("torch")
    import warnings

    from hostpool_nb.torch import LogicalHostPool as TorchPool

    pool = TorchPool(4 * PS, PS)
    held = pool.alloc(2 * PS)
    assert held is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that nested tensors are a prototype
        nested = torch.nested.nested_tensor([held[:PS], held[PS:]])
    before = snapshot(pool)
    name = "indices" if call == "free" else "sizes"
    with pytest.raises(TypeError) as info:
        getattr(pool, call)(nested)
    assert str(info.value) == (
        f"{name} must be a dense tensor, got a nested tensor; concatenate its components "
        "(torch.cat(list(t.unbind()))) first"
    )
    unchanged(pool, before)


# -- 17. fork while another thread is inside a pool call --------------------------------------------

_FORK = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time, warnings
    warnings.simplefilter("ignore")        # 3.12+: fork of a multi-threaded process warns
    import numpy as np
    from hostpool_nb import LogicalHostPool
    from hostpool_nb.paged import PagedTokenToKVPoolAllocator
    args = json.loads(sys.argv[1])
    pool = LogicalHostPool(1 << 20, 1)
    paged = PagedTokenToKVPoolAllocator(1 << 16, 4, None)
    stop = threading.Event()
    def busy():
        while not stop.is_set():
            s = pool.alloc(1 << 16); pool.free(s)
            p = paged.alloc(1 << 12); paged.free(p)
    t = threading.Thread(target=busy, daemon=True); t.start()
    time.sleep(0.1)
    results = []
    for _ in range(args["forks"]):
        pid = os.fork()
        if pid == 0:
            try:
                pool.check_invariants(); paged.check_invariants()
                s = pool.alloc(16); pool.free(s)
                p = paged.alloc(8); paged.free(p)
                pool.check_invariants(); paged.check_invariants()
                os._exit(0)
            except BaseException:
                os._exit(3)
        deadline = time.monotonic() + 20
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                results.append(os.waitstatus_to_exitcode(status))
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
                results.append("hang")
                break
            time.sleep(0.005)
    stop.set(); t.join()
    print(json.dumps({"results": results}))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no os.fork on this platform")
def test_a_fork_while_another_thread_uses_the_pool_gives_the_child_a_usable_pool() -> None:
    got = run_child(_FORK, {"forks": 10}, timeout=300)
    assert got["results"] == [0] * 10


# -- gaps that planted bugs went through ---------------------------------------------------------------


def test_a_sorted_free_list_of_two_pages_in_descending_order_fails_check_invariants() -> None:
    from tests.conftest import one_entry_per_page

    pool = LogicalHostPool(2 * PS, PS, merge="sorted")
    pool.check_invariants()
    ring = one_entry_per_page(pool._st)
    head = int(pool._st[L.H_HEAD])
    ring[head], ring[(head + 1) % 2] = 1, 0
    with pytest.raises(RuntimeError) as info:
        pool.check_invariants()
    assert str(info.value) == "LogicalHostPool state is corrupted: the free list of a sorted pool is not ascending"


_RING_END = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from hostpool_nb import LogicalHostPool
    from hostpool_nb._kernels import layout as L
    args = json.loads(sys.argv[1])
    ps, n, h = args["page_size"], args["pages"], args["head"]
    pool = LogicalHostPool(n * ps, ps)
    held = pool.alloc(n * ps)               # every page: the lists are empty
    pool._st[L.H_HEAD] = h                  # so the window may start anywhere: here, near the ring's end
    pool.check_invariants()
    pages = held.reshape(n, ps)
    # One call that stages from ring position h: a run (in order; its length entry
    # past the ring's end when h = n - 1), or lone pages (reversed) across the end.
    order = pages if args["in_order"] else pages[::-1]
    freed = np.concatenate([order[: n // 2], order[n // 2 :]]).reshape(-1)
    assert pool.free(freed) == n * ps
    pool.check_invariants()
    again = pool.alloc(n * ps)              # the next call reads what that one staged
    pool.check_invariants()
    print(json.dumps({"again": again.tolist()[:: ps], "expected": freed.tolist()[:: ps]}))
    """
)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("in_order", [True, False], ids=["a-run", "lone-pages"])
@pytest.mark.parametrize("back", [1, 2])
@pytest.mark.slow
def test_pages_freed_across_the_rings_end_come_back_in_order(page_size: int, in_order: bool, back: int) -> None:
    """A run whose length entry wraps to ring position 0, or lone pages across the end: FIFO, and sound."""
    long = int(callable_from_python(K.long_run)(page_size))
    pages = 4 * long
    got = run_child(
        _RING_END, {"page_size": page_size, "pages": pages, "head": pages - back, "in_order": in_order}, timeout=120
    )
    assert got["again"] == got["expected"]  # FIFO: the pages come back in the order they were freed
