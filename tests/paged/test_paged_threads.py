"""hostpool_nb.paged under threads: a shared allocator, and a caller's thread writing what free reads.

The stress: several threads extend, decode, allocate and free their own
requests on one allocator of 2 ranks, begin and end free groups (which
are the allocator's, so they catch the other threads' frees too) and merge.
Each thread records the pages it holds in a shared per-rank owner table
(guarded by a test lock, not the allocator's): a page it is handed must be
free in the table, so no page ever has two owners; it unmarks its pages
just before freeing them. Every read of the lists meanwhile must be
consistent (the free list ascending, sizes in range). Afterwards every page
is free again and the allocator's bookkeeping agrees with the threads'.
With ``track=True`` each thread tags its calls with its own id and checks,
now and then, that ``outstanding()`` gives it exactly the pages it holds.

The races: ``free`` hands a caller's int64 array to a kernel that runs
without the GIL, so another thread of the caller may write the array
meanwhile. The allocator must free only pages it validated (the pages it
reports), or raise a ``HostPoolError`` and change nothing; it must never
crash. Each scenario runs in a child process, so a crash fails the test
instead of killing pytest.
"""

from __future__ import annotations

import random
import sys
import textwrap
import threading
from typing import Any

import numpy as np
import pytest

from hostpool_nb.paged import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from tests.conftest import JIT_DISABLED, run_child

THREADS = 4
OPS = 400 if JIT_DISABLED else 3000  # the kernels run as Python without the JIT
PAGES = 40  # per rank: small, so that the threads compete and allocations are refused
FREE = -1


class Stress:
    """Shared state of one stress run: the allocator, the owner table, failures, counters."""

    def __init__(self, page_size: int, track: bool = False) -> None:
        self.ps = page_size
        self.track = track
        self.alloc = PagedTokenToKVPoolAllocator(2 * PAGES * page_size, page_size, None, dp_size=2, track=track)
        self.owner = np.full((2, PAGES + 1), FREE, dtype=np.int64)  # page 0 is never anybody's
        self.table = threading.Lock()
        self.barrier = threading.Barrier(THREADS)
        self.failures: list[str] = []
        self.counts = {k: [0] * THREADS for k in ("served", "refused", "freed", "groups", "merges")}

    def fail(self, message: str) -> None:
        self.failures.append(message)
        self.barrier.abort()

    def claim(self, tid: int, r: int, pages: set[int]) -> None:
        """Mark newly handed-out pages as ``tid``'s: each must be nobody's."""
        with self.table:
            held = {p: int(self.owner[r, p]) for p in pages if self.owner[r, p] != FREE}
            if held:
                self.fail(f"thread {tid} was handed rank {r} pages already held: {held}")
            for p in pages:
                self.owner[r, p] = tid

    def release(self, tid: int, r: int, pages: set[int]) -> None:
        with self.table:
            lost = [p for p in pages if self.owner[r, p] != tid]
            if lost:
                self.fail(f"thread {tid} lost rank {r} pages {lost}")
            for p in pages:
                self.owner[r, p] = FREE


def worker(s: Stress, tid: int) -> None:
    rng = random.Random(1000 * s.ps + tid)
    ps = s.ps
    reqs: list[list[list[int]]] = [[], []]  # per rank: each request's token slots in order
    a = s.alloc
    tag: dict[str, Any] = {"tag": f"thread-{tid}"} if s.track else {}

    def tags(n: int) -> dict[str, Any]:
        return {"tags": [f"thread-{tid}"] * n} if s.track else {}

    def mine_outstanding(r: int) -> None:
        """The pages outstanding() says this thread's tag holds are the ones it holds."""
        got = sum(o.pages for o in a.outstanding(r) if o.tag == f"thread-{tid}")
        held = len(set().union(*(pages_of(q) for q in reqs[r])))
        if got != held:
            s.fail(f"thread {tid}: outstanding() gives it {got} pages of rank {r}, it holds {held}")

    def pages_of(slots: list[int]) -> set[int]:
        return {x // ps for x in slots}

    def extend(r: int) -> None:
        live = reqs[r]
        picked = rng.sample(range(len(live)), min(len(live), rng.randint(0, 2)))
        batch: list[tuple[int | None, int]] = [(i, rng.randint(1, ps + 1)) for i in picked]
        batch += [(None, rng.randint(1, 2 * ps + 1)) for _ in range(rng.randint(0 if batch else 1, 2))]
        rng.shuffle(batch)
        prefix = [0 if i is None else len(live[i]) for i, _ in batch]
        last = [-1 if i is None else live[i][-1] for i, _ in batch]
        seq = [p + e for p, (_, e) in zip(prefix, batch, strict=True)]
        out = a.alloc_extend(prefix, seq, last, sum(e for _, e in batch), dp_rank=r, **tags(len(batch)))
        if out is None:
            s.counts["refused"][tid] += 1
            return
        s.counts["served"][tid] += 1
        pos, new_pages = 0, set()
        for i, e in batch:
            slots = out[pos : pos + e].tolist()
            pos += e
            if i is None:
                live.append(slots)
                new_pages |= pages_of(slots)
            else:
                new_pages |= pages_of(slots) - pages_of(live[i])  # the rest of its page is its own already
                live[i].extend(slots)
        s.claim(tid, r, new_pages)

    def decode(r: int) -> None:
        live = reqs[r]
        picked = rng.sample(range(len(live)), min(len(live), rng.randint(1, 3)))
        order: list[int | None] = [*picked, *[None] * rng.randint(0, 1)]
        seq = [1 if i is None else len(live[i]) + 1 for i in order]
        last = [-1 if i is None else live[i][-1] for i in order]
        out = a.alloc_decode(np.array(seq, dtype=np.int64), np.array(last, dtype=np.int64), dp_rank=r, **tags(len(seq)))
        if out is None:
            s.counts["refused"][tid] += 1
            return
        s.counts["served"][tid] += 1
        new_pages = set()
        for i, x in zip(order, out.tolist(), strict=True):
            if i is None:
                live.append([x])
                new_pages.add(x // ps)
            else:
                if x // ps not in pages_of(live[i]):
                    new_pages.add(x // ps)
                live[i].append(x)
        s.claim(tid, r, new_pages)

    def alloc_pages(r: int) -> None:
        out = a.alloc(rng.randint(1, 4) * ps, dp_rank=r, **tag)
        if out is None:
            s.counts["refused"][tid] += 1
            return
        s.counts["served"][tid] += 1
        reqs[r].append(out.tolist())
        s.claim(tid, r, pages_of(out.tolist()))

    def free(r: int, everything: bool = False) -> None:
        live = reqs[r]
        i = rng.randrange(len(live))
        q = live[i]
        k = 0 if everything or rng.random() < 0.5 else rng.randrange(len(q))
        gone = pages_of(q[k:])  # the page of token k goes whole
        kept = q[: k - k % ps]
        if kept:
            live[i] = kept
        else:
            live.pop(i)
        s.release(tid, r, gone)
        got = a.free(np.array(q[k:], dtype=np.int64), dp_rank=r)
        if got != len(gone):  # freed or made pending: each is allocated, and not pending yet
            s.fail(f"thread {tid}: free of {len(gone)} pages reported {got}")
        s.counts["freed"][tid] += 1

    try:
        s.barrier.wait()
        for step in range(OPS):
            if s.failures:
                return
            r = rng.randrange(2)
            if s.track and step % 50 == 0:
                mine_outstanding(r)
            op = rng.random()
            if op < 0.35 and reqs[r]:
                free(r)
            elif op < 0.6:
                extend(r)
            elif op < 0.75 and reqs[r]:
                decode(r)
            elif op < 0.88:
                alloc_pages(r)
            elif op < 0.9:
                a.free_group_begin()
                s.counts["groups"][tid] += 1
            elif op < 0.96:
                a.free_group_end()
            else:
                a.merge_and_sort_free(r)
                s.counts["merges"][tid] += 1
            free_list = a.free_pages[r]
            if free_list.size and not bool(np.all(np.diff(free_list) > 0)):
                s.fail(f"rank {r} free list read unsorted: {free_list.tolist()}")
            available = a.available_size(r)
            if not (0 <= available <= PAGES * ps and available % ps == 0):
                s.fail(f"rank {r} available_size() {available} out of range")
        for r in (0, 1):
            while reqs[r]:
                free(r, everything=True)
    except threading.BrokenBarrierError:
        pass
    except BaseException as exc:  # noqa: BLE001 - surface anything else to the test thread
        s.fail(f"thread {tid}: {exc!r}")


def run_threads(target: Any, args: list[tuple[Any, ...]]) -> None:
    threads = [threading.Thread(target=target, args=a, daemon=True) for a in args]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so their calls interleave
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "a worker hung"


@pytest.mark.slow
@pytest.mark.parametrize("track", [False, True], ids=["untracked", "tracked"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_no_page_has_two_owners(page_size: int, track: bool) -> None:
    s = Stress(page_size, track)
    run_threads(worker, [(s, tid) for tid in range(THREADS)])
    assert s.failures == []
    a = s.alloc
    a.free_group_end()  # a group another thread began may still hold the last frees
    assert a.is_not_in_free_group
    a.check_invariants()
    assert (s.owner == FREE).all()
    for r in (0, 1):
        assert a.available_size(r) == PAGES * page_size
        assert not track or a.outstanding(r) == []
        a.merge_and_sort_free(r)
        assert a.free_pages[r].tolist() == list(range(1, PAGES + 1))
    for tid in range(THREADS):
        assert s.counts["served"][tid] > OPS // 10
        assert s.counts["freed"][tid] > OPS // 10
    # The threads competed: some allocations were refused; groups and merges happened.
    assert sum(s.counts["refused"]) > 0
    assert sum(s.counts["groups"]) > 0
    assert sum(s.counts["merges"]) > 0


def test_token_allocator_no_slot_has_two_owners() -> None:
    per_rank = 64
    t = TokenToKVPoolAllocator(2 * per_rank, None, dp_size=2)
    owner = np.full((2, per_rank + 1), FREE, dtype=np.int64)
    table = threading.Lock()
    failures: list[str] = []
    served = [0] * THREADS
    refused = [0] * THREADS

    def token_worker(tid: int) -> None:
        rng = random.Random(tid)
        held: list[list[np.ndarray]] = [[], []]

        def give_back(r: int) -> None:
            x = held[r].pop(rng.randrange(len(held[r])))
            x = x[rng.sample(range(len(x)), len(x))]  # in any order: appended in that order
            with table:
                if not (owner[r, x] == tid).all():
                    failures.append(f"thread {tid} lost slots {x.tolist()}")
                owner[r, x] = FREE
            if t.free(x, dp_rank=r) != len(x):
                failures.append(f"thread {tid}: free did not report {len(x)} slots")

        try:
            for _ in range(OPS):
                r = rng.randrange(2)
                if held[r] and rng.random() < 0.45:
                    give_back(r)
                    continue
                if rng.random() < 0.05:
                    (t.free_group_begin if rng.random() < 0.4 else t.free_group_end)()
                    continue
                x = t.alloc(rng.randint(1, 8), dp_rank=r)
                if x is None:
                    refused[tid] += 1
                    continue
                served[tid] += 1
                with table:
                    if (owner[r, x] != FREE).any():
                        failures.append(f"thread {tid} got slots already held: {x.tolist()}")
                    owner[r, x] = tid
                held[r].append(x)
            for r in (0, 1):
                while held[r]:
                    give_back(r)
        except BaseException as exc:  # noqa: BLE001 - surface anything to the test thread
            failures.append(f"thread {tid}: {exc!r}")

    run_threads(token_worker, [(tid,) for tid in range(THREADS)])
    assert failures == []
    t.free_group_end()
    t.check_invariants()
    assert (owner == FREE).all()
    for r in (0, 1):
        assert sorted(t.free_slots[r].tolist()) == list(range(1, per_rank + 1))
    assert min(served) > OPS // 10
    assert sum(refused) > 0


# -- a caller's thread writing the array free reads ---------------------------------------------

# Smaller pools without the JIT: the kernels then run as Python.
SCALE = 8 if JIT_DISABLED else 1

_CHILD_PRELUDE = textwrap.dedent(
    """
    import json, sys, threading
    import numpy as np
    from hostpool_nb import HostPoolError
    from hostpool_nb.paged import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    args = json.loads(sys.argv[1])
    ps, pages, rounds, group = args["page_size"], args["pages"], args["rounds"], args["group"]
    if args["kind"] == "paged":
        alloc = PagedTokenToKVPoolAllocator(pages * ps, ps, None)
    else:
        alloc = TokenToKVPoolAllocator(pages, None)

    def writer(stop, steps):
        # Runs ``steps`` (a list of callables) round and round until stopped.
        i = 0
        while not stop.is_set():
            steps[i % len(steps)]()
            i += 1

    def start(steps):
        stop = threading.Event()
        t = threading.Thread(target=writer, args=(stop, steps), daemon=True)
        t.start()
        return stop, t

    def free(x):
        if group:
            alloc.free_group_begin()
        try:
            return alloc.free(x)
        finally:
            if group:
                alloc.free_group_end()
    """
)

# Every free fails (its last slot is the padding page's) while a thread flips
# the first slot between a held one and one far beyond the rank.
_FAILING = textwrap.dedent(
    """
    held = alloc.alloc(pages * ps)
    x = np.array(held, dtype=np.int64)  # the caller's own copy
    x[-1] = 0  # the padding page: the free fails at its very end
    stop, t = start([lambda: x.__setitem__(0, 10**15), lambda: x.__setitem__(0, ps)])
    errors = {}
    for _ in range(rounds):
        try:
            free(x)
        except HostPoolError as exc:
            # Which check failed: the far slot the writer put first, or the padding page last.
            key = type(exc).__name__ + (" far" if "10000000000" in str(exc) else " padding")
            errors[key] = errors.get(key, 0) + 1
    stop.set(); t.join()
    alloc.check_invariants()
    print(json.dumps({"errors": errors, "available": alloc.available_size()}))
    """
)

# A thread swaps the first page of the freed array between the caller's page
# and a page another owner holds, whole or half-way. Whatever each free reads,
# the pages it released are exactly the pages it reported, and every other
# page is still held.
_SWAP = textwrap.dedent(
    """
    mine_pages = pages - 1
    outcomes = {"mine": 0, "other": 0, "both": 0}
    for _ in range(rounds):
        alloc.clear()
        a = np.array(alloc.alloc(mine_pages * ps), dtype=np.int64)  # pages 1 .. n-1
        other = np.array(alloc.alloc(ps), dtype=np.int64)  # page n: another owner's
        assert int(other[0]) == pages * ps
        mine0 = a[:ps].copy()
        stop, t = start([lambda: a.__setitem__(slice(0, ps), other), lambda: a.__setitem__(slice(0, ps), mine0)])
        n = free(a)
        stop.set(); t.join()
        alloc.check_invariants()
        if args["kind"] == "paged":
            alloc.merge_and_sort_free()
            freed = set(alloc.free_pages[0].tolist())
        else:
            freed = set(alloc.free_slots[0].tolist())
        # Pages 2 .. n-1 for sure; page 1, page n or both (a half-swapped first page).
        assert set(range(2, mine_pages + 1)) <= freed <= set(range(1, pages + 1)), sorted(freed)
        assert n == len(freed), (n, len(freed))
        ends = (1 in freed, pages in freed)
        assert ends != (False, False)
        outcomes["both" if all(ends) else "mine" if ends[0] else "other"] += 1
    print(json.dumps(outcomes))
    """
)


def _run(script: str, args: dict[str, Any]) -> dict[str, Any]:
    return run_child(_CHILD_PRELUDE + script, args, timeout=300)


_KINDS = [
    pytest.param("paged", 16, id="paged-16"),
    pytest.param("paged", 1, id="paged-1"),
    pytest.param("token", 1, id="token"),
]


@pytest.mark.slow
@pytest.mark.parametrize("group", [False, True], ids=["direct", "in-a-group"])
@pytest.mark.parametrize(("kind", "page_size"), _KINDS)
def test_writer_racing_a_failing_free_cannot_crash(kind: str, page_size: int, group: bool) -> None:
    rounds = 120 // SCALE
    pages = (1 << 20) // SCALE // page_size
    res = _run(_FAILING, {"kind": kind, "page_size": page_size, "pages": pages, "rounds": rounds, "group": group})
    # Every call failed (the padding page at the end, or the slot the writer put
    # far out) and left everything allocated.
    assert sum(res["errors"].values()) == rounds
    assert set(res["errors"]) <= {"SlotRangeError far", "SlotRangeError padding"}
    assert res["available"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("group", [False, True], ids=["direct", "in-a-group"])
@pytest.mark.parametrize(("kind", "page_size"), _KINDS)
def test_writer_racing_a_successful_free_keeps_the_allocator_consistent(kind: str, page_size: int, group: bool) -> None:
    rounds = 40 // SCALE
    pages = (1 << 16) // SCALE
    res = _run(_SWAP, {"kind": kind, "page_size": page_size, "pages": pages, "rounds": rounds, "group": group})
    assert sum(res.values()) == rounds
