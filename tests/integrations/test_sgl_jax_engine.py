"""sglang-jax's released engine, run end to end on a CPU: plain, and with hostpool_nb installed as the docs say.

Needs sglang-jax (:data:`hostpool_nb.integrations.sgl_jax.TESTED_VERSION`, Python 3.12 or later, with
jax from its ``[cpu]`` extra); skipped without it. CI's engine job installs it (docs/development.md).
Each configuration builds a tiny model in a temporary folder (``tests/engine/tiny_models.py``, nothing
downloaded) and runs ``tests/engine/launch.py`` twice, in processes of their own: once plain, once with
``sgl_jax.install()`` at the top of the launcher. The engine spawns its scheduler, which runs the
launcher's top level again: so it is the scheduler that builds hostpool_nb's classes, as for a user.

Compared exactly, per configuration: every generated token id and every request's cached-token count,
and every call the scheduler made on the allocator and host pool that changes something, with its
arguments and result, in order (``free``'s result aside: hostpool_nb's counts the pages, the original's
is ``None``; see :func:`comparable`). Checked on
the installed run: the INFO lines come from the scheduler's process and name the expected classes, and
what each configuration is for happened (evictions, host pages freed and reused, ``free_swa``).

Requests are sent one ``generate`` call at a time: the engine's own outputs are reproducible so, and a
whole batch in one call is not (the plain engine differs from itself). With ``dp_size`` 2 the requests
are routed round-robin: the engine's default, cache-aware routing reads how busy each rank is when a
request arrives, which depends on timing (the plain engine with 50 ms added to its first five frees
routes differently from itself), not on the allocator.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import hostpool_nb

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        importlib.util.find_spec("sgl_jax") is None,
        reason="sglang-jax is not installed (Python 3.12+: pip install --pre 'sglang-jax[cpu]==0.1.0rc0')",
    ),
]

ROOT = Path(hostpool_nb.__file__).resolve().parent.parent
LAUNCHER = Path(__file__).parents[1] / "engine" / "launch.py"
REQUESTS = 40
NEW_TOKENS = 16
# Each run may take this long (start, 40 requests, stop took 15-30 s on two shared cores).
RUN_TIMEOUT_S = 300
TWO_CPU_DEVICES = "--xla_force_host_platform_device_count=2"
TRACK_ENV, RECORD_ENV = "HOSTPOOL_NB_TRACK", "HOSTPOOL_NB_RECORD"


# The configuration whose installed run also records its allocator's calls (HOSTPOOL_NB_RECORD), replayed after.
RECORDED = "p16-tracked"


@dataclass(frozen=True)
class Config:
    """One way of running the engine: its model, ``Engine`` arguments and the launcher's switches."""

    model: str
    engine: dict[str, Any]
    env: tuple[tuple[str, str], ...] = ()
    swa: bool = False
    host_tier: bool = False
    expect: tuple[str, ...] = ("PagedTokenToKVPoolAllocator",)


CONFIGS = {
    # Page size 1 and a device pool of 128 tokens: the radix cache evicts.
    "p1-evict": Config("qwen3", {"page_size": 1, "max_total_tokens": 128}, expect=("TokenToKVPoolAllocator",)),
    # Page size 16, every allocation tracked, and each of the engine's leak checks seconded by hostpool_nb's.
    "p16-tracked": Config("qwen3", {"page_size": 16, "max_total_tokens": 256}, env=(("HOSTPOOL_NB_TRACK", "1"),)),
    # The HiCache host tier, 16 host pages for 256 device tokens: host pages are freed and reused.
    "p16-host": Config(
        "qwen3",
        {"page_size": 16, "max_total_tokens": 256, "hicache_storage": "none", "hicache_ratio": 1},
        host_tier=True,
        expect=("PagedTokenToKVPoolAllocator", "LRUHostKVPool"),
    ),
    # No radix cache: every request's slots are freed when it ends.
    "p4-no-radix": Config("qwen3", {"page_size": 4, "max_total_tokens": 256, "disable_radix_cache": True}),
    # The sliding-window allocator (Gemma2's first layer slides over 16 tokens); the overlap scheduler off, as
    # with it on the plain engine's outputs vary between runs at page size 1.
    "swa-p1": Config(
        "gemma2",
        {"page_size": 1, "max_total_tokens": 256, "disable_overlap_schedule": True},
        swa=True,
        expect=("SWATokenToKVPoolAllocator",),
    ),
    "swa-p16": Config(
        "gemma2",
        {"page_size": 16, "max_total_tokens": 512, "disable_overlap_schedule": True},
        swa=True,
        expect=("SWATokenToKVPoolAllocator",),
    ),
    # Two data-parallel ranks on two CPU devices (XLA's host platform split in two), routed round-robin.
    "dp2": Config(
        "qwen3",
        {"page_size": 16, "max_total_tokens": 512, "dp_size": 2, "tp_size": 2, "dp_schedule_policy": "round_robin"},
        env=(("XLA_FLAGS", TWO_CPU_DEVICES),),
    ),
}


def prompts() -> list[str]:
    """40 prompts from the tokenizer's words: four shared 20-word prefixes, and tails of 4 to 23 words."""
    from tests.engine.tiny_models import SENTENCES

    words = sorted({w for sentence in SENTENCES for w in sentence.split()})
    rng = random.Random(0)
    bases = [" ".join(rng.choice(words) for _ in range(20)) for _ in range(4)]
    made = []
    for i in range(REQUESTS):
        tail = " ".join(rng.choice(words) for _ in range(rng.randrange(4, 24)))
        made.append(f"{bases[i % 4]} {tail}" if i % 5 else tail)
    return made


@dataclass
class Run:
    """What one engine run left in its folder."""

    folder: Path
    launcher_pid: int
    requests: list[dict[str, Any]]
    seconds: float
    counts: dict[str, int]
    calls: list[list[Any]]
    log: list[str]
    leak: dict[str, Any] | None


def _scheduler_file(folder: Path, pattern: str) -> Path | None:
    """The scheduler's file of ``pattern`` (the one process that made allocator calls)."""
    found = sorted(folder.glob(pattern), key=lambda p: p.stat().st_size)
    return found[-1] if found else None


def run_engine(
    folder: Path, models: dict[str, Path], config: Config, *, install: bool, record: bool = False, **switches: Any
) -> Run:
    folder.mkdir(parents=True)
    settings = {
        "out": str(folder),
        "model": str(models[config.model]),
        "install": install,
        "engine": {
            "device": "cpu",
            "max_running_requests": 8,
            "chunked_prefill_size": 128,
            "max_prefill_tokens": 256,
            "disable_precompile": True,
            "skip_server_warmup": True,
            "grammar_backend": "none",
            "random_seed": 0,
            **config.engine,
        },
        "prompts": prompts(),
        "max_new_tokens": NEW_TOKENS,
        "swa": config.swa,
        "host_tier": config.host_tier,
        **switches,
    }
    env = {k: v for k, v in os.environ.items() if k not in (TRACK_ENV, RECORD_ENV)}  # only what the run asks
    env |= {
        "HOSTPOOL_NB_ENGINE_RUN": json.dumps(settings),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **dict(config.env),
    }
    if record:
        env[RECORD_ENV] = str(folder / "traces")
    done = subprocess.run(
        [sys.executable, str(LAUNCHER)], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"the engine run failed ({done.returncode}):\n{done.stderr[-4000:]}"
    result = json.loads((folder / "result.json").read_text())
    counts_file = _scheduler_file(folder, "calls-*.json")
    calls_file = _scheduler_file(folder, "calls-*.jsonl")
    leak_file = _scheduler_file(folder, "leak-*.json")
    return Run(
        folder=folder,
        launcher_pid=result["pid"],
        requests=result["requests"],
        seconds=result["start_seconds"] + result["run_seconds"],
        counts=json.loads(counts_file.read_text()) if counts_file else {},
        calls=[json.loads(line) for line in calls_file.read_text().splitlines()] if calls_file else [],
        log=[line for p in sorted(folder.glob("log-*.txt")) for line in p.read_text().splitlines()],
        leak=json.loads(leak_file.read_text()) if leak_file else None,
    )


def comparable(calls: list[list[Any]]) -> list[list[Any]]:
    """The calls that change something, as compared: ``free`` / ``free_swa`` results left out (hostpool_nb's
    count pages), and frees of nothing and empty free groups too: with the overlap scheduler on, where those
    fall between two batches depends on timing, in the plain engine as well."""
    kept: list[list[Any]] = []
    for name, arguments, got in calls:
        if name.endswith("free_group_end") and kept and kept[-1][0].endswith("free_group_begin"):
            kept.pop()  # an empty group
        elif not (name.endswith(("free", "free_swa")) and arguments.get("free_index") == []):
            kept.append([name, arguments, None if name.endswith(("free", "free_swa")) else got])
    return kept


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.engine import tiny_models

    where = tmp_path_factory.mktemp("models")
    return {"qwen3": tiny_models.qwen3(where / "qwen3"), "gemma2": tiny_models.gemma2(where / "gemma2")}


@pytest.fixture(scope="module")
def plain_runs() -> dict[str, Run]:
    """The plain engine's run of each configuration, kept for the planted fault's comparison."""
    return {}


INFO = re.compile(r"^(\d+) (\S+) INFO hostpool_nb in use: sgl_jax builds (\w+) ")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_engine_gives_the_same_outputs_and_calls_with_hostpool_nb_installed(
    name: str, models: dict[str, Path], plain_runs: dict[str, Run], tmp_path: Path
) -> None:
    config = CONFIGS[name]
    plain = run_engine(tmp_path / "plain", models, config, install=False)
    plain_runs[name] = plain
    mine = run_engine(tmp_path / "hostpool_nb", models, config, install=True, record=name == RECORDED)

    # Only the installed run uses hostpool_nb, in the scheduler's process, for the classes expected.
    assert [line for line in plain.log if "hostpool_nb in use" in line] == []
    said = [INFO.match(line) for line in mine.log if "hostpool_nb in use" in line]
    assert said, mine.log
    assert all(said), mine.log
    assert {(m.group(2), m.group(3)) for m in said if m} == {("run_scheduler_process", c) for c in config.expect}
    assert {int(m.group(1)) for m in said if m} - {mine.launcher_pid} == {int(m.group(1)) for m in said if m}

    assert len(mine.requests) == REQUESTS
    assert mine.requests == plain.requests
    assert len(mine.calls) > REQUESTS
    assert comparable(mine.calls) == comparable(plain.calls)
    counts = {k: v for k, v in mine.counts.items() if k != "engine leak checks passed"}
    assert counts == {k: v for k, v in plain.counts.items() if k != "engine leak checks passed"}
    assert mine.counts["engine leak checks passed"] > 0  # the engine's own check, at every idle moment
    _what_the_configuration_is_for(name, mine)


def _what_the_configuration_is_for(name: str, run: Run) -> None:
    counts = run.counts
    if name == "p1-evict":
        assert counts["radix cache tokens evicted"] > 0
    elif name == "p16-tracked":
        assert run.leak is not None
        assert run.leak["unaccounted"] == [], run.leak["report"]
        assert run.leak["outstanding"] * 16 >= run.leak["radix cache slots"] > 0  # what it holds is tracked
        _replayed(run)
    elif name == "p16-host":
        pages = int(re.search(r"LRUHostKVPool on a HostPagePool \(hostpool_nb\): (\d+) pages", "\n".join(run.log))[1])
        assert counts["host.free"] > 0
        assert counts["host.pages allocated"] > pages  # freed pages handed out again
    elif name == "p4-no-radix":
        assert counts["allocator.free"] >= REQUESTS
    elif name.startswith("swa"):
        assert counts["allocator.free_swa"] > 0  # tokens left the window
    elif name == "dp2":
        ranks = {arguments["dp_rank"] for call, arguments, _ in run.calls if call.endswith("alloc_extend")}
        assert ranks == {0, 1}


def _replayed(run: Run) -> None:
    """The scheduler's trace holds every call the scheduler made, and replays: every result matches."""
    traces = sorted((run.folder / "traces").glob("PagedTokenToKVPoolAllocator-*-pid*-1.trace"))
    assert len(traces) == 1, sorted(p.name for p in (run.folder / "traces").iterdir())
    assert str(traces[0]) in "\n".join(run.log)  # the WARNING line at start-up says where it records
    from hostpool_nb.trace import load

    trace = load(traces[0])
    # The recording wrappers saw what the engine called, all of it; the launcher logs every call but the sizes.
    sizes = {"available_size", "full_available_size", "swa_available_size"}
    assert sum(op.name not in sizes for op in trace.operations) == len(run.calls)
    assert any(op.name == "available_size" for op in trace.operations)  # its most frequent call, recorded too
    replayed = subprocess.run(
        [sys.executable, "-m", "hostpool_nb.replay", str(traces[0])], capture_output=True, text=True, check=False
    )
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert f"all {len(trace)} operations match" in replayed.stdout
    timed = subprocess.run(
        [sys.executable, "-m", "hostpool_nb.replay", str(traces[0]), "--time", "--repeats", "3"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert timed.returncode == 0, timed.stdout + timed.stderr
    assert "x numpy" in timed.stdout
    print(replayed.stdout, timed.stdout, sep="\n")  # for the CI log (-s)


def test_a_planted_fault_makes_the_comparison_fail(
    models: dict[str, Path], plain_runs: dict[str, Run], tmp_path: Path
) -> None:
    """An allocator that hands one slot out twice (each prefill's first, in the test's processes only)."""
    config = CONFIGS["p16-tracked"]
    plain = plain_runs.get("p16-tracked") or run_engine(tmp_path / "plain", models, config, install=False)
    faulty = run_engine(tmp_path / "faulty", models, config, install=True, fault=True)
    assert len(faulty.requests) == REQUESTS
    differ = [i for i, (a, b) in enumerate(zip(plain.requests, faulty.requests, strict=True)) if a != b]
    assert differ, "a slot handed out twice went unnoticed: the comparison cannot catch a broken allocator"


def test_the_docs_laptop_recipe_runs_as_written(models: dict[str, Path], tmp_path: Path) -> None:
    """docs/jax-serving.md's tiny_serve.py, taken from the page and run as the page says."""
    page = (ROOT / "docs" / "jax-serving.md").read_text()
    (script,) = re.findall(r"```py\n(# tiny_serve\.py.*?)```", page, flags=re.DOTALL)
    (tmp_path / "tiny_serve.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in (TRACK_ENV, RECORD_ENV)}
    env |= {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "tiny_serve.py", str(models["qwen3"])],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "hostpool_nb in use: sgl_jax builds PagedTokenToKVPoolAllocator (hostpool_nb.paged): size=4096" in (
        done.stderr
    )
    printed = [line for line in done.stdout.splitlines() if "cached tokens:" in line]
    assert len(printed) == 2
    assert all(len(json.loads(line.split(" cached tokens:")[0])) == 8 for line in printed)


def test_the_server_started_through_the_launcher_serves_with_hostpool_nb(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """``python -m hostpool_nb.serve sgl_jax.launch_server <its arguments>``: the HTTP server, as users start it.

    The scheduler is a spawned process: it says it uses hostpool_nb, so the launcher installed it there too.
    """
    import socket
    import time
    import urllib.request

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = str(models["qwen3"])
    server_args = ["--model-path", model, "--tokenizer-path", model, "--device", "cpu", "--page-size", "16"]
    server_args += ["--max-total-tokens", "4096", "--max-running-requests", "8", "--grammar-backend", "none"]
    server_args += ["--disable-precompile", "--skip-server-warmup", "--host", "127.0.0.1", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k not in (TRACK_ENV, RECORD_ENV)}
    env |= {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "hostpool_nb.serve", "sgl_jax.launch_server", *server_args, "--log-level", "info"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"the server exited ({server.returncode}):\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not start in {RUN_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        outputs = []
        for prompt in ("the quick brown fox", "the quick brown fox jumps over the lazy dog"):
            body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
            request = urllib.request.Request(
                f"{url}/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=RUN_TIMEOUT_S) as answer:
                outputs.append(json.loads(answer.read()))
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()
    said = log.read_text()
    assert all(o["meta_info"]["completion_tokens"] == 8 for o in outputs), outputs
    in_use = [
        line for line in said.splitlines() if "hostpool_nb in use: sgl_jax builds PagedTokenToKVPoolAllocator" in line
    ]
    assert in_use, said[-4000:]
    assert "size=4096, page_size=16" in in_use[0]


def test_the_launcher_refuses_a_module_of_no_engine_in_one_line() -> None:
    for module, said in (
        ("uvicorn.main", "'uvicorn.main' is not a module of an engine hostpool_nb installs into (sgl_jax, sglang)"),
        ("sgl_jax.no_such_server", "no module named 'sgl_jax.no_such_server' here"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "hostpool_nb.serve", module], capture_output=True, text=True, check=False
        )
        assert done.returncode == 2
        assert done.stderr.startswith(f"python -m hostpool_nb.serve: error: {said}"), done.stderr
        assert done.stderr.count("\n") == 1
