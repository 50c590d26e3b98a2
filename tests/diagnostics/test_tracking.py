"""Tracking (``track=True``): who holds each page, and where a double-freed page came from.

Every site string is computed from this file's own frames (``__file__``,
the calling line, the test function's name), so a site capture that stops
one frame too early (inside hostpool_nb) or too late (in pytest) fails. The
expected report texts are the library's, spelled out in full.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import random
import sys
import threading
import types
from typing import Any

import numpy as np
import pytest

from hostpool_nb import DoubleFreeError, HostPoolError, LogicalHostPool, PoolState
from hostpool_nb._kernels import layout as L

PS = 16


def line() -> int:
    """The line number of the call to this function."""
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno


def at(lineno: int, function: str) -> str:
    """A site string in this file."""
    return f"{__file__}:{lineno} in {function}"


def page(p: int, ps: int = PS) -> np.ndarray:
    return np.arange(p * ps, (p + 1) * ps, dtype=np.int64)


def grab(pool: Any, n: int, tag: Any = None) -> Any:
    return pool.alloc(n, tag=tag)  # a helper outside hostpool_nb is a site of its own


GRAB_LINE = grab.__code__.co_firstlineno + 1


def rows(pool: LogicalHostPool) -> list[tuple[Any, ...]]:
    """outstanding() as comparable tuples: (site, tag, pages, slots, oldest, allocations)."""
    return [(r.site, r.tag, r.pages, r.slots, r.oldest, r.allocations) for r in pool.outstanding()]


def site_table_len(pool: LogicalHostPool) -> int:
    tracker = pool._tracker
    assert tracker is not None
    return len(tracker.table())


# -- site strings ---------------------------------------------------------------


def test_site_is_the_calling_line_of_this_file() -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    got, ln = pool.alloc(PS), line()
    assert got is not None
    (rec,) = pool.outstanding()
    assert rec.site == at(ln, "test_site_is_the_calling_line_of_this_file")
    assert (rec.file, rec.line, rec.function) == (__file__, ln, "test_site_is_the_calling_line_of_this_file")
    assert rec.tag is None


def test_site_of_a_helper_lambda_and_alloc_many() -> None:
    pool = LogicalHostPool(8 * PS, PS, track=True)
    assert grab(pool, PS) is not None
    take = lambda n: pool.alloc(n, tag="lambda")  # noqa: E731 - a lambda frame is a site too
    assert take(2 * PS) is not None
    ln_take = line() - 2
    got, ln_many = pool.alloc_many([PS, 2 * PS, 0]), line()
    assert got is not None
    assert rows(pool) == [
        (at(ln_many, "test_site_of_a_helper_lambda_and_alloc_many"), None, 3, 3 * PS, 3, 1),
        (at(ln_take, "<lambda>"), "lambda", 2, 2 * PS, 2, 1),
        (at(GRAB_LINE, "grab"), None, 1, PS, 1, 1),
    ]


def test_sites_stay_in_the_caller_while_recording(tmp_path: Any) -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    with pool.recording(tmp_path / "t.npz"):
        a, ln_a = pool.alloc(PS, tag="rec"), line()
        b, ln_b = pool.alloc_many([PS], tag="many"), line()
        assert a is not None
        assert b is not None
        assert pool.free(a) == PS
        ln_free = line() - 1
        with pytest.raises(DoubleFreeError) as info:
            pool.free(a)
    name = "test_sites_stay_in_the_caller_while_recording"
    assert rows(pool) == [(at(ln_b, name), "many", 1, PS, 2, 1)]
    assert str(info.value).endswith(
        f"; it was allocated at {at(ln_a, name)} with tag 'rec' (allocation #1), then freed at {at(ln_free, name)}"
    )


def test_site_in_a_module_whose_name_starts_like_the_package() -> None:
    module = types.ModuleType("hostpool_nb_helpers")
    source = "def grab(pool, n):\n    return pool.alloc(n)\n"
    exec(compile(source, "/virtual/hostpool_nb_helpers.py", "exec"), module.__dict__)
    pool = LogicalHostPool(4 * PS, PS, track=True)
    assert module.grab(pool, PS) is not None
    assert pool.outstanding()[0].site == "/virtual/hostpool_nb_helpers.py:2 in grab"


# -- tags -----------------------------------------------------------------------


def test_tags_of_every_hashable_kind_group_apart() -> None:
    pool = LogicalHostPool(16 * PS, PS, track=True)
    tags: list[Any] = [None, 7, "req-7", ("req", 7), frozenset({1}), 7, None]
    ln = line() + 2
    for tag in tags:
        assert pool.alloc(PS, tag=tag) is not None
    site = at(ln, "test_tags_of_every_hashable_kind_group_apart")
    assert rows(pool) == [
        (site, None, 2, 2 * PS, 1, 2),
        (site, 7, 2, 2 * PS, 2, 2),
        (site, "req-7", 1, PS, 3, 1),
        (site, ("req", 7), 1, PS, 4, 1),
        (site, frozenset({1}), 1, PS, 5, 1),
    ]


@pytest.mark.parametrize(
    ("tag", "text"),
    [
        pytest.param([1], "list [1]", id="list"),
        pytest.param({"r": 1}, "dict {'r': 1}", id="dict"),
        pytest.param(("req", [1]), "tuple ('req', [1])", id="tuple-holding-a-list"),
    ],
)
@pytest.mark.parametrize("call", ["alloc", "alloc_many"])
def test_unhashable_tag_is_a_type_error_and_changes_nothing(
    tag: Any, text: str, call: str, snapshot: Any, unchanged: Any
) -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    assert pool.alloc(PS, tag="kept") is not None
    before, table, held = snapshot(pool), site_table_len(pool), rows(pool)
    method = pool.alloc if call == "alloc" else pool.alloc_many
    with pytest.raises(TypeError) as info:
        method(PS if call == "alloc" else [PS, PS], tag=tag)
    assert str(info.value) == f"tag must be hashable, got {text}"
    unchanged(pool, before)
    assert site_table_len(pool) == table
    assert rows(pool) == held
    assert pool.stats().alloc_calls == 1


def test_tag_is_accepted_and_ignored_without_tracking() -> None:
    pool = LogicalHostPool(4 * PS, PS)
    a = pool.alloc(PS, tag=[1, 2])  # unhashable: never looked at
    b = pool.alloc_many([PS], tag={"x": 1})
    assert a is not None
    assert b is not None
    assert a.tolist() == page(0).tolist()
    assert b[0].tolist() == page(1).tolist()
    assert pool._tracker is None
    assert pool._st.shape[0] == L.state_length(4)
    with pytest.raises(HostPoolError) as info:
        pool.outstanding()
    assert str(info.value) == (
        "outstanding() needs a tracking pool: construct it with track=True "
        "(leak_report() still says how much is allocated)"
    )


@pytest.mark.parametrize("track", [1, 0, "yes", np.bool_(True)])
def test_track_must_be_a_bool_or_none(track: Any) -> None:
    with pytest.raises(TypeError) as info:
        LogicalHostPool(4 * PS, PS, track=track)
    assert str(info.value) == f"track must be True, False or None, got {type(track).__name__} {track!r}"


# -- outstanding() --------------------------------------------------------------


def test_outstanding_groups_orders_and_follows_frees() -> None:
    ps = 4
    pool = LogicalHostPool(24 * ps, ps, track=True)
    name = "test_outstanding_groups_orders_and_follows_frees"
    loop: list[np.ndarray] = []
    ln_loop = line() + 2
    for tag in ["a", "b", "a", None, ("t", 1), 7]:
        got = pool.alloc(2 * ps, tag=tag)  # allocations #1..#6, two pages each
        assert got is not None
        loop.append(got)
    big, ln_big = pool.alloc(3 * ps, tag="a"), line()  # #7
    batch, ln_many = pool.alloc_many([ps, 0, 2 * ps], tag="m"), line()  # #8: one allocation
    assert big is not None
    assert batch is not None
    s_loop, s_big, s_many = at(ln_loop, name), at(ln_big, name), at(ln_many, name)
    assert rows(pool) == [
        (s_loop, "a", 4, 4 * ps, 1, 2),
        (s_big, "a", 3, 3 * ps, 7, 1),
        (s_many, "m", 3, 3 * ps, 8, 1),
        (s_loop, "b", 2, 2 * ps, 2, 1),
        (s_loop, None, 2, 2 * ps, 4, 1),
        (s_loop, ("t", 1), 2, 2 * ps, 5, 1),
        (s_loop, 7, 2, 2 * ps, 6, 1),
    ]
    for r in pool.outstanding():
        assert r.slots == r.pages * ps
        assert r.file == __file__
        assert r.function == name
        assert r.site == f"{r.file}:{r.line} in {r.function}"

    # A partial free of #1: the group keeps both allocations and its oldest.
    assert pool.free(loop[0][:ps]) == ps
    assert rows(pool)[:3] == [
        (s_loop, "a", 3, 3 * ps, 1, 2),
        (s_big, "a", 3, 3 * ps, 7, 1),
        (s_many, "m", 3, 3 * ps, 8, 1),
    ]
    # All of #1: #3 is now the oldest and only allocation; ties go oldest first.
    assert pool.free(loop[0][ps:]) == ps
    # Request 0 of the batch: the batch is one allocation, partly freed.
    slots, offsets = batch
    assert pool.free(slots[offsets[0] : offsets[1]]) == ps
    assert rows(pool) == [
        (s_big, "a", 3, 3 * ps, 7, 1),
        (s_loop, "b", 2, 2 * ps, 2, 1),
        (s_loop, "a", 2, 2 * ps, 3, 1),
        (s_loop, None, 2, 2 * ps, 4, 1),
        (s_loop, ("t", 1), 2, 2 * ps, 5, 1),
        (s_loop, 7, 2, 2 * ps, 6, 1),
        (s_many, "m", 2, 2 * ps, 8, 1),
    ]
    # Pages recycled by a later allocation belong to it only.
    again, ln_again = pool.alloc(6 * ps, tag="b"), line()  # #9
    assert again is not None
    assert rows(pool)[0] == (at(ln_again, name), "b", 6, 6 * ps, 9, 1)
    assert sum(r.pages for r in pool.outstanding()) == pool.stats().allocated_pages == 21
    pool.check_invariants()

    pool.clear()
    assert pool.outstanding() == []
    # Numbers keep counting after clear().
    got, ln_after = pool.alloc(ps), line()
    assert got is not None
    assert rows(pool) == [(at(ln_after, name), None, 1, ps, 10, 1)]


def test_only_allocations_that_hand_out_pages_are_numbered() -> None:
    pool = LogicalHostPool(2 * PS, PS, track=True)
    assert pool.alloc(0).shape == (0,)  # nothing handed out: no number
    empty = pool.alloc_many([])
    assert empty is not None
    assert empty[0].shape == (0,)
    assert pool.alloc(3 * PS) is None  # refused: no number
    assert pool.alloc_many([PS, 2 * PS]) is None
    got, ln = pool.alloc(PS), line()
    assert got is not None
    assert rows(pool) == [(at(ln, "test_only_allocations_that_hand_out_pages_are_numbered"), None, 1, PS, 1, 1)]
    assert int(pool._st[L.H_SEQ]) == 2


def test_outstanding_of_an_empty_and_of_a_zero_size_pool() -> None:
    assert LogicalHostPool(4 * PS, PS, track=True).outstanding() == []
    zero = LogicalHostPool(0, PS, track=True)
    assert zero.alloc(0) is not None
    assert zero.outstanding() == []
    zero.check_invariants()


# -- leak_report() --------------------------------------------------------------


def test_leak_report_table() -> None:
    pool = LogicalHostPool(8 * PS, PS, track=True)
    name = "test_leak_report_table"
    ln_loop = line() + 2
    for tag in ["req-1", ("batch", 12), "req-1"]:
        assert pool.alloc(PS, tag=tag) is not None
    many, ln_many = pool.alloc_many([2 * PS, PS]), line()
    assert many is not None
    loop, batch = at(ln_loop, name), at(ln_many, name)
    assert pool.leak_report() == (
        "LogicalHostPool(size=128, page_size=16): 6 pages (96 slots) allocated, "
        "by 4 allocations in 3 groups (call site, tag):\n"
        "  pages  slots  allocs  oldest  tag            site\n"
        f"      3     48       1      #4  None           {batch}\n"
        f"      2     32       2      #1  'req-1'        {loop}\n"
        f"      1     16       1      #2  ('batch', 12)  {loop}"
    )
    assert pool.leak_report(limit=1) == (
        "LogicalHostPool(size=128, page_size=16): 6 pages (96 slots) allocated, "
        "by 4 allocations in 3 groups (call site, tag):\n"
        "  pages  slots  allocs  oldest  tag   site\n"
        f"      3     48       1      #4  None  {batch}\n"
        "  ... and 2 more groups holding 3 pages (limit=1)"
    )
    assert pool.leak_report(limit=0) == (
        "LogicalHostPool(size=128, page_size=16): 6 pages (96 slots) allocated, "
        "by 4 allocations in 3 groups (call site, tag):\n"
        "  pages  slots  allocs  oldest  tag  site\n"
        "  ... and 3 more groups holding 6 pages (limit=0)"
    )
    assert pool.leak_report(limit=3) == pool.leak_report() == pool.leak_report(limit=np.int64(99))


@pytest.mark.parametrize("track", [True, False])
def test_leak_report_when_nothing_is_allocated(track: bool) -> None:
    pool = LogicalHostPool(4 * PS, PS, track=track)
    expected = "LogicalHostPool(size=64, page_size=16): no pages are allocated; nothing is outstanding."
    assert pool.leak_report() == expected
    got = pool.alloc(2 * PS)
    assert got is not None
    assert pool.free(got) == 2 * PS
    assert pool.leak_report() == expected
    assert pool.alloc(PS) is not None
    pool.clear()
    assert pool.leak_report(limit=0) == expected


def test_leak_report_without_tracking_gives_totals_and_the_hint() -> None:
    pool = LogicalHostPool(6 * 4, 4)
    assert pool.alloc_many([8, 4]) is not None
    assert pool.leak_report() == (
        "LogicalHostPool(size=24, page_size=4): 3 pages (12 slots) allocated; "
        "the pool does not track where: construct it with track=True to see the call sites."
    )


@pytest.mark.parametrize(
    ("limit", "error", "text"),
    [
        pytest.param(-1, HostPoolError, "limit must be non-negative, got limit=-1", id="negative"),
        pytest.param(1.0, TypeError, "limit must be an integer, got float 1.0", id="float"),
        pytest.param(True, TypeError, "limit must be an integer, got bool True", id="bool"),
        pytest.param("3", TypeError, "limit must be an integer, got str '3'", id="str"),
        pytest.param(None, TypeError, "limit must be an integer, got NoneType None", id="none"),
    ],
)
@pytest.mark.parametrize("track", [True, False])
def test_leak_report_bad_limit(limit: Any, error: type[Exception], text: str, track: bool) -> None:
    pool = LogicalHostPool(4 * PS, PS, track=track)
    with pytest.raises(error) as info:
        pool.leak_report(limit=limit)
    assert type(info.value) is error
    assert str(info.value) == text


# -- DoubleFreeError history ----------------------------------------------------

NOT_ALLOCATED = "is not allocated: it was freed already, freed by clear(), or never allocated"


def test_double_free_names_the_allocation_and_the_earlier_free() -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    name = "test_double_free_names_the_allocation_and_the_earlier_free"
    a, ln_a = pool.alloc(2 * PS, tag="req-9"), line()
    assert a is not None
    freed, ln_free = pool.free(a), line()
    assert freed == 2 * PS
    with pytest.raises(DoubleFreeError) as info:
        pool.free(a[PS:])
    assert str(info.value) == (
        f"page 1 (slots 16..31), freed at indices[0] (flattened), {NOT_ALLOCATED}; "
        f"it was allocated at {at(ln_a, name)} with tag 'req-9' (allocation #1), then freed at {at(ln_free, name)}"
    )
    # Handed out again, from another site without a tag: the history follows.
    b, ln_b = pool.alloc(3 * PS), line()  # pages 2, 3, then 0
    assert b is not None
    assert b[2 * PS :].tolist() == page(0).tolist()
    with pytest.raises(DoubleFreeError) as info:
        pool.free(np.concatenate([b[2 * PS :], b[2 * PS :]]))
    assert str(info.value) == (
        f"page 0 (slots 0..15) is freed twice in one call (again at indices[16], flattened); "
        f"it was allocated at {at(ln_b, name)} (allocation #2), then freed at {at(ln_free, name)}"
    )


def test_double_free_of_a_page_never_freed_before_has_no_free_site() -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    a, ln_a = pool.alloc(2 * PS, tag=3), line()
    assert a is not None
    with pytest.raises(DoubleFreeError) as info:
        pool.free(np.concatenate([a, page(1)]))
    assert str(info.value) == (
        "page 1 (slots 16..31) is freed twice in one call (again at indices[32], flattened); it was allocated at "
        f"{at(ln_a, 'test_double_free_of_a_page_never_freed_before_has_no_free_site')} with tag 3 (allocation #1)"
    )


def test_a_failed_free_records_no_free_site() -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    name = "test_a_failed_free_records_no_free_site"
    first = pool.alloc(PS)
    assert first is not None
    assert pool.free(first) == PS
    ln_free1 = line() - 1
    again, ln_again = pool.alloc(4 * PS), line()  # page 0 comes back last
    assert again is not None
    assert again[3 * PS :].tolist() == page(0).tolist()
    assert pool.free(again[:PS]) == PS  # page 1 is now free
    with pytest.raises(DoubleFreeError):
        pool.free(np.concatenate([page(0), page(1)]))  # page 0 is valid, page 1 is not: nothing is freed
    with pytest.raises(DoubleFreeError) as info:
        pool.free(np.concatenate([page(0), page(0)]))
    assert str(info.value).endswith(
        f"; it was allocated at {at(ln_again, name)} (allocation #2), then freed at {at(ln_free1, name)}"
    )


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("held", [16, 15, 8])
def test_a_free_that_stages_an_entry_for_every_page_records_its_site(ps: int, held: int) -> None:
    """Every page freed on its own ring entry (descending order): the ring full when all 16 are; its site kept."""
    name = "test_a_free_that_stages_an_entry_for_every_page_records_its_site"
    pool = LogicalHostPool(16 * ps, ps, track=True)
    slots, ln_a = pool.alloc(held * ps), line()
    assert slots is not None
    descending = np.concatenate([page(p, ps) for p in range(held - 1, -1, -1)])
    assert pool.free(descending) == held * ps
    ln_free = line() - 1
    for p in (0, held - 1):
        with pytest.raises(DoubleFreeError) as info:
            pool.free(page(p, ps))
        assert str(info.value).endswith(
            f"; it was allocated at {at(ln_a, name)} (allocation #1), then freed at {at(ln_free, name)}"
        )
    pool.check_invariants()


def test_double_free_after_clear_says_freed_by_clear() -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    name = "test_double_free_after_clear_says_freed_by_clear"
    a, ln_a = pool.alloc(2 * PS, tag=("r", 1)), line()
    assert a is not None
    assert pool.free(a[:PS]) == PS
    ln_free = line() - 1
    pool.clear()
    with pytest.raises(DoubleFreeError) as info:
        pool.free(a[PS:])
    assert str(info.value) == (
        f"page 1 (slots 16..31), freed at indices[0] (flattened), {NOT_ALLOCATED}; "
        f"it was allocated at {at(ln_a, name)} with tag ('r', 1) (allocation #1), then freed by clear()"
    )
    # clear() marks only the pages held then: page 0 was freed before it.
    with pytest.raises(DoubleFreeError) as info:
        pool.free(a[:PS])
    assert str(info.value).endswith(
        f"it was allocated at {at(ln_a, name)} with tag ('r', 1) (allocation #1), then freed at {at(ln_free, name)}"
    )


def test_double_free_inside_a_free_group() -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    name = "test_double_free_inside_a_free_group"
    a, ln_a = pool.alloc(PS), line()
    assert a is not None
    with pool.free_group():
        freed, ln_free = pool.free(a), line()
        assert freed == PS
        with pytest.raises(DoubleFreeError) as info:
            pool.free(a)
    assert str(info.value) == (
        f"page 0 (slots 0..15), freed at indices[0] (flattened), {NOT_ALLOCATED}; "
        f"it was allocated at {at(ln_a, name)} (allocation #1), then freed at {at(ln_free, name)}"
    )


def test_untracked_double_free_has_no_history() -> None:
    pool = LogicalHostPool(4 * PS, PS)
    a = pool.alloc(PS)
    assert a is not None
    assert pool.free(a) == PS
    with pytest.raises(DoubleFreeError) as info:
        pool.free(a)
    assert str(info.value) == f"page 0 (slots 0..15), freed at indices[0] (flattened), {NOT_ALLOCATED}"


def test_never_allocated_page_has_no_allocation_history() -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    with pytest.raises(DoubleFreeError) as info:
        pool.free(page(3))
    assert "allocated at" not in str(info.value).split(NOT_ALLOCATED)[1]


# -- the torch adapter ----------------------------------------------------------


@pytest.mark.torch
def test_torch_adapter_sites_skip_the_adapter_and_tags_pass_through() -> None:
    torch = pytest.importorskip("torch")
    from hostpool_nb.torch import LogicalHostPool as TorchPool

    pool = TorchPool(8 * PS, PS, track=True)
    name = "test_torch_adapter_sites_skip_the_adapter_and_tags_pass_through"
    a, ln_a = pool.alloc(torch.tensor(2 * PS), tag="t-1"), line()
    b, ln_b = pool.alloc_many(torch.tensor([PS, PS]), tag=("t", 2)), line()
    assert isinstance(a, torch.Tensor)
    assert b is not None
    assert rows(pool) == [
        (at(ln_a, name), "t-1", 2, 2 * PS, 1, 1),
        (at(ln_b, name), ("t", 2), 2, 2 * PS, 2, 1),
    ]
    freed, ln_free = pool.free(a), line()
    assert freed == 2 * PS
    with pytest.raises(DoubleFreeError) as info:
        pool.free(a[:PS])
    assert str(info.value).endswith(
        f"; it was allocated at {at(ln_a, name)} with tag 't-1' (allocation #1), then freed at {at(ln_free, name)}"
    )
    with pytest.raises(TypeError) as err:
        pool.alloc(PS, tag=[1])
    assert str(err.value) == "tag must be hashable, got list [1]"


# -- threads --------------------------------------------------------------------

THREADS = 4


@pytest.mark.parametrize("page_size", [1, 4])
def test_tracking_under_threads_loses_and_duplicates_nothing(page_size: int) -> None:
    pages = 64
    pool = LogicalHostPool(pages * page_size, page_size, track=True)
    barrier = threading.Barrier(THREADS)
    held: list[list[np.ndarray]] = [[] for _ in range(THREADS)]
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        mine = held[tid]
        try:
            barrier.wait()
            for _ in range(300):
                got = None
                if mine and rng.random() < 0.45:
                    arr = mine.pop(rng.randrange(len(mine)))
                    pool.free(arr)
                elif rng.random() < 0.5:
                    got = pool.alloc(rng.randint(1, 3) * page_size, tag=f"thread-{tid}")
                else:
                    many = pool.alloc_many([page_size, 0, page_size], tag=f"thread-{tid}")
                    got = None if many is None else many[0]
                if got is not None and got.shape[0]:
                    mine.append(got)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()

    source, first = inspect.getsourcelines(worker)
    ln_alloc = first + next(i for i, text in enumerate(source) if "pool.alloc(" in text)
    ln_many = first + next(i for i, text in enumerate(source) if "pool.alloc_many(" in text)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    assert pool.stats().alloc_calls > THREADS * 100
    assert any(held)
    pool.check_invariants()

    # Each held allocation's pages carry one number; no number is shared.
    st = pool._st
    track = int(st[L.H_TRACK])
    numbers: dict[int, int] = {}
    expected: dict[str, tuple[int, int, int]] = {}
    for tid, mine in enumerate(held):
        seqs = []
        for arr in mine:
            pages_of = np.unique(arr // page_size)
            seq = np.unique(st[track + pages_of])
            assert seq.shape == (1,), f"allocation of thread {tid} has numbers {seq}"
            assert int(seq[0]) not in numbers, "two allocations share a number"
            numbers[int(seq[0])] = tid
            seqs.append(int(seq[0]))
        if mine:
            expected[f"thread-{tid}"] = (sum(a.shape[0] for a in mine) // page_size, len(mine), min(seqs))
    got: dict[str, tuple[int, int, int]] = {}
    for r in pool.outstanding():
        assert r.function == "worker"
        assert r.line in (ln_alloc, ln_many)
        key = r.tag
        pages_, allocs, oldest = got.get(key, (0, 0, 1 << 62))
        got[key] = (pages_ + r.pages, allocs + r.allocations, min(oldest, r.oldest))
    assert got == expected
    assert sum(r.pages for r in pool.outstanding()) == pool.stats().allocated_pages
    assert max(numbers, default=0) < int(st[L.H_SEQ])
    # The site table holds each (site, tag) once: 2 fixed ids, at most 4 tags at 2 lines (a refused
    # call takes back what it added), the free line.
    table = [s for s in pool._tracker.table() if s is not None]  # type: ignore[union-attr]
    assert len({s.key() for s in table}) == len(table) <= 2 + 2 * THREADS + 1
    assert {(s.line, s.tag) for s in table} >= {(r.line, r.tag) for r in pool.outstanding()}


# -- snapshots and pickling -----------------------------------------------------


def test_restore_brings_back_the_sites_of_the_backup() -> None:
    pool = LogicalHostPool(8 * PS, PS, track=True)
    name = "test_restore_brings_back_the_sites_of_the_backup"
    a, ln_a = pool.alloc(2 * PS, tag="before"), line()
    assert a is not None
    state = pool.backup_state()
    assert state.sites is not None
    assert len(state.sites) == 3
    at_backup = rows(pool)
    assert at_backup == [(at(ln_a, name), "before", 2, 2 * PS, 1, 1)]

    assert pool.free(a) == 2 * PS
    b, ln_b = pool.alloc(3 * PS, tag="after"), line()
    assert b is not None
    assert rows(pool) == [(at(ln_b, name), "after", 3, 3 * PS, 2, 1)]
    pool.restore_state(state)
    assert rows(pool) == at_backup
    pool.check_invariants()
    # The history of the restored pages is the backup's: allocated, never freed.
    with pytest.raises(DoubleFreeError) as info:
        pool.free(np.concatenate([a[:PS], a[:PS]]))
    assert str(info.value).endswith(f"; it was allocated at {at(ln_a, name)} with tag 'before' (allocation #1)")
    # New sites after the restore get ids of their own, numbering goes on from the backup.
    c, ln_c = pool.alloc(PS, tag="later"), line()
    assert c is not None
    assert rows(pool) == [*at_backup, (at(ln_c, name), "later", 1, PS, 2, 1)]

    # Into another tracking pool of the same shape.
    other = LogicalHostPool(8 * PS, PS, track=True)
    other.restore_state(state)
    assert rows(other) == at_backup


@pytest.mark.parametrize(("source", "target"), [(False, True), (True, False)])
def test_restore_across_tracking_is_refused(source: bool, target: bool, snapshot: Any, unchanged: Any) -> None:
    src = LogicalHostPool(4 * PS, PS, track=source)
    assert src.alloc(PS) is not None
    state = src.backup_state()
    pool = LogicalHostPool(4 * PS, PS, track=target)
    assert pool.alloc(2 * PS) is not None
    before = snapshot(pool)
    held = rows(pool) if target else None
    with pytest.raises(HostPoolError) as info:
        pool.restore_state(state)
    assert str(info.value) == f"the state is from a pool with track={source}; this pool has track={target}"
    unchanged(pool, before)
    if target:
        assert rows(pool) == held


def test_restore_refuses_corrupted_tracking_words(snapshot: Any, unchanged: Any) -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    assert pool.alloc(PS) is not None
    state = pool.backup_state()
    words = state._words.copy()
    words[int(words[L.H_TRACK])] = 5  # page 0's allocation number, beyond the next one (2)
    bad = PoolState(state.size, state.page_size, state.merge, words, state.sites)
    before = snapshot(pool)
    with pytest.raises(HostPoolError) as info:
        pool.restore_state(bad)
    assert str(info.value) == (
        "the state fails the pool's invariants: allocation numbers of held pages are not below the next one, 2"
    )
    unchanged(pool, before)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_tracking_pool_copies_with_its_sites(how: str) -> None:
    pool = LogicalHostPool(8 * PS, PS, track=True)
    name = "test_a_tracking_pool_copies_with_its_sites"
    a, ln_a = pool.alloc(2 * PS, tag=("req", 5)), line()
    assert a is not None
    assert pool.alloc_many([PS, PS], tag=9) is not None
    assert pool.free(a[:PS]) == PS
    ln_free = line() - 1
    copied = pickle.loads(pickle.dumps(pool)) if how == "pickle" else copy.deepcopy(pool)
    assert copied.track is True
    assert rows(copied) == rows(pool)
    assert copied.leak_report() == pool.leak_report()
    with pytest.raises(DoubleFreeError) as info:
        copied.free(a[:PS])
    assert str(info.value).endswith(
        f"it was allocated at {at(ln_a, name)} with tag ('req', 5) (allocation #1), then freed at {at(ln_free, name)}"
    )
    # The copy is independent: a new allocation numbers on from the original's count.
    c, ln_c = copied.alloc(PS), line()
    assert c is not None
    assert rows(copied)[-1] == (at(ln_c, name), None, 1, PS, 3, 1)
    assert len(pool.outstanding()) == 2


def test_an_untracked_pool_copies_untracked() -> None:
    pool = LogicalHostPool(4 * PS, PS)
    assert pool.alloc(PS) is not None
    copied = pickle.loads(pickle.dumps(pool))
    assert copied.track is False
    with pytest.raises(HostPoolError):
        copied.outstanding()


def test_a_pickle_with_tracking_words_but_no_sites_is_refused() -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    saved = pool.__getstate__()
    blank = LogicalHostPool.__new__(LogicalHostPool)
    with pytest.raises(HostPoolError) as info:
        blank.__setstate__({**saved, "sites": None})
    assert str(info.value) == ("the pickled LogicalHostPool is from a pool with track=True; this pool has track=False")
    with pytest.raises(HostPoolError) as info:
        blank.__setstate__({**saved, "sites": ("not a site",)})
    assert (
        str(info.value) == "the pickled LogicalHostPool has a damaged site table: it has 1 entries, not 2 to 2147483648"
    )


# -- sorted merge order, invariants ---------------------------------------------


def test_tracking_with_sorted_merge() -> None:
    ps = 2
    pool = LogicalHostPool(6 * ps, ps, merge="sorted", track=True)
    name = "test_tracking_with_sorted_merge"
    a, ln_a = pool.alloc(6 * ps, tag="all"), line()
    assert a is not None
    for p in (4, 1, 3):
        assert pool.free(page(p, ps)) == ps
    ln_free = line() - 1
    assert pool.merge() == 3 * ps
    with pytest.raises(DoubleFreeError) as info:
        pool.free(page(4, ps))
    assert str(info.value).endswith(
        f"it was allocated at {at(ln_a, name)} with tag 'all' (allocation #1), then freed at {at(ln_free, name)}"
    )
    b, ln_b = pool.alloc(3 * ps, tag="again"), line()
    assert b is not None
    assert b.tolist() == [2, 3, 6, 7, 8, 9]  # ascending: pages 1, 3, 4
    assert rows(pool) == [
        (at(ln_a, name), "all", 3, 3 * ps, 1, 1),
        (at(ln_b, name), "again", 3, 3 * ps, 2, 1),
    ]
    pool.check_invariants()
    freed, ln_f2 = pool.free(page(3, ps)), line()
    assert freed == ps
    with pytest.raises(DoubleFreeError) as info:
        pool.free(page(3, ps))
    assert str(info.value).endswith(
        f"it was allocated at {at(ln_b, name)} with tag 'again' (allocation #2), then freed at {at(ln_f2, name)}"
    )
    assert rows(pool) == [
        (at(ln_a, name), "all", 3, 3 * ps, 1, 1),
        (at(ln_b, name), "again", 2, 2 * ps, 2, 1),
    ]


def test_check_invariants_covers_the_tracking_words() -> None:
    pool = LogicalHostPool(4 * PS, PS, track=True)
    assert pool.alloc(2 * PS) is not None
    pool.check_invariants()
    st = pool._st
    track = int(st[L.H_TRACK])
    assert track == L.track_offset(4)
    # A free page keeps its last allocation's number, which is below the next one too.
    st[track + 3] = 99
    with pytest.raises(RuntimeError) as info:
        pool.check_invariants()
    assert str(info.value) == (
        "LogicalHostPool state is corrupted: page 3's last allocation number is not below the next one, 2"
    )
    st[track + 3] = 1
    pool.check_invariants()
    for page_, value in ((1, 2), (1, -1), (0, 1 << 40)):
        saved = int(st[track + page_])
        st[track + page_] = value
        with pytest.raises(RuntimeError) as info:
            pool.check_invariants()
        assert str(info.value) == (
            "LogicalHostPool state is corrupted: allocation numbers of held pages are not below the next one, 2"
        )
        st[track + page_] = saved
        pool.check_invariants()
    st[L.H_SEQ] = 0
    with pytest.raises(RuntimeError) as info:
        pool.check_invariants()
    assert str(info.value) == (
        "LogicalHostPool state is corrupted: allocation numbers of held pages are not below the next one, 0"
    )
    st[L.H_SEQ] = 2
    st[L.H_TRACK] = track + 1
    with pytest.raises(RuntimeError) as info:
        pool.check_invariants()
    assert str(info.value) == (
        f"LogicalHostPool state is corrupted: tracking words said to start at {track + 1}, expected 0 or {track}"
    )


def test_site_table_stays_bounded_with_a_tag_per_request() -> None:
    """A scheduler tags each request with its own id: entries no page refers to are swept.

    Without the sweep the table would hold one entry per request ever made
    (about 240 bytes each, for the pool's life). Pages held across many
    sweeps keep their site and tag.
    """
    pool = LogicalHostPool(64 * 16, 16, track=True)
    kept = pool.alloc(32, tag="kept-request")  # held across every sweep below
    assert kept is not None
    for request in range(6000):
        slots = pool.alloc(16, tag=request)
        assert slots is not None
        pool.free(slots)
    live = [s for s in pool._tracker.table() if s is not None]
    # At most two entries per page (allocation and last free) plus what came since the last sweep.
    assert len(live) <= 2 * 64 + 2 * 1024 + 2, len(live)
    assert len(pool._tracker.table()) < 6000 / 2
    (group,) = pool.outstanding()
    assert (group.tag, group.pages, group.oldest) == ("kept-request", 2, 1)
    # The last request's history is still exact.
    with pytest.raises(DoubleFreeError, match=r"with tag 5999 \(allocation #6001\), then freed at "):
        pool.free(slots)
    pool.check_invariants()


def test_caller_deeper_than_the_stack_starts_at_the_nearest_frame() -> None:
    from hostpool_nb._diagnostics.tracking import caller

    file, line, function = caller(10**6)  # sys._getframe refuses that depth: no error, the nearest frame
    assert (file, function) == (__file__, "test_caller_deeper_than_the_stack_starts_at_the_nearest_frame")
    assert line > 0


@pytest.mark.parametrize("ps", [1, 3, PS])
@pytest.mark.parametrize("first", [1, 4], ids=["one page", "a run across the ring's end"])
def test_every_page_of_a_free_records_its_site(ps: int, first: int) -> None:
    """One free of many pages (or of one slot) records the freeing site on each, wherever it was staged."""
    pool = LogicalHostPool(6 * ps, ps, track=True)
    warm = pool.alloc(3 * ps)  # moves the ring's head: the next frees are staged across its end
    assert warm is not None
    pool.free(warm)
    held = pool.alloc(first * ps)
    assert held is not None
    freed, ln_free = pool.free(held), line()
    assert freed == first * ps
    name = "test_every_page_of_a_free_records_its_site"
    for p in held.reshape(-1, ps):
        with pytest.raises(DoubleFreeError) as info:
            pool.free(p)
        assert str(info.value).endswith(f"then freed at {at(ln_free, name)}"), str(info.value)


def test_a_sweep_keeps_the_site_that_freed_a_page() -> None:
    """A page's last free site is referred to only by the page's word: sweeps must keep it."""
    pool = LogicalHostPool(8192, 1, track=True)
    name = "test_a_sweep_keeps_the_site_that_freed_a_page"
    first, ln_a = pool.alloc(1, tag="first"), line()
    assert first is not None
    pool.free(first)
    ln_free = line() - 1
    for request in range(3000):  # new tags: the table doubles and is swept, page 0 stays released
        slots = pool.alloc(1, tag=request)
        assert slots is not None
        pool.free(slots)
    assert int(first[0]) == 0
    with pytest.raises(DoubleFreeError) as info:
        pool.free(first)
    assert str(info.value).endswith(
        f"it was allocated at {at(ln_a, name)} with tag 'first' (allocation #1), then freed at {at(ln_free, name)}"
    ), str(info.value)


def test_a_snapshot_restored_into_another_pool_brings_its_own_sites() -> None:
    """A site table of the same length as the pool's, with other entries, is loaded, not taken for the same."""
    name = "test_a_snapshot_restored_into_another_pool_brings_its_own_sites"
    a = LogicalHostPool(4 * PS, PS, track=True)
    b = LogicalHostPool(4 * PS, PS, track=True)
    _, ln_a = a.alloc(PS, tag="from a"), line()
    _, ln_b = b.alloc(PS, tag="from b"), line()
    assert site_table_len(a) == site_table_len(b)  # one site each, at the same id
    b.restore_state(a.backup_state())
    assert [(r.line, r.tag) for r in b.outstanding()] == [(ln_a, "from a")]
    assert rows(b) == rows(a)
    assert ln_b != ln_a
    assert at(ln_a, name) in b.leak_report()
