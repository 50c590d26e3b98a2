"""The implementations every workload runs, in the order the table shows them.

``bench/baselines.py`` is the original algorithm as SPEC section 1 states it,
one copy shared with ``tests/``. The benchmark runs it unchanged; the
subclasses here only count merges (``_merge`` runs once per pool cycle, so
the count costs nothing on the measured hot path), which lets the tables
and tests confirm that every implementation merged equally often.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

from .baselines import NumpyHostPool, TorchHostPool

HOSTPOOL = "hostpool_nb"
NUMPY = "numpy"
TORCH = "torch"


@functools.cache
def torch_available() -> bool:
    """Whether torch imports (a broken install counts as absent)."""
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import torch  # noqa: F401
    except Exception:  # noqa: BLE001 - whatever a broken torch install raises, torch is absent
        return False
    return True


class _MergeCounter:
    """Mixin: count the merges that actually concatenated something."""

    merges = 0

    def _merge(self) -> None:
        if self.release_list:  # type: ignore[attr-defined]
            self.merges += 1
        super()._merge()  # type: ignore[misc]


class NumpyBaseline(_MergeCounter, NumpyHostPool):
    """``NumpyHostPool``, counting merges."""


class TorchBaseline(_MergeCounter, TorchHostPool):
    """``TorchHostPool``, counting merges."""


def hostpool_factory() -> Callable[[int, int], Any]:
    from hostpool_nb import LogicalHostPool

    return LogicalHostPool


def implementations(with_torch: bool | None = None) -> dict[str, Callable[[int, int], Any]]:
    """Name -> pool constructor ``(size, page_size)``, hostpool_nb first.

    Torch is included when importable (or as ``with_torch`` says).
    """
    if with_torch is None:
        with_torch = torch_available()
    impls: dict[str, Callable[[int, int], Any]] = {HOSTPOOL: hostpool_factory(), NUMPY: NumpyBaseline}
    if with_torch:
        impls[TORCH] = TorchBaseline
    return impls


def merges_of(pool: Any) -> int | None:
    """Merges a pool has performed, when it counts them.

    A hostpool_nb pool's header is read with its own package's offsets:
    ``python -m bench.compare`` imports another revision under another name.
    """
    st = getattr(pool, "_st", None)
    if st is not None:
        package = type(pool).__module__.split(".", 1)[0]
        K = sys.modules.get(f"{package}._kernels") or importlib.import_module("hostpool_nb._kernels")
        return int(st[K.H_MERGES])
    return getattr(pool, "merges", None)
