"""``check_invariants()`` itself: it must pass every reachable state and flag each broken one.

Every state-machine step trusts this check, so its blind spots would be the
suite's. Here each condition it enforces is broken on its own, in a pool
whose state is otherwise valid, and must be reported with its own reason;
putting the value back must make the check pass again (so the failure came
from that value). Pools at page sizes 1, 3 (not a power of two) and 16, in
states where the free and release window wraps around the end of the ring.
"""

from __future__ import annotations

import numpy as np
import pytest

from hostpool_nb import LogicalHostPool
from hostpool_nb._kernels import layout as L
from tests.conftest import one_entry_per_page

PAGE_SIZES = [1, 3, 16]
PAGES = 8


def wrapped_pool(page_size: int) -> LogicalHostPool:
    """A pool with pages held, released and free, its live window wrapping the ring's end.

    Ring after the calls: head at page position 6; free pages 6, 7; released
    pages 1, 0 (positions 0, 1 of the ring, past its end); pages 2..5 held.
    """
    pool = LogicalHostPool(PAGES * page_size, page_size)
    first = pool.alloc(6 * page_size)  # pages 0..5 held; 6, 7 free
    assert first is not None
    pool.free(first[page_size : 2 * page_size])  # page 1 released
    pool.free(first[:page_size])  # then page 0
    pool.check_invariants()
    st = pool._st
    one_entry_per_page(st, head=6)
    assert (int(st[L.H_HEAD]), int(st[L.H_NFREE]), int(st[L.H_NREL])) == (6, 2, 2)
    return pool


def ring(pool: LogicalHostPool) -> np.ndarray:
    return one_entry_per_page(pool._st)


def live(pool: LogicalHostPool) -> list[int]:
    """Ring positions of the live window, in order."""
    st = pool._st
    n = int(st[L.H_NPAGES])
    return [(int(st[L.H_HEAD]) + i) % n for i in range(int(st[L.H_NFREE] + st[L.H_NREL]))]


def held_page(pool: LogicalHostPool) -> int:
    return int(np.flatnonzero(pool._owner == L.OWNER_ALLOCATED)[0])


def broken_then_fixed(pool: LogicalHostPool, array: np.ndarray, index: int, value: int, reason: str) -> None:
    """Set ``array[index] = value``: the check must fail naming ``reason``; undo: it must pass."""
    old = int(array[index])
    assert old != value, "test bug: the corruption changes nothing"
    array[index] = value
    with pytest.raises(RuntimeError, match=f"^LogicalHostPool state is corrupted: {reason}"):
        pool.check_invariants()
    array[index] = old
    pool.check_invariants()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_reachable_states_pass(page_size: int) -> None:
    LogicalHostPool(0, page_size).check_invariants()
    pool = LogicalHostPool(PAGES * page_size, page_size)
    pool.check_invariants()  # fresh: everything free, in order
    held = pool.alloc(PAGES * page_size)  # nothing free
    assert held is not None
    pool.check_invariants()
    pool.free(held)  # everything released
    pool.check_invariants()
    wrapped_pool(page_size).check_invariants()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(
    ("word", "delta"),
    [(L.H_NPAGES, 1), (L.H_NPAGES, -1), (L.H_PAGE_SIZE, 1), (L.H_PAGE_SHIFT, 1), (L.H_PAGE_SHIFT, -2)],
    ids=["pages+1", "pages-1", "page_size+1", "shift+1", "shift-2"],
)
def test_header_mismatch(page_size: int, word: int, delta: int) -> None:
    pool = wrapped_pool(page_size)
    st = pool._st
    broken_then_fixed(pool, st, word, int(st[word]) + delta, r"header says \(pages, page_size, shift\)")


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_state_array_of_the_wrong_length(page_size: int) -> None:
    pool = wrapped_pool(page_size)
    good = pool._st
    for bad in (np.append(good, 0), good[:-1].copy()):
        pool._st = bad
        with pytest.raises(RuntimeError, match="state array has length"):
            pool.check_invariants()
    pool._st = good
    pool.check_invariants()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(
    ("word", "value"),
    [
        (L.H_NFREE, -1),
        (L.H_NREL, -1),
        (L.H_NFREE, PAGES - 1),  # free + released > pages
        (L.H_NREL, PAGES - 1),
        (L.H_HEAD, PAGES),  # head past the ring
        (L.H_HEAD, -1),
    ],
    ids=["nfree<0", "nrel<0", "nfree-too-many", "nrel-too-many", "head=pages", "head<0"],
)
def test_counters_out_of_range(page_size: int, word: int, value: int) -> None:
    pool = wrapped_pool(page_size)
    broken_then_fixed(pool, pool._st, word, value, "counters out of range")


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("which", [0, -1], ids=["first", "last-wrapped"])
@pytest.mark.parametrize("value", [PAGES, -1], ids=["too-big", "negative"])
def test_listed_page_id_out_of_range(page_size: int, which: int, value: int) -> None:
    pool = wrapped_pool(page_size)
    broken_then_fixed(pool, ring(pool), live(pool)[which], value, "a listed page id is out of range")


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_page_listed_twice(page_size: int) -> None:
    # Exactly twice: a check for "more than twice" must not pass this.
    pool = wrapped_pool(page_size)
    r, pos = ring(pool), live(pool)
    broken_then_fixed(pool, r, pos[-1], int(r[pos[0]]), f"page {int(r[pos[0]])} is listed 2 times")


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("which", [0, -1], ids=["free-list", "release-list"])
def test_listed_page_flagged_allocated(page_size: int, which: int) -> None:
    pool = wrapped_pool(page_size)
    page = int(ring(pool)[live(pool)[which]])
    broken_then_fixed(pool, pool._owner, page, L.OWNER_ALLOCATED, f"page {page} has owner flag 1 but is listed 1 times")


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_unlisted_page_flagged_free(page_size: int) -> None:
    pool = wrapped_pool(page_size)
    page = held_page(pool)
    broken_then_fixed(pool, pool._owner, page, L.OWNER_FREE, f"page {page} has owner flag 0 but is listed 0 times")


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_held_page_put_on_the_ring_is_flagged(page_size: int) -> None:
    # A listed page replaced by a held one: the held page is now listed while
    # flagged allocated, and the page it replaced is unlisted but free.
    pool = wrapped_pool(page_size)
    r, pos = ring(pool), live(pool)
    held = held_page(pool)
    broken_then_fixed(pool, r, pos[0], held, f"page {min(held, int(r[pos[0]]))} has owner flag")


def test_every_problem_is_reported_together() -> None:
    """Two independent faults: the message lists both, so a report shows the whole damage."""
    pool = wrapped_pool(16)
    pool._owner[held_page(pool)] = L.OWNER_FREE
    pool._st[L.H_PAGE_SIZE] += 1
    with pytest.raises(RuntimeError) as info:
        pool.check_invariants()
    text = str(info.value)
    assert "header says" in text
    assert "has owner flag 0 but is listed 0 times" in text
    assert "; " in text


def test_check_holds_the_lock() -> None:
    """The check reads a consistent state: it takes the pool's lock."""
    pool = wrapped_pool(16)
    seen: list[str] = []
    real = pool.lock

    class Spy:
        def __enter__(self) -> None:
            seen.append("enter")
            real.acquire()

        def __exit__(self, *exc: object) -> None:
            seen.append("exit")
            real.release()

    pool.lock = Spy()  # type: ignore[assignment]
    pool.check_invariants()
    assert seen == ["enter", "exit"]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("where", ["held", "listed"])
def test_owner_flag_that_is_neither_value(page_size: int, where: str) -> None:
    """A flag byte that is neither "free" nor "allocated" is damage wherever it is."""
    pool = wrapped_pool(page_size)
    page = held_page(pool) if where == "held" else int(ring(pool)[live(pool)[0]])
    times = 0 if where == "held" else 1
    broken_then_fixed(pool, pool._owner, page, 7, f"page {page} has owner flag 7 but is listed {times} times")


# A status code the kernel never returns for that call is the pool's own
# fault: each error mapper must turn it into a RuntimeError naming the code,
# never into one of the caller-facing errors of its neighbours.
_FREE_CODES = {L.E_LENGTH, L.E_RANGE, L.E_MISALIGNED, L.E_PARTIAL, L.E_NOT_ALLOCATED, L.E_DUPLICATE}


@pytest.mark.parametrize("code", sorted(set(range(1, 16)) - _FREE_CODES))
def test_free_error_of_an_unexpected_code_is_a_runtime_error(code: int) -> None:
    pool = LogicalHostPool(64, 16)
    err = pool._free_error(L.status_for(code, 0), np.arange(16, dtype=np.int64))
    assert type(err) is RuntimeError
    assert f"code {code}" in str(err)


@pytest.mark.parametrize("code", [c for c in range(1, 16) if c not in (L.E_SHORT, L.E_MISALIGNED)])
def test_alloc_error_of_an_unexpected_code_is_a_runtime_error(code: int) -> None:
    pool = LogicalHostPool(64, 16)
    with pytest.raises(RuntimeError, match=f"code {code}") as info:
        pool._failed_alloc(L.status_for(code, 0), 16)
    assert type(info.value) is RuntimeError
