"""States and pickles written before the lists were runs still load, converted, and behave as they did.

``tests/data/format3.pickle`` was written by hostpool_nb at 8ab7b25 (core
format 3, paged format 1: one page id per ring entry) by
``tests/data/make_format3.py``, with what the next calls returned there.
Loading converts each entry into a run of one page.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hostpool_nb import HostPagePool, HostPoolError, LogicalHostPool
from hostpool_nb._diagnostics.snapshot import CONVERTS, FORMATS, READS
from hostpool_nb._kernels import layout as L
from hostpool_nb.paged import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

if not hasattr(np, "_core"):  # numpy 1 reads numpy 2's pickles (which name numpy._core) through numpy.core
    sys.modules.setdefault("numpy._core", np.core)
    sys.modules.setdefault("numpy._core.multiarray", np.core.multiarray)

_DATA = pickle.loads((Path(__file__).parents[1] / "data" / "format3.pickle").read_bytes())
BLOBS: dict[str, bytes] = _DATA["blobs"]
EXPECTED: dict[str, Any] = _DATA["expected"]


def _calls(pool: LogicalHostPool) -> list[Any]:
    out = []
    for n in (3, 5, 2):
        a = pool.alloc(n * pool.page_size)
        out.append(None if a is None else a.tolist())
    return out


def test_the_fixture_is_in_the_formats_this_version_converts() -> None:
    assert CONVERTS == {"LogicalHostPool": 3, "PoolState": 3, "PagedAllocator": 1, "PagedState": 1}
    assert FORMATS["LogicalHostPool"] == 4
    assert FORMATS["PagedAllocator"] == FORMATS["PagedState"] == 3
    assert READS == {"PagedAllocator": 2, "PagedState": 2}  # today's words, without site tables


def test_a_format_3_pool_pickle_loads_converted_and_allocates_as_it_did() -> None:
    pool = pickle.loads(BLOBS["pool"])
    pool.check_invariants()
    st = pool._st
    # Converted: one entry per page, the lists and pending group as they were.
    assert [int(st[h]) for h in (L.H_EFREE, L.H_EREL, L.H_EPEND)] == [
        int(st[h]) for h in (L.H_NFREE, L.H_NREL, L.H_NPEND)
    ]
    assert int(st[L.H_NPEND]) == 1
    assert _calls(pool) == EXPECTED["pool"]
    pool.free_group_end()
    pool.check_invariants()


def test_a_format_3_pool_state_restores_converted() -> None:
    state = pickle.loads(BLOBS["state"])
    pool = LogicalHostPool(12 * 4, 4)
    pool.restore_state(state)
    pool.check_invariants()
    assert _calls(pool) == EXPECTED["pool"]
    again = pickle.loads(pickle.dumps(pool.backup_state()))  # and pickles in today's format
    assert again.__reduce__()[1][0] == FORMATS["PoolState"]


@pytest.mark.parametrize("blob", ["paged", "paged_state"])
def test_a_format_1_paged_pickle_loads_converted_and_allocates_as_it_did(blob: str) -> None:
    loaded = pickle.loads(BLOBS[blob])
    if blob == "paged":
        alloc = loaded
    else:
        alloc = PagedTokenToKVPoolAllocator(16 * 4, 4, None)
        alloc.restore_state(loaded)
    alloc.check_invariants()
    first = alloc.alloc(12).tolist()
    assert alloc.alloc(0) is not None
    assert [first, alloc.alloc(40).tolist()] == EXPECTED["paged"]
    alloc.check_invariants()


@pytest.mark.parametrize(
    ("version", "by"),
    [
        (2, "hostpool_nb before its ring held int32 page ids"),
        (5, "a newer hostpool_nb"),
        (0, "no hostpool_nb this one knows"),
        ("3", "no hostpool_nb"),
    ],
)
def test_a_pool_pickle_of_a_format_neither_read_nor_converted_says_what_wrote_it(version: Any, by: str) -> None:
    pool = LogicalHostPool(16, 4)
    saved = pool.__getstate__()
    saved["format"] = version
    fresh = LogicalHostPool.__new__(LogicalHostPool)
    with pytest.raises(HostPoolError) as info:
        fresh.__setstate__(saved)
    assert str(info.value) == (
        f"this LogicalHostPool was pickled in state format {version!r}, written by {by}; this hostpool_nb reads "
        "format 4 and converts format 3 (pickle it again with the same hostpool_nb version that loads it)"
    )


@pytest.mark.parametrize("kind", ["paged", "token"])
def test_a_format_2_allocator_pickle_loads_untracked_and_goes_on_as_it_would_have(kind: str) -> None:
    # Format 2 is what hostpool_nb wrote before allocators could track: the
    # same fields without "sites", and no "track" among the arguments.
    a = PagedTokenToKVPoolAllocator(16 * 4, 4, None) if kind == "paged" else TokenToKVPoolAllocator(16, None)
    a.alloc(8)
    a.free_group_begin()
    a.free([4] if kind == "paged" else [1])
    saved = a.__getstate__()
    assert saved["format"] == 3
    del saved["sites"]
    del saved["args"]["track"]
    saved["format"] = 2
    fresh = type(a).__new__(type(a))
    fresh.__setstate__(saved)
    fresh.check_invariants()
    assert not fresh.track
    assert fresh.alloc(4).tolist() == a.alloc(4).tolist()
    fresh.free_group_end()
    a.free_group_end()
    assert fresh.available_size() == a.available_size()


def test_a_paged_pickle_of_a_newer_format_says_so() -> None:
    saved = PagedTokenToKVPoolAllocator(16 * 4, 4, None).__getstate__()
    saved["format"] = 4
    fresh = PagedTokenToKVPoolAllocator.__new__(PagedTokenToKVPoolAllocator)
    with pytest.raises(HostPoolError) as info:
        fresh.__setstate__(saved)
    assert str(info.value) == (
        "this PagedTokenToKVPoolAllocator was pickled in state format 4, written by a newer hostpool_nb; this "
        "hostpool_nb reads format 3 and 2 and converts format 1 (pickle it again with the same hostpool_nb version "
        "that loads it)"
    )


@pytest.mark.parametrize(
    ("make", "today", "before"),
    [
        (lambda: HostPagePool(8), b"chostpool_nb\nHostPagePool\n", b"chostpool_nb._host\nHostPagePool\n"),
        (lambda: LogicalHostPool(16, 4), b"chostpool_nb\nLogicalHostPool\n", b"chostpool_nb._pool\nLogicalHostPool\n"),
        (
            lambda: LogicalHostPool(16, 4).backup_state(),
            b"chostpool_nb._diagnostics.snapshot\n",
            b"chostpool_nb._snapshot\n",
        ),
    ],
    ids=["HostPagePool", "LogicalHostPool", "PoolState"],
)
def test_a_pickle_naming_a_module_path_from_before_the_packages_loads(make: Any, today: bytes, before: bytes) -> None:
    """Pickles written before the modules moved into packages name hostpool_nb._host, ._pool and ._snapshot."""
    made = make()
    if hasattr(made, "alloc"):
        made.alloc(4)
    written = pickle.dumps(made, protocol=0)
    assert today in written  # what this version writes: the path a user's old file has in its place
    loaded = pickle.loads(written.replace(today, before))
    assert type(loaded) is type(made)
    assert pickle.dumps(loaded, protocol=0) == written
