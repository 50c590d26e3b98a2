"""Mutation testing of hostpool_nb with cosmic-ray: ``python -m tests.mutation``.

Plants one small bug at a time in the package (cosmic-ray's operators: a
``+`` made ``-``, ``<`` made ``<=``, a number changed, a ``break`` made a
``continue``, ...) and runs a fast part of the test suite against it; a
mutant the suite does not notice "survives". The score is killed / (killed +
survived). The configuration is ``[tool.cosmic-ray]`` in ``pyproject.toml``;
survivors judged equivalent (no test could tell them apart) are listed, with
the reason, in ``docs/mutation.md``.

Why cosmic-ray: mutmut 3 leaves every decorated function unmutated, and every
kernel here is a decorated ``@_jit(...)`` function; cosmic-ray mutates the
source whatever its decorators. The suite runs with ``NUMBA_DISABLE_JIT=1``
(set here), so the kernels run as the plain Python they are written in and a
mutant costs a test run, not a 10 s compile. ``--jit`` compiles them: the
tests then see what only compiled code does (numba checks no bounds and
wraps integers), at a compile per mutant of a kernel module.

It is slow (thousands of mutants, a test run each), so it is not part of
CI. Mutants run in parallel, one worker per copy of the working tree (a
mutant is written to disk while its tests run). Sessions live in
``.mutation/`` and resume where they stopped; ``--retest-survivors`` runs
only the mutants that survived last time, after new tests were written.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SESSIONS = ROOT / ".mutation"


def load_config() -> dict[str, Any]:
    """``[tool.cosmic-ray]`` of pyproject.toml.

    Besides cosmic-ray's own keys (``timeout``, ``excluded-modules``), it has
    ``groups``: each a ``name``, the ``modules`` it mutates, the
    ``test-command`` that judges them (``{python}`` is this interpreter) and
    whether the kernels must be compiled (``jit``, default false). A group
    is one cosmic-ray session, so each module is judged by the tests that
    exercise it and no mutant pays for tests that cannot see it (torch's
    import, for one).
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: cosmic-ray's own dependency
        import toml as tomllib  # type: ignore[no-redef]
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    try:
        cfg = dict(data["tool"]["cosmic-ray"])
        cfg["groups"]
    except KeyError:
        raise SystemExit("python -m tests.mutation: error: pyproject.toml has no [tool.cosmic-ray] groups") from None
    return cfg


def cosmic_ray_config(cfg: dict[str, Any], group: dict[str, Any], modules: list[str], urls: list[str]) -> str:
    """The TOML cosmic-ray reads: its keys, the group's modules and tests, the http workers."""
    body = {k: v for k, v in cfg.items() if k != "groups"}
    body["module-path"] = modules
    body["test-command"] = group["test-command"].replace("{python}", sys.executable)
    lines = ["[cosmic-ray]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in body.items()]
    lines += ["", "[cosmic-ray.distributor]", 'name = "http"', "", "[cosmic-ray.distributor.http]"]
    lines.append(f"worker-urls = {json.dumps(urls)}")
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _copy_tree(dest: Path) -> None:
    """Copy the working tree (tracked and untracked, not ignored files) to ``dest``."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for raw in files:
        if not raw:
            continue
        rel = Path(raw.decode())
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def worker_env(jit: bool) -> dict[str, str]:
    """The environment of every test run: kernels as Python unless ``jit``; few examples."""
    env = dict(os.environ)
    env.pop("NUMBA_DISABLE_JIT", None)
    if not jit:
        env["NUMBA_DISABLE_JIT"] = "1"
    env["HYPOTHESIS_PROFILE"] = "mutation"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@contextlib.contextmanager
def workers(n: int, tmp: Path, jit: bool) -> Iterator[list[str]]:
    """Start ``n`` cosmic-ray http workers, each in its own copy of the tree."""
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    logs = []
    try:
        for i in range(n):
            copy = tmp / f"worker{i}"
            copy.mkdir()
            _copy_tree(copy)
            port = _free_port()
            log = open(tmp / f"worker{i}.log", "wb")  # noqa: SIM115 - closed in finally
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "cosmic_ray.cli", "http-worker", "--port", str(port)],
                    cwd=copy,
                    env=worker_env(jit),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            _wait_listening(url, proc)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            _stop(proc)
        for log in logs:
            log.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a terminated worker; kill it if it lingers."""
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_listening(url: str, proc: subprocess.Popen[bytes]) -> None:
    port = int(url.rsplit(":", 1)[1])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"python -m tests.mutation: error: a worker exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise SystemExit("python -m tests.mutation: error: a worker did not start listening within 60 s")


def annotation_spans(source: str) -> list[tuple[int, int, int, int]]:
    """(first line, first column, last line, end column) of every type annotation in ``source``."""
    spans: list[tuple[int, int, int, int]] = []
    for node in ast.walk(ast.parse(source)):
        found: list[ast.expr | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            every = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x is not None)]
            found = [arg.annotation for arg in every] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            found = [node.annotation]
        spans.extend(
            (ann.lineno, ann.col_offset, ann.end_lineno, ann.end_col_offset)
            for ann in found
            if ann is not None and ann.end_lineno is not None and ann.end_col_offset is not None
        )
    return spans


def annotation_jobs(session: Path, root: Path = ROOT) -> set[str]:
    """The session's mutants that change only a type annotation.

    Every module of the package starts with ``from __future__ import
    annotations``: an annotation is never evaluated, so no test can tell
    such a mutant from the original (mypy checks annotations, not the
    tests). They are left out of a fresh session before it is sampled, and
    out of an older session's counts.
    """
    db = sqlite3.connect(session)
    try:
        rows = db.execute(
            "select job_id, module_path, start_pos_row, start_pos_col, end_pos_row, end_pos_col from mutation_specs"
        ).fetchall()
    except sqlite3.OperationalError:  # a session cosmic-ray has not filled in yet
        return set()
    finally:
        db.close()
    spans: dict[str, list[tuple[int, int, int, int]]] = {}
    out = set()
    for job, module, row, col, end_row, end_col in rows:
        if module not in spans:
            path = root / module
            spans[module] = annotation_spans(path.read_text()) if path.is_file() else []
        if any((r, c) <= (row, col) and (end_row, end_col) <= (er, ec) for r, c, er, ec in spans[module]):
            out.add(job)
    return out


def drop_annotations(session: Path) -> int:
    """Delete a fresh session's annotation mutants (:func:`annotation_jobs`); how many."""
    jobs = [(j,) for j in annotation_jobs(session)]
    db = sqlite3.connect(session)
    try:
        db.executemany("delete from mutation_specs where job_id = ?", jobs)
        db.executemany("delete from work_items where job_id = ?", jobs)
        db.commit()
    finally:
        db.close()
    return len(jobs)


def counts(session: Path) -> dict[str, int]:
    """Outcome counts of a session: pending, killed (``timeouts`` of them), survived, incompetent, skipped, and
    ``annotations``: mutants of a type annotation in an older session, counted in none of the others."""
    left_out = annotation_jobs(session)
    db = sqlite3.connect(session)
    try:
        jobs = [r[0] for r in db.execute("select job_id from work_items")]
        rows = db.execute(
            "select job_id, worker_outcome, test_outcome, output = 'timeout' from work_results"
        ).fetchall()
    finally:
        db.close()
    total = sum(j not in left_out for j in jobs)
    out = {"total": total, "killed": 0, "timeouts": 0, "survived": 0, "incompetent": 0, "skipped": 0, "other": 0}
    out["annotations"] = len(left_out)
    done = 0
    for job, worker, test, timed_out in rows:
        if job in left_out:
            continue
        n = 1
        done += n
        if worker == "SKIPPED":
            out["skipped"] += n
        elif worker != "NORMAL":
            out["other"] += n  # the worker failed (exception, crash): counted apart
        elif test == "KILLED":
            out["killed"] += n
            if timed_out:  # killed, but say how many: a timeout too short for the tests would look like a kill
                out["timeouts"] += n
        elif test == "SURVIVED":
            out["survived"] += n
        else:
            out["incompetent"] += n
    out["pending"] = total - done
    return out


def sample_session(session: Path, size: int, seed: int) -> tuple[int, int]:
    """Keep a random ``size`` of a fresh session's mutants; return ``(kept, total)``.

    A uniform sample estimates the whole session's score (``report`` gives
    its 95% interval) in a fraction of the time; the sample's size and
    seed are kept in the session, so a resumed run keeps the same mutants.
    """
    db = sqlite3.connect(session)
    try:
        jobs = [r[0] for r in db.execute("select job_id from work_items order by job_id")]
        total = len(jobs)
        if size < total:
            keep = set(random.Random(seed).sample(jobs, size))
            drop = [(j,) for j in jobs if j not in keep]
            db.executemany("delete from mutation_specs where job_id = ?", drop)
            db.executemany("delete from work_items where job_id = ?", drop)
        db.execute("create table sample (total integer, seed integer)")
        db.execute("insert into sample values (?, ?)", (total, seed))
        db.commit()
        return min(size, total), total
    finally:
        db.close()


def sampled_from(session: Path) -> int | None:
    """The number of mutants a sampled session was drawn from; ``None`` if it holds them all."""
    db = sqlite3.connect(session)
    try:
        if db.execute("select name from sqlite_master where type = 'table' and name = 'sample'").fetchone() is None:
            return None
        return int(db.execute("select total from sample").fetchone()[0])
    finally:
        db.close()


def interval(killed: int, decided: int) -> tuple[float, float]:
    """Wilson 95% interval of a score measured on a sample of ``decided`` mutants."""
    if decided == 0:
        return 0.0, 1.0
    z = 1.96
    p = killed / decided
    centre = (p + z * z / (2 * decided)) / (1 + z * z / decided)
    half = z * math.sqrt(p * (1 - p) / decided + z * z / (4 * decided * decided)) / (1 + z * z / decided)
    return centre - half, centre + half


def score(c: dict[str, int]) -> float:
    decided = c["killed"] + c["survived"]
    return c["killed"] / decided if decided else 0.0


def survivors(session: Path) -> list[dict[str, Any]]:
    """Every surviving mutant: module, line, operator, occurrence, diff."""
    db = sqlite3.connect(session)
    try:
        rows = db.execute(
            "select m.module_path, m.start_pos_row, m.operator_name, m.occurrence, r.diff, m.job_id "
            "from work_results r join mutation_specs m on m.job_id = r.job_id "
            "where r.worker_outcome = 'NORMAL' and r.test_outcome = 'SURVIVED' "
            "order by m.module_path, m.start_pos_row, m.operator_name"
        ).fetchall()
    finally:
        db.close()
    return [
        {"module": r[0], "line": r[1], "operator": r[2], "occurrence": r[3], "diff": r[4] or "", "job": r[5]}
        for r in rows
    ]


def reset_survivors(session: Path) -> int:
    """Forget the survivors' results, and those a worker error left undecided, so the next run tests them again."""
    db = sqlite3.connect(session)
    try:
        cur = db.execute(
            "delete from work_results where (worker_outcome = 'NORMAL' and test_outcome = 'SURVIVED') "
            "or worker_outcome not in ('NORMAL', 'SKIPPED', 'NO_TEST')"
        )
        db.commit()
        return cur.rowcount
    finally:
        db.close()


def baseline(group: dict[str, Any], jit: bool = False) -> float:
    """The group's tests must pass on the unmutated code, or every mutant 'dies'; return how long they took.

    With ``jit``, in a cache of their own: every mutant of a kernel module
    compiles its kernels again, so the time includes the compiles.
    """
    cmd = shlex.split(group["test-command"].replace("{python}", sys.executable))
    env = worker_env(jit)
    with tempfile.TemporaryDirectory(prefix="hostpool-mutation-cache-") as cache:
        if jit:
            env["NUMBA_CACHE_DIR"] = cache
        start = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        took = time.monotonic() - start
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-2000:])
        raise SystemExit(f"python -m tests.mutation: error: group {group['name']}: the tests fail without any mutation")
    return took


# cosmic-ray's http distributor waits for a worker's answer with aiohttp's default total timeout, 5 minutes:
# a mutant's limit past it would come back as a worker error, not as a kill by the timeout.
HTTP_WAIT_S = 300.0


def session_timeout(cfg: dict[str, Any], took: float) -> float:
    """A mutant's time limit: the configured one, or three times the unmutated run if that is longer, and
    short enough that the worker answers before the http distributor stops waiting.

    A mutant that loops forever is killed by the limit; one merely slower
    than the limit (two workers sharing the cores) must not be.
    """
    return min(max(float(cfg.get("timeout", 0.0)), 3.0 * took), HTTP_WAIT_S - 20.0)


def _progress(session: Path, proc: subprocess.Popen[bytes], every: float) -> None:
    start = time.monotonic()
    while proc.poll() is None:
        time.sleep(every)
        c = counts(session)
        done = c["total"] - c["pending"]
        rate = done / max(time.monotonic() - start, 1e-9)
        eta = c["pending"] / rate / 60 if rate > 0 else float("nan")
        print(
            f"  {done}/{c['total']} mutants, {c['killed']} killed, {c['survived']} survived, "
            f"{c['incompetent'] + c['other']} other; about {eta:.0f} min left",
            file=sys.stderr,
            flush=True,
        )


def run_group(cfg: dict[str, Any], group: dict[str, Any], args: argparse.Namespace) -> Path:
    """Run (or resume) one group's session; return its path."""
    modules = [m for m in group["modules"] if not args.module or m in args.module]
    jit = bool(group.get("jit", False)) or args.jit
    session = session_path(group, args.jit)
    if args.retest_survivors:
        if not session.exists():
            raise SystemExit(f"python -m tests.mutation: error: no session at {session} to retest")
        print(f"[{group['name']}] retesting {reset_survivors(session)} survivors", file=sys.stderr)
    fresh = args.fresh or not session.exists()
    if not fresh and counts(session)["pending"] == 0:
        print(f"[{group['name']}] nothing pending in {session} (--fresh starts over)", file=sys.stderr)
        return session
    print(f"[{group['name']}] baseline: the group's tests on the unmutated code", file=sys.stderr, flush=True)
    timeout = session_timeout(cfg, baseline(group, jit))
    print(f"[{group['name']}] a mutant's tests get {timeout:.0f} s", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="hostpool-mutation-") as tmp_name:
        tmp = Path(tmp_name)
        config_file = tmp / "cosmic-ray.toml"
        with workers(args.workers, tmp, jit) as urls:
            config_file.write_text(cosmic_ray_config({**cfg, "timeout": timeout}, group, modules, urls))
            cr = [sys.executable, "-m", "cosmic_ray.cli"]
            if fresh:
                session.unlink(missing_ok=True)
                subprocess.run([*cr, "init", str(config_file), str(session)], cwd=ROOT, check=True)
                dropped = drop_annotations(session)
                print(f"[{group['name']}] {dropped} mutants of type annotations left out", file=sys.stderr)
                if args.sample is not None:
                    kept, total = sample_session(session, args.sample, args.seed)
                    print(f"[{group['name']}] a random {kept} of {total} mutants (seed {args.seed})", file=sys.stderr)
            c = counts(session)
            print(
                f"[{group['name']}] {c['pending']} of {c['total']} mutants to run, {args.workers} workers",
                file=sys.stderr,
                flush=True,
            )
            proc = subprocess.Popen([*cr, "exec", str(config_file), str(session)], cwd=ROOT)
            try:
                _progress(session, proc, args.progress_every)
            finally:
                if proc.poll() is None:
                    proc.terminate()
                proc.wait()
    return session


def session_path(group: dict[str, Any], jit: bool) -> Path:
    """Where a group's session lives; runs with ``--jit`` keep their own."""
    return SESSIONS / f"{group['name']}{'-jit' if jit else ''}.sqlite"


def run(args: argparse.Namespace) -> int:
    cfg = load_config()
    groups = [g for g in cfg["groups"] if not args.group or g["name"] in args.group]
    if args.module:
        groups = [g for g in groups if set(g["modules"]) & set(args.module)]
    if not groups:
        raise SystemExit("python -m tests.mutation: error: no group or module matches")
    SESSIONS.mkdir(exist_ok=True)
    (SESSIONS / ".gitignore").write_text("*\n")
    sessions = [] if args.report else [run_group(cfg, g, args) for g in groups]
    if args.report:
        sessions = [session_path(g, args.jit) for g in groups if session_path(g, args.jit).exists()]
    return report(sessions, args.show_diff)


def report(sessions: list[Path], show_diff: bool) -> int:
    """Print each session's counts and survivors, then the score over all of them."""
    total: dict[str, int] = {}
    any_sampled = False
    for session in sessions:
        c = counts(session)
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
        drawn = sampled_from(session)
        any_sampled = any_sampled or drawn is not None
        of = "" if drawn is None else f" (a random sample of {drawn})"
        spread = ""
        if drawn is not None:
            lo, hi = interval(c["killed"], c["killed"] + c["survived"])
            spread = f", 95% interval {lo:.1%}..{hi:.1%}"
        print(
            f"{session.stem}: {c['total']} mutants{of}; killed {c['killed']} ({c['timeouts']} by the timeout), "
            f"survived {c['survived']}, "
            f"incompetent {c['incompetent']}, worker errors {c['other']}, pending {c['pending']}; "
            f"score {score(c):.1%}{spread}"
            + (f"; {c['annotations']} mutants of type annotations left out" if c["annotations"] else "")
        )
        left_out = annotation_jobs(session)
        for s in survivors(session):
            if s["job"] in left_out:
                continue
            print(f"  SURVIVED {s['module']}:{s['line']} {s['operator']} #{s['occurrence']}")
            if show_diff:
                for ln in s["diff"].splitlines():
                    if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---")):
                        print(f"      {ln}")
    if total:
        decided = total["killed"] + total["survived"]
        line = f"score: {score(total):.1%} of {decided} decided mutants killed"
        if any_sampled:  # the groups' samples pooled: an estimate for the mutants they were drawn from
            lo, hi = interval(total["killed"], decided)
            line += f" (sampled; 95% interval {lo:.1%}..{hi:.1%})"
        print(line)
    return 0


# Bugs planted by hand in the run bookkeeping of the lists and the ring's wrap (docs/mutation.md):
# (name, module, the text replaced, its replacement). Each must be killed.
PLANTED = [
    (
        "a run split off by one (the rest at the front one page too long)",
        "hostpool_nb/_kernels/runs.py",
        "            rest = length - take\n",
        "            rest = length - take + 1\n",
    ),
    (
        "a run split off by one (the rest starts a page early)",
        "hostpool_nb/_kernels/runs.py",
        "            ring[pos] += take\n",
        "            ring[pos] += take - 1\n",
    ),
    (
        "two pages in a row staged as one run though they are not (free of pages above one slot)",
        "hostpool_nb/_kernels/runs.py",
        "    if p == first + length:\n        return pos, entries, first, length + more\n",
        "    if p == first + length or p == first + length + 1:\n        return pos, entries, first, length + more\n",
    ),
    (
        "two runs in a row not joined by a sorted merge (a page's run cut at each word)",
        "hostpool_nb/_kernels/runs.py",
        "                p += 8 if p & 7 == 0 and p + 8 <= n and st[base + (p >> 3)] == 0 else 1\n",
        "                p += 8 if p & 7 == 0 and p + 8 <= n and st[base + (p >> 3)] == 0 else 1\n"
        "                if p & 7 == 0:\n                    break\n",
    ),
    (
        "a run that crosses the ring's end: its length entry written past it",
        "hostpool_nb/_kernels/runs.py",
        "    ring[pos] = first\n    pos = pos + 1 if pos + 1 < n else 0\n    if length > 1:\n",
        "    ring[pos] = first\n    pos = pos + 1\n    if length > 1:\n",
    ),
    (
        "a run that crosses the ring's end: its length read from past it",
        "hostpool_nb/_kernels/runs.py",
        "        nxt = pos + 1 if pos + 1 < ring.shape[0] else 0\n        e: int = ring[nxt]\n",
        "        nxt = pos + 1 if pos + 1 < ring.shape[0] else pos\n        e: int = ring[nxt]\n",
    ),
    (
        "a run's end found one slot late (the mask every free measures a run by)",
        "hostpool_nb/_kernels/runs.py",
        "    length = k + trailing_zeros(off) if off != 0",
        "    length = k + trailing_zeros(off) + 1 if off != 0",
    ),
    (
        "a run's last flag word masked one page short",
        "hostpool_nb/_kernels/runs.py",
        "    top = ((start + length - 1) & 7) + 1  # how many",
        "    top = ((start + length - 1) & 7)  # how many",
    ),
    (
        "a run's slots written rounded down, its last ones left as they were",
        "hostpool_nb/_kernels/runs.py",
        "            span = (span + 15) & ~15\n        dst = out[at : at + span]\n        first = p * page_size\n",
        "            span = span & ~15\n        dst = out[at : at + span]\n        first = p * page_size\n",
    ),
    (
        "a sorted merge's count takes the bytes after the last page's flag for free pages",
        "hostpool_nb/_kernels/runs.py",
        "        if q == last:\n            free &= tail\n",
        "        if q == last:\n            free &= _ALL_BYTES\n",
    ),
    (
        "a sorted merge's count sees no page free two before a word's first page (a run of two there)",
        "hostpool_nb/_kernels/runs.py",
        "        older = (free << 16) | (prev >> 48)\n",
        "        older = free << 16\n",
    ),
    (
        "a free staged one entry past the ring when the live window ends at its last entry (run kernels)",
        "hostpool_nb/_kernels/runs.py",
        "    return tail - n if tail >= n else tail\n",
        "    return tail - n if tail > n else tail\n",
    ),
    (
        "a free staged one entry past the ring when the live window ends at its last entry (short kernel)",
        "hostpool_nb/_kernels/flat.py",
        "    tail = _ring_tail0_tail - _ring_tail0_n if _ring_tail0_tail >= _ring_tail0_n else _ring_tail0_tail\n",
        "    tail = _ring_tail0_tail - _ring_tail0_n if _ring_tail0_tail > _ring_tail0_n else _ring_tail0_tail\n",
    ),
]


def _run_planted_one(cmd: list[str], name: str, module: str, old: str, new: str) -> bool:
    """Whether the tests kill the bug ``old`` -> ``new`` planted in ``module`` of a copy of the tree."""
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", ".mutation", "__pycache__", "*.egg-info"))
        path = tree / module
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"python -m tests.mutation: error: planted bug {name!r} no longer matches {module}")
        path.write_text(text.replace(old, new))
        env = {**worker_env(False), "PYTHONPATH": str(tree)}
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600, check=False)
    return done.returncode != 0


def run_planted(workers: int) -> int:
    """Plant each of :data:`PLANTED` in a copy of the tree and run the core group's tests on it."""
    from concurrent.futures import ThreadPoolExecutor

    group = next(g for g in load_config()["groups"] if g["name"] == "core")
    baseline(group)  # else every planted bug would count as killed
    cmd = shlex.split(group["test-command"].replace("{python}", sys.executable))
    with ThreadPoolExecutor(max(workers, 1)) as pool:
        killed = list(pool.map(lambda bug: _run_planted_one(cmd, *bug), PLANTED))
    for (name, *_), dead in zip(PLANTED, killed, strict=True):
        print(f"{'killed  ' if dead else 'SURVIVED'}  {name}")
    print(f"{sum(killed)} of {len(PLANTED)} planted bugs killed")
    return 0 if all(killed) else 1


def main(argv: list[str] | None = None) -> int:
    # A terminated run still stops its workers and removes their copies.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(prog="python -m tests.mutation", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallel workers (default: CPU count)")
    ap.add_argument("--group", action="append", metavar="NAME", help="run only this group (repeatable)")
    ap.add_argument("--module", action="append", metavar="PATH", help="mutate only this module (repeatable)")
    ap.add_argument("--fresh", action="store_true", help="start new sessions even where one exists")
    ap.add_argument(
        "--retest-survivors",
        action="store_true",
        help="run again only the mutants that survived (or met a worker error)",
    )
    ap.add_argument("--report", action="store_true", help="only print the report of the existing sessions")
    ap.add_argument("--show-diff", action="store_true", help="print each survivor's change")
    ap.add_argument("--progress-every", type=float, default=60.0, metavar="S", help="seconds between progress lines")
    ap.add_argument(
        "--sample",
        type=int,
        metavar="N",
        help="with a fresh session: run a random N of each group's mutants (the report gives the score's interval)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of --sample (default: 0)")
    ap.add_argument("--planted", action="store_true", help="run only the bugs planted by hand in the run bookkeeping")
    ap.add_argument(
        "--jit",
        action="store_true",
        help="compile the kernels (catches what only compiled code does: unchecked bounds, integer width); "
        "sessions of their own",
    )
    args = ap.parse_args(argv)
    if args.planted:
        return run_planted(args.workers)
    if args.sample is not None and args.sample < 1:
        ap.error(f"--sample: {args.sample} is not a positive number")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
