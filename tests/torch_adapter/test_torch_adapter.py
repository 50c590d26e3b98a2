"""hostpool_nb.torch: types, zero-copy boundaries, input forms and errors.

The adapter must convert at the boundary and nothing else, so most tests run
the same calls on the torch pool and on the core pool (fed plain int64 numpy
arrays) and require identical results and identical states. Zero-copy is
checked by spying on the core's methods: the array the core returns is the
memory of the tensor the adapter returns, and the array the core is given
is the memory of the tensor the caller passed.

The non-CPU path of ``free`` (one ``.to("cpu")``) cannot be tested here:
this machine has no GPU.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hostpool_nb  # noqa: E402
import hostpool_nb.torch as hpt  # noqa: E402
from hostpool_nb.torch import (  # noqa: E402
    AlignmentError,
    DoubleFreeError,
    HostPoolError,
    LogicalHostPool,
    PartialPageError,
    SlotRangeError,
)
from tests.conftest import Snapshot, assert_refused, take_snapshot  # noqa: E402
from tests.torch_adapter.test_torch_missing import run_child  # noqa: E402

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parents[2]

# Every integer dtype torch has that numpy can view; the unsigned 16/32/64
# bit ones exist in recent torch only.
INT_DTYPES = [
    getattr(torch, name)
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
    if hasattr(torch, name)
]


# -- helpers -------------------------------------------------------------


def state(pool: Any) -> Snapshot:
    """Copies of what determines a pool's logical state (conftest's snapshot)."""
    return take_snapshot(pool)


def assert_same_state(a: Any, b: Any) -> None:
    """Two pools (or a pool and a saved state) are in the same logical state."""
    sa = state(a) if not isinstance(a, tuple) else a
    sb = state(b) if not isinstance(b, tuple) else b
    for x, y in zip(sa, sb, strict=True):
        assert np.array_equal(x, y), f"{x} != {y}"


def page_slots(pages: list[int], page_size: int) -> np.ndarray:
    """The slot ids of ``pages``, each page ascending, pages in the given order."""
    pages_arr = np.asarray(pages, dtype=np.int64).reshape(-1, 1)
    return (pages_arr * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)


def pool_arrays(pool: Any) -> list[np.ndarray]:
    """Every numpy array the pool holds as an attribute (its whole state)."""
    arrays = [v for v in vars(pool).values() if isinstance(v, np.ndarray)]
    assert arrays, "expected the pool to keep its state in numpy arrays"
    return arrays


def assert_not_pool_memory(pool: Any, tensor: Any) -> None:
    """``tensor`` overlaps none of the pool's arrays, by address range too."""
    view = tensor.numpy()
    lo, hi = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    for arr in pool_arrays(pool):
        assert not np.shares_memory(view, arr)
        a_lo = arr.__array_interface__["data"][0]
        a_hi = a_lo + arr.nbytes
        assert hi <= a_lo or a_hi <= lo or tensor.numel() == 0


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240613)


# -- import behaviour ----------------------------------------------------


def test_import_core_does_not_import_torch_even_when_installed() -> None:
    code = (
        "import json, sys, hostpool_nb\n"
        "p = hostpool_nb.LogicalHostPool(32, 16); p.free(p.alloc(16))\n"
        "print(json.dumps({'torch': 'torch' in sys.modules}))\n"
    )
    assert run_child(code) == {"torch": False}


def test_reexports() -> None:
    for name in hpt.__all__:
        assert getattr(hpt, name) is not None
    assert set(hpt.__all__) == {
        "AlignmentError",
        "DoubleFreeError",
        "HostPoolError",
        "LogicalHostPool",
        "PartialPageError",
        "PoolState",
        "PoolStats",
        "SlotRangeError",
    }
    # The very same classes as the core's: `except hostpool_nb.X` catches both.
    for name in hpt.__all__:
        if name != "LogicalHostPool":
            assert getattr(hpt, name) is getattr(hostpool_nb, name)
    assert issubclass(LogicalHostPool, hostpool_nb.LogicalHostPool)
    assert issubclass(DoubleFreeError, ValueError)


# -- types ---------------------------------------------------------------


def test_attributes_and_data_plane_hooks() -> None:
    pool = LogicalHostPool(64, 16, layout="page_first")
    assert pool.dtype is torch.uint8
    assert (pool.size, pool.logical_size, pool.page_size, pool.layout) == (64, 64, 16, "page_first")
    assert pool.device == "cpu"
    for page in (pool.get_data_page(0), pool.get_data_page(3, flat=False), pool.get_dummy_flat_data_page()):
        assert isinstance(page, torch.Tensor)
        assert page.dtype is torch.uint8
        assert page.numel() == 0
        assert page.device.type == "cpu"
    # Each call returns a new tensor: a caller resizing one affects no other.
    assert pool.get_dummy_flat_data_page() is not pool.get_dummy_flat_data_page()
    assert pool.get_ksize_per_token() == 0
    assert pool.get_page_buffer_meta(torch.arange(16)) is None
    assert pool.destroy() is None
    # A later sglang's HostPoolGroup reads these too.
    assert (pool.shared_allocation_domain, pool.stores_page_envelope, pool.storage_format_tag) == (None, False, None)
    host, device = torch.arange(16), torch.arange(16, 32)
    pair = pool.prepare_transfer_indices(host, device, "kernel")
    assert pair[0] is host
    assert pair[1] is device
    assert pool.backup_from_device_all_layer_physical(object(), host, device, "kernel") is None
    assert pool.load_to_device_per_layer_physical(object(), host, device, 0, "direct", is_draft=True) is None
    assert pool.get_page_buffer_element_size(split_factor=2) is None


@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_returns_cpu_int64_tensors_like_the_core(page_size: int) -> None:
    size = 8 * page_size
    pool, core = LogicalHostPool(size, page_size), hostpool_nb.LogicalHostPool(size, page_size)
    for need in (0, 2 * page_size, 3 * page_size, 3 * page_size, 0):
        got, want = pool.alloc(need), core.alloc(need)
        if want is None:
            assert got is None
            continue
        assert type(got) is torch.Tensor
        assert got.dtype is torch.int64
        assert got.device.type == "cpu"
        assert got.dim() == 1
        assert got.is_contiguous()
        assert np.array_equal(got.numpy(), want)
        assert pool.available_size() == core.available_size()
    assert_same_state(pool, core)


def test_alloc_returns_none_when_short() -> None:
    pool = LogicalHostPool(64, 16)
    held = pool.alloc(48)
    before = state(pool)
    assert pool.alloc(32) is None
    assert_refused(pool, before)
    assert pool.free(held) == 48
    assert pool.alloc(64) is not None


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_alloc_takes_a_0d_integer_tensor(dtype: Any) -> None:
    pool, core = LogicalHostPool(128, 16), hostpool_nb.LogicalHostPool(128, 16)
    got = pool.alloc(torch.tensor(32, dtype=dtype))
    assert np.array_equal(got.numpy(), core.alloc(32))
    with pytest.raises(AlignmentError, match="need_size=8"):
        pool.alloc(torch.tensor(8, dtype=dtype))
    assert_same_state(pool, core)


@pytest.mark.parametrize(
    "bad",
    [torch.tensor(True), torch.tensor(16.0), torch.tensor([16]), torch.tensor([[16]]), torch.tensor([16, 16])],
    ids=["bool", "float", "1-d", "2-d", "two"],
)
def test_alloc_rejects_tensors_that_are_not_0d_integers(bad: Any) -> None:
    pool = LogicalHostPool(64, 16)
    held = pool.alloc(16)
    before = state(pool)
    with pytest.raises(TypeError, match="need_size"):
        pool.alloc(bad)
    assert_same_state(pool, before)
    assert pool.free(held) == 16


def test_alloc_reads_uint64_counts_beyond_int64_exactly() -> None:
    """torch's ``__index__`` raises its RuntimeError for these; the adapter reads the value."""
    if not hasattr(torch, "uint64"):
        pytest.skip("this torch has no uint64")
    pool = LogicalHostPool(64, 16)
    before = state(pool)
    with pytest.raises(AlignmentError, match=f"need_size={2**64 - 1}, page_size=16"):
        pool.alloc(torch.tensor(2**64 - 1, dtype=torch.uint64))
    assert pool.alloc(torch.tensor(2**64 - 16, dtype=torch.uint64)) is None  # aligned, too large
    assert_refused(pool, before)
    ones = LogicalHostPool(64, 1)
    assert ones.alloc(torch.tensor(2**64 - 1, dtype=torch.uint64)) is None


def test_alloc_and_free_of_meta_tensors_are_type_errors() -> None:
    pool = LogicalHostPool(64, 16)
    held = pool.alloc(16)
    before = state(pool)
    with pytest.raises(TypeError, match=r"need_size.*meta device"):
        pool.alloc(torch.empty((), dtype=torch.int64, device="meta"))
    with pytest.raises(TypeError, match=r"indices.*meta device"):
        pool.free(torch.empty(16, dtype=torch.int64, device="meta"))
    assert_same_state(pool, before)
    assert pool.free(held) == 16


@pytest.mark.parametrize(
    "bad",
    [torch.tensor(True), torch.tensor([[16]]), torch.tensor(16), torch.empty(16, dtype=torch.int64, device="meta")],
    ids=["bool", "2-d", "0-d", "meta"],
)
def test_core_pool_refuses_tensor_counts_and_meta_indices(bad: Any) -> None:
    """The core treats every array as an array: no count through ``__index__``."""
    pool = hostpool_nb.LogicalHostPool(64, 16)
    held = pool.alloc(16)
    before = state(pool)
    with pytest.raises(TypeError, match="need_size"):
        pool.alloc(bad)
    if bad.ndim == 1:
        with pytest.raises(TypeError, match="indices"):
            pool.free(bad)
    assert_same_state(pool, before)
    assert pool.free(held) == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.bool, torch.complex64], ids=str)
def test_non_integer_tensors_get_torch_advice(dtype: Any) -> None:
    pool = LogicalHostPool(64, 16)
    held = pool.alloc(16)
    with pytest.raises(TypeError) as info:
        pool.free(held.to(dtype))
    message = str(info.value)
    assert str(dtype) in message
    assert ".long()" in message
    assert "astype" not in message
    assert pool.free(held) == 16


def test_alloc_keeps_core_checks() -> None:
    pool = LogicalHostPool(64, 16)
    before = state(pool)
    with pytest.raises(HostPoolError, match="-16"):
        pool.alloc(-16)
    with pytest.raises(TypeError, match="need_size"):
        pool.alloc(16.0)
    with pytest.raises(AlignmentError, match="page-aligned"):
        pool.alloc(torch.tensor(-8))
    assert_same_state(pool, before)


# -- zero copy and ownership --------------------------------------------


def test_alloc_wraps_the_cores_array_without_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[np.ndarray] = []
    core_alloc = hostpool_nb.LogicalHostPool.alloc

    def spy(self: Any, need_size: Any, *, tag: Any = None) -> Any:
        out = core_alloc(self, need_size, tag=tag)
        seen.append(out)
        return out

    monkeypatch.setattr(hostpool_nb.LogicalHostPool, "alloc", spy)
    pool = LogicalHostPool(256, 16)
    got = pool.alloc(64)
    assert len(seen) == 1
    assert got.data_ptr() == seen[0].__array_interface__["data"][0]
    assert np.shares_memory(got.numpy(), seen[0])
    seen[0][5] = -7  # one buffer: a write through the array shows in the tensor
    assert int(got[5]) == -7


def test_free_views_a_cpu_tensor_without_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    core_free = hostpool_nb.LogicalHostPool.free

    def spy(self: Any, indices: Any) -> int:
        seen.append(indices)
        return core_free(self, indices)

    monkeypatch.setattr(hostpool_nb.LogicalHostPool, "free", spy)
    pool = LogicalHostPool(256, 16)
    for dtype in (torch.int64, torch.int32, torch.uint8):
        slots = pool.alloc(64).to(dtype)
        assert pool.free(slots) == 64
        arr = seen[-1]
        assert type(arr) is np.ndarray
        assert arr.__array_interface__["data"][0] == slots.data_ptr()
        assert arr.dtype == slots.numpy().dtype
    pool.check_invariants()


@pytest.mark.parametrize("page_size", [1, 16])
def test_returned_tensors_are_never_written_by_the_pool(page_size: int, rng: np.random.Generator) -> None:
    size = 16 * page_size
    pool = LogicalHostPool(size, page_size)
    kept: list[tuple[Any, Any]] = []  # (returned tensor, clone at return time)
    held: list[Any] = []
    for _ in range(300):
        op = rng.integers(0, 10)
        if op < 5:
            got = pool.alloc(int(rng.integers(0, 5)) * page_size)
            if got is not None:
                assert_not_pool_memory(pool, got)
                kept.append((got, got.clone()))
                held.append(got)
        elif op < 9 and held:
            victim = held.pop(int(rng.integers(0, len(held))))
            pool.free(victim)  # the caller's tensor, as returned
        elif op == 9:
            pool.clear()
            held.clear()
        pool.check_invariants()
    assert len(kept) > 50
    for tensor, clone in kept:
        assert torch.equal(tensor, clone)
    # The pool's state arrays still overlap none of them.
    for tensor, _ in kept[-20:]:
        assert_not_pool_memory(pool, tensor)


def test_pool_keeps_nothing_of_freed_inputs() -> None:
    """Overwriting a tensor after freeing it changes nothing in the pool."""
    pool, core = LogicalHostPool(128, 16), hostpool_nb.LogicalHostPool(128, 16)
    a, b = pool.alloc(64), core.alloc(64)
    as_i32 = a.flip(0).view(-1, 16).flip(1).reshape(-1).to(torch.int32)  # pages in reverse
    assert pool.free(a) == 64
    assert core.free(b) == 64
    a.fill_(-1)  # the caller reuses its buffers
    a2, b2 = pool.alloc(128), core.alloc(128)
    assert np.array_equal(a2.numpy(), b2)
    assert pool.free(as_i32[:32]) == 32
    assert core.free(as_i32[:32].numpy().astype(np.int64)) == 32
    as_i32.zero_()
    assert_same_state(pool, core)
    assert np.array_equal(pool.alloc(32).numpy(), core.alloc(32))


# -- input forms ---------------------------------------------------------


def value_fits(dtype: Any, top: int) -> bool:
    return torch.iinfo(dtype).max >= top


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
def test_free_any_integer_dtype(dtype: Any, page_size: int, rng: np.random.Generator) -> None:
    size = 128  # every slot id fits int8 and uint8
    assert value_fits(dtype, size - 1)
    pool, core = LogicalHostPool(size, page_size), hostpool_nb.LogicalHostPool(size, page_size)
    assert np.array_equal(pool.alloc(size).numpy(), core.alloc(size))
    pages = list(rng.permutation(size // page_size))
    slots = page_slots(pages, page_size)
    for chunk in np.array_split(slots.reshape(-1, page_size), 3):
        flat = chunk.reshape(-1)
        tensor = torch.from_numpy(flat.copy()).to(dtype)
        assert tensor.dtype is dtype
        assert pool.free(tensor) == flat.size
        assert core.free(flat) == flat.size
        assert pool.available_size() == core.available_size()
        pool.check_invariants()
    assert_same_state(pool, core)
    # FIFO: the next allocation hands the pages back in the order freed.
    again = pool.alloc(size)
    assert np.array_equal(again.numpy(), slots)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_free_multidimensional_tensors_flatten_in_c_order(page_size: int) -> None:
    size = 12 * page_size
    pool, core = LogicalHostPool(size, page_size), hostpool_nb.LogicalHostPool(size, page_size)
    a, b = pool.alloc(size), core.alloc(size)
    assert np.array_equal(a.numpy(), b)
    rows = a.view(-1, page_size)  # (pages, page_size): pages are rows
    assert pool.free(rows[[5, 2]]) == 2 * page_size  # 2-D, gathered rows
    assert pool.free(rows[6:10].reshape(2, 2, page_size)) == 4 * page_size  # 3-D
    for pages in ([5, 2], [6, 7, 8, 9]):
        core.free(page_slots(pages, page_size))
    assert_same_state(pool, core)
    assert np.array_equal(pool.alloc(6 * page_size).numpy(), core.alloc(6 * page_size))


def test_free_two_rows_of_a_page_is_two_pages() -> None:
    """indices of shape (2, 16) are 32 slots, two pages (not 2 rows)."""
    pool = LogicalHostPool(64, 16)
    got = pool.alloc(32)
    assert pool.free(got.view(2, 16)) == 32
    assert pool.available_size() == 64
    pool.check_invariants()


@pytest.mark.parametrize("page_size", [1, 16])
def test_free_non_contiguous_tensors(page_size: int) -> None:
    size = 8 * page_size
    pool, core = LogicalHostPool(size, page_size), hostpool_nb.LogicalHostPool(size, page_size)
    a = pool.alloc(size)
    core.alloc(size)  # the core pool mirrors the adapter's state
    # Fortran-ordered (pages, page_size): values in C order are pages 0, 1.
    fortran = a[: 2 * page_size].view(-1, page_size).T.contiguous().T
    # Every other element of a larger buffer: pages 2, 3 as int32.
    big = torch.full((4 * page_size,), -5, dtype=torch.int32)
    big[::2] = a[2 * page_size : 4 * page_size].to(torch.int32)
    strided = big[::2]
    # A column slice: pages 5 and 4 (in that order).
    grid = torch.stack([a[5 * page_size : 6 * page_size], a[4 * page_size : 5 * page_size]])
    cols = torch.cat([grid, torch.zeros_like(grid)], dim=1)[:, :page_size]
    for t in (fortran, strided, cols):
        if page_size > 1:
            assert not t.is_contiguous()
    assert pool.free(fortran) == 2 * page_size
    assert pool.free(strided) == 2 * page_size
    assert pool.free(cols) == 2 * page_size
    for pages in ([0, 1], [2, 3], [5, 4]):
        core.free(page_slots(pages, page_size))
    assert_same_state(pool, core)
    assert np.array_equal(pool.alloc(size - 2 * page_size).numpy(), core.alloc(size - 2 * page_size))


def test_free_expanded_tensor_is_rejected_unchanged() -> None:
    pool = LogicalHostPool(64, 1)
    got = pool.alloc(4)
    before = state(pool)
    with pytest.raises(DoubleFreeError, match="twice"):
        pool.free(got[:1].expand(4))  # stride 0: slot 0 four times
    assert_same_state(pool, before)
    pool16 = LogicalHostPool(64, 16)
    got16 = pool16.alloc(16)
    before16 = state(pool16)
    with pytest.raises(PartialPageError):
        pool16.free(got16[:1].expand(16))
    assert_same_state(pool16, before16)


def test_free_accepts_numpy_lists_and_subclasses() -> None:
    pool = LogicalHostPool(96, 16)
    a = pool.alloc(96)
    assert pool.free(a[:16].tolist()) == 16
    assert pool.free(a[16:32].numpy().astype(np.uint16)) == 16
    assert pool.free(torch.nn.Parameter(a[32:48].clone(), requires_grad=False)) == 16
    assert pool.free(a[48:48]) == 0  # empty tensor: nothing changes
    assert pool.free([]) == 0
    assert pool.available_size() == 48
    pool.check_invariants()


# -- errors --------------------------------------------------------------


def _nested(t: Any, layout: Any) -> Any:
    """``t``'s two halves as a nested tensor (a prototype feature: torch warns on making one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([t[: t.shape[0] // 2], t[t.shape[0] // 2 :]], layout=layout)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.float(),
        lambda t: t.double().requires_grad_(),  # .numpy() alone would raise RuntimeError
        lambda t: t.bool(),
        lambda t: t.half(),
        lambda t: t.bfloat16(),  # a dtype numpy lacks
        lambda t: t.to(torch.complex64),
        lambda t: t.to(torch.complex64).conj(),  # a conjugate view
        lambda t: t[0],  # 0-d: a scalar
        lambda t: t.to_sparse(),
        lambda t: _nested(t, torch.strided),  # .numpy() raises torch's RuntimeError
        lambda t: _nested(t, torch.jagged),
    ],
    ids=[
        "float32",
        "float64-grad",
        "bool",
        "float16",
        "bfloat16",
        "complex",
        "conj",
        "0-d",
        "sparse",
        "nested",
        "nested-jagged",
    ],
)
def test_free_wrong_kind_of_tensor_is_a_type_error(make: Any) -> None:
    pool = LogicalHostPool(64, 16)
    held = pool.alloc(32)
    before = state(pool)
    with pytest.raises(TypeError, match="indices"):
        pool.free(make(held))
    assert_same_state(pool, before)
    assert pool.free(held) == 32  # still held: nothing was freed


def test_double_free_and_other_core_errors_through_tensors() -> None:
    pool = LogicalHostPool(64, 16)
    a = pool.alloc(32)
    assert pool.free(a[16:]) == 16
    before = state(pool)
    cases = [
        (a[16:], DoubleFreeError, "not allocated"),  # freed already
        (torch.cat([a[:16], a[:16]]), DoubleFreeError, "twice"),  # twice in one call
        (a[:8], AlignmentError, "len\\(indices\\)=8"),
        (a[:16].view(2, 8).flip(1), PartialPageError, "whole pages"),
        (a[:16] + 64, SlotRangeError, "outside"),
        (a[:16] - 100, SlotRangeError, "outside"),
        (torch.arange(48, 64), DoubleFreeError, "not allocated"),  # never allocated
    ]
    if hasattr(torch, "uint64"):
        huge = torch.full((16,), 2**63, dtype=torch.uint64)
        cases.append((huge, SlotRangeError, "int64"))
    for bad, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            pool.free(bad)
        assert_same_state(pool, before)
    assert isinstance(DoubleFreeError("x"), ValueError)
    pool.clear()
    with pytest.raises(DoubleFreeError):
        pool.free(a[:16])  # freed by clear()
    assert pool.available_size() == 64
