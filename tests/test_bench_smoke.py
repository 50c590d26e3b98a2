"""The benchmark machinery on tiny sizes: same workload everywhere, sane output.

No timing is asserted (speed is never a test); these check that what the
benchmark compares is comparable - the trace replays to identical slot
sequences on hostpool_nb and on the baselines, the counted baselines behave
exactly as the shared ones, the memory accounting agrees with tracemalloc -
and that the JSON, table, plot and progress bar are produced. Fast, and
passes under ``NUMBA_DISABLE_JIT=1``.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest

from bench import report
from bench.baselines import NumpyHostPool
from bench.impls import NumpyBaseline, implementations, merges_of
from bench.memory import measure_memory
from bench.suite import run_suite, tiny_config
from bench.timing import Progress, interleaved
from bench.workloads import TraceDivergence, make_trace, measure_roundtrip, replay
from hostpool_nb import LogicalHostPool

POOL, PAGE = 4096, 16


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
    assert {"round trip", "KV-cache trace", "metadata peak", "memory floor"} <= workloads
    for r in loaded["rows"]:
        assert {"workload", "params", "unit", "values", "ratios", "target", "met"} <= set(r)
        assert r["met"] in (True, False, None)
        for name, ratio in r["ratios"].items():
            assert ratio == pytest.approx(r["values"][name] / r["values"]["hostpool_nb"])

    table = report.render_table(loaded["rows"], torch_present=False)
    header = table.splitlines()[0]
    for col in ("workload", "params", "hostpool_nb", "numpy", "x numpy", "torch", "x torch", "target", "met?"):
        assert col in header
    trace_line = next(line for line in table.splitlines() if line.startswith("KV-cache trace"))
    assert "n/a" in trace_line  # torch columns without torch

    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    cells = [c for c in loaded["raw"]["roundtrip"] if c["workload"] == "round trip"]
    floors = {int(k): v["copy"] for k, v in loaded["raw"]["floors"].items()}
    report.write_plot(png, cells, floors, loaded["machine"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_fallback_and_interleaving() -> None:
    out = io.StringIO()
    bar = Progress(4, stream=out, use_tqdm=False)
    order: list[str] = []
    samples = interleaved(
        {n: (lambda n=n: order.append(n) or 1.0) for n in ("a", "b")},
        repeats=2,
        tick=lambda: (bar.label("x"), bar.step()),
    )
    bar.close()
    assert samples == {"a": [1.0, 1.0], "b": [1.0, 1.0]}
    assert order == ["a", "b", "b", "a"]  # each repeat starts elsewhere
    assert "100%" in out.getvalue() or "[" in out.getvalue()


def test_cli_rejects_unknown_workload() -> None:
    from bench.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--only", "nonsense"])
    assert parse_args(["--only", "trace,memory"]).only == ("trace", "memory")
