"""Short calls run flat kernels, medium ones keep the GIL, long ones release it; all do the same work.

``alloc`` and ``free`` of at most ``S.SHORT_SLOTS`` slots run the flat
``*_short`` kernels (``*_tracked_short`` on a tracking pool): one page loop,
no runs, for every page size. Up to ``K.GIL_SLOTS`` slots they run the page-
size class's ``*_gil`` kernels: the run kernels compiled a second time
(``_kernels.jit.variant``) without ``nogil``, since handing the GIL over costs more
than such a call's work. Here: the compile options of every kernel, which
kernel each size reaches, and that a short kernel, a twin and the run
kernel leave the same state and return the same status from the same
state, on success and on every kind of failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hostpool_nb import DoubleFreeError, HostPoolError, LogicalHostPool
from hostpool_nb._kernels import flat as F
from hostpool_nb._kernels import layout as L
from hostpool_nb._kernels import paged as P
from hostpool_nb._kernels import pool as K
from hostpool_nb._kernels import short as S
from tests.conftest import JIT_DISABLED

needs_jit = pytest.mark.skipif(JIT_DISABLED, reason="compile options exist only with the JIT on")

# The kernels that keep the GIL: the flat short ones and the run kernels' twins.
GIL_KERNELS = {
    getattr(k, "__name__", "")
    for ks in K.KERNELS
    for k in ks
    if getattr(k, "__name__", "").endswith(("_short", "_gil"))
}
GIL_TWINS = {name for name in GIL_KERNELS if name.endswith("_gil")}


def _dispatchers() -> list[tuple[Any, str, Any]]:
    """Every kernel of the core and paged modules, compiled, as (module, name, numba's dispatcher)."""
    from hostpool_nb._kernels.jit import Kernel

    found = []
    for module in (K, P):
        for name, value in vars(module).items():
            home = (module.__name__, F.__name__) if module is K else (module.__name__,)  # K compiles flat's
            if isinstance(value, Kernel) and value.__module__ in home:
                found.append((module, name, value.dispatcher))
    return found


@needs_jit
def test_only_the_short_kernels_and_the_twins_keep_the_gil() -> None:
    kernels = _dispatchers()
    assert len(kernels) > 20  # the collection found the kernels at all
    assert len(GIL_KERNELS) == 8  # alloc short, the free short of each class, tracked short; three run twins
    for module, name, kernel in kernels:
        keeps_gil = module is K and name in GIL_KERNELS
        assert kernel.targetoptions.get("nogil") is (not keeps_gil), (module.__name__, name)


@needs_jit
def test_no_kernel_counts_references() -> None:
    from numba.core.extending import _Intrinsic

    from hostpool_nb._kernels import layout as L

    for module, name, kernel in _dispatchers():
        assert kernel.targetoptions.get("_nrt") is False, (module.__name__, name)
    # The windows on the state are made in the kernel's own code, not returned by a function.
    for name in ("ring_view", "owner_view", "marks_view", "host_ring", "host_gens", "host_refs", "host_flags"):
        assert isinstance(getattr(L, name), _Intrinsic), name


@needs_jit
def test_twins_have_their_own_cache_files() -> None:
    assert len(GIL_TWINS) == 3
    for name in sorted(GIL_TWINS):
        twin, original = getattr(K, name), getattr(K, name.removesuffix("_gil"))
        assert twin.py_func is not original.py_func
        assert twin.py_func.__code__ is original.py_func.__code__  # one source
        assert twin.py_func.__qualname__ == name
        index = getattr(getattr(getattr(twin.dispatcher, "_cache", None), "_cache_file", None), "_index_name", "")
        assert index.startswith(f"pool.{name}-"), index


class _Spy:
    """Records which of the pool's kernels ran: wraps the pool's bound entry points."""

    def __init__(self, pool: LogicalHostPool) -> None:
        from types import SimpleNamespace

        self.calls: list[str] = []
        k = pool._k
        pool._k = SimpleNamespace(**{name: self._wrap(name, getattr(k, name)) for name in K.PageSizeKernels._fields})
        from hostpool_nb._core import pool as _pool

        # The pool's rows of kernels by call length, looked up again from the spies, short ones first.
        pool._alloc_kernels = list(_pool._ALLOC_KERNELS[pool.track])
        pool._free_kernels = list(_pool._FREE_KERNELS[pool.track])
        pool._alloc_short = pool._sized(pool._alloc_kernels, 0)
        pool._free_short = pool._sized(pool._free_kernels, 0)

    def _wrap(self, name: str, kernel: Callable[..., int]) -> Callable[..., int]:
        def spy(*args: Any) -> int:
            self.calls.append(name)
            return kernel(*args)

        return spy

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


@pytest.mark.parametrize("track", [False, True], ids=["plain", "tracked"])
@pytest.mark.parametrize("page_size", [1, 16, 3])
def test_each_size_reaches_the_kernel_for_it(page_size: int, track: bool) -> None:
    pool = LogicalHostPool(page_size << 15, page_size, track=track)
    spy = _Spy(pool)
    names = ("alloc_tracked", "free_tracked") if track else ("alloc", "free")
    alloc_long, free_long = names
    alloc_short, free_short = (f"{n}_short" for n in names)
    # A tracking pool has no GIL twins: beyond the short calls, the run kernels.
    alloc_mid, free_mid = names if track else (f"{n}_gil" for n in names)
    top = S.SHORT_SLOTS // page_size * page_size  # the longest short request
    top_gil = K.GIL_SLOTS // page_size * page_size  # the longest request that keeps the GIL
    for size, alloc_kernel, free_kernel in (
        (page_size, alloc_short, free_short),
        (top, alloc_short, free_short),
        (top + page_size, alloc_mid, free_mid),
        (top_gil, alloc_mid, free_mid),
        (top_gil + page_size, alloc_long, free_long),
    ):
        out = pool.alloc(size)
        assert out is not None
        assert len(out) == size
        assert spy.take() == [alloc_kernel], size
        assert pool.free(out) == size
        assert spy.take() == [free_kernel], size
    # A failing free reaches the same kernel as a successful one.
    with pytest.raises(HostPoolError):
        pool.free(np.arange(page_size, dtype=np.int64))  # never allocated
    assert spy.take() == [free_short]
    pool.check_invariants()


def _model_state(page_size: int, ops: list[int], seed: int, track: bool) -> tuple[LogicalHostPool, list[np.ndarray]]:
    """A pool after ``ops`` (sizes in pages: positive allocs, negative frees of a held one)."""
    pool = LogicalHostPool(64 * page_size, page_size, track=track)
    rng = np.random.default_rng(seed)
    held: list[np.ndarray] = []
    for op in ops:
        if op > 0:
            out = pool.alloc(op * page_size, tag=op)
            if out is not None:
                held.append(out)
        elif held:
            out = held.pop(int(rng.integers(len(held))))
            pages = out.reshape(-1, page_size)[rng.permutation(len(out) // page_size)]
            pool.free(pages.reshape(-1))
    return pool, held


def _probe_inputs(page_size: int, held: list[np.ndarray], seed: int) -> list[np.ndarray]:
    """Free inputs of every outcome: held pages, a double free, a partial page, out of range, misaligned."""
    rng = np.random.default_rng(seed)
    size = 64 * page_size
    probes = [h.copy() for h in held[:2]]
    if held:
        both = np.concatenate([held[0], held[0]])  # named twice in one call
        probes.append(both)
        broken = held[0].copy()
        broken[-1] += 1 if page_size > 1 else size  # a partial page, or out of range
        probes.append(broken)
    probes.append(np.arange(page_size, dtype=np.int64) + page_size * int(rng.integers(64)))
    probes.append(np.arange(page_size, dtype=np.int64) + 1)  # misaligned (page_size > 1)
    probes.append(np.arange(page_size + 1, dtype=np.int64))  # not a whole number of pages
    return probes


def _assert_same_pool(st_a: np.ndarray, st_b: np.ndarray) -> None:
    """The same pool: header (but for the lists' entry counts), pages listed in order, flags and tracking words.

    The kernels may split the same lists into runs differently (a short
    free stages pages of more than one slot one entry each, the run kernels
    join pages in a row), and the ring's scratch is not state.
    """
    entries = [L.H_EFREE, L.H_EREL, L.H_EPEND]
    np.testing.assert_array_equal(np.delete(st_a[: L.HEADER], entries), np.delete(st_b[: L.HEADER], entries))
    for a, b in zip(L.window_entries(st_a), L.window_entries(st_b), strict=True):
        np.testing.assert_array_equal(L.run_pages(a), L.run_pages(b))
    n = int(st_a[L.H_NPAGES])
    np.testing.assert_array_equal(L.owner_flags(st_a, n), L.owner_flags(st_b, n))
    track = int(st_a[L.H_TRACK])
    if track:
        np.testing.assert_array_equal(st_a[track:], st_b[track:])


@given(
    page_size=st.sampled_from([1, 3, 16]),
    ops=st.lists(st.integers(-1, 9), max_size=30),
    seed=st.integers(0, 2**16),
    track=st.booleans(),
)
def test_short_kernels_and_twins_do_what_the_run_kernels_do(
    page_size: int, ops: list[int], seed: int, track: bool
) -> None:
    pool, held = _model_state(page_size, ops, seed, track)
    outs = [np.empty(n * page_size, dtype=np.int64) for n in (0, 1, 5, 70)]
    probes = _probe_inputs(page_size, held, seed)
    site = (5,) if track else ()  # a site id the tracking kernels record
    cases: list[tuple[Callable[..., int], Callable[..., int], np.ndarray]]
    ks = K.KERNELS[page_size == 1]
    if track:
        cases = [(ks.alloc_tracked, ks.alloc_tracked_short, out) for out in outs]
        cases += [(ks.free_tracked, ks.free_tracked_short, probe) for probe in probes]
    else:
        cases = [(ks.alloc, other, out) for out in outs for other in (ks.alloc_gil, ks.alloc_short)]
        cases += [(ks.free, other, probe) for probe in probes for other in (ks.free_gil, ks.free_short)]
    for original, twin, arg in cases:
        st_a, st_b = pool._st.copy(), pool._st.copy()
        arg_a, arg_b = arg.copy(), arg.copy()
        status = original(st_a, arg_a, *site)
        assert twin(st_b, arg_b, *site) == status, (original, arg)
        _assert_same_pool(st_a, st_b)
        if status >= 0:
            np.testing.assert_array_equal(arg_a, arg_b)  # an alloc's slots


@pytest.mark.parametrize("length", [8, 9, 15, 16, 17, 24])
@pytest.mark.parametrize("start", range(17))
def test_a_page_size_1_run_whose_last_page_is_free_is_refused(start: int, length: int) -> None:
    """A short free's run at page size 1: the run's last flag word is tested (masked to the run), every start."""
    pool = LogicalHostPool(64, 1)
    assert pool.alloc(64) is not None
    last = start + length - 1
    pool.free(np.array([last]))
    before = _lists_and_flags(pool)
    with pytest.raises(
        DoubleFreeError, match=rf"page {last} \(slots {last}..{last}\), freed at indices\[{length - 1}\]"
    ):
        pool.free(np.arange(start, start + length))
    assert _lists_and_flags(pool) == before
    assert pool.free(np.arange(start, last)) == length - 1  # the run without it: all allocated


@pytest.mark.parametrize("length", [8, 9, 16, 17])
@pytest.mark.parametrize("again", ["first", "last"])
def test_a_page_size_1_page_named_again_after_its_run_is_a_duplicate(length: int, again: str) -> None:
    """The duplicate search reads the last staged run's length: a page of that run named again is found in it."""
    pool = LogicalHostPool(64, 1)
    assert pool.alloc(64) is not None
    start = 5
    page = start if again == "first" else start + length - 1
    before = _lists_and_flags(pool)
    with pytest.raises(
        DoubleFreeError, match=rf"page {page} .* is freed twice in one call \(again at indices\[{length}\]"
    ):
        pool.free(np.array([*range(start, start + length), page]))
    assert _lists_and_flags(pool) == before


def _lists_and_flags(pool: LogicalHostPool) -> tuple[list[list[int]], list[int]]:
    """The pool's lists and every page's owner flag: what a refused free leaves as it was (the ring's spare
    part is scratch)."""
    n = pool.size // pool.page_size
    return [x.tolist() for x in L.lists_of(pool._st)], L.owner_flags(pool._st, n).tolist()
