"""Taking runs whole in the alloc and free kernels decides exactly as going page by page.

``_kernels/pool.py`` takes a stretch of ``long`` or more consecutive pages whole
(one test of their flags, one fill, one block store) and everything else,
every failure included, one page at a time. Which runs are taken must be
invisible: for any pool, any input and any ``long``, the kernels return the
same status and leave the same state. The kernels read ``long`` from
``long_run``; these tests compile the kernels' code again with ``long_run``
replaced (``long=2`` takes every run it can, a ``long`` larger than the
input takes none: the plain page-by-page pass), build states and inputs
that mix runs, lone pages and every kind of fault, run the variants on
copies of one state, and compare. The pool's own threshold
(``K.long_run``) is 1,024 slots, so the tests through the public API use
inputs long enough to reach it.
"""

from __future__ import annotations

import functools
import itertools
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st_

from hostpool_nb import DoubleFreeError, LogicalHostPool, SlotRangeError
from hostpool_nb._kernels import layout as L
from hostpool_nb._kernels import pool as K
from hostpool_nb._kernels import runs as R
from hostpool_nb._kernels import short as S
from hostpool_nb._kernels.jit import JIT_DISABLED, callable_from_python, callee, kernel
from tests.conftest import take_snapshot

PAGE_SIZES = [1, 3, 4, 16]


NO_RUNS = 1 << 40  # a ``long`` no input reaches: the page-by-page pass


@functools.cache
def with_long(name: str, long: int) -> Callable[..., int]:
    """The kernel ``K.<name>`` compiled again (in memory) with every run threshold set to ``long`` pages."""
    original = getattr(K, name)
    py = getattr(original, "py_func", original)

    def fixed(page_size: int) -> int:
        return long

    scope = dict(py.__globals__, long_run=callee()(fixed))
    copy = types.FunctionType(py.__code__, scope, f"{name}_long{long}", py.__defaults__, py.__closure__)
    copy.__qualname__ = copy.__name__
    if JIT_DISABLED:
        return copy  # type: ignore[no-any-return]
    made = kernel("i8(i8[::1], i8[::1])")(copy)
    return made.dispatcher  # type: ignore[attr-defined, no-any-return]


def _free_with(st: np.ndarray, slots: np.ndarray, long: int) -> int:
    """The free kernel for the state's page size, taking runs of ``long`` pages or more (``NO_RUNS``: none)."""
    ps = int(st[L.H_PAGE_SIZE])
    return int(with_long("free_p1" if ps == 1 else "free_pn", long)(st, slots))


def _chunks(draw: Any, items: list[int], max_chunk: int) -> list[list[int]]:
    """``items`` cut into consecutive chunks of random lengths."""
    out, i = [], 0
    while i < len(items):
        k = draw(st_.integers(1, max_chunk))
        out.append(items[i : i + k])
        i += k
    return out


@st_.composite
def pool_and_free(draw: Any) -> tuple[LogicalHostPool, np.ndarray]:
    """A pool with a shuffled free list and some pages held, and a free call's input.

    The input is the held pages in chunks (runs), shuffled, possibly with
    one fault: a page named twice, a free page, a slot out of range, a
    misaligned first slot, a page with a wrong slot, or a ragged length.
    """
    ps = draw(st_.sampled_from(PAGE_SIZES))
    n = draw(st_.integers(1, 80))
    pool = LogicalHostPool(n * ps, ps)
    # Shuffle the free list in chunks: allocations then mix runs and lone pages.
    everything = pool.alloc(n * ps)
    assert everything is not None
    pages = list(range(n))
    order = [p for chunk in draw(st_.permutations(_chunks(draw, pages, 12))) for p in chunk]
    pool.free(np.concatenate([np.arange(p * ps, (p + 1) * ps) for p in order]))
    held = pool.alloc(draw(st_.integers(0, n)) * ps)
    assert held is not None
    held_pages = [int(x) // ps for x in held[::ps]]
    if draw(st_.booleans()):  # some pages released again, in between
        keep = draw(st_.integers(0, len(held_pages)))
        back = held_pages[keep:]
        if back:
            pool.free(np.concatenate([np.arange(p * ps, (p + 1) * ps) for p in back]))
        held_pages = held_pages[:keep]
    if draw(st_.booleans()):
        pool.free_group_begin()  # frees then go to the pending list
    chosen = draw(st_.lists(st_.sampled_from(held_pages), unique=True)) if held_pages else []
    if draw(st_.booleans()):
        chosen.sort()  # long runs
    parts = list(draw(st_.permutations(_chunks(draw, chosen, 10)))) if chosen else []
    free_pages = [p for part in parts for p in part]
    slots = [s for p in free_pages for s in range(p * ps, (p + 1) * ps)]
    fault = draw(
        st_.sampled_from(["none", "twice", "free-page", "next-free", "range", "misaligned", "partial", "length"])
    )
    if fault != "none" and slots:
        at = draw(st_.integers(0, len(free_pages) - 1)) * ps
        if fault == "twice":
            slots[at:at] = slots[at : at + ps][:] if draw(st_.booleans()) else slots[-ps:]
        elif fault == "free-page":
            not_held = [p for p in range(n) if p not in held_pages]
            if not_held:
                p = draw(st_.sampled_from(not_held))
                slots[at:at] = list(range(p * ps, (p + 1) * ps))
        elif fault == "next-free":  # a page not held, next to a freed one: a run that ends or starts on it
            spots = [
                (i, q + d)
                for i, q in enumerate(free_pages)
                for d in (1, -1)
                if 0 <= q + d < n and q + d not in held_pages
            ]
            if spots:
                i, q = draw(st_.sampled_from(spots))
                where = (i + 1) * ps if q > free_pages[i] else i * ps
                slots[where:where] = list(range(q * ps, (q + 1) * ps))
                event("a run ending or starting on a page not held")
        elif fault == "range":
            slots[at + draw(st_.integers(0, ps - 1))] = draw(st_.sampled_from([-1, n * ps, n * ps + ps, 2**40]))
        elif fault == "misaligned" and ps > 1:
            slots[at : at + ps] = [x + 1 for x in slots[at : at + ps]]
        elif fault == "partial" and ps > 1:
            j = draw(st_.integers(1, ps - 1))
            slots[at + j] += draw(st_.sampled_from([1, -1, ps]))
        elif fault == "length" and ps > 1:
            slots = slots[:-1]
    return pool, np.array(slots, dtype=np.int64)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(pool_and_free(), st_.sampled_from([2, 5]))
def test_free_decides_as_the_page_by_page_pass(case: tuple[LogicalHostPool, np.ndarray], long: int) -> None:
    """With runs taken eagerly and at the pool's threshold: the same status, the same state."""
    pool, slots = case
    before = take_snapshot(pool)
    original = pool._st.copy()
    want_st = original.copy()
    want = _free_with(want_st, slots, NO_RUNS)
    event("freed" if want >= 0 else f"error code {L.decode_status(want)[0]}")
    for how in (long, None):  # None: free_pages itself, at the pool's threshold
        st_a = original.copy()
        pool_free = K.KERNELS[int(st_a[L.H_PAGE_SIZE]) == 1].free
        got = int(pool_free(st_a, slots)) if how is None else _free_with(st_a, slots, how)
        assert got == want, (how, L.decode_status(got) if got < 0 else got, L.decode_status(want) if want < 0 else want)
        if want >= 0:
            assert np.array_equal(st_a, want_st)  # the same pages, staged in the same order
        else:  # unchanged but for the scratch outside the live window
            pool._st[:] = st_a
            for old, new in zip(before, take_snapshot(pool), strict=True):
                assert np.array_equal(old, new)
            pool._st[:] = original


def _entries(runs: list[tuple[int, int]]) -> list[int]:
    """The ring entries of ``runs`` (first page, length), as ``_kernels/layout.py`` encodes them."""
    return [e for p, n in runs for e in ((p,) if n == 1 else (p, -n))]


@st_.composite
def lists_to_claim(draw: Any) -> tuple[np.ndarray, int, list[tuple[int, int]]]:
    """A state whose free and release lists are runs of any split, at any ring position, maybe with a fault.

    The owner flags say free, allocated or pending at random; the lists
    name free pages in shuffled chunks, each cut into runs anywhere (runs
    need not be the longest). A fault is a page id that is not a page, a
    run that goes past the last page, or a page inside a run that is not
    free: a corrupted list, which the kernels refuse. The window may wrap
    the ring's end, a run's length entry included. Returns the state, the
    pages to allocate and the runs of both lists, in order.
    """
    n = draw(st_.integers(1, 200))
    ps = draw(st_.sampled_from([1, 2, 16]))
    owner = np.array(draw(st_.lists(st_.sampled_from([0, 0, 0, 1, 2]), min_size=n, max_size=n)), dtype=np.uint8)
    free = [p for p in range(n) if owner[p] == 0]
    pages = [p for chunk in draw(st_.permutations(_chunks(draw, free, 70))) for p in chunk]
    runs: list[tuple[int, int]] = []
    for p in pages:  # a page that continues the last run joins it, unless the draw cuts the run there
        if runs and p == runs[-1][0] + runs[-1][1] and draw(st_.integers(0, 9)) > 0:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    fault = draw(st_.sampled_from(["none", "none", "id", "past-the-end", "held-inside"]))
    if fault != "none":
        at = draw(st_.integers(0, len(runs)))
        if fault == "id":
            runs.insert(at, (draw(st_.sampled_from([n, n + 5, 2**31 - 1])), 1))
        elif fault == "past-the-end" and runs:
            p, _ = runs[min(at, len(runs) - 1)]
            runs[min(at, len(runs) - 1)] = (p, n - p + draw(st_.integers(1, 3)))
        elif fault == "held-inside":
            long_ones = [i for i, (_, k) in enumerate(runs) if k > 1]
            if long_ones:
                i = draw(st_.sampled_from(long_ones))
                owner[runs[i][0] + draw(st_.integers(0, runs[i][1] - 1))] = L.OWNER_ALLOCATED
    while len(_entries(runs)) > n:  # a fault's extra run may not fit the ring
        runs.pop()
    cut = draw(st_.integers(0, len(runs)))  # the free list, then the release list
    lists = (runs[:cut], runs[cut:])
    st = L.new_state(n, ps)
    L.owner_flags(st, n)[:] = owner
    ring = L.ring_ids(st, n)
    entries = _entries(runs)
    head = draw(st_.integers(0, n - 1))
    ring[(head + np.arange(len(entries))) % n] = entries
    st[L.H_HEAD] = head
    st[L.H_NFREE], st[L.H_NREL] = (sum(k for _, k in part) for part in lists)
    st[L.H_EFREE], st[L.H_EREL] = (len(_entries(part)) for part in lists)
    total = int(st[L.H_NFREE] + st[L.H_NREL])
    assume(total > 0)  # an allocation the lists cannot serve never reads them
    need = draw(st_.integers(1, total))
    return st, need, runs


def _claimed(st: np.ndarray, need: int, runs: list[tuple[int, int]]) -> tuple[int, list[int], list[tuple[int, int]]]:
    """What an allocation of ``need`` pages from ``runs`` returns, run by run: status, pages, the runs left."""
    n = int(st[L.H_NPAGES])
    owner = L.owner_flags(st, n)
    got: list[int] = []
    for i, (p, k) in enumerate(runs):
        take = min(k, need - len(got))
        if p < 0 or k > n - p or bool(np.any(owner[p : p + take] != L.OWNER_FREE)):
            return L.status_for(L.E_CORRUPT, len(got)), got, runs
        got += range(p, p + take)
        if len(got) == need:
            rest = [(p + take, k - take)] if take < k else []
            return need * int(st[L.H_PAGE_SIZE]), got, rest + runs[i + 1 :]
    raise AssertionError("the lists hold fewer pages than asked for")


@pytest.mark.slow
@settings(max_examples=600, deadline=None)
@given(lists_to_claim(), st_.sampled_from(["alloc_pages", "alloc_short"]))
def test_alloc_takes_the_runs_in_order_splitting_the_last(
    case: tuple[np.ndarray, int, list[tuple[int, int]]], name: str
) -> None:
    """Both alloc kernels against a run-by-run model: the pages, the runs left, the counts; refusals unchanged."""
    st, need, runs = case
    ps = int(st[L.H_PAGE_SIZE])
    if need * ps > S.SHORT_SLOTS and name == "alloc_short":
        name = "alloc_pages"  # the pool never calls the short kernel so long; it would serve it the same
    want, pages, rest = _claimed(st, need, runs)
    out = np.full(need * ps, -7, dtype=np.int64)
    before = st.copy()
    got = int(getattr(K, name)(st, out))
    event("claimed" if want >= 0 else "corrupt")
    assert got == want, (L.decode_status(got) if got < 0 else got, L.decode_status(want) if want < 0 else want)
    n = int(st[L.H_NPAGES])
    if want < 0:
        assert np.array_equal(st, before)  # every flag put back, nothing counted
        return
    assert out.tolist() == [p * ps + j for p in pages for j in range(ps)]
    assert bool(np.all(L.owner_flags(st, n)[pages] == L.OWNER_ALLOCATED))
    free, released, _ = L.window_entries(st)
    assert np.concatenate([free, released]).tolist() == _entries(rest)  # the split run's rest, then as they were
    assert int(st[L.H_NFREE] + st[L.H_NREL]) == int(before[L.H_NFREE] + before[L.H_NREL]) - need
    merged = need > int(before[L.H_NFREE])  # reading on into the release list is a FIFO merge
    assert int(st[L.H_MERGES]) == int(merged)
    assert int(st[L.H_NREL]) == (0 if merged else int(before[L.H_NREL]))


@pytest.mark.parametrize("ps", [1, 16])
def test_shuffled_and_sorted_pools_hand_out_the_same_pages_as_the_model(ps: int) -> None:
    """A long mixed workload at a size where runs reach the pool's threshold, against the plain-list model."""
    long = int(callable_from_python(K.long_run)(ps))
    n = 8 * long + 2000
    pool = LogicalHostPool(n * ps, ps)
    rng = np.random.default_rng(5)
    everything = pool.alloc(n * ps)
    assert everything is not None
    order = rng.permutation(n)
    order[: n // 2] = np.sort(order[: n // 2])  # half sorted: long runs, half shuffled: lone pages
    pool.free(everything.reshape(-1, ps)[order].reshape(-1))
    free_list = [int(p) for p in order]  # FIFO: the model's free list
    held: list[np.ndarray] = []
    for _ in range(300):
        if held and rng.random() < 0.45:
            out = held.pop(int(rng.integers(len(held))))
            pages = out.reshape(-1, ps)
            if rng.random() < 0.5:
                pages = pages[rng.permutation(len(pages))]
            assert pool.free(pages.reshape(-1)) == out.size
            free_list += [int(x) // ps for x in pages[:, 0]]
        else:
            k = int(rng.integers(1, 3 * long + 400))
            out = pool.alloc(k * ps)
            if k > len(free_list):
                assert out is None
                continue
            assert out is not None
            want, free_list = free_list[:k], free_list[k:]
            assert out.tolist() == [p * ps + j for p in want for j in range(ps)]
            held.append(out)
    pool.check_invariants()


def _naive_run_length(ids: np.ndarray, start: int, limit: int, first: int) -> int:
    k = 1
    while k < limit and ids[start + k] == first + k:
        k += 1
    return k


@pytest.mark.parametrize("limit", [1, 2, 7, 8, 9, 63, 64, 65, 66, 71, 72, 73, 128, 129, 130, 193, 200, 270])
@pytest.mark.parametrize("brk", [None, 1, 5, 7, 8, 9, 40, 63, 64, 65, 71, 72, 73, 128, 129, 150, 192, 193, 250])
@pytest.mark.parametrize("start", [0, 3])
@pytest.mark.parametrize("dtype", [np.int64, np.int32], ids=["slots", "ring"])
def test_run_length_stops_at_the_first_break_or_the_limit(
    limit: int, brk: int | None, start: int, dtype: type[np.integer[Any]]
) -> None:
    """In the first block's mask, in a later block's test and mask, at every block's edges, in the tail.

    For both of its compiled forms: a caller's int64 slots and the ring's
    int32 page ids.
    """
    ids = np.arange(100, 400, dtype=dtype)
    if brk is not None:
        ids[start + brk] += 1000
    first = int(ids[start])
    run_length = callable_from_python(K._run_length)
    got = run_length(ids, start, limit, first)
    assert got == _naive_run_length(ids, start, limit, first)
    assert got == (limit if brk is None or brk >= limit else brk)
    # Measured against the caller's read of the first entry, not a second one.
    assert run_length(ids, start, limit, first + 1) == 1 or limit == 1


@pytest.mark.parametrize("run", [8, 9, 16, 23, 70, 300])
def test_a_run_holding_one_free_page_anywhere_in_a_word_is_a_double_free(
    run: int, snapshot: Any, unchanged: Any
) -> None:
    """Page size 1: a free of consecutive slots whose one page is free already, at every byte of its flag word
    (a word's first, inside, last; the run's first, last), in short calls and long ones: refused, unchanged."""
    n = 384
    for start in range(17):
        for j in sorted({0, 1, 7, run - 1, *(k for k in range(run) if (start + k) % 8 in (0, 7))}):
            pool = LogicalHostPool(n, 1)
            pool.alloc(n)
            pool.free([start + j])
            before = snapshot(pool)
            with pytest.raises(DoubleFreeError, match=rf"freed at indices\[{j}\] \(flattened\), is not"):
                pool.free(np.arange(start, start + run))
            unchanged(pool, before)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_a_lone_pending_page_before_a_run_is_a_double_free(ps: int, snapshot: Any, unchanged: Any) -> None:
    """Freed in the open group, then freed again before a run, or in one: refused at its position."""
    long = int(callable_from_python(K.long_run)(ps))
    n = 5 * long + 32
    q = 2 * long + 8  # the pending page, with runs of 2 * long pages on either side of it
    pool = LogicalHostPool(n * ps, ps)
    held = pool.alloc(n * ps)
    assert held is not None
    pages = held.reshape(-1, ps)
    with pool.free_group():
        pool.free(pages[0])  # pending now
        pool.free(pages[q])
        before = snapshot(pool)
        again = np.concatenate([pages[0], pages[q + 1 : q + 1 + 2 * long].reshape(-1)])  # a lone page, then a run
        with pytest.raises(DoubleFreeError, match=r"freed at indices\[0\] \(flattened\), is not allocated"):
            pool.free(again)
        unchanged(pool, before)
        # Runs long enough to take that start on, hold or end on the pending page.
        for start, at in ((q, 0), (q - long, long), (q - 2 * long + 1, 2 * long - 1)):
            within = pages[start : start + 2 * long].reshape(-1)
            with pytest.raises(DoubleFreeError, match=rf"freed at indices\[{at * ps}\] \(flattened\), is not"):
                pool.free(within)
            unchanged(pool, before)
    pool.check_invariants()
    assert pool.available_size() == 2 * ps


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("beyond", [1, 2, 9])
def test_a_run_that_continues_past_the_last_page_is_out_of_range(
    ps: int, beyond: int, snapshot: Any, unchanged: Any
) -> None:
    """Slots counting up from the last pages on past the pool's end: the run stops at the last page."""
    long = int(callable_from_python(K.long_run)(ps))
    n = 2 * long + 4
    pool = LogicalHostPool(n * ps, ps)
    held = pool.alloc(n * ps)
    assert held is not None
    bad = np.arange((n - long - 1) * ps, (n + beyond) * ps, dtype=np.int64)  # the last long + 1 pages, then beyond
    before = snapshot(pool)
    with pytest.raises(SlotRangeError, match=rf"free got slot {n * ps} at indices\[{(long + 1) * ps}\]"):
        pool.free(bad)
    unchanged(pool, before)


@settings(max_examples=400, deadline=None)
@given(
    st_.integers(0, 700),
    st_.integers(0, 20),
    st_.integers(1, 600),
    st_.sampled_from([0, 1, 2]),
    st_.sampled_from([0, 1, 2]),
    st_.lists(st_.integers(0, 699), max_size=3),
)
def test_claim_flags_tests_and_sets_exactly_the_range(
    n_extra: int, start: int, length: int, want: int, flag: int, wrong: list[int]
) -> None:
    """Eight flags to a word, the first and last words masked to the range: the range's flags, none outside it.

    The word path reads the flags as words of the state array, so they are
    a real state's (whose ring, before them, must not be touched either).
    A range not all ``want`` is left as it was.
    """
    n = start + length + n_extra
    st = L.new_state(n, 1)
    owner = L.owner_flags(st, n)
    owner[:] = want
    for w in wrong:  # flags that are not ``want``, inside the range or outside it
        owner[w % n] = (want + 1) % 3
    before = st.copy()
    all_wanted = bool(np.all(owner[start : start + length] == want))
    event("all as wanted" if all_wanted else "some not")
    assert bool(callable_from_python(K._claim_flags)(st, start, length, want, flag)) == all_wanted
    expected = before.copy()
    if all_wanted:
        L.owner_flags(expected, n)[start : start + length] = flag
    assert np.array_equal(st, expected)


@settings(max_examples=300, deadline=None)
@given(st_.integers(-(2**63), 2**63 - 1).filter(lambda x: x != 0))
def test_trailing_zeros_is_the_lowest_set_bits_index(x: int) -> None:
    """In a kernel (LLVM's cttz) and in plain Python (the JIT off): where a run's mask says it ends."""
    from hostpool_nb._kernels.jit import _trailing_zeros_in_python

    want = next(i for i in range(64) if (x >> i) & 1)
    assert _trailing_zeros_in_python(np.int64(x)) == want
    if JIT_DISABLED:
        return
    assert _in_a_kernel("trailing_zeros")(np.int64(x)) == want


@functools.cache
def _in_a_kernel(name: str) -> Callable[[Any], int]:
    """``_kernels.jit.<name>`` (an intrinsic, callable only from compiled code) inside a one-line kernel."""
    from numba import njit

    from hostpool_nb._kernels import jit as _jit

    op = getattr(_jit, name)

    def call(x: int) -> int:
        return op(x)  # type: ignore[no-any-return]

    compiled: Callable[[Any], int] = njit("i8(i8)", cache=False)(call)
    return compiled


@settings(max_examples=300, deadline=None)
@given(st_.integers(-(2**63), 2**63 - 1))
def test_popcount_counts_the_set_bits(x: int) -> None:
    """In a kernel (LLVM's ctpop) and in plain Python (the JIT off): how a sorted merge counts free pages."""
    from hostpool_nb._kernels.jit import _popcount_in_python

    want = sum((x >> i) & 1 for i in range(64))
    assert _popcount_in_python(np.int64(x)) == want
    if JIT_DISABLED:
        return
    assert _in_a_kernel("popcount")(np.int64(x)) == want


# Half the pages free, so runs of every length cross the flag words' edges.
_FLAG_BYTES = [L.OWNER_FREE] * 5 + [L.OWNER_ALLOCATED, L.OWNER_PENDING, L.OWNER_STAGED, 0x80, 0xFF]


@settings(max_examples=400, deadline=None)
@given(
    st_.lists(st_.sampled_from(_FLAG_BYTES), min_size=1, max_size=90),
    st_.integers(0, 255),
    st_.booleans(),
)
def test_free_counts_are_a_byte_by_byte_count(flags: list[int], padding: int, track: bool) -> None:
    """Eight flags a word: the free pages and their longest runs' entries, whatever the bytes past the last page.

    The bytes after page ``n - 1`` in the last flag word are not pages (zero,
    which reads as free, in a new state): they must not count.
    """
    n = len(flags)
    st = L.new_state(n, 1, track=track)
    owner = L.owner_flags(st, n)
    owner[:] = flags
    raw = st.view(np.uint8)
    first = (L.HEADER + (n + 1) // 2) * 8 + n  # the first byte after the flags
    raw[first : (first + 7) // 8 * 8] = padding
    free = [f == L.OWNER_FREE for f in flags]
    runs = [length for is_free, group in itertools.groupby(free) if is_free for length in [len(list(group))]]
    event("padding reads as free" if padding == 0 and n % 8 else "no free padding")
    found, entries = callable_from_python(R._free_counts)(st, n)
    assert (found, entries) == (sum(runs), sum(1 if r == 1 else 2 for r in runs))


@settings(max_examples=150, deadline=None)
@given(
    pages=st_.integers(9, 200),
    ps=st_.sampled_from([1, 2, 4]),
    data=st_.data(),
)
def test_a_sorted_merge_hands_out_exactly_the_freed_pages_in_order(pages: int, ps: int, data: Any) -> None:
    """Odd and even page counts (the owner flags start on a word the count rounds to), any pages freed in any
    order: the merge's rebuild of the free list holds exactly them, ascending."""
    pool = LogicalHostPool(pages * ps, ps, merge="sorted")
    held = pool.alloc(pages * ps)
    assert held is not None
    if data.draw(st_.booleans()):  # pages one by one: short runs, each its own entry
        freed = data.draw(st_.lists(st_.integers(0, pages - 1), unique=True, min_size=1, max_size=pages))
    else:  # long runs of free pages between long runs of held ones: the rebuild skips words of flags
        freed, p = [], data.draw(st_.integers(0, 8))
        while p < pages:
            run = data.draw(st_.integers(1, 24))
            freed += range(p, min(p + run, pages))
            p += run + data.draw(st_.integers(1, 24))
        freed = data.draw(st_.permutations(freed)) if freed else [0]
    for p in freed:
        pool.free(held[p * ps : (p + 1) * ps])
    got = pool.alloc(len(freed) * ps)  # the release list merged, sorted, then taken whole
    assert got is not None
    assert got.tolist() == [int(s) for p in sorted(freed) for s in held[p * ps : (p + 1) * ps]]
    pool.check_invariants()
