"""The kernel layer itself: entry points, the dispatcher fallback, status codes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hostpool_nb import DoubleFreeError, LogicalHostPool, PartialPageError, SlotRangeError
from hostpool_nb._core import pool as _pool
from hostpool_nb._kernels import layout as L
from hostpool_nb._kernels import pool as K
from hostpool_nb._kernels import runs as R
from hostpool_nb._kernels import short as S
from tests.conftest import JIT_DISABLED, one_entry_per_page


def kernels(ps: int) -> Any:
    """The alloc and free kernels of page size ``ps``'s class."""
    return K.KERNELS[ps == 1]


_KERNEL_NAMES = K.PageSizeKernels._fields


@pytest.mark.skipif(JIT_DISABLED, reason="entry points exist only with the JIT on")
@pytest.mark.parametrize("ps", [1, 16])
def test_pool_calls_compiled_entry_points(ps: int) -> None:
    """A silent fallback to the dispatcher would still be correct, but slower by hundreds of ns a call."""
    pool = LogicalHostPool(8 * ps, ps)
    bound = [pool._alloc_short, pool._free_short] + [getattr(pool._k, name) for name in _KERNEL_NAMES]
    for entry in bound:
        assert type(entry).__name__ == "builtin_function_or_method", entry
    # A module's kernels are stand-ins until their first call, which rebinds them.
    # The rarer calls' kernels are read from the module's table, each compiled on its first use.
    pool.merge()
    assert type(_pool._K.merge).__name__ == "builtin_function_or_method"


def _dispatchers(ps: int) -> Any:
    """The class's kernels as numba's dispatchers (or the plain functions without the JIT)."""
    from types import SimpleNamespace

    ks = kernels(ps)
    return SimpleNamespace(
        **{name: getattr(getattr(ks, name), "dispatcher", getattr(ks, name)) for name in _KERNEL_NAMES}
    )


def _trace(pool: LogicalHostPool, rng: np.random.Generator) -> list[list[int] | None]:
    ps = pool.page_size
    held: list[np.ndarray] = []
    results: list[list[int] | None] = []
    for _ in range(200):
        if held and rng.random() < 0.5:
            out = held.pop(int(rng.integers(len(held))))
            pages = out.reshape(-1, ps)[rng.permutation(len(out) // ps)]
            pool.free(pages.reshape(-1))
        else:
            out = pool.alloc(int(rng.integers(0, 4)) * ps)
            results.append(None if out is None else out.tolist())
            if out is not None and len(out):
                held.append(out)
    return results


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_dispatcher_fallback_gives_the_same_results(page_size: int) -> None:
    expected = _trace(LogicalHostPool(8 * page_size, page_size), np.random.default_rng(7))
    pool = LogicalHostPool(8 * page_size, page_size)
    pool._k = _dispatchers(page_size)
    pool._alloc_short, pool._free_short = pool._k.alloc_short, pool._k.free_short
    assert _trace(pool, np.random.default_rng(7)) == expected
    pool.check_invariants()


@pytest.mark.parametrize("code", range(1, 8))
@pytest.mark.parametrize("position", [0, 1, 15, 16, 2**40])
def test_status_codes_round_trip(code: int, position: int) -> None:
    status = L.status_for(code, position)
    assert status < 0
    assert L.decode_status(status) == (code, position)


@pytest.mark.parametrize("ps", [1, 3, 16])
def test_merge_happens_only_when_an_allocation_needs_it(ps: int) -> None:
    pool = LogicalHostPool(4 * ps, ps)
    a = pool.alloc(2 * ps)
    assert a is not None
    pool.free(a)  # released, not merged: the free list still holds 2 pages
    assert int(pool._st[L.H_MERGES]) == 0
    assert int(pool._st[L.H_NREL]) == 2
    # Exactly the free list: served without a merge (a ">=" would merge here).
    assert pool.alloc(2 * ps).tolist() == list(range(2 * ps, 4 * ps))
    assert (int(pool._st[L.H_MERGES]), int(pool._st[L.H_NFREE]), int(pool._st[L.H_NREL])) == (0, 0, 2)
    assert pool.alloc(ps).tolist() == a[:ps].tolist()  # needs the released pages
    assert (int(pool._st[L.H_MERGES]), int(pool._st[L.H_NFREE]), int(pool._st[L.H_NREL])) == (1, 1, 0)
    assert pool.alloc(ps).tolist() == a[ps:].tolist()  # the rest of the merged list, no second merge
    assert int(pool._st[L.H_MERGES]) == 1
    pool.check_invariants()


def test_state_length_and_page_shift() -> None:
    for n in range(20):
        # The header words, four ring bytes per page, one owner byte per
        # page, each part rounded up to whole words.
        assert L.state_length(n) * 8 >= L.HEADER * 8 + 5 * n
        assert L.state_length(n) * 8 < L.HEADER * 8 + 5 * n + 16
    assert [L.page_shift(ps) for ps in (1, 2, 3, 16, 48, 64)] == [0, 1, -1, 4, -1, 6]
    # Every size up to 1024: the power-of-two test must not pass 5 (101b)
    # or 9, whose bits do not touch their doubles.
    for ps in range(1, 1025):
        assert L.page_shift(ps) == (ps.bit_length() - 1 if ps in {1 << e for e in range(11)} else -1), ps


# -- kernel contracts: return values, distinct codes, roll-back across the ring's end --


def test_status_codes_are_distinct_and_fit_the_code_bits() -> None:
    codes = {name: value for name, value in vars(L).items() if name.startswith("E_")}
    assert len(codes) >= 19
    assert len(set(codes.values())) == len(codes)
    # decode_status keeps the low _CODE_BITS bits; 0 is no error
    assert all(1 <= c < 1 << L._CODE_BITS for c in codes.values())
    for code in codes.values():
        assert L.decode_status(L.status_for(code, 12345)) == (code, 12345)


@pytest.mark.parametrize("ps", [2, 3, 16])
def test_length_checks_happen_in_the_kernels_before_anything(ps: int, snapshot: Any, unchanged: Any) -> None:
    """alloc and free leave the page-alignment check of a length to the kernel: nothing moves, nothing is counted."""
    pool = LogicalHostPool(8 * ps, ps)
    held = pool.alloc(2 * ps)
    assert held is not None
    before = snapshot(pool)
    calls = int(pool._st[L.H_ALLOC_CALLS])
    assert L.decode_status(kernels(ps).alloc(pool._st, np.empty(ps + 1, dtype=np.int64))) == (L.E_MISALIGNED, 0)
    assert L.decode_status(kernels(ps).free(pool._st, held[:-1].copy())) == (L.E_LENGTH, 0)
    unchanged(pool, before)
    assert int(pool._st[L.H_ALLOC_CALLS]) == calls


@pytest.mark.parametrize("ps", [1, 3, 16])
def test_kernels_return_what_they_moved(ps: int) -> None:
    pool = LogicalHostPool(8 * ps, ps)
    st = pool._st
    out = np.empty(3 * ps, dtype=np.int64)
    assert kernels(ps).alloc(st, out) == 3 * ps
    assert out.tolist() == list(range(3 * ps))
    assert kernels(ps).free(st, out[ps:]) == 2 * ps
    assert R.merge(st) == 2  # pages moved onto the free list
    assert R.merge(st) == 0
    assert kernels(ps).alloc(st, np.empty(0, dtype=np.int64)) == 0
    assert K.reset(st) == 8
    pool.check_invariants()


BIG = 300  # pages: ring positions past 256 are not cached small ints in Python


def _wrapped(ps: int, track: bool = False) -> LogicalHostPool:
    """A BIG-page pool whose next allocation of 10 pages wraps the ring's end.

    After the calls: head at BIG-3 with 3 free pages, then BIG-3 released
    pages staged from ring position 0 on.
    """
    pool = LogicalHostPool(BIG * ps, ps, track=track)
    held = pool.alloc((BIG - 3) * ps)
    assert held is not None
    pool.free(held)
    st = pool._st
    one_entry_per_page(st, head=BIG - 3)
    assert (int(st[L.H_HEAD]), int(st[L.H_NFREE]), int(st[L.H_NREL])) == (BIG - 3, 3, BIG - 3)
    return pool


@pytest.mark.parametrize("ps", [1, 3, 16])
@pytest.mark.parametrize("bad", ["held", "too-big", "equal-n", "negative"])
@pytest.mark.parametrize("track", [False, True], ids=["plain", "tracked"])
def test_alloc_rolls_back_a_corrupt_ring_across_its_end(
    ps: int, bad: str, track: bool, snapshot: Any, unchanged: Any
) -> None:
    """A listed page that is not free (impossible through the API) stops alloc unchanged.

    The bad entry is the 9th page the allocation would take, past the ring's
    end, so the roll-back walks back across it. A tracking pool allocates
    through the checked path: the same RuntimeError, never a ``None``.
    """
    pool = _wrapped(ps, track)
    held = pool.alloc(2 * ps)  # pages BIG-3, BIG-2 now held; head at BIG-1
    assert held is not None
    ring = one_entry_per_page(pool._st)
    victim = 7  # ring position of the 9th page from head BIG-1
    value = {"held": BIG - 3, "too-big": BIG + 5, "equal-n": BIG, "negative": -1}[bad]
    old = int(ring[victim])
    ring[victim] = value
    before = snapshot(pool)
    before_owner = pool._owner.copy()
    with pytest.raises(RuntimeError, match=r"alloc kernel failed with code 7 at 8;"):
        pool.alloc(10 * ps)
    assert np.array_equal(pool._owner, before_owner)
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(pool), strict=True))
    ring[victim] = old
    unchanged(pool, snapshot(pool))
    out = pool.alloc(10 * ps)  # and with the ring repaired, the same call works
    assert out is not None
    assert len(out) == 10 * ps


@pytest.mark.parametrize("ps", [1, 3, 16])
@pytest.mark.parametrize("bad", ["held", "too-big", "equal-n", "negative"])
@pytest.mark.parametrize("track", [False, True], ids=["plain", "tracked"])
def test_a_one_page_alloc_refuses_a_corrupt_head(ps: int, bad: str, track: bool, snapshot: Any, unchanged: Any) -> None:
    """The one-page path (no run, no loop) checks the page it takes as the general one does."""
    pool = _wrapped(ps, track)
    held = pool.alloc(2 * ps)  # pages BIG-3, BIG-2 now held; head at BIG-1
    assert held is not None
    ring = one_entry_per_page(pool._st)
    head = int(pool._st[L.H_HEAD])
    value = {"held": BIG - 3, "too-big": BIG + 5, "equal-n": BIG, "negative": -1}[bad]
    old = int(ring[head])
    ring[head] = value
    before = snapshot(pool)
    before_owner = pool._owner.copy()
    with pytest.raises(RuntimeError, match=r"alloc kernel failed with code 7 at 0;"):
        pool.alloc(ps)
    assert np.array_equal(pool._owner, before_owner)
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(pool), strict=True))
    ring[head] = old
    out = pool.alloc(ps)  # and with the ring repaired, the same call takes that page
    assert out is not None
    assert out.tolist() == [old * ps + j for j in range(ps)]


@pytest.mark.parametrize("ps", [1, 3, 16])
def test_failed_free_rolls_back_across_the_rings_end(ps: int, snapshot: Any, unchanged: Any) -> None:
    """Staging wraps the ring's end; the roll-back and the duplicate scan follow it."""
    pool = _wrapped(ps)
    held = pool.alloc(10 * ps)  # wraps: pages BIG-3..BIG-1 and 0..6
    assert held is not None
    # Stage from ring position BIG-3+... : everything but the last page, then
    # a page freed twice, then (second call) a page never allocated.
    pages = held.reshape(-1, ps)
    before = snapshot(pool)
    twice = np.concatenate([pages.reshape(-1), pages[4]])
    with pytest.raises(DoubleFreeError, match=rf"is freed twice in one call \(again at indices\[{10 * ps}\]"):
        pool.free(twice)
    unchanged(pool, before)
    # The page freed twice is the last one staged, for every length: for
    # some the staging wraps just before it, and the scan must follow.
    for k in range(1, 11):
        with pytest.raises(DoubleFreeError, match=rf"is freed twice in one call \(again at indices\[{k * ps}\]"):
            pool.free(np.concatenate([pages[:k].reshape(-1), pages[k - 1]]))
        unchanged(pool, before)
    # A higher page id (BIG-3) staged before a lower one (2) freed already:
    # "not allocated", however the staged ids compare.
    pool.free(pages[5])
    lower = np.concatenate([pages[0], pages[5]])
    assert int(pages[0][0]) // ps > int(pages[5][0]) // ps
    before = snapshot(pool)
    with pytest.raises(DoubleFreeError, match=rf"freed at indices\[{ps}\] \(flattened\), is not allocated"):
        pool.free(lower)
    unchanged(pool, before)
    assert pool.free(np.delete(pages, 5, axis=0).reshape(-1)) == 9 * ps


@pytest.mark.parametrize("track", [False, True], ids=["plain", "tracked"])
@pytest.mark.parametrize("count", [600, 2048, 5000], ids=["short", "gil twin", "run kernel"])
def test_a_run_staged_across_the_rings_end_is_read_back_whole(
    count: int, track: bool, snapshot: Any, unchanged: Any
) -> None:
    """A run staged from the ring's last position has its length entry at position 0.

    Each kind of free (the flat short free, the GIL-keeping twin, the run
    kernel) stages the run there, and reads its length back across the end
    wherever it walks the staged runs: the duplicate scan and the roll-back
    of a failed free, the tracking pass, the release. Read from past the
    end, the length would be the page id: the roll-back would leave the
    run's other pages flagged free.
    """
    n = 8192
    pool = LogicalHostPool(n, 1, track=track)
    held = pool.alloc(n - 1)  # one page left: n - 1
    assert held is not None
    st = pool._st
    one_entry_per_page(st, head=n - 2)  # that page's entry at n - 2: staging starts at the ring's last position
    assert (int(st[L.H_HEAD]) + int(st[L.H_EFREE])) % n == n - 1
    before = snapshot(pool)
    with pytest.raises(DoubleFreeError, match=rf"is freed twice in one call \(again at indices\[{count}\]"):
        pool.free(np.concatenate([held[:count], held[:1]]))  # the run staged, then its first page again
    unchanged(pool, before)
    assert pool.free(held[:count]) == count
    ring = L.ring_ids(st, n)
    assert (int(ring[n - 1]), int(ring[0])) == (0, -count)  # the run: its first page, then its length across the end
    pool.check_invariants()
    assert pool.available_size() == count + 1
    got = pool.alloc(count + 1)
    assert got is not None
    assert got.tolist() == [n - 1, *range(count)]  # FIFO: the free list's page, then the released run


def test_the_paged_status_codes_do_not_reuse_the_cores() -> None:
    """hostpool_nb.paged decodes its kernels' statuses with both modules' codes: one value, one meaning."""
    from hostpool_nb._kernels import paged as P

    core = {name: value for name, value in vars(K).items() if name.startswith("E_")}
    paged = {name: value for name, value in vars(P).items() if name.startswith("E_") and name not in core}
    assert paged
    assert not set(core.values()) & set(paged.values())
    assert len(set(paged.values())) == len(paged)
    assert all(1 <= c < 1 << L._CODE_BITS for c in paged.values())


def test_kernels_call_only_callees() -> None:
    """A kernel is compiled on first use (a ``_kernels.jit.Kernel``), which numba cannot call from another kernel."""
    import ast
    import inspect

    from hostpool_nb._kernels import host as _host_kernels
    from hostpool_nb._kernels import paged as _paged_kernels

    for module in (K, _paged_kernels, _host_kernels):
        tree = ast.parse(inspect.getsource(module))
        kernel_names = {
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef)
            and any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "_jit" for d in node.decorator_list)
        }
        assert kernel_names, module.__name__
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                called = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
                assert not (called & kernel_names) - {node.name}, (module.__name__, node.name, called & kernel_names)


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("how", ["short", "long", "tracked", "alloc_many"])
def test_a_sorted_pool_merges_before_allocating_on_every_path(ps: int, how: str) -> None:
    """The alloc kernels leave a sorted merge to the pool (E_MERGE_FIRST); every path merges, then allocates once."""
    pages = 12000  # half of them freed: enough for a call beyond S.SHORT_SLOTS at page size 1
    pool = LogicalHostPool(pages * ps, ps, merge="sorted", track=how == "tracked")
    held = pool.alloc(pages * ps)
    assert held is not None
    back = held.reshape(-1, ps)[::-1][: pages // 2]  # freed in descending order: a FIFO merge would keep it
    pool.free(back.reshape(-1))
    calls = int(pool._st[L.H_ALLOC_CALLS])
    want_pages = 5000 if how == "long" else 3
    need = want_pages * ps
    if how == "alloc_many":
        got = pool.alloc_many([ps, need - ps])
        assert got is not None
        out = got[0]
    else:
        out = pool.alloc(need)
    assert out is not None
    if how == "long":
        assert need > S.SHORT_SLOTS
    ascending = np.sort(back[:, 0])[:want_pages] if how != "long" else None
    firsts = out.reshape(-1, ps)[:, 0]
    if ascending is not None:
        assert firsts.tolist() == ascending.tolist()  # merged in ascending order, then taken
    assert np.all(np.diff(firsts) > 0)
    assert int(pool._st[L.H_MERGES]) == 1
    assert int(pool._st[L.H_ALLOC_CALLS]) == calls + 1  # the refused first attempt is not counted
    pool.check_invariants()


@pytest.mark.parametrize("track", [False, True])
@pytest.mark.parametrize(("page_size", "rest"), [(1, 1100), (1, 3), (3, 400), (16, 70), (16, 2)])
@pytest.mark.parametrize("past", [-1, 0, 1])
def test_a_free_stages_from_the_rings_start_when_the_window_ends_at_its_last_entry(
    page_size: int, rest: int, past: int, track: bool
) -> None:
    """A free stages its pages just past the live window, wrapped: at ring position 0 when the window ends at the end.

    The window is walked to end one entry before, exactly at, and one after
    the ring's last entry, then ``rest`` pages are freed in one call (long
    enough for the run kernels, or short). Staged one entry past the ring (a
    ``>`` for ``>=`` in the wrap), the free writes outside the ring and the
    pages come back wrong or the pool is corrupt.
    """
    singles = 4
    n = rest + singles
    pool = LogicalHostPool(n * page_size, page_size, track=track)
    held = list(pool.alloc(n * page_size).reshape(n, page_size))
    # One page's round trip moves the ring's head one entry on.
    while (int(pool._st[L.H_HEAD]) + singles - past) % n != 0:
        page = held.pop(0)
        pool.free(page)
        held.append(pool.alloc(page_size))
    order = []  # the pages, in the order allocation must hand them out again
    for _ in range(singles):
        page = held.pop(0)
        pool.free(page)
        order.append(int(page[0]) // page_size)
    st = pool._st
    assert int(st[L.H_HEAD] + st[L.H_EFREE] + st[L.H_EREL] + st[L.H_EPEND]) == n + past
    batch = np.concatenate(held)
    order += [int(s) // page_size for s in batch[::page_size]]
    assert pool.free(batch) == batch.size
    pool.check_invariants()
    again = pool.alloc(n * page_size)
    assert again is not None
    assert [int(s) // page_size for s in again[::page_size]] == order


@pytest.mark.parametrize("ps", [2, 3, 4, 16])
@pytest.mark.parametrize("fault", ["misaligned", "out of range"])
def test_a_fault_in_a_long_free_is_reported_at_its_exact_position(ps: int, fault: str) -> None:
    """Every page position of short and long frees, in and after the first block, in runs and out of them: the
    error names the entry."""
    long = S.SHORT_SLOTS // ps + 65  # pages: a call of more than SHORT_SLOTS slots runs the long kernel
    pool = LogicalHostPool(long * ps, ps)
    held = pool.alloc(long * ps)
    assert held is not None
    shuffled = held.reshape(-1, ps)[np.random.default_rng(ps).permutation(long)].reshape(-1)
    for source, pages in ((held, 5), (held, long), (shuffled, 5), (shuffled, long)):
        for q in range(pages):
            slots = source[: pages * ps].copy()
            slots[q * ps] = slots[q * ps] + 1 if fault == "misaligned" else long * ps + 7
            error = PartialPageError if fault == "misaligned" else SlotRangeError
            with pytest.raises(error, match=rf"indices\[{q * ps}\] \(flattened\)"):
                pool.free(slots)
    pool.check_invariants()
    assert pool.available_size() == 0
