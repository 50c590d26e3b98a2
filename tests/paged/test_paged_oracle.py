"""The paged oracle itself (hostpool_nb.originals.paged) against docs/behaviour.md, section 3.

This oracle judges hostpool_nb.paged, so it must itself be right: every
expected value below is worked out by hand from docs/behaviour.md (the comments
show the arithmetic), never computed by the oracle.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hostpool_nb.originals.paged import (
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)


def _paged(size: int, page_size: int, dp_size: int = 1, debug_mode: bool = False) -> PagedTokenToKVPoolAllocator:
    return PagedTokenToKVPoolAllocator(size, page_size, kvcache=None, debug_mode=debug_mode, dp_size=dp_size)


def _eq(actual: Any, expected: list[int], dtype: Any) -> None:
    assert isinstance(actual, np.ndarray)
    assert actual.dtype == dtype, actual.dtype
    assert actual.tolist() == expected


def _free_list(a: PagedTokenToKVPoolAllocator, r: int = 0) -> list[int]:
    assert a.free_pages[r].dtype == np.int32
    return a.free_pages[r].tolist()


def _released(a: PagedTokenToKVPoolAllocator, r: int = 0) -> list[int]:
    return sorted(a.release_pages[r].tolist())  # a set: its order is not part of the contract


# -- construction and page/slot layout -------------------------------------------


def test_attributes() -> None:
    a = _paged(64, 4, dp_size=2, debug_mode=True)
    assert (a.size, a.page_size, a.dp_size, a.debug_mode) == (64, 4, 2, True)
    assert a.size_per_rank == 32  # 64 // 2
    assert a.num_pages == 16  # 64 // 4
    assert a.pages_per_rank == 8  # 16 // 2
    assert a.is_not_in_free_group is True
    assert a.free_group == [[], []]
    for r in (0, 1):
        assert _free_list(a, r) == [1, 2, 3, 4, 5, 6, 7, 8]  # pages 1..pages_per_rank, page 0 is padding
        assert _released(a, r) == []
        assert a.available_size(r) == 32  # 8 pages * 4


def test_layout_page_size_1() -> None:
    a = _paged(8, 1)
    assert _free_list(a) == [1, 2, 3, 4, 5, 6, 7, 8]
    _eq(a.alloc(3), [1, 2, 3], np.int64)  # page p is slot p
    _eq(a.alloc(1), [4], np.int64)
    assert _free_list(a) == [5, 6, 7, 8]
    assert a.available_size() == 4


def test_layout_page_size_2() -> None:
    a = _paged(16, 2)  # 8 pages
    _eq(a.alloc(4), [2, 3, 4, 5], np.int64)  # pages 1, 2: slots 1*2+{0,1}, 2*2+{0,1}
    _eq(a.alloc(2), [6, 7], np.int64)  # page 3
    assert _free_list(a) == [4, 5, 6, 7, 8]
    assert a.available_size() == 10  # 5 pages * 2


def test_layout_page_size_16() -> None:
    a = _paged(64, 16)  # 4 pages
    _eq(a.alloc(32), list(range(16, 48)), np.int64)  # pages 1 (16..31) and 2 (32..47)
    _eq(a.alloc(16), list(range(48, 64)), np.int64)  # page 3
    assert _free_list(a) == [4]
    _eq(a.alloc(16), list(range(64, 80)), np.int64)  # page 4 = pages_per_rank, slots 64..79
    assert a.alloc(16) is None
    assert a.available_size() == 0


def test_alloc_zero_and_misaligned() -> None:
    a = _paged(16, 4)
    _eq(a.alloc(0), [], np.int64)  # no page taken
    assert _free_list(a) == [1, 2, 3, 4]
    with pytest.raises(AssertionError):
        a.alloc(6)  # not a multiple of 4: the original's assert
    assert _free_list(a) == [1, 2, 3, 4]


# -- allocation order, merge -------------------------------------------------


def test_alloc_order_and_merge_only_when_short() -> None:
    a = _paged(16, 2)  # pages 1..8
    _eq(a.alloc(4), [2, 3, 4, 5], np.int64)  # pages 1, 2
    _eq(a.alloc(2), [6, 7], np.int64)  # page 3
    a.free(np.array([2, 3]))  # page 1 released
    assert _free_list(a) == [4, 5, 6, 7, 8]
    assert _released(a) == [1]
    assert a.available_size() == 12  # (5 + 1) * 2
    # 5 pages needed, 5 on the free list: no merge, page 1 stays released.
    _eq(a.alloc(10), [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], np.int64)  # pages 4..8
    assert _free_list(a) == []
    assert _released(a) == [1]
    # 1 page needed, free list empty: merge, then page 1.
    _eq(a.alloc(2), [2, 3], np.int64)
    assert _free_list(a) == []
    assert _released(a) == []
    assert a.available_size() == 0


def test_merge_before_none() -> None:
    a = _paged(8, 2)  # pages 1..4
    _eq(a.alloc(6), [2, 3, 4, 5, 6, 7], np.int64)  # pages 1, 2, 3
    a.free(np.array([2, 3]))  # page 1 released
    assert (_free_list(a), _released(a)) == ([4], [1])
    # 3 pages needed > 1 free: merge first ([1, 4]), then still short: None.
    assert a.alloc(6) is None
    assert _free_list(a) == [1, 4]
    assert _released(a) == []
    assert a.available_size() == 4  # 2 pages * 2


def test_merge_and_sort_free() -> None:
    a = _paged(6, 1)  # pages 1..6
    _eq(a.alloc(4), [1, 2, 3, 4], np.int64)
    a.free(np.array([3]))
    a.free(np.array([1]))
    assert _free_list(a) == [5, 6]
    assert _released(a) == [1, 3]
    a.merge_and_sort_free()
    assert _free_list(a) == [1, 3, 5, 6]  # sorted union of [5, 6] and {1, 3}
    assert a.release_pages[0].tolist() == []
    assert a.available_size() == 4
    _eq(a.alloc(2), [1, 3], np.int64)  # the front of the sorted list
    a.merge_and_sort_free()  # nothing released: no change
    assert _free_list(a) == [5, 6]


# -- alloc_extend ------------------------------------------------------------


def test_alloc_extend_layout() -> None:
    a = _paged(64, 4)  # pages 1..16
    _eq(a.alloc(8), [4, 5, 6, 7, 8, 9, 10, 11], np.int64)  # pages 1, 2 taken: the free list now starts at 3
    prefix = [6, 8, 0, 3, 5, 0]
    seq = [13, 10, 4, 3, 7, 1]
    # (last_loc + 1) % 4 == prefix % 4 for each: 10%4=2=6%4, 8%4=0=8%4, 0=0, 51%4=3=3%4, 5%4=1=5%4, 0=0.
    last = [9, 7, -1, 50, 4, -1]
    # New pages: ceil(seq/4) - ceil(prefix/4) = (4-2) + (3-2) + (1-0) + (1-1) + (2-2) + (1-0) = 5: pages 3..7.
    # Tokens: 7 + 2 + 4 + 0 + 2 + 1 = 16.
    expected = [
        # req 0: prefix 6 ends mid-page; rest of its page = ceil(6/4)*4 - 6 = 2 slots from last_loc+1: 10, 11;
        # then 5 left: whole new page 3 (12..15), then 1 slot of new page 4 (16).
        10, 11, 12, 13, 14, 15, 16,
        # req 1: prefix 8 ends exactly at a page end: no rest; 2 slots of new page 5 (20, 21).
        20, 21,
        # req 2: empty prefix (last_loc -1): no rest; whole new page 6 (24..27).
        24, 25, 26, 27,
        # req 3: extend 0: nothing.
        # req 4: prefix 5, rest of page = 8 - 5 = 3 slots but extend is 2: 5, 6 (no new page).
        5, 6,
        # req 5: empty prefix, 1 token: first slot of new page 7 (28).
        28,
    ]  # fmt: skip
    for debug in (False, True):
        a.debug_mode = debug
        state = a.backup_state()
        _eq(a.alloc_extend(np.array(prefix), np.array(seq), np.array(last), 16), expected, np.int32)
        assert _free_list(a) == list(range(8, 17))  # pages 3..7 taken as one block
        assert a.available_size() == 36  # 9 pages * 4
        a.restore_state(state)


def test_alloc_extend_page_size_1() -> None:
    a = _paged(8, 1)
    # ps 1: no partial pages; every token is a new page. prefix 2 -> 4 (2 pages), 0 -> 1 (1 page).
    _eq(a.alloc_extend([2, 0], [4, 1], [9, -1], 3), [1, 2, 3], np.int32)
    assert _free_list(a) == [4, 5, 6, 7, 8]


def test_alloc_extend_list_inputs_and_int32() -> None:
    a = _paged(32, 4)
    # prefix 3 (last_loc 14, 15 % 4 = 3), seq 9: rest 1 slot (15), then page 1 whole (4..7), then 1 slot of page 2 (8).
    _eq(a.alloc_extend([3], [9], [14], 6), [15, 4, 5, 6, 7, 8], np.int32)
    _eq(
        a.alloc_extend(np.array([3], np.int32), np.array([9], np.int32), np.array([14], np.int32), 6),
        [15, 12, 13, 14, 15, 16],  # same request on pages 3, 4
        np.int32,
    )


def test_alloc_extend_no_new_pages() -> None:
    a = _paged(16, 4)
    _eq(a.alloc_extend([3], [3], [2], 0), [], np.int32)  # extend 0: empty, nothing taken
    _eq(a.alloc_extend([1, 2], [3, 4], [4, 9], 4), [5, 6, 10, 11], np.int32)  # both within their current pages
    assert _free_list(a) == [1, 2, 3, 4]


def test_alloc_extend_merge_and_none() -> None:
    a = _paged(8, 2)  # pages 1..4
    _eq(a.alloc(6), [2, 3, 4, 5, 6, 7], np.int64)  # pages 1, 2, 3
    a.free(np.array([3]))  # part of page 1: page 1 released
    # 3 pages needed (ceil(5/2) = 3), 1 free: merge to [1, 4], still short: None.
    assert a.alloc_extend([0], [5], [-1], 5) is None
    assert _free_list(a) == [1, 4]
    assert _released(a) == []
    # 2 pages needed (ceil(4/2) = 2): pages 1 and 4.
    _eq(a.alloc_extend([0], [4], [-1], 4), [2, 3, 8, 9], np.int32)
    assert a.available_size() == 0


def test_alloc_extend_merges_when_short_and_served() -> None:
    a = _paged(8, 2)
    a.alloc(8)  # all 4 pages
    a.free(np.array([6, 2]))  # pages 3 and 1 released
    # 1 page needed, free list empty: merge to [1, 3], take page 1.
    _eq(a.alloc_extend([0], [1], [-1], 1), [2], np.int32)
    assert _free_list(a) == [3]
    assert _released(a) == []


def test_alloc_extend_debug_assert() -> None:
    a = _paged(32, 4, debug_mode=True)
    with pytest.raises(AssertionError):
        a.alloc_extend([6], [8], [10], 2)  # (10 + 1) % 4 = 3 != 6 % 4 = 2
    assert _free_list(a) == list(range(1, 9))
    a.debug_mode = False
    # Unchecked: the rest of the page, ceil(6/4)*4 - 6 = 2 slots, counted from last_loc + 1 = 11.
    _eq(a.alloc_extend([6], [8], [10], 2), [11, 12], np.int32)


# -- alloc_decode ------------------------------------------------------------


def test_alloc_decode_with_new_pages() -> None:
    a = _paged(32, 4)  # pages 1..8
    seq = [5, 7, 1, 8]
    # (last_loc + 2) % 4 == seq % 4: 9%4=1=5%4, 11%4=3=7%4, 1%4=1=1%4, 16%4=0=8%4.
    last = [7, 9, -1, 14]
    # New page when ceil(seq/4) > ceil((seq-1)/4): 5: 2>1 yes; 7: 2=2 no; 1: 1>0 yes; 8: 2=2 no.
    for debug in (False, True):
        a.debug_mode = debug
        state = a.backup_state()
        # req 0: first new page (1) -> slot 4; req 1: 9+1 = 10; req 2: second new page (2) -> 8; req 3: 14+1 = 15.
        _eq(a.alloc_decode(np.array(seq), np.array(last)), [4, 10, 8, 15], np.int32)
        assert _free_list(a) == [3, 4, 5, 6, 7, 8]
        a.restore_state(state)


def test_alloc_decode_without_new_pages() -> None:
    a = _paged(32, 4)
    _eq(a.alloc_decode([7, 8], [9, 14]), [10, 15], np.int32)  # last_loc + 1 each
    assert _free_list(a) == list(range(1, 9))
    assert a.available_size() == 32


def test_alloc_decode_page_size_1() -> None:
    a = _paged(4, 1)
    _eq(a.alloc_decode([3, 5], [1, 2]), [1, 2], np.int32)  # ps 1: every token a new page, page p = slot p
    assert _free_list(a) == [3, 4]


def test_alloc_decode_merge_and_none() -> None:
    a = _paged(8, 2)  # pages 1..4
    a.alloc(6)  # pages 1, 2, 3
    a.free(np.array([4, 5]))  # page 2 released
    # seq 3 and 5 both start a page (ceil(3/2)=2 > 1, ceil(5/2)=3 > 2): 2 pages, 1 free -> merge [2, 4].
    _eq(a.alloc_decode([3, 5], [-1, -1]), [4, 8], np.int32)  # pages 2, 4
    assert _free_list(a) == []
    assert a.alloc_decode([1], [-1]) is None  # 1 page needed, none anywhere
    _eq(a.alloc_decode([2], [6]), [7], np.int32)  # ceil(2/2) = ceil(1/2) = 1: no page needed, 6 + 1


def test_alloc_decode_debug_assert() -> None:
    a = _paged(32, 4, debug_mode=True)
    with pytest.raises(AssertionError):
        a.alloc_decode([6], [9])  # (9 + 2) % 4 = 3 != 6 % 4 = 2
    assert _free_list(a) == list(range(1, 9))


# -- free ----------------------------------------------------------------------


def test_free_partial_and_already_free_pages() -> None:
    a = _paged(32, 4)  # pages 1..8
    _eq(a.alloc(12), list(range(4, 16)), np.int64)  # pages 1, 2, 3
    a.free(np.array([5]))  # one slot of page 1: the whole page is released
    assert (_free_list(a), _released(a)) == ([4, 5, 6, 7, 8], [1])
    assert a.available_size() == 24  # (5 + 1) * 4
    a.free(np.array([4, 6, 7]))  # page 1 again: already released, ignored
    assert _released(a) == [1]
    a.free(np.array([9, 10, 13], dtype=np.int32))  # 9//4 = 2, 10//4 = 2, 13//4 = 3: pages 2, 3
    assert _released(a) == [1, 2, 3]
    assert a.release_pages[0].dtype == np.int32
    a.free(np.array([20, 33], dtype=np.uint16))  # pages 5 and 8: on the free list, ignored
    assert _released(a) == [1, 2, 3]
    assert _free_list(a) == [4, 5, 6, 7, 8]
    a.free(np.array([], dtype=np.int64))  # empty: no-op
    a.free([])
    assert a.available_size() == 32
    a.merge_and_sort_free()
    assert _free_list(a) == [1, 2, 3, 4, 5, 6, 7, 8]


def test_free_silent_corruption_kept() -> None:
    a = _paged(8, 2)  # pages 1..4
    a.free(np.array([0, 1]))  # page 0 (padding): the original accepts it
    a.free(np.array([10]))  # page 5, beyond pages_per_rank = 4: accepted too
    assert _released(a) == [0, 5]
    assert a.available_size() == 12  # (4 + 2) * 2
    a.merge_and_sort_free()
    assert _free_list(a) == [0, 1, 2, 3, 4, 5]
    _eq(a.alloc(2), [0, 1], np.int64)  # the padding page handed out


# -- free groups ---------------------------------------------------------------


def test_free_groups_per_rank() -> None:
    a = _paged(16, 2, dp_size=2)  # 4 pages per rank
    _eq(a.alloc(6, dp_rank=0), [2, 3, 4, 5, 6, 7], np.int64)  # rank 0 pages 1, 2, 3
    _eq(a.alloc(4, dp_rank=1), [2, 3, 4, 5], np.int64)  # rank 1 pages 1, 2 (rank-local ids)
    a.free_group_begin()
    assert a.is_not_in_free_group is False
    a.free(np.array([6]), dp_rank=0)  # page 3
    a.free(np.array([4, 5]), dp_rank=1)  # page 2
    a.free(np.array([2, 7]), dp_rank=0)  # pages 1, 3
    a.free(np.array([], dtype=np.int64), dp_rank=1)  # empty: not stored
    assert [len(g) for g in a.free_group] == [2, 1]
    assert [x.tolist() for x in a.free_group[0]] == [[6], [2, 7]]
    assert _released(a, 0) == []
    assert _released(a, 1) == []
    assert (a.available_size(0), a.available_size(1)) == (2, 4)  # 1 page * 2, 2 pages * 2
    a.free_group_end()
    assert a.is_not_in_free_group is True
    assert a.free_group == [[], []]
    assert _released(a, 0) == [1, 3]  # [6, 2, 7] in one free: pages {3, 1}
    assert _released(a, 1) == [2]
    assert (a.available_size(0), a.available_size(1)) == (6, 6)  # (1 + 2) * 2, (2 + 1) * 2
    assert _free_list(a, 0) == [4]
    assert _free_list(a, 1) == [3, 4]
    a.free_group_end()  # outside a group: nothing
    assert _released(a, 0) == [1, 3]


def test_free_group_end_is_one_free_call_per_rank() -> None:
    a = _paged(8, 2)
    a.alloc(4)  # pages 1, 2
    a.free_group_begin()
    a.free(np.array([2]))  # page 1, pending
    a.free(np.array([3]))  # page 1 again, pending
    a.free(np.array([4]))  # page 2
    a.free_group_end()
    assert a.release_pages[0].tolist() == [1, 2]  # one call: unique pages 1, 2, each once
    assert a.available_size() == 8


# -- backup / restore, clear -----------------------------------------------------


def test_backup_restore() -> None:
    a = _paged(8, 2)  # pages 1..4
    a.alloc(2)  # page 1
    a.free(np.array([2]))  # page 1 released
    free_copies, release_copies = a.backup_state()
    assert [x.tolist() for x in free_copies] == [[2, 3, 4]]
    assert [x.tolist() for x in release_copies] == [[1]]
    _eq(a.alloc(4), [4, 5, 6, 7], np.int64)  # pages 2, 3
    a.free(np.array([4]))  # page 2
    assert free_copies[0].tolist() == [2, 3, 4]  # the backup is a copy
    for _ in range(2):  # a state can be restored more than once
        a.restore_state((free_copies, release_copies))
        assert (_free_list(a), _released(a)) == ([2, 3, 4], [1])
        assert a.available_size() == 8
        # 4 pages > 3 free: merge to [1, 2, 3, 4], then slots 2..9.
        _eq(a.alloc(8), [2, 3, 4, 5, 6, 7, 8, 9], np.int64)


def test_clear_one_rank_and_all() -> None:
    a = _paged(16, 2, dp_size=2)  # pages 1..4 per rank
    a.alloc(4, dp_rank=0)  # rank 0 pages 1, 2
    a.alloc(6, dp_rank=1)  # rank 1 pages 1, 2, 3
    a.free(np.array([2]), dp_rank=0)  # rank 0 page 1 released
    a.free(np.array([2]), dp_rank=1)  # rank 1 page 1 released
    a.free_group_begin()
    a.free(np.array([4]), dp_rank=0)  # pending on rank 0
    a.free(np.array([4]), dp_rank=1)  # pending on rank 1
    a.clear(dp_rank=0)
    assert a.is_not_in_free_group is True  # left the group
    assert (_free_list(a, 0), _released(a, 0), a.free_group[0]) == ([1, 2, 3, 4], [], [])
    assert a.available_size(0) == 8
    # Rank 1 untouched, its pending free kept (Ambiguity 10).
    assert (_free_list(a, 1), _released(a, 1)) == ([4], [1])
    assert [x.tolist() for x in a.free_group[1]] == [[4]]
    a.free_group_end()  # frees rank 1's pending page 2
    assert _released(a, 1) == [1, 2]
    a.alloc(2, dp_rank=0)
    a.free_group_begin()
    a.free(np.array([6]), dp_rank=1)
    a.clear()
    assert a.is_not_in_free_group is True
    assert a.free_group == [[], []]
    for r in (0, 1):
        assert (_free_list(a, r), _released(a, r)) == ([1, 2, 3, 4], [])
        assert a.available_size(r) == 8


def test_dp_ranks_are_independent() -> None:
    a = _paged(24, 4, dp_size=2)  # num_pages 6, pages_per_rank 3, size_per_rank 12
    assert (a.size_per_rank, a.pages_per_rank) == (12, 3)
    _eq(a.alloc(8, dp_rank=1), [4, 5, 6, 7, 8, 9, 10, 11], np.int64)  # rank 1 pages 1, 2
    assert _free_list(a, 0) == [1, 2, 3]  # rank 0 untouched
    _eq(a.alloc(4, dp_rank=0), [4, 5, 6, 7], np.int64)  # rank-local page 1 again
    a.free(np.array([9]), dp_rank=1)  # rank 1 page 2
    assert _released(a, 0) == []
    assert _released(a, 1) == [2]
    assert a.alloc(12, dp_rank=0) is None  # rank 0 has 2 pages; rank 1's do not count
    _eq(a.alloc_decode([1], [-1], dp_rank=1), [12], np.int32)  # rank 1 page 3 (free list before release)
    _eq(a.alloc_extend([0], [8], [-1], 8, dp_rank=0), [8, 9, 10, 11, 12, 13, 14, 15], np.int32)  # rank 0 pages 2, 3
    assert (a.available_size(0), a.available_size(1)) == (0, 4)


def test_kvcache_forwarding() -> None:
    class FakeCache:
        def __init__(self) -> None:
            self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

        def get_cpu_copy(self, *args: Any, **kwargs: Any) -> str:
            self.calls.append(("get", args, kwargs))
            return "copy"

        def load_cpu_copy(self, *args: Any, **kwargs: Any) -> str:
            self.calls.append(("load", args, kwargs))
            return "loaded"

    for alloc in (PagedTokenToKVPoolAllocator(8, 2, FakeCache()), TokenToKVPoolAllocator(8, FakeCache())):
        cache = alloc.get_kvcache()
        assert isinstance(cache, FakeCache)
        assert alloc.get_cpu_copy(1) == "copy"
        assert alloc.load_cpu_copy("c", indices=3) == "loaded"
        assert cache.calls == [("get", (1,), {}), ("load", ("c", 3), {})]  # passed on as (kv_cache_cpu, indices)
    swa = SWATokenToKVPoolAllocator(8, 8, SimpleNamespace(full_kv_pool=None, swa_kv_pool=None))
    for name in ("get_cpu_copy", "load_cpu_copy"):  # the base class's: the SWA allocator does not forward
        with pytest.raises(NotImplementedError, match=f"^{name} not implemented for JAX$"):
            getattr(swa, name)(1)


def test_what_the_base_class_gives_each_allocator() -> None:
    """debug_print, merge_and_sort_free and the batch calls as sglang-jax's base class gives them."""
    paged, token = PagedTokenToKVPoolAllocator(16, 4, None), TokenToKVPoolAllocator(8, None)
    swa = SWATokenToKVPoolAllocator(8, 8, SimpleNamespace(full_kv_pool=None, swa_kv_pool=None))
    for alloc in (paged, token, swa):
        assert isinstance(alloc, BaseTokenToKVPoolAllocator)
    assert paged.debug_print() == token.debug_print() == ""
    assert (token.free_pages, token.release_pages, token.origin_size) == (None, None, 8)
    assert (swa.free_pages, swa.release_pages, swa.size, swa.size_per_rank) == (None, None, 8, 8)
    for alloc in (token, swa):  # no page lists: the inherited merge fails on them
        with pytest.raises(TypeError):
            alloc.merge_and_sort_free()
    batches = {"alloc_extend": ([0], [1], [-1], 1), "alloc_decode": ([1], [-1])}
    for name, args in batches.items():
        for alloc in (token, swa):  # the SWA allocator's through its token sub-allocator
            with pytest.raises(NotImplementedError, match=f"^{name} is only for paged allocator$"):
                getattr(alloc, name)(*args)


# -- token allocator -------------------------------------------------------------


def test_token_allocator_order_and_double_free() -> None:
    t = TokenToKVPoolAllocator(6, kvcache=None)
    assert (t.size, t.page_size, t.dp_size, t.size_per_rank) == (6, 1, 1, 6)
    _eq(t.free_slots[0], [1, 2, 3, 4, 5, 6], np.int32)  # slots 1..size_per_rank
    _eq(t.alloc(0), [], np.int32)
    got = t.alloc(2)
    _eq(got, [1, 2], np.int32)
    got[0] = 99  # an int32 copy: the pool does not see it
    _eq(t.free_slots[0], [3, 4, 5, 6], np.int32)
    assert t.alloc(5) is None  # 4 left
    assert t.available_size() == 4
    t.free(np.array([2], dtype=np.int64))  # appended at the end, cast to int32
    _eq(t.free_slots[0], [3, 4, 5, 6, 2], np.int32)
    t.free(np.array([2]))  # double free: silently on the list twice
    t.free(np.array([], dtype=np.int64))  # empty: no-op
    _eq(t.free_slots[0], [3, 4, 5, 6, 2, 2], np.int32)
    assert t.available_size() == 6
    _eq(t.alloc(6), [3, 4, 5, 6, 2, 2], np.int32)
    t.free(np.array([5, 1, 3]))  # no sort
    _eq(t.alloc(3), [5, 1, 3], np.int32)


def test_token_allocator_groups_backup_clear_dp() -> None:
    t = TokenToKVPoolAllocator(8, kvcache=None, dp_size=2)  # 4 slots per rank
    assert t.size_per_rank == 4
    _eq(t.alloc(3, dp_rank=0), [1, 2, 3], np.int32)
    _eq(t.alloc(2, dp_rank=1), [1, 2], np.int32)  # rank-local slots
    state = t.backup_state()
    assert [s.tolist() for s in state] == [[4], [3, 4]]
    t.free_group_begin()
    t.free(np.array([1]), dp_rank=0)
    t.free(np.array([3, 2]), dp_rank=0)
    t.free(np.array([2]), dp_rank=1)
    _eq(t.free_slots[0], [4], np.int32)  # deferred
    t.free_group_end()
    assert t.is_not_in_free_group is True
    assert t.free_group == [[], []]
    _eq(t.free_slots[0], [4, 1, 3, 2], np.int32)  # rank 0's pending arrays concatenated, appended
    _eq(t.free_slots[1], [3, 4, 2], np.int32)
    t.restore_state(state)
    _eq(t.free_slots[0], [4], np.int32)
    _eq(t.free_slots[1], [3, 4], np.int32)
    t.free_group_begin()
    t.free(np.array([1]), dp_rank=1)
    t.clear(dp_rank=1)
    assert t.is_not_in_free_group is True
    assert t.free_group == [[], []]
    _eq(t.free_slots[1], [1, 2, 3, 4], np.int32)
    _eq(t.free_slots[0], [4], np.int32)  # rank 0 untouched
    t.clear()
    assert (t.available_size(0), t.available_size(1)) == (4, 4)


# -- the sliding-window allocator (docs/behaviour.md, section 3) ---------------------------------------


class _HybridPool:
    """A hybrid KV pool as the SWA allocator reads it: two sub-pools, and the mapping it is given."""

    def __init__(self) -> None:
        self.full_kv_pool = object()
        self.swa_kv_pool = object()
        self.full_to_swa_index_mapping: Any = None


def test_swa_builds_its_sub_allocators_and_hands_out_its_mapping() -> None:
    kv = _HybridPool()
    a = SWATokenToKVPoolAllocator(64, 16, kv)
    assert type(a.full_attn_allocator) is TokenToKVPoolAllocator
    assert type(a.swa_attn_allocator) is TokenToKVPoolAllocator
    assert a.full_attn_allocator.get_kvcache() is kv.full_kv_pool
    assert a.swa_attn_allocator.get_kvcache() is kv.swa_kv_pool
    assert (a.size_full, a.size_swa, a.get_kvcache()) == (64, 16, kv)
    mapping = a.full_to_swa_index_mapping
    assert kv.full_to_swa_index_mapping is mapping
    assert mapping.dtype == np.int32
    assert mapping.shape == (64 + 1,)
    paged = SWATokenToKVPoolAllocator(64, 32, _HybridPool(), page_size=4, dp_size=2)
    assert type(paged.full_attn_allocator) is PagedTokenToKVPoolAllocator
    assert paged.full_attn_allocator.debug_mode is False
    assert [m.shape for m in paged.full_to_swa_index_mapping] == [(32 + 4,), (32 + 4,)]
    assert paged.debug_print(1) == "#swa-available-size: 16, #full-attn-available-size: 32, "


def test_swa_alloc_maps_full_slots_to_swa_slots_and_free_unmaps_both() -> None:
    a = SWATokenToKVPoolAllocator(16, 4, _HybridPool())
    full = a.alloc(3)
    _eq(full, [1, 2, 3], np.int32)
    mapping = a.full_to_swa_index_mapping
    assert mapping[[1, 2, 3]].tolist() == [1, 2, 3]
    assert a.available_size() == 1  # the smaller of the two
    assert a.alloc(2) is None  # the SWA side has 1: refused before anything is taken
    assert a.full_available_size() == 13
    a.free_swa([2])  # the token left the window: its SWA slot goes, the full slot stays
    assert mapping[[1, 2, 3]].tolist() == [1, 0, 3]
    assert (a.swa_available_size(), a.full_available_size()) == (2, 13)
    assert a.count_swa_mapped([1, 2, 3]) == 2
    a.free(full)
    assert a.count_swa_mapped([1, 2, 3]) == 0
    assert a.full_attn_allocator.free_slots[0].tolist()[-3:] == [1, 2, 3]
    assert a.swa_attn_allocator.free_slots[0].tolist() == [4, 2, 1, 3]


def test_swa_extend_and_decode_map_last_loc_and_free_the_full_slots_when_the_swa_side_refuses() -> None:
    a = SWATokenToKVPoolAllocator(64, 16, _HybridPool(), page_size=4)
    out = a.alloc_extend([0], [6], [-1], 6)
    _eq(out, [4, 5, 6, 7, 8, 9], np.int32)
    mapping = a.full_to_swa_index_mapping
    assert mapping[out].tolist() == [4, 5, 6, 7, 8, 9]
    new = a.alloc_decode([7], [9])  # last_loc 9 maps to SWA slot 9
    _eq(new, [10], np.int32)
    assert mapping[10] == 10
    # 3 pages more: the full side serves them, the SWA side (4 pages, 2 free) refuses,
    # and the full slots are freed again: to the release list.
    assert a.alloc_extend([0], [12], [-1], 12) is None
    assert sorted(a.full_attn_allocator.release_pages[0].tolist()) == [3, 4, 5]


def test_swa_frees_in_a_group_at_its_end_and_refuses_snapshots() -> None:
    a = SWATokenToKVPoolAllocator(16, 8, _HybridPool(), dp_size=2)
    x = a.alloc(2, 1)
    a.free_group_begin()
    a.free(x, 1)
    assert a.count_swa_mapped(x, 1) == 2  # pending
    a.free_group_end()
    assert a.count_swa_mapped(x, 1) == 0
    assert a.full_available_size(1) == 8
    with pytest.raises(NotImplementedError):
        a.backup_state()
    a.alloc(3)
    a.clear(0)
    assert a.full_available_size(0) == 8
    assert not a.full_to_swa_index_mapping[0].any()
