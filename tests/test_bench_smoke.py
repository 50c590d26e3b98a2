"""The benchmark machinery on tiny sizes: same workload everywhere, sane output.

No timing is asserted (speed is never a test); these check that what the
benchmark compares is comparable - the trace replays to identical slot
sequences on hostpool_nb and on the baselines, the batch workload refuses
implementations that hand out other slots or merge unequally, the counted baselines behave
exactly as the shared ones, the memory accounting agrees with tracemalloc, the
tracking workload measures pools that track, a recorded trace (``--trace``) replays
to the recorded slots everywhere or stops naming the call that diverged - and that
the JSON, table, plot, progress bar and command line behave. Fast, and passes
under ``NUMBA_DISABLE_JIT=1``.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bench.baselines import NumpyHostPool

from bench import report
from bench.cli import TABLE_WIDTH
from bench.impls import (
    HOSTPOOL,
    NUMPY,
    TORCH,
    NumpyBaseline,
    implementations,
    merges_of,
)
from bench.memory import measure_memory
from bench.paged_workloads import (
    PAGED_WORKLOAD,
    PagedDivergence,
    measure_paged,
    paged_cases,
    paged_implementations,
)
from bench.recorded import (
    ALLOC,
    CLEAR,
    FREE,
    RecordedTraceError,
    ReplayDivergence,
    baseline_plan,
    hostpool_plan,
)
from bench.recorded import read as read_trace
from bench.suite import (
    BATCH_TARGET,
    BATCH_TARGET_REQUESTS,
    BIG_K,
    BIG_K_TARGET,
    HEADLINE_TARGET,
    METADATA_TARGET,
    PAGED_DECODE_TARGET,
    PAGED_EXTEND_TARGET,
    PAGED_FREE_TARGET,
    PAGED_MERGE_TARGET,
    ROUNDTRIP_TARGET,
    STARTUP_PARAMS,
    STARTUP_TARGET,
    TRACE_P1_TARGET,
    TRACE_TARGET,
    TRACKING_SITES_PARAMS,
    TRACKING_TARGET,
    _steps,
    batch_params,
    batch_target,
    floor_params,
    full_config,
    memory_params,
    paged_params,
    paged_target,
    quick_config,
    recorded_params,
    roundtrip_params,
    roundtrip_target,
    run_suite,
    shuffled_params,
    tiny_config,
    trace_params,
    trace_target,
    tracking_params,
    tracking_state_params,
    tracking_target,
)
from bench.timing import Progress, interleaved, median
from bench.tracking import NEW_TAGS, TRACKED, UNTRACKED, VARIANTS
from bench.workloads import (
    HOSTPOOL_LIST,
    MIB_SLOTS,
    BatchDivergence,
    TraceDivergence,
    TraceFloor,
    _touch_kernels,
    make_trace,
    measure_batch,
    measure_roundtrip,
    replay,
    shuffle_free_list,
)
from hostpool_nb import AlignmentError, DoubleFreeError, LogicalHostPool
from hostpool_nb import _layout as L
from hostpool_nb import trace as hp_trace
from hostpool_nb.originals.paged import PagedTokenToKVPoolAllocator as PagedOracle
from hostpool_nb.paged import PagedTokenToKVPoolAllocator as PagedHostPool
from tests.conftest import JIT_DISABLED

POOL, PAGE = 4096, 16
ROOT = Path(__file__).resolve().parent.parent
BATCH = "batch round trip"
RECORDED = "recorded trace"


@pytest.fixture(scope="module")
def trace():
    t = make_trace(POOL, PAGE, n_ops=600, seed=3)
    # The trace exercises what it claims to: full-pool failures and retries.
    assert t.stats["failed_allocs"] > 0
    assert t.stats["frees"] > 0
    assert t.stats["pool_cycles"] > 1
    return t


def _replayed(make, trace):
    pool = make(trace.pool_slots, trace.page_size)
    record = []
    replay(pool, trace, record)
    return pool, [None if r is None else np.asarray(r).tolist() for r in record]


def test_trace_replays_identically_on_hostpool_and_numpy(trace) -> None:
    ours, got = _replayed(LogicalHostPool, trace)
    base, want = _replayed(NumpyBaseline, trace)
    assert got == want
    assert any(r is None for r in got)  # the failing allocs are part of the replay
    assert ours.available_size() == base.available_size()
    assert merges_of(ours) == merges_of(base) > 0
    ours.check_invariants()


@pytest.mark.torch
def test_trace_replays_identically_on_torch(trace) -> None:
    pytest.importorskip("torch")
    from bench.impls import TorchBaseline

    ours, got = _replayed(LogicalHostPool, trace)
    base, want = _replayed(TorchBaseline, trace)
    assert got == want
    assert merges_of(ours) == merges_of(base) > 0


def test_trace_floor_replays_the_trace_and_touches_every_slot(trace) -> None:
    floor, got = _replayed(TraceFloor, trace)
    base, want = _replayed(NumpyBaseline, trace)
    # None exactly where every pool answers None, arrays of the same lengths
    assert [None if r is None else len(r) for r in got] == [None if r is None else len(r) for r in want]
    assert floor.available_size() == base.available_size()
    # every slot of every returned array written (its position: a stand-in, not a page id)
    assert all(r == list(range(len(r))) for r in got if r is not None)


def test_trace_floor_reads_every_slot_it_is_given() -> None:
    write_every, read_every = _touch_kernels()
    out = np.full(100, -1, dtype=np.int64)
    assert write_every(out) == 100
    assert out.tolist() == list(range(100))
    for i in (0, 57, 99):  # a bit set at any one position shows in the result
        slots = np.zeros(100, dtype=np.int64)
        slots[i] = 1 << 40
        assert read_every(slots) == 1 << 40
    assert read_every(np.zeros(0, dtype=np.int64)) == 0


def test_replay_detects_divergence(trace) -> None:
    small = LogicalHostPool(POOL // 2, PAGE)  # too small: some alloc answers None
    with pytest.raises(TraceDivergence):
        replay(small, trace)


def test_baseline_released_count_matches_the_release_list() -> None:
    """The baselines' O(1) ``available_size`` equals SPEC's definition.

    SPEC section 1: free slots + released slots not yet merged. The
    baselines keep a running count instead of summing the release list;
    check the count against the sum through allocs, whole-page frees in
    random order (sometimes 2-D), merges and clears.
    """
    rng = random.Random(7)
    pool = NumpyHostPool(512, 16)
    held: list[np.ndarray] = []
    for step in range(400):
        op = rng.random()
        if op < 0.45:
            got = pool.alloc(16 * rng.randint(0, 12))
            if got is not None:
                held.append(got)
        elif op < 0.9 and held:
            chunk = held.pop(rng.randrange(len(held)))
            pages = list(range(len(chunk) // 16))
            rng.shuffle(pages)
            for p in pages:
                page = chunk[16 * p : 16 * p + 16]
                pool.free(page.reshape(16, 1) if rng.random() < 0.3 else page)
        elif op > 0.98:
            pool.clear()
            held.clear()
        spec = len(pool.free_slots) + sum(len(c) for c in pool.release_list)
        assert pool.available_size() == spec, step


class _CountingProgress:
    """Counts the steps a run reports, to hold ``_steps`` to them."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self, n: int = 1) -> None:
        self.steps += n

    def label(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def test_batch_rows_have_ratios_and_pay_every_merge() -> None:
    cfg = tiny_config(("batch",))
    progress = _CountingProgress()
    doc = run_suite(cfg, with_torch=False, progress=progress)
    assert progress.steps == _steps(cfg, 2) > 0
    rows = doc["rows"]
    assert [r["workload"] for r in rows] == [BATCH] * 2 * len(cfg.batch_requests)
    assert [r["params"] for r in rows] == [
        batch_params(cfg.batch_page_size, n, cfg.batch_pool_slots, as_list)
        for n in cfg.batch_requests
        for as_list in (False, True)
    ]
    for r in rows:
        assert r["unit"] == "s/batch"
        assert set(r["values"]) == {HOSTPOOL, NUMPY}
        assert all(v > 0 for v in r["values"].values())
        assert r["ratios"][NUMPY] == pytest.approx(r["values"][NUMPY] / r["values"][HOSTPOOL])
        assert set(r["paired_ratios"]) == {NUMPY}
        assert (r["target"], r["met"]) == ("", None)  # the target is on the 256-request row only
        # Each timed loop covers whole pool cycles: one merge per cycle, everywhere.
        assert r["merges_per_loop"] == {name: float(r["cycles_per_loop"]) for name in (HOSTPOOL, HOSTPOOL_LIST, NUMPY)}
    cells = doc["raw"]["batch"]
    assert [set(c["per_op"]) for c in cells] == [{HOSTPOOL, HOSTPOOL_LIST, NUMPY}] * len(cfg.batch_requests)
    for array_row, list_row, cell in zip(rows[::2], rows[1::2], cells, strict=True):
        assert (array_row["sizes"], list_row["sizes"]) == ("int64 array", "list")
        assert array_row["values"] == {HOSTPOOL: cell["per_op"][HOSTPOOL], NUMPY: cell["per_op"][NUMPY]}
        # One baseline measurement, two rows: the list row is hostpool_nb's other pool against it.
        assert list_row["values"] == {HOSTPOOL: cell["per_op"][HOSTPOOL_LIST], NUMPY: cell["per_op"][NUMPY]}
    assert any(note.startswith(f"batch round trip p{cfg.batch_page_size}:") for note in doc["notes"])
    table = report.render_table(rows, torch_present=False).splitlines()
    assert sum(line.startswith(BATCH) for line in table) == len(rows)
    assert all(len(line) <= TABLE_WIDTH for line in table)


def test_batch_target_is_on_the_256_request_array_row() -> None:
    assert batch_target(BATCH_TARGET_REQUESTS, False, {NUMPY: 1.0, TORCH: 50.0}) == (BATCH_TARGET, True)
    assert batch_target(BATCH_TARGET_REQUESTS, False, {NUMPY: 99.0, TORCH: 49.9}) == (BATCH_TARGET, False)
    assert batch_target(BATCH_TARGET_REQUESTS, False, {NUMPY: 99.0}) == (BATCH_TARGET, None)  # no torch
    assert batch_target(BATCH_TARGET_REQUESTS, True, {TORCH: 1.0}) == ("", None)
    assert batch_target(16, False, {TORCH: 1.0}) == ("", None)
    for cfg in (quick_config(), full_config()):
        assert (cfg.batch_page_size, cfg.batch_requests, cfg.batch_pool_slots) == (64, (16, 256, 1024), MIB_SLOTS)
        # Several batches per pool cycle, and whole cycles only.
        assert all(cfg.batch_pool_slots % (64 * n) == 0 < cfg.batch_pool_slots // (64 * n) - 1 for n in (16, 256, 1024))
    cfg = tiny_config(("batch",))
    cfg.batch_requests, cfg.batch_pool_slots = (BATCH_TARGET_REQUESTS,), 2 * BATCH_TARGET_REQUESTS * PAGE
    array_row, list_row = run_suite(cfg, with_torch=False)["rows"]
    assert (array_row["target"], array_row["met"]) == (BATCH_TARGET, None)
    assert (list_row["target"], list_row["met"]) == ("", None)


@pytest.mark.torch
def test_batch_with_torch() -> None:
    pytest.importorskip("torch")
    cfg = tiny_config(("batch",))
    cfg.batch_requests = (4, BATCH_TARGET_REQUESTS)
    cfg.batch_pool_slots = 2 * BATCH_TARGET_REQUESTS * PAGE
    rows = run_suite(cfg, with_torch=True)["rows"]
    assert len(rows) == 4
    for r in rows:
        assert set(r["ratios"]) == {NUMPY, TORCH}
        assert set(r["merges_per_loop"]) == {HOSTPOOL, HOSTPOOL_LIST, NUMPY, TORCH}
    assert rows[2]["target"] == BATCH_TARGET
    assert rows[2]["met"] is (rows[2]["ratios"][TORCH] >= 50)


def _offsets_wrong(real: Callable[..., Any]) -> Callable[..., Any]:
    def alloc_many(self: LogicalHostPool, sizes: Any) -> Any:
        slots, offsets = real(self, sizes)
        return slots, offsets[::-1].copy()

    return alloc_many


def _list_slots_reversed(real: Callable[..., Any]) -> Callable[..., Any]:
    def alloc_many(self: LogicalHostPool, sizes: Any) -> Any:
        slots, offsets = real(self, sizes)
        return (slots[::-1].copy() if isinstance(sizes, list) else slots), offsets

    return alloc_many


def _next_page(real: Callable[..., Any]) -> Callable[..., Any]:
    def alloc(self: NumpyBaseline, need_size: int) -> Any:
        got = real(self, need_size)
        return None if got is None else (got + need_size) % self.size

    return alloc


def _merges_twice(real: Callable[..., Any]) -> Callable[..., Any]:
    def merge(self: NumpyBaseline) -> None:
        had = bool(self.release_list)
        real(self)
        self.merges += had

    return merge


@pytest.mark.parametrize(
    ("cls", "method", "misbehave", "message"),
    [
        (NumpyBaseline, "alloc", _next_page, r"first batch on a fresh pool: numpy handed out other slots"),
        (LogicalHostPool, "alloc_many", _list_slots_reversed, r"hostpool_nb \(list\) handed out other slots"),
        (
            LogicalHostPool,
            "alloc_many",
            _offsets_wrong,
            r"alloc_many returned offsets \[64, 48, 32, 16, 0\], not i \* 16",
        ),
        (NumpyBaseline, "_merge", _merges_twice, r"merges per timed loop differ: .*'numpy': 2\.0"),
    ],
    ids=["baseline-other-slots", "list-sizes-other-order", "offsets", "merges"],
)
def test_batch_workload_refuses_a_misbehaving_implementation(
    monkeypatch: pytest.MonkeyPatch,
    cls: type,
    method: str,
    misbehave: Callable[[Callable[..., Any]], Callable[..., Any]],
    message: str,
) -> None:
    """The differential check is live: one implementation answering otherwise stops the run, loudly."""
    monkeypatch.setattr(cls, method, misbehave(getattr(cls, method)))
    with pytest.raises(BatchDivergence, match=message):
        run_suite(tiny_config(("batch",)), with_torch=False)


def test_measure_batch_needs_whole_cycles() -> None:
    impls = implementations(with_torch=False)
    for pool in (96, 32, 0):  # 1.5 batches, half a batch, none
        with pytest.raises(ValueError, match="whole number of batches"):
            measure_batch(impls, PAGE, 4, pool, repeats=1)


def test_batch_workload_without_the_jit() -> None:
    """The batch workload in a child process with ``NUMBA_DISABLE_JIT=1`` (kernels as plain Python)."""
    code = (
        "import numba\n"
        "from bench.report import render_table\n"
        "from bench.suite import run_suite, tiny_config\n"
        "doc = run_suite(tiny_config(('batch',)), with_torch=False)\n"
        "print('jit disabled:', bool(numba.config.DISABLE_JIT))\n"
        "print(render_table(doc['rows'], False))\n"
    )
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr
    assert "jit disabled: True" in res.stdout
    assert res.stdout.count(BATCH) == 2 * len(tiny_config().batch_requests), res.stdout


# -- the paged workload ---------------------------------------------------------


def test_paged_rows_have_ratios_and_no_torch_column() -> None:
    cfg = tiny_config(("paged",))
    progress = _CountingProgress()
    doc = run_suite(cfg, with_torch=False, progress=progress)
    assert progress.steps == _steps(cfg, 2) == _steps(cfg, 3) > 0  # torch or not: two implementations
    rows = doc["rows"]
    cases = paged_cases(cfg.paged)
    assert [r["workload"] for r in rows] == [PAGED_WORKLOAD] * len(cases) == [PAGED_WORKLOAD] * 7
    assert [c["call"] for c in cases] == ["free"] * 2 + ["alloc_extend"] * 2 + ["alloc_decode"] * 2 + [
        "merge_and_sort_free"
    ]
    for r, case in zip(rows, cases, strict=True):
        assert r["case"].items() >= case.items()  # the measured cell is the case, with details added
        assert r["params"] == paged_params(case)
        assert r["unit"] == "s/call"
        assert r["columns"] == (HOSTPOOL, NUMPY)
        assert set(r["values"]) == {HOSTPOOL, NUMPY}
        assert all(v > 0 for v in r["values"].values())
        assert r["ratios"] == {NUMPY: pytest.approx(r["values"][NUMPY] / r["values"][HOSTPOOL])}
        assert set(r["paired_ratios"]) == {NUMPY}
        assert (r["target"], r["met"]) == ("", None)  # targets are at the issue's sizes only
        assert set(r["iterations_per_sample"]) == set(r["sample_means"]) == {HOSTPOOL, NUMPY}
        assert all(len(m) == cfg.paged.repeats for m in r["sample_means"].values())
    free_rows = rows[:2]
    assert [r["case"]["pool_tokens"] for r in free_rows] == [16 * (32 + 4), 16 * (128 + 4)]
    assert rows[5]["case"]["new_pages"] >= 1  # alloc_decode takes at least one page
    raw = doc["raw"]["paged"]
    assert [c["params"] for c in raw["cells"]] == [r["case"] for r in rows]
    assert raw["free_flatness"]["free_pages"] == [32, 128]
    assert raw["free_flatness"][HOSTPOOL] == pytest.approx(rows[1]["values"][HOSTPOOL] / rows[0]["values"][HOSTPOOL])
    assert 0 < raw["timer_overhead_s"] < 1e-4
    notes = [n for n in doc["notes"] if n.startswith("paged")]
    assert len(notes) == 4
    assert "int32 array" in notes[1]
    assert "Flatness" in notes[1]
    table = report.render_table(rows, torch_present=True).splitlines()
    assert all(len(line) <= TABLE_WIDTH for line in table)
    for line, r in zip(table[2:], rows, strict=True):
        cells = re.split(r"\s{2,}", line.strip())
        assert cells[:2] == [PAGED_WORKLOAD, r["params"]]
        assert cells[4] == "-"  # no torch baseline for the paged allocator, torch installed or not
    json.dumps(doc, default=report._jsonable)  # the JSON writer takes it


def _issue_case(call: str, **changes: Any) -> dict[str, Any]:
    """The quick config's case for ``call`` (the issue's sizes), with ``changes``."""
    case = next(c for c in paged_cases(quick_config().paged) if c["call"] == call)
    return {**case, **changes}


def test_paged_targets_are_at_the_issue_sizes() -> None:
    for cfg in (quick_config(), full_config()):
        pc = cfg.paged
        assert pc.page_size == 16
        assert pc.free_pages == (10_000, 62_500, 250_000, 1_000_000)
        assert pc.free_request_tokens == 2048
        assert (pc.extend_requests, pc.extend_max_prefix, pc.extend_max_tokens) == (32, 4096, 2048)
        assert pc.decode_seqs == 256
        assert pc.merge_released == 100_000
        targets = [paged_target(c, {NUMPY: 1e9})[0] for c in paged_cases(pc)]
        assert targets == [
            "",
            PAGED_FREE_TARGET,
            "",
            "",
            PAGED_EXTEND_TARGET,
            "",
            PAGED_DECODE_TARGET,
            "",
            PAGED_MERGE_TARGET,
        ]
    free = _issue_case("free", free_pages=62_500)
    assert paged_params(free) == "free 2048 tok, 62.5k free"
    assert paged_target(free, {NUMPY: 300.0}) == (PAGED_FREE_TARGET, True)
    assert paged_target(free, {NUMPY: 299.9}) == (PAGED_FREE_TARGET, False)
    assert paged_target(free, {}) == (PAGED_FREE_TARGET, None)
    assert paged_target({**free, "page_size": 64}, {NUMPY: 1e9}) == ("", None)
    assert paged_target({**free, "request_tokens": 4096}, {NUMPY: 1e9}) == ("", None)
    assert paged_target(_issue_case("alloc_extend"), {NUMPY: 24.9}) == (PAGED_EXTEND_TARGET, False)
    assert paged_target(_issue_case("alloc_decode"), {NUMPY: 4.0}) == (PAGED_DECODE_TARGET, True)
    assert paged_target(_issue_case("alloc_decode", inputs="arrays"), {NUMPY: 1.0}) == ("", None)
    assert paged_target(_issue_case("merge_and_sort_free"), {NUMPY: 3.9}) == (PAGED_MERGE_TARGET, False)
    assert [paged_params(c) for c in paged_cases(full_config().paged)] == [
        "free 2048 tok, 10k free",
        "free 2048 tok, 62.5k free",
        "free 2048 tok, 250k free",
        "free 2048 tok, 1M free",
        "extend 32 reqs, lists",
        "extend 32 reqs, arrays",
        "decode 256 seqs, lists",
        "decode 256 seqs, arrays",
        "merge 100k released",
    ]


def _as_int64(real: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return real(self, *args, **kwargs).astype(np.int64)

    return call


def _last_slot_off(real: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, *args, **kwargs).copy()
        out[-1] += 1
        return out

    return call


def _frees_nothing(real: Callable[..., Any]) -> Callable[..., Any]:
    def free(self: Any, free_index: Any, dp_rank: int = 0) -> int:
        return 0

    return free


def _merge_unsorted(real: Callable[..., Any]) -> Callable[..., Any]:
    def merge_and_sort_free(self: PagedOracle, dp_rank: int = 0) -> None:
        if len(self.release_pages[dp_rank]):
            self.free_pages[dp_rank] = np.concatenate([self.free_pages[dp_rank], self.release_pages[dp_rank]])
            self.release_pages[dp_rank] = np.empty(0, np.int32)

    return merge_and_sort_free


@pytest.mark.parametrize(
    ("cls", "method", "misbehave", "message"),
    [
        (
            PagedHostPool,
            "alloc_decode",
            _as_int64,
            r"alloc_decode of 16 sequences \(lists\), checked call before timing, the result: "
            r"hostpool_nb's has dtype int64, not int32 \(as numpy's\)",
        ),
        (
            PagedHostPool,
            "alloc_decode",
            _last_slot_off,
            r"alloc_decode of 16 sequences \(lists\), checked call before timing, the result: "
            r"hostpool_nb's differs first at position 15 \(1 in all\)",
        ),
        (
            PagedHostPool,
            "alloc_extend",
            _last_slot_off,
            r"alloc_extend of 4 requests \(lists\), set-up: the requests' alloc_extend from empty: hostpool_nb's",
        ),
        (
            PagedHostPool,
            "free",
            _frees_nothing,
            r"free of 64 tokens with 32 free pages, checked call before timing, the lists after the call, "
            r"release_pages\[0\] \(sorted\): hostpool_nb's has shape \(0,\), not \(4,\)",
        ),
        (
            PagedOracle,
            "merge_and_sort_free",
            _merge_unsorted,
            r"free of 64 tokens with 32 free pages, checked call before timing, the lists after a "
            r"merge_and_sort_free, free_pages\[0\]: hostpool_nb's differs first at position 0",
        ),
    ],
    ids=["decode-dtype", "decode-value", "extend-setup", "free-nothing", "oracle-merge-unsorted"],
)
def test_paged_workload_refuses_a_misbehaving_implementation(
    monkeypatch: pytest.MonkeyPatch,
    cls: type,
    method: str,
    misbehave: Callable[[Callable[..., Any]], Callable[..., Any]],
    message: str,
) -> None:
    """The differential check is live: either side answering otherwise stops the run before timing."""
    monkeypatch.setattr(cls, method, misbehave(getattr(cls, method)))
    cfg = tiny_config(("paged",))
    if method != "free" and cls is PagedHostPool:
        cfg.paged.free_pages = ()  # straight to the call under test
    with pytest.raises(PagedDivergence, match=message):
        run_suite(cfg, with_torch=False)


def test_paged_merge_case_checks_the_merged_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    pc = tiny_config(("paged",)).paged
    case = paged_cases(pc)[-1]
    cell = measure_paged(paged_implementations(), pc, case, seed=5)
    assert cell.params["call"] == "merge_and_sort_free"
    assert cell.params["free_calls"] == 3  # 48 released pages, 16 per free
    monkeypatch.setattr(PagedHostPool, "merge_and_sort_free", lambda self, dp_rank=0: None)
    with pytest.raises(PagedDivergence, match=r"merge_and_sort_free of 48 released pages, checked call before"):
        measure_paged(paged_implementations(), pc, case, seed=5)


def test_paged_workload_without_the_jit() -> None:
    """The paged workload in a child process with ``NUMBA_DISABLE_JIT=1`` (kernels as plain Python)."""
    code = (
        "import numba\n"
        "from bench.report import render_table\n"
        "from bench.suite import run_suite, tiny_config\n"
        "doc = run_suite(tiny_config(('paged',)), with_torch=False)\n"
        "print('jit disabled:', bool(numba.config.DISABLE_JIT))\n"
        "print(render_table(doc['rows'], True))\n"
    )
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr
    assert "jit disabled: True" in res.stdout
    assert res.stdout.count(PAGED_WORKLOAD) == len(paged_cases(tiny_config().paged)), res.stdout


def test_roundtrip_cell_pays_every_merge() -> None:
    impls = implementations(with_torch=False)
    cell = measure_roundtrip(impls, PAGE, 64, 1024, repeats=2, min_cycles=2, min_loop_s=0.0)
    assert set(cell.per_op) == set(impls)
    assert all(v > 0 for v in cell.per_op.values())
    # Each timed loop covers whole cycles: one merge per cycle, everywhere.
    assert cell.extra["merges_per_loop"] == {name: float(cell.params["cycles_per_loop"]) for name in impls}


def test_memory_accounting_matches_tracemalloc() -> None:
    for make in (LogicalHostPool, NumpyBaseline):
        res = measure_memory(make, 2048, 16, trace_all=True)
        for phase in ("built", "released"):
            counted, traced = res[phase], res[phase + "_traced"]
            assert abs(counted - traced) <= 0.02 * traced + 4096, (make.__name__, phase, res)
    ours = measure_memory(LogicalHostPool, 2048, 16)
    assert ours["peak_per_page"] < 24 + 4096 / 128  # header and objects amortised over 128 pages
    base = measure_memory(NumpyBaseline, 2048, 16)
    assert base["merge_peak"] > 2 * 8 * 2048  # old free list + concatenation output
    assert base.get("merges") == 1


def test_suite_json_table_and_plot(tmp_path: Path) -> None:
    doc = run_suite(tiny_config(), with_torch=False)
    path = tmp_path / "bench.json"
    report.write_json(path, doc)
    loaded = json.loads(path.read_text())
    assert {"schema", "mode", "machine", "config", "rows", "notes", "raw", "elapsed_s"} <= set(loaded)
    for key in ("cpu_model", "cpu_count", "cpus_usable", "python", "numpy", "numba", "torch", "date"):
        assert key in loaded["machine"]
    workloads = {r["workload"] for r in loaded["rows"]}
    assert {"round trip", BATCH, "KV-cache trace", "metadata peak", "memory floor", PAGED_WORKLOAD} <= workloads
    for r in loaded["rows"]:
        assert {"workload", "params", "unit", "values", "ratios", "target", "met"} <= set(r)
        assert r["met"] in (True, False, None)
        for name, ratio in r["ratios"].items():
            assert ratio == pytest.approx(r["values"][name] / r["values"]["hostpool_nb"])

    table = report.render_table(loaded["rows"], torch_present=False)
    header = table.splitlines()[0]
    for col in report.TABLE_HEADER:
        assert col in header
    trace_line = next(line for line in table.splitlines() if line.startswith("KV-cache trace"))
    assert "n/a" in trace_line  # torch columns without torch

    # One trace floor row per trace row: the floor where hostpool_nb's time
    # would be, so its ratios are each baseline's time / the floor's.
    traces = {r["params"]: r for r in loaded["rows"] if r["workload"] == "KV-cache trace"}
    floors = {r["params"]: r for r in loaded["rows"] if r["workload"] == "trace floor"}
    assert set(floors) == set(traces)
    assert traces
    for params, fl in floors.items():
        tr = traces[params]
        floor_time = fl["values"]["hostpool_nb"]
        assert 0 < floor_time == median(fl["floor_samples"])
        assert fl["values"][NUMPY] == tr["values"][NUMPY]
        assert fl["ratios"][NUMPY] == pytest.approx(tr["values"][NUMPY] / floor_time)
        assert fl["hostpool_over_floor"] == pytest.approx(tr["values"]["hostpool_nb"] / floor_time)
        assert fl["met"] is None
        assert not fl["target"]

    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    cells = [c for c in loaded["raw"]["roundtrip"] if c["workload"] == "round trip"]
    floors = {int(k): v["copy"] for k, v in loaded["raw"]["floors"].items()}
    report.write_plot(png, cells, floors, loaded["machine"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- tracking ------------------------------------------------------------------


def test_tracking_rows_have_a_target_and_real_metadata() -> None:
    cfg = tiny_config(("tracking",))
    progress = _CountingProgress()
    doc = run_suite(cfg, with_torch=False, progress=progress)
    assert progress.steps == _steps(cfg, 2) > 0
    ps, k, pool = cfg.tracking_cell
    rows = doc["rows"]
    assert [(r["workload"], r["params"]) for r in rows] == [
        *(("tracking", tracking_params(ps, k, pool, v)) for v in VARIANTS),
        *(("tracking state", tracking_state_params(pool, ps, v)) for v in (UNTRACKED, TRACKED)),
        ("tracking state", TRACKING_SITES_PARAMS),
    ]
    for r in rows:
        # hostpool_nb against itself: no ratio columns, no ratios.
        assert r["columns"] == (HOSTPOOL,)
        assert set(r["values"]) == {HOSTPOOL}
        assert r["values"][HOSTPOOL] > 0
        assert r["ratios"] == {}
    times = {r["variant"]: r for r in rows[:3]}
    tracked = times[TRACKED]
    ratio = tracked["values"][HOSTPOOL] / times[UNTRACKED]["values"][HOSTPOOL]
    assert tracked["over_untracked"] == pytest.approx(ratio)
    assert tracked["met"] in (True, False)
    assert (tracked["target"], tracked["met"]) == (TRACKING_TARGET, ratio <= 3.0)
    for variant in (UNTRACKED, NEW_TAGS):
        assert (times[variant]["target"], times[variant]["met"]) == ("", None)
    # The state rows are the pools' arrays, per page, as the layout says.
    pages = pool // ps
    untracked_b, tracked_b = (r["values"][HOSTPOOL] for r in rows[3:5])
    assert untracked_b == L.state_length(pages) * 8 / pages == LogicalHostPool(pool, ps)._st.nbytes / pages
    assert tracked_b - untracked_b == 16.0
    assert rows[5]["unit"] == "B/tag"
    assert rows[5]["values"][HOSTPOOL] > 50  # a Site, its key and the tag, at least
    notes = " ".join(" ".join(doc["notes"]).split())
    assert "python -m bench.compare" in notes
    assert f"--only-cells {ps}:{k}" in notes
    assert f"target {TRACKING_TARGET}: {'met' if tracked['met'] else 'NOT met'}" in notes
    raw = doc["raw"]["tracking"]
    assert set(raw["per_op"]) == set(VARIANTS)
    assert raw["extra"]["merges_per_loop"] == {UNTRACKED: 1.0, TRACKED: 1.0}  # one per cycle, each
    table = report.render_table(rows, torch_present=False).splitlines()
    assert all(len(line) <= TABLE_WIDTH for line in table)
    line = next(x for x in table if TRACKING_TARGET in x)
    assert line.split()[-1] == report.fmt_met(tracked["met"])


def test_tracking_target_bounds_tracked_over_untracked() -> None:
    assert tracking_target(TRACKED, 3.0) == (TRACKING_TARGET, True)
    assert tracking_target(TRACKED, 3.01) == (TRACKING_TARGET, False)
    assert tracking_target(TRACKED, None) == (TRACKING_TARGET, None)
    assert tracking_target(UNTRACKED, 1.0) == ("", None)
    assert tracking_target(NEW_TAGS, 9.0) == ("", None)
    # The round-trip workload's headline cell, in the quick and full runs.
    for cfg in (quick_config(), full_config()):
        assert cfg.tracking_cell == (64, 64, MIB_SLOTS)
        assert "tracking" in cfg.workloads


# -- a recorded trace (--trace) -------------------------------------------------


def _record(path: Path, *, snapshots: bool = False, merge: str = "fifo", track: bool = False) -> None:
    """A scheduler-like run recorded to ``path``: every call the baselines map, failures and errors."""
    pool = LogicalHostPool(POOL, PAGE, merge=merge, track=track)
    rng = np.random.default_rng(5)
    held: list[np.ndarray] = []
    with pool.recording(path):
        for i in range(300):
            r = rng.random()
            if r < 0.45 or not held:
                got = pool.alloc(PAGE * int(rng.integers(1, 24)), tag=i)
                if got is not None:
                    held.append(got)
            elif r < 0.55:
                many = pool.alloc_many(np.array([PAGE, 2 * PAGE, 0], dtype=np.int64), tag=i)
                if many is not None:
                    held.append(many[0])
            elif r < 0.65:
                with pool.free_group():
                    for _ in range(min(2, len(held))):
                        pool.free(held.pop(int(rng.integers(len(held)))))
            else:
                pool.free(held.pop(int(rng.integers(len(held)))))
        assert pool.alloc(2 * POOL) is None
        with pytest.raises(AlignmentError):
            pool.alloc(PAGE + 1)
        a = pool.alloc(PAGE)
        pool.free(a)
        with pytest.raises(DoubleFreeError):
            pool.free(a)
        pool.merge()
        if snapshots:
            pool.restore_state(pool.backup_state())
        pool.free_group_begin()
        if held:
            pool.free(held.pop())
        pool.clear()  # ends the group; what it held is free again
        pool.free(pool.alloc(4 * PAGE))


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    path = tmp_path / "sched.npz"
    _record(path)
    trace = hp_trace.load(path)
    names = {op.name for op in trace.operations}
    assert {"alloc", "alloc_many", "free", "free_group_begin", "free_group_end", "merge", "clear"} <= names
    assert sum(op.name == "alloc" and op.result < 0 for op in trace.operations) > 1  # answered None
    assert {op.error for op in trace.operations} >= {"AlignmentError", "DoubleFreeError"}
    assert hp_trace.replay(trace)[2] is None  # the library's own replay agrees with the record
    return path


def test_recorded_trace_rows_and_ratios(recorded: Path) -> None:
    cfg = tiny_config(())
    cfg.recorded_trace = str(recorded)
    progress = _CountingProgress()
    doc = run_suite(cfg, with_torch=False, progress=progress)
    trace = read_trace(str(recorded))
    assert progress.steps == _steps(cfg, 2, trace) == 2 * (cfg.trace_repeats + 1)
    [row] = doc["rows"]
    assert row["workload"] == RECORDED
    assert row["params"] == recorded_params(str(recorded), len(trace.operations))
    assert row["params"] == f"sched.npz {len(trace.operations)} ops"
    assert set(row["values"]) == {HOSTPOOL, NUMPY}
    assert all(v > 0 for v in row["values"].values())
    assert row["ratios"][NUMPY] == pytest.approx(row["values"][NUMPY] / row["values"][HOSTPOOL])
    assert set(row["paired_ratios"]) == {NUMPY}
    assert (row["target"], row["met"], row["baselines_skipped"]) == ("", None, None)
    # Fewer calls on the baseline: no merge or group calls, none of the calls that raised.
    calls = row["calls_per_replay"]
    assert calls[NUMPY] < calls[HOSTPOOL] == len(trace.operations)
    assert any(note.startswith(f"recorded trace {recorded}:") for note in doc["notes"])
    table = report.render_table(doc["rows"], torch_present=False).splitlines()
    assert all(len(line) <= TABLE_WIDTH for line in table)
    assert sum(line.startswith(RECORDED) for line in table) == 1


@pytest.mark.torch
def test_recorded_trace_with_torch(recorded: Path) -> None:
    pytest.importorskip("torch")
    cfg = tiny_config(())
    cfg.recorded_trace = str(recorded)
    [row] = run_suite(cfg, with_torch=True)["rows"]
    assert set(row["ratios"]) == {NUMPY, TORCH}


def test_baselines_get_the_calls_a_scheduler_on_the_original_makes(tmp_path: Path) -> None:
    path = tmp_path / "small.npz"
    pool = LogicalHostPool(POOL, PAGE)
    with pool.recording(path):
        a = pool.alloc(2 * PAGE)  # 0
        slots, _ = pool.alloc_many([PAGE, 3 * PAGE])  # 1
        pool.free_group_begin()  # 2
        pool.free(a)  # 3: released at the group's end
        c = pool.alloc(PAGE)  # 4: so not from a's pages
        pool.merge()  # 5
        with pytest.raises(AlignmentError):
            pool.alloc(1)  # 6
        pool.free_group_end()  # 7
        pool.free_group_begin()  # 8
        pool.free(slots)  # 9: never released, clear() ends the group
        pool.clear()  # 10
        with pytest.raises(DoubleFreeError):
            pool.free(c)  # 11: clear() freed it
    trace = hp_trace.load(path)
    assert [op.error for op in trace.operations][6] == "AlignmentError"
    assert trace.operations[11].error == "DoubleFreeError"
    ours, theirs = hostpool_plan(trace), baseline_plan(trace)
    assert [op.index for op, _, _ in ours.expect] == list(range(12))
    assert [op.index for op, _, _ in theirs.expect] == [0, 1, 4, 3, 10]
    assert [code for code, _ in theirs.steps] == [ALLOC, ALLOC, ALLOC, FREE, CLEAR]
    assert [arg for code, arg in theirs.steps if code == ALLOC] == [2 * PAGE, 4 * PAGE, PAGE]
    cfg = tiny_config(())
    cfg.recorded_trace = str(path)
    [row] = run_suite(cfg, with_torch=False)["rows"]
    assert row["calls_per_replay"] == {HOSTPOOL: 12, NUMPY: 5}


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [({"snapshots": True}, "backup/restore calls"), ({"merge": "sorted"}, "FIFO order only")],
    ids=["snapshots", "sorted"],
)
def test_recorded_trace_the_baselines_cannot_replay(tmp_path: Path, kwargs: dict, why: str) -> None:
    path = tmp_path / "t.npz"
    _record(path, **kwargs)
    cfg = tiny_config(())
    cfg.recorded_trace = str(path)
    progress = _CountingProgress()
    doc = run_suite(cfg, with_torch=False, progress=progress)
    assert progress.steps == _steps(cfg, 2, read_trace(str(path))) == cfg.trace_repeats + 1
    [row] = doc["rows"]
    assert set(row["values"]) == {HOSTPOOL}
    assert row["columns"] == (HOSTPOOL,)
    assert why in row["baselines_skipped"]
    assert any(f"the baselines were not run: {row['baselines_skipped']}" in note for note in doc["notes"])


def test_recorded_trace_of_a_tracking_pool_replays_tracked(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    _record(path, track=True)
    cfg = tiny_config(())
    cfg.recorded_trace = str(path)
    [row] = run_suite(cfg, with_torch=False)["rows"]
    assert row["trace"]["track"] is True
    assert set(row["ratios"]) == {NUMPY}


def _altered(src: Path, dst: Path, op_name: str) -> int:
    """``src`` with one slot of the first successful ``op_name`` moved a page on; that call's index."""
    trace = hp_trace.load(src)
    op = next(o for o in trace.operations if o.name == op_name and o.error is None and o.slots is not None)
    arrays = dict(np.load(src))
    data = arrays["data"].copy()
    where = int(arrays["ops"][op.index]["offset"]) + (op.arg if op_name == "alloc_many" else 0)
    data[where] = (data[where] + PAGE) % POOL
    arrays["data"] = data
    np.savez(dst, **arrays)
    return op.index


@pytest.mark.parametrize("op_name", ["alloc", "alloc_many", "free"])
def test_recorded_trace_with_altered_slots_stops_at_the_call(recorded: Path, tmp_path: Path, op_name: str) -> None:
    bad = tmp_path / "bad.npz"
    index = _altered(recorded, bad, op_name)
    cfg = tiny_config(())
    cfg.recorded_trace = str(bad)
    expected = rf"^--trace {re.escape(str(bad))}: hostpool_nb diverges from the trace at operation {index} \({op_name}"
    with pytest.raises(ReplayDivergence, match=expected):
        run_suite(cfg, with_torch=False)


def test_recorded_trace_refuses_a_baseline_that_diverges(recorded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NumpyBaseline, "alloc", _next_page(NumpyBaseline.alloc))
    cfg = tiny_config(())
    cfg.recorded_trace = str(recorded)
    with pytest.raises(ReplayDivergence, match=r"numpy diverges from the trace at operation 0 \(alloc\("):
        run_suite(cfg, with_torch=False)


def test_read_trace_says_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(3))  # load() lets a .npy through as a TypeError
    (tmp_path / "text.npz").write_text("not a trace\nat all")
    empty = tmp_path / "empty.npz"
    with LogicalHostPool(POOL, PAGE).recording(empty):
        pass
    for path, says in (
        (tmp_path / "missing.npz", "no such file"),
        (tmp_path, "is a directory"),
        (tmp_path / "x.npy", "is not a hostpool_nb trace"),
        (tmp_path / "text.npz", "is not a hostpool_nb trace"),
        (empty, "holds no call to replay"),
    ):
        with pytest.raises(RecordedTraceError) as exc:
            read_trace(str(path))
        assert says in str(exc.value)
        assert "\n" not in str(exc.value)


def test_tracking_and_recorded_trace_without_the_jit(recorded: Path) -> None:
    """Both workloads in a child process with ``NUMBA_DISABLE_JIT=1`` (kernels as plain Python)."""
    code = (
        "import sys, numba\n"
        "from bench.report import render_table\n"
        "from bench.suite import run_suite, tiny_config\n"
        "cfg = tiny_config(('tracking',))\n"
        "cfg.recorded_trace = sys.argv[1]\n"
        "doc = run_suite(cfg, with_torch=False)\n"
        "print('jit disabled:', bool(numba.config.DISABLE_JIT))\n"
        "print(render_table(doc['rows'], False))\n"
    )
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    res = subprocess.run(
        [sys.executable, "-c", code, str(recorded)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "jit disabled: True" in res.stdout
    lines = res.stdout.splitlines()
    assert sum(line.split("  ")[0] == "tracking" for line in lines) == 3, res.stdout
    assert sum(line.startswith(RECORDED) for line in lines) == 1, res.stdout
    assert TRACKING_TARGET in res.stdout


class _Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr does in an interactive shell."""

    def isatty(self) -> bool:
        return True


def _drive(bar: Progress) -> None:
    bar.label("measuring x")
    bar.step()
    bar.step(3)
    bar.label("measured")  # redraws at once: tqdm throttles the redraws of step()
    bar.close()
    bar.close()  # idempotent: main and run_suite both close


def test_progress_interleaving() -> None:
    bar = Progress(4, stream=io.StringIO())
    order: list[str] = []
    samples = interleaved(
        {n: (lambda n=n: order.append(n) or 1.0) for n in ("a", "b")},
        repeats=2,
        tick=lambda: (bar.label("x"), bar.step()),
    )
    bar.close()
    assert samples == {"a": [1.0, 1.0], "b": [1.0, 1.0]}
    assert order == ["a", "b", "b", "a"]  # each repeat starts elsewhere


def test_progress_writes_nothing_to_a_log() -> None:
    """Redirected stderr gets no bar: tqdm's carriage-return frames would pile up in the log."""
    out = io.StringIO()
    bar = Progress(4, stream=out)
    assert not bar.shown
    _drive(bar)
    assert out.getvalue() == ""


def test_progress_on_a_terminal_uses_tqdm() -> None:
    pytest.importorskip("tqdm")
    out = _Terminal()
    bar = Progress(4, stream=out)
    assert bar.shown
    _drive(bar)
    assert not bar.shown
    text = out.getvalue()
    assert "measuring x" in text  # a redrawn line, labelled
    assert "\r" in text
    assert "measured: 100%" in text  # the steps reached the bar
    assert "4/4" in text


def test_progress_disabled_or_without_tqdm_draws_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _Terminal()
    off = Progress(4, enabled=False, stream=out)  # --no-progress
    _drive(off)
    assert not off.shown
    assert out.getvalue() == ""

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    bare = Progress(4, stream=out)
    _drive(bare)
    assert not bare.shown
    assert out.getvalue() == ""


# -- the command line --------------------------------------------------------


def _cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """stderr of ``python -m bench argv``, which must exit 2 with one line, before measuring."""
    from bench.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("python -m bench: error: "), err
    return err


@pytest.fixture
def no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the suite starts: user mistakes must be caught before it."""

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured despite a bad command line")

    monkeypatch.setattr("bench.__main__.run_suite", boom)


def test_cli_rejects_unknown_workload(capsys: pytest.CaptureFixture[str], no_measuring: None) -> None:
    from bench.__main__ import parse_args

    err = _cli_error(capsys, ["--only", "nonsense"])
    assert "nonsense" in err
    assert "roundtrip" in err
    assert parse_args(["--only", "trace,memory"]).only == ("trace", "memory")
    assert parse_args(["--only", "paged"]).only == ("paged",)
    assert "paged" in err


def test_cli_checks_output_paths_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_measuring: None
) -> None:
    missing = tmp_path / "nonexistent" / "x.json"
    err = _cli_error(capsys, ["--json", str(missing)])
    assert f"cannot write --json {missing}: directory {missing.parent} does not exist" in err
    assert "is a directory" in _cli_error(capsys, ["--json", str(tmp_path)])
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert "not a directory" in _cli_error(capsys, ["--plot", str(a_file / "x.png")])
    same = str(tmp_path / "x")
    assert "same file" in _cli_error(capsys, ["--json", same, "--plot", same])


def test_cli_plot_without_matplotlib(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_measuring: None
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "needs matplotlib" in _cli_error(capsys, ["--plot", str(tmp_path / "x.png")])


def test_cli_checks_the_trace_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_measuring: None
) -> None:
    missing = tmp_path / "missing.npz"
    assert _cli_error(capsys, ["--trace", str(missing)]) == f"python -m bench: error: --trace {missing}: no such file\n"
    junk = tmp_path / "junk.npz"
    junk.write_text("junk\nmore junk")
    assert f"--trace {junk} is not a hostpool_nb trace" in _cli_error(capsys, ["--trace", str(junk)])
    assert "--trace: no path given" in _cli_error(capsys, ["--trace", ""])


def test_cli_trace_with_output_options(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_measuring: None
) -> None:
    err = _cli_error(capsys, ["--trace", str(recorded), "--plot", str(tmp_path / "p.png")])
    assert "--plot needs the roundtrip workload (with --trace, add --only roundtrip)" in err
    assert "--json names the --trace file" in _cli_error(capsys, ["--trace", str(recorded), "--json", str(recorded)])


def test_cli_trace_alone_runs_only_the_trace(
    recorded: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench.__main__ as cli

    monkeypatch.setattr(cli, "quick_config", tiny_config)
    assert cli.main(["--trace", str(recorded), "--no-torch"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert all(len(line) <= TABLE_WIDTH for line in lines), max(lines, key=len)
    workloads = [
        line.split("  ")[0] for line in lines[lines.index(next(x for x in lines if x.startswith("---"))) + 1 :]
    ]
    assert workloads[0] == RECORDED
    assert not any(line.startswith(("round trip", "tracking", "KV-cache trace")) for line in lines)
    # With --only, those workloads run too.
    assert cli.main(["--trace", str(recorded), "--no-torch", "--only", "tracking"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith(RECORDED) for line in lines) == 1
    assert sum(line.split("  ")[0] == "tracking" for line in lines) == 3


def test_cli_trace_divergence_is_one_line(
    recorded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench.__main__ as cli

    monkeypatch.setattr(cli, "quick_config", tiny_config)
    bad = tmp_path / "bad.npz"
    index = _altered(recorded, bad, "alloc")
    assert cli.main(["--trace", str(bad), "--no-torch"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith(
        f"python -m bench: error: --trace {bad}: hostpool_nb diverges from the trace at operation {index} (alloc("
    )


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.__main__ import main as bench_main
    from bench.profile import main as profile_main

    for main, options in ((bench_main, ()), (profile_main, ("--page-size", "--k", "--pool", "--big-k", "--trace-ops"))):
        with pytest.raises(SystemExit) as exc:
            main(["--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        assert "``" not in text
        for opt in options:  # each profile option says what it is and its default
            line = next(x for x in text.splitlines() if x.lstrip().startswith(opt + " "))
            assert len(line.split(maxsplit=2)) == 3, line
        if options:
            assert text.count("(default") == len(options)


@pytest.mark.parametrize(
    ("argv", "option"),
    [(["--k", "10"], "--k"), (["--trace-ops", "-1"], "--trace-ops")],  # --k: not a multiple of the page size, 64
)
def test_profile_rejects_sizes_the_pool_cannot_take(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.profile import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m bench.profile: error: {option} ")
    assert len(err.splitlines()) == 1


@pytest.mark.skipif(JIT_DISABLED, reason="the kernel pieces need numba's compiled entry points")
def test_profile_times_every_piece() -> None:
    """No piece falls back to "unavailable": a renamed private name fails here, not silently in the report."""
    from bench.profile import profile_roundtrip

    rows = profile_roundtrip(page_size=16, k=16, pool_slots=1 << 12, number=50, repeat=1)
    missing = [(name, comment) for name, ns, comment in rows if ns is None]
    assert missing == []
    names = [name for name, _, _ in rows]
    for piece in ("floor: np.empty + lock + kernel, twice", "kernels via entry point: alloc_pages + free_pages"):
        assert piece in names


@pytest.mark.skipif(JIT_DISABLED, reason="the round-trip sections time 20,000 calls per piece")
def test_profile_main_prints_each_section(capsys: pytest.CaptureFixture[str]) -> None:
    """One section per measurement and page size, in order; --trace-ops 0 leaves the trace out."""
    from bench.profile import main

    small = ["--pool", "4096", "--page-size", "16", "--k", "16", "--big-k", "256"]
    assert main([*small, "--trace-ops", "200"]) == 0
    titles = [line for line in capsys.readouterr().out.splitlines() if "pool=4096" in line]
    assert titles == [
        "single round trip, page size 16, k=16, pool=4096",
        "large round trip, page size 1, k=256, pool=4096",
        "large round trip, page size 16, k=256, pool=4096",
        "KV-cache trace, page size 1, pool=4096, 200 calls: time per call",
        "KV-cache trace, page size 16, pool=4096, 200 calls: time per call",
    ]
    assert main([*small, "--trace-ops", "0"]) == 0
    assert "KV-cache trace" not in capsys.readouterr().out


def test_profile_trace_rows_and_differences() -> None:
    """Every stand-in is timed, and the three differences are the rows they name."""
    from bench import profile as P

    rows = P.profile_trace(page_size=16, pool_slots=1 << 12, n_ops=300, repeat=1, with_torch=False)
    ns = {name: value for name, value, _ in rows}
    assert [name for name, _, _ in rows[:5]] == [P.POOL, P.KERNELS, P.KERNELS_LOCKED, P.FLOOR, P.FLOOR_LOCKED]
    assert P.TORCH not in ns
    assert all(ns[name] is not None and ns[name] > 0 for name in list(ns)[:5])
    assert ns["the lock's share"] == ns[P.KERNELS_LOCKED] - ns[P.KERNELS]
    assert ns["argument checks and the rest"] == ns[P.POOL] - ns[P.KERNELS_LOCKED]
    assert ns["kernels over the floor"] == ns[P.KERNELS] - ns[P.FLOOR]


@pytest.mark.parametrize("page_size", [1, 16])
def test_profile_trace_standins_answer_as_the_pool(page_size: int) -> None:
    """The kernels-only stand-ins hand out exactly the pool's slots; the locked floor refuses where the floor does."""
    import threading

    from bench import profile as P

    trace = make_trace(1 << 12, page_size, 400, seed=3)
    makers = P.trace_standins(with_torch=False)
    records: dict[str, list[Any]] = {}
    for name in (P.POOL, P.KERNELS, P.KERNELS_LOCKED):
        records[name] = []
        replay(makers[name](trace.pool_slots, page_size), trace, records[name])
    assert len(records[P.POOL]) == sum(1 for k, _ in trace.ops if k != 0)
    for name in (P.KERNELS, P.KERNELS_LOCKED):
        assert len(records[name]) == len(records[P.POOL])
        for got, want in zip(records[name], records[P.POOL], strict=True):
            assert (got is None) == (want is None)
            if want is not None:
                np.testing.assert_array_equal(got, want)
    for name in (P.KERNELS_LOCKED, P.FLOOR_LOCKED):  # replay checks every None against the trace
        standin = makers[name](trace.pool_slots, page_size)
        replay(standin, trace)
        taken: list[bool] = []
        other = threading.Thread(target=lambda lock=standin.lock, out=taken: out.append(lock.acquire(blocking=False)))
        other.start()
        other.join()
        assert taken == [True], f"{name} left its lock held"


def test_main_output_fits_and_has_no_carriage_returns(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole main job on tiny sizes, stdout and stderr redirected as in a log."""
    import bench.__main__ as cli

    monkeypatch.setattr(cli, "quick_config", tiny_config)
    out_json = tmp_path / "r.json"
    assert cli.main(["--no-torch", "--json", str(out_json)]) == 0
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    assert err == ""
    assert all(len(line) <= TABLE_WIDTH for line in out.splitlines()), max(out.splitlines(), key=len)
    assert "KV-cache trace" in out
    assert f"results written to {out_json}" in out
    assert json.loads(out_json.read_text())["rows"]


# -- the table ---------------------------------------------------------------


def _full_run_rows() -> list[dict]:
    """Rows shaped like a --full run's: every row suite.run_suite makes, with its texts.

    Values are chosen for the widest cells the formatters produce (three
    digits before the unit, four- and five-digit ratios).
    """
    cfg = full_config()
    t = {HOSTPOOL: 123e-6, NUMPY: 0.123, TORCH: 1.23}  # ratios 1000x and 10000x
    rows = []
    for ps, k, pool in cfg.roundtrip_cells:
        ratios = report.row("", "", "s/op", t)["ratios"]
        target, met = roundtrip_target(ps, k, pool, ratios)
        samples = {n: [v, v * 1.1] for n, v in t.items()}
        rows.append(report.row("round trip", roundtrip_params(ps, k, pool), "s/op", t, target, met, samples=samples))
    for ps, k, pool in cfg.shuffled_cells:
        rows.append(report.row("round trip", shuffled_params(ps, k, pool), "s/op", t, samples=samples))
    rows.append(report.row("memory floor", floor_params(BIG_K), "s/op", {HOSTPOOL: 18.4e-6}, columns=(HOSTPOOL,)))
    # Failed allocs are retried, so a trace has more ops than asked for.
    rows.extend(
        report.row(
            "KV-cache trace",
            trace_params(ps, cfg.trace_pool_slots, 10 * cfg.trace_ops),
            "s/op",
            t,
            *trace_target(ps, {}),
        )
        for ps in cfg.trace_page_sizes
    )
    b = {HOSTPOOL: 9.0, NUMPY: 1161.0, TORCH: 12345.0}
    rows.append(
        report.row("metadata held", memory_params(cfg.memory_pool_slots, cfg.memory_page_size, "built"), "B/page", b)
    )
    rows.append(
        report.row(
            "metadata peak",
            memory_params(cfg.memory_pool_slots, cfg.memory_page_size, "merge"),
            "B/page",
            b,
            METADATA_TARGET,
            True,
        )
    )
    for key in ("warm", "cold"):
        s = {HOSTPOOL: 10.9, TORCH: 321.0}
        rows.append(
            report.row(
                "start-up",
                STARTUP_PARAMS[key],
                "s",
                s,
                STARTUP_TARGET if key == "warm" else "",
                None,
                columns=(HOSTPOOL, TORCH),
            )
        )
    for n in cfg.batch_requests:
        for as_list in (False, True):
            ratios = report.row("", "", "s/batch", t)["ratios"]
            target, met = batch_target(n, as_list, ratios)
            params = batch_params(cfg.batch_page_size, n, cfg.batch_pool_slots, as_list)
            rows.append(report.row(BATCH, params, "s/batch", t, target, met))
    # The paged rows: two columns, torch shows '-'.
    for case in paged_cases(cfg.paged):
        ratios = report.row("", "", "s/call", t)["ratios"]
        target, met = paged_target(case, ratios)
        samples = {n: [v, v * 1.1] for n, v in t.items() if n != TORCH}
        rows.append(
            report.row(
                PAGED_WORKLOAD,
                paged_params(case),
                "s/call",
                {n: v for n, v in t.items() if n != TORCH},
                target,
                met,
                samples=samples,
                columns=(HOSTPOOL, NUMPY),
            )
        )
    ps, k, pool = cfg.tracking_cell
    for variant, seconds in ((UNTRACKED, 123e-6), (TRACKED, 369e-6), (NEW_TAGS, 999e-6)):
        target, met = tracking_target(variant, seconds / 123e-6)
        rows.append(
            report.row(
                "tracking",
                tracking_params(ps, k, pool, variant),
                "s/op",
                {HOSTPOOL: seconds},
                target,
                met,
                columns=(HOSTPOOL,),
            )
        )
    for variant, per_page in ((UNTRACKED, 9.01), (TRACKED, 125.01)):
        rows.append(
            report.row(
                "tracking state",
                tracking_state_params(pool, ps, variant),
                "B/page",
                {HOSTPOOL: per_page},
                columns=(HOSTPOOL,),
            )
        )
    rows.append(report.row("tracking state", TRACKING_SITES_PARAMS, "B/tag", {HOSTPOOL: 1234.5}, columns=(HOSTPOOL,)))
    # A user's trace: a usual file name, and one too long for its column;
    # one the baselines could replay and one they could not.
    rows.append(report.row(RECORDED, recorded_params("/data/sched.npz", 99_999), "s/op", t))
    rows.append(
        report.row(
            RECORDED,
            recorded_params("/data/scheduler-2026-11-30-prod-replica-3.npz", 12_345_678),
            "s/op",
            {HOSTPOOL: 123e-6},
            columns=(HOSTPOOL,),
        )
    )
    # A target too long for its column (what the issue tracker may plan next).
    rows.append(
        report.row(
            "paged allocator", "p16 256 reqs pool=1M", "s/op", t, ">=50x torch, >=10x numpy, in every batch size", True
        )
    )
    return rows


def _ratio_cell(r: dict, name: str, torch_present: bool) -> str:
    """What the table must show for ``name``'s ratio in row ``r``."""
    if name not in r.get("columns", report.IMPL_COLUMNS):
        return "-"
    if name == TORCH and not torch_present:
        return "n/a"
    return report.fmt_ratio(r["ratios"][name])


@pytest.mark.parametrize("torch_present", [True, False])
def test_table_fits_120_columns_and_shows_every_row(torch_present: bool) -> None:
    rows = _full_run_rows()
    table = report.render_table(rows, torch_present)
    lines = table.splitlines()
    assert all(len(line) <= TABLE_WIDTH for line in lines), max(lines, key=len)
    assert lines[0].split() == ["workload", "params", "hostpool_nb", "x", "numpy", "x", "torch", "target", "met?"]
    body = lines[2 : 2 + len(rows)]
    footnotes = "\n".join(lines[2 + len(rows) :])
    for r, line in zip(rows, body, strict=True):
        # Columns are two spaces apart and no cell is empty or holds two spaces.
        workload, params, ours, x_numpy, x_torch, target, met = re.split(r"\s{2,}", line.strip())
        assert (workload, ours, x_numpy, x_torch, met) == (
            r["workload"],
            report.fmt_value(r["values"][HOSTPOOL], r["unit"]),
            _ratio_cell(r, NUMPY, torch_present),
            _ratio_cell(r, TORCH, torch_present),
            report.fmt_met(r["met"]),
        )
        for cell, text in ((params, r["params"]), (target, r["target"] or "-")):
            if cell != text:  # moved to a numbered note under the table
                assert re.fullmatch(r"\[\d+\]", cell), (cell, text)
                assert " ".join(footnotes.split()).count(f"{cell} {text}") == 1
    assert footnotes.splitlines() == [
        "[1] scheduler-2026-11-30-prod-replica-3.npz 12345K ops",
        "[2] >=50x torch, >=10x numpy, in every batch size",
    ]


def test_every_target_reads_as_a_bound_on_the_ratios() -> None:
    """One direction everywhere: ratio = baseline / hostpool_nb, targets as lower bounds on it.

    But for two, each unmistakable: bytes per page, and the tracking row's,
    which compares hostpool_nb with itself on a row without ratio columns
    and names both sides.
    """
    rows = _full_run_rows()
    targets = {r["target"] for r in rows[:-1]} - {"", METADATA_TARGET, TRACKING_TARGET}
    assert BATCH_TARGET in targets
    assert {PAGED_FREE_TARGET, PAGED_EXTEND_TARGET, PAGED_DECODE_TARGET, PAGED_MERGE_TARGET} <= targets
    for target in targets:
        for part in target.split(", "):
            assert re.fullmatch(r">=\d+(\.\d+)?x (numpy|torch)", part), target
    [tracked] = [r for r in rows if r["target"] == TRACKING_TARGET]
    assert tracked["columns"] == (HOSTPOOL,)
    assert re.fullmatch(r"tracked <=\d+x untracked", TRACKING_TARGET)


# -- the speed issue's targets and rows ----------------------------------------


def test_roundtrip_targets() -> None:
    """Every round-trip cell has a bound on its torch ratio; the headline and 65,536-slot cells tighter ones."""
    assert roundtrip_target(64, 64, MIB_SLOTS, {NUMPY: 2.0, TORCH: 8.0}) == (HEADLINE_TARGET, True)
    assert roundtrip_target(64, 64, MIB_SLOTS, {NUMPY: 2.0, TORCH: 7.9}) == (HEADLINE_TARGET, False)
    assert roundtrip_target(64, 64, MIB_SLOTS, {NUMPY: 1.9, TORCH: 9.0}) == (HEADLINE_TARGET, False)
    assert roundtrip_target(64, 64, MIB_SLOTS, {NUMPY: 3.0}) == (HEADLINE_TARGET, True)  # no torch
    for ps in (16, 64):
        assert roundtrip_target(ps, BIG_K, MIB_SLOTS, {TORCH: 1.5}) == (BIG_K_TARGET, True)
        assert roundtrip_target(ps, BIG_K, MIB_SLOTS, {TORCH: 1.49}) == (BIG_K_TARGET, False)
    assert roundtrip_target(1, BIG_K, MIB_SLOTS, {TORCH: 1.0}) == (ROUNDTRIP_TARGET, True)
    assert roundtrip_target(1, BIG_K, MIB_SLOTS, {TORCH: 0.99}) == (ROUNDTRIP_TARGET, False)
    assert roundtrip_target(16, 4096, MIB_SLOTS, {TORCH: 0.5}) == (ROUNDTRIP_TARGET, False)
    assert roundtrip_target(16, 4096, MIB_SLOTS, {NUMPY: 0.5}) == (ROUNDTRIP_TARGET, None)
    # Every cell of a --full run has one.
    cfg = full_config()
    assert all(roundtrip_target(*cell, {NUMPY: 1e9, TORCH: 1e9})[1] for cell in cfg.roundtrip_cells)


def test_trace_targets_and_page_sizes() -> None:
    assert trace_target(1, {TORCH: 4.0}) == (TRACE_P1_TARGET, True)
    assert trace_target(1, {TORCH: 3.9}) == (TRACE_P1_TARGET, False)
    for ps in (16, 64):
        assert trace_target(ps, {TORCH: 5.0}) == (TRACE_TARGET, True)
        assert trace_target(ps, {TORCH: 4.9}) == (TRACE_TARGET, False)
    assert trace_target(64, {NUMPY: 9.0}) == (TRACE_TARGET, None)
    assert full_config().trace_page_sizes == (1, 16, 64)
    assert 1 in quick_config().trace_page_sizes


def test_shuffled_pools_hand_out_the_same_slots_everywhere_and_no_runs() -> None:
    results = {}
    for name, make in implementations(with_torch=False).items():
        pool = make(1024, 4)
        shuffle_free_list(pool, 4, 1024, seed=3)
        results[name] = [np.asarray(pool.alloc(256)).tolist() for _ in range(3)]
    first = results[HOSTPOOL]
    assert all(r == first for r in results.values())
    starts = np.asarray(first[0][::4])
    # Shuffled: far fewer pages follow their predecessor than in a sorted pool.
    assert int((np.diff(starts) == 4).sum()) < 8
    assert sorted(x for r in first for x in r) != list(range(3 * 256))  # not the sorted pool's first pages
    for cfg in (quick_config(), full_config()):
        assert cfg.shuffled_cells
        assert all(ps == 1 for ps, _, _ in cfg.shuffled_cells)
        assert (1, BIG_K, MIB_SLOTS) in cfg.shuffled_cells


def test_a_shuffled_cell_runs_and_says_so() -> None:
    impls = implementations(with_torch=False)
    cell = measure_roundtrip(impls, 1, 64, 1024, repeats=1, min_cycles=1, min_loop_s=0.0, shuffle_seed=0)
    assert cell.params["free_list"] == "shuffled (seed 0)"
    assert set(cell.per_op) == set(impls)
    sorted_cell = measure_roundtrip(impls, 1, 64, 1024, repeats=1, min_cycles=1, min_loop_s=0.0)
    assert sorted_cell.params["free_list"] == "sorted"


def test_compare_times_the_trace_cells(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m bench.compare --only-cells 16:trace``: one row, this checkout against the revision's pool."""
    from bench import compare
    from hostpool_nb import LogicalHostPool

    monkeypatch.setattr(compare, "load_revision", lambda rev: ("0123456789", LogicalHostPool))
    monkeypatch.setattr(compare, "TRACE_OPS", 300)
    assert compare.main(["HEAD", "--only-cells", "16:trace", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "trace: the KV-cache trace" in lines[1]
    row = lines[-1].split()
    assert row[:3] == ["16", "trace", str(1 << 20)]
    assert float(row[-2].rstrip("x")) > 0


def test_compare_rejects_unknown_cells(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import compare

    with pytest.raises(SystemExit) as exc:
        compare.main(["HEAD", "--only-cells", "2:trace"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown cell(s) 2:trace" in err
    assert "1:65536s,1:trace,16:trace,64:trace" in err


# -- the host tier ------------------------------------------------------------------------


def test_the_host_tier_times_every_cell_on_both_sides() -> None:
    from bench import host

    cfg = host.HostConfig(alloc_sizes=(64, 256), reserve_sizes=(64,), mixin_size=64, repeats=2, min_loop_s=0.0)
    cells = host.measure_host(cfg)
    assert [(c.params["through"], c.params["call"], c.params["pool_pages"]) for c in cells] == [
        ("pool", "alloc+free", 64),
        ("pool", "alloc+free", 256),
        ("pool", "reserve+release", 64),
        ("mixin", "alloc+free", 64),
        ("mixin", "reserve+release", 64),
    ]
    for c in cells:
        assert set(c.per_op) == {"hostpool_nb", "numpy"}
        assert all(len(s) == 2 and min(s) > 0 for s in c.samples.values())
    assert [host.params_text(c.params) for c in cells][-2:] == [
        "mixin alloc+free 32 of 64",
        "mixin reserve+release of 64",
    ]
    assert host.target({"through": "pool", "pool_pages": 32768, "call": "alloc+free"}, 999.0) == (
        ">=1000x numpy",
        False,
    )
    assert host.target({"through": "pool", "pool_pages": 32768, "call": "reserve+release"}, 50.0) == (
        ">=50x numpy",
        True,
    )
    assert host.target({"through": "mixin", "pool_pages": 32768, "call": "alloc+free"}, 1.0) == ("", None)


def test_the_host_tier_refuses_implementations_that_disagree(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import host
    from hostpool_nb.originals.host_tier import LRUHostKVPool

    class Reversed(LRUHostKVPool):
        def alloc(self, need_pages: int) -> Any:
            got = super().alloc(need_pages)
            return None if got is None else got[::-1].copy()

    impls = {**host.implementations(), "numpy": Reversed}
    cfg = host.HostConfig(repeats=1, min_loop_s=0.0)
    with pytest.raises(RuntimeError, match="the implementations disagree"):
        host.measure_cell(impls, "alloc+free", 128, cfg, None)


def test_half_full_pools_agree_whichever_way_they_are_filled() -> None:
    from bench import host

    mine, theirs = (host.half_full(make, 10) for make in host.implementations().values())
    assert mine.available_size() == theirs.available_size() == 5
    assert mine.allocated.tolist() == theirs._allocated
    assert mine.generation.tolist() == theirs._generation
    assert mine.alloc(5).tolist() == theirs.alloc(5).tolist() == [5, 6, 7, 8, 9]
