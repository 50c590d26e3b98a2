"""hostpool_nb.torch against the original algorithm on torch (docs/behaviour.md, section 1).

``hostpool_nb.originals.sglang.LogicalHostPool`` on torch is the original pool's algorithm: a tensor
of free slots, a release list of freed chunks, a merge only when an
allocation needs it. On whole-page frees, the domain where the original is
correct, hostpool_nb must hand out exactly the same slots in exactly the same
order. Hypothesis generates traces of alloc (including 0 and more than is
available), frees of random subsets of the held pages in random page order
(passed to the adapter in varied tensor forms, or as the very tensor
``alloc`` returned) and clear, and runs each on both pools: every returned
tensor must be equal element for element, and ``available_size()`` equal
after every step. Example counts come from the hypothesis profile loaded by
``tests/conftest.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from hostpool_nb.originals.sglang import LogicalHostPool as Original  # noqa: E402
from hostpool_nb.torch import LogicalHostPool  # noqa: E402

pytestmark = pytest.mark.torch

PAGE_SIZES = [1, 16, 64]
# How a batch of slot ids is handed to the adapter; the oracle always gets a
# fresh 1-D int64 tensor (it counts rows of a 2-D input, docs/behaviour.md, section 1).
FORMS = ["int64", "int32", "int16", "2d", "fortran", "strided", "numpy", "list"]
# Step kinds, weighted: clear() is rare so that pages cycle through the
# free and release lists and merges happen.
OPS = st.sampled_from(["alloc"] * 4 + ["free"] * 3 + ["free_alloc"] * 2 + ["clear"])
FORM = st.sampled_from(FORMS)


def slots_of(pages: list[int], page_size: int) -> torch.Tensor:
    """The slot ids of ``pages``, each page ascending, pages in the given order."""
    base = torch.tensor(pages, dtype=torch.int64).reshape(-1, 1) * page_size
    return (base + torch.arange(page_size, dtype=torch.int64)).reshape(-1)


def as_form(slots: torch.Tensor, form: str, page_size: int) -> Any:
    if form == "int64":
        return slots.clone()
    if form == "int32":
        return slots.to(torch.int32)
    if form == "int16":
        return slots.to(torch.int16)  # slot ids stay below 2**15 here
    if form == "2d":
        return slots.reshape(-1, page_size).clone()
    if form == "fortran":
        return slots.reshape(-1, page_size).T.contiguous().T
    if form == "strided":
        big = torch.full((2 * slots.numel(),), -3, dtype=torch.int64)
        big[::2] = slots
        return big[::2]
    if form == "numpy":
        return slots.numpy().copy()
    if form == "list":
        return slots.tolist()
    raise AssertionError(form)


def check_alloc(got: Any, want: Any, need: int) -> None:
    if want is None:
        assert got is None, f"alloc({need}): oracle is short, adapter returned {got}"
        return
    assert got is not None, f"alloc({need}): adapter is short, oracle returned {want}"
    assert type(got) is torch.Tensor
    assert got.dtype is torch.int64
    assert got.device.type == "cpu"
    assert got.is_contiguous()
    assert torch.equal(got, want), f"alloc({need}): {got.tolist()} != {want.tolist()}"


@pytest.mark.slow
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@given(data=st.data())
def test_same_slots_in_same_order_as_the_original(page_size: int, data: st.DataObject) -> None:
    n_pages = data.draw(st.integers(1, 12), label="n_pages")
    size = n_pages * page_size
    pool, oracle = LogicalHostPool(size, page_size), Original(size, page_size, backend="torch")
    # Held pages, and the allocations still held whole: (adapter tensor,
    # oracle tensor, pages), freed as returned by the "free_alloc" step.
    held: list[int] = []
    whole: list[tuple[Any, Any, list[int]]] = []
    n_steps = data.draw(st.integers(8, 32), label="n_steps")
    need_pages = st.sampled_from(range(n_pages + 2))  # 0 and more than fits too
    for _ in range(n_steps):
        op = data.draw(OPS, label="op")
        if op == "alloc":
            need = data.draw(need_pages, label="pages") * page_size
            got, want = pool.alloc(need), oracle.alloc(need)
            check_alloc(got, want, need)
            if got is not None:
                pages = (got[::page_size] // page_size).tolist()
                held.extend(pages)
                whole.append((got, want, pages))
        elif op == "free":
            order = data.draw(st.permutations(held), label="order")
            k = data.draw(st.integers(0, len(order)), label="k")
            batch = order[:k]
            form = data.draw(FORM, label="form")
            slots = slots_of(batch, page_size)
            assert pool.free(as_form(slots, form, page_size)) == oracle.free(slots.clone()) == slots.numel()
            freed = set(batch)
            held = [p for p in held if p not in freed]
            whole = [w for w in whole if not freed.intersection(w[2])]
        elif op == "free_alloc" and whole:
            i = data.draw(st.integers(0, len(whole) - 1), label="which")
            got, want, pages = whole.pop(i)
            assert pool.free(got) == oracle.free(want) == got.numel()
            freed = set(pages)
            held = [p for p in held if p not in freed]
        elif op == "clear":
            pool.clear()
            oracle.clear()
            held, whole = [], []
        assert pool.available_size() == oracle.available_size() == size - len(held) * page_size
        pool.check_invariants()
    # Drain both: the whole remaining FIFO sequence must agree too.
    rest = pool.available_size()
    check_alloc(pool.alloc(rest), oracle.alloc(rest), rest)
    assert pool.available_size() == oracle.available_size() == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_spec_example_release_order(page_size: int) -> None:
    """docs/behaviour.md, section 1: alloc all, free two chunks, alloc returns them in order."""
    size = 8 * page_size
    for pool in (LogicalHostPool(size, page_size), Original(size, page_size, backend="torch")):
        everything = pool.alloc(size)
        assert torch.equal(everything, torch.arange(size))
        pool.free(everything[: 2 * page_size])
        pool.free(everything[2 * page_size : 4 * page_size])
        assert torch.equal(pool.alloc(4 * page_size), torch.arange(4 * page_size))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_released_pages_follow_the_free_list(page_size: int) -> None:
    """Freed pages queue behind the still-free ones, in release order."""
    size = 6 * page_size
    results = []
    for pool in (LogicalHostPool(size, page_size), Original(size, page_size, backend="torch")):
        first = pool.alloc(3 * page_size)  # pages 0, 1, 2
        pool.free(slots_of([2, 0], page_size))
        got = [pool.alloc(2 * page_size), pool.alloc(2 * page_size), pool.alloc(page_size)]
        results.append(torch.cat(got))
        assert pool.alloc(page_size) is None  # page 1 is still held
        pool.free(first[page_size : 2 * page_size])
        results.append(pool.alloc(page_size))
    expected = slots_of([3, 4, 5, 2, 0], page_size)
    assert torch.equal(results[0], expected)
    assert torch.equal(results[2], expected)
    assert torch.equal(results[1], slots_of([1], page_size))
    assert torch.equal(results[3], results[1])


# -- the scheduler API (commit c42b45d) against the original ------------------------
#
# The original has neither alloc_many nor free groups, so each is compared
# with what a caller of the original would do instead: alloc_many(sizes) is
# the original's alloc(sum(sizes)), split at the offsets; a free group is
# the original with the group's frees delayed to the outermost group's end,
# then freed as one concatenated chunk, as sglang's free_group_end does.

SCHED_OPS = st.sampled_from(
    ["alloc"] * 2 + ["alloc_many"] * 4 + ["free"] * 4 + ["begin"] * 2 + ["end"] * 2 + ["merge", "clear"]
)
SIZES_FORMS = st.sampled_from(["list", "int64", "int32", "uint8", "numpy"])


def sizes_form(sizes: list[int], form: str) -> Any:
    if form == "list":
        return list(sizes)
    if form == "numpy":
        return torch.tensor(sizes, dtype=torch.int64).numpy()
    return torch.tensor(sizes, dtype=getattr(torch, form))  # sizes stay below 256 here


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 3, 16])
@given(data=st.data())
def test_alloc_many_and_free_groups_match_the_original(page_size: int, data: st.DataObject) -> None:
    from hostpool_nb.torch import HostPoolError

    n_pages = data.draw(st.integers(1, 10), label="n_pages")
    size = n_pages * page_size
    pool, oracle = LogicalHostPool(size, page_size), Original(size, page_size, backend="torch")
    held: list[int] = []
    depth = 0
    delayed: list[torch.Tensor] = []  # the group's frees, not yet given to the original
    for _ in range(data.draw(st.integers(8, 40), label="n_steps")):
        op = data.draw(SCHED_OPS, label="op")
        if op == "alloc":
            need = data.draw(st.integers(0, n_pages + 1), label="pages") * page_size
            got, want = pool.alloc(need), oracle.alloc(need)
            check_alloc(got, want, need)
            if got is not None:
                held.extend((got[::page_size] // page_size).tolist())
        elif op == "alloc_many":
            # Totals up to one page beyond the pool: the original refuses those
            # (its alloc checks the total), and so must the batch.
            budget, sizes = n_pages + 1, []
            for _ in range(data.draw(st.integers(0, 4), label="requests")):
                pages = data.draw(st.integers(0, budget), label="request_pages")
                budget -= pages
                sizes.append(pages * page_size)
            form = data.draw(SIZES_FORMS, label="sizes_form")
            got_many, want = pool.alloc_many(sizes_form(sizes, form)), oracle.alloc(sum(sizes))
            if want is None:
                assert got_many is None, f"alloc_many({sizes}): the original is short, got {got_many}"
            else:
                assert got_many is not None, f"alloc_many({sizes}): short, the original returned {want}"
                slots, offsets = got_many
                check_alloc(slots, want, sum(sizes))
                assert type(offsets) is torch.Tensor
                assert offsets.dtype is torch.int64
                bounds = [0]
                for s in sizes:
                    bounds.append(bounds[-1] + s)
                assert offsets.tolist() == bounds
                for i, part in enumerate(torch.split(want, sizes)):
                    assert torch.equal(slots[offsets[i] : offsets[i + 1]], part), f"request {i} of {sizes}"
                held.extend((slots[::page_size] // page_size).tolist())
        elif op == "free":
            order = data.draw(st.permutations(held), label="order")
            batch = order[: data.draw(st.integers(0, len(order)), label="k")]
            slots = slots_of(batch, page_size)
            form = data.draw(FORM, label="form")
            assert pool.free(as_form(slots, form, page_size)) == slots.numel()
            if depth == 0:
                assert oracle.free(slots.clone()) == slots.numel()
            elif batch:
                delayed.append(slots.clone())
            freed = set(batch)
            held = [p for p in held if p not in freed]
        elif op == "begin":
            pool.free_group_begin()
            depth += 1
        elif op == "end" and depth == 0:
            with pytest.raises(HostPoolError, match=r"^free_group_end\(\) without a free group"):
                pool.free_group_end()
        elif op == "end":
            pool.free_group_end()
            depth -= 1
            if depth == 0 and delayed:
                oracle.free(torch.cat(delayed))
                delayed = []
        elif op == "merge":
            released = pool.stats().released_pages
            assert pool.merge() == released * page_size  # FIFO: the order stays the original's
        else:
            pool.clear()
            oracle.clear()
            held, depth, delayed = [], 0, []
        pending = sum(d.numel() for d in delayed)
        assert pool.available_size() == oracle.available_size() == size - len(held) * page_size - pending
        assert pool.stats().pending_pages * page_size == pending
        pool.check_invariants()
    while depth:
        pool.free_group_end()
        depth -= 1
    if delayed:
        oracle.free(torch.cat(delayed))
    rest = pool.available_size()
    check_alloc(pool.alloc(rest), oracle.alloc(rest), rest)
    assert pool.available_size() == oracle.available_size() == 0
