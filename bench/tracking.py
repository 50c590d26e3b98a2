"""What ``track=True`` costs: the single-page round trip tracked and untracked, and the metadata it adds.

hostpool_nb against itself, side by side in one process: the same
``free(alloc(k))`` loop on an untracked pool and on pools made with
``track=True``, where each ``alloc`` passes a tag as a scheduler passes its
request id. Two tagged loops, since a tracking pool keeps a table of
(call site, tag) pairs that only grows:

- ``tracked``: tags from a fixed set of request ids, reused round-robin, so
  every call finds its (site, tag) in the table: the per-call cost.
- ``new tags``: a never-seen id on every call, so every call adds an entry
  to the table (a request's first allocation): the per-call cost plus the
  insertion. Each sample runs on a fresh pool, so the table's growth over
  the repeats is not carried into the next sample (or into memory).

The metadata figures are read from real pools, never restated: the state
array's ``nbytes`` per page (checked against ``_kernels.state_length``),
and the bytes the site table keeps per live tag (``tracemalloc``).
"""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

from .impls import merges_of
from .timing import interleaved, median, timed
from .workloads import Cell

UNTRACKED = "untracked"
TRACKED = "tracked"
NEW_TAGS = "new tags"
VARIANTS = (UNTRACKED, TRACKED, NEW_TAGS)
# Request ids the ``tracked`` loop reuses: a scheduler's requests in flight.
REQUEST_IDS = 1024


class TrackingCheckFailed(RuntimeError):
    """A pool of the tracking workload is not doing what the workload says it measures."""


def tagged_loop(pool: Any, k: int, tags: Sequence[Any] | range) -> None:
    """``free(alloc(k, tag=tag))`` for every tag, in order."""
    alloc = pool.alloc
    free = pool.free
    for tag in tags:
        free(alloc(k, tag=tag))


def untagged_loop(pool: Any, k: int, tags: Sequence[Any] | range) -> None:
    """``free(alloc(k))`` once per tag, without passing it: today's call, the same loop overhead."""
    alloc = pool.alloc
    free = pool.free
    for _ in tags:
        free(alloc(k))


def _reused_tags(n: int) -> list[int]:
    ids = list(range(REQUEST_IDS))
    return (ids * (n // REQUEST_IDS + 1))[:n]


def _sites(pool: Any) -> int:
    return len(pool._tracker.table())


def _has_tag(pool: Any, tag: Any) -> bool:
    return any(site is not None and site.tag == tag for site in pool._tracker.table())


def measure_tracking(
    page_size: int,
    k: int,
    pool_slots: int,
    repeats: int,
    min_cycles: int = 3,
    min_loop_s: float = 0.02,
    tick: Callable[[], None] | None = None,
    max_loop_s: float = 0.25,
) -> Cell:
    """Median seconds per round trip of ``k`` slots: untracked, tracked, tracked with a new tag each call.

    Timed loops cover whole pool cycles (so each holds as many merges as
    the others), sized as the round-trip workload's; repeats interleaved.
    Outside the timed region, the workload checks that the tracked pools
    do track (the site table holds the reused ids; the new-tag loop adds
    entries, the last tag's among them, and at most one per call, fewer once
    sweeps reuse ids), that nothing is left allocated, and that the
    persistent pools merged equally often.
    """
    from hostpool_nb import LogicalHostPool

    if k < 1 or pool_slots < k or pool_slots % k:
        raise ValueError(f"a {pool_slots}-slot pool is no whole number of {k}-slot round trips")
    ops_per_cycle = pool_slots // k
    untracked = LogicalHostPool(pool_slots, page_size)
    tracked = LogicalHostPool(pool_slots, page_size, track=True)

    # Warm-up: a cycle each (kernels loaded or compiled, first merge paid),
    # and every reused id enters the tracked pool's table.
    warm = _reused_tags(max(ops_per_cycle, REQUEST_IDS))
    untagged_loop(untracked, k, warm)
    tagged_loop(tracked, k, warm)
    cycle = _reused_tags(ops_per_cycle)

    def fresh() -> Any:
        pool = LogicalHostPool(pool_slots, page_size, track=True)
        # To a cycle's end, as the others, through the timed loop's own
        # lines: its free site is then in the table, and each new tag adds
        # exactly one entry.
        tagged_loop(pool, k, [-1] * ops_per_cycle)
        return pool

    cycle_s = {
        UNTRACKED: timed(untagged_loop, untracked, k, cycle),
        TRACKED: timed(tagged_loop, tracked, k, cycle),
        NEW_TAGS: timed(tagged_loop, fresh(), k, range(ops_per_cycle)),
    }
    fastest = max(min(cycle_s.values()), 1e-9)
    slowest = max(*cycle_s.values(), 1e-9)
    cycles = max(min_cycles, min(math.ceil(min_loop_s / fastest), int(max_loop_s / slowest)))
    n = cycles * ops_per_cycle
    tags = _reused_tags(n)
    grown: list[tuple[int, bool]] = []

    def new_tags() -> float:
        pool = fresh()  # outside the timed region, as is dropping it
        before = _sites(pool)
        seconds = timed(tagged_loop, pool, k, range(n)) / n
        grown.append((_sites(pool) - before, _has_tag(pool, n - 1)))
        return seconds

    runners = {
        UNTRACKED: lambda: timed(untagged_loop, untracked, k, tags) / n,
        TRACKED: lambda: timed(tagged_loop, tracked, k, tags) / n,
        NEW_TAGS: new_tags,
    }
    sites_before = _sites(tracked)
    merges_before = {UNTRACKED: merges_of(untracked), TRACKED: merges_of(tracked)}
    samples = interleaved(runners, repeats, tick)

    merges = {}
    for name, pool in ((UNTRACKED, untracked), (TRACKED, tracked)):
        before, after = merges_before[name], merges_of(pool)
        if before is not None and after is not None:
            merges[name] = (after - before) / repeats
    problems = []
    if not (untracked.track is False and tracked.track is True):
        problems.append(f"track flags are {untracked.track}, {tracked.track}")
    if _sites(tracked) != sites_before:
        problems.append(f"the reused tags added {_sites(tracked) - sites_before} sites to the table")
    # Each new tag enters the table; once it has doubled, a sweep drops the
    # entries of requests since freed and their ids are reused, so a long
    # loop adds fewer than n entries, but always some, and the last tag.
    if not all(0 < added <= n and last for added, last in grown):
        problems.append(f"the new-tag loops of {n} calls added (sites, last tag kept) {grown}")
    if len(set(merges.values())) > 1:
        problems.append(f"merges per timed loop differ: {merges}")
    problems.extend(
        f"{pool_slots - pool.available_size()} slots left allocated"
        for pool in (untracked, tracked)
        if pool.available_size() != pool_slots
    )
    if problems:
        raise TrackingCheckFailed("tracking workload: " + "; ".join(problems))
    return Cell(
        workload="tracking",
        params={
            "page_size": page_size,
            "k": k,
            "pool_slots": pool_slots,
            "ops_per_loop": n,
            "cycles_per_loop": cycles,
            "request_ids": REQUEST_IDS,
        },
        per_op={name: median(s) for name, s in samples.items()},
        samples=samples,
        extra={"merges_per_loop": merges, "calls_per_new_tag_loop": n},
    )


def paired(samples: dict[str, list[float]], num: str, den: str) -> dict[str, float]:
    """``num / den`` within each interleaved repeat: min, median, max."""
    rs = sorted(a / b for a, b in zip(samples[num], samples[den], strict=True) if b > 0)
    if not rs:
        return {}
    return {"min": rs[0], "median": median(rs), "max": rs[-1]}


def state_bytes_per_page(pool_slots: int, page_size: int) -> dict[str, float]:
    """Bytes per page of the state array of a real pool, untracked and tracked (header included).

    Each pool's ``_st.nbytes`` must equal ``_kernels.state_length`` words,
    or :class:`TrackingCheckFailed` is raised: the figure is the pool's,
    and the layout's documentation cannot drift from it unnoticed.
    ``added`` is the exact growth per page, without the header.
    """
    from hostpool_nb import LogicalHostPool
    from hostpool_nb import _kernels as K

    pages = pool_slots // page_size
    out = {}
    for name, track in ((UNTRACKED, False), (TRACKED, True)):
        st = LogicalHostPool(pool_slots, page_size, track=track)._st
        words = K.state_length(pages, track)
        if st.nbytes != words * st.itemsize:
            raise TrackingCheckFailed(
                f"a {name} pool of {pages} pages has a {st.nbytes}-byte state array; "
                f"_kernels.state_length says {words} words ({words * st.itemsize} bytes)"
            )
        out[name] = st.nbytes / pages
    out["added"] = (K.state_length(pages, True) - K.state_length(pages, False)) * 8 / pages
    return out


def site_table_bytes(page_size: int, n_tags: int) -> float:
    """Bytes a tracking pool keeps per live (call site, tag): ``tracemalloc`` over ``n_tags`` held pages.

    Each of ``n_tags`` pages is allocated with a new tag and held, so every
    entry stays referenced (a sweep drops only entries no page refers to)
    and the table holds exactly ``n_tags`` more. The same loop on an
    untracked pool is subtracted: what is left is the table's ``Site``,
    key and dict slot per entry, with the tag object. The table keeps at
    most two entries per page plus those added since its last sweep.
    """
    from hostpool_nb import LogicalHostPool

    def held_bytes(track: bool) -> tuple[int, Any]:
        pool = LogicalHostPool(page_size * n_tags, page_size, track=track)
        first = 1 << 40  # ints no other code holds
        before = tracemalloc.get_traced_memory()[0]
        held = [pool.alloc(page_size, tag=t) for t in range(first, first + n_tags)]
        after = tracemalloc.get_traced_memory()[0]
        if any(h is None for h in held):
            raise TrackingCheckFailed(f"a pool of {n_tags} pages refused one of {n_tags} one-page allocations")
        return after - before, pool

    owner = not tracemalloc.is_tracing()
    if owner:
        tracemalloc.start(1)
    try:
        plain, _ = held_bytes(False)
        tracked, pool = held_bytes(True)
    finally:
        if owner:
            tracemalloc.stop()
    live = sum(site is not None for site in pool._tracker.table())
    fixed = sum(site is not None for site in LogicalHostPool(page_size, page_size, track=True)._tracker.table())
    if live - fixed != n_tags:
        raise TrackingCheckFailed(f"{n_tags} held pages with new tags left {live - fixed} sites in the table")
    return (tracked - plain) / n_tags
