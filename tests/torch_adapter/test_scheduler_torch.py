"""The scheduler API on hostpool_nb.torch: tensors at the boundary, the core's semantics inside.

``alloc_many`` returns two CPU ``torch.int64`` tensors wrapping the core's
fresh arrays (``torch.from_numpy``: no copy, no pool memory) and takes 1-D
integer tensors as sizes; non-integer and non-1-D tensors are a
``TypeError`` before anything changes. Free groups, snapshots, statistics,
``merge=`` and pickling work on the adapter exactly as on the core, and an
unpickled or copied adapter is still an adapter (``dtype`` ``torch.uint8``).
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hostpool_nb  # noqa: E402
import hostpool_nb.torch as hpt  # noqa: E402
from hostpool_nb._kernels import layout as L  # noqa: E402
from hostpool_nb.torch import AlignmentError, HostPoolError, LogicalHostPool, PoolState, PoolStats  # noqa: E402
from tests.conftest import take_snapshot  # noqa: E402
from tests.scheduler_ops import run_ops, summary  # noqa: E402

pytestmark = pytest.mark.torch

INT_DTYPES = [
    getattr(torch, name)
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
    if hasattr(torch, name)
]


def pg(p: int, ps: int) -> list[int]:
    return list(range(p * ps, (p + 1) * ps))


def pages_of(*pages: int, ps: int) -> list[int]:
    return [s for p in pages for s in pg(p, ps)]


def family(cls: type, ps: int = 16, merge: str = "fifo") -> Any:
    """Six pages: 0, 1, 3 and 4 held, 2 released, 5 free (as in test_scheduler_api.py)."""
    pool = cls(6 * ps, ps, merge=merge)
    held = pool.alloc(5 * ps)
    assert held is not None
    pool.free(held[2 * ps : 3 * ps])
    return pool


def same_state(a: Any, b: Any) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(take_snapshot(a), take_snapshot(b), strict=True))


# -- alloc_many: results -----------------------------------------------------------


def test_alloc_many_wraps_the_cores_arrays_without_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    core_alloc_many = hostpool_nb.LogicalHostPool.alloc_many

    def spy(self: Any, sizes: Any, *, tag: Any = None) -> Any:
        got = core_alloc_many(self, sizes, tag=tag)
        seen.append(got)
        return got

    monkeypatch.setattr(hostpool_nb.LogicalHostPool, "alloc_many", spy)
    pool = family(LogicalHostPool)
    core = family(hostpool_nb.LogicalHostPool)
    got = pool.alloc_many([16, 0, 16])
    want = core_alloc_many(core, [16, 0, 16])
    assert len(seen) == 1
    assert type(got) is tuple
    assert len(got) == 2
    for tensor, arr, expected in zip(got, seen[0], want, strict=True):
        assert type(tensor) is torch.Tensor
        assert tensor.dtype is torch.int64
        assert tensor.device.type == "cpu"
        assert tensor.dim() == 1
        assert tensor.is_contiguous()
        assert tensor._base is None  # not a view of another tensor
        assert tensor.tolist() == expected.tolist()
        # torch.from_numpy of the core's array: the same memory, no copy ...
        assert tensor.data_ptr() == arr.__array_interface__["data"][0]
        assert np.shares_memory(tensor.numpy(), arr)
        # ... an array that owns its memory, which is not the pool's.
        assert arr.flags.owndata
        assert arr.base is None
        assert not np.shares_memory(tensor.numpy(), pool._st)
        assert not np.shares_memory(tensor.numpy(), pool._owner)
    slots, offsets = got
    assert slots.tolist() == pages_of(5, 2, ps=16)
    assert offsets.tolist() == [0, 16, 16, 32]
    assert not np.shares_memory(slots.numpy(), offsets.numpy())
    assert same_state(pool, core)
    # Writing the caller's tensors changes nothing in the pool.
    slots.fill_(-1)
    offsets.fill_(7)
    assert same_state(pool, core)
    pool.check_invariants()


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_alloc_many_takes_1d_integer_tensors(dtype: Any) -> None:
    pool, core = family(LogicalHostPool), family(hostpool_nb.LogicalHostPool)
    slots, offsets = pool.alloc_many(torch.tensor([16, 0, 16], dtype=dtype))
    want_slots, want_offsets = core.alloc_many([16, 0, 16])
    assert slots.tolist() == want_slots.tolist() == pages_of(5, 2, ps=16)
    assert offsets.tolist() == want_offsets.tolist() == [0, 16, 16, 32]
    assert (slots.dtype, offsets.dtype) == (torch.int64, torch.int64)
    assert same_state(pool, core)


def test_alloc_many_takes_other_tensor_layouts_and_refuses_what_does_not_fit() -> None:
    pool = family(LogicalHostPool)
    before = take_snapshot(pool)
    strided = torch.tensor([16, -5, 16, -5])[::2]
    assert not strided.is_contiguous()
    empty = pool.alloc_many(torch.empty(0, dtype=torch.int64))
    assert empty is not None
    assert (empty[0].tolist(), empty[1].tolist()) == ([], [0])
    assert pool.alloc_many(torch.tensor([16, 32])) is None  # three pages, two available
    if hasattr(torch, "uint64"):
        assert pool.alloc_many(torch.tensor([2**63], dtype=torch.uint64)) is None  # beyond int64
    stats = pool.stats()
    refusals = 2 if hasattr(torch, "uint64") else 1
    assert stats.alloc_calls - int(before[0][L.H_ALLOC_CALLS]) == refusals + 1  # and the empty batch
    assert stats.failed_allocs - int(before[0][L.H_FAILED_ALLOCS]) == refusals
    assert stats.available_size == 32
    got = pool.alloc_many(strided)
    assert got is not None
    assert got[1].tolist() == [0, 16, 32]
    assert strided.tolist() == [16, 16]  # the caller's tensor is untouched
    pool.check_invariants()


# -- alloc_many: bad tensors -----------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "needles"),
    [
        pytest.param(torch.tensor([16.0]), ["torch.float32", ".long()"], id="float32"),
        pytest.param(torch.tensor([16.0], dtype=torch.float64), ["torch.float64", ".long()"], id="float64"),
        pytest.param(torch.tensor([16.0], dtype=torch.bfloat16), ["torch.bfloat16", ".long()"], id="bfloat16"),
        pytest.param(torch.tensor([16.0], requires_grad=True), ["torch.float32", ".long()"], id="float-grad"),
        pytest.param(torch.tensor([True, False]), ["torch.bool"], id="bool"),
        pytest.param(torch.tensor([16 + 0j]), ["torch.complex64"], id="complex"),
        pytest.param(torch.tensor([[16, 16]]), ["^sizes must be 1-D, got an array of shape \\(1, 2\\)$"], id="2d"),
        pytest.param(
            torch.zeros(2, 2, dtype=torch.int32), ["^sizes must be 1-D, got an array of shape \\(2, 2\\)$"], id="2x2"
        ),
        pytest.param(torch.tensor(16), ["^sizes must be 1-D, got an array of shape \\(\\)$"], id="0d"),
        pytest.param(torch.empty(2, dtype=torch.int64, device="meta"), ["meta device"], id="meta"),
        pytest.param(torch.tensor([16, 16]).to_sparse(), ["sizes must be a dense tensor"], id="sparse"),
        pytest.param(
            [torch.tensor(16)],
            ["^sizes\\[0\\] must be an integer, got Tensor tensor\\(16\\); pass a Python int"],
            id="list",
        ),
    ],
)
def test_alloc_many_rejects_tensors_that_are_not_1d_integers(sizes: Any, needles: list[str]) -> None:
    pool = family(LogicalHostPool)
    before = take_snapshot(pool)
    with pytest.raises(TypeError) as info:
        pool.alloc_many(sizes)
    assert type(info.value) is TypeError
    message = str(info.value)
    for needle in needles:
        if needle.startswith("^"):
            assert re.search(needle, message), message
        else:
            assert needle in message, message
    assert "astype" not in message  # torch advice, not numpy's
    assert same_state(pool, family(hostpool_nb.LogicalHostPool))
    for old, new in zip(before, take_snapshot(pool), strict=True):
        assert np.array_equal(old, new)


@pytest.mark.parametrize(
    ("sizes", "start"),
    [
        pytest.param(torch.tensor([16.0]), "sizes must hold integers, got dtype torch.float32", id="float32"),
        pytest.param(
            torch.tensor([16.0], dtype=torch.bfloat16), "sizes must hold integers, got dtype torch.bfloat16", id="bf16"
        ),
        pytest.param(torch.empty(2, dtype=torch.int64, device="meta"), "sizes must hold", id="meta"),
        pytest.param(torch.tensor([16, 16]).to_sparse(), "sizes must be a dense tensor", id="sparse"),
    ],
)
def test_alloc_many_tensor_errors_name_sizes(sizes: Any, start: str) -> None:
    pool = family(LogicalHostPool)
    with pytest.raises(TypeError) as info:
        pool.alloc_many(sizes)
    assert str(info.value).startswith(start), str(info.value)


@pytest.mark.parametrize(
    ("sizes", "error", "message"),
    [
        (
            [16, 17],
            AlignmentError,
            "LogicalHostPool allocation must be page-aligned, got sizes[1]=17, page_size=16",
        ),
        ([16, 0, -16], HostPoolError, "sizes[2] must be non-negative, got sizes[2]=-16"),
        ([-1], AlignmentError, "LogicalHostPool allocation must be page-aligned, got sizes[0]=-1, page_size=16"),
    ],
    ids=["misaligned", "negative", "minus-one"],
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8], ids=str)
def test_alloc_many_bad_tensor_sizes_have_the_cores_texts(
    sizes: list[int], error: type, message: str, dtype: Any
) -> None:
    pool = family(LogicalHostPool)
    with pytest.raises(error) as info:
        pool.alloc_many(torch.tensor(sizes, dtype=dtype))
    assert type(info.value) is error
    assert str(info.value) == message
    assert same_state(pool, family(hostpool_nb.LogicalHostPool))


# -- groups, snapshots, stats, merge order on the adapter ------------------------------


def test_free_groups_on_tensors() -> None:
    pool = LogicalHostPool(64, 16)
    held = pool.alloc(64)

    def failing_body() -> None:
        with pool.free_group():
            assert pool.free(held[32:48]) == 16
            assert pool.free(held[:16].to(torch.int32)) == 16
            assert pool.available_size() == 0
            assert pool.alloc(16) is None
            raise KeyError("the body fails")

    with pytest.raises(KeyError, match="the body fails"):
        failing_body()
    got = pool.alloc(32)
    assert type(got) is torch.Tensor
    assert got.tolist() == pg(2, 16) + pg(0, 16)  # in the order freed
    with pytest.raises(HostPoolError, match=r"^free_group_end\(\) without a free group"):
        pool.free_group_end()
    pool.check_invariants()


def test_backup_and_restore_across_the_adapter_and_the_core() -> None:
    pool = family(LogicalHostPool)
    core = family(hostpool_nb.LogicalHostPool)
    state = pool.backup_state()
    assert type(state) is PoolState
    assert PoolState is hostpool_nb.PoolState
    assert pool.alloc(32) is not None
    pool.restore_state(state)
    assert same_state(pool, core)
    # A snapshot is the same whichever class took it: each restores the other's.
    core.restore_state(state)
    pool.restore_state(core.backup_state())
    assert same_state(pool, core)
    with pytest.raises(HostPoolError, match=r"^the state is from a pool with size=96, page_size=16, merge='fifo'; "):
        LogicalHostPool(64, 16).restore_state(state)
    with pytest.raises(TypeError, match=r"^state must be a PoolState from backup_state\(\), got Tensor$"):
        pool.restore_state(torch.from_numpy(state._words.copy()))
    ours = run_ops(pool, 3, [0, 1, 3, 4])
    assert ours == run_ops(core, 3, [0, 1, 3, 4])  # the same answers, the repr included
    assert min(summary(ours).values()) > 0


def test_stats_and_repr_match_the_core() -> None:
    pool, core = family(LogicalHostPool), family(hostpool_nb.LogicalHostPool)
    for p in (pool, core):
        with p.free_group():
            p.free(pg(4, 16))
            assert p.alloc_many([32, 16]) is None
    stats = pool.stats()
    assert type(stats) is PoolStats
    assert PoolStats is hostpool_nb.PoolStats
    assert stats == core.stats()
    assert dataclasses.asdict(stats) == {
        "size": 96,
        "page_size": 16,
        "num_pages": 6,
        "free_pages": 1,
        "released_pages": 2,
        "pending_pages": 0,
        "allocated_pages": 3,
        "available_size": 48,
        "merges": 0,
        "alloc_calls": 2,
        "failed_allocs": 1,
        "free_calls": 2,
        "peak_allocated_pages": 5,
    }
    assert (
        repr(pool)
        == repr(core)
        == (
            "LogicalHostPool(size=96, page_size=16, merge='fifo': 3/6 pages allocated (50.0%), "
            "available=48, pending_pages=0)"
        )
    )


def test_merge_order_on_the_adapter() -> None:
    with pytest.raises(HostPoolError, match=r"^merge must be 'fifo' or 'sorted', got merge='lifo'$"):
        LogicalHostPool(64, 16, merge="lifo")
    pool = LogicalHostPool(64, 16, merge="sorted")
    held = pool.alloc(64)
    pool.free(held[48:])
    pool.free(held[16:32])
    assert pool.merge() == 32
    got = pool.alloc(32)
    assert got.tolist() == pg(1, 16) + pg(3, 16)
    assert "merge='sorted'" in repr(pool)


# -- pickle and copies -----------------------------------------------------------------


@pytest.mark.parametrize(
    "make_copy",
    [
        pytest.param(copy.deepcopy, id="deepcopy"),
        pytest.param(copy.copy, id="copy"),
        pytest.param(lambda p: pickle.loads(pickle.dumps(p)), id="pickle"),
    ],
)
@pytest.mark.parametrize("merge", ["fifo", "sorted"])
def test_copies_of_the_adapter_are_adapters(make_copy: Any, merge: str) -> None:
    pool = family(LogicalHostPool, merge=merge)
    pool.free_group_begin()
    pool.free(torch.tensor(pg(4, 16)))
    clone = make_copy(pool)
    assert type(clone) is hpt.LogicalHostPool
    assert clone.dtype is torch.uint8
    assert clone.lock is not pool.lock
    assert not np.shares_memory(clone._st, pool._st)
    assert clone.merge_order == merge
    assert clone.stats() == pool.stats()
    got = clone.alloc(16)
    assert type(got) is torch.Tensor
    assert got.tolist() == pg(5, 16)
    assert clone.alloc_many([16])[0].tolist() == pg(2, 16)
    assert pool.available_size() == 32  # the original did not move
    # From here on, both answer alike.
    twin = make_copy(pool)
    ours = run_ops(twin, 11, [0, 1, 3])
    assert ours == run_ops(pool, 11, [0, 1, 3])
    assert min(summary(ours).values()) > 0
    assert isinstance(pool.get_dummy_flat_data_page(), torch.Tensor)
    assert isinstance(twin.get_dummy_flat_data_page(), torch.Tensor)


def test_pickled_pool_state_from_the_adapter() -> None:
    pool = family(LogicalHostPool)
    state = pickle.loads(pickle.dumps(pool.backup_state()))
    assert type(state) is PoolState
    fresh = LogicalHostPool(96, 16)
    fresh.restore_state(state)
    assert same_state(fresh, pool)
    assert fresh.alloc(32).tolist() == pages_of(5, 2, ps=16)
