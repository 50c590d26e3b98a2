"""Shared test helpers: pool state snapshots and hypothesis profiles.

Profiles (pick one with ``HYPOTHESIS_PROFILE=<name>``):

``default``  local runs; derandomized, no example database.
``ci``       more examples; derandomized, no example database.
``nojit``    fewer examples; replaces ``default`` and ``ci`` when
             ``NUMBA_DISABLE_JIT=1`` (the kernels then run as plain Python).

Any other profile named in ``HYPOTHESIS_PROFILE`` is used as is.

Every profile is derandomized and keeps no database, so a run's outcome
depends only on the code under test: no flakiness in CI.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

JIT_DISABLED = os.environ.get("NUMBA_DISABLE_JIT") == "1"

_COMMON: dict[str, Any] = dict(
    deadline=None,  # first calls may load or compile kernels
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("default", max_examples=100, stateful_step_count=50, **_COMMON)
settings.register_profile("ci", max_examples=200, stateful_step_count=50, **_COMMON)
settings.register_profile("nojit", max_examples=100, stateful_step_count=40, **_COMMON)


def _profile_name() -> str:
    name = os.environ.get("HYPOTHESIS_PROFILE") or "default"
    if JIT_DISABLED and name in ("default", "ci"):
        return "nojit"  # plain-Python kernels: keep the run short
    return name


settings.load_profile(_profile_name())


def take_snapshot(pool: Any) -> tuple[np.ndarray, np.ndarray]:
    """Copies of the two arrays that fully determine a pool's logical state."""
    return pool._st.copy(), pool._owner.copy()


def assert_unchanged(pool: Any, before: tuple[np.ndarray, np.ndarray]) -> None:
    """The pool's state equals ``before`` and its invariants hold."""
    st, owner = before
    assert np.array_equal(pool._st, st), f"state changed: {st} -> {pool._st}"
    assert np.array_equal(pool._owner, owner), f"owners changed: {owner} -> {pool._owner}"
    pool.check_invariants()


@pytest.fixture
def snapshot() -> Callable[[Any], tuple[np.ndarray, np.ndarray]]:
    """``snapshot(pool)`` -> an opaque state copy for :func:`unchanged`."""
    return take_snapshot


@pytest.fixture
def unchanged() -> Callable[[Any, tuple[np.ndarray, np.ndarray]], None]:
    """``unchanged(pool, before)`` asserts the pool still equals ``before``."""
    return assert_unchanged
