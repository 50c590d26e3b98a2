"""Every pool's invariants, recomputed with plain numpy, independently of the kernels.

``check_invariants()`` reports the problems found here as a ``RuntimeError``
(the pool's own state is broken); ``restore_state`` and unpickling run the
same checks on a candidate state first, and refuse it with a
``HostPoolError`` (it is not a state this pool could have made). Each
function returns a list of problems, empty when there are none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from .._kernels import layout as _layout
from .._kernels.layout import owner_flags, ring_ids
from .tracking import Site, site_id_problems

# A state loaded from outside (a snapshot, a pickle) must have every counter
# and generation below COUNTER_LIMIT: at a call per nanosecond 2**62 calls
# take 146 years, so no pool's calls reach it. A live pool's may grow past
# it; LIVE_LIMIT, 2**61 calls further (73 years more), is what none can
# reach without a broken state, and still far from overflowing int64.
COUNTER_LIMIT = 2**62
LIVE_LIMIT = COUNTER_LIMIT + 2**61


def _limit(loading: bool) -> tuple[int, str]:
    """The bound a counter must stay below, and how a message says it is past it."""
    if loading:
        return COUNTER_LIMIT, f"at or beyond {COUNTER_LIMIT} (2**62), more than a pool's calls reach"
    return LIVE_LIMIT, f"at or beyond {LIVE_LIMIT} (3 * 2**61), which later calls could overflow"


def pool_problems(
    st: NDArray[np.int64],
    num_pages: int,
    page_size: int,
    sites: Sequence[Site | None] | None = None,
    *,
    loading: bool = False,
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
      and the allocation number are below :data:`LIVE_LIMIT`, or, for a
      state ``loading`` from outside, below :data:`COUNTER_LIMIT`, so no
      call can make one wrap; the header's spare words are zero;
    - a tracking state's allocation numbers are below the next one, and its
      site ids name entries of ``sites`` (its site table), when given.

    Costs O(number of pages).
    """
    n = num_pages
    layout = _layout_problems(st, n)
    if layout:
        return layout
    found: list[str] = []
    header = (int(st[_layout.H_NPAGES]), int(st[_layout.H_PAGE_SIZE]), int(st[_layout.H_PAGE_SHIFT]))
    shape = (n, page_size, _layout.page_shift(page_size))
    if header != shape:
        found.append(f"header says (pages, page_size, shift) = {header}, pool has {shape}")
    head, nfree, nrel, npend = (int(st[h]) for h in (_layout.H_HEAD, _layout.H_NFREE, _layout.H_NREL, _layout.H_NPEND))
    if not (nfree >= 0 and nrel >= 0 and npend >= 0 and nfree + nrel + npend <= n and (n == 0 or 0 <= head < n)):
        found.append(f"counters out of range: head={head} nfree={nfree} nrel={nrel} npend={npend} pages={n}")
        return found
    found += _word_problems(st, npend, loading)
    sorted_flag = int(st[_layout.H_SORTED])
    track = int(st[_layout.H_TRACK])
    counters = _counters(st, host=False)
    lists = _listed_runs(st, n, (nfree, nrel, npend))
    if isinstance(lists, str):
        found.append(lists)
        return found
    listed = np.concatenate(lists)
    owner = owner_flags(st, n)
    times = np.bincount(listed, minlength=n)
    if times.max(initial=0) > 1:
        found.append(f"page {int(np.argmax(times))} is listed {int(times.max())} times")
    expected = np.full(n, _layout.OWNER_ALLOCATED, dtype=np.uint8)
    expected[listed[: nfree + nrel]] = _layout.OWNER_FREE
    expected[listed[nfree + nrel :]] = _layout.OWNER_PENDING
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


def _listed_runs(st: NDArray[np.int64], n: int, pages: tuple[int, int, int]) -> list[NDArray[np.int64]] | str:
    """The page ids of the free, release and pending lists, decoded from their runs; or what is wrong with them.

    Each list's entries must be runs (``_kernels/layout.py``): a length entry (at
    most ``-2``) follows a page id, every other entry is a page id, each run
    lies inside the pool, and the runs hold as many pages as the list's
    count says.
    """
    entries = [int(st[h]) for h in (_layout.H_EFREE, _layout.H_EREL, _layout.H_EPEND)]
    if min(entries) < 0 or sum(entries) > n or any(e > p for e, p in zip(entries, pages, strict=True)):
        return f"ring entries out of range: {entries} for lists of {list(pages)} pages in a ring of {n}"
    ring = ring_ids(st, n).astype(np.int64)
    at = _layout.ring_positions(int(st[_layout.H_HEAD]), sum(entries), n)
    decoded = []
    for name, e, count, offset in zip(
        ("free", "release", "pending"), entries, pages, (0, entries[0], entries[0] + entries[1]), strict=True
    ):
        runs = ring[at[offset : offset + e]]
        length = runs <= -_layout.MIN_RUN
        starts = runs[~length]
        lengths = np.where(np.append(length[1:], False)[~length], -np.append(runs[1:], 0)[~length], 1)
        # A length that follows no page id, or a page id that is negative or runs past the pool.
        if e and (length[0] or bool(np.any(length[1:] & length[:-1]))):
            return "a listed page id is out of range"
        if starts.size and (int(starts.min()) < 0 or bool(np.any(lengths > n - starts))):
            return "a listed page id is out of range"
        if int(lengths.sum()) != count:
            return f"the {name} list's runs hold {int(lengths.sum())} pages, its count says {count}"
        decoded.append(_layout.run_pages(runs))
    return decoded


def _layout_problems(st: NDArray[np.int64], n: int) -> list[str]:
    """The array itself: 1-D int64, of the length its layout (tracking or not) needs."""
    if st.ndim != 1 or st.dtype != np.int64:
        return [f"state must be a 1-D int64 array, got {st.dtype} with shape {st.shape}"]
    track = int(st[_layout.H_TRACK]) if st.shape[0] > _layout.H_TRACK else 0
    if track not in (0, _layout.track_offset(n)):
        return [f"tracking words said to start at {track}, expected 0 or {_layout.track_offset(n)}"]
    if st.shape[0] != _layout.state_length(n, track != 0):
        return [f"state array has length {st.shape[0]}, expected {_layout.state_length(n, track != 0)}"]
    return []


def _word_problems(st: NDArray[np.int64], npend: int, loading: bool) -> list[str]:
    """Free groups, the merge order word and the statistics, each in its range."""
    found = []
    depth, sorted_flag = int(st[_layout.H_GROUP_DEPTH]), int(st[_layout.H_SORTED])
    if depth < 0 or (npend > 0 and depth == 0):
        found.append(f"free groups out of range: depth={depth} with {npend} pending pages")
    if sorted_flag not in (0, 1):
        found.append(f"merge order word is {sorted_flag}, expected 0 (fifo) or 1 (sorted)")
    counters = _counters(st, host=False)
    if min(counters.values()) < 0 or counters["failed_allocs"] > counters["alloc_calls"]:
        found.append(f"statistics out of range: {counters}")
    grow = {**counters, "group depth": int(st[_layout.H_GROUP_DEPTH]), "allocation number": int(st[_layout.H_SEQ])}
    limit, beyond = _limit(loading)
    full = [f"{name}={value}" for name, value in grow.items() if value >= limit]
    if full:
        found.append(f"counters {beyond}: {', '.join(full)}")
    listed = int(st[_layout.H_NFREE] + st[_layout.H_NREL]) * int(st[_layout.H_PAGE_SIZE])
    avail = int(st[_layout.H_AVAIL])
    if avail != listed and not (loading and avail == 0):  # derived: a snapshot or pickle holds 0
        found.append(f"available slots word is {avail}, but the free and release lists hold {listed} slots")
    spare = st[_layout.H_AVAIL + 1 : _layout.HEADER]
    if spare.any():
        found.append(f"spare header word {_layout.H_AVAIL + 1 + int(np.argmax(spare != 0))} is not zero")
    return found


def _tracking_problems(st: NDArray[np.int64], n: int, track: int, owner: NDArray[np.uint8]) -> list[str]:
    """A tracking pool's words: every page's allocation number (0: never allocated) below the next one."""
    seq = int(st[_layout.H_SEQ])
    numbers = st[track : track + n]
    bad = (numbers < 0) | (numbers >= seq)
    if seq < 1 or bad[owner == _layout.OWNER_ALLOCATED].any():
        return [f"allocation numbers of held pages are not below the next one, {seq}"]
    if bad.any():
        return [f"page {int(np.argmax(bad))}'s last allocation number is not below the next one, {seq}"]
    return []


# Each counter's header word in a pool's (or paged rank's) state and in a host pool's; -1 where it has none.
_COUNTERS = (
    ("merges", _layout.H_MERGES, -1),
    ("alloc_calls", _layout.H_ALLOC_CALLS, _layout.HP_ALLOC_CALLS),
    ("failed_allocs", _layout.H_FAILED_ALLOCS, -1),
    ("exhausted_calls", -1, _layout.HP_EXHAUSTED),
    ("free_calls", _layout.H_FREE_CALLS, _layout.HP_FREE_CALLS),
    ("peak_allocated_pages", _layout.H_PEAK, _layout.HP_PEAK),
    ("clears", _layout.H_CLEARS, _layout.HP_CLEARS),
)


def _counters(st: NDArray[np.int64], host: bool) -> dict[str, int]:
    """The counters a pool's state (``host``: a host pool's) keeps, by name, in :data:`_COUNTERS`' order."""
    return {name: int(st[words[host]]) for name, *words in _COUNTERS if words[host] >= 0}


# -- a paged rank --------------------------------------------------------------------


def rank_problems(
    st: NDArray[np.int64], pages: int, page_size: int, sorted_order: bool, *, loading: bool = False
) -> list[str]:
    """Every way ``st`` breaks a rank's invariants (``loading``: as a state from outside); empty if none. O(pages)."""
    found = pool_problems(st, pages + 1, page_size, loading=loading)
    if found:
        return found
    owner = owner_flags(st, pages + 1)
    if owner[0] != _layout.OWNER_ALLOCATED:
        found.append(f"the padding page 0 has owner flag {int(owner[0])}, expected {_layout.OWNER_ALLOCATED}")
    if int(st[_layout.H_NPEND]) or int(st[_layout.H_GROUP_DEPTH]):
        found.append("a rank's core pending list and group depth must stay empty")
    if bool(int(st[_layout.H_SORTED])) != sorted_order:
        found.append(f"merge order word is {int(st[_layout.H_SORTED])}, expected {int(sorted_order)}")
    return found


def group_problems(gp: NDArray[np.int64], st: NDArray[np.int64], pages: int) -> list[str]:
    """Every way a rank's group buffer breaks its invariants; empty if none."""
    count, cap = int(gp[_layout.GP_COUNT]), int(gp[_layout.GP_CAP])
    if cap != pages + 1 or gp.shape[0] != _layout.group_length(pages):
        return [f"group buffer of capacity {cap} and length {gp.shape[0]} for {pages} pages"]
    if not 0 <= count <= cap:
        return [f"group buffer holds {count} pages"]
    ids = gp[_layout.GP_HEADER : _layout.GP_HEADER + count]
    marks = _layout.group_marks(gp)
    if count and (ids.min() < 1 or ids.max() > pages):
        return ["a pending page id is out of range"]
    expected = np.zeros(cap, dtype=np.uint8)
    expected[ids] = _layout.MARK_PENDING
    if len(np.unique(ids)) != count or not np.array_equal(marks, expected):
        return ["the pending pages and their marks disagree"]
    return []


# -- a host page pool -----------------------------------------------------------------


def host_problems(st: NDArray[np.int64], n: int, *, loading: bool = False) -> list[str]:
    """Every way ``st`` breaks a host pool's invariants (``loading``: as a state from outside); empty if none. O(pages).

    The header matches the pool and its counters are in range and agree;
    every page on the free list is in range, listed once and flagged free,
    every other page flagged allocated; no page is marked; counters,
    generations and pin counts are non-negative and below
    :data:`LIVE_LIMIT` (:data:`COUNTER_LIMIT` when ``loading``), free pages are unpinned and the
    header counts the pinned ones. The scratch words and the ring's
    entries after the free list may hold anything.
    """
    if st.ndim != 1 or st.dtype != np.int64 or st.shape[0] != _layout.host_state_length(n):
        return [f"state must be a 1-D int64 array of length {_layout.host_state_length(n)}, got {st.dtype} {st.shape}"]
    head, nfree = int(st[_layout.HP_HEAD]), int(st[_layout.HP_NFREE])
    if int(st[_layout.HP_NPAGES]) != n or not (0 <= nfree <= n and 0 <= head < n):
        return [
            f"header out of range: pages={int(st[_layout.HP_NPAGES])} head={head} nfree={nfree}, pool has {n} pages"
        ]
    limit = _limit(loading)
    return _host_header_problems(st, n, nfree, limit) + _host_page_problems(st, n, head, nfree, limit)


def _host_header_problems(st: NDArray[np.int64], n: int, nfree: int, limit: tuple[int, str]) -> list[str]:
    found = []
    counters = _counters(st, host=True)
    full = [f"{name}={value}" for name, value in counters.items() if value >= limit[0]]
    if min(counters.values()) < 0:
        found.append(f"counters out of range: {counters}")
    elif full:
        found.append(f"counters {limit[1]}: {', '.join(full)}")
    if counters["exhausted_calls"] > counters["alloc_calls"] or not n - nfree <= counters["peak_allocated_pages"] <= n:
        found.append(f"statistics disagree: {counters} with {n - nfree} pages held")
    spare = [w for w in range(_layout.HP_FAULT_GEN + 1, _layout.HP_HEADER) if st[w] != 0]
    if spare:
        found.append(f"spare header word {spare[0]} is not zero")
    return found


def _host_page_problems(st: NDArray[np.int64], n: int, head: int, nfree: int, limit: tuple[int, str]) -> list[str]:
    ids, gen, ref, flags, marks = _layout.host_views(st, n)
    listed = ids[_layout.ring_positions(head, nfree, n)]
    if listed.size and (listed.min() < 0 or listed.max() >= n):
        return ["a listed page id is out of range"]
    found = []
    times = np.bincount(listed, minlength=n)
    if times.max(initial=0) > 1:
        found.append(f"page {int(np.argmax(times))} is listed {int(times.max())} times")
    expected = np.ones(n, dtype=np.uint8)
    expected[listed] = 0
    if not np.array_equal(flags, expected):
        p = int(np.argmax(flags != expected))
        found.append(f"page {p} has allocated flag {int(flags[p])} but is listed {int(times[p])} times")
    if marks.any():
        found.append("a page is marked outside a call")
    if gen.min() < 0:
        found.append("a generation is out of range")
    elif gen.max() >= limit[0]:
        found.append(f"page {int(np.argmax(gen))}'s generation is {limit[1]}")
    if ref.min() < 0:
        found.append("a pin count is out of range")
    elif ref.max() >= limit[0]:
        found.append(f"page {int(np.argmax(ref))}'s pin count is {limit[1]}")
    elif (ref[flags == 0] != 0).any():
        found.append(f"free page {int(np.flatnonzero((ref != 0) & (flags == 0))[0])} is pinned")
    if int(np.count_nonzero(ref)) != int(st[_layout.HP_PINNED]):
        found.append(f"{int(np.count_nonzero(ref))} pages are pinned, the header says {int(st[_layout.HP_PINNED])}")
    return found


def interleaved_problems(
    st: NDArray[np.int64], classes: int, per_class: int, page_size: int, *, loading: bool = False
) -> list[str]:
    """Every way ``st`` breaks an interleaved pool's invariants (``loading``: from outside); empty if none. O(pages).

    The header matches the pool; each class lists only its own pages
    (``p % N == r``, not reserved), each once and in state free; every
    other page but the reserved ones is held; the header's minimum, held
    count and counters agree with that.
    """
    length = _layout.interleaved_state_length(classes, per_class)
    if st.ndim != 1 or st.dtype != np.int64 or st.shape[0] != length:
        return [f"state must be a 1-D int64 array of length {length}, got {st.dtype} {st.shape}"]
    shape = (int(st[_layout.IP_CLASSES]), int(st[_layout.IP_PER_CLASS]), int(st[_layout.IP_PAGE_SIZE]))
    if shape != (classes, per_class, page_size):
        return [f"header says classes, per_class, page_size = {shape}; the pool has {(classes, per_class, page_size)}"]
    counts, stacks, states = _layout.interleaved_views(st)
    if counts.min() < 0 or counts.max() > per_class:
        return [f"class counts out of range [0, {per_class}]: {counts.tolist()}"]
    found = []
    pages = _layout.interleaved_pages(classes, per_class)
    listed = np.zeros(pages, dtype=np.int64)
    for r in range(classes):
        mine = stacks[r, : counts[r]]
        if ((mine < classes) | (mine >= pages)).any() or (mine % classes != r).any():
            found.append(f"class {r} lists a page that is not its own: {mine[(mine % classes != r)][:5].tolist()}")
            continue
        np.add.at(listed, mine, 1)
    if found:
        return found
    expect = np.where(listed > 0, _layout.IP_FREE, _layout.IP_HELD_PAGE).astype(np.uint8)
    expect[:classes] = _layout.IP_RESERVED
    if (listed > 1).any():
        found.append(f"page {int(np.flatnonzero(listed > 1)[0])} is listed twice")
    bad = np.flatnonzero(states != expect)
    if bad.size:
        p = int(bad[0])
        found.append(f"page {p} is in state {int(states[p])}, but its lists say {int(expect[p])}")
    held = int((states == _layout.IP_HELD_PAGE).sum())
    words = {name: int(st[w]) for name, w in _IP_WORDS.items()}
    if words["min"] != int(counts.min()) or words["held"] != held:
        found.append(f"header says min={words['min']}, held={words['held']}; the lists say {int(counts.min())}, {held}")
    limit = _limit(loading)
    counters = {k: v for k, v in words.items() if k not in ("min", "held")}
    if min(counters.values()) < 0 or max(counters.values()) >= limit[0]:
        found.append(f"counters out of range: {counters}")
    elif counters["exhausted_calls"] > counters["alloc_calls"] or not held <= counters["peak_allocated_pages"]:
        found.append(f"statistics disagree: {counters} with {held} pages held")
    spare = [w for w in range(_layout.IP_CLEARS + 1, _layout.IP_HEADER) if st[w] != 0]
    if spare:
        found.append(f"spare header word {spare[0]} is not zero")
    return found


_IP_WORDS = {
    "min": _layout.IP_MIN,
    "held": _layout.IP_HELD,
    "alloc_calls": _layout.IP_ALLOC_CALLS,
    "exhausted_calls": _layout.IP_EXHAUSTED,
    "free_calls": _layout.IP_FREE_CALLS,
    "peak_allocated_pages": _layout.IP_PEAK,
    "clears": _layout.IP_CLEARS,
}


def envelope_problems(st: NDArray[np.int64], shape: tuple[int, tuple[tuple[str, int, int, str], ...]]) -> list[str]:
    """Every way ``st`` breaks a page-envelope pool's invariants; empty if none. O(pages).

    Per side: the two maps are each other's inverse over the live pages,
    every live page below the watermark; the free-page bitmap marks
    exactly the unmapped logical pages and the hole bitmap exactly the
    unmapped physical pages below the watermark, never the one just below
    it; the counts and search hints agree; the sides' bytes do not meet.
    """
    total, sides = shape
    pages = tuple(total // pb for _, _, pb, _ in sides)
    length = _layout.envelope_state_length(pages)
    if st.ndim != 1 or st.dtype != np.int64 or st.shape[0] != length:
        return [f"state must be a 1-D int64 array of length {length}, got {st.dtype} {st.shape}"]
    if int(st[_layout.EV_SIDES]) != len(sides):
        return [f"header says {int(st[_layout.EV_SIDES])} sides; the pool has {len(sides)}"]
    found: list[str] = []
    ends = []
    base = _layout.EV_HEADER + _layout.EV_SIDE_WORDS * len(sides)
    for s, ((name, ps, pb, grow), n) in enumerate(zip(sides, pages, strict=True)):
        b = _layout.EV_HEADER + s * _layout.EV_SIDE_WORDS
        head = [int(x) for x in st[b : b + _layout.EV_SIDE_WORDS]]
        if head[: _layout.S_DOWN + 1] != [ps, pb, n, int(grow == "down")] or head[_layout.S_BASE] != base:
            return [f"side {name!r}: header {head[:4]} at {head[_layout.S_BASE]}, expected {[ps, pb, n]} at {base}"]
        found += [f"side {name!r}: {p}" for p in _side_problems(st[base : base + _layout.envelope_words(n)], n, head)]
        mark = head[_layout.S_MARK]
        ends.append((grow, mark * pb if grow == "up" else (n - mark) * pb))
        base += _layout.envelope_words(n)
    low = max([at for grow, at in ends if grow == "up"], default=0)
    high = min([at for grow, at in ends if grow == "down"], default=int(st[_layout.EV_ALLOCATABLE]))
    if low > high:
        found.append(f"the sides' pages overlap: the up side reaches byte {low}, the down side starts at {high}")
    return found


def _side_problems(arrays: NDArray[np.int64], n: int, head: list[int]) -> list[str]:
    to_d, to_l = arrays[:n], arrays[n : 2 * n]
    words = (n + _layout.EV_BITS - 1) // _layout.EV_BITS
    free_bits = _bits(arrays[2 * n : 2 * n + words], n)
    hole_bits = _bits(arrays[2 * n + words : 2 * n + 2 * words], n)
    mark = head[_layout.S_MARK]
    live = np.flatnonzero(to_d >= 0)
    found = []
    if ((to_d < -1) | (to_d >= max(mark, 0))).any() or not 0 <= mark <= n:
        return [f"a logical page maps outside [0, {mark}) (the watermark), or the watermark is outside [0, {n}]"]
    if (to_l[to_d[live]] != live).any() or int((to_l >= 0).sum()) != live.size:
        found.append("the logical -> physical and physical -> logical maps are not each other's inverse")
    if (free_bits != (to_d == -1)).any():
        found.append("the free-page bitmap differs from the unmapped logical pages")
    holes = (to_l == -1) & (np.arange(n) < mark)
    if (hole_bits != holes).any():
        found.append("the hole bitmap differs from the unmapped physical pages below the watermark")
    if mark > 0 and holes[mark - 1]:
        found.append(f"a hole sits just below the watermark ({mark - 1}): it should have been given up")
    counts = (head[_layout.S_LIVE], head[_layout.S_FREE], head[_layout.S_HOLES])
    if counts != (live.size, n - live.size, int(holes.sum())):
        found.append(f"live, free, holes = {counts}; the maps say {(live.size, n - live.size, int(holes.sum()))}")
    for hint, bits, what in ((_layout.S_LOW_FREE, free_bits, "free page"), (_layout.S_LOW_HOLE, hole_bits, "hole")):
        first = int(np.argmax(bits)) if bits.any() else n
        if head[hint] < 0 or head[hint] * _layout.EV_BITS > first:
            found.append(f"the {what} search starts at word {head[hint]}, past the first {what} ({first})")
    return found


def _bits(words: NDArray[np.int64], n: int) -> NDArray[np.bool_]:
    """A bitmap of 63 bits a word, as booleans; ``n`` of them (the rest must be clear)."""
    shifts = np.arange(_layout.EV_BITS, dtype=np.int64)
    bits = ((words[:, None] >> shifts) & 1).astype(bool).reshape(-1)
    if bits[n:].any():
        bits[:n] = ~bits[:n]  # a bit past the last page: reported as a mismatch of every bit
    return bits[:n]
