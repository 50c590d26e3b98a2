"""Shared test helpers: pool state snapshots and hypothesis profiles.

Profiles (pick one with ``HYPOTHESIS_PROFILE=<name>``):

``default``  local runs; derandomized, no example database.
``ci``       more examples; derandomized, no example database.
``nojit``    fewer examples; replaces ``default`` and ``ci`` when
             ``NUMBA_DISABLE_JIT=1`` (the kernels then run as plain Python).
``mutation`` fewer still, for ``python -m tests.mutation``.

Any other profile named in ``HYPOTHESIS_PROFILE`` is used as is.

Every profile is derandomized and keeps no database, so a run's outcome
depends only on the code under test: no flakiness in CI.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from hostpool_nb._kernels import layout as L

JIT_DISABLED = os.environ.get("NUMBA_DISABLE_JIT") == "1"
# The package's modules that import torch: not imported (nor their examples run) where torch is absent.
TORCH_MODULES = frozenset(
    {
        "hostpool_nb.torch",
        "hostpool_nb.integrations._sglang_host",
        "hostpool_nb.integrations._sglang_interleave",
        "hostpool_nb.integrations._sglang_envelope",
    }
)

_COMMON: dict[str, Any] = {
    "deadline": None,  # first calls may load or compile kernels
    "derandomize": True,
    "database": None,
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow],
}
settings.register_profile("default", max_examples=100, stateful_step_count=50, **_COMMON)
settings.register_profile("ci", max_examples=200, stateful_step_count=50, **_COMMON)
settings.register_profile("nojit", max_examples=100, stateful_step_count=40, **_COMMON)
# python -m tests.mutation: one test run per planted bug, thousands of them.
settings.register_profile("mutation", max_examples=60, stateful_step_count=30, **_COMMON)


def _profile_name() -> str:
    name = os.environ.get("HYPOTHESIS_PROFILE") or "default"
    if JIT_DISABLED and name in ("default", "ci"):
        return "nojit"  # plain-Python kernels: keep the run short
    return name


settings.load_profile(_profile_name())


Snapshot = tuple[np.ndarray, np.ndarray, np.ndarray]


class RaisingEq:
    """An integer by ``__index__`` whose ``==`` raises: not an integer to any pool (the bad-input matrices)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        raise ZeroDivisionError("no eq")

    __hash__ = object.__hash__


def take_snapshot(pool: Any) -> Snapshot:
    """Copies of what fully determines a pool's logical state.

    The header, the live window of the ring (free list then release list,
    in order) and the owner flags. The ring's other entries are scratch
    (``free`` stages validated page ids there), so they are left out.
    """
    st = pool._st
    window = np.concatenate(L.window_entries(st))  # the runs as entries: how they are split matters too
    return st[: L.HEADER].copy(), window.copy(), pool._owner.copy()


def assert_unchanged(pool: Any, before: Snapshot) -> None:
    """The pool's logical state equals ``before``, its invariants hold, and its lock is free.

    Every failed call is followed by this check, so it also proves that the
    call released the lock on its way out. The lock is an ``RLock``: the
    thread that made the call could take it again even if it were still
    held, so another thread tries, with a timeout rather than a hang.
    """
    after = take_snapshot(pool)
    for name, old, new in zip(("header", "free+release window", "owner flags"), before, after, strict=True):
        assert np.array_equal(old, new), f"{name} changed: {old} -> {new}"
    pool.check_invariants()
    assert_lock_free(pool)


def assert_refused(pool: Any, before: Snapshot, times: int = 1) -> None:
    """Like :func:`assert_unchanged` for an allocation answered ``None``.

    Refusing changes nothing but the statistics: the answered calls and the
    failed ones each grow by ``times``, and no other header word moves.
    """

    header = before[0].copy()
    header[L.H_ALLOC_CALLS] += times
    header[L.H_FAILED_ALLOCS] += times
    assert_unchanged(pool, (header, before[1], before[2]))


@pytest.fixture
def refused() -> Callable[..., None]:
    """``refused(pool, before)`` asserts an allocation was answered None, changing nothing else."""
    return assert_refused


def assert_lock_free(pool: Any) -> None:
    """Another thread can acquire ``pool.lock`` within a few seconds."""
    got: list[bool] = []

    def take() -> None:
        acquired = pool.lock.acquire(timeout=5)
        got.append(acquired)
        if acquired:
            pool.lock.release()

    t = threading.Thread(target=take)
    t.start()
    t.join(timeout=10)
    assert got == [True], "the pool's lock is still held after the call returned"


@pytest.fixture
def snapshot() -> Callable[[Any], Snapshot]:
    """``snapshot(pool)`` -> an opaque state copy for :func:`unchanged`."""
    return take_snapshot


@pytest.fixture
def unchanged() -> Callable[[Any, Snapshot], None]:
    """``unchanged(pool, before)`` asserts the pool still equals ``before``."""
    return assert_unchanged


def run_child(source: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run ``source`` in a child interpreter with ``args`` as JSON in argv[1]; return its last line of JSON.

    The child imports the same package as the tests. A crash (a negative exit
    code: killed by a signal) fails the calling test instead of killing
    pytest, with the end of the child's stderr.
    """
    import hostpool_nb

    env = dict(os.environ)
    root = str(Path(hostpool_nb.__file__).resolve().parent.parent)  # the package the tests import
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", source, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"child exited {proc.returncode} (negative: killed by signal)\n{proc.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def loaded(line: str) -> int:
    """How many kernels an integration's INFO line says its pool loaded when it was built (ms, a whole number)."""
    found = re.fullmatch(r".*; (\d+) kernels loaded in \d+ ms \(hostpool_nb [0-9][^ ]* from .+\)", line)
    assert found, line
    return int(found[1])


@pytest.fixture(scope="session")
def all_kernels() -> None:
    """Every kernel compiled (or loaded): for tests that measure a call, not its first compile."""
    from hostpool_nb.warmup import compile_all

    compile_all(quiet=True)


def one_entry_per_page(st: np.ndarray, head: int | None = None) -> np.ndarray:
    """Rewrite ``st``'s lists with every page a run of its own (a valid state), and return the ring.

    Then ring position ``head + i`` holds the ``i``-th listed page, as in
    the layout before runs: tests that corrupt one listed page write it
    there. The pages, their order and the owner flags stay as they were;
    the window starts at ring position ``head`` (where it was by default).
    """
    n = int(st[L.H_NPAGES])
    pages = L.listed(st)
    ring = L.ring_ids(st, n)
    if head is not None:
        st[L.H_HEAD] = head
    ring[L.ring_positions(int(st[L.H_HEAD]), pages.shape[0], n)] = pages
    for entries, count in ((L.H_EFREE, L.H_NFREE), (L.H_EREL, L.H_NREL), (L.H_EPEND, L.H_NPEND)):
        st[entries] = st[count]
    return ring
