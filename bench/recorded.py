"""A recorded trace (``pool.recording(path)``) timed on hostpool_nb and on the original algorithm.

``python -m bench --trace PATH`` lets a user measure their own workload.
hostpool_nb replays every recorded call on a fresh pool of the recorded
size, page size, merge order and tracking, the calls that raised included
(expecting their error). The baselines (``bench/baselines.py``) have only
``alloc``, ``free`` and ``clear``, so they get the calls a scheduler on the
original would make:

- ``alloc(n)`` -> ``alloc(n)``; ``alloc_many(sizes)`` -> ``alloc(sum(sizes))``
  (hostpool_nb's batch is one allocation of the total, with the same slots);
- ``free(slots)`` -> ``free`` of the recorded slots (a torch tensor for the
  torch baseline), and the frees of a free group at the group's end, when
  hostpool_nb releases them;
- ``merge()`` -> nothing (the original merges when an allocation needs it,
  and FIFO merging does not change the order pages come out in);
- ``clear()`` -> ``clear()`` (it also ends the open free groups);
- a call recorded with an error -> nothing (the original accepts some of
  them silently and would be corrupted).

Traces with ``backup_state``/``restore_state`` calls, or of a pool with
``merge="sorted"``, have no equivalent on the original: hostpool_nb alone is
timed, and a note says why.

Before timing, each implementation replays the trace once with every result
checked: every allocation must return the recorded slots (or ``None`` where
the trace has ``None``), every free its recorded count, and hostpool_nb must
raise each recorded error; otherwise :class:`ReplayDivergence` names the
operation. Then every repeat replays the trace on a fresh pool (built
outside the timed region), interleaved; the figure is seconds per recorded
operation, the same count for every implementation.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .impls import HOSTPOOL, TORCH, merges_of
from .timing import gc_paused, interleaved, median, timed
from .workloads import Cell

# Step codes of a replay plan, the frequent ones first (the timed loop tests them in this order).
ALLOC, FREE, ALLOC_MANY, CLEAR, MERGE, GROUP_BEGIN, GROUP_END, BACKUP, RESTORE, RAISES = range(10)
_CODE = {
    "alloc": ALLOC,
    "free": FREE,
    "alloc_many": ALLOC_MANY,
    "clear": CLEAR,
    "merge": MERGE,
    "free_group_begin": GROUP_BEGIN,
    "free_group_end": GROUP_END,
    "backup": BACKUP,
    "restore": RESTORE,
}
# What a checked replay compares: the slots returned, the count returned, an error, nothing.
SLOTS, COUNT, ERROR, NOTHING = range(4)


class RecordedTraceError(ValueError):
    """A ``--trace`` file that cannot be timed; the message is one line."""


class ReplayDivergence(RuntimeError):
    """An implementation answered a recorded call otherwise than the trace says."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def read(path: str) -> Any:
    """``hostpool_nb.trace.load(path)``, any failure a :class:`RecordedTraceError` of one line.

    Also refused: a trace without a call to replay.
    """
    from hostpool_nb.trace import TraceError, load

    p = Path(path)
    if not p.exists():
        raise RecordedTraceError(f"{path}: no such file")
    if p.is_dir():
        raise RecordedTraceError(f"{path} is a directory")
    try:
        trace = load(path)
    except TraceError as exc:
        raise RecordedTraceError(_one_line(str(exc))) from None
    except Exception as exc:  # noqa: BLE001 - load lets some non-trace files through as other errors (a .npy)
        raise RecordedTraceError(
            _one_line(f"{path} is not a hostpool_nb trace ({type(exc).__name__}: {exc})")
        ) from None
    if not any(replayable(op) for op in trace.operations):
        raise RecordedTraceError(f"{path} holds no call to replay ({len(trace.operations)} recorded)")
    return trace


def replayable(op: Any) -> bool:
    """Whether the record holds the call's argument: ``hostpool_nb.trace.replay``'s own test."""
    return bool(op.replayable)


def baseline_problem(trace: Any) -> str | None:
    """Why the baselines cannot replay ``trace``, or ``None`` when they can."""
    if trace.merge != "fifo":
        return f"the pool merges {trace.merge!r}, the original in FIFO order only"
    snapshots = sorted({op.name for op in trace.operations if op.name in ("backup", "restore") and not op.error})
    if snapshots:
        return f"it has {'/'.join(snapshots)} calls, which the original does not have"
    return None


def describe(op: Any) -> str:
    """A recorded call, briefly: ``alloc(64)``, ``alloc_many of 3 requests``, ``free of 64 slots``."""
    if op.name == "alloc":
        return f"alloc({op.arg})"
    if op.name == "alloc_many":
        return f"alloc_many of {op.arg} requests"
    if op.name == "free":
        return f"free of {op.arg} slots"
    return f"{op.name}()"


_SHOWN = 6


def _slots_text(value: Any) -> str:
    if value is None:
        return "None"
    arr = np.asarray(value).reshape(-1)
    head = ", ".join(str(v) for v in arr[:_SHOWN].tolist())
    return f"{arr.shape[0]} slots [{head}{', ...' if arr.shape[0] > _SHOWN else ''}]"


@dataclass
class Plan:
    """The calls one implementation makes for a trace, and what each must answer.

    ``steps`` are ``(code, argument)``; ``expect`` holds, for each step,
    ``(recorded operation, what to compare, expected value)``.
    """

    steps: list[tuple[int, Any]] = field(default_factory=list)
    expect: list[tuple[Any, int, Any]] = field(default_factory=list)

    def add(self, code: int, arg: Any, op: Any, kind: int, value: Any = None) -> None:
        self.steps.append((code, arg))
        self.expect.append((op, kind, value))


def _expected(op: Any) -> tuple[int, Any]:
    if op.name in ("alloc", "alloc_many"):
        return SLOTS, (op.slots if op.result >= 0 else None)
    if op.name in ("free", "merge"):
        return COUNT, op.result
    return NOTHING, None


def hostpool_plan(trace: Any) -> Plan:
    """Every replayable call as recorded; a call that raised, expecting its error."""
    plan = Plan()
    for op in trace.operations:
        if not replayable(op):
            continue
        code = _CODE[op.name]
        arg = {ALLOC: op.arg, ALLOC_MANY: op.sizes, FREE: op.slots, BACKUP: op.arg, RESTORE: op.arg}.get(code)
        if op.error:
            plan.add(RAISES, (code, arg), op, ERROR, op.error)
        else:
            plan.add(code, arg, op, *_expected(op))
    return plan


def baseline_plan(trace: Any, convert: Callable[[np.ndarray], Any] | None = None) -> Plan:
    """The calls a scheduler on the original makes for ``trace`` (see the module docstring).

    ``convert`` turns recorded slots into what the baseline's caller would
    hold (a torch tensor for the torch baseline); ``None``: numpy arrays.
    """
    problem = baseline_problem(trace)
    if problem is not None:
        raise ValueError(f"the baselines cannot replay this trace: {problem}")
    plan = Plan()
    depth = 0
    pending: list[tuple[Any, Any]] = []  # frees of the open free groups: (slots, op)
    for op in trace.operations:
        if not replayable(op) or op.error:
            continue
        if op.name == "alloc":
            plan.add(ALLOC, op.arg, op, *_expected(op))
        elif op.name == "alloc_many":
            plan.add(ALLOC, sum(op.sizes.tolist()), op, *_expected(op))
        elif op.name == "free":
            slots = op.slots if convert is None else convert(op.slots)
            if depth:
                pending.append((slots, op))
            else:
                plan.add(FREE, slots, op, COUNT, op.result)
        elif op.name == "free_group_begin":
            depth += 1
        elif op.name == "free_group_end":
            depth -= 1
            if depth == 0:
                for slots, fop in pending:
                    plan.add(FREE, slots, fop, COUNT, fop.result)
                pending.clear()
        elif op.name == "clear":
            plan.add(CLEAR, None, op, NOTHING)
            depth = 0  # clear() ends every free group; what they held is free again
            pending.clear()
        # merge: nothing (see the module docstring)
    return plan


def _backup(pool: Any, arg: Any, backups: dict[int, Any]) -> None:
    backups[arg] = pool.backup_state()


# code -> call(pool, argument, snapshots by recorded number)
_CALLS: dict[int, Callable[[Any, Any, dict[int, Any]], Any]] = {
    ALLOC: lambda pool, arg, _: pool.alloc(arg),
    FREE: lambda pool, arg, _: pool.free(arg),
    ALLOC_MANY: lambda pool, arg, _: pool.alloc_many(arg),
    CLEAR: lambda pool, _arg, _: pool.clear(),
    MERGE: lambda pool, _arg, _: pool.merge(),
    GROUP_BEGIN: lambda pool, _arg, _: pool.free_group_begin(),
    GROUP_END: lambda pool, _arg, _: pool.free_group_end(),
    BACKUP: _backup,
    RESTORE: lambda pool, arg, backups: pool.restore_state(backups[arg]),
}


def _rare(pool: Any, code: int, arg: Any, backups: dict[int, Any]) -> Any:
    """Any step by its code; a RAISES step swallows its (expected) error, which run_checked checks."""
    if code == RAISES:
        inner, inner_arg = arg
        with contextlib.suppress(Exception):
            _CALLS[inner](pool, inner_arg, backups)
        return None
    return _CALLS[code](pool, arg, backups)


def run(pool: Any, steps: list[tuple[int, Any]]) -> None:
    """The timed replay: every step, results dropped."""
    alloc = pool.alloc
    free = pool.free
    alloc_many = getattr(pool, "alloc_many", None)
    backups: dict[int, Any] = {}
    for code, arg in steps:
        if code == ALLOC:
            alloc(arg)
        elif code == FREE:
            free(arg)
        elif code == ALLOC_MANY:
            alloc_many(arg)
        else:
            _rare(pool, code, arg, backups)


def run_checked(pool: Any, plan: Plan, name: str, path: str) -> None:
    """Replay ``plan`` on ``pool`` comparing every answer; :class:`ReplayDivergence` at the first difference."""
    backups: dict[int, Any] = {}
    hint = (
        " (a replay starts on a fresh pool: was the trace recorded on a pool already in use, or edited?)"
        if name == HOSTPOOL
        else ""
    )

    def diverge(op: Any, expected: str, got: str) -> ReplayDivergence:
        return ReplayDivergence(
            _one_line(
                f"--trace {path}: {name} diverges from the trace at operation {op.index} ({describe(op)}): "
                f"the trace has {expected}, {name} gave {got}{hint}"
            )
        )

    for (code, arg), (op, kind, want) in zip(plan.steps, plan.expect, strict=True):
        if kind == ERROR:
            inner, inner_arg = arg
            try:
                _CALLS[inner](pool, inner_arg, backups)
            except Exception as exc:  # noqa: BLE001 - compared with the recorded error
                if type(exc).__name__ != want:
                    raise diverge(op, want, f"{type(exc).__name__}: {exc}") from None
                continue
            raise diverge(op, want, "no error")
        try:
            got = _rare(pool, code, arg, backups)
        except Exception as exc:  # noqa: BLE001 - reported as the divergence it is
            raise diverge(op, "no error", f"{type(exc).__name__}: {exc}") from None
        if kind == SLOTS:
            if code == ALLOC_MANY and got is not None:
                got = got[0]
            if got is not None and hasattr(got, "numpy") and not isinstance(got, np.ndarray):
                got = got.numpy()
            same = (want is None and got is None) or (
                want is not None and got is not None and np.array_equal(np.asarray(got), want)
            )
            if not same:
                raise diverge(op, _slots_text(want), _slots_text(got))
        elif kind == COUNT and got != want:
            raise diverge(op, f"{want} slots", f"{got}")


def _torch_slots(slots: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(slots if slots.flags.writeable else slots.copy())


def measure_recorded(
    impls: dict[str, Callable[..., Any]],
    trace: Any,
    path: str,
    repeats: int,
    tick: Callable[[], None] | None = None,
) -> Cell:
    """Median seconds per recorded operation of ``trace`` on each implementation that can replay it.

    ``impls`` maps names to pool constructors (``bench.impls``);
    hostpool_nb's is called with the recorded ``merge`` and ``track``.
    """
    problem = baseline_problem(trace)
    used = [name for name in impls if name == HOSTPOOL or problem is None]
    if HOSTPOOL not in used:
        raise ValueError("measure_recorded needs hostpool_nb among the implementations")
    plans = {
        name: hostpool_plan(trace)
        if name == HOSTPOOL
        else baseline_plan(trace, _torch_slots if name == TORCH else None)
        for name in used
    }

    def make(name: str) -> Any:
        if name == HOSTPOOL:
            return impls[name](trace.size, trace.page_size, merge=trace.merge, track=trace.track)
        return impls[name](trace.size, trace.page_size)

    # Warm-up (kernels loaded or compiled) and the differential check, untimed.
    merges = {}
    for name in used:
        pool = make(name)
        with gc_paused():
            run_checked(pool, plans[name], name, path)
        merges[name] = merges_of(pool)
        if tick is not None:
            tick()

    n_ops = sum(1 for op in trace.operations if replayable(op))

    def runner(name: str) -> Callable[[], float]:
        steps = plans[name].steps

        def one() -> float:
            pool = make(name)
            return timed(run, pool, steps) / n_ops

        return one

    samples = interleaved({name: runner(name) for name in used}, repeats, tick)
    counts = Counter(op.name for op in trace.operations if replayable(op))
    return Cell(
        workload="recorded trace",
        params={
            "path": path,
            "pool": trace.pool,
            "size": trace.size,
            "page_size": trace.page_size,
            "merge": trace.merge,
            "track": trace.track,
            "operations": len(trace.operations),
            "replayed": n_ops,
            "not_replayable": len(trace.operations) - n_ops,
            "errors": sum(1 for op in trace.operations if replayable(op) and op.error),
            "calls": dict(counts.most_common()),
        },
        per_op={name: median(s) for name, s in samples.items()},
        samples=samples,
        extra={
            "merges_per_replay": merges,
            "baselines_skipped": problem,
            "calls_per_replay": {name: len(plans[name].steps) for name in used},
        },
    )


def steps_of(trace: Any, nimpl: int, repeats: int) -> int:
    """Progress steps :func:`measure_recorded` reports for ``trace``."""
    used = nimpl if baseline_problem(trace) is None else 1
    return used * (repeats + 1)
