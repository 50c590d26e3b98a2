"""The kernel layer itself: entry points, the dispatcher fallback, status codes."""

from __future__ import annotations

import numpy as np
import pytest

from hostpool_nb import LogicalHostPool, _pool
from hostpool_nb import _kernels as K
from tests.conftest import JIT_DISABLED


@pytest.mark.skipif(JIT_DISABLED, reason="entry points exist only with the JIT on")
def test_pool_calls_compiled_entry_points() -> None:
    # A silent fallback to the dispatcher would still be correct, but slower
    # by several hundred ns per call: catch it here rather than in a profile.
    for name, kernel in (("_alloc_pages", K.alloc_pages), ("_free_pages", K.free_pages), ("_reset", K.reset)):
        bound = getattr(_pool, name)
        assert bound is not kernel, name
        assert type(bound).__name__ == "builtin_function_or_method", (name, type(bound))


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
def test_dispatcher_fallback_gives_the_same_results(page_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _trace(LogicalHostPool(8 * page_size, page_size), np.random.default_rng(7))
    for name, kernel in (("_alloc_pages", K.alloc_pages), ("_free_pages", K.free_pages), ("_reset", K.reset)):
        monkeypatch.setattr(_pool, name, kernel)
    pool = LogicalHostPool(8 * page_size, page_size)
    assert _trace(pool, np.random.default_rng(7)) == expected
    pool.check_invariants()


@pytest.mark.parametrize("code", range(1, 8))
@pytest.mark.parametrize("position", [0, 1, 15, 16, 2**40])
def test_status_codes_round_trip(code: int, position: int) -> None:
    status = K._fail(code, position)
    assert status < 0
    assert K.decode_status(status) == (code, position)


def test_merge_happens_only_when_an_allocation_needs_it() -> None:
    pool = LogicalHostPool(64, 16)
    a = pool.alloc(32)
    pool.free(a)  # released, not merged: the free list still holds 32 slots
    assert int(pool._st[K.H_MERGES]) == 0
    assert int(pool._st[K.H_NREL]) == 2
    pool.alloc(32)  # served by the free list alone
    assert int(pool._st[K.H_MERGES]) == 0
    assert pool.alloc(32).tolist() == a.tolist()  # needs the released pages
    assert int(pool._st[K.H_MERGES]) == 1
    assert int(pool._st[K.H_NREL]) == 0
    pool.check_invariants()


def test_state_length_and_page_shift() -> None:
    for n in range(20):
        # 8 header words, one ring word per page, one owner byte per page.
        assert K.state_length(n) * 8 >= (K.HEADER + n) * 8 + n
        assert K.state_length(n) * 8 < (K.HEADER + n) * 8 + n + 8
    assert [K.page_shift(ps) for ps in (1, 2, 3, 16, 48, 64)] == [0, 1, -1, 4, -1, 6]
