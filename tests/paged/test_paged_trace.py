"""Recordings of the paged allocators: ``allocator.recording(path)``, their traces, and replaying them.

What each call records (rank, arguments, result, error), the state a
recording begins from (free groups open, pages pending after another
rank's ``clear()``), restores of snapshots from before the recording,
calls whose arguments the record cannot hold, the divergence report,
damaged traces of allocators, ``python -m hostpool_nb.replay`` and
``--time`` on them. The differential
state machines (``test_paged_state_machine.py``) record stretches of their
runs and replay each on a fresh allocator and on the original.
"""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hostpool_nb import DoubleFreeError, HostPoolError, PagedOnlyError, SlotRangeError
from hostpool_nb import replay as R
from hostpool_nb import trace as T
from hostpool_nb._core.protocol import handed_off
from hostpool_nb.paged import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from tests.diagnostics.test_trace import arrays, rewrite, run_main


@pytest.fixture(autouse=True)
def short_traces_are_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests time traces of a few calls, to test how timing works: the minimum it asks for is lifted
    (its own tests set it back)."""
    monkeypatch.setattr(R, "MIN_TIMED", 1)


PROG = "python -m hostpool_nb.replay"


def ops_of(path: Path) -> list[tuple[Any, ...]]:
    """Each recorded operation as plain values: (name, rank, arg, result, batch, slots, error)."""
    rows = []
    for op in T.load(path).operations:
        batch = None if op.batch is None else [b.tolist() for b in op.batch]
        slots = None if op.slots is None else op.slots.tolist()
        rows.append((op.name, op.rank, op.arg, op.result, batch, slots, op.error))
    return rows


def paged_session(a: PagedTokenToKVPoolAllocator, path: Path) -> dict[str, Any]:
    """One call of every kind on a paged allocator of 2 ranks of 15 pages of 4 slots, with an error."""
    got: dict[str, Any] = {}
    with a.recording(path):
        got["extend"] = a.alloc_extend([0, 0], [6, 3], [-1, -1], 9, 1)
        got["decode"] = a.alloc_decode([7], [int(got["extend"][5])], 1)
        got["alloc"] = a.alloc(8)
        got["freed"] = a.free(got["alloc"][:4])
        a.free_group_begin()
        got["in group"] = a.free(got["extend"][:4], 1)
        a.free_group_end()
        a.merge_and_sort_free(0)
        with pytest.raises(HostPoolError, match="extend_num_tokens=5 is not the sum"):
            a.alloc_extend([0], [4], [-1], 5)
        state = a.backup_state()
        got["then"] = a.alloc(60, 1)
        a.restore_state(state)
        a.clear(0)
        a.clear()
    return got


def test_every_call_of_the_paged_allocator_is_recorded(tmp_path: Path) -> None:
    a = PagedTokenToKVPoolAllocator(128, 4, None, dp_size=2)
    got = paged_session(a, tmp_path / "t.npz")
    header = arrays(tmp_path / "t.npz")["header"][0]
    assert header.tolist() == (4, "PagedTokenToKVPoolAllocator", 128, 4, "sorted", False, 14, 39, 2, False, False, 0)
    extend, decode, alloc = got["extend"].tolist(), got["decode"].tolist(), got["alloc"].tolist()
    assert extend == [4, 5, 6, 7, 8, 9, 12, 13, 14]  # rank 1: pages 1, 2 for the first request, 3 for the second
    assert decode == [10]
    assert ops_of(tmp_path / "t.npz") == [
        ("alloc_extend", 1, 9, 9, [[0, 0], [6, 3], [-1, -1]], extend, None),
        ("alloc_decode", 1, 1, 1, [[7], [9]], decode, None),
        ("alloc", 0, 8, 8, None, alloc, None),
        ("free", 0, 4, 1, None, alloc[:4], None),
        ("free_group_begin", 0, 0, 0, None, None, None),
        ("free", 1, 4, 1, None, extend[:4], None),
        ("free_group_end", 0, 0, 0, None, None, None),
        ("merge_and_sort_free", 0, 0, 0, None, None, None),
        ("alloc_extend", 0, 5, 0, [[0], [4], [-1]], None, "HostPoolError"),
        ("backup", 0, 0, 0, None, None, None),
        ("alloc", 1, 60, -1, None, None, None),  # 15 pages: refused
        ("restore", 0, 0, 0, None, None, None),
        ("clear", 0, 0, 0, None, None, None),
        ("clear", -1, 0, 0, None, None, None),  # every rank
    ]
    assert R.replay(T.load(tmp_path / "t.npz")) == (14, 0, None)


def test_the_start_state_is_every_ranks_lists(tmp_path: Path) -> None:
    a = PagedTokenToKVPoolAllocator(64, 4, None, dp_size=2)  # 8 pages per rank, ids 1..8
    held = a.alloc(8, 1)
    assert held is not None
    a.free(held[:4], 1)  # page 1 of rank 1 released
    with a.recording(tmp_path / "t.npz"):
        pass
    start = arrays(tmp_path / "t.npz")["start"].tolist()
    assert start == [0, 8, 0, 0, *range(1, 9), 0, 6, 1, 0, *range(3, 9), 1]
    trace = T.load(tmp_path / "t.npz")
    assert [s.free.tolist() for s in trace.starts] == [list(range(1, 9)), list(range(3, 9))]
    assert [s.released.tolist() for s in trace.starts] == [[], [1]]


def test_the_token_allocators_calls_are_recorded_and_replay(tmp_path: Path, capsys: Any) -> None:
    a = TokenToKVPoolAllocator(16, None, dp_size=2)  # 8 slots per rank, 1..8
    with a.recording(tmp_path / "t.npz"):
        x = a.alloc(3, 1)
        assert x is not None
        a.free_group_begin()
        assert a.free(x[::-1], 1) == 3
        a.free_group_end()
        with pytest.raises(DoubleFreeError):
            a.free(x[:1], 1)
        assert a.alloc(9) is None
        a.clear(1)
    assert ops_of(tmp_path / "t.npz") == [
        ("alloc", 1, 3, 3, None, [1, 2, 3], None),
        ("free_group_begin", 0, 0, 0, None, None, None),
        ("free", 1, 3, 3, None, [3, 2, 1], None),
        ("free_group_end", 0, 0, 0, None, None, None),
        ("free", 1, 1, 0, None, [1], "DoubleFreeError"),
        ("alloc", 0, 9, -1, None, None, None),
        ("clear", 1, 0, 0, None, None, None),
    ]
    code, out, _ = run_main(tmp_path / "t.npz", capsys)
    assert (code, out) == (
        0,
        f"{tmp_path / 't.npz'}: TokenToKVPoolAllocator(size=16, page_size=1, dp_size=2, strict=False, "
        "debug_mode=False, track=False): all 7 operations match\n",
    )


def test_the_token_allocator_records_no_call_it_lacks(tmp_path: Path) -> None:
    a = TokenToKVPoolAllocator(16, None)
    with a.recording(tmp_path / "t.npz"):
        assert a._recording is not None
        with pytest.raises(PagedOnlyError):
            a.alloc_extend([0], [1], [-1], 1)  # a paged allocator's call: no record of a token allocator holds it
        a.merge_and_sort_free()  # nothing to merge here: no record either
        a.free(a.alloc(2))
    assert a._recording is None  # the recording is gone with the block
    assert [op.name for op in T.load(tmp_path / "t.npz").operations] == ["alloc", "free"]


# -- replay: every result, from the state the recording found ----------------------------------


@pytest.mark.parametrize("kind", ["paged", "paged strict", "paged debug", "token", "tracked"])
def test_a_recording_replays_on_a_fresh_allocator_and_on_the_original(kind: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    if kind == "token":
        a: Any = TokenToKVPoolAllocator(512, None, dp_size=2, track=False)
    else:
        a = PagedTokenToKVPoolAllocator(
            2048,
            4,
            None,
            debug_mode=kind == "paged debug",
            dp_size=2,
            strict=kind == "paged strict",
            track=kind == "tracked",
        )
    path = tmp_path / "t.npz"
    held: list[list[Any]] = [[], []]
    with a.recording(path):
        for step in range(400):
            r = int(rng.integers(0, 2))
            if kind != "token" and rng.random() < 0.4:
                n = int(rng.integers(1, 4))
                seq = rng.integers(1, 30, n)
                out = a.alloc_extend(np.zeros(n, np.int64), seq, np.full(n, -1), int(seq.sum()), r)
                if out is not None:
                    held[r].append(out)
            elif rng.random() < 0.5:
                out = a.alloc(int(rng.integers(0, 8)) * a.page_size, r)
                if out is not None:
                    held[r].append(out)
            elif held[r]:
                group = rng.random() < 0.3
                if group:
                    a.free_group_begin()
                a.free(held[r].pop(int(rng.integers(0, len(held[r])))), r)
                if group:
                    a.free_group_end()
            if step % 97 == 0:
                state = a.backup_state()
            if step % 131 == 130:
                a.restore_state(state)
                held = [[], []]  # what the callers held is the snapshot's business now; leaked, as a test may
    trace = T.load(path)
    assert len(trace) > 400
    assert R.replay(trace) == (len(trace), 0, None)
    timing = R.time_trace(trace, repeats=1)  # checks the original's every allocation first
    assert set(timing.per_op) == {"hostpool_nb", "numpy"}
    assert all(v > 0 for v in timing.per_op.values())


def pending_on_rank_0(a: PagedTokenToKVPoolAllocator) -> Any:
    """Rank 0 with page 1 pending in a group that a clear(1) ended: pending outside any group."""
    x = a.alloc(a.page_size)
    assert x is not None
    assert x.tolist()[0] == a.page_size
    a.free_group_begin()
    a.free(x)
    a.clear(1)
    assert a.is_not_in_free_group
    return x


@pytest.mark.parametrize("case", ["in a group", "pending outside a group", "pending and free"])
def test_a_recording_begun_with_frees_pending_replays(case: str, tmp_path: Path) -> None:
    a = PagedTokenToKVPoolAllocator(64, 4, None, dp_size=2)
    if case == "in a group":
        x = a.alloc(8)
        a.free_group_begin()
        a.free(x)
    else:
        x = pending_on_rank_0(a)
        if case == "pending and free":
            assert a.free(x) == 1  # a non-strict free outside the group frees it: free and still pending
    with a.recording(tmp_path / "t.npz"):
        a.free_group_end()
        assert a.alloc(16) is not None
        a.merge_and_sort_free()
        assert a.alloc(4) is not None
    trace = T.load(tmp_path / "t.npz")
    pages = sorted({int(s) // 4 for s in x.tolist()})
    assert trace.starts[0].pending.tolist() == pages  # the pending list is the pending pages, not the released
    assert trace.starts[0].released.tolist() == (pages if case == "pending and free" else [])
    assert trace.starts[0].group_depth == (case == "in a group")
    # The rebuilt allocator is in the group (or not) as the recorded one was when the recording began.
    assert R.fresh_pool(trace).is_not_in_free_group is (case != "in a group")
    assert R.replay(trace) == (4, 0, None)
    R.time_trace(trace, repeats=1)


def test_a_recording_begun_in_a_sliding_window_group_is_rebuilt_in_it(tmp_path: Path) -> None:
    kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    a = SWATokenToKVPoolAllocator(256, 128, kv, page_size=4)
    x = a.alloc(8)
    assert x is not None
    a.free_group_begin()  # an SWA allocator records from a group with nothing pending yet
    with a.recording(tmp_path / "t.npz"):
        a.free(x[:4])
        a.free(x[4:])
        a.free_group_end()
        assert a.alloc(8) is not None
    trace = T.load(tmp_path / "t.npz")
    rebuilt = R.fresh_pool(trace)
    assert not rebuilt.is_not_in_free_group
    assert R.replay(trace) == (4, 0, None)


def test_the_start_state_keeps_released_and_pending_apart(tmp_path: Path) -> None:
    """Two pages released, one pending: a start state with the two counts swapped would misplace them."""
    a = PagedTokenToKVPoolAllocator(64, 4, None)
    held = a.alloc(16)
    assert held is not None
    a.free(held[:8])  # pages 1 and 2: released
    a.free_group_begin()
    a.free(held[8:12])  # page 3: pending
    with a.recording(tmp_path / "t.npz"):
        a.free_group_end()
    (start,) = T.load(tmp_path / "t.npz").starts
    assert (start.released.tolist(), start.pending.tolist()) == ([1, 2], [3])


def test_a_restore_of_a_snapshot_from_before_the_recording_replays(tmp_path: Path) -> None:
    a = PagedTokenToKVPoolAllocator(64, 4, None, dp_size=2, track=True)
    before = a.backup_state()
    a.alloc(16, 1)
    with a.recording(tmp_path / "t.npz"):
        a.alloc(8)
        a.restore_state(before)
        assert a.alloc(32, 1).tolist()[0] == 4  # type: ignore[union-attr]  # rank 1 is whole again
    op = T.load(tmp_path / "t.npz").operations[1]
    assert (op.name, op.arg, op.replayable) == ("restore", -1, True)
    assert [s.free.tolist() for s in op.state] == [list(range(1, 9))] * 2  # type: ignore[union-attr]
    assert R.replay(T.load(tmp_path / "t.npz")) == (3, 0, None)


@pytest.mark.parametrize("kind", ["smaller allocator", "untracked snapshot", "smaller SWA side"])
def test_a_restore_the_allocator_refused_is_skipped_by_replay_not_applied(kind: str, tmp_path: Path) -> None:
    """Refused, it changed nothing: replay must not apply the lists the record holds and call it a divergence."""
    kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    if kind == "smaller SWA side":
        a: Any = SWATokenToKVPoolAllocator(64, 32, kv, page_size=4)
        state = SWATokenToKVPoolAllocator(64, 16, SimpleNamespace(full_kv_pool=None, swa_kv_pool=None), 4)
    else:
        a = PagedTokenToKVPoolAllocator(64, 4, None, track=kind == "untracked snapshot")
        state = PagedTokenToKVPoolAllocator(32 if kind == "smaller allocator" else 64, 4, None)
    snapshot = state.backup_state()
    with a.recording(tmp_path / "t.npz"):
        a.alloc(8)
        with pytest.raises(HostPoolError):
            a.restore_state(snapshot)
        a.alloc(8)
    trace = T.load(tmp_path / "t.npz")
    restore = trace.operations[1]
    assert (restore.name, restore.error, restore.replayable) == ("restore", "HostPoolError", False)
    assert R.replay(trace) == (2, 1, None)


def test_calls_the_record_cannot_hold_are_skipped(tmp_path: Path, capsys: Any) -> None:
    a = PagedTokenToKVPoolAllocator(64, 4, None, dp_size=2)
    with a.recording(tmp_path / "t.npz"):
        with pytest.raises(HostPoolError, match="dp_rank must be in"):
            a.alloc(4, 2)
        with pytest.raises(HostPoolError, match="must have the same length"):
            a.alloc_decode([1, 2], [0])
        with pytest.raises(TypeError):
            a.alloc_extend([0.5], [4], [-1], 4)
        a.restore_state(PagedTokenToKVPoolAllocator(64, 4, None, dp_size=2).backup_state())  # no error: replays
        assert a.alloc(4, 1) is not None
    trace = T.load(tmp_path / "t.npz")
    assert [op.replayable for op in trace.operations] == [False, False, False, True, True]
    assert [op.error for op in trace.operations] == ["HostPoolError", "HostPoolError", "TypeError", None, None]
    assert R.replay(trace) == (2, 3, None)
    code, out, _ = run_main(tmp_path / "t.npz", capsys)
    assert code == 0
    assert out.endswith(
        "all 2 operations match; 3 not replayable (what they were given is not in the record), skipped\n"
    )


def test_a_tracking_allocators_double_free_replays_without_its_sites(tmp_path: Path) -> None:
    a = PagedTokenToKVPoolAllocator(64, 4, None, strict=True, track=True)
    x = a.alloc(8)
    with a.recording(tmp_path / "t.npz"):
        a.free(x)
        with pytest.raises(DoubleFreeError) as info:
            a.free(x)
    assert "it was allocated at" in str(info.value)
    op = T.load(tmp_path / "t.npz").operations[1]
    assert op.message == str(info.value)
    assert R.replay(T.load(tmp_path / "t.npz")) == (2, 0, None)


def test_a_changed_decode_slot_is_the_first_divergence(tmp_path: Path, capsys: Any) -> None:
    a = PagedTokenToKVPoolAllocator(64, 4, None)
    with a.recording(tmp_path / "t.npz"):
        e = a.alloc_extend([0], [4], [-1], 4)
        a.alloc_decode([5], [int(e[-1])])  # type: ignore[index]  # served
    got = arrays(tmp_path / "t.npz")
    data = got["data"].copy()
    data[-1] += 1  # the decode's slot
    bad = rewrite(tmp_path / "t.npz", tmp_path / "bad.npz", data=data)
    code, out, _ = run_main(bad, capsys)
    assert code == 1
    assert "DIVERGES at operation 1 (alloc_decode): expected 1 slots [9], got 1 slots [8]" in out


def test_replay_time_times_the_allocator_against_the_original(tmp_path: Path, capsys: Any) -> None:
    a = PagedTokenToKVPoolAllocator(1024, 4, None)
    with a.recording(tmp_path / "t.npz"):
        for _ in range(20):
            e = a.alloc_extend([0, 0], [9, 3], [-1, -1], 12)
            a.free(e)
    code = R.main([str(tmp_path / "t.npz"), "--time", "--repeats", "2"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert lines[1].strip().startswith("hostpool_nb:")
    assert lines[2].strip().startswith("original on numpy:")
    assert re.search(r"x numpy \(repeats [0-9.,]+x-[0-9.,]+x\)$", lines[2])


# -- damaged traces of allocators --------------------------------------------------------------


def small_paged(path: Path) -> Path:
    a = PagedTokenToKVPoolAllocator(64, 4, None, dp_size=2)  # 8 pages per rank
    with a.recording(path):
        e = a.alloc_extend([0], [6], [-1], 6, 1)  # 0
        a.alloc_decode([7], [int(e[-1])], 1)  # type: ignore[index]  # 1
        a.clear()  # 2
    return path


def damaged_paged(good: Path, bad: Path, case: str) -> str:
    """Write a damaged copy of ``small_paged`` to ``bad``; return the TraceError's text after 'is damaged: '."""
    got = arrays(good)
    ops, data, start = got["ops"].copy(), got["data"].copy(), got["start"].copy()
    if case == "rank":
        ops["rank"][0] = 2
        rewrite(good, bad, ops=ops)
        return "operation 0 (alloc_extend) names rank 2, of dp_size=2"
    if case == "rank -1":
        ops["rank"][0] = -1
        rewrite(good, bad, ops=ops)
        return "operation 0 (alloc_extend) names rank -1, of dp_size=2"
    if case == "a call it lacks":
        ops["op"][2] = T.OPS.index("alloc_many")
        rewrite(good, bad, ops=ops)
        return "operation 2 is a call of alloc_many, which a PagedTokenToKVPoolAllocator does not have"
    if case == "requests":
        data[0] = 1000
        rewrite(good, bad, data=data)
        return "operation 0 (alloc_extend) points outside the data (0+3007)"
    if case == "negative requests":
        data[0] = -1
        rewrite(good, bad, data=data)
        return "operation 0 (alloc_extend) declares -1 requests"
    if case == "page 0":
        start[4] = 0
        rewrite(good, bad, start=start)
        return "its start state of rank 0 lists a page outside the rank's pages 1..8"
    if case == "a rank short":
        rewrite(good, bad, start=start[:14])
        return "its start array ends before the state of rank 1 (shape (14,))"
    if case == "numbers after":
        rewrite(good, bad, start=np.concatenate([start, [1]]))
        return "its start array holds 1 numbers after the last rank's state"
    if case == "groups disagree":
        start[0] = 1
        rewrite(good, bad, start=start)
        return "its start state's ranks disagree on whether a free group is open"
    if case == "nested groups":
        start[0] = start[12] = 2
        rewrite(good, bad, start=start)
        return "its start state of rank 0 is 2 free groups deep; an allocator's do not nest"
    if case == "ranks of a host pool":
        header = got["header"].copy()
        header["pool"] = "LogicalHostPool"
        rewrite(good, bad, header=header)
        return "it records a LogicalHostPool of dp_size=2; only the allocators have ranks"
    raise AssertionError(case)


PAGED_DAMAGE = [
    "rank",
    "rank -1",
    "a call it lacks",
    "requests",
    "negative requests",
    "page 0",
    "a rank short",
    "numbers after",
    "groups disagree",
    "nested groups",
    "ranks of a host pool",
]


@pytest.mark.parametrize("case", PAGED_DAMAGE)
def test_a_damaged_allocator_trace(case: str, tmp_path: Path, capsys: Any) -> None:
    good = small_paged(tmp_path / "good.npz")
    assert R.replay(T.load(good)) == (3, 0, None)
    bad = tmp_path / "bad.npz"
    text = f"{bad} is damaged: " + damaged_paged(good, bad, case)
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert str(info.value) == text
    code, out, err = run_main(bad, capsys)
    assert (code, out, err) == (2, "", f"{PROG}: error: {text}\n")


def test_a_start_state_no_allocator_can_be_in_is_exit_2(tmp_path: Path, capsys: Any) -> None:
    good = small_paged(tmp_path / "good.npz")
    start = arrays(good)["start"].copy()
    start[4:6] = [2, 1]  # rank 0's free list out of order: a paged allocator's is ascending
    bad = rewrite(good, tmp_path / "bad.npz", start=start)
    with pytest.raises(T.TraceError, match="start state is not one the recorded allocator can be in"):
        R.replay(T.load(bad))
    code, _, err = run_main(bad, capsys)
    assert code == 2
    assert err.count("\n") == 1


# -- what a recording changes: nothing -----------------------------------------------------------


def test_recordings_of_an_allocator_do_not_nest_and_leave_it_as_it_was(tmp_path: Path) -> None:
    a = PagedTokenToKVPoolAllocator(64, 4, None)
    with (
        a.recording(tmp_path / "a.npz"),
        pytest.raises(HostPoolError, match="recordings do not nest"),
        a.recording(tmp_path / "b.npz"),
    ):
        pass
    assert a._recording is None
    assert not (tmp_path / "b.npz").exists()
    with pytest.raises(SlotRangeError):
        a.free([0])  # the method, unwrapped, as before


def test_an_allocator_pickles_and_copies_while_recording(tmp_path: Path) -> None:
    a = PagedTokenToKVPoolAllocator(64, 4, None)
    with a.recording(tmp_path / "a.npz"):
        a.alloc(8)
        for b in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a)):
            assert b._recording is None  # the copy does not record into the file
            assert b.alloc(4).tolist() == [12, 13, 14, 15]  # type: ignore[union-attr]
    assert len(T.load(tmp_path / "a.npz")) == 1


# -- the sliding-window allocator: both sides and the mapping ----------------------------------------


def hybrid() -> Any:
    return SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)


def test_every_call_of_the_sliding_window_allocator_is_recorded(tmp_path: Path) -> None:
    a = SWATokenToKVPoolAllocator(64, 32, hybrid(), page_size=4, dp_size=2)  # per rank: 8 full, 4 SWA pages
    held = a.alloc(4, 1)
    assert held is not None
    with a.recording(tmp_path / "t.npz"):
        e = a.alloc_extend([0], [6], [-1], 6)
        d = a.alloc_decode([7], [int(e[-1])])  # type: ignore[index]  # served
        assert a.free_swa(e[:4]) == 4  # type: ignore[index]
        assert a.free(e) == 2  # type: ignore[arg-type]
        a.merge_and_sort_free(0)  # the pages just freed merged, on both sides
        a.clear()
    header = arrays(tmp_path / "t.npz")["header"][0].tolist()
    assert header == (4, "SWATokenToKVPoolAllocator", 64, 4, "sorted", False, 6, 23, 2, False, False, 32)
    assert (
        ops_of(tmp_path / "t.npz")
        == [
            ("alloc_extend", 0, 6, 6, [[0], [6], [-1]], e.tolist(), None),  # type: ignore[union-attr]
            ("alloc_decode", 0, 1, 1, [[7], [int(e[-1])]], d.tolist(), None),  # type: ignore[index,union-attr]
            ("free_swa", 0, 4, 4, None, e[:4].tolist(), None),  # type: ignore[index]
            ("free", 0, 6, 2, None, e.tolist(), None),  # type: ignore[union-attr]
            ("merge_and_sort_free", 0, 0, 0, None, None, None),
            ("clear", -1, 0, 0, None, None, None),
        ]
    )
    trace = T.load(tmp_path / "t.npz")
    assert [s.free.tolist() for s in trace.starts] == [list(range(1, 9)), list(range(2, 9))]  # type: ignore[union-attr]
    assert [s.free.tolist() for s in trace.swa_starts] == [[1, 2, 3, 4], [2, 3, 4]]  # type: ignore[union-attr]
    mapped = trace.mappings[1]  # type: ignore[index]
    assert mapped[held].tolist() == [4, 5, 6, 7]  # rank 1's request, mapped when the recording began
    assert R.replay(trace) == (6, 0, None)


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("track", [False, True])
def test_a_sliding_window_recording_replays_on_a_fresh_allocator_and_on_the_original(
    ps: int, track: bool, tmp_path: Path
) -> None:
    rng = np.random.default_rng(ps)
    # The SWA side as large as the full one: no batch is refused, which the original could not follow (below).
    a = SWATokenToKVPoolAllocator(512 * ps, 512 * ps, hybrid(), page_size=ps, dp_size=2, track=track)
    held: list[list[Any]] = [[], []]
    with a.recording(tmp_path / "t.npz"):
        for _ in range(400):
            r = int(rng.integers(0, 2))
            if ps > 1 and rng.random() < 0.3:
                n = int(rng.integers(1, 3))
                seq = rng.integers(1, 12, n)
                out = a.alloc_extend(np.zeros(n, np.int64), seq, np.full(n, -1), int(seq.sum()), r)
                if out is not None:
                    held[r].append(out)
            elif rng.random() < 0.5:
                out = a.alloc(int(rng.integers(1, 4)) * ps, r)
                if out is not None:
                    held[r].append(out)
            elif held[r]:
                slots = held[r].pop(int(rng.integers(0, len(held[r]))))
                if rng.random() < 0.4:
                    a.free_swa(slots[:1], r)
                group = rng.random() < 0.3
                if group:
                    a.free_group_begin()
                a.free(slots, r)
                if group:
                    a.free_group_end()
    trace = T.load(tmp_path / "t.npz")
    assert len(trace) > 300
    assert R.replay(trace) == (len(trace), 0, None)
    timing = R.time_trace(trace, repeats=1)  # the original's allocations checked first
    assert set(timing.per_op) == {"hostpool_nb", "numpy"}


def test_a_sliding_window_recording_cannot_begin_with_frees_pending(tmp_path: Path) -> None:
    a = SWATokenToKVPoolAllocator(64, 32, hybrid())
    x = a.alloc(4)
    a.free_group_begin()
    a.free(x)
    with pytest.raises(HostPoolError, match="records from a state with no frees pending in a free group"):
        a.recording(tmp_path / "t.npz").__enter__()
    assert list(tmp_path.iterdir()) == []  # no file, not even the temporary one
    assert not set(a._recorded) & set(vars(a))
    a.free_group_end()
    a.free_group_begin()  # a group with nothing pending yet: recordable
    with a.recording(tmp_path / "t.npz"):
        a.free(a.alloc(4))
        a.free_group_end()
    trace = T.load(tmp_path / "t.npz")
    assert trace.start is not None and trace.start.group_depth == 1  # noqa: PT018 - the group was open
    assert R.replay(trace) == (3, 0, None)


def test_a_sliding_window_trace_with_snapshots_replays_and_says_why_the_original_is_not_timed(tmp_path: Path) -> None:
    a = SWATokenToKVPoolAllocator(64, 32, hybrid(), page_size=4)
    with a.recording(tmp_path / "t.npz"):
        state = a.backup_state()
        a.alloc(8)
        a.restore_state(state)
        a.alloc(4)
    trace = T.load(tmp_path / "t.npz")
    assert R.replay(trace) == (4, 0, None)
    timing = R.time_trace(trace, repeats=1)
    assert set(timing.per_op) == {"hostpool_nb"}
    assert any("NotImplementedError" in note for note in timing.notes), timing.notes


@pytest.mark.parametrize(
    "case",
    [
        "mapping short",
        "mapping beyond int32",
        "mapping negative",
        "size_swa on a paged trace",
        "no size_swa",
        "SWA side cut short",
        "SWA side nested",
        "SWA side page outside",
    ],
)
def test_a_damaged_sliding_window_trace(case: str, tmp_path: Path) -> None:
    a = SWATokenToKVPoolAllocator(64, 32, hybrid(), page_size=4)
    with a.recording(tmp_path / "good.npz"):
        a.alloc(4)
    got = arrays(tmp_path / "good.npz")
    bad = tmp_path / "bad.npz"
    header = got["header"].copy()
    if case == "mapping short":
        rewrite(tmp_path / "good.npz", bad, start=got["start"][:-1])
        text = "its start state of rank 0 has no mapping of 68 int32 slots"
    elif case.startswith("mapping"):  # a mapping entry the int32 mapping cannot hold
        start = got["start"].copy()
        start[-1] = 2**31 if case == "mapping beyond int32" else -1
        rewrite(tmp_path / "good.npz", bad, start=start)
        text = "its start state of rank 0 has no mapping of 68 int32 slots"
    elif case.startswith("SWA side"):  # the rank's SWA state follows its full side's: read as that one is
        start = got["start"].copy()
        swa_at = 4 + int(start[1:4].sum())  # past the full side's counts and pages
        if case == "SWA side cut short":
            start = start[: swa_at + 2]
            text = f"its start array ends before the state of rank 0's SWA side (shape ({swa_at + 2},))"
        elif case == "SWA side nested":
            start[swa_at] = 2
            text = "its start state of rank 0's SWA side is 2 free groups deep; an allocator's do not nest"
        else:
            start[swa_at + 4] = 9  # the SWA side has 8 pages a rank (32 slots of 4)
            text = "its start state of rank 0's SWA side lists a page outside the rank's pages 1..8"
        rewrite(tmp_path / "good.npz", bad, start=start)
    elif case == "size_swa on a paged trace":
        header["pool"] = "PagedTokenToKVPoolAllocator"
        rewrite(tmp_path / "good.npz", bad, header=header)
        text = "it records a PagedTokenToKVPoolAllocator with size_swa=32"
    else:
        header["size_swa"] = 0
        rewrite(tmp_path / "good.npz", bad, header=header)
        text = "it records a SWATokenToKVPoolAllocator with size_swa=0"
    with pytest.raises(T.TraceError) as info:
        T.load(bad)
    assert str(info.value) == f"{bad} is damaged: {text}"


def test_a_batch_refused_on_a_sliding_window_trace_leaves_the_original_untimed(tmp_path: Path) -> None:
    a = SWATokenToKVPoolAllocator(64, 8, hybrid(), page_size=4)  # 16 full pages, 2 SWA pages
    with a.recording(tmp_path / "t.npz"):
        assert a.alloc_extend([0], [12], [-1], 12) is None  # the SWA side is short
        assert a.alloc(4) is not None
    trace = T.load(tmp_path / "t.npz")
    assert R.replay(trace) == (2, 0, None)
    timing = R.time_trace(trace, repeats=1)
    assert set(timing.per_op) == {"hostpool_nb"}
    assert any("operation 0 (alloc_extend) was refused" in note for note in timing.notes), timing.notes


def test_replay_bounds_the_memory_an_allocators_trace_would_build(tmp_path: Path, capsys: Any) -> None:
    a = PagedTokenToKVPoolAllocator(1 << 16, 16, None, dp_size=2, track=True)  # 2048 pages per rank
    s = SWATokenToKVPoolAllocator(1 << 16, 1 << 14, hybrid(), page_size=16, dp_size=2, track=True)
    for pool, name in ((a, "paged.npz"), (s, "swa.npz")):
        with pool.recording(tmp_path / name):
            pool.alloc(16)
    paged, swa = T.load(tmp_path / "paged.npz"), T.load(tmp_path / "swa.npz")
    need = R.pool_bytes(paged)
    assert need >= 2 * 2048 * (4 + 1 + 16)  # per rank and page: a ring entry, an owner byte, two tracking words
    assert R.pool_bytes(paged, with_original=True) >= need + 2 * 2048 * 4 * 2  # the original's int32 lists
    mappings = 2 * swa.mapping_length * 4
    swa_need = R.pool_bytes(swa)
    assert swa_need >= need + 2 * 512 * (4 + 1 + 16) + mappings  # the SWA side's 512 pages a rank, the mappings
    assert R.pool_bytes(swa, with_original=True) >= swa_need + mappings  # the original's mappings too
    code = R.main([str(tmp_path / "swa.npz"), "--max-pool-bytes", str(swa_need - 1)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"needs {swa_need:,} bytes to replay, more than the {swa_need - 1:,} allowed" in err
    assert R.main([str(tmp_path / "swa.npz"), "--max-pool-bytes", str(swa_need)]) == 0


@pytest.mark.parametrize("kind", ["host", "host tracked", "paged", "token", "swa"])
def test_calls_through_methods_bound_before_the_block_are_recorded(kind: str, tmp_path: Path) -> None:
    """Schedulers keep ``alloc, free = pool.alloc, pool.free``: those calls change the pool, so the trace has them."""
    from hostpool_nb import LogicalHostPool

    kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    pool: Any = {
        "host": lambda: LogicalHostPool(1024, 16),
        "host tracked": lambda: LogicalHostPool(1024, 16, track=True),
        "paged": lambda: PagedTokenToKVPoolAllocator(1024, 16, None),
        "token": lambda: TokenToKVPoolAllocator(64, None),
        "swa": lambda: SWATokenToKVPoolAllocator(256, 128, kv, page_size=16),
    }[kind]()
    alloc, free, clear, begin, end = pool.alloc, pool.free, pool.clear, pool.free_group_begin, pool.free_group_end
    backup, restore = pool.backup_state, pool.restore_state
    n = pool.page_size
    with pool.recording(tmp_path / "t.npz"):
        held = [alloc(n), alloc(2 * n), alloc(n)]
        free(held[0])
        free(np.asarray(held[1]).tolist())  # a list: the slow path
        state = backup()
        begin()
        free(held[2])
        end()
        restore(state)
        host = kind.startswith("host")
        if not host:
            pool.alloc_extend([0], [n + 1], [-1], n + 1) if kind != "token" else alloc(3)
        clear()
        alloc(n)
    trace = T.load(tmp_path / "t.npz")
    names = [op.name for op in trace.operations]
    group = ["free_group_begin", "free", "free_group_end"]
    assert names[:9] == ["alloc", "alloc", "alloc", "free", "free", "backup", *group]
    extra = [] if host else ["alloc" if kind == "token" else "alloc_extend"]
    assert names[9:] == ["restore", *extra, "clear", "alloc"]
    assert R.replay(trace) == (len(names), 0, None)


def test_a_recording_sees_other_threads_calls_through_bound_methods(tmp_path: Path) -> None:
    import threading

    a = PagedTokenToKVPoolAllocator(1 << 16, 16, None)
    alloc, free = a.alloc, a.free
    go, stop = threading.Event(), threading.Event()
    calls = [0]

    def worker() -> None:
        go.wait()
        while not stop.is_set():
            free(alloc(64))
            calls[0] += 2

    t = threading.Thread(target=worker)
    t.start()
    with a.recording(tmp_path / "t.npz"):
        go.set()
        while calls[0] < 200:
            pass
        stop.set()
        t.join(10)
    trace = T.load(tmp_path / "t.npz")
    assert len(trace) == calls[0]  # every call of the worker's, made while the block was open
    assert R.replay(trace) == (calls[0], 0, None)


def test_every_recorded_method_hands_its_calls_to_the_recording() -> None:
    """What a trace holds is what ``_recorded`` says: each of those methods looks for the recording first."""
    import inspect

    from hostpool_nb import LogicalHostPool
    from hostpool_nb._diagnostics.recording import _Calls, _RankedCalls

    kinds: list[Any] = [LogicalHostPool, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator, SWATokenToKVPoolAllocator]
    for cls in kinds:
        calls = _RankedCalls if hasattr(cls(*_args_of(cls)), "dp_size") else _Calls
        for name in cls._recorded:
            method = getattr(cls, name)
            # Written out (the hot paths), or handed_off's wrapper (its code object is every wrapper's).
            looks = "self._recording" in inspect.getsource(method) or method.__code__ is _HANDED_OFF
            assert looks, f"{cls.__name__}.{name} does not hand its calls to a recording"
            assert callable(getattr(calls, name, None)), f"a recording has no {name} for {cls.__name__}"


_HANDED_OFF = handed_off(lambda self: None).__code__


def _args_of(cls: type) -> tuple[Any, ...]:
    if cls is SWATokenToKVPoolAllocator:
        return (64, 32, SimpleNamespace(full_kv_pool=None, swa_kv_pool=None))
    if cls is PagedTokenToKVPoolAllocator:
        return (64, 4, None)
    if cls is TokenToKVPoolAllocator:
        return (64, None)
    return (64, 16)


def _warm_up_calls(a: Any, n: int = 60) -> None:
    """``2n`` calls that every implementation serves alike: a trace long enough to time."""
    for _ in range(n):
        a.free(a.alloc(a.page_size))


def test_time_says_where_the_original_fails_and_times_the_calls_before(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A valid SWA trace that reaches the padding page: the original trips its own assert at the free."""
    monkeypatch.setattr(R, "MIN_TIMED", 100)
    a = SWATokenToKVPoolAllocator(64, 64, hybrid(), page_size=4)
    with a.recording(tmp_path / "t.npz"):
        _warm_up_calls(a)
        full = a.alloc_extend([0], [3], [-1], 3)
        a.free_swa(full)  # all three left the window
        new = a.alloc_decode([4], [int(full[2])])  # continues page 1: its SWA slot is read from slot 0's page
        a.free(np.concatenate([full, new]))  # the original lists the padding page, and asserts
    trace = T.load(tmp_path / "t.npz")
    assert R.replay(trace) == (124, 0, None)
    assert R.main([str(tmp_path / "t.npz"), "--time", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("        hostpool_nb:")
    assert out[2].startswith("  original on numpy:")
    assert "  the original fails at operation 123 (free): AssertionError(" in out[4]
    assert out[4].endswith("; both are timed on the 123 operations before it")


def test_time_says_where_the_original_does_otherwise_and_times_the_calls_before(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A documented difference: a free in a group frees the pages allocated when it was made, the original's
    those allocated at the group's end (a page handed out again in between is freed under its new owner)."""
    monkeypatch.setattr(R, "MIN_TIMED", 100)
    a = PagedTokenToKVPoolAllocator(64, 4, None)
    with a.recording(tmp_path / "t.npz"):
        _warm_up_calls(a)
        a.merge_and_sort_free()  # every page free, in order
        a.free_group_begin()
        assert a.free([8]) == 0  # page 2 is free now: nothing to free (the original will free it at the end)
        held = a.alloc(8)  # pages 1 and 2: page 2 handed out again
        a.free_group_end()
        assert a.alloc(60) is None  # 14 pages free here; the original freed page 2 under its new owner
        a.free(held)
    trace = T.load(tmp_path / "t.npz")
    assert R.replay(trace) == (127, 0, None)
    assert R.main([str(tmp_path / "t.npz"), "--time", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("  original on numpy:")
    assert out[4].startswith("  the original diverges at operation 125 (alloc): expected None, got 60 slots")
    assert out[4].endswith("; both are timed on the 125 operations before it")


@pytest.mark.parametrize("state", ["paged", "str", "other dp_size"])
def test_a_recorded_sliding_window_restore_of_a_foreign_state_is_refused_as_without_the_recording(
    state: str, tmp_path: Path
) -> None:
    foreign: Any = {
        "paged": lambda: PagedTokenToKVPoolAllocator(64, 4, None).backup_state(),
        "str": lambda: "not a state",
        "other dp_size": lambda: SWATokenToKVPoolAllocator(64, 32, hybrid(), page_size=4, dp_size=2).backup_state(),
    }[state]()
    plain = SWATokenToKVPoolAllocator(64, 32, hybrid(), page_size=4)
    with pytest.raises((TypeError, HostPoolError)) as unrecorded:
        plain.restore_state(foreign)
    a = SWATokenToKVPoolAllocator(64, 32, hybrid(), page_size=4)
    with a.recording(tmp_path / "t.npz"):
        a.alloc(4)
        with pytest.raises(type(unrecorded.value)) as recorded:
            a.restore_state(foreign)
    assert str(recorded.value) == str(unrecorded.value)
    trace = T.load(tmp_path / "t.npz")
    assert [(op.name, op.replayable, op.error) for op in trace.operations] == [
        ("alloc", True, None),
        ("restore", False, type(unrecorded.value).__name__),
    ]
    assert R.replay(trace) == (1, 1, None)


def test_replay_compares_free_swas_count_with_the_record(tmp_path: Path) -> None:
    """A free_swa that returns another count than the recorded one is a divergence, as any call's result."""
    kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    a = SWATokenToKVPoolAllocator(256, 128, kv, page_size=1)
    path = tmp_path / "t.npz"
    with a.recording(path):
        x = a.alloc(6)
        assert x is not None
        assert a.free_swa(x[:4]) == 4
        assert a.free(x) == 6
    assert R.replay(T.load(path)) == (3, 0, None)
    ops = arrays(path)["ops"]
    (i,) = [k for k, op in enumerate(ops["op"]) if T.OPS[op] == "free_swa"]
    ops["result"][i] = 3
    changed = rewrite(path, tmp_path / "changed.npz", ops=ops)
    done, skipped, divergence = R.replay(T.load(changed))
    assert (done, skipped) == (i, 0)
    assert divergence is not None
    assert (divergence.index, divergence.name) == (i, "free_swa")
    assert "3" in divergence.expected
    assert "4" in divergence.got


@pytest.mark.parametrize("kind", ["paged", "token", "swa"])
def test_a_version_3_allocator_trace_is_read_and_replays(kind: str, tmp_path: Path) -> None:
    """Version 3 (the first to record allocators) stored every array as it is, its ops without a kind."""
    from tests.diagnostics.test_trace import as_version

    kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    a: Any = {
        "paged": lambda: PagedTokenToKVPoolAllocator(256, 4, None, dp_size=2),
        "token": lambda: TokenToKVPoolAllocator(64, None),
        "swa": lambda: SWATokenToKVPoolAllocator(256, 128, kv, page_size=4),
    }[kind]()
    held = a.alloc(8)
    a.free(held[:4])  # a start state with something released
    path = tmp_path / "t.npz"
    with a.recording(path):
        x = a.alloc_extend([0, 0], [5, 3], [-1, -1], 8) if kind != "token" else a.alloc(8)
        a.free_group_begin()
        a.free(x)
        a.free_group_end()
        with pytest.raises(HostPoolError):
            a.free(np.array([1 << 20]))  # out of range: refused, recorded with its error
    new = T.load(path)
    old = T.load(as_version(path, tmp_path / "v3.npz", 3))
    assert [op.name for op in old.operations] == [op.name for op in new.operations]
    assert [op.error for op in old.operations] == [op.error for op in new.operations]
    assert {op.kind for op in old.operations} == {"int64 array"}  # version 3 did not say: replayed as int64
    assert R.replay(old) == (len(new.operations), 0, None)
