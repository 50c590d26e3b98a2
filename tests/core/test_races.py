"""A caller's thread writing the array that ``free`` is reading (docs/behaviour.md, section 2).

``free`` hands a caller's int64 array to a kernel that runs without the GIL,
so another thread of the caller may write that array meanwhile. The pool
must then free only pages it validated, or raise a ``HostPoolError``; it
must never crash, and ``check_invariants()`` must hold afterwards.

Each scenario runs in a child process, so a crash (the kernels once read
the input again after validating it and could index the owner flags with
an unchecked value: a segfault) fails the test instead of killing pytest.
Iterations are bounded; a scenario takes a few seconds.
"""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from tests.conftest import JIT_DISABLED, run_child

pytestmark = pytest.mark.slow  # child processes, each a race of seconds

# Smaller pools without the JIT: the kernels then run as Python.
SCALE = 4 if JIT_DISABLED else 1

_CHILD_PRELUDE = textwrap.dedent(
    """
    import json, sys, threading
    import numpy as np
    import hostpool_nb
    from hostpool_nb import HostPoolError

    args = json.loads(sys.argv[1])
    if args.get("torch"):
        import torch
        from hostpool_nb.torch import LogicalHostPool
        wrap = torch.from_numpy
    else:
        from hostpool_nb import LogicalHostPool
        wrap = lambda a: a

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
    """
)

# The reported crash: every free fails (the last page repeats the first),
# while a thread flips the first slot to a value far out of range. The
# roll-back of the failure used to read that slot again, unchecked.
_CRASH = textwrap.dedent(
    """
    ps, size, rounds = args["page_size"], args["size"], args["rounds"]
    pool = LogicalHostPool(size, ps)
    held = pool.alloc(size)
    x = np.array(held, dtype=np.int64)  # the caller's own copy
    x[-ps:] = x[:ps]  # a page named twice: the free fails at its very end
    arg = wrap(x)
    far = 10**15
    stop, t = start([lambda: x.__setitem__(0, far), lambda: x.__setitem__(0, 0)])
    errors = {}
    for _ in range(rounds):
        try:
            pool.free(arg)
        except HostPoolError as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
    stop.set(); t.join()
    pool.check_invariants()
    print(json.dumps({"errors": errors, "available": pool.available_size(), "size": size}))
    """
)

# The success path: a thread swaps one page of the freed array (the first,
# or one in the middle of the one long run the array is) between the
# caller's page and a page another owner holds. Whatever each free reads,
# the pool must stay consistent: the pages it released are exactly the
# pages it reported, and every other page is still held. The middle swap
# splits the run under the run path's feet.
_SWAP = textwrap.dedent(
    """
    ps, size, rounds = args["page_size"], args["size"], args["rounds"]
    pool = LogicalHostPool(size, ps)
    npages = size // ps
    mine_pages = npages - 1
    s = args["swap_page"]
    freed_other = freed_mine_first = failed = 0
    for _ in range(rounds):
        pool.clear()
        a = np.array(pool.alloc(mine_pages * ps), dtype=np.int64)  # pages 0 .. n-2
        other = pool.alloc(ps)  # page n-1: another owner's
        assert other is not None and int(other[0]) == mine_pages * ps
        mine0 = a[s * ps:(s + 1) * ps].copy()
        other0 = np.asarray(other, dtype=np.int64).copy()
        arg = wrap(a)
        stop, t = start([lambda: a.__setitem__(slice(s * ps, (s + 1) * ps), other0),
                         lambda: a.__setitem__(slice(s * ps, (s + 1) * ps), mine0)])
        try:
            n = pool.free(arg)
        except HostPoolError:
            n = None
        stop.set(); t.join()
        pool.check_invariants()
        owner = pool._owner
        if n is None:
            failed += 1
            assert pool.available_size() == 0, "a failed free released pages"
            continue
        assert n == mine_pages * ps
        assert pool.available_size() == n
        # Exactly one of page s and page n-1 was released, with all the others.
        assert (np.delete(owner[:mine_pages], s) == 0).all()
        assert int(owner[s]) + int(owner[mine_pages]) == 1, (int(owner[s]), int(owner[mine_pages]))
        if owner[mine_pages] == 0:
            freed_other += 1
        else:
            freed_mine_first += 1
    print(json.dumps({"freed_other": freed_other, "freed_mine": freed_mine_first, "failed": failed}))
    """
)


def _run(script: str, args: dict[str, Any]) -> dict[str, Any]:
    return run_child(_CHILD_PRELUDE + script, args, timeout=240)


def _torch_params() -> list[Any]:
    return [
        pytest.param(False, id="numpy"),
        pytest.param(True, id="torch", marks=pytest.mark.torch),
    ]


@pytest.mark.parametrize("use_torch", _torch_params())
@pytest.mark.parametrize("page_size", [16, 1, 3])
def test_writer_racing_a_failing_free_cannot_crash(page_size: int, use_torch: bool) -> None:
    if use_torch:
        pytest.importorskip("torch")
    size = (1 << 22) // SCALE // page_size * page_size if page_size > 1 else (1 << 20) // SCALE
    res = _run(_CRASH, {"page_size": page_size, "size": size, "rounds": 150 // SCALE, "torch": use_torch})
    # Every call failed (the duplicate page at the end, or a slot the writer
    # put out of range) and left everything allocated.
    assert sum(res["errors"].values()) == 150 // SCALE
    assert set(res["errors"]) <= {"DoubleFreeError", "SlotRangeError", "PartialPageError"}
    assert res["available"] == 0


@pytest.mark.parametrize("use_torch", _torch_params())
@pytest.mark.parametrize("where", ["first", "middle"])
@pytest.mark.parametrize("page_size", [16, 1, 3])
def test_writer_racing_a_successful_free_keeps_the_pool_consistent(page_size: int, where: str, use_torch: bool) -> None:
    if use_torch:
        pytest.importorskip("torch")
    npages = (1 << 16) // SCALE
    rounds = 60 // SCALE
    swap_page = 0 if where == "first" else npages // 2 + 5  # mid-run, off any block boundary
    args = {"page_size": page_size, "size": npages * page_size, "rounds": rounds, "torch": use_torch}
    res = _run(_SWAP, {**args, "swap_page": swap_page})
    assert res["freed_other"] + res["freed_mine"] + res["failed"] == rounds


# The sliding-window allocator: a thread flips one slot of the array a call reads between a slot of the
# request and a value that is no slot (far beyond, or negative). Each element must be read once: a free
# may fail (SlotRangeError) or free what it checked, never crash, never leave the allocator corrupted,
# and a count may not read a wrapped negative index.
_SWA = textwrap.dedent(
    """
    from types import SimpleNamespace
    from hostpool_nb import SlotRangeError
    from hostpool_nb.paged import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
    ps, n, rounds, bad, call = args["page_size"], args["slots"], args["rounds"], args["bad"], args["call"]
    a = SWATokenToKVPoolAllocator(4 * n, 4 * n, SimpleNamespace(full_kv_pool=None, swa_kv_pool=None), page_size=ps)
    outcomes = {}
    for _ in range(rounds):
        a.clear()
        full = np.array(a.alloc(n), dtype=np.int64)
        x = full.copy()
        good = int(x[0])
        stop, t = start([lambda: x.__setitem__(0, bad), lambda: x.__setitem__(0, good)])
        try:
            if call == "free":
                a.free(x)
            elif call == "free_swa":
                a.free_swa(x)
            got = "ok"
        except SlotRangeError as exc:
            assert str(bad) in str(exc) or str(good) in str(exc), exc  # names a value the call read
            assert f"got slot {bad} " in str(exc), exc  # the value it refused, not one read again
            got = "refused"
        stop.set(); t.join()
        a.check_invariants()
        outcomes[got] = outcomes.get(got, 0) + 1
    print(json.dumps(outcomes))
    """
)


@pytest.mark.parametrize("bad", [10**15, -7], ids=["far", "negative"])
@pytest.mark.parametrize("call", ["free", "free_swa"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_writer_racing_the_sliding_window_allocator_cannot_crash_or_corrupt_it(
    page_size: int, call: str, bad: int
) -> None:
    rounds = 300 // SCALE
    res = _run(_SWA, {"page_size": page_size, "slots": (1 << 16) // SCALE, "rounds": rounds, "bad": bad, "call": call})
    assert sum(res.values()) == rounds
    assert set(res) <= {"ok", "refused"}


# Python-side reads of a caller's array: a check, then an index. A negative value written in between
# would wrap (numpy) and read another slot's entry; each must read the array once.
_COUNTS = textwrap.dedent(
    """
    from types import SimpleNamespace
    from hostpool_nb import SlotRangeError
    from hostpool_nb.paged import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
    rounds, what = args["rounds"], args["what"]
    sys.setswitchinterval(1e-6)  # the writer gets in between two numpy calls often
    wrong = 0
    if what == "count_swa_mapped":
        a = SWATokenToKVPoolAllocator(4096, 4096, SimpleNamespace(full_kv_pool=None, swa_kv_pool=None))
        full = a.alloc(4096)  # every entry of the mapping set, the last ones too
        a.free_swa(full[:1])  # but slot 1's
        x = np.full(1 << 16, 1, dtype=np.int64)  # slot 1, many times: none of them mapped
        # -255 shares its low byte with 1 and wraps to a mapped entry: a copy that tears
        # the two apart (numpy copies without the GIL) gives 1, -255 or an id out of range.
        stop, t = start([lambda: x.__setitem__(-1, -255), lambda: x.__setitem__(-1, 1)])
        for _ in range(rounds):
            try:
                wrong += a.count_swa_mapped(x) != 0
            except SlotRangeError:
                pass
    else:
        a = PagedTokenToKVPoolAllocator(1 << 16, 16, None, track=True)
        held = a.alloc(1 << 16)
        x = np.array(held[: 1 << 15], dtype=np.int64)  # half the pages held legitimately
        v = int(x[-1])
        # v - 2**16 shares v's low two bytes (a torn copy gives v, it, or an id out of range)
        # and wraps to page v // 16 + 1, which the exclusion does not cover.
        stop, t = start([lambda: x.__setitem__(-1, v - (1 << 16)), lambda: x.__setitem__(-1, v)])
        for _ in range(rounds):
            try:
                left = sum(o.pages for o in a.outstanding(exclude=x))
                wrong += left != (1 << 11)  # the other half: a wrapped id would drop one page of it
            except SlotRangeError:
                pass
    stop.set(); t.join()
    print(json.dumps({"wrong": wrong}))
    """
)


@pytest.mark.parametrize("what", ["count_swa_mapped", "outstanding"])
def test_a_negative_value_written_meanwhile_is_never_read_as_a_wrapped_index(what: str) -> None:
    assert _run(_COUNTS, {"rounds": 3000 // SCALE, "what": what}) == {"wrong": 0}
