"""Who holds each slot of the device tier: ``track=True`` on the paged and token allocators.

The case this is for (sglang-jax #982 and #994): at page size 1, two code
paths free the same decode slot, and all the scheduler said was a count,
"token_to_kv_pool_allocator memory leak detected!". Here the second free
is a ``DoubleFreeError`` naming the line that allocated the slot and the
line that freed it first; at the leak check, ``leak_report(exclude=...)``
names the pages nobody accounts for and who allocated them.

Every bad call here raises before anything changes: the lists, flags and
group buffers (``tests/paged_model.py``), the tracking words and the site
tables. The differential state machines (``test_paged_state_machine.py``)
check ``outstanding()`` against the oracle after every step.
"""

from __future__ import annotations

import copy
import inspect
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hostpool_nb import DoubleFreeError, HostPoolError, LogicalHostPool, SlotRangeError
from hostpool_nb._diagnostics.snapshot import FORMATS, _load_paged
from hostpool_nb._kernels import layout as L
from hostpool_nb.paged import PagedState, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from tests.paged_model import assert_unchanged, capture

HERE = __file__


def line_of(marker: str) -> int:
    """The line of this file holding ``marker`` (a comment at a call site), so no test hard-codes a number."""
    lines = inspect.getsource(inspect.getmodule(line_of)).splitlines()  # type: ignore[arg-type]
    found = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(f"# {marker}")]
    assert len(found) == 1, f"marker {marker!r} is on lines {found}"
    return found[0]


def capture_tracked(a: Any) -> tuple[Any, ...]:
    """``capture``, and every rank's tracking words and site table."""
    words = tuple(tuple(st[int(st[L.H_TRACK]) :].tolist()) for st in a._st)
    return capture(a), words, tuple(t.table() for t in a._trackers or ())


def check_error(a: Any, call: Callable[[Any], Any], error: type[BaseException], message: str) -> None:
    before = capture_tracked(a)
    with pytest.raises(error) as info:
        call(a)
    assert type(info.value) is error
    assert str(info.value) == message
    assert_unchanged(a, before[0])
    assert capture_tracked(a) == before


def paged(track: bool | None = True, **kw: Any) -> PagedTokenToKVPoolAllocator:
    """2 ranks of 8 pages of 4 slots; rank 0 holds two requests (pages 1-2 and 3), rank 1 nothing."""
    a = PagedTokenToKVPoolAllocator(2 * 8 * 4, 4, None, dp_size=2, track=track, **kw)
    assert a.alloc_extend([0, 0], [6, 3], [-1, -1], 9, tags=["req-a", "req-b"]).tolist() == [
        4, 5, 6, 7, 8, 9, 12, 13, 14,
    ]  # fmt: skip
    return a


# -- the sglang-jax case ------------------------------------------------------------------


def scheduler_frees_finished(alloc: Any, slots: Any) -> None:
    alloc.free(slots)  # first free


def overlap_path_frees_again(alloc: Any, slots: Any) -> None:
    alloc.free(slots)  # second free


@pytest.mark.parametrize("kind", ["token", "paged page size 1, strict"])
def test_two_code_paths_freeing_one_decode_slot_name_where_it_was_allocated_and_first_freed(kind: str) -> None:
    if kind == "token":
        a: Any = TokenToKVPoolAllocator(64, None, track=True)
        decode = a.alloc(4, tag="batch-3")  # token decode alloc
    else:
        a = PagedTokenToKVPoolAllocator(64, 1, None, strict=True, track=True)
        decode = a.alloc_decode([1, 1, 1, 1], [-1, -1, -1, -1], tags=["batch-3"] * 4)  # paged decode alloc
    scheduler_frees_finished(a, decode[2:3])
    before = capture_tracked(a)
    with pytest.raises(DoubleFreeError) as info:
        overlap_path_frees_again(a, decode[2:3])
    text = str(info.value)
    marker = "token decode alloc" if kind == "token" else "paged decode alloc"
    assert f"{HERE}:{line_of(marker)} in test_two_code_paths" in text
    assert "with tag 'batch-3'" in text
    assert f"then freed at {HERE}:{line_of('first free')} in scheduler_frees_finished" in text
    assert text.startswith(f"slot {int(decode[2])} of rank 0, freed at free_index[0] (flattened), is not allocated")
    assert capture_tracked(a) == before


def test_the_leak_check_names_the_pages_nobody_holds_and_who_allocated_them() -> None:
    a = TokenToKVPoolAllocator(64, None, track=True)
    running = a.alloc(6, tag="req-1")
    cached = a.alloc(3, tag="req-2")  # the radix cache keeps these
    lost = a.alloc(2, tag="req-3")  # leaked
    a.free(running[3:])
    held = np.concatenate([running[:3], cached])
    records = a.outstanding(exclude=held)
    assert [(o.tag, o.pages, o.line) for o in records] == [("req-3", 2, line_of("leaked"))]
    report = a.leak_report(exclude=held)
    assert report.startswith("TokenToKVPoolAllocator(size=64, page_size=1) rank 0: 2 pages (2 slots) allocated")
    assert f"'req-3'  {HERE}:{line_of('leaked')} in test_the_leak_check" in report
    assert {o.tag: o.pages for o in a.outstanding()} == {"req-1": 3, "req-2": 3, "req-3": 2}
    assert a.leak_report(exclude=np.concatenate([held, lost])).endswith("nothing is outstanding.")
    untracked = TokenToKVPoolAllocator(64, None, track=False)
    untracked.alloc(5)
    assert untracked.leak_report(exclude=[1, 2]) == (
        "TokenToKVPoolAllocator(size=64, page_size=1) rank 0: 3 pages (3 slots) allocated; the pool does not "
        "track where: construct it with track=True to see the call sites."
    )


def test_each_request_of_a_batch_is_an_allocation_with_its_tag() -> None:
    a = paged()
    got = a.alloc_decode([7, 4, 1], [9, 14, -1], tags=["req-a", "req-b", "req-c"])  # batch decode
    assert got.tolist() == [10, 15, 16]  # req-a and req-b continue their pages, req-c takes page 4
    records = {o.tag: o for o in a.outstanding()}
    assert {t: (o.pages, o.allocations) for t, o in records.items()} == {
        "req-a": (2, 1),
        "req-b": (1, 1),
        "req-c": (1, 1),
    }
    assert records["req-c"].line == line_of("batch decode")
    assert records["req-a"].oldest < records["req-b"].oldest < records["req-c"].oldest
    a.alloc_extend([0], [9], [-1], 9)  # no tags: one site, tag None, for the batch
    assert {o.tag: o.pages for o in a.outstanding()}[None] == 3
    assert a.outstanding(dp_rank=1) == []


def test_pages_pending_in_a_free_group_are_freed_already_and_not_outstanding() -> None:
    a = paged(strict=True)
    a.free_group_begin()
    a.free([4, 5], dp_rank=0)  # group free
    assert {o.tag: o.pages for o in a.outstanding()} == {"req-a": 1, "req-b": 1}
    a.free_group_end()
    assert {o.tag: o.pages for o in a.outstanding()} == {"req-a": 1, "req-b": 1}
    a.free_group_begin()
    with pytest.raises(DoubleFreeError) as info:
        a.free([4])
    assert f"then freed at {HERE}:{line_of('group free')} in test_pages_pending" in str(info.value)


@pytest.mark.parametrize("size", [16, 100, 1000])  # the tracking words' offsets fall differently on each
def test_clear_keeps_where_each_page_was_allocated(size: int) -> None:
    a = TokenToKVPoolAllocator(size, None, track=True)

    def even() -> Any:
        return a.alloc(1)

    def odd() -> Any:
        return a.alloc(1)

    got = [(even if i % 2 == 0 else odd)() for i in range(12)]
    a.clear()
    for i, slot in enumerate(got):
        with pytest.raises(DoubleFreeError) as info:
            a.free(slot)
        site = "even" if i % 2 == 0 else "odd"
        assert str(info.value).endswith(f"in {site} (allocation #{i + 1}), then freed by clear()"), (i, info.value)


def test_a_page_freed_by_clear_says_so() -> None:
    a = TokenToKVPoolAllocator(16, None, track=True)
    a.alloc(3)
    a.clear()
    with pytest.raises(DoubleFreeError) as info:
        a.free([2])
    assert str(info.value).endswith(", then freed by clear()")
    with pytest.raises(DoubleFreeError) as info:
        a.free([9])
    assert str(info.value).endswith("; it was never allocated by this pool")


def test_a_strict_paged_double_free_names_the_sites_and_a_lenient_one_is_still_ignored() -> None:
    a = paged(strict=True)
    a.free([4])  # strict first free
    with pytest.raises(DoubleFreeError) as info:
        a.free([5, 6])
    assert str(info.value).startswith("page 1 (slots 4..7) of rank 0, freed at free_index[0] (flattened)")
    assert f"then freed at {HERE}:{line_of('strict first free')}" in str(info.value)
    lenient = paged()
    lenient.free([4])
    assert lenient.free([5, 6]) == 0  # the original's meaning: a free page is ignored


# -- turning it on without editing the engine ---------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", "ON", " yes "])
def test_hostpool_nb_track_turns_tracking_on_for_every_pool_built_without_track(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOSTPOOL_NB_TRACK", value)
    assert PagedTokenToKVPoolAllocator(64, 4, None).track
    assert TokenToKVPoolAllocator(64, None, dp_size=2).track
    assert LogicalHostPool(64, 4).track
    assert not PagedTokenToKVPoolAllocator(64, 4, None, track=False).track  # an explicit track= wins
    assert not LogicalHostPool(64, 4, track=False).track


@pytest.mark.parametrize("value", ["", "0", "false", "Off", "no"])
def test_hostpool_nb_track_off(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOSTPOOL_NB_TRACK", value)
    assert not TokenToKVPoolAllocator(64, None).track
    assert not LogicalHostPool(64, 4).track
    assert PagedTokenToKVPoolAllocator(64, 4, None, track=True).track


@pytest.mark.parametrize(
    "make",
    [
        lambda: PagedTokenToKVPoolAllocator(64, 4, None),
        lambda: TokenToKVPoolAllocator(64, None),
        lambda: LogicalHostPool(64, 4),
    ],
    ids=["paged", "token", "core"],
)
def test_a_hostpool_nb_track_that_means_nothing_is_an_error(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOSTPOOL_NB_TRACK", "2")
    with pytest.raises(HostPoolError) as info:
        make()
    assert str(info.value) == (
        "HOSTPOOL_NB_TRACK must be 1 or 0 (or true/false, yes/no, on/off), got HOSTPOOL_NB_TRACK='2'"
    )


def test_an_old_untracked_pickle_loads_untracked_whatever_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    blob = pickle.dumps(PagedTokenToKVPoolAllocator(64, 4, None, track=False))
    monkeypatch.setenv("HOSTPOOL_NB_TRACK", "1")
    assert not pickle.loads(blob).track


@pytest.mark.parametrize("track", ["yes", 1, np.bool_(True)])
def test_track_must_be_a_bool_or_none(track: Any) -> None:
    for make in (
        lambda: PagedTokenToKVPoolAllocator(64, 4, None, track=track),
        lambda: TokenToKVPoolAllocator(64, None, track=track),
        lambda: LogicalHostPool(64, 4, track=track),
    ):
        with pytest.raises(TypeError) as info:
            make()
        assert str(info.value) == f"track must be True, False or None, got {type(track).__name__} {track!r}"


# -- the bad-input matrix of the new arguments --------------------------------------------

_UNHASHABLE = "tag must be hashable, got list [1]"
_BAD_CALLS: list[Any] = [
    pytest.param(
        lambda a: a.alloc_extend([0, 0], [1, 1], [-1, -1], 2, tags=["x"]),
        HostPoolError,
        "tags must have one entry per request (2), got 1",
        id="extend tags too short",
    ),
    pytest.param(
        lambda a: a.alloc_decode([1], [-1], tags=["x", "y"]),
        HostPoolError,
        "tags must have one entry per request (1), got 2",
        id="decode tags too long",
    ),
    pytest.param(
        lambda a: a.alloc_decode([1], [-1], tags="x"),
        TypeError,
        "tags must be a sequence of one tag per request, got str",
        id="tags a str",
    ),
    pytest.param(
        lambda a: a.alloc_extend([0], [1], [-1], 1, tags=7),
        TypeError,
        "tags must be a sequence of one tag per request, got int",
        id="tags an int",
    ),
    pytest.param(
        lambda a: a.alloc_decode([1, 1], [-1, -1], tags=["ok", [1]]),
        TypeError,
        _UNHASHABLE,
        id="an unhashable tag",
    ),
    pytest.param(lambda a: a.alloc(4, tag=[1]), TypeError, _UNHASHABLE, id="alloc tag unhashable"),
    pytest.param(
        lambda a: a.outstanding(exclude=[4, 64]),
        SlotRangeError,
        "exclude got slot 64 at exclude[1] (flattened), outside rank 0 (slots 0..35)",
        id="exclude beyond the rank",
    ),
    pytest.param(
        lambda a: a.leak_report(1, exclude=[-1]),
        SlotRangeError,
        "exclude got slot -1 at exclude[0] (flattened), outside rank 1 (slots 0..35)",
        id="exclude negative",
    ),
    pytest.param(
        lambda a: a.outstanding(exclude=[1.5]),
        TypeError,
        "exclude must hold integers, got dtype float64; convert with .astype(np.int64) if the values are whole "
        "slot ids",
        id="exclude floats",
    ),
    pytest.param(
        lambda a: a.leak_report(limit=-1), HostPoolError, "limit must be non-negative, got limit=-1", id="limit"
    ),
    pytest.param(
        lambda a: a.outstanding(dp_rank=2), HostPoolError, "dp_rank must be in [0, 2), got dp_rank=2", id="rank"
    ),
]


@pytest.mark.parametrize("group", [False, True], ids=["outside a group", "in a group"])
@pytest.mark.parametrize(("call", "error", "message"), _BAD_CALLS)
def test_bad_tracking_arguments_change_nothing(group: bool, call: Any, error: type, message: str) -> None:
    a = paged()
    if group:
        a.free_group_begin()
        a.free([12])
    check_error(a, call, error, message)


def test_an_unhashable_tag_is_ignored_by_an_allocator_that_does_not_track() -> None:
    a = paged(track=False)
    assert a.alloc(4, tag=[1]) is not None
    assert a.alloc_decode([1], [-1], tags="not even a sequence of tags") is not None


def test_outstanding_needs_a_tracking_allocator() -> None:
    a = paged(track=False)
    check_error(
        a,
        lambda a: a.outstanding(),
        HostPoolError,
        "outstanding() needs a tracking allocator: construct PagedTokenToKVPoolAllocator with track=True or set "
        "HOSTPOOL_NB_TRACK=1 before the engine builds it (leak_report() still says how much is held)",
    )


def test_the_core_pools_outstanding_takes_exclude_too() -> None:
    pool = LogicalHostPool(64, 4, track=True)
    kept = pool.alloc(8, tag="cache")
    pool.alloc(4, tag="lost")
    assert [(o.tag, o.pages) for o in pool.outstanding(exclude=kept)] == [("lost", 1)]
    assert "1 page (4 slots) allocated" in pool.leak_report(exclude=kept)
    with pytest.raises(SlotRangeError) as info:
        pool.outstanding(exclude=[64])
    assert str(info.value) == "exclude got slot 64 at exclude[0] (flattened), outside the pool (slots 0..63)"


# -- snapshots, pickles, the site table ---------------------------------------------------


def test_a_tracked_snapshot_restores_who_held_what() -> None:
    a = paged()
    state = a.backup_state()
    assert state.sites is not None
    assert len(state.sites) == 2
    before = a.outstanding()
    a.clear()
    for i in range(3000):  # enough new tags to make the table sweep the old entries
        a.free(a.alloc(4, tag=f"t{i}"))
    assert len(a._trackers[0].table()) < 2100  # swept: two entries per page at most, and those since the sweep
    a.restore_state(state)
    assert a.outstanding() == before
    a.restore_state(pickle.loads(pickle.dumps(state)))
    assert a.outstanding() == before
    a.check_invariants()


@pytest.mark.parametrize("copier", [pickle.loads, copy.deepcopy])
def test_a_tracked_allocator_pickles_and_copies_with_its_sites(copier: Any) -> None:
    a = paged(strict=True)
    a.free_group_begin()
    a.free([12], dp_rank=0)
    b = copier(pickle.dumps(a)) if copier is pickle.loads else copier(a)
    b.check_invariants()
    assert b.track
    assert b.outstanding() == a.outstanding()
    with pytest.raises(DoubleFreeError) as info:
        b.free([13])
    assert "was already freed in this free group; it was allocated at" in str(info.value)


def test_a_state_that_tracks_otherwise_is_refused() -> None:
    tracked, untracked = paged(), paged(track=False)
    check_error(
        untracked,
        lambda a: a.restore_state(tracked.backup_state()),
        HostPoolError,
        "the state of rank 0 is from an allocator with track=True; this one has track=False",
    )
    check_error(
        tracked,
        lambda a: a.restore_state(untracked.backup_state()),
        HostPoolError,
        "the state of rank 0 is from an allocator with track=False; this one has track=True",
    )


def _with_sites(state: PagedState, sites: Any) -> PagedState:
    return PagedState(state.kind, state.size, state.page_size, state.dp_size, state._ranks, sites)


@pytest.mark.parametrize(
    ("sites", "message"),
    [
        (None, "the state holds a NoneType; this tracking allocator needs one per rank (2)"),
        ("edit", "the state has a damaged site table for rank 1: entry 0 is a str, not a Site"),
        ("short", "the state holds 1 site tables; this tracking allocator needs one per rank (2)"),
        ("dangling", "the state of rank 0 fails the invariants: page 1's allocation site id 2 is not in its site "
         "table of 2"),
    ],
)  # fmt: skip
def test_a_damaged_site_table_is_refused(sites: Any, message: str) -> None:
    a = paged()
    state = a.backup_state()
    good = state.sites
    assert good is not None
    table = {
        None: None,
        "edit": (good[0], ("not a site", *good[1][1:])),
        "short": good[:1],
        "dangling": (good[0][:2], good[1]),
    }[sites]
    check_error(a, lambda a: a.restore_state(_with_sites(state, table)), HostPoolError, message)


def test_an_untracked_state_with_site_tables_is_refused() -> None:
    a = paged(track=False)
    state = paged().backup_state()
    untracked = a.backup_state()
    check_error(
        a,
        lambda a: a.restore_state(_with_sites(untracked, state.sites)),
        HostPoolError,
        "the state has site tables, but this allocator does not track",
    )


def test_a_format_2_paged_state_pickle_loads_as_an_untracked_state() -> None:
    a = paged(track=False)
    state = a.backup_state()
    old = _load_paged(2, (state.kind, state.size, state.page_size, state.dp_size, state._ranks))
    assert old.sites is None
    a.clear()
    a.restore_state(old)
    assert a.free_pages[0].tolist() == [4, 5, 6, 7, 8]
    with pytest.raises(HostPoolError) as info:
        _load_paged(FORMATS["PagedState"], (state.kind, state.size, state.page_size, state.dp_size, state._ranks))
    assert str(info.value) == "the PagedState pickle of format 3 does not hold its 6 fields"


def test_a_batch_whose_new_tags_make_the_table_sweep_keeps_every_tag() -> None:
    a = PagedTokenToKVPoolAllocator(8192, 1, None, strict=True, track=True)
    for i in range(1100):  # entries nobody refers to any more: the next new ones sweep them
        a.free(a.alloc(1, tag=f"gone-{i}"))
    n = 3000
    got = a.alloc_decode([1] * n, [-1] * n, tags=[f"req-{i}" for i in range(n)])
    assert got is not None
    tags = {int(got[i]): f"req-{i}" for i in range(n)}
    records = a.outstanding()
    assert len(records) == n
    assert all(o.pages == 1 for o in records)
    assert {o.tag for o in records} == set(tags.values())
    a.free(got[7:8])
    with pytest.raises(DoubleFreeError) as info:  # each slot's own request, after the sweep
        a.free(got[7:8])
    assert "with tag 'req-7'" in str(info.value)


def test_a_refused_allocation_leaves_the_site_table_as_it_was() -> None:
    a = paged()
    before = capture_tracked(a)
    assert a.alloc(9 * 4, tag="too-big") is None
    assert a.alloc_extend([0], [40], [-1], 40, tags=["too-big"]) is None
    assert a.alloc_decode([1] * 7, [-1] * 7, tags=[f"new-{i}" for i in range(7)]) is None
    assert capture_tracked(a)[1:] == before[1:]


# -- a decode step's tags are the last step's: their entries are reused while the table means the same ----------


def decode_batch(a: Any, heads: list[int], tags: list[Any]) -> Any:
    """One decode token for each request whose last slot is ``heads[i]`` (page size 1: a new page each)."""
    return a.alloc_decode([2] * len(heads), heads, tags=tags)  # decode site


def tags_of(a: Any) -> dict[Any, int]:
    return {o.tag: o.pages for o in a.outstanding() if o.line == line_of("decode site")}


def test_a_batch_with_the_last_batchs_tags_is_recorded_with_them() -> None:
    a = PagedTokenToKVPoolAllocator(64, 1, None, track=True)
    first = decode_batch(a, [0, 0], ["a", "b"])
    again = decode_batch(a, [0, 0], ["a", "b"])  # equal tags, from the same site: the last batch's entries
    assert first.tolist() == [1, 2]
    assert again.tolist() == [3, 4]
    assert tags_of(a) == {"a": 2, "b": 2}
    decode_batch(a, [0, 0], ["b", "c"])  # other tags: looked up, and interned
    assert tags_of(a) == {"a": 2, "b": 3, "c": 1}


def test_a_tag_equal_to_the_last_batchs_counts_as_it() -> None:
    a = PagedTokenToKVPoolAllocator(64, 1, None, track=True)
    decode_batch(a, [0], [5])
    decode_batch(a, [0], [np.int64(5)])  # == 5, as a dict key would be: reported as the tag 5
    assert tags_of(a) == {5: 2}
    assert [type(t) for t in tags_of(a)] == [int]


class _NoCompare:
    """A hashable tag whose ``==`` raises (numpy arrays' does): never the last batch's."""

    def __eq__(self, other: object) -> bool:
        raise ValueError("no comparing")

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return "<tag>"


def test_a_tag_whose_equality_raises_is_a_new_tag() -> None:
    a = PagedTokenToKVPoolAllocator(64, 1, None, track=True)
    decode_batch(a, [0], [7])
    tag = _NoCompare()
    decode_batch(a, [0], [tag])
    assert [repr(t) for t in tags_of(a)] == ["7", "<tag>"]


def test_the_last_batchs_ids_are_not_reused_after_a_sweep_gave_them_to_others() -> None:
    a = PagedTokenToKVPoolAllocator(8, 1, None, track=True)
    tracker = a._trackers[0]  # type: ignore[index]  # a tracking allocator
    a.free(decode_batch(a, [0, 0], ["a", "b"]))
    version = tracker._version
    for i in range(1100):  # new tags on the same few pages, until the table sweeps those no page refers to
        a.free(a.alloc(1, tag=f"other-{i}"))
    assert tracker._version > version  # swept: ids of "a" and "b" may be others' now
    decode_batch(a, [0, 0], ["a", "b"])
    assert tags_of(a) == {"a": 1, "b": 1}


def test_the_last_batchs_ids_are_not_reused_after_a_failed_call_took_its_entries_back() -> None:
    a = PagedTokenToKVPoolAllocator(4, 1, None, track=True)
    held = decode_batch(a, [0], ["a"])
    tags = ["p", "q", "r", "s"]
    assert decode_batch(a, [0] * 4, tags) is None  # refused, short: its new entries taken back
    a.free(held)
    decode_batch(a, [0] * 4, tags)  # the same tags again, now served
    assert tags_of(a) == dict.fromkeys(tags, 1)


def test_a_restore_of_another_table_forgets_the_last_batch() -> None:
    a = PagedTokenToKVPoolAllocator(64, 1, None, track=True)
    empty = a.backup_state()
    decode_batch(a, [0], ["a"])
    a.restore_state(empty)  # a table without "a": its id means nothing now
    decode_batch(a, [0], ["a"])
    assert tags_of(a) == {"a": 1}
    same = a.backup_state()
    a.restore_state(same)  # the table as it is: the last batch's entries still mean the same
    decode_batch(a, [0], ["a"])
    assert tags_of(a) == {"a": 2}


@pytest.mark.parametrize("cls", ["paged", "token"])
def test_check_invariants_finds_a_site_id_outside_the_table_of_a_rank_otherwise_sound(cls: str) -> None:
    """Site ids in the tracking words are checked whenever the rank's lists are sound, not only when they are not."""
    a = (
        PagedTokenToKVPoolAllocator(16 * 8, 16, None, dp_size=2, track=True)
        if cls == "paged"
        else TokenToKVPoolAllocator(8, None, dp_size=2, track=True)
    )
    held = a.alloc(a.page_size, dp_rank=1)
    assert held is not None
    a.check_invariants()
    st = a._st[1]
    n, t = int(st[L.H_NPAGES]), int(st[L.H_TRACK])
    page = int(held[0]) // a.page_size
    st[t + n + page] = (999 << 32) | (int(st[t + n + page]) & 0xFFFFFFFF)  # an allocation site no table holds
    with pytest.raises(RuntimeError, match=rf"rank 1 is corrupted: page {page}'s allocation site id 999 is not in"):
        a.check_invariants()
