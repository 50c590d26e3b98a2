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
