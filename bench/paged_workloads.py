"""The paged workload: ``hostpool_nb.paged`` against its numpy oracle, one call at a time.

``hostpool_nb.paged.PagedTokenToKVPoolAllocator`` and the algorithm of
sglang-jax's allocator written in numpy from SPEC-paged
(``bench/paged_baselines.py``) are timed on the four calls the issue tracker
names: ``free`` of one request, ``alloc_extend`` of a batch, ``alloc_decode``
of a batch and ``merge_and_sort_free``.

Unlike the other workloads' loops, each timed iteration here is a single
call on a state set up outside the timed region: ``restore_state`` of a
snapshot before each ``alloc_extend``, ``alloc_decode`` and merge (the same
state every time), an ``alloc`` of the request before each ``free`` (the
same number of free pages every time). Each call is timed alone with
``perf_counter`` (the clock's own cost, tens of nanoseconds, is included and
counts against the faster implementation); a sample is the median call of
``n`` iterations, ``n`` chosen per implementation from a first timing (their
mean is kept too); samples are interleaved and their median reported
(``bench/timing.py``).

Before and after the timed loops, one checked iteration runs on every
implementation: the call's arguments (which come from the set-up calls, so
those are compared too), its result (values, dtype, shape) and the lists
afterwards (``free_pages`` in order, ``release_pages`` as a set,
``available_size``), then again after a ``merge_and_sort_free``, must be the
same everywhere; otherwise :class:`PagedDivergence` is raised. The set-up
calls that build each case (the prefixes' ``alloc_extend``, the released
pages) are compared the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .impls import HOSTPOOL, NUMPY
from .timing import gc_paused, interleaved, median
from .workloads import Cell

PAGED_WORKLOAD = "paged allocator"


class PagedDivergence(RuntimeError):
    """hostpool_nb.paged and the numpy oracle answered a call of the paged workload differently."""


@dataclass
class PagedConfig:
    """Sizes and repeat counts of the paged workload (defaults: the issue's sizes)."""

    page_size: int = 16
    # free: a request of ``free_request_tokens`` freed with this many pages on the free list.
    free_pages: tuple[int, ...] = (10_000, 62_500, 250_000, 1_000_000)
    free_request_tokens: int = 2048
    # alloc_extend: prefixes in [0, extend_max_prefix], extensions in [1, extend_max_tokens].
    extend_requests: int = 32
    extend_max_prefix: int = 4096
    extend_max_tokens: int = 2048
    extend_pool_pages: int = 62_500  # 1M tokens at page size 16
    # alloc_decode: sequences of 1..decode_max_len tokens grow by one.
    decode_seqs: int = 256
    decode_max_len: int = 4096
    decode_pool_pages: int = 62_500
    # merge_and_sort_free: a pool of free + released + held pages.
    merge_released: int = 100_000
    merge_free: int = 62_500
    merge_held: int = 37_500
    merge_chunk_pages: int = 1000  # pages per set-up free call
    repeats: int = 3
    min_iters: int = 3
    min_loop_s: float = 0.02  # timed calls per sample: at least this long for each implementation...
    max_loop_s: float = 0.25  # ...unless a sample's iterations (set-up included) would exceed this


def paged_cases(pc: PagedConfig) -> list[dict[str, Any]]:
    """What each cell of the workload measures, in order: the keys of its ``params`` (cells add details).

    ``call`` names the call timed; the free cells, one per ``free_pages``
    size, then alloc_extend and alloc_decode with lists and with arrays,
    then the merge.
    """
    both = ("lists", "arrays")
    cases: list[dict[str, Any]] = [
        *({"call": "free", "free_pages": n, "request_tokens": pc.free_request_tokens} for n in pc.free_pages),
        *({"call": "alloc_extend", "requests": pc.extend_requests, "inputs": inputs} for inputs in both),
        *({"call": "alloc_decode", "sequences": pc.decode_seqs, "inputs": inputs} for inputs in both),
        {"call": "merge_and_sort_free", "released_pages": pc.merge_released, "free_pages": pc.merge_free},
    ]
    return [{"page_size": pc.page_size, **c} for c in cases]


def paged_steps(pc: PagedConfig) -> int:
    """Progress steps of the paged workload: one per sample (two implementations, no torch)."""
    return len(paged_cases(pc)) * pc.repeats * 2


def measure_paged(
    impls: dict[str, Callable[[int, int], Any]],
    pc: PagedConfig,
    case: dict[str, Any],
    seed: int = 0,
    tick: Callable[[], None] | None = None,
) -> Cell:
    """Measure one entry of :func:`paged_cases`."""
    call = case["call"]
    if call == "free":
        return measure_paged_free(impls, pc, case["free_pages"], tick)
    if call == "alloc_extend":
        return measure_paged_extend(impls, pc, seed, case["inputs"] == "arrays", tick)
    if call == "alloc_decode":
        return measure_paged_decode(impls, pc, seed, case["inputs"] == "arrays", tick)
    if call == "merge_and_sort_free":
        return measure_paged_merge(impls, pc, seed, tick)
    raise ValueError(f"no paged case times {call!r}")


def paged_implementations() -> dict[str, Callable[[int, int], Any]]:
    """Name -> paged allocator constructor ``(size, page_size)``, hostpool_nb first (no torch baseline).

    The classes are looked up at each call, so a test's monkeypatched method is the one measured.
    """
    from hostpool_nb import paged

    from . import paged_baselines

    return {
        HOSTPOOL: lambda size, ps: paged.PagedTokenToKVPoolAllocator(size, ps, None),
        NUMPY: lambda size, ps: paged_baselines.PagedTokenToKVPoolAllocator(size, ps, None),
    }


# -- comparing the implementations --------------------------------------------------


def _pages(tokens: np.ndarray, ps: int) -> np.ndarray:
    """Pages holding ``tokens`` tokens, element-wise (ceil division)."""
    return -(-tokens // ps)


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"a {x.dtype} array of shape {x.shape}"
    if isinstance(x, list):
        return f"a list of {len(x)}"
    return repr(x)


def _array_difference(mine: np.ndarray, ref: np.ndarray) -> str | None:
    if mine.dtype != ref.dtype:
        return f"has dtype {mine.dtype}, not {ref.dtype}"
    if mine.shape != ref.shape:
        return f"has shape {mine.shape}, not {ref.shape}"
    diff = np.flatnonzero(mine.reshape(-1) != ref.reshape(-1))
    if diff.size == 0:
        return None
    i = int(diff[0])
    return f"differs first at position {i} ({diff.size} in all): {mine.flat[i]}, not {ref.flat[i]}"


def _difference(mine: Any, ref: Any) -> str | None:
    """How ``mine`` differs from ``ref`` (arrays: type, dtype, shape, values), or None if it does not."""
    if isinstance(mine, np.ndarray) and isinstance(ref, np.ndarray):
        return _array_difference(mine, ref)
    if isinstance(mine, list) and isinstance(ref, list):
        if len(mine) != len(ref):
            return f"has {len(mine)} items, not {len(ref)}"
        at = next((i for i, (a, b) in enumerate(zip(mine, ref, strict=True)) if a != b), None)
        return None if at is None else f"differs first at position {at}: {mine[at]!r}, not {ref[at]!r}"
    if isinstance(mine, np.ndarray) or isinstance(ref, np.ndarray) or type(mine) is not type(ref) or mine != ref:
        return f"is {_describe(mine)}, not {_describe(ref)}"
    return None


def _same(values: dict[str, Any], what: str) -> None:
    """Raise :class:`PagedDivergence` unless every implementation's value equals the oracle's (numpy's)."""
    ref_name = NUMPY if NUMPY in values else next(iter(values))
    ref = values[ref_name]
    for name, value in values.items():
        if name == ref_name:
            continue
        problem = _difference(value, ref)
        if problem:
            raise PagedDivergence(f"{what}: {name}'s {problem} (as {ref_name}'s)")


def _same_items(values: dict[str, dict[str, Any]], what: str) -> None:
    """:func:`_same` on each named item of per-implementation dicts (argument lists, lists of a rank)."""
    for key in next(iter(values.values())):
        _same({name: v[key] for name, v in values.items()}, f"{what}, {key}")


def _lists(alloc: Any) -> dict[str, Any]:
    """Rank 0's lists as the contract defines them: free pages in order, released pages as a set."""
    return {
        "free_pages[0]": np.asarray(alloc.free_pages[0]),
        "release_pages[0] (sorted)": np.sort(np.asarray(alloc.release_pages[0])),
        "available_size()": int(alloc.available_size()),
    }


def _same_lists(allocs: dict[str, Any], what: str) -> None:
    _same_items({name: _lists(a) for name, a in allocs.items()}, what)


def _allocated(got: Any, what: str) -> Any:
    if got is None:
        raise PagedDivergence(f"{what} returned None: the pool is too small for the workload")
    return got


# -- a case: one call, prepared identically before each timing --------------------------------


@dataclass
class _Subject:
    """One implementation in one case: its allocator, the untimed set-up of an iteration, the timed call."""

    alloc: Any
    prepare: Callable[[], tuple[Any, ...]]  # puts the state back; returns the call's arguments
    call: Callable[..., Any]


@dataclass
class _Case:
    what: str  # names the case in error messages
    subjects: dict[str, _Subject]
    compare_result: bool = True  # free returns a count in hostpool_nb, None in the original


def _check(case: _Case, when: str) -> dict[str, tuple[float, float]]:
    """One iteration on every implementation, everything it gives and leaves compared.

    It starts with a ``merge_and_sort_free`` everywhere, so that the
    implementations, which ran different numbers of iterations, stand in
    the same state (the set-up of the restoring cases overrides it anyway).
    Returns each implementation's seconds of set-up + call, and of the call
    (a first timing for :func:`_iterations`).
    """
    what = f"paged {case.what}, {when}"
    clock = time.perf_counter
    for s in case.subjects.values():
        s.alloc.merge_and_sort_free()
    args, results, took = {}, {}, {}
    with gc_paused():
        for name, s in case.subjects.items():
            t0 = clock()
            args[name] = s.prepare()
            t1 = clock()
            results[name] = s.call(*args[name])
            t2 = clock()
            took[name] = (t2 - t0, t2 - t1)
    _same_items({name: {f"argument {i}": x for i, x in enumerate(a)} for name, a in args.items()}, what)
    if case.compare_result:
        _same(results, f"{what}, the result")
    allocs = {name: s.alloc for name, s in case.subjects.items()}
    _same_lists(allocs, f"{what}, the lists after the call")
    for a in allocs.values():
        a.merge_and_sort_free()
    _same_lists(allocs, f"{what}, the lists after a merge_and_sort_free")
    return took


def _timed_calls(subject: _Subject, n: int, means: list[float] | None = None) -> float:
    """Median seconds of ``n`` calls, each timed alone after its untimed set-up; ``means`` gets their mean.

    The median, not the mean: on a shared machine a few calls of microseconds
    are preempted for milliseconds, which would swamp a mean; every
    iteration starts from the same state, so their typical time is the
    call's cost.
    """
    prepare, call = subject.prepare, subject.call
    clock = time.perf_counter
    times = [0.0] * n
    with gc_paused():
        for i in range(n):
            args = prepare()
            t0 = clock()
            call(*args)
            times[i] = clock() - t0
    if means is not None:
        means.append(math.fsum(times) / n)
    return median(times)


def _iterations(subject: _Subject, pc: PagedConfig, first: tuple[float, float]) -> int:
    """Iterations per sample: timed calls summing to ``min_loop_s``, within ``max_loop_s`` with set-up.

    From the faster of the checked iteration (``first``: seconds of set-up +
    call, and of the call) and one more, unless the first already exceeds
    ``max_loop_s`` (the oracle's slowest calls take seconds).
    """
    iter_s, call_s = first
    if iter_s <= pc.max_loop_s:
        clock = time.perf_counter
        with gc_paused():
            t0 = clock()
            args = subject.prepare()
            t1 = clock()
            subject.call(*args)
            t2 = clock()
        iter_s, call_s = min(iter_s, t2 - t0), min(call_s, t2 - t1)
    call_s, iter_s = max(call_s, 1e-9), max(iter_s, 1e-9)
    return max(pc.min_iters, min(math.ceil(pc.min_loop_s / call_s), int(pc.max_loop_s / iter_s)))


def _measure(case: _Case, pc: PagedConfig, params: dict[str, Any], tick: Callable[[], None] | None) -> Cell:
    first = _check(case, "checked call before timing")
    iters = {name: _iterations(s, pc, first[name]) for name, s in case.subjects.items()}
    means: dict[str, list[float]] = {name: [] for name in case.subjects}

    def runner(name: str) -> Callable[[], float]:
        return lambda: _timed_calls(case.subjects[name], iters[name], means[name])

    samples = interleaved({name: runner(name) for name in case.subjects}, pc.repeats, tick)
    _check(case, "checked call after the timed loops")
    return Cell(
        workload=PAGED_WORKLOAD,
        params={"page_size": pc.page_size, **params},
        per_op={name: median(s) for name, s in samples.items()},
        samples=samples,
        extra={"iterations_per_sample": iters, "sample_means": means},
    )


def timer_overhead(n: int = 20_000) -> float:
    """Seconds the per-call timing adds to a call that does nothing (included in every figure)."""
    noop = _Subject(None, tuple, lambda: None)
    return median([_timed_calls(noop, n) for _ in range(3)])


# -- free --------------------------------------------------------------------------


def measure_paged_free(
    impls: dict[str, Callable[[int, int], Any]],
    pc: PagedConfig,
    free_pages: int,
    tick: Callable[[], None] | None = None,
) -> Cell:
    """Seconds per ``free`` of one request of ``free_request_tokens`` with ``free_pages`` pages free.

    The pool has ``free_pages + request pages`` pages. Untimed, before each
    call: ``alloc`` of the request, which leaves exactly ``free_pages``
    pages on the free and release lists together - the pages the original's
    ``free`` scans (it set-subtracts against both). The alloc takes the
    front of the free list and merges the release list in (untimed) when
    that runs short, every ``free_pages / request pages`` iterations, as a
    server's allocations do; merging before every call instead would leave
    the caches cold after a pass over the whole pool, which is the set-up's
    cost, not the free's. Timed: one ``free`` of the request's slots as an
    int32 array, as sglang-jax passes device indices. The checked calls
    start from a merge, so the request is pages ``1..request pages``.
    """
    ps, tokens = pc.page_size, pc.free_request_tokens
    if tokens < ps or tokens % ps:
        raise ValueError(f"free_request_tokens={tokens} is not a whole number of pages of {ps}")
    req_pages = tokens // ps
    size = ps * (free_pages + req_pages)
    subjects = {}
    for name, make in impls.items():
        a = make(size, ps)

        def prepare(a: Any = a) -> tuple[Any, ...]:
            got = _allocated(a.alloc(tokens), f"alloc({tokens})")
            return (np.asarray(got).astype(np.int32),)

        subjects[name] = _Subject(a, prepare, a.free)
    what = f"free of {tokens} tokens with {free_pages} free pages"
    sizes = {name: s.alloc.available_size() for name, s in subjects.items()}
    if set(sizes.values()) != {size}:
        raise PagedDivergence(f"paged {what}: available_size() of a fresh {size}-token pool: {sizes}")
    params = {"call": "free", "free_pages": free_pages, "request_tokens": tokens}
    cell = _measure(_Case(what, subjects, compare_result=False), pc, params, tick)
    cell.params.update(pool_tokens=size, free_index="int32 array")
    return cell


# -- alloc_extend and alloc_decode ----------------------------------------------------


def _grow_from_empty(
    impls: dict[str, Callable[[int, int], Any]], pool_pages: int, ps: int, lens: np.ndarray, what: str
) -> dict[str, tuple[Any, np.ndarray]]:
    """Allocators of ``pool_pages`` pages holding requests of ``lens`` tokens, and each request's last slot.

    The requests are made by one ``alloc_extend`` from empty prefixes (as a
    prefill), whose result is compared across implementations; each
    implementation's ``last_loc`` comes from its own result (``-1`` for an
    empty request).
    """
    need = int(np.sum(_pages(lens, ps)))
    if need > pool_pages:
        raise ValueError(f"{what}: {need} pages of requests do not fit a pool of {pool_pages} pages")
    n = lens.shape[0]
    made, got = {}, {}
    for name, make in impls.items():
        a = make(ps * pool_pages, ps)
        got[name] = _allocated(a.alloc_extend([0] * n, lens.tolist(), [-1] * n, int(lens.sum())), "alloc_extend")
        made[name] = a
    _same(got, f"paged {what}, set-up: the requests' alloc_extend from empty")
    _same_lists(made, f"paged {what}, set-up: the lists after the requests' alloc_extend")
    ends = np.cumsum(lens)
    out = {}
    for name, a in made.items():
        slots = np.asarray(got[name], dtype=np.int64)
        last = np.where(lens > 0, slots[np.maximum(ends - 1, 0)] if slots.size else -1, -1).astype(np.int64)
        out[name] = (a, last)
    return out


def _batch_args(arrays: list[np.ndarray], as_arrays: bool) -> list[Any]:
    """The batch arguments as int64 arrays (fresh for each implementation) or Python lists."""
    return [x.astype(np.int64) if as_arrays else x.tolist() for x in arrays]


def _from_backup(a: Any, args: tuple[Any, ...], call: Callable[..., Any]) -> _Subject:
    """A subject whose every timed ``call(*args)`` starts from ``a``'s state now (restored untimed)."""
    state = a.backup_state()

    def prepare() -> tuple[Any, ...]:
        a.restore_state(state)
        return args

    return _Subject(a, prepare, call)


def measure_paged_extend(
    impls: dict[str, Callable[[int, int], Any]],
    pc: PagedConfig,
    seed: int,
    as_arrays: bool,
    tick: Callable[[], None] | None = None,
) -> Cell:
    """Seconds per ``alloc_extend`` of ``extend_requests`` requests (seeded prefixes and extensions).

    The prefixes exist (set up by ``alloc_extend`` from empty, ``last_loc``
    their last slots); ``restore_state`` of the snapshot taken then runs
    before each call, untimed. ``as_arrays``: the batch arguments as int64
    arrays instead of Python lists (both implementations get the same kind).
    """
    ps = pc.page_size
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, pc.extend_max_prefix + 1, pc.extend_requests)
    seq = prefix + rng.integers(1, pc.extend_max_tokens + 1, pc.extend_requests)
    total = int(np.sum(seq - prefix))
    new_pages = int(np.sum(_pages(seq, ps) - _pages(prefix, ps)))
    what = f"alloc_extend of {pc.extend_requests} requests ({'arrays' if as_arrays else 'lists'})"
    if int(np.sum(_pages(seq, ps))) > pc.extend_pool_pages:
        raise ValueError(f"{what}: the requests need more than the pool's {pc.extend_pool_pages} pages")
    subjects = {}
    for name, (a, last) in _grow_from_empty(impls, pc.extend_pool_pages, ps, prefix, what).items():
        subjects[name] = _from_backup(a, (*_batch_args([prefix, seq, last], as_arrays), total), a.alloc_extend)
    params = {"call": "alloc_extend", "requests": pc.extend_requests, "inputs": "arrays" if as_arrays else "lists"}
    cell = _measure(_Case(what, subjects), pc, params, tick)
    cell.params.update(
        seed=seed,
        pool_tokens=ps * pc.extend_pool_pages,
        prefix_tokens=int(prefix.sum()),
        extend_tokens=total,
        new_pages=new_pages,
    )
    return cell


def measure_paged_decode(
    impls: dict[str, Callable[[int, int], Any]],
    pc: PagedConfig,
    seed: int,
    as_arrays: bool,
    tick: Callable[[], None] | None = None,
) -> Cell:
    """Seconds per ``alloc_decode`` of ``decode_seqs`` sequences of 1..``decode_max_len`` tokens (seeded).

    The sequences exist (``alloc_extend`` from empty); each gains one token,
    and those whose length is a multiple of the page size need a new page
    (at least one does). ``restore_state`` runs before each call, untimed.
    """
    ps = pc.page_size
    rng = np.random.default_rng(seed + 1)
    lens = rng.integers(1, pc.decode_max_len + 1, pc.decode_seqs)
    if not np.any(lens % ps == 0):  # a full page, so that the call takes at least one
        lens[0] = max(ps, lens[0] - lens[0] % ps)
    seq = lens + 1
    new_pages = int(np.sum(lens % ps == 0))
    what = f"alloc_decode of {pc.decode_seqs} sequences ({'arrays' if as_arrays else 'lists'})"
    if int(np.sum(_pages(seq, ps))) > pc.decode_pool_pages:
        raise ValueError(f"{what}: the sequences need more than the pool's {pc.decode_pool_pages} pages")
    subjects = {}
    for name, (a, last) in _grow_from_empty(impls, pc.decode_pool_pages, ps, lens, what).items():
        subjects[name] = _from_backup(a, tuple(_batch_args([seq, last], as_arrays)), a.alloc_decode)
    params = {"call": "alloc_decode", "sequences": pc.decode_seqs, "inputs": "arrays" if as_arrays else "lists"}
    cell = _measure(_Case(what, subjects), pc, params, tick)
    cell.params.update(seed=seed + 1, pool_tokens=ps * pc.decode_pool_pages, new_pages=new_pages)
    return cell


# -- merge_and_sort_free ------------------------------------------------------------


def measure_paged_merge(
    impls: dict[str, Callable[[int, int], Any]],
    pc: PagedConfig,
    seed: int,
    tick: Callable[[], None] | None = None,
) -> Cell:
    """Seconds per ``merge_and_sort_free`` of ``merge_released`` released pages into ``merge_free`` free ones.

    The pool holds ``merge_free + merge_released + merge_held`` pages. Set
    up once: one ``alloc`` of the released and held pages (the rest stays
    on the free list, ascending), then ``free`` of ``merge_released`` of
    them picked at random (seeded), ``merge_chunk_pages`` pages per call,
    every slot of each page, as int32. ``restore_state`` of that state runs
    before each merge, untimed.
    """
    ps, released, held = pc.page_size, pc.merge_released, pc.merge_held
    pool_pages = pc.merge_free + released + held
    order = np.random.default_rng(seed + 2).permutation(np.arange(1, released + held + 1, dtype=np.int64))[:released]
    chunks = [order[i : i + pc.merge_chunk_pages] for i in range(0, released, max(pc.merge_chunk_pages, 1))]
    what = f"merge_and_sort_free of {released} released pages"
    made, got = {}, {}
    for name, make in impls.items():
        a = make(ps * pool_pages, ps)
        got[name] = _allocated(a.alloc(ps * (released + held)), f"alloc({ps * (released + held)})")
        for pages in chunks:
            a.free((pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int32))
        made[name] = a
    _same(got, f"paged {what}, set-up: the alloc of the released and held pages")
    _same_lists(made, f"paged {what}, set-up: the lists after the frees")
    subjects = {}
    for name, a in made.items():
        subjects[name] = _from_backup(a, (), a.merge_and_sort_free)
    params = {"call": "merge_and_sort_free", "released_pages": released, "free_pages": pc.merge_free}
    cell = _measure(_Case(what, subjects), pc, params, tick)
    cell.params.update(
        held_pages=held, pool_tokens=ps * pool_pages, seed=seed + 2, free_calls=len(chunks), chunk=pc.merge_chunk_pages
    )
    return cell
