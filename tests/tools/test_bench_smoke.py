"""The benchmark: every workload runs and compares like with like, the report says what it measured.

Each workload runs in the tests' tiny mode (pools of a few thousand slots,
one repeat), under the JIT and without it. The checks that make its
figures comparable (every implementation hands out the same slots and
merges as often) must catch a planted difference; the table must fit 80
columns (110 with --wide) and say which targets were missed; the command line must refuse a
mistake in one line, before measuring anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import __main__ as cli
from bench import compare, host, kvtrace, pool
from bench.core import HOSTPOOL, NUMPY, TORCH, WORKLOADS, Context, Row, fmt_count
from bench.report import WIDE, WIDTH, summary, table
from bench.timing import Progress, interleaved, loop_count
from hostpool_nb import LogicalHostPool
from hostpool_nb.originals.sglang import LogicalHostPool as Original


def tiny_context(with_torch: bool = False) -> Context:
    return Context(1.0, pool.implementations(with_torch), tiny=True)


# -- every workload --------------------------------------------------------------------------

TIMED = [n for n in WORKLOADS if n not in ("startup", "recorded")]


@pytest.mark.parametrize("name", TIMED)
def test_every_workload_runs_and_gives_positive_figures(name: str) -> None:
    ctx = tiny_context(with_torch=name == "hicache" and pool.torch_available())
    shares: list[float] = []
    ctx.tick = shares.append
    rows = WORKLOADS[name].run(ctx)
    if name == "hicache" and TORCH not in ctx.impls:  # sglang's host pools keep torch tensors
        assert rows == []
        assert "torch is not in this run" in ctx.notes[0]
        return
    assert rows
    for row in rows:
        assert row.values, row
        assert all(v > 0 for v in row.values.values()), row
        assert HOSTPOOL in row.values
        assert set(row.values) <= set(row.columns) | {HOSTPOOL}
        assert row.met in (None, True, False)
        assert row.met is None or row.target, row  # a verdict is on a target
    assert 0.5 <= sum(shares) <= 1.01  # the progress bar's share of the workload's estimate
    assert ctx.notes


def test_the_workloads_run_in_the_documented_order() -> None:
    assert list(WORKLOADS) == [
        n
        for n in (
            "roundtrip",
            "batch",
            "trace",
            "recorded",
            "tracking",
            "memory",
            "startup",
            "paged",
            "swa",
            "engine",
            "host",
            "hicache",
        )
        if n in WORKLOADS
    ]
    assert all(w.seconds >= 0 for w in WORKLOADS.values())


def test_ratios_are_baseline_over_hostpool_nb() -> None:
    row = Row("w", "p", "s", {HOSTPOOL: 2.0, NUMPY: 3.0, TORCH: 8.0})
    assert row.ratios == {NUMPY: 1.5, TORCH: 4.0}
    assert row.at_least(TORCH, 4).met is True
    assert row.target == ">=4x torch"
    assert row.at_least(NUMPY, 1.6).met is False
    assert Row("w", "p", "s", {HOSTPOOL: 1.0}).at_least(TORCH, 1).met is None  # not measured: no verdict
    row.samples = {HOSTPOOL: [1.0, 2.0], NUMPY: [3.0, 3.0]}
    assert row.paired(NUMPY) == (1.5, 3.0)


# -- comparable figures ------------------------------------------------------------------------


class _Reversed(Original):
    """The original, handing out the same slots in another order: its times would not compare."""

    def alloc(self, need_size: int) -> Any:
        got = super().alloc(need_size)
        return None if got is None else got[::-1]


def test_a_round_trip_of_implementations_that_disagree_is_refused() -> None:
    impls = {HOSTPOOL: LogicalHostPool, NUMPY: _Reversed}
    with pytest.raises(pool.Divergence, match="handed out other slots"):
        pool.measure_roundtrip(impls, 16, 64, 1024, 1, 0.0, 0.0)


def test_a_trace_of_implementations_that_disagree_is_refused() -> None:
    impls = {HOSTPOOL: LogicalHostPool, NUMPY: _Reversed}
    with pytest.raises(pool.Divergence, match="handed out other slots"):
        kvtrace.measure_trace(impls, kvtrace.make_trace(4096, 16, 200), 1)


def test_a_batch_of_implementations_that_disagree_is_refused() -> None:
    ctx = tiny_context()
    with pytest.raises(pool.Divergence, match="batch of 4"):
        pool.measure_batch({HOSTPOOL: LogicalHostPool, NUMPY: _Reversed}, 16, 4, 1024, ctx)


def test_round_trips_that_merge_unequally_are_refused() -> None:
    class NeverMerges(Original):
        def _merge(self) -> None:
            if self.release_list:
                super()._merge()
                self.merges -= 1

    with pytest.raises(pool.Divergence, match="merges differ"):
        pool.measure_roundtrip({HOSTPOOL: LogicalHostPool, NUMPY: NeverMerges}, 16, 64, 1024, 1, 0.0, 0.0)


def test_a_shuffled_free_list_hands_out_pages_in_no_order() -> None:
    p = LogicalHostPool(4096, 16)
    pool.shuffle_free_list(p, 16, 4096)
    pages = p.alloc(4096)[::16] // 16
    assert sorted(pages.tolist()) == list(range(256))
    assert np.count_nonzero(np.diff(pages) == 1) < 16  # hardly a run of consecutive pages left


def test_the_trace_is_reproducible_and_feasible() -> None:
    a, b = kvtrace.make_trace(1 << 14, 16, 500, seed=3), kvtrace.make_trace(1 << 14, 16, 500, seed=3)
    assert a.ops == b.ops
    assert a.ops != kvtrace.make_trace(1 << 14, 16, 500, seed=4).ops
    assert len(a.ops) >= 500
    assert a.stats["failed_allocs"] > 0  # the pool runs full: refusals are part of the trace
    assert all(k % 16 == 0 for k, _ in a.ops)
    kvtrace.replay(LogicalHostPool(1 << 14, 16), a)  # raises if an answer differs from the trace's


@pytest.mark.parametrize("locked", [False, True])
def test_the_trace_floor_hands_out_what_a_pool_would(locked: bool) -> None:
    floor = kvtrace.TraceFloor(64, 16, locked=locked)
    got = floor.alloc(48)
    assert got is not None
    assert got.shape == (48,)
    assert floor.alloc(32) is None  # 16 left: refused as a pool refuses
    assert floor.free(got) == 48
    assert floor.alloc(64) is not None
    if locked:
        assert floor.lock is not None
        assert floor.lock.acquire(timeout=1)
        floor.lock.release()


def test_loop_count_bounds_both_ends() -> None:
    assert loop_count({"a": 0.001, "b": 0.01}, 0.05, 1.0) == 50  # the fastest loop lasts min_loop_s
    assert loop_count({"a": 0.001, "b": 0.5}, 0.05, 1.0) == 3  # the slowest at most max_loop_s, 3 cycles at least


def test_interleaved_rotates_who_goes_first() -> None:
    order: list[str] = []
    runners = {n: (lambda n=n: order.append(n) or 1.0) for n in "abc"}
    samples = interleaved(runners, 3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert samples == {n: [1.0] * 3 for n in "abc"}


def test_half_full_host_pools_agree_whichever_way_they_are_filled() -> None:
    mine, theirs = (host.half_full(make, 10) for make in host.implementations().values())
    assert mine.available_size() == theirs.available_size() == 5
    assert mine.allocated.tolist() == theirs._allocated
    assert mine.generation.tolist() == theirs._generation
    assert mine.alloc(5).tolist() == theirs.alloc(5).tolist() == [5, 6, 7, 8, 9]


def test_the_host_tier_refuses_implementations_that_disagree() -> None:
    from hostpool_nb.originals.host_tier import LRUHostKVPool

    class Reversed(LRUHostKVPool):
        def alloc(self, need_pages: int) -> Any:
            got = super().alloc(need_pages)
            return None if got is None else got[::-1].copy()

    impls = {**host.implementations(), NUMPY: Reversed}
    with pytest.raises(RuntimeError, match="the implementations disagree"):
        host.measure_cell(impls, "alloc+free", 128, host.HostConfig(repeats=1, min_loop_s=0.0), None)


def test_host_targets() -> None:
    assert host.target({"through": "pool", "pool_pages": 32768, "call": "alloc+free"}, 999.0) == (
        ">=1000x numpy",
        False,
    )
    assert host.target({"through": "pool", "pool_pages": 32768, "call": "reserve+release"}, 50.0) == (
        ">=50x numpy",
        True,
    )
    # Every operation through the mixin: at least as fast as the host class alone, at every size.
    assert host.target({"through": "mixin", "pool_pages": 64, "call": "staging 8"}, 1.0) == (">=1x numpy", True)
    assert host.target({"through": "mixin", "pool_pages": 64, "call": "release"}, 0.99) == (">=1x numpy", False)
    assert host.target({"through": "pool", "pool_pages": 64, "call": "alloc+free"}, 1.0) == ("", None)


# -- the report ------------------------------------------------------------------------------


def _rows() -> list[Row]:
    return [
        Row("round trip", "p64 k=64 pool=1M", "s", {HOSTPOOL: 7.3e-7, NUMPY: 1.2e-6}).at_least(TORCH, 8),
        Row("host tier", "mixin reserve+release, 32K", "s", {HOSTPOOL: 8e-7, NUMPY: 1.1e-4}, columns=(HOSTPOOL, NUMPY)),
        Row("metadata peak", "16M slots p64 merge", "B/page", {HOSTPOOL: 5.0, NUMPY: 1160.0}),
        Row("vs locked floor", "p1 pool=1M 30K ops", "x", {HOSTPOOL: 1.9}, "<=1.3x", False, columns=(HOSTPOOL,)),
        Row("recorded trace", "a/very/long/path/to/a/trace/file/serve.trace 12 ops", "s", {HOSTPOOL: 1e-6}),
    ]


def test_the_table_fits_80_columns_and_says_what_each_cell_is() -> None:
    text = table(_rows(), torch_ran=False)
    lines = text.splitlines()
    assert max(map(len, lines)) <= WIDTH == 80
    head = lines[0].split()
    assert head == ["workload", "/", "params", "hostpool_nb", "x", "numpy", "target", "met?"]  # no torch column
    assert lines[2] == "round trip"  # each workload's name a line above its rows
    assert lines[3].startswith("- p64 k=64 pool=1M")
    assert "730 ns" in lines[3]
    assert "1.64x" in lines[3]
    assert lines[3].split()[-2:] == ["-", "-"]  # its only target is torch's: not measured, not shown
    host_line = lines[lines.index("host tier") + 1]
    assert "138x" in host_line
    assert "5 B/pg" in text
    assert lines[-2] == "[1] mixin reserve+release, 32K"  # params too long for the column: footnotes
    assert lines[-1].startswith("[2] a/very/long/path")


def test_with_torch_the_table_still_fits_and_a_bound_on_both_baselines_reads_once() -> None:
    rows = [
        Row("round trip", "p1 k=65536 pool=1M", "s", {HOSTPOOL: 3e-5, NUMPY: 4e-5, TORCH: 7e-5})
        .at_least(TORCH, 1)
        .at_least(NUMPY, 1),
        Row("round trip", "p1 k=65536 shuffled", "s", {HOSTPOOL: 2e-4, NUMPY: 4e-5, TORCH: 1e-4})
        .at_least(TORCH, 0.5)
        .at_least(NUMPY, 0.15),
        Row("batch round trip", "p64 1024 reqs pool=1M 24", "s", {HOSTPOOL: 1.2e-6, NUMPY: 1.2e-4, TORCH: 6e-4}),
        Row("paged allocator", "free 2048 tok, 62.5K free", "s", {HOSTPOOL: 8.7e-6, NUMPY: 8.7e-3}),
        *_rows(),
    ]
    text = table(rows, torch_ran=True)
    assert max(map(len, text.splitlines())) <= WIDTH
    first = text.splitlines()[3]
    assert first.split()[-3:] == [">=1x", "both", "yes"]
    assert ">=0.5x torch, >=0.15x numpy" in text  # mixed bounds: a footnote
    assert rows[1].met is True
    assert rows[1].target == ">=0.5x torch, >=0.15x numpy"
    wide = table(rows, torch_ran=True, wide=True)
    assert wide.splitlines()[0].split()[:2] == ["workload", "params"]
    assert max(map(len, wide.splitlines())) <= WIDE
    assert "round trip" in wide.splitlines()[2]


def test_a_bound_on_numpy_is_judged_without_torch() -> None:
    row = Row("round trip", "p", "s", {HOSTPOOL: 1.0, NUMPY: 2.0}).at_least(TORCH, 1).at_least(NUMPY, 1.5)
    assert row.met is True  # torch's bound is not measured, numpy's is met
    assert row.at_least(NUMPY, 3).met is False


def test_off_a_terminal_it_says_as_each_workload_ends(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--only", "memory", "--no-torch"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("bench: 1 workload, about ")
    assert out[1].startswith("bench: memory done (1 of 1, ")
    assert max(map(len, out)) <= WIDTH  # the progress lines too: a log read in an 80-column terminal
    assert cli.main(["--only", "memory", "--no-torch", "--no-progress"]) == 0
    assert not any(line.startswith("bench: ") for line in capsys.readouterr().out.splitlines())


def test_the_summary_counts_the_targets_and_says_which_misses_are_known_and_why() -> None:
    rows = _rows()
    rows[0].met = True
    unknown = Row("batch round trip", "p64 256 reqs pool=1M", "s", {HOSTPOOL: 1e-6}, ">=50x numpy", False)
    lines = summary([*rows, unknown]).splitlines()
    assert lines[0] == "targets: 1 of 3 met"
    assert lines[1] == "missed, known (docs/benchmarks.md, 'Where it loses', says why):"
    assert lines[2].startswith("- vs locked floor p1 pool=1M 30K ops (<=1.3x): the page-size-1 trace's lists")
    assert lines[3].startswith("missed, not known (a change, or a machine busy or unlike this project's")
    assert lines[4] == "- batch round trip p64 256 reqs pool=1M (>=50x numpy)"
    assert summary(rows[:1]) == "targets: 1 of 1 met"


def test_every_known_miss_names_a_workload_the_bench_has_and_the_docs_section_exists() -> None:
    from bench.report import KNOWN_MISSES

    docs = (Path(__file__).parents[2] / "docs" / "benchmarks.md").read_text()
    assert "Where it loses" in docs
    workloads = {"round trip", "vs locked floor", "KV-cache trace", "host tier", "cold start", "tracking"}
    assert {w for w, _ in KNOWN_MISSES} <= workloads | {"paged allocator"}


def test_counts_are_short() -> None:
    assert [fmt_count(n) for n in (1 << 20, 4096, 62_500, 1_000_000, 300, 30_000)] == [
        "1M",
        "4K",
        "62.5K",
        "1M",
        "300",
        "30K",
    ]


def test_progress_counts_estimated_seconds_and_stays_quiet_off_a_terminal() -> None:
    class NotATty:
        def isatty(self) -> bool:
            return False

    bar = Progress(10.0, stream=NotATty())  # type: ignore[arg-type]
    assert not bar.shown
    bar.advance(2.5)
    bar.reach(2.0)  # never backwards
    bar.reach(6.0)
    assert bar._done == 6.0
    bar.close()


def test_the_bar_never_passes_its_end_and_its_eta_is_the_estimates_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal: a workload that reports more than its estimate does not overshoot (tqdm would warn), and
    the time left is what the estimates say, not a rate taken while the first workload compiles."""
    import io
    import warnings

    from bench import timing

    pytest.importorskip("tqdm")
    monkeypatch.setattr(timing, "_columns", lambda stream: 100)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TqdmWarning: clamping frac to range [0, 1]
        bar = Progress(100.0, stream=stream)
        assert bar.shown
        bar.advance(30.0)
        assert "about 1:10 left by the estimates" in stream.getvalue()
        bar.advance(500.0)  # far more than the rest
        bar.reach(200.0)
        assert bar._done == 100.0
        assert "about 0:00 left by the estimates" in stream.getvalue()
        assert "elapsed, about" in stream.getvalue()
        assert ", ," not in stream.getvalue()  # tqdm's own comma before the postfix, once
        bar.close()


def test_a_terminal_of_no_width_gets_a_line_per_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bar on a pseudo-terminal of zero columns printed nothing for the whole run."""
    import io

    from bench import timing

    pytest.importorskip("tqdm")
    monkeypatch.setattr(timing, "_columns", lambda stream: 0)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    bar = Progress(100.0, stream=stream)
    assert not bar.shown
    for text in ("host: page size 64", "host: page size 64", "paged: free"):
        bar.label(text)
        bar.advance(10.0)
    bar.close()
    assert stream.getvalue() == "host: page size 64\npaged: free\n"


def test_startup_says_each_process_as_it_ends(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import startup

    monkeypatch.setattr(startup, "run_python", lambda code, cache_dir=None, timeout=600.0: 0.5)
    assert startup.main(["--repeats", "1", "--warmup-repeats", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "7 fresh processes, one after another; a line on stderr as each ends"
    assert err[1] == "  [1/7] python -m hostpool_nb.warmup, filling the warm cache: 0.5 s"
    assert err[-1] == "  [7/7] python -m hostpool_nb.warmup, empty cache: 0.5 s"
    assert len(err) == 8


def test_the_startup_workload_moves_the_bar_as_each_process_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import startup

    monkeypatch.setattr(startup, "run_python", lambda code, cache_dir=None, timeout=600.0: 0.5)
    ctx = tiny_context()
    shares: list[float] = []
    ctx.tick = shares.append
    startup.startup(ctx)
    assert len(shares) >= 3  # a tick per process, not one at the end
    assert abs(sum(shares) - 1.0) < 1e-9


# -- the command line ---------------------------------------------------------------------------


def _exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    err = capsys.readouterr().err
    return int(info.value.code or 0), err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--only", "nosuch"], "--only: unknown workload(s) nosuch; choose from"),
        (["--only", ","], "--only: unknown workload(s) (none)"),
        (["--scale", "0"], "--scale must be positive, got 0.0"),
        (["--torch-threads", "-1"], "--torch-threads must be 0 (torch's default) or more, got -1"),
        (["--json", "/no/such/dir/out.json"], "cannot write --json /no/such/dir/out.json: directory /no/such/dir"),
        (["--plot", "/"], "cannot write --plot /: it is a directory"),
        (["--trace", "/no/such.trace"], "--trace /no/such.trace: [Errno 2] No such file or directory"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--max-pool-bytes", "100"], "--max-pool-bytes bounds the pools of --trace: give --trace PATH too"),
    ],
)
def test_a_mistake_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _exit(argv, capsys)
    assert code == 2
    assert err.startswith(f"python -m bench: error: {message}")
    assert err.count("\n") == 1


def test_a_trace_too_large_to_time_is_one_line_naming_the_option_that_raises_the_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.npz"
    p = LogicalHostPool(1 << 20, 64)
    with p.recording(path):
        p.free(p.alloc(1 << 20))
    code, err = _exit(["--trace", str(path), "--max-pool-bytes", "1000000"], capsys)
    assert code == 2
    assert err.startswith(f"python -m bench: error: --trace {path}: the recorded pool (size=1048576, page_size=64)")
    assert err.rstrip().endswith("raise --max-pool-bytes to replay it")
    assert err.count("\n") == 1
    code, err = _exit(["--trace", str(path), "--max-pool-bytes", "0"], capsys)
    assert (code, err) == (2, "python -m bench: error: --max-pool-bytes must be positive, got 0\n")
    assert cli.parse_args(["--trace", str(path), "--max-pool-bytes", str(1 << 26)]).max_pool_bytes == 1 << 26


def test_full_is_scale_3_and_a_trace_alone_times_only_the_trace(tmp_path: Path) -> None:
    assert cli.parse_args(["--full"]).scale == cli.FULL_SCALE == 3.0
    path = tmp_path / "t.npz"
    p = LogicalHostPool(64, 16)
    with p.recording(path):
        p.free(p.alloc(32))
    assert cli.parse_args(["--trace", str(path)]).only == ["recorded"]
    assert cli.parse_args(["--trace", str(path), "--only", "host"]).only == ["host"]
    # Options that say nothing of what runs leave the trace alone; those that do run the rest too.
    for more in (["--no-progress"], ["--no-torch", "--json", str(tmp_path / "o.json")], ["--torch-threads", "2"]):
        assert cli.parse_args(["--trace", str(path), *more]).only == ["recorded"], more
    for more in (["--full"], ["--scale", "1"], ["--scale", "2"]):
        assert cli.parse_args(["--trace", str(path), *more]).only is None, more


def test_help_says_how_long_and_how_to_scale(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = _exit(["--help"], capsys)
    assert code == 0


def test_a_run_writes_its_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = cli.Context

    def tiny(*args: Any, **kwargs: Any) -> Context:
        return real(*args, **kwargs, tiny=True)

    monkeypatch.setattr(cli, "Context", tiny)
    out = tmp_path / "r.json"
    assert cli.main(["--only", "host,tracking", "--no-torch", "--no-progress", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "host tier" in printed
    assert "targets: " in printed
    assert max(map(len, printed.splitlines())) <= WIDTH
    doc = json.loads(out.read_text())
    assert doc["schema"] == 2
    assert {r["workload"] for r in doc["rows"]} == {"host tier", "tracking", "tracking state"}
    assert doc["machine"]["cpu_count"] >= 1
    assert all(r["ratios"] == Row(**{k: v for k, v in r.items() if k != "ratios"}).ratios for r in doc["rows"])


def test_a_recorded_trace_is_timed_on_every_implementation(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    p = LogicalHostPool(1024, 16)
    with p.recording(path):
        for _ in range(60):
            held = [p.alloc(64) for _ in range(2)]
            for h in held:
                p.free(h)
    ctx = tiny_context()
    ctx.raw["trace_path"] = str(path)
    (row,) = WORKLOADS["recorded"].run(ctx)
    assert set(row.values) == {HOSTPOOL, NUMPY}
    assert row.params == f"{path} 240 ops"


def test_a_recorded_trace_too_short_to_time_is_a_note_not_a_row(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    p = LogicalHostPool(1024, 16)
    with p.recording(path):
        p.free(p.alloc(64))
    ctx = tiny_context()
    ctx.raw["trace_path"] = str(path)
    assert WORKLOADS["recorded"].run(ctx) == []
    assert any("not timed: 2 operations are too few to time" in note for note in ctx.notes), ctx.notes


# -- bench.compare ---------------------------------------------------------------------------------


def test_compare_times_a_cell_against_a_revision(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hostpool_nb

    monkeypatch.setattr(compare, "load_revision", lambda rev: ("0123456789", hostpool_nb))
    monkeypatch.setattr(compare, "TRACE_OPS", 200)
    cells = "16:trace,64:64t,paged:decode,paged:free,swa:extend,swa:free_swa"
    assert compare.main(["HEAD", "--only-cells", cells, "--repeats", "1", "--min-loop", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("this checkout against HEAD (0123456789)")
    assert [line.split()[0] for line in out[2:]] == cells.split(",")


def test_compare_run_mode_prints_one_json_line_per_cell_importing_in_the_order_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hostpool_nb

    loaded: list[str] = []
    monkeypatch.setattr(compare, "load_revision", lambda rev: (loaded.append(rev), ("0123456789", hostpool_nb))[1])
    for order in ("this-first", "rev-first"):
        args = ["v1", "--only-cells", "64:64,16:16", "--repeats", "1", "--min-loop", "0", "--run", order]
        assert compare.main(args) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [(d["cell"], d["sha"]) for d in lines] == [("64:64", "0123456789"), ("16:16", "0123456789")]
        assert all(d["this"] > 0 and d["rev"] > 0 for d in lines)
    assert loaded == ["v1", "v1"]


def test_compare_runs_gives_each_cells_median_ratio_over_processes_alternating_the_import_order(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[list[str]] = []
    rev_times = iter([2.0, 1.0, 3.0, 1.5, 1.0, 1.0])  # per run, against this = 1.0: ratios 2, 1, 3; 1.5, 1, 1

    class Done:
        returncode = 0
        stderr = ""

        def __init__(self, command: list[str]) -> None:
            cell = command[command.index("--only-cells") + 1]
            line = {"cell": cell, "sha": "0123456789", "this": 1.0, "rev": next(rev_times)}
            self.stdout = "compiling...\n" + json.dumps(line) + "\n"

    def run(command: list[str], **_: Any) -> Done:
        seen.append(command)
        return Done(command)

    monkeypatch.setattr(compare.subprocess, "run", run)
    assert compare.main(["v1", "--runs", "3", "--only-cells", "64:64,16:16", "--repeats", "2"]) == 0
    assert [c[c.index("--run") + 1] for c in seen] == ["this-first", "rev-first", "this-first"] * 2
    assert all(c[c.index("--repeats") + 1] == "2" and c[c.index("bench.compare") + 1] == "v1" for c in seen)
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["64:64", "16:16"]
    assert rows[0].split()[-2:] == ["2x", "1.00..3.00"]
    assert rows[1].split()[-2:] == ["1x", "1.00..1.50"]


def test_compare_runs_stops_at_a_failed_run(monkeypatch: pytest.MonkeyPatch) -> None:
    class Failed:
        returncode, stdout, stderr = 1, "", "boom\n"

    monkeypatch.setattr(compare.subprocess, "run", lambda command, **_: Failed())
    with pytest.raises(SystemExit, match="run 1 of 64:64 failed \\(exit 1\\)"):
        compare.main(["v1", "--runs", "2", "--only-cells", "64:64"])
    with pytest.raises(SystemExit) as refused:
        compare.main(["v1", "--runs", "0"])
    assert refused.value.code == 2


def test_compare_refuses_an_unknown_cell(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        compare.main(["HEAD", "--only-cells", "2:trace"])
    assert info.value.code == 2
    assert "--only-cells: unknown cell(s) 2:trace" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "-0.01", "61", "1e400"])
def test_compare_refuses_a_loop_length_that_times_nothing(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        compare.main(["HEAD", "--min-loop", value, "--only-cells", compare.CELLS[0]])
    assert info.value.code == 2
    assert "--min-loop: " in capsys.readouterr().err


def test_the_startup_ranges_refuse_no_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import startup

    for bad in (["--repeats", "0"], ["--warmup-repeats", "0"]):
        with pytest.raises(SystemExit) as exited:
            startup.main(bad)
        assert exited.value.code == 2
        assert "--repeats and --warmup-repeats must be at least 1" in capsys.readouterr().err


def test_bench_trace_times_an_allocators_recording(tmp_path: Path) -> None:
    from hostpool_nb.paged import TokenToKVPoolAllocator

    a = TokenToKVPoolAllocator(256, None)
    with a.recording(tmp_path / "t.npz"):
        for _ in range(60):
            a.free(a.alloc(100))
    out = tmp_path / "bench.json"
    assert cli.main(["--trace", str(tmp_path / "t.npz"), "--json", str(out), "--no-progress"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["params"]) for r in rows] == [("recorded trace", f"{tmp_path / 't.npz'} 120 ops")]


def test_a_run_that_judged_no_target_says_so_not_0_of_0() -> None:
    """bench --trace ended "targets: 0 of 0 met"."""
    row = Row("recorded trace", "t.npz 120 ops", "s", {HOSTPOOL: 1e-6, NUMPY: 2e-6})
    assert row.met is None
    assert summary([row]) == "no targets judged here (a trace's rows have none)"
    assert summary([row.at_least(NUMPY, 1.0)]).startswith("targets: 1 of 1 met")


def test_the_sglang_host_tier_cells_refuse_to_time_sides_that_disagree() -> None:
    pytest.importorskip("torch")
    from bench import hicache
    from hostpool_nb.originals import sglang_host

    cell = hicache.cells(tiny=True)[1]  # one page of 16 slots
    original, ours = sglang_host.hierarchy(), sglang_host.hierarchy()
    hand_out = ours["HostKVCache"].alloc

    def from_the_back(self, need_size):  # type: ignore[no-untyped-def]
        got = hand_out(self, need_size)
        return None if got is None else got.flip(0)

    ours["HostKVCache"].alloc = from_the_back
    with pytest.raises(RuntimeError, match="disagree on the first cycle"):
        hicache.measure(cell, original, ours, repeats=1, loop_s=0.0)
    ours["HostKVCache"].alloc = hand_out
    samples = hicache.measure(cell, original, ours, repeats=2, loop_s=0.0)
    assert {k: len(v) for k, v in samples.items()} == {"torch": 2, "hostpool_nb": 2, "tracked": 2}


# -- the engine timing script's figures (tests/engine/timing.py; the engine itself runs in CI's engine job) -----


def _engine_run(requests: list[Any], first_ns: int = 2_000_000) -> dict[str, Any]:
    """One run's record as the launcher and the scheduler's clock leave it."""
    return {
        "requests": requests,
        "first_request_seconds": 1.5,
        "batch_seconds": 10.0,
        "tokens": 500,
        "timing": {
            "first": {"allocator.free": first_ns, "allocator.available_size": 1_000},
            "steady": {"allocator.free": [3_000, 5_000], "allocator.available_size": [500] * 10},
            "shapes": {},
            "construction": [30_000_000],
            "scheduler": {"busy_ns": 50_000_000, "forward_ns": 30_000_000, "steps": 4, "idle_ns": 0},
            "first_request_ns": 250_000,
        },
    }


def test_the_engine_timing_adds_up_a_runs_calls() -> None:
    from tests.engine import timing

    s = timing.summarise(_engine_run([]))
    assert s["first_calls_ms"] == pytest.approx(2.001)
    assert s["steady_ms"] == pytest.approx(0.013)
    assert s["serving_ms"] == pytest.approx(2.014)
    assert s["calls"] == 14  # each method's first call and its steady ones
    assert s["allocator_ms_per_step"] == pytest.approx(2.014 / 4)
    assert s["outside_forward_ms_per_step"] == pytest.approx(5.0)  # (50 - 30) ms over 4 steps
    assert s["construction_ms"] == pytest.approx(30.0)
    assert s["allocator_in_first_request_ms"] == pytest.approx(0.25)
    assert s["tokens_per_s"] == pytest.approx(50.0)


def test_the_engine_timing_says_when_the_outputs_differ() -> None:
    from tests.engine import timing

    def run(*requests: tuple[list[int], int]) -> dict[str, Any]:
        return _engine_run([{"output_ids": ids, "cached_tokens": hit} for ids, hit in requests])

    same = {"plain": [run(([1, 2], 0), ([4], 60))], "installed": [run(([1, 2], 0), ([4], 60))]}
    differ = {"plain": [run(([1, 2], 0), ([4], 60))], "installed": [run(([1, 3], 0), ([4], 60))]}
    # A cache hit that moved with timing is reported, not an error: the tokens are what must not change.
    moved = {"plain": [run(([1, 2], 0), ([4], 60))], "installed": [run(([1, 2], 0), ([4], 0))]}
    assert timing._identical(same)
    assert not timing._identical(differ)
    assert timing._identical(moved)
    report = timing._report({"p16-64K": differ})
    assert "outputs identical: False" in report
    assert "allocator while serving" in report
    assert "outputs identical: True" in timing._report({"p16-64K": moved})
    assert "cache hits moved with timing in at most 1 requests" in timing._report({"p16-64K": moved})
    assert "at most 0 requests" in timing._report({"p16-64K": same})


def test_the_engine_timing_workload_is_the_same_every_time() -> None:
    from tests.engine import timing

    prompts = timing.workload(200)
    assert prompts == timing.workload(200)
    lengths = [len(p.split()) for p in prompts]
    assert min(lengths) >= 100
    assert max(lengths) + 16 < 512  # the tiny model's context, new tokens included
    shared = {" ".join(p.split()[:60]) for i, p in enumerate(prompts) if i % 4}
    assert len(shared) == 6  # three prompts in four begin with one of six prefixes
