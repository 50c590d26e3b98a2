"""No problem with numba's on-disk cache stops ``import hostpool_nb``.

The kernels compile with ``cache=True`` (``hostpool_nb/_kernels/jit.py``). Here:

* a read-only install, imported by a process that can write neither the
  package nor HOME and has no NUMBA_CACHE_DIR, compiles in memory and warns
  once (numba alone raises "no locator available" at import);
* truncated or garbage cache files are recompiled and rewritten, and the run
  after that loads every kernel from the cache again;
* the helper itself: one warning for many kernels, a broken cache it cannot
  rewrite (the warning names the directory to delete, and deleting it
  works), a cache it cannot write, and errors that must propagate (a kernel
  that does not compile, ``MemoryError``).

Every check runs in a fresh interpreter, as the warning is once per process
and the cache is read at import. Needs no torch; all but the last test are
skipped under ``NUMBA_DISABLE_JIT=1`` (no JIT, no cache).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import hostpool_nb

JIT_DISABLED = os.environ.get("NUMBA_DISABLE_JIT") == "1"
needs_jit = pytest.mark.skipif(JIT_DISABLED, reason="the numba cache exists only with the JIT on")
pytestmark = pytest.mark.slow  # child processes with cold, damaged or read-only caches

PKG = Path(hostpool_nb.__file__).resolve().parent
ROOT = PKG.parent
# A cold child compiles every kernel (~10 s on 2 cores, more when loaded).
TIMEOUT_S = 120.0

# Imports hostpool_nb, recording warnings, runs an alloc/free sequence whose
# results the parent checks, and reports where each kernel came from (kernels
# collected as in tests/kernels/test_cache_concurrency.py).
USE_POOL = r"""
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import hostpool_nb
    from hostpool_nb._kernels import pool as K
    from hostpool_nb._kernels import short as S
    from hostpool_nb._kernels.jit import is_callee
    p = hostpool_nb.LogicalHostPool(1024, 16)
    a = p.alloc(64)
    b = p.alloc(32)
    freed = p.free(a)
    c = p.alloc(960)  # more than the free list: merges the release list (FIFO)
    short = p.alloc(48)  # only 32 slots left: None
    p.free(b)
    p.free(c)
    try:
        p.free(b)
        double = "accepted"
    except hostpool_nb.DoubleFreeError:
        double = "DoubleFreeError"
    p.check_invariants()
from hostpool_nb._kernels.jit import Kernel
# The kernels this process used: compiled, or loaded from the cache, on first use.
used = {n: v.dispatcher for n, v in vars(K).items() if isinstance(v, Kernel) and v.compiled}
callees = {n: v for n, v in vars(K).items() if is_callee(v)}
print(json.dumps({
    "a": a.tolist(), "b": b.tolist(), "c": c.tolist(), "freed": freed,
    "short": short is None, "double": double, "available": p.available_size(),
    "kernels": sorted(n for n, v in vars(K).items() if isinstance(v, Kernel)),
    "used": sorted(used),
    "compiled": sorted(n for n, k in used.items() if k.stats.cache_misses),
    "loaded": sorted(n for n, k in used.items() if k.stats.cache_hits and not k.stats.cache_misses),
    "callees": sorted(callees),
    "callees_compiled": sorted(n for n, k in callees.items() if k.signatures),
    "warnings": [[w.category.__name__, str(w.message)] for w in caught],
}))
"""

EXPECTED = {
    "a": list(range(64)),
    "b": list(range(64, 96)),
    "c": list(range(96, 1024)) + list(range(32)),
    "freed": 64,
    "short": True,
    "double": "DoubleFreeError",
    "available": 1024,
}


def _env(**changes: str | None) -> dict[str, str]:
    """This process's environment, JIT on, with ``changes`` (None removes a variable)."""
    env = dict(os.environ)
    env.pop("NUMBA_DISABLE_JIT", None)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _pythonpath(first: Path) -> str:
    """``first``, then this process's PYTHONPATH."""
    return os.pathsep.join(p for p in (str(first), os.environ.get("PYTHONPATH")) if p)


def _run(args: list[str], env: dict[str, str], cwd: Path, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """Run a child to completion; assert it exited 0 and return its last JSON line."""
    done = subprocess.run(args, env=env, cwd=str(cwd), capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"child exited {done.returncode}:\n{done.stderr[-4000:]}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"child printed no result; stdout={done.stdout!r} stderr={done.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _cache_warnings(result: dict[str, Any]) -> list[str]:
    return [message for category, message in result["warnings"] if category == "KernelCacheWarning"]


# --- a. read-only install, unprivileged process ------------------------------

# Proves it cannot write the package copy or HOME, then imports and uses the
# pool with every warning recorded.
READ_ONLY_CHILD = r"""
import json, os, sys, warnings
pkg_copy, home = sys.argv[1], sys.argv[2]

def write_error(directory):
    try:
        with open(os.path.join(directory, "write-probe"), "x"):
            pass
    except OSError as exc:
        return type(exc).__name__
    return "wrote a file"

cannot_write = {"package": write_error(pkg_copy), "home": write_error(home)}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import hostpool_nb
    pool = hostpool_nb.LogicalHostPool(64, 16)
    a = pool.alloc(32)
    freed = pool.free(a)
    pool.check_invariants()
print(json.dumps({
    "cannot_write": cannot_write, "uid": os.geteuid(), "file": hostpool_nb.__file__,
    "a": a.tolist(), "freed": freed, "available": pool.available_size(),
    "warnings": [[w.category.__name__, str(w.message)] for w in caught],
}))
"""


def _unprivileged() -> list[str]:
    """Command prefix that runs a child without the right to ignore file permissions.

    Not root: nothing to drop, chmod already applies. Root: run as ``nobody``
    if ``nobody`` can run this interpreter and import numba (often it
    cannot: the interpreter or the venv may sit under a mode-0700 directory
    such as /root or CI's ``mktemp -d``). Otherwise stay uid 0 but drop every
    capability (``setpriv --bounding-set=-all --inh-caps=-all``): without
    CAP_DAC_OVERRIDE root is an ordinary owner, so the mode bits of the
    read-only copy and HOME (owned by root, no write bit) deny it writes,
    while the interpreter stays executable even under a 0700 directory. The
    child proves it cannot write either way.
    """
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root and setpriv (util-linux) is missing: cannot drop privileges")
    as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run(
        [*as_nobody, sys.executable, "-c", "import numba"],
        cwd="/",
        capture_output=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if probe.returncode == 0:
        return as_nobody
    return [setpriv, "--bounding-set=-all", "--inh-caps=-all"]


def _set_modes(top: Path, dirs: int, files: int) -> None:
    for path in [top, *top.rglob("*")]:
        path.chmod(dirs if path.is_dir() else files)


def _listing(*tops: Path) -> list[str]:
    return sorted(str(p) for top in tops for p in top.rglob("*"))


@needs_jit
def test_read_only_install_imports_as_unprivileged_user() -> None:
    """A read-only copy of the package imports, compiling in memory, with one warning.

    The child runs unprivileged (see :func:`_unprivileged`: as ``nobody``
    when that user can run this interpreter, else as root with every
    capability dropped) and first proves it can write neither the copy nor
    HOME, so the test cannot pass just because the process may write.
    """
    prefix = _unprivileged()
    # Not pytest's tmp_path: /tmp/pytest-of-root is 0700, closed to nobody.
    base = Path(tempfile.mkdtemp(prefix="hostpool-ro-", dir="/tmp" if os.path.isdir("/tmp") else None))
    try:
        base.chmod(0o755)
        site = base / "site"
        copy = site / "hostpool_nb"
        shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
        home = base / "home"
        home.mkdir()
        _set_modes(site, 0o555, 0o444)
        _set_modes(home, 0o555, 0o444)
        before = _listing(site, home)
        env = _env(
            HOME=str(home),
            NUMBA_CACHE_DIR=None,
            XDG_CACHE_HOME=None,
            PYTHONPATH=_pythonpath(site),
        )
        res = _run([*prefix, sys.executable, "-c", READ_ONLY_CHILD, str(copy), str(home)], env, cwd=home)

        # The child really could not write: the test is not vacuous as root.
        assert res["cannot_write"] == {"package": "PermissionError", "home": "PermissionError"}, res
        assert Path(res["file"]).resolve().parent == copy.resolve()
        assert (res["a"], res["freed"], res["available"]) == (list(range(32)), 32, 64)
        cache_warnings = _cache_warnings(res)
        assert len(cache_warnings) == 1, res["warnings"]
        assert "NUMBA_CACHE_DIR" in cache_warnings[0], cache_warnings[0]
        assert "in memory" in cache_warnings[0], cache_warnings[0]
        assert _listing(site, home) == before
    finally:
        _set_modes(base, 0o755, 0o644)
        shutil.rmtree(base)


# --- b. corrupt or truncated cache files -------------------------------------


@pytest.fixture(scope="module")
def filled_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A NUMBA_CACHE_DIR holding every kernel, written by one cold child."""
    cache = tmp_path_factory.mktemp("filled") / "numba_cache"
    env = _env(NUMBA_CACHE_DIR=str(cache), PYTHONPATH=_pythonpath(ROOT))
    res = _run([sys.executable, "-c", USE_POOL], env, cwd=cache.parent)
    assert {k: res[k] for k in EXPECTED} == EXPECTED
    assert res["compiled"] == res["used"], res
    # A page size 16 pool that does not track, with calls of at most
    # S.SHORT_SLOTS slots, used only the flat short kernels: nothing else
    # compiled.
    assert set(res["used"]) == {"alloc_short", "free_pn_short"}, res
    assert len(res["kernels"]) > 10, res
    # Each kernel used wrote its cache index; the callees, compiled into
    # their callers, wrote none.
    indexed = {path.name.split(".", 1)[1].split("-")[0] for path in cache.rglob("*.nbi")}
    assert indexed == set(res["used"]), sorted(indexed ^ set(res["used"]))
    assert res["callees"], res
    return cache


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(i * 37 % 251 for i in range(path.stat().st_size)))


@needs_jit
@pytest.mark.parametrize(
    ("suffix", "damage"),
    [(".nbi", _truncate), (".nbc", _truncate), (".nbi", _garbage), (".nbc", _garbage)],
    ids=["truncated-index", "truncated-data", "garbage-index", "garbage-data"],
)
def test_damaged_cache_is_rebuilt(
    filled_cache: Path, tmp_path: Path, suffix: str, damage: Callable[[Path], None]
) -> None:
    cache = tmp_path / "numba_cache"
    shutil.copytree(filled_cache, cache)
    damaged = list(cache.rglob("*" + suffix))
    assert damaged
    for path in damaged:
        damage(path)
    env = _env(NUMBA_CACHE_DIR=str(cache), PYTHONPATH=_pythonpath(ROOT))

    rebuilt = _run([sys.executable, "-c", USE_POOL], env, cwd=tmp_path)
    assert {k: rebuilt[k] for k in EXPECTED} == EXPECTED
    # Every kernel's files were damaged, so every kernel used compiled again.
    assert rebuilt["compiled"] == rebuilt["used"], rebuilt
    assert _cache_warnings(rebuilt) == []  # recovered: nothing to report

    warm = _run([sys.executable, "-c", USE_POOL], env, cwd=tmp_path)
    assert {k: warm[k] for k in EXPECTED} == EXPECTED
    # The rebuild rewrote the cache: everything loads, nothing compiles,
    # and the callees, whose code the kernels' cached code contains, are
    # not even compiled.
    assert warm["loaded"] == warm["used"], warm
    assert warm["compiled"] == [], warm
    assert warm["callees"], warm
    assert warm["callees_compiled"] == [], warm
    assert _cache_warnings(warm) == []


# --- c. the helper on small kernels ------------------------------------------

# A child script, written to a file so numba can cache its functions. It
# makes kernels of ``square`` and friends with hostpool_nb's helper, with
# every warning recorded, after an optional SETUP snippet.
HELPER_CHILD = r"""
import json, warnings
import numba
from hostpool_nb._kernels.jit import kernel

def square(x):
    return x * x

def twice(x):
    return 2 * x

def negate(x):
    return -x

def broken(x):
    return x.no_such_attribute

FUNCS = {"square": square, "twice": twice, "negate": negate, "broken": broken}
# SETUP

out = {"kernels": {}, "errors": {}}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for name in NAMES:
        try:
            k = kernel("i8(i8)")(FUNCS[name])
            first = int(k(-3))  # compiles (or loads) here, on first use
        except BaseException as exc:
            out["errors"][name] = type(exc).__name__
            continue
        out["kernels"][name] = {
            "results": [first] + [int(k(v)) for v in (0, 7)],
            "expected": [FUNCS[name](v) for v in (-3, 0, 7)],
            "overloads": len(k.dispatcher.overloads),
            "is_dispatcher": isinstance(k.dispatcher, numba.core.dispatcher.Dispatcher),
            "cache_path": k.dispatcher.stats.cache_path,
            "from_cache": bool(k.dispatcher.stats.cache_hits) and not k.dispatcher.stats.cache_misses,
        }
out["warnings"] = [[w.category.__name__, str(w.message)] for w in caught]
print(json.dumps(out))
"""


def _helper_child(tmp_path: Path, names: list[str], setup: str = "") -> dict[str, Any]:
    """Run HELPER_CHILD from a file in ``tmp_path``, making kernels of ``names``."""
    script = tmp_path / "helper_child.py"
    code = HELPER_CHILD.replace("# SETUP", f"NAMES = {names!r}\n{setup}")
    # Written only when its text changes, as a source file is: numba before
    # 0.68 stamps a cache with the source's mtime, so a rewrite would make
    # every cache entry stale.
    if not script.exists() or script.read_text() != code:
        script.write_text(code)
    return _run([sys.executable, str(script)], _env(PYTHONPATH=_pythonpath(ROOT)), cwd=tmp_path)


def _assert_correct(res: dict[str, Any], names: list[str]) -> None:
    assert sorted(res["kernels"]) == sorted(names), res
    for name in names:
        k = res["kernels"][name]
        assert k["is_dispatcher"], (name, k)
        assert k["results"] == k["expected"], (name, k)
        assert k["overloads"] == 1, (name, k)


@needs_jit
def test_no_cache_location_warns_once_for_many_kernels(tmp_path: Path) -> None:
    # Functions defined in ``-c`` code have no source file: numba has no
    # locator for them, exactly as for a read-only install.
    names = ["square", "twice", "negate"]
    code = HELPER_CHILD.replace("# SETUP", f"NAMES = {names!r}")
    res = _run([sys.executable, "-c", code], _env(PYTHONPATH=_pythonpath(ROOT)), cwd=tmp_path)
    _assert_correct(res, names)
    assert [category for category, _ in res["warnings"]] == ["KernelCacheWarning"], res["warnings"]
    message = res["warnings"][0][1]
    assert "compiled in memory on every start" in message, message
    assert "no locator available" in message, message
    assert "set NUMBA_CACHE_DIR to a writable directory" in message, message


@needs_jit
def test_no_cache_location_does_not_hide_compile_errors(tmp_path: Path) -> None:
    code = HELPER_CHILD.replace("# SETUP", "NAMES = ['broken']")
    res = _run([sys.executable, "-c", code], _env(PYTHONPATH=_pythonpath(ROOT)), cwd=tmp_path)
    assert res["errors"] == {"broken": "TypingError"}, res
    assert res["warnings"] == []


@needs_jit
def test_helper_caches_and_rebuilds_a_damaged_cache(tmp_path: Path) -> None:
    names = ["square", "twice", "negate"]
    cold = _helper_child(tmp_path, names)
    _assert_correct(cold, names)
    assert cold["warnings"] == [], cold
    assert not any(k["from_cache"] for k in cold["kernels"].values()), cold
    cache_dir = Path(cold["kernels"]["square"]["cache_path"])
    for path in cache_dir.glob("helper_child.*.nb[ic]"):
        _truncate(path)

    rebuilt = _helper_child(tmp_path, names)
    _assert_correct(rebuilt, names)
    assert rebuilt["warnings"] == [], rebuilt
    assert not any(k["from_cache"] for k in rebuilt["kernels"].values()), rebuilt

    warm = _helper_child(tmp_path, names)
    _assert_correct(warm, names)
    assert warm["warnings"] == [], warm
    assert all(k["from_cache"] for k in warm["kernels"].values()), warm


@needs_jit
def test_cache_that_cannot_be_rebuilt_names_the_directory_to_delete(tmp_path: Path) -> None:
    names = ["square", "twice", "negate"]
    cold = _helper_child(tmp_path, names)
    assert cold["warnings"] == [], cold
    cache_dir = Path(cold["kernels"]["square"]["cache_path"])
    # An index that is a directory can be neither read nor replaced.
    indexes = list(cache_dir.glob("helper_child.*.nbi"))
    assert len(indexes) == len(names)
    for index in indexes:
        index.unlink()
        index.mkdir()

    broken = _helper_child(tmp_path, names)
    _assert_correct(broken, names)  # compiled in memory
    assert [category for category, _ in broken["warnings"]] == ["KernelCacheWarning"], broken["warnings"]
    message = broken["warnings"][0][1]
    assert "compiled in memory on every start" in message, message
    assert f"delete the directory {cache_dir}." in message, message

    # The advice works: after deleting that directory the cache is rebuilt.
    shutil.rmtree(cache_dir)
    rebuilt = _helper_child(tmp_path, names)
    _assert_correct(rebuilt, names)
    assert rebuilt["warnings"] == [], rebuilt
    warm = _helper_child(tmp_path, names)
    _assert_correct(warm, names)
    assert warm["warnings"] == [], warm
    assert all(k["from_cache"] for k in warm["kernels"].values()), warm


@needs_jit
def test_cache_that_cannot_be_written_keeps_the_compiled_kernel(tmp_path: Path) -> None:
    names = ["square", "twice", "negate"]
    setup = (
        "import errno\n"
        "from numba.core import caching\n"
        "def _full(self, name, data):\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "caching.IndexDataCacheFile._save_data = _full\n"
    )
    res = _helper_child(tmp_path, names, setup)
    _assert_correct(res, names)
    assert [category for category, _ in res["warnings"]] == ["KernelCacheWarning"], res["warnings"]
    message = res["warnings"][0][1]
    assert "could not write its cache in" in message, message
    assert "No space left on device" in message, message
    assert "set NUMBA_CACHE_DIR to a writable directory" in message, message


@needs_jit
def test_errors_that_are_not_cache_failures_propagate(tmp_path: Path) -> None:
    # A kernel that does not compile, with a working cache.
    res = _helper_child(tmp_path, ["broken"])
    assert res["errors"] == {"broken": "TypingError"}, res
    assert res["warnings"] == [], res
    # Running out of memory while loading the cache is not a cache problem.
    setup = (
        "from numba.core import caching\n"
        "def _oom(self, key):\n"
        "    raise MemoryError\n"
        "caching.IndexDataCacheFile.load = _oom\n"
    )
    res = _helper_child(tmp_path, ["square"], setup)
    assert res["errors"] == {"square": "MemoryError"}, res
    assert res["warnings"] == [], res


def test_disabled_jit_returns_the_python_function(tmp_path: Path) -> None:
    code = (
        "import json, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from hostpool_nb._kernels.jit import kernel\n"
        "    def f(x):\n"
        "        return x + 1\n"
        "    k = kernel('i8(i8)')(f)\n"
        "print(json.dumps({'same': k is f, 'value': k(41), 'warnings': [str(w.message) for w in caught]}))\n"
    )
    res = _run([sys.executable, "-c", code], _env(NUMBA_DISABLE_JIT="1", PYTHONPATH=_pythonpath(ROOT)), cwd=tmp_path)
    assert res == {"same": True, "value": 42, "warnings": []}


# --- a change to the kernels' shared constants reaches every kernel module ----------------

PAGED_CHILD = r"""
import json
from hostpool_nb._kernels import paged as P, pool as K
from hostpool_nb.paged import PagedTokenToKVPoolAllocator
alloc = PagedTokenToKVPoolAllocator(64 * 16, 16, None)
out = alloc.alloc(32)
first_free = alloc.free_pages[0][:3].tolist()
alloc.free(out)
alloc.merge_and_sort_free()
try:
    alloc.check_invariants()
    broken = None
except RuntimeError as exc:
    broken = str(exc)
from hostpool_nb._kernels.jit import Kernel
kernels = {n: v.dispatcher for n, v in vars(P).items() if isinstance(v, Kernel) and v.compiled}
print(json.dumps({
    "first_free": first_free,
    "alloc": out.tolist(),
    "broken": broken,
    "compiled": sorted(n for n, k in kernels.items() if k.stats.cache_misses),
}))
"""


@needs_jit
def test_a_changed_constant_recompiles_the_kernels_that_read_it(tmp_path: Path) -> None:
    """numba keys a kernel's cache to its own file, but _kernels/paged.py compiles in _kernels/layout.py's constants.

    With only numba's own stamp, changing OWNER_ALLOCATED in the layout
    left most of _kernels/paged.py's kernels loading their cached code,
    which still flagged the padding page with the old value: the allocator
    failed its invariants. Every kernel's index is stamped with every
    kernel module of the package.
    """
    site = tmp_path / "site"
    shutil.copytree(PKG, site / "hostpool_nb", ignore=shutil.ignore_patterns("__pycache__"))
    env = _env(NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=_pythonpath(site))
    first = _run([sys.executable, "-c", PAGED_CHILD], env, tmp_path)
    assert (first["first_free"], first["broken"]) == ([3, 4, 5], None)  # pages 1, 2 were just allocated
    assert first["compiled"]
    kernels_py = site / "hostpool_nb" / "_kernels" / "layout.py"
    text = kernels_py.read_text()
    assert "OWNER_ALLOCATED = 1\n" in text
    kernels_py.write_text(text.replace("OWNER_ALLOCATED = 1\n", "OWNER_ALLOCATED = 5\n"))
    changed = _run([sys.executable, "-c", PAGED_CHILD], env, tmp_path)
    assert changed["broken"] is None, changed["broken"]
    assert (changed["first_free"], changed["alloc"]) == ([3, 4, 5], list(range(16, 48)))
    assert sorted(changed["compiled"]) == sorted(first["compiled"]), "a paged kernel loaded code of the old file"
