"""``HOSTPOOL_NB_RECORD=<folder>``: every pool a process builds records its calls, for engines a user does not edit.

Each test runs its pools in a child process with the variable set (it is read when a pool is built, and
the traces are written by a thread and at exit), then reads what the child left: a trace per pool, named
by kind, start time, process and number, that ``python -m hostpool_nb.replay`` replays with every
result matching.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import hostpool_nb
from hostpool_nb import HostPoolError
from hostpool_nb import replay as R
from hostpool_nb import trace as T
from hostpool_nb._core.protocol import RECORD_ENV
from hostpool_nb._diagnostics.live import DEFAULT_MB, LIMIT_ENV, limit_bytes
from hostpool_nb.paged import PagedTokenToKVPoolAllocator

ROOT = str(Path(hostpool_nb.__file__).resolve().parent.parent)
NAME = re.compile(r"^(\w+)-\d{8}T\d{6}-pid(\d+)-(\d+)\.trace$")


def child(source: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``source`` in a new interpreter with ``env`` added (and the recording variables only as given)."""
    base = {k: v for k, v in os.environ.items() if k not in (RECORD_ENV, LIMIT_ENV)}
    base["PYTHONPATH"] = ROOT + os.pathsep + base.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", source],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def traces(folder: Path) -> dict[str, T.Trace]:
    return {p.name: T.load(p) for p in sorted(folder.iterdir())}


def replays(trace: T.Trace) -> int:
    done, skipped, divergence = R.replay(trace)
    assert divergence is None, divergence
    assert skipped == 0
    return done


EVERY_KIND = """
import json, os
from types import SimpleNamespace
import numpy as np
from hostpool_nb import HostPoolError, LogicalHostPool
from hostpool_nb.paged import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator

host = LogicalHostPool(1024, 16)
paged = PagedTokenToKVPoolAllocator(1024, 16, None, dp_size=2)
token = TokenToKVPoolAllocator(64, None)
swa = SWATokenToKVPoolAllocator(256, 128, SimpleNamespace(full_kv_pool=None, swa_kv_pool=None), page_size=16)
host.free(host.alloc(64)); host.alloc(32)
out = paged.alloc_extend([0, 0], [20, 5], [-1, -1], 25, dp_rank=1); paged.free(out[:5], 1); paged.merge_and_sort_free(1)
token.free(token.alloc(8)[::2])
try:
    token.free([1])
except HostPoolError:
    pass
full = swa.alloc_extend([0], [40], [-1], 40); swa.free_swa(full[:16]); swa.merge_and_sort_free(); swa.free(full)
try:
    with host.recording("elsewhere.trace"):
        pass
except HostPoolError as error:
    nested = str(error)
print(json.dumps({"pid": os.getpid(), "nested": nested}))
"""


def test_every_recordable_kind_records_into_a_trace_of_its_own(tmp_path: Path) -> None:
    done = child(EVERY_KIND, {RECORD_ENV: str(tmp_path / "traces")})  # the folder is made
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["nested"] == "this pool is already recording: recordings do not nest"
    found = traces(tmp_path / "traces")
    names = {NAME.match(name).groups(): trace for name, trace in found.items()}  # type: ignore[union-attr]
    pid = str(said["pid"])
    assert sorted(names) == [
        ("LogicalHostPool", pid, "1"),
        ("PagedTokenToKVPoolAllocator", pid, "2"),
        ("SWATokenToKVPoolAllocator", pid, "4"),  # one trace: its sides are parts of it
        ("TokenToKVPoolAllocator", pid, "3"),
    ]
    operations = {kind: replays(trace) for (kind, _, _), trace in names.items()}
    assert operations == {
        "LogicalHostPool": 3,
        "PagedTokenToKVPoolAllocator": 3,
        "TokenToKVPoolAllocator": 3,  # the double free too, refused as when it was made
        "SWATokenToKVPoolAllocator": 4,
    }
    for name in found:
        folder = tmp_path / "traces"
        said = f"recording every call of this {NAME.match(name)[1]} into {folder / name} ({RECORD_ENV}={folder}; "  # type: ignore[index]
        assert f"{said}up to {DEFAULT_MB} MB)" in done.stderr


def test_a_killed_process_leaves_a_trace_of_its_calls_but_the_last_seconds(tmp_path: Path) -> None:
    source = """
import os, signal, time
from hostpool_nb.paged import PagedTokenToKVPoolAllocator
a = PagedTokenToKVPoolAllocator(4096, 16, None)
held = [a.alloc(32) for _ in range(50)]
for h in held[::2]:
    a.free(h)
time.sleep(2.5)  # the trace writer's turn
os.kill(os.getpid(), signal.SIGKILL)  # as an engine ends its workers: no exit handlers
"""
    done = child(source, {RECORD_ENV: str(tmp_path)})
    assert done.returncode == -9
    (trace,) = traces(tmp_path).values()
    assert replays(trace) == 75


def test_a_trace_stops_at_its_bound_and_the_pool_goes_on(tmp_path: Path) -> None:
    source = """
import json
from hostpool_nb.paged import PagedTokenToKVPoolAllocator
a = PagedTokenToKVPoolAllocator(1 << 16, 16, None)
for _ in range(4000):  # 8,000 calls: more than 0.05 MB holds, some 50 bytes a call before compression
    a.free(a.alloc(256))
print(json.dumps({"available": a.available_size()}))
"""
    done = child(source, {RECORD_ENV: str(tmp_path), LIMIT_ENV: "0.05"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"available": 1 << 16}  # every call served
    ((name, trace),) = traces(tmp_path).items()
    assert 0 < len(trace) < 8000
    assert replays(trace) == len(trace)
    assert (tmp_path / name).stat().st_size <= 0.05 * (1 << 20)
    assert f"({RECORD_ENV}={tmp_path}; up to 0.05 MB)" in done.stderr  # the bound as it was set
    assert f"stopped recording into {tmp_path / name} at {len(trace)} calls: the trace reached {LIMIT_ENV}=0.05 MB" in (
        done.stderr
    )


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf", "1e400", "2e12"])
def test_a_bound_it_cannot_mean_is_an_error_at_the_first_pool(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    monkeypatch.setenv(LIMIT_ENV, value)
    with pytest.raises(HostPoolError) as raised:
        PagedTokenToKVPoolAllocator(64, 4, None)
    assert str(raised.value) == (
        f"{LIMIT_ENV} must be a positive number of megabytes, at most 1e+09, got {LIMIT_ENV}={value!r}"
    )
    assert list(tmp_path.iterdir()) == []


def test_the_bound_defaults_and_takes_fractions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    assert limit_bytes() == DEFAULT_MB << 20
    monkeypatch.setenv(LIMIT_ENV, " 1.5 ")
    assert limit_bytes() == 3 << 19


def test_a_folder_it_cannot_make_is_an_error_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(RECORD_ENV, str(blocker / "traces"))
    with pytest.raises(HostPoolError, match=rf"^{RECORD_ENV}='.*a file/traces': cannot make the folder"):
        PagedTokenToKVPoolAllocator(64, 4, None)


def test_a_forked_child_stops_recording_and_leaves_the_parents_trace(tmp_path: Path) -> None:
    source = """
import os, sys
from hostpool_nb.paged import TokenToKVPoolAllocator
a = TokenToKVPoolAllocator(64, None)
a.free(a.alloc(4))
pid = os.fork()
if pid == 0:
    for _ in range(10):
        a.free(a.alloc(2))  # not recorded: the child's calls are not the parent's
    sys.exit(0)  # its exit handlers run, and must not write the parent's trace
os.waitpid(pid, 0)
a.alloc(3)
"""
    done = child(source, {RECORD_ENV: str(tmp_path)})
    assert done.returncode == 0, done.stderr
    (trace,) = traces(tmp_path).values()
    assert replays(trace) == 3
    assert [op.name for op in trace.operations] == ["alloc", "free", "alloc"]


def test_an_unpickled_allocator_records_from_the_state_it_was_unpickled_in(tmp_path: Path) -> None:
    source = """
import os, pickle
from hostpool_nb.paged import PagedTokenToKVPoolAllocator
a = PagedTokenToKVPoolAllocator(1024, 16, None)
held = a.alloc_extend([0, 0], [40, 20], [-1, -1], 60)
saved = pickle.dumps(a)
os.environ["HOSTPOOL_NB_RECORD"] = os.environ.pop("LATER")
b = pickle.loads(saved)
b.free(held[:40])
b.alloc(64)
"""
    done = child(source, {"LATER": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    (trace,) = traces(tmp_path).values()
    assert replays(trace) == 2  # from the loaded state: the free finds those pages allocated


def test_without_the_variable_nothing_is_recorded_and_the_trace_code_is_not_imported(tmp_path: Path) -> None:
    source = """
import json, sys
from types import SimpleNamespace
from hostpool_nb import LogicalHostPool
from hostpool_nb.paged import SWATokenToKVPoolAllocator
LogicalHostPool(64, 16).alloc(16)
SWATokenToKVPoolAllocator(64, 32, SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)).alloc(4)
names = ["hostpool_nb._diagnostics.live", "hostpool_nb._diagnostics.recording"]
print(json.dumps(sorted(m for m in sys.modules if m in names)))
"""
    done = child(source, {}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
    assert "recording" not in done.stderr


@pytest.mark.torch
def test_the_torch_pool_records_too(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    source = """
import torch
from hostpool_nb.torch import LogicalHostPool
p = LogicalHostPool(1024, 16)
p.free(p.alloc(64))
p.free(torch.arange(0, 16) + int(p.alloc(16)[0]))  # a tensor in, as sglang frees
"""
    done: Any = child(source, {RECORD_ENV: str(tmp_path)})
    assert done.returncode == 0, done.stderr
    (trace,) = traces(tmp_path).values()
    assert trace.pool == "LogicalHostPool"
    assert replays(trace) == 4


# -- hardening, fifth round: what a live recording promises ----------------------------------------------


def test_snapshots_a_server_drops_are_not_kept_alive_and_one_kept_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recording numbers the snapshots taken while it records and holds them weakly: 300 snapshots of a 1M-slot
    allocator, each dropped at once, took a process from 174 to 1,690 MB when they were kept for the pool's life."""
    import gc

    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    a = PagedTokenToKVPoolAllocator(1 << 20, 16, None)
    rec = a._recording.rec
    out = a.alloc(64)
    for _ in range(300):
        a.backup_state()  # a server's step snapshot, dropped at once
    gc.collect()
    assert len(rec.backups) == 0  # none of them held
    kept = a.backup_state()
    a.free(out)
    a.restore_state(kept)
    a.free(out)
    from hostpool_nb._diagnostics.live import flush_all

    flush_all()
    (trace,) = traces(tmp_path).values()
    assert [op.name for op in trace.operations][-4:] == ["backup", "free", "restore", "free"]
    assert trace.operations[-2].arg == 300  # numbered after the 300 dropped
    assert replays(trace) == len(trace)


def test_a_recording_holds_its_calls_compressed_once_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a live recording keeps in memory is what its file holds, plus the calls since its last write."""
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    a = PagedTokenToKVPoolAllocator(1 << 16, 16, None)
    rec = a._recording.rec
    for _ in range(2000):
        a.free(a.alloc_extend([0, 0], [40, 30], [-1, -1], 70))
        a.available_size()
    assert 0 < len(rec.ops) <= 6000  # the calls since the last write (a loaded machine may pass a write's interval)
    from hostpool_nb._diagnostics.live import flush_all

    flush_all()
    assert (rec.ops, rec.data, rec.messages) == ([], [], [])  # packed: the calls are in the compressed streams
    (name,) = (p.name for p in tmp_path.iterdir())
    assert replays(T.load(tmp_path / name)) == 6000


def test_long_error_messages_keep_the_trace_within_its_bound(tmp_path: Path) -> None:
    """The bound counts what the file holds: one long message then short ones made a trace 102 times it (its
    messages one fixed-width array, the longest's width for each)."""
    source = """
from hostpool_nb import HostPoolError, LogicalHostPool
p = LogicalHostPool(1 << 16, 16)
for n in [10 ** 6000] + list(range(-1, -20000, -1)):  # a free of a huge, then of negative slots: refused, said
    try:
        p.free([n])
    except (HostPoolError, TypeError, IndexError, OverflowError):
        pass
"""
    done = child(source, {RECORD_ENV: str(tmp_path), LIMIT_ENV: "0.1"})
    assert done.returncode == 0, done.stderr
    (name,) = (p.name for p in tmp_path.iterdir())
    assert (tmp_path / name).stat().st_size <= 0.1 * (1 << 20)
    assert len(T.load(tmp_path / name)) > 100


def test_a_start_state_alone_past_the_bound_records_nothing(tmp_path: Path) -> None:
    source = """
import os, pickle
from hostpool_nb import LogicalHostPool
p = LogicalHostPool(1 << 20, 1)
held = p.alloc(1 << 20)
p.free(held[::2])  # 524,288 runs of one slot: the start state of what unpickles it
saved = pickle.dumps(p)
os.environ["HOSTPOOL_NB_RECORD"] = os.environ.pop("LATER")
q = pickle.loads(saved)
q.free(held[1:4:2])  # slots 1 and 3: still allocated
"""
    done = child(source, {"LATER": str(tmp_path), LIMIT_ENV: "0.01"})
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == []  # no trace past the bound
    assert "not recording this LogicalHostPool: the state it begins from alone takes" in done.stderr
    assert f"over {LIMIT_ENV}=0.01 MB" in done.stderr


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_multiprocessing_worker_leaves_its_whole_trace(method: str, tmp_path: Path) -> None:
    """A worker ends with os._exit, past the exit handlers: it left a 0-byte file that was not a trace."""
    source = f"""
import multiprocessing as mp

def work(n):
    from hostpool_nb.paged import TokenToKVPoolAllocator
    a = TokenToKVPoolAllocator(4096, None)
    for _ in range(n):
        a.free(a.alloc(4))
    return n

if __name__ == "__main__":
    context = mp.get_context("{method}")
    workers = context.Pool(1)  # closed and joined: its worker ends normally (a with block terminates it)
    print(workers.apply(work, (30,)))
    workers.close()
    workers.join()
    worker = context.Process(target=work, args=(20,))
    worker.start()
    worker.join()
"""
    script = tmp_path / "run.py"
    script.write_text(source)
    folder = tmp_path / "traces"
    env = {k: v for k, v in os.environ.items() if k not in (RECORD_ENV, LIMIT_ENV)}
    env |= {RECORD_ENV: str(folder), "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert sorted(replays(trace) for trace in traces(folder).values()) == [40, 60]


def test_a_relative_folder_is_resolved_once_and_a_chdir_moves_no_trace(tmp_path: Path) -> None:
    source = """
import os
from hostpool_nb.paged import TokenToKVPoolAllocator
a = TokenToKVPoolAllocator(64, None)
os.chdir(os.environ["ELSEWHERE"])  # a daemon's chdir
for _ in range(10):
    a.free(a.alloc(2))
"""
    (tmp_path / "elsewhere").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in (RECORD_ENV, LIMIT_ENV)}
    env |= {RECORD_ENV: "traces", "ELSEWHERE": str(tmp_path / "elsewhere"), "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-c", source], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    (name, trace), *_ = traces(tmp_path / "traces").items()
    assert replays(trace) == 20
    assert f"into {tmp_path / 'traces' / name} ({RECORD_ENV}=traces;" in done.stderr  # where it really goes
    assert "could not write" not in done.stderr
    assert not (tmp_path / "elsewhere" / "traces").exists()


def test_a_folder_that_is_a_file_is_said_to_be_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv(RECORD_ENV, str(blocker))
    with pytest.raises(HostPoolError) as raised:
        PagedTokenToKVPoolAllocator(64, 4, None)
    assert str(raised.value) == f"{RECORD_ENV}={str(blocker)!r}: {blocker} is a file, not a folder"


def test_the_tools_own_pools_are_never_recorded(tmp_path: Path) -> None:
    """replay and bench --trace in a server's shell recorded their own pools and timed the recording."""
    a = PagedTokenToKVPoolAllocator(4096, 16, None)
    path = tmp_path / "t.trace"
    with a.recording(path):
        for _ in range(60):
            a.free(a.alloc_extend([0, 0], [20, 5], [-1, -1], 25))
    folder = tmp_path / "recorded"
    env = {k: v for k, v in os.environ.items() if k not in (RECORD_ENV, LIMIT_ENV)}
    env |= {RECORD_ENV: str(folder), "PYTHONPATH": ROOT}
    for command in (["-m", "hostpool_nb.replay", str(path), "--time", "--repeats", "1"],):
        done = subprocess.run(
            [sys.executable, *command], env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "recording every call" not in done.stderr
    assert not folder.exists() or list(folder.iterdir()) == []
    from hostpool_nb import replay as replay_module

    os.environ[RECORD_ENV] = str(folder)  # the library's own functions too
    try:
        replay_module.replay(T.load(path))
    finally:
        del os.environ[RECORD_ENV]
    assert not folder.exists() or list(folder.iterdir()) == []


def test_batch_arguments_that_are_integers_by_index_are_recorded_replayably(tmp_path: Path) -> None:
    class Index:
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    a = PagedTokenToKVPoolAllocator(256, 4, None)
    with a.recording(tmp_path / "t.trace"):
        out = a.alloc_extend([Index(0)], [Index(6)], [Index(-1)], 6)
        a.alloc_decode([Index(7)], [Index(int(out[-1]))])
    trace = T.load(tmp_path / "t.trace")
    assert [op.unreadable for op in trace.operations] == [False, False]
    assert replays(trace) == 2
