"""hostpool_nb.paged.SWATokenToKVPoolAllocator: every misuse, snapshots, the documented difference, threads.

Each bad call raises the documented type with its exact message and leaves
both sub-allocators, every mapping and the lock as they were. The
differential state machine is ``test_swa_state_machine.py``.
"""

from __future__ import annotations

import copy
import pickle
import random
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hostpool_nb import AlignmentError, DoubleFreeError, HostPoolError, PagedOnlyError, SlotRangeError
from hostpool_nb._kernels import layout as L
from hostpool_nb.originals import paged as oracle_mod
from hostpool_nb.paged import SWAState, SWATokenToKVPoolAllocator
from tests.conftest import one_entry_per_page
from tests.paged_model import capture


def hybrid() -> Any:
    return SimpleNamespace(full_kv_pool="full pool", swa_kv_pool="swa pool")


def made(page_size: int = 1, dp_size: int = 2) -> SWATokenToKVPoolAllocator:
    """16 full and 8 SWA slots per rank at page size 1 (4 and 2 pages of 4 above); rank 0 holds a request."""
    ps = page_size
    a = SWATokenToKVPoolAllocator(dp_size * 16 * ps, dp_size * 8 * ps, hybrid(), page_size=ps, dp_size=dp_size)
    assert a.alloc(2 * ps) is not None
    return a


def everything(a: SWATokenToKVPoolAllocator) -> tuple[Any, ...]:
    maps = a.full_to_swa_index_mapping
    maps = maps if isinstance(maps, list) else [maps]
    return capture(a.full_attn_allocator), capture(a.swa_attn_allocator), [m.tolist() for m in maps]


def check_error(a: SWATokenToKVPoolAllocator, call: Any, error: type, message: str) -> None:
    before = everything(a)
    with pytest.raises(error) as info:
        call(a)
    assert type(info.value) is error
    assert str(info.value) == message
    assert everything(a) == before
    a.check_invariants()
    assert a.lock.acquire(timeout=5)
    a.lock.release()


_DP = "dp_rank must be in [0, 2), got dp_rank=2"
_BAD: list[Any] = [
    pytest.param(1, lambda a: a.free([3]), DoubleFreeError,
                 "slot 3 of rank 0, freed at free_index[0] (flattened), is not allocated: it was freed already",
                 id="never allocated"),
    pytest.param(1, lambda a: a.free([17]), SlotRangeError,
                 "free got slot 17 at free_index[0] (flattened), outside rank 0's pages 1..16 (slots 1..16)",
                 id="free beyond the rank"),
    pytest.param(1, lambda a: a.free([0]), SlotRangeError,
                 "free got slot 0 at free_index[0] (flattened), in the padding page 0, which is never allocated",
                 id="free of slot 0"),
    pytest.param(1, lambda a: a.free_swa([1, 40]), SlotRangeError,
                 "free_swa got slot 40 at free_index[1] (flattened), outside rank 0's full slots 0..16",
                 id="free_swa beyond"),
    pytest.param(1, lambda a: a.count_swa_mapped([-1]), SlotRangeError,
                 "count_swa_mapped got slot -1 at indices[0] (flattened), outside rank 0's full slots 0..16",
                 id="count beyond"),
    pytest.param(1, lambda a: a.alloc(-1), HostPoolError, "need_size must be non-negative, got need_size=-1",
                 id="alloc negative"),
    pytest.param(1, lambda a: a.alloc(1, 2), HostPoolError, _DP, id="alloc rank"),
    pytest.param(1, lambda a: a.free([1], 2), HostPoolError, _DP, id="free rank"),
    pytest.param(1, lambda a: a.merge_and_sort_free(2), HostPoolError, _DP, id="merge rank"),
    pytest.param(4, lambda a: a.merge_and_sort_free(-1), HostPoolError, "dp_rank must be in [0, 2), got dp_rank=-1",
                 id="merge rank paged"),
    pytest.param(4, lambda a: a.merge_and_sort_free(1.0), TypeError, "dp_rank must be an integer, got float 1.0",
                 id="merge rank float"),
    pytest.param(1, lambda a: a.count_swa_mapped([1], 2), HostPoolError, _DP, id="count rank"),
    pytest.param(1, lambda a: a.alloc_extend([0], [1], [-1], 1), PagedOnlyError,
                 "alloc_extend is only for paged allocator: SWATokenToKVPoolAllocator at page size 1 hands out "
                 "single slots; use alloc(n)", id="extend at page size 1"),
    pytest.param(1, lambda a: a.alloc_decode([2], [1]), PagedOnlyError,
                 "alloc_decode is only for paged allocator: SWATokenToKVPoolAllocator at page size 1 hands out "
                 "single slots; use alloc(n)", id="decode at page size 1"),
    pytest.param(4, lambda a: a.alloc(5), AlignmentError, "alloc must be page-aligned, got need_size=5, page_size=4",
                 id="alloc misaligned"),
    pytest.param(4, lambda a: a.alloc_extend([0, 0], [1], [-1, -1], 1), HostPoolError,
                 "prefix_lens, seq_lens and last_loc must have the same length, got 2, 1, 2", id="extend lengths"),
    pytest.param(4, lambda a: a.alloc_decode([1, 2], [-1]), HostPoolError,
                 "seq_lens and last_loc must have the same length, got 2, 1", id="decode lengths"),
    pytest.param(4, lambda a: a.alloc_extend([0], [2], [99], 2), SlotRangeError,
                 "last_loc[0]=99 is outside rank 0's full slots (-1, or 0..67)", id="extend last_loc beyond"),
    pytest.param(4, lambda a: a.alloc_decode([2], [-2]), SlotRangeError,
                 "last_loc[0]=-2 is outside rank 0's full slots (-1, or 0..67)", id="decode last_loc negative"),
    pytest.param(4, lambda a: a.alloc_extend([0], [2], [-1], 3), HostPoolError,
                 "extend_num_tokens=3 is not the sum of seq_lens - prefix_lens (2)", id="extend total"),
    pytest.param(4, lambda a: a.alloc_decode([0], [-1]), HostPoolError,
                 "seq_lens[0] must be at least 1 (it counts the new token), got 0", id="decode seq 0"),
    pytest.param(4, lambda a: a.free([3]), SlotRangeError,
                 "free got slot 3 at free_index[0] (flattened), in the padding page 0, which is never allocated",
                 id="paged free of page 0"),
    pytest.param(1, lambda a: a.free([1.0]), TypeError,
                 "free_index must hold integers, got dtype float64; convert with .astype(np.int64) if the values are "
                 "whole slot ids", id="float slots"),
]  # fmt: skip


@pytest.mark.parametrize("group", [False, True], ids=["outside a group", "in a group"])
@pytest.mark.parametrize(("ps", "call", "error", "message"), _BAD)
def test_bad_calls_change_nothing(group: bool, ps: int, call: Any, error: type, message: str) -> None:
    a = made(ps)
    if group:
        a.free_group_begin()
    check_error(a, call, error, message)


@pytest.mark.parametrize("group", [False, True], ids=["outside a group", "in a group"])
def test_a_slot_named_twice_in_one_free_is_a_double_free(group: bool) -> None:
    a = made()
    if group:
        a.free_group_begin()
    said = "was already freed in this free group" if group else "is freed twice in one call (again at"
    before = everything(a)
    with pytest.raises(DoubleFreeError) as info:
        a.free([2, 2])
    assert said in str(info.value)
    assert everything(a) == before


def test_a_slot_freed_in_a_group_is_a_double_free_if_freed_again_in_it() -> None:
    a = made()
    a.free_group_begin()
    assert a.free([1]) == 1
    check_error(
        a,
        lambda a: a.free([1]),
        DoubleFreeError,
        "slot 1 of rank 0, freed at free_index[0] (flattened), was already freed in this free group",
    )
    assert a.count_swa_mapped([1]) == 1  # still mapped until the group ends
    a.free_group_end()
    assert a.count_swa_mapped([1]) == 0


@pytest.mark.parametrize("call", ["extend", "decode"])
def test_a_batch_the_swa_side_cannot_serve_leaves_the_full_side_untouched(call: str) -> None:
    # The original takes the full slots, then frees them again when the SWA side refuses
    # (at page size > 1 the continuing requests' current pages with them); here neither
    # side changes but for the merges the call makes.
    kv = hybrid()
    lib = SWATokenToKVPoolAllocator(16 * 4, 2 * 4, kv, page_size=4)
    ora = oracle_mod.SWATokenToKVPoolAllocator(16 * 4, 2 * 4, hybrid(), page_size=4)
    for a in (lib, ora):
        a.alloc(4)
    before = everything(lib)
    if call == "extend":
        got, want = (a.alloc_extend([0], [12], [-1], 12) for a in (lib, ora))
    else:
        got, want = (a.alloc_decode([1, 1], [-1, -1]) for a in (lib, ora))
    assert got is None
    assert want is None
    assert everything(lib) == before
    assert sorted(ora.full_attn_allocator.release_pages[0].tolist())  # the original's pages came back released
    lib.check_invariants()


def test_the_mapping_is_one_object_for_the_allocators_life_and_the_kv_pools() -> None:
    for dp in (1, 2):
        kv = hybrid()
        a = SWATokenToKVPoolAllocator(dp * 16, dp * 8, kv, dp_size=dp)
        mapping = a.full_to_swa_index_mapping
        assert kv.full_to_swa_index_mapping is mapping
        assert a.get_kvcache() is kv
        state = a.backup_state()
        a.alloc(3)
        a.clear()
        a.restore_state(state)
        assert a.full_to_swa_index_mapping is mapping
        if dp == 2:
            assert [m.shape for m in mapping] == [(17,), (17,)]
            assert all(m.dtype == np.int32 for m in mapping)
        assert a.full_attn_allocator.get_kvcache() == "full pool"
        assert a.swa_attn_allocator.get_kvcache() == "swa pool"
        assert (a.size_full, a.size_swa) == (dp * 16, dp * 8)


@pytest.mark.parametrize("ps", [1, 4])
def test_backup_and_restore_bring_back_both_sides_and_the_mapping(ps: int) -> None:
    a = made(ps)
    state = a.backup_state()
    before = everything(a)
    x = a.alloc(ps, 1)
    a.free_swa(x, 1)
    a.free(np.arange(ps, 2 * ps))
    a.restore_state(state)
    assert everything(a) == before
    again = pickle.loads(pickle.dumps(state))
    a.clear()
    a.restore_state(again)
    assert everything(a) == before


def test_a_damaged_snapshot_is_refused_and_changes_nothing() -> None:
    a = made()
    state = a.backup_state()
    maps = [m.copy() for m in state._mappings]
    maps[0][5] = 3  # full slot 5 is not allocated
    bad = _with_maps(state, maps)
    check_error(a, lambda a: a.restore_state(bad), HostPoolError,
                "the state's mapping of rank 0 fails the invariants: a full slot that is not allocated has an "
                "SWA slot")  # fmt: skip
    maps = [m.copy() for m in state._mappings]
    maps[0][1] = maps[0][2]  # two full slots, one SWA slot
    check_error(a, lambda a: a.restore_state(_with_maps(state, maps)), HostPoolError,
                "the state's mapping of rank 0 fails the invariants: two full slots map to one SWA slot")  # fmt: skip
    maps = [m[:-1] for m in state._mappings]
    check_error(a, lambda a: a.restore_state(_with_maps(state, maps)), HostPoolError,
                "the state's mapping of rank 0 fails the invariants: it has 16 entries, expected 17")  # fmt: skip
    maps = [m.copy() for m in state._mappings]
    maps[0][1] = int(state.swa._ranks[0][L.H_NPAGES])  # one past the SWA rank's last slot (page size 1)
    check_error(a, lambda a: a.restore_state(_with_maps(state, maps)), HostPoolError,
                "the state's mapping of rank 0 fails the invariants: an SWA slot is outside the SWA rank")  # fmt: skip
    check_error(a, lambda a: a.restore_state(_with_maps(state, [state._mappings[0]])), HostPoolError,
                "the state holds 1 mappings; this allocator has dp_size=2")  # fmt: skip
    check_error(a, lambda a: a.restore_state(state.full), TypeError,
                "state must be a SWAState from backup_state(), got PagedState")  # fmt: skip
    other = SWATokenToKVPoolAllocator(64, 16, hybrid(), dp_size=2)
    with pytest.raises(HostPoolError):
        other.restore_state(state)


def _with_maps(state: Any, maps: list[np.ndarray]) -> SWAState:
    return SWAState(state.full, state.swa, tuple(maps))


def test_it_does_not_pickle_or_copy_and_says_why() -> None:
    a = made()
    for attempt in (lambda: pickle.dumps(a), lambda: copy.deepcopy(a), lambda: copy.copy(a)):
        with pytest.raises(TypeError) as info:
            attempt()
        assert "the KV pool and the attention backend hold its mapping array by identity" in str(info.value)


def test_debug_print_and_sizes_are_the_originals() -> None:
    a, o = made(4), oracle_mod.SWATokenToKVPoolAllocator(2 * 16 * 4, 2 * 8 * 4, hybrid(), page_size=4, dp_size=2)
    o.alloc(8)
    for r in (0, 1):
        assert a.debug_print(r) == o.debug_print(r)
        assert (a.available_size(r), a.full_available_size(r), a.swa_available_size(r)) == (
            o.available_size(r),
            o.full_available_size(r),
            o.swa_available_size(r),
        )


@pytest.mark.slow
@pytest.mark.parametrize("ps", [1, 4])
def test_threads_sharing_one_allocator_never_share_a_slot(ps: int) -> None:
    # Tracking: each thread's allocations carry its tag, so outstanding() at the end tells them apart too.
    a = SWATokenToKVPoolAllocator(2 * 64 * ps, 2 * 32 * ps, hybrid(), page_size=ps, dp_size=2, track=True)
    owner: dict[tuple[int, int], int] = {}
    table = threading.Lock()
    failures: list[str] = []

    def worker(tid: int) -> None:
        try:
            work(tid)
        except BaseException as exc:  # noqa: BLE001 - surfaced to the test thread
            failures.append(f"thread {tid}: {exc!r}")

    def work(tid: int) -> None:
        rng = random.Random(tid)
        held: list[tuple[int, list[int]]] = []
        for _ in range(1500):
            r = rng.randrange(2)
            if held and rng.random() < 0.45:
                r, slots = held.pop(rng.randrange(len(held)))
                with table:
                    for s in slots[::ps]:
                        del owner[(r, s // ps)]
                if rng.random() < 0.5:
                    a.free_swa(slots[:ps], r)
                a.free(np.array(slots, dtype=np.int64), r)
            else:
                got = a.alloc(rng.randint(1, 3) * ps, r, tag=tid)
                if got is None:
                    continue
                slots = got.tolist()
                with table:
                    for s in slots[::ps]:
                        if (r, s // ps) in owner:
                            failures.append(f"page {s // ps} of rank {r} handed to {tid} and {owner[(r, s // ps)]}")
                        owner[(r, s // ps)] = tid
                held.append((r, slots))
        for r in (0, 1):  # the pages this thread holds are exactly those outstanding with its tag
            with a.lock:
                mine = sum(o.pages for o in a.outstanding(r) if o.tag == tid)
                expected = sum(len(s) // ps for rr, s in held if rr == r)
            if mine != expected:
                failures.append(f"thread {tid} rank {r}: outstanding() says {mine} pages, it holds {expected}")
        for r, slots in held:
            with table:
                for s in slots[::ps]:
                    del owner[(r, s // ps)]
            a.free(np.array(slots, dtype=np.int64), r)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    a.check_invariants()
    for r in (0, 1):
        assert a.full_available_size(r) == 64 * ps
        assert a.swa_available_size(r) == 32 * ps
        assert not a.full_to_swa_index_mapping[r].any()


def test_a_request_continued_after_its_last_swa_slot_went_never_frees_the_padding_page() -> None:
    # The original maps the next token from SWA slot 0, in the padding page, and its
    # later free would list that page; here that slot is never freed.
    a = SWATokenToKVPoolAllocator(16 * 4, 8 * 4, hybrid(), page_size=4)
    out = a.alloc_extend([0], [3], [-1], 3)
    assert out is not None
    a.free_swa(out)  # every token of the request left the window
    new = a.alloc_decode([4], [int(out[-1])])  # continues its page: SWA slot mapping[last] + 1
    assert new is not None
    assert 0 < a.full_to_swa_index_mapping[int(new[0])] < 4  # in the SWA side's page 0
    swa_before = a.swa_available_size()
    assert a.free(np.concatenate([out, new]).astype(np.int64)) == 1
    assert a.swa_available_size() == swa_before
    assert 0 not in a.swa_attn_allocator.free_pages[0].tolist()
    a.check_invariants()


# -- who holds each slot (track=True): both sides, from the caller's sites ----------------------------------

HERE = __file__


def tracked(page_size: int = 1) -> SWATokenToKVPoolAllocator:
    return SWATokenToKVPoolAllocator(64 * page_size, 32 * page_size, hybrid(), page_size=page_size, track=True)


def everything_tracked(a: SWATokenToKVPoolAllocator) -> tuple[Any, ...]:
    """``everything``, and both sides' tracking words and site tables."""
    subs = (a.full_attn_allocator, a.swa_attn_allocator)
    words = tuple(tuple(st[int(st[L.H_TRACK]) :].tolist()) for sub in subs for st in sub._st)
    return everything(a), words, tuple(t.table() for sub in subs for t in sub._trackers)


def test_a_decode_slot_freed_by_two_code_paths_names_where_it_was_allocated_and_first_freed() -> None:
    a = tracked()
    slots = a.alloc(4, tag="req-1")  # allocated here
    a.free(slots[3:])  # first freed here
    with pytest.raises(DoubleFreeError) as info:
        a.free(slots[3:])
    text = str(info.value)
    assert text.startswith("slot 4 of rank 0, freed at free_index[0] (flattened), is not allocated: it was freed")
    source = Path(HERE).read_text().splitlines()
    lines = [i + 1 for i, line in enumerate(source) if line.endswith("# allocated here")]
    first = [i + 1 for i, line in enumerate(source) if line.endswith("# first freed here")]
    assert f"allocated at {HERE}:{lines[0]} in " in text
    assert "with tag 'req-1'" in text
    assert f"then freed at {HERE}:{first[0]} in " in text


@pytest.mark.parametrize("ps", [1, 4])
def test_each_side_knows_who_holds_its_pages_and_the_leak_report_leaves_out_what_is_held(ps: int) -> None:
    a = tracked(ps)
    cached = a.alloc(2 * ps, tag="cached")
    lost = a.alloc(ps, tag="lost")
    assert cached is not None and lost is not None  # noqa: PT018 - both served
    held = {o.tag: o.pages for o in a.outstanding()}
    assert held == {"cached": 2, "lost": 1}
    assert {o.tag: o.pages for o in a.swa_attn_allocator.outstanding()} == held  # the SWA side's, the same calls
    assert a.outstanding() == a.full_attn_allocator.outstanding()
    report = a.leak_report(exclude=cached)
    full, swa = report.split("\nSWA side: ")
    assert full.startswith("full side: ")
    for side in (full, swa):
        assert "'lost'" in side
        assert "'cached'" not in side  # excluded: the full slots, and on the SWA side the slots they map to


def test_the_swa_sides_frees_record_their_own_site() -> None:
    a = tracked(4)
    out = a.alloc_extend([0, 0], [8, 4], [-1, -1], 12, tags=["a", "b"])
    assert out is not None
    assert {o.tag: o.pages for o in a.outstanding()} == {"a": 2, "b": 1}
    assert a.free_swa(out[:4]) == 4  # request a's first page left the window: its SWA page goes
    assert {o.tag: o.pages for o in a.swa_attn_allocator.outstanding()} == {"a": 1, "b": 1}
    assert {o.tag: o.pages for o in a.outstanding()} == {"a": 2, "b": 1}  # the full side keeps it
    a.free_group_begin()
    a.free(out)
    assert {o.tag: o.pages for o in a.outstanding()} == {}  # pending in the group: freed already
    a.free_group_end()
    assert a.swa_attn_allocator.outstanding() == []
    assert a.alloc_decode([9], [int(out[7])], tags=["a"]) is not None  # a decode that needs a page: tracked
    assert {o.tag for o in a.outstanding()} == {"a"}


_BAD_TRACKED: list[Any] = [
    pytest.param(lambda a: a.alloc(4, tag=[1]), TypeError, "tag must be hashable, got list [1]", id="alloc tag"),
    pytest.param(
        lambda a: a.alloc_extend([0], [4], [-1], 4, tags=["a", "b"]),
        HostPoolError,
        "tags must have one entry per request (1), got 2",
        id="extend tags length",
    ),
    pytest.param(
        lambda a: a.alloc_decode([5], [3], tags="ab"),
        TypeError,
        "tags must be a sequence of one tag per request, got str",
        id="decode tags str",
    ),
    pytest.param(
        lambda a: a.alloc_decode([5], [3], tags=[{}]),
        TypeError,
        "tag must be hashable, got dict {}",
        id="decode unhashable tag",
    ),
    pytest.param(
        lambda a: a.alloc_extend([0, 0], [4, 4], [-1, -1], 9, tags=["new-1", "new-2"]),
        HostPoolError,
        "extend_num_tokens=9 is not the sum of seq_lens - prefix_lens (8)",
        id="extend refused after interning",
    ),
]


@pytest.mark.parametrize(("call", "error", "message"), _BAD_TRACKED)
def test_bad_tracking_arguments_change_nothing_on_either_side(call: Any, error: type, message: str) -> None:
    a = tracked(4)
    assert a.alloc_extend([0], [3], [-1], 3, tags=["held"]) is not None
    before = everything_tracked(a)
    with pytest.raises(error) as info:
        call(a)
    assert str(info.value) == message
    assert everything_tracked(a) == before


@pytest.mark.parametrize("ps", [1, 4])
def test_a_refused_tracked_allocation_leaves_both_tables_as_they_were(ps: int) -> None:
    a = tracked(ps)
    before = everything_tracked(a)
    if ps > 1:
        assert a.alloc_extend([0], [ps * 40], [-1], ps * 40, tags=["too big"]) is None
    assert a.alloc(ps * 80, tag="too big") is None  # more than the full side's rank: refused before the kernel
    assert a.alloc(ps * 40, tag="short") is None  # the SWA side's 32 pages are too few: the kernel refuses
    assert everything_tracked(a) == before
    if ps > 1:  # the batch calls' refusals in the kernel: the SWA side full, the full side not
        held = a.alloc(ps * 32, tag="all of the SWA side")
        assert held is not None
        before = everything_tracked(a)
        last = int(held[-1])
        assert a.alloc_decode([ps * 32 + 1], [last], tags=["a new page"]) is None
        assert a.alloc_extend([ps * 32], [ps * 33], [last], ps, tags=["a new page"]) is None
        assert everything_tracked(a) == before


@pytest.mark.parametrize("ps", [1, 4])
def test_a_corrupt_full_side_stops_an_allocation_before_the_swa_side(ps: int) -> None:
    """A listed full page that is not free (impossible through the API): RuntimeError, both sides and the mapping
    as they were."""
    a = SWATokenToKVPoolAllocator(16 * ps, 8 * ps, hybrid(), page_size=ps)
    st = a.full_attn_allocator._st[0]
    ring = one_entry_per_page(st)
    held = a.alloc(ps)
    assert held is not None
    head = int(st[L.H_HEAD])
    ring[head + 1] = int(held[0]) // ps  # the second page the next allocation takes: held already
    before = everything(a)
    with pytest.raises(RuntimeError, match="corrupted"):
        a.alloc(2 * ps)
    assert everything(a) == before


def test_an_extension_the_swa_side_cannot_serve_is_refused_whatever_the_requests_hold() -> None:
    """The SWA side's check counts the new pages, ``ceil(seq / ps) - ceil(prefix / ps)``, of requests that hold some.

    Here 2 new pages, with 1 SWA page free and 14 full pages: refused, neither side changed.
    """
    kv = hybrid()
    a = SWATokenToKVPoolAllocator(16 * 4, 3 * 4, kv, page_size=4)
    held = a.alloc(8)  # two pages a side: the request's first 8 tokens
    assert held is not None
    before = everything(a)
    assert a.alloc_extend([8], [16], [int(held[-1])], 8) is None
    assert everything(a) == before
    a.check_invariants()


def test_an_untracking_swa_allocator_ignores_tags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOSTPOOL_NB_TRACK", raising=False)
    a = SWATokenToKVPoolAllocator(64, 32, hybrid(), page_size=4)
    assert not a.track
    assert a.alloc_extend([0], [4], [-1], 4, tags=[[]]) is not None  # not even looked at
    with pytest.raises(HostPoolError, match="outstanding\\(\\) needs a tracking allocator"):
        a.outstanding()


def test_hostpool_nb_track_turns_both_sides_tracking_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOSTPOOL_NB_TRACK", "1")
    a = SWATokenToKVPoolAllocator(64, 32, hybrid())
    assert (a.track, a.full_attn_allocator.track, a.swa_attn_allocator.track) == (True, True, True)
    assert not SWATokenToKVPoolAllocator(64, 32, hybrid(), track=False).track


def test_a_tracked_snapshot_restores_who_held_what_on_both_sides() -> None:
    a = tracked(4)
    state = a.backup_state()
    a.alloc(8, tag="later")
    a.restore_state(state)
    assert a.outstanding() == [] and a.swa_attn_allocator.outstanding() == []  # noqa: PT018 - both sides
    a.alloc(4, tag="x")
    state = a.backup_state()
    a.free(np.arange(4, 8))  # x's page
    a.restore_state(state)
    assert [o.tag for o in a.outstanding()] == ["x"]
    untracked = SWATokenToKVPoolAllocator(256, 128, hybrid(), page_size=4, track=False).backup_state()
    with pytest.raises(HostPoolError, match="track"):
        a.restore_state(untracked)


def test_the_repr_says_each_sides_available_slots() -> None:
    a = made(4, dp_size=2)  # rank 0 holds a request of two pages
    assert repr(a) == (
        "SWATokenToKVPoolAllocator(size=128, size_swa=64, page_size=4, dp_size=2: available_full=[56, 64], "
        "available_swa=[24, 32])"
    )


@pytest.mark.parametrize("grouped", [False, True])
def test_a_full_slot_mapped_into_the_padding_page_is_unmapped_by_its_free(grouped: bool) -> None:
    """A request decoding after its SWA slots went is mapped from slot 0 (the padding page); its free unmaps it."""
    a = SWATokenToKVPoolAllocator(256, 128, hybrid(), page_size=4)
    swa_free = a.swa_available_size()
    full = a.alloc_extend([0], [3], [-1], 3)
    assert full is not None
    assert a.free_swa(full) == 3  # the window moved past all three
    assert a.full_to_swa_index_mapping[full].tolist() == [0, 0, 0]
    decoded = a.alloc_decode([4], [int(full[-1])])
    assert decoded is not None
    padding = int(a.full_to_swa_index_mapping[decoded[0]])
    assert 0 < padding < 4  # mapped from slot 0: into the padding page, which is never allocated
    everything = np.concatenate([full, decoded])
    if grouped:
        a.free_group_begin()
    a.free(everything)
    if grouped:
        a.free_group_end()
    assert a.full_to_swa_index_mapping[everything].tolist() == [0, 0, 0, 0]
    assert a.count_swa_mapped(everything) == 0
    assert a.swa_available_size() == swa_free  # the padding slot was never the SWA side's to free
    a.check_invariants()
