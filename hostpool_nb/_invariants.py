"""The pool's invariants, recomputed with plain numpy, independently of the kernels.

:meth:`LogicalHostPool.check_invariants` reports the problems this finds as
a ``RuntimeError`` (the pool's own state is broken); ``restore_state`` and
unpickling run the same check on a candidate state before accepting it
(the caller's snapshot is not one this pool could have made).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from . import _kernels as K
from ._tracking import Site, site_id_problems

# A counter word above this is refused: at a call per nanosecond, 2**62
# calls take 146 years, so a real pool never reaches it, and one that
# starts below it can never overflow int64.
COUNTER_LIMIT = 2**62


def ring_ids(st: NDArray[np.int64], num_pages: int) -> NDArray[np.int32]:
    """The ring of int32 page ids inside a state array, as the kernels see it."""
    return st[K.HEADER : K.HEADER + K.ring_words(num_pages)].view(np.int32)[:num_pages]


def owner_flags(st: NDArray[np.int64], num_pages: int) -> NDArray[np.uint8]:
    """The owner flags inside a state array, as the kernels see them."""
    return st[K.HEADER + K.ring_words(num_pages) :].view(np.uint8)[:num_pages]


def problems(
    st: NDArray[np.int64], num_pages: int, page_size: int, sites: Sequence[Site | None] | None = None
) -> list[str]:
    """Every way ``st`` breaks the invariants of a pool of that shape; empty if none.

    - the header matches the pool (pages, page size, shift) and the array
      has the length of that layout;
    - the counters are in range, and pending pages exist only inside a
      free group;
    - every page id on the free, release and pending lists is in range and
      listed once; listed free or released pages are flagged free, pending
      ones pending, and every page not listed is flagged allocated;
    - a sorted pool's free list is ascending;
    - the statistics are consistent (failed calls among the calls, the
      peak at least what is held now), and every counter, the group depth
      and the allocation number are below :data:`COUNTER_LIMIT`, so no call
      can make one wrap; the header's spare words are zero;
    - a tracking state's allocation numbers are below the next one, and its
      site ids name entries of ``sites`` (its site table), when given.

    Costs O(number of pages).
    """
    n = num_pages
    layout = _layout_problems(st, n)
    if layout:
        return layout
    found: list[str] = []
    header = (int(st[K.H_NPAGES]), int(st[K.H_PAGE_SIZE]), int(st[K.H_PAGE_SHIFT]))
    if header != (n, page_size, K.page_shift(page_size)):
        found.append(
            f"header says (pages, page_size, shift) = {header}, pool has {(n, page_size, K.page_shift(page_size))}"
        )
    head, nfree, nrel, npend = (int(st[h]) for h in (K.H_HEAD, K.H_NFREE, K.H_NREL, K.H_NPEND))
    if not (nfree >= 0 and nrel >= 0 and npend >= 0 and nfree + nrel + npend <= n and (n == 0 or 0 <= head < n)):
        found.append(f"counters out of range: head={head} nfree={nfree} nrel={nrel} npend={npend} pages={n}")
        return found
    found += _word_problems(st, npend)
    sorted_flag = int(st[K.H_SORTED])
    track = int(st[K.H_TRACK])
    counters = {name: int(st[h]) for name, h in _COUNTERS}
    ring = ring_ids(st, n)
    listed = ring[(head + np.arange(nfree + nrel + npend)) % max(n, 1)]
    if listed.size and (listed.min() < 0 or listed.max() >= n):
        found.append("a listed page id is out of range")
        return found
    owner = owner_flags(st, n)
    times = np.bincount(listed, minlength=n)
    if times.max(initial=0) > 1:
        found.append(f"page {int(np.argmax(times))} is listed {int(times.max())} times")
    expected = np.full(n, K.OWNER_ALLOCATED, dtype=np.uint8)
    expected[listed[: nfree + nrel]] = K.OWNER_FREE
    expected[listed[nfree + nrel :]] = K.OWNER_PENDING
    bad_owner = owner != expected
    if bad_owner.any():
        p = int(np.argmax(bad_owner))
        found.append(
            f"page {p} has owner flag {int(owner[p])} but is listed {int(times[p])} times"
            + (" (as pending)" if p in listed[nfree + nrel :] else "")
        )
    if sorted_flag == 1 and nfree > 1 and not bool(np.all(np.diff(listed[:nfree]) > 0)):
        found.append("the free list of a sorted pool is not ascending")
    held = n - nfree - nrel - npend
    if counters["peak_allocated_pages"] < held:
        found.append(f"peak of {counters['peak_allocated_pages']} pages is below the {held} held now")
    if track:
        found += _tracking_problems(st, n, track, owner)
        if sites is not None and not found:
            found += site_id_problems(st, sites)
    return found


def _layout_problems(st: NDArray[np.int64], n: int) -> list[str]:
    """The array itself: 1-D int64, of the length its layout (tracking or not) needs."""
    if st.ndim != 1 or st.dtype != np.int64:
        return [f"state must be a 1-D int64 array, got {st.dtype} with shape {st.shape}"]
    track = int(st[K.H_TRACK]) if st.shape[0] > K.H_TRACK else 0
    if track not in (0, K.track_offset(n)):
        return [f"tracking words said to start at {track}, expected 0 or {K.track_offset(n)}"]
    if st.shape[0] != K.state_length(n, track != 0):
        return [f"state array has length {st.shape[0]}, expected {K.state_length(n, track != 0)}"]
    return []


def _word_problems(st: NDArray[np.int64], npend: int) -> list[str]:
    """Free groups, the merge order word and the statistics, each in its range."""
    found = []
    depth, sorted_flag = int(st[K.H_GROUP_DEPTH]), int(st[K.H_SORTED])
    if depth < 0 or (npend > 0 and depth == 0):
        found.append(f"free groups out of range: depth={depth} with {npend} pending pages")
    if sorted_flag not in (0, 1):
        found.append(f"merge order word is {sorted_flag}, expected 0 (fifo) or 1 (sorted)")
    counters = {name: int(st[h]) for name, h in _COUNTERS}
    if min(counters.values()) < 0 or counters["failed_allocs"] > counters["alloc_calls"]:
        found.append(f"statistics out of range: {counters}")
    grow = {
        name: int(st[h]) for name, h in (*_COUNTERS, ("group depth", K.H_GROUP_DEPTH), ("allocation number", K.H_SEQ))
    }
    full = [f"{name}={value}" for name, value in grow.items() if value > COUNTER_LIMIT]
    if full:
        found.append(f"counters beyond {COUNTER_LIMIT} (2**62), which later calls would overflow: {', '.join(full)}")
    spare = st[K.H_SEQ + 1 : K.HEADER]
    if spare.any():
        found.append(f"spare header word {K.H_SEQ + 1 + int(np.argmax(spare != 0))} is not zero")
    return found


def _tracking_problems(st: NDArray[np.int64], n: int, track: int, owner: NDArray[np.uint8]) -> list[str]:
    """A tracking pool's words: every page's allocation number (0: never allocated) below the next one."""
    seq = int(st[K.H_SEQ])
    numbers = st[track : track + n]
    bad = (numbers < 0) | (numbers >= seq)
    if seq < 1 or bad[owner == K.OWNER_ALLOCATED].any():
        return [f"allocation numbers of held pages are not below the next one, {seq}"]
    if bad.any():
        return [f"page {int(np.argmax(bad))}'s last allocation number is not below the next one, {seq}"]
    return []


_COUNTERS = (
    ("merges", K.H_MERGES),
    ("alloc_calls", K.H_ALLOC_CALLS),
    ("failed_allocs", K.H_FAILED_ALLOCS),
    ("free_calls", K.H_FREE_CALLS),
    ("peak_allocated_pages", K.H_PEAK),
    ("clears", K.H_CLEARS),
)
