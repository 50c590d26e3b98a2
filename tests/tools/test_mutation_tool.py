"""The mutation-testing command's own logic: sampling a session and the score's interval."""

from __future__ import annotations

import argparse
import sqlite3
from pathlib import Path

import pytest

from tests import mutation


def _session(path: Path, jobs: int) -> Path:
    """A session file with cosmic-ray's two job tables, ``jobs`` mutants in each."""
    db = sqlite3.connect(path)
    db.execute("create table work_items (job_id text primary key)")
    db.execute("create table mutation_specs (job_id text, module_path text)")
    db.execute("create table work_results (job_id text, worker_outcome text, test_outcome text, output text)")
    db.executemany("insert into work_items values (?)", [(f"j{i:04d}",) for i in range(jobs)])
    db.executemany("insert into mutation_specs values (?, 'm.py')", [(f"j{i:04d}",) for i in range(jobs)])
    db.commit()
    db.close()
    return path


def _jobs(path: Path) -> tuple[list[str], list[str]]:
    db = sqlite3.connect(path)
    try:
        items = [r[0] for r in db.execute("select job_id from work_items order by job_id")]
        specs = [r[0] for r in db.execute("select job_id from mutation_specs order by job_id")]
    finally:
        db.close()
    return items, specs


def test_a_sample_keeps_that_many_mutants_the_same_for_a_seed(tmp_path: Path) -> None:
    a = _session(tmp_path / "a.sqlite", 200)
    b = _session(tmp_path / "b.sqlite", 200)
    c = _session(tmp_path / "c.sqlite", 200)
    assert mutation.sample_session(a, 30, seed=1) == (30, 200)
    assert mutation.sample_session(b, 30, seed=1) == (30, 200)
    assert mutation.sample_session(c, 30, seed=2) == (30, 200)
    items, specs = _jobs(a)
    assert len(items) == 30
    assert items == specs  # a mutant's spec goes with it
    assert _jobs(b)[0] == items
    assert _jobs(c)[0] != items
    assert mutation.sampled_from(a) == 200
    assert mutation.counts(a)["total"] == 30


def test_a_sample_larger_than_the_session_keeps_everything(tmp_path: Path) -> None:
    a = _session(tmp_path / "a.sqlite", 12)
    assert mutation.sample_session(a, 50, seed=0) == (12, 12)
    assert len(_jobs(a)[0]) == 12
    assert mutation.sampled_from(a) == 12
    assert mutation.sampled_from(_session(tmp_path / "full.sqlite", 5)) is None


@pytest.mark.parametrize(("killed", "decided"), [(95, 100), (480, 500), (10, 10), (0, 7)])
def test_the_interval_holds_the_score_and_narrows_with_the_sample(killed: int, decided: int) -> None:
    lo, hi = mutation.interval(killed, decided)
    assert 0.0 <= lo <= killed / decided <= hi <= 1.0
    lo4, hi4 = mutation.interval(4 * killed, 4 * decided)
    assert hi4 - lo4 < hi - lo
    assert mutation.interval(0, 0) == (0.0, 1.0)


def test_every_module_of_the_library_is_in_exactly_one_group_whose_tests_exist() -> None:
    """The groups drift as modules land: each module (but the packages' fronts and the warm-up command) in one."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[2]
    groups = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["cosmic-ray"]["groups"]
    where: dict[str, list[str]] = {}
    for group in groups:
        for module in group["modules"]:
            where.setdefault(module, []).append(group["name"])
        for word in group["test-command"].split():
            if word.startswith("tests/"):  # a file, or one test of it
                assert (root / word.split("::")[0]).is_file(), (group["name"], word)
    package = root / "hostpool_nb"
    modules = {
        p.relative_to(root).as_posix()
        for p in package.rglob("*.py")
        if p.name != "__init__.py" and "originals" not in p.parts and "__pycache__" not in p.parts
    }
    # warmup: no group's tests reach it. short.py: the short free's template, which runs as _kernels/flat.py (judged
    # there; only tests/flatten.py reads the template) beside the two flags and SHORT_SLOTS: its mutants never run.
    modules -= {"hostpool_nb/warmup.py", "hostpool_nb/_kernels/short.py"}
    assert sorted(m for m in modules if m not in where) == []
    assert {m: g for m, g in where.items() if len(g) != 1} == {}


def test_a_group_whose_tests_fail_unmutated_is_refused_before_any_mutant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every mutant of such a group would 'die': the tool must stop, not score it."""
    failing = {"name": "g", "test-command": "{python} -c \"import sys; print('unmutated run'); sys.exit(3)\""}
    with pytest.raises(SystemExit, match="group g: the tests fail without any mutation"):
        mutation.baseline(failing)
    assert "unmutated run" in capsys.readouterr().err
    mutation.baseline({"name": "g", "test-command": "{python} -c pass"})  # a passing group goes on

    # The planted bugs are judged by the core group's tests: those are checked first too.
    monkeypatch.setattr(mutation, "load_config", lambda: {"groups": [{**failing, "name": "core"}]})
    planted: list[object] = []

    def plant(*bug: object) -> bool:
        planted.append(bug)
        return True

    monkeypatch.setattr(mutation, "_run_planted_one", plant)
    with pytest.raises(SystemExit, match="group core: the tests fail without any mutation"):
        mutation.run_planted(1)
    assert planted == []


def test_a_session_is_not_run_when_its_group_fails_unmutated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh, resumed and --retest-survivors runs all check the unmutated code before a worker starts."""
    session = _session(tmp_path / "g.sqlite", 4)
    monkeypatch.setattr(mutation, "SESSIONS", tmp_path)
    started: list[int] = []
    monkeypatch.setattr(mutation, "workers", lambda n, *a: started.append(n))
    group = {"name": "g", "modules": ["m.py"], "test-command": '{python} -c "raise SystemExit(1)"'}
    for flags in ([], ["--fresh"], ["--retest-survivors"]):
        args = argparse.Namespace(
            module=None,
            retest_survivors="--retest-survivors" in flags,
            fresh="--fresh" in flags,
            sample=None,
            jit=False,
        )
        with pytest.raises(SystemExit, match="fail without any mutation"):
            mutation.run_group({}, group, args)
    assert started == []
    assert session.exists()  # a refused run leaves the old session as it was


def test_a_mutant_gets_three_times_the_unmutated_run_and_timeouts_are_counted_apart(tmp_path: Path) -> None:
    """A timeout counts as a kill (a loop made endless), so a limit below the tests' own time would fake kills."""
    assert mutation.session_timeout({"timeout": 90.0}, 10.0) == 90.0
    assert mutation.session_timeout({"timeout": 90.0}, 70.0) == 210.0
    # past three times 93 s the http distributor would stop waiting first: the limit stays below it
    assert mutation.session_timeout({"timeout": 90.0}, 117.0) == mutation.HTTP_WAIT_S - 20.0
    session = _session(tmp_path / "s.sqlite", 5)
    db = sqlite3.connect(session)
    db.executemany(
        "insert into work_results (job_id, worker_outcome, test_outcome) values (?, ?, ?)",
        [("j0000", "NORMAL", "KILLED"), ("j0001", "NORMAL", "KILLED"), ("j0002", "NORMAL", "SURVIVED")],
    )
    db.execute("update work_results set output = 'timeout' where job_id = 'j0001'")
    db.commit()
    db.close()
    c = mutation.counts(session)
    assert (c["killed"], c["timeouts"], c["survived"], c["pending"]) == (2, 1, 1, 2)


def test_jit_runs_keep_sessions_of_their_own() -> None:
    group = {"name": "paged"}
    assert mutation.session_path(group, False).name == "paged.sqlite"
    assert mutation.session_path(group, True).name == "paged-jit.sqlite"


def test_retesting_forgets_the_survivors_and_the_worker_errors_only(tmp_path: Path) -> None:
    import sqlite3

    session = tmp_path / "g.sqlite"
    db = sqlite3.connect(session)
    db.execute("create table work_results (job_id text, worker_outcome text, test_outcome text, output text)")
    rows = [
        ("survived", "NORMAL", "SURVIVED", ""),
        ("killed", "NORMAL", "KILLED", ""),
        ("timed out", "NORMAL", "KILLED", "timeout"),
        ("worker error", "EXCEPTION", "INCOMPETENT", "TimeoutError"),
        ("skipped", "SKIPPED", "INCOMPETENT", ""),
    ]
    db.executemany("insert into work_results values (?, ?, ?, ?)", rows)
    db.commit()
    db.close()
    assert mutation.reset_survivors(session) == 2
    db = sqlite3.connect(session)
    left = sorted(r[0] for r in db.execute("select job_id from work_results"))
    db.close()
    assert left == ["killed", "skipped", "timed out"]


def test_mutants_of_type_annotations_are_told_from_mutants_of_code(tmp_path: Path) -> None:
    import sqlite3

    source = (
        "from __future__ import annotations\n"
        "def f(x: int | None = 1, *a: int | str, **k: bytes | None) -> list[int] | None:\n"
        "    y: int | str = x | 2\n"
        "    return y\n"
    )
    (tmp_path / "m.py").write_text(source)
    line2, line3 = source.splitlines()[1], source.splitlines()[2]
    at = {
        "x's": (2, line2.index("|")),
        "*a's": (2, line2.index("|", line2.index("*a"))),
        "**k's": (2, line2.index("|", line2.index("**k"))),
        "return's": (2, line2.rindex("|")),
        "y's": (3, line3.index("|")),
        "code": (3, line3.rindex("|")),
        "default": (2, line2.index("1")),
    }
    session = tmp_path / "s.sqlite"
    db = sqlite3.connect(session)
    db.execute(
        "create table mutation_specs (job_id text, module_path text, start_pos_row integer, start_pos_col integer, "
        "end_pos_row integer, end_pos_col integer)"
    )
    db.executemany(
        "insert into mutation_specs values (?, 'm.py', ?, ?, ?, ?)",
        [(name, row, col, row, col + 1) for name, (row, col) in at.items()],
    )
    db.commit()
    db.close()
    assert mutation.annotation_jobs(session, tmp_path) == {"x's", "*a's", "**k's", "return's", "y's"}


def test_every_planted_bug_matches_one_place_of_todays_code() -> None:
    """A planted bug whose text no longer matches stops the run: code that moved must take its bugs along."""
    root = Path(__file__).resolve().parents[2]
    assert mutation.PLANTED
    for name, module, old, new in mutation.PLANTED:
        assert (root / module).read_text().count(old) == 1, (name, module)
        assert old != new, name
    assert len({name for name, *_ in mutation.PLANTED}) == len(mutation.PLANTED)
