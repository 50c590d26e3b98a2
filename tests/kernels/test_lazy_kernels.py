"""Kernels compile on their first use, each process paying only for the kernels it calls.

``import hostpool_nb`` compiles nothing; a pool's first calls compile (or
load from numba's cache) the kernels of its page-size class and kind; a
module's kernel stand-in rebinds itself to the compiled entry point on its
first call; a compile that takes long says so once on the ``hostpool_nb``
logger; ``python -m hostpool_nb.warmup`` compiles everything ahead. The
cold checks run in fresh interpreters with an empty ``NUMBA_CACHE_DIR``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import hostpool_nb
from hostpool_nb._kernels import jit as _jit
from hostpool_nb._kernels import layout as L
from hostpool_nb._kernels import pool as K
from tests.conftest import JIT_DISABLED, TORCH_MODULES

needs_jit = pytest.mark.skipif(JIT_DISABLED, reason="nothing compiles with the JIT off")
ROOT = Path(hostpool_nb.__file__).resolve().parent.parent

# Runs FIRST (the calls under test) after importing the package, then reports
# which kernels of each module the process compiled or loaded.
CHILD = r"""
import json, sys
import hostpool_nb
from pathlib import Path
from hostpool_nb._kernels.jit import KERNELS

def used():  # each compiled kernel, named as its cache files are: source file, then name
    return sorted(f"{Path(k.py_func.__code__.co_filename).stem}.{k.__name__}" for k in KERNELS if k.compiled)

after_import = used()
exec(sys.argv[1])
print(json.dumps({"after_import": after_import, "used": used()}))
"""


def _child(code: str, cache: Path, *args: str) -> dict[str, Any]:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    env.pop("NUMBA_DISABLE_JIT", None)
    done = subprocess.run(
        [sys.executable, *args, "-c", CHILD, code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    result["stderr"] = done.stderr
    return result


_SHORT = {"flat.alloc_short", "flat.free_pn_short"}  # the flat pair a page size above 1 starts with
_SHORT_1 = {"flat.alloc_short", "flat.free_p1_short"}  # and page size 1
FIRST_CALLS = {
    "page size 64": ("p = hostpool_nb.LogicalHostPool(1 << 14, 64); p.free(p.alloc(64))", _SHORT),
    "page size 1": ("p = hostpool_nb.LogicalHostPool(1 << 14, 1); p.free(p.alloc(64))", _SHORT_1),
    "a call that keeps the GIL": (
        "p = hostpool_nb.LogicalHostPool(1 << 14, 1); p.free(p.alloc(2048))",
        _SHORT_1 | {"pool.alloc_pages_gil", "pool.free_p1_gil"},
    ),
    "long calls": (
        "p = hostpool_nb.LogicalHostPool(1 << 14, 1); p.free(p.alloc(8192))",
        _SHORT_1 | {"pool.alloc_pages", "pool.free_p1"},
    ),
    "tracked": (
        "p = hostpool_nb.LogicalHostPool(1 << 14, 16, track=True); p.free(p.alloc(64))",
        {"pool.alloc_tracked_short", "pool.free_tracked_short"},
    ),
    "alloc_many": (
        "p = hostpool_nb.LogicalHostPool(1 << 14, 16); s, o = p.alloc_many([16, 32]); p.free(s)",
        _SHORT | {"pool.plan_batch"},
    ),
    "free group": (
        "p = hostpool_nb.LogicalHostPool(1 << 14, 16); a = p.alloc(64)\nwith p.free_group():\n    p.free(a)",
        _SHORT | {"pool.group_begin", "pool.group_end"},
    ),
    "paged alloc_extend": (
        "from hostpool_nb.paged import PagedTokenToKVPoolAllocator\n"
        "a = PagedTokenToKVPoolAllocator(1 << 14, 16, None); a.alloc_extend([0], [20], [-1], 20)",
        {"paged.reset_rank", "paged.alloc_extend"},
    ),
    "host pool": (
        "h = hostpool_nb.HostPagePool(1024); h.free(h.alloc(32))",
        {"host.host_reset", "host.host_alloc", "host.host_free"},
    ),
}


@pytest.mark.slow
@needs_jit
@pytest.mark.parametrize("name", list(FIRST_CALLS))
def test_first_calls_compile_only_the_kernels_they_use(name: str, tmp_path: Path) -> None:
    code, expected = FIRST_CALLS[name]
    res = _child(code, tmp_path / "cache")
    assert res["after_import"] == [], "import hostpool_nb compiled kernels"
    assert set(res["used"]) == expected, sorted(set(res["used"]) ^ expected)
    # Each compiled kernel wrote its cache files, and only those did.
    written = {p.name.split("-")[0] for p in (tmp_path / "cache").rglob("*.nbi")}
    assert written == expected


# Each kind of pool, built, then every call it offers: the calls after warmup.load(pool) load no kernel.
_EVERY_CALL = {
    "paged": (
        "from hostpool_nb.paged import PagedTokenToKVPoolAllocator as C; p = C(1 << 12, 16, None)",
        "o = p.alloc_extend([0, 0], [20, 5], [-1, -1], 25); d = p.alloc_decode([21, 6], [int(o[19]), int(o[24])]); "
        "p.free_group_begin(); p.free(o[:20]); p.free_group_end(); p.free(o[20:]); p.free(d); p.alloc(32); "
        "s = p.backup_state(); p.merge_and_sort_free(); p.restore_state(s); p.available_size(); p.clear()",
    ),
    "token": (
        "from hostpool_nb.paged import TokenToKVPoolAllocator as C; p = C(1 << 12, None)",
        "o = p.alloc(40); p.free_group_begin(); p.free(o[:20]); p.free_group_end(); p.free(o[20:]); "
        "s = p.backup_state(); p.merge_and_sort_free(); p.restore_state(s); p.available_size(); p.clear()",
    ),
    "sliding window": (
        "from types import SimpleNamespace as N; from hostpool_nb.paged import SWATokenToKVPoolAllocator as C; "
        "p = C(1 << 12, 1 << 10, N(full_kv_pool=None, swa_kv_pool=None), 16)",
        "o = p.alloc_extend([0], [40], [-1], 40); d = p.alloc_decode([41], [int(o[39])]); p.free_swa(o[:16]); "
        "p.free_group_begin(); p.free(o); p.free_group_end(); p.free(d); p.alloc(32); s = p.backup_state(); "
        "p.merge_and_sort_free(); p.restore_state(s); p.available_size(); p.clear()",
    ),
    "host page pool": (
        "p = hostpool_nb.HostPagePool(64)",
        "b = p.reserve(); p.inc_lock_ref(b); p.dec_lock_ref(b); p.release(b); a = p.alloc(3); p.free(a); "
        "p.free_listed(p.alloc(2)); s = p.backup_state(); p.restore_state(s); p.clear()",
    ),
    "logical host pool": (
        "p = hostpool_nb.LogicalHostPool(1 << 14, 1)",
        "for n in (16, 2048, 8192): p.free(p.alloc(n))\n"
        "s, o = p.alloc_many([16, 32]); p.free(s); p.alloc(1 << 15)\n"
        "with p.free_group(): p.free(p.alloc(16))\n"
        "p.merge(); st = p.backup_state(); p.restore_state(st); p.clear()",
    ),
}


@pytest.mark.slow
@needs_jit
@pytest.mark.parametrize("name", list(_EVERY_CALL))
def test_a_pool_loaded_by_warmup_load_loads_no_kernel_on_its_calls(name: str) -> None:
    build, calls = _EVERY_CALL[name]
    code = (
        f"{build}\nfrom hostpool_nb.warmup import load\nload(p)\nloaded = used()\n{calls}\n"
        "assert used() == loaded, sorted(set(used()) - set(loaded))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # the package's own cache: warm after the first run
    env.pop("NUMBA_DISABLE_JIT", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, code], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_warmup_load_refuses_what_is_not_a_pool() -> None:
    from hostpool_nb.warmup import load

    with pytest.raises(TypeError, match="load takes a hostpool_nb pool or allocator, got list"):
        load([])


# Every timer fires as it starts: a compile (or a cache load) is "slow" on any machine, however fast.
_ALWAYS_SLOW = """
import threading
class Now:
    def __init__(self, interval, function, args=()):
        self.function, self.args, self.daemon = function, args, False
    def start(self):
        self.function(*self.args)
    def cancel(self):
        pass
threading.Timer = Now
"""


@pytest.mark.slow
@needs_jit
def test_a_slow_compile_says_so_once_and_a_slow_load_from_the_cache_says_nothing(tmp_path: Path) -> None:
    code = "p = hostpool_nb.LogicalHostPool(1 << 14, 16); p.free(p.alloc(64))"
    cold = _child(_ALWAYS_SLOW + code, tmp_path / "cache")
    notices = [line for line in cold["stderr"].splitlines() if "compiling numba kernels on their first use" in line]
    assert len(notices) == 1, cold["stderr"]
    assert "hostpool_nb.warmup" in notices[0]
    assert str(tmp_path / "cache") in notices[0]  # where numba really caches them
    # Every kernel now loads from the cache: however long that takes, nothing compiles, and nothing is said.
    warm = _child(_ALWAYS_SLOW + code, tmp_path / "cache")
    assert warm["stderr"] == ""


@pytest.mark.slow
@needs_jit
def test_a_numba_cache_dir_that_is_a_file_is_said_to_be_ignored(tmp_path: Path) -> None:
    setting = tmp_path / "not-a-directory"
    setting.write_text("")
    code = "import warnings\nwarnings.simplefilter('always')\np = hostpool_nb.HostPagePool(8); p.free(p.alloc(2))"
    res = _child(code, setting)
    warning = [line for line in res["stderr"].splitlines() if "KernelCacheWarning" in line]
    assert len(warning) == 1, res["stderr"]
    assert f"NUMBA_CACHE_DIR={setting} is not a directory numba can write to" in warning[0]
    # ... and where numba caches them instead: beside the package, or in the user's cache.
    assert "caches the kernels in " in warning[0]
    assert "__pycache__" in warning[0] or ".cache" in warning[0], warning[0]


class _TimerNow:
    """A ``threading.Timer`` that fires as it starts: the compile is then always "slow"."""

    def __init__(self, interval: float, function: Any, args: tuple[Any, ...] = ()) -> None:
        self.function, self.args = function, args
        self.daemon = False

    def start(self) -> None:
        self.function(*self.args)

    def cancel(self) -> None:
        pass


@needs_jit
def test_the_notice_goes_through_logging_once_per_process(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def slow(x: int) -> int:
        return x + 1

    def slower(x: int) -> int:
        return x + 2

    from numba.core import event

    def compiling(func: Any, signature: str, *, nogil: bool = True, watch: Any = None) -> Any:
        """A compile as numba does one after a cache miss (its event, here, whatever the cache holds)."""
        if watch is not None:
            watch.where = "/the/cache"
        with event.trigger_event("numba:compile", data={}):
            pass
        return func, None

    monkeypatch.setattr(_jit.threading, "Timer", _TimerNow)
    monkeypatch.setattr(_jit, "_compile", compiling)
    monkeypatch.setattr(_jit._COMPILER, "announced", False)
    with caplog.at_level(logging.WARNING, logger="hostpool_nb"):
        assert _jit.Kernel(slow, "i8(i8)", nogil=True)(41) == 42
        assert _jit.Kernel(slower, "i8(i8)", nogil=True)(40) == 42
    records = [r for r in caplog.records if r.name == "hostpool_nb"]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "compiling numba kernels on their first use" in records[0].getMessage()
    assert "/the/cache" in records[0].getMessage()
    assert records[0].levelno == logging.WARNING


@needs_jit
def test_a_module_stand_in_rebinds_itself_on_its_first_call() -> None:
    def plus(x: int) -> int:
        return x + 3

    made = _jit.Kernel(plus, "i8(i8)", nogil=True)
    module: dict[str, Any] = {"made": made}
    exec("from hostpool_nb._kernels.jit import entry_point\nstand_in = entry_point(made)\nalias = stand_in", module)
    kept = [module["stand_in"]]  # a reference outside the module's globals
    assert not made.compiled  # binding compiles nothing
    assert module["stand_in"](4) == 7
    assert made.compiled
    for name in ("stand_in", "alias"):  # every global holding the stand-in: now the entry point itself
        assert type(module[name]).__name__ == "builtin_function_or_method", name
    assert kept[0] is not module["stand_in"]
    assert kept[0](5) == 8  # the stand-in still works where it was kept


@needs_jit
def test_listing_or_inspecting_a_kernel_compiles_nothing() -> None:
    def plus(x: int) -> int:
        return x + 3

    made = _jit.Kernel(plus, "i8(i8)", nogil=True)
    assert not _jit.is_callee(made)
    assert not hasattr(made, "overloads")
    assert "not compiled yet" in repr(made)
    assert not made.compiled


@needs_jit
def test_a_callee_called_from_python_is_a_type_error_not_a_crash() -> None:
    with pytest.raises(TypeError, match="has no Python entry point"):
        K.long_run(16)
    assert _jit.callable_from_python(K.long_run)(16) == 64


@pytest.mark.slow
@needs_jit
def test_constant_and_narrow_arguments_share_one_compile_of_a_callee() -> None:
    """``fail(E_RANGE, 0)``, ``fail(E_SHORT, i)``, an int32 page id or an int64 one: one signature each.

    Copies of two kernels are compiled here, in memory, so that their
    callees are compiled in this process whatever the cache holds.
    """
    import types as pytypes

    from numba import njit
    from numba.core import types

    for name in ("free_pn", "alloc_pages"):
        py = getattr(K, name).py_func
        copy = pytypes.FunctionType(py.__code__, py.__globals__, f"{name}_copy")
        njit("i8(i8[::1], i8[::1])", cache=False, _nrt=False)(copy)
    assert L.fail.signatures == [(types.int64, types.int64)]
    assert len(K._claim_flags.signatures) == 1  # called with a page id read from the input and one computed


@pytest.mark.slow
@needs_jit
def test_a_fork_waits_for_a_compile_in_flight(tmp_path: Path) -> None:
    """A child forked while another thread compiles can compile itself: it did not inherit a held compile lock."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    code = r"""
import os, threading, time
from hostpool_nb._kernels import jit as _jit

def a(x):
    return x + 1

def b(x):
    return x + 2

started = threading.Event()
def compile_a():
    started.set()
    _jit.Kernel(a, "i8(i8)", nogil=True)(1)

t = threading.Thread(target=compile_a)
t.start()
started.wait()
time.sleep(0.01)  # inside the compile, most likely
pid = os.fork()
if pid == 0:
    os._exit(0 if _jit.Kernel(b, "i8(i8)", nogil=True)(1) == 3 else 1)
t.join()
_, status = os.waitpid(pid, 0)
print('{"child": %d}' % os.waitstatus_to_exitcode(status))
"""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    env.pop("NUMBA_DISABLE_JIT", None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"child": 0}


@pytest.mark.slow
@needs_jit
def test_warmup_compiles_every_kernel_then_loads_them(tmp_path: Path) -> None:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    env.pop("NUMBA_DISABLE_JIT", None)
    command = [sys.executable, "-m", "hostpool_nb.warmup"]
    cold = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert cold.returncode == 0, cold.stderr[-3000:]
    # The package's kernels, counted in a fresh process as warmup lists them: in this one, tests that
    # compile variants of a kernel (test_runs.py) have registered more.
    listing = (
        "import importlib\n"
        "from hostpool_nb._kernels import MODULES, jit as _jit\n"
        "for module in MODULES:\n"
        "    importlib.import_module('hostpool_nb._kernels.' + module)\n"
        "print(len(_jit.KERNELS))\n"
    )
    listed = subprocess.run([sys.executable, "-c", listing], env=env, capture_output=True, text=True, check=True)
    count = int(listed.stdout)
    assert f"{count} kernels ready" in cold.stderr, cold.stderr
    assert f"({count} compiled, 0 loaded" in cold.stderr, cold.stderr
    assert "first use" not in cold.stderr  # warmup says what it does itself
    assert cold.stderr.count(" compiled in ") == count  # a line per kernel as it goes: a cold run takes a minute
    assert f"[{count}/{count}] " in cold.stderr
    indexed = list((tmp_path / "cache").rglob("*.nbi"))
    assert len(indexed) == count
    warm = subprocess.run([*command, "--quiet"], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert (warm.returncode, warm.stdout, warm.stderr) == (0, "", "")
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert f"(0 compiled, {count} loaded from the cache)" in again.stderr, again.stderr


def test_warmup_without_the_jit_has_nothing_to_do(tmp_path: Path) -> None:
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "hostpool_nb.warmup"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "0 kernels ready" in done.stderr


def test_compile_all_from_threads_compiles_each_kernel_once() -> None:
    from hostpool_nb.warmup import compile_all

    errors: list[BaseException] = []

    def run() -> None:
        try:
            compile_all(quiet=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(k.compiled for k in _jit.KERNELS)
    assert all(len(k.dispatcher.overloads) == 1 for k in _jit.KERNELS)


def test_a_kernel_takes_one_signature() -> None:
    # One compiled entry point per kernel; numba < 0.68 does not reload several from a rebuilt cache.
    with pytest.raises(TypeError, match="one signature string"):
        _jit.kernel(("i8(i8)", "f8(f8)"))  # type: ignore[arg-type]


@needs_jit
def test_every_kernel_callee_and_window_is_defined_in_a_module_the_cache_stamp_reads() -> None:
    """The cache stamp and warmup read _kernels.MODULES: a module of kernels left out would load stale code."""
    import importlib
    import pkgutil

    import hostpool_nb
    from hostpool_nb._kernels import MODULES

    for info in pkgutil.walk_packages(hostpool_nb.__path__, "hostpool_nb."):
        if info.name not in TORCH_MODULES:  # torch's adapters define no kernels, and torch may be absent
            importlib.import_module(info.name)
    defining = set()
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if not name.startswith("hostpool_nb."):
            continue
        for value in vars(module).values():
            if isinstance(value, _jit.Kernel) or _jit.is_callee(value):
                defining.add(getattr(value, "py_func", value).__module__)
    assert defining, "no kernel found"
    stamped = {f"hostpool_nb._kernels.{m}" for m in MODULES}
    assert defining <= stamped, defining - stamped
    assert {"hostpool_nb._kernels.pool", "hostpool_nb._kernels.paged", "hostpool_nb._kernels.host"} <= defining
    assert {k.__module__ for k in _jit.KERNELS} <= stamped
    assert [name for name, *_ in _jit._PACKAGE_STAMP] == [f"{m}.py" for m in MODULES]  # every file stamped


@needs_jit
def test_every_kernel_warmup_compiles_is_in_a_pool_kinds_table() -> None:
    """What warmup compiles (every kernel made) is what some pool kind's table hands its class: nothing uncalled."""
    import importlib

    from hostpool_nb._kernels import MODULES

    tabled: set[int] = set()
    for module in MODULES:
        loaded = importlib.import_module(f"hostpool_nb._kernels.{module}")
        for table in (getattr(loaded, "KERNELS", None), getattr(loaded, "POOL", None)):
            if module == "jit" or table is None:
                continue
            rows = table if isinstance(table[0], tuple) else (table,)  # a row per variant, or one row
            tabled |= {id(k) for row in rows for k in row}
    made = [k.__name__ for k in _jit.KERNELS]
    assert len(made) > 40  # the registry was found at all
    assert [name for k, name in zip(_jit.KERNELS, made, strict=True) if id(k) not in tabled] == []
