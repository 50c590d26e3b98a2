"""``python -m hostpool_nb.replay PATH``: replay a recorded trace on a fresh pool, and time it.

Exit status 0 when every operation matches its record, 1 with the first
divergence (operation number, expected, got), 2 when the file cannot be
read as a trace or the recorded pool cannot be built. ``--time`` also times
the trace on the pool and on the original algorithm
(``hostpool_nb.originals``), side by side. See :mod:`hostpool_nb.trace`
for the format.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._errors import HostPoolError
from ._pool import LogicalHostPool
from ._tracking import HISTORY_MARK
from .trace import Operation, Trace, TraceError, describe_slots, load


@dataclass(frozen=True)
class Divergence:
    """The first operation whose replay differs from the record."""

    index: int
    name: str
    expected: str
    got: str

    def __str__(self) -> str:
        return f"operation {self.index} ({self.name}): expected {self.expected}, got {self.got}"


def replay(trace: Trace) -> tuple[int, int, Divergence | None]:
    """Replay ``trace`` on a fresh pool; return (replayed, skipped, first divergence or None)."""
    # Untracked: a tracking pool's error texts end with the call sites of
    # the recording, which a replay cannot have; they are compared without.
    pool = LogicalHostPool(trace.size, trace.page_size, merge=trace.merge)
    backups: dict[int, Any] = {}
    skipped = 0
    for op in trace.operations:
        if not op.replayable:
            skipped += 1
            continue
        got_value, got_exc = _run(pool, op, backups)
        divergence = _compare(op, got_value, got_exc)
        if divergence is not None:
            return op.index - skipped, skipped, divergence
    return len(trace.operations) - skipped, skipped, None


def _run(pool: Any, op: Operation, backups: dict[int, Any]) -> tuple[Any, BaseException | None]:
    calls = {
        "alloc": lambda: pool.alloc(op.arg),
        "alloc_many": lambda: pool.alloc_many(op.sizes),
        "free": lambda: pool.free(op.slots),
        "backup": lambda: backups.__setitem__(op.arg, pool.backup_state()),
        "restore": lambda: pool.restore_state(backups[op.arg]),
    }
    call = calls.get(op.name) or getattr(pool, op.name)  # clear, merge, free_group_begin/end
    try:
        return call(), None
    except Exception as exc:  # noqa: BLE001 - every error is compared with the record
        return None, exc


def _without_history(message: str) -> str:
    """A tracking pool's error text without the history it appends (``; it was allocated at ...``,
    ``; it was never allocated by this pool``): a replay's untracked pool has none."""
    cut = message.find(HISTORY_MARK)
    return message if cut < 0 else message[:cut]


def _same_slots(want: NDArray[np.int64] | None, got: Any) -> bool:
    if want is None or got is None:
        return want is None and got is None
    return bool(np.array_equal(np.asarray(got), want))


def _compare(op: Operation, value: Any, exc: BaseException | None) -> Divergence | None:
    if op.error is not None or exc is not None:
        want = f"{op.error}: {_without_history(op.message or '')}" if op.error else "no error"
        got = f"{type(exc).__name__}: {exc}" if exc is not None else "no error"
        return None if want == got else Divergence(op.index, op.name, want, got)
    if op.name in ("alloc", "alloc_many"):
        want_slots = op.slots if op.result >= 0 else None
        got_slots = value if op.name == "alloc" or value is None else value[0]
        if not _same_slots(want_slots, got_slots):
            return Divergence(op.index, op.name, describe_slots(want_slots), describe_slots(got_slots))
    if op.name in ("free", "merge") and value != op.result:
        return Divergence(op.index, op.name, f"{op.result}", f"{value}")
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m hostpool_nb.replay PATH``: 0 if every operation matches, 1 at the first divergence."""
    ap = argparse.ArgumentParser(
        prog="python -m hostpool_nb.replay",
        description="Replay a trace recorded with pool.recording(path) on a fresh pool, checking every result.",
    )
    ap.add_argument("path", help="the trace file")
    args = ap.parse_args(argv)
    try:
        trace = load(args.path)
    except FileNotFoundError:
        print(f"python -m hostpool_nb.replay: error: no such file: {args.path}", file=sys.stderr)
        return 2
    except TraceError as exc:
        print(f"python -m hostpool_nb.replay: error: {exc}", file=sys.stderr)
        return 2
    try:
        done, skipped, divergence = replay(trace)
    except (HostPoolError, MemoryError) as exc:  # the recorded pool cannot be built here
        print(
            f"python -m hostpool_nb.replay: error: {args.path}: cannot build the recorded pool: {exc}", file=sys.stderr
        )
        return 2
    pool = f"{trace.pool}(size={trace.size}, page_size={trace.page_size}, merge={trace.merge!r}, track={trace.track})"
    if divergence is not None:
        print(f"{args.path}: {pool}: DIVERGES at {divergence} (after {done} matching operations)")
        return 1
    note = f"; {skipped} not replayable (their input was not numbers), skipped" if skipped else ""
    print(f"{args.path}: {pool}: all {done} operations match{note}")
    return 0


__all__ = ["Divergence", "main", "replay"]


if __name__ == "__main__":
    sys.exit(main())
