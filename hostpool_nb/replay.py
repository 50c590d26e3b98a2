"""``python -m hostpool_nb.replay PATH``: replay a recorded trace on a fresh pool, and time it.

Exit status 0 when every operation matches its record, 1 with the first
divergence (operation number, expected, got), 2 when the file cannot be
read as a trace or the recorded pool cannot be built here: a kind of pool
replay does not build, or one whose metadata would take more memory than
``--max-pool-bytes`` allows. ``--time`` also times the trace on the pool
and on the original algorithm (``hostpool_nb.originals``), side by side.
A trace starts from the state its recording found (``trace.StartState``):
replay restores it first. See :mod:`hostpool_nb.trace` for the format.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._core.pool import LogicalHostPool
from ._core.protocol import RECORD_ENV, unrecorded
from ._diagnostics.report import TraceTiming, timing_lines
from ._diagnostics.snapshot import FORMATS, PagedState, PoolState, SWAState
from ._diagnostics.tracking import HISTORY_MARK, Tracker
from ._errors import HostPoolError
from ._kernels import layout as _layout
from .originals import paged as original_paged
from .originals.sglang import LogicalHostPool as Original
from .paged import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator
from .trace import HOST_KV_BOOKS, SWA, Operation, StartState, Trace, TraceError, describe_slots, load

#: The pool kinds replay builds, by the name a trace's header gives.
REPLAYS = (
    "LogicalHostPool",
    "PagedTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "SWATokenToKVPoolAllocator",
    *HOST_KV_BOOKS,  # with torch installed
)
#: The most memory a replay builds its pools with, unless ``--max-pool-bytes`` says otherwise (a trace's
#: header names the pool, and a file of a few bytes may name one of terabytes).
MAX_POOL_BYTES = 1 << 30


@dataclass(frozen=True)
class Divergence:
    """The first operation whose replay differs from the record.

    Examples
    --------
    A trace replayed on the same version: no difference.

    >>> import os, tempfile
    >>> from hostpool_nb.paged import TokenToKVPoolAllocator
    >>> from hostpool_nb.replay import Divergence, replay
    >>> from hostpool_nb.trace import load
    >>> a = TokenToKVPoolAllocator(64, None)
    >>> path = os.path.join(tempfile.mkdtemp(), "tokens.trace")
    >>> with a.recording(path):
    ...     n = a.free(a.alloc(5)[:2])
    >>> replay(load(path))  # (replayed, skipped, the first difference or None)
    (2, 0, None)
    >>> print(Divergence(1, "free", "16", "DoubleFreeError"))
    operation 1 (free): expected 16, got DoubleFreeError
    """

    index: int
    name: str
    expected: str
    got: str

    def __str__(self) -> str:
        return f"operation {self.index} ({self.name}): expected {self.expected}, got {self.got}"


def pool_bytes(trace: Trace, with_original: bool = False) -> int:
    """The memory a replay of ``trace`` builds its pools with: hostpool_nb's state, and the original's slots."""
    if trace.ranked:
        sides = [trace.pages_per_rank] + ([trace.swa_pages_per_rank] if trace.pool == SWA else [])
        need = 0
        for pages in sides:
            rank = _layout.state_length(pages + 1, trace.track) + _layout.group_length(pages)
            need += trace.dp_size * rank * 8
            if with_original:
                need += trace.dp_size * pages * 4 * 3  # its int32 free and release lists, a merge's concatenation
        if trace.pool == SWA:
            need += trace.dp_size * trace.mapping_length * 4 * (2 if with_original else 1)
        return need
    num_pages = trace.size // trace.page_size
    need = _layout.state_length(num_pages, trace.track) * 8
    if with_original:
        need += trace.size * 8 * 2  # its int64 free slots, and as much again when a merge concatenates them
    return need


_ALLOCATIONS = ("alloc", "alloc_many", "alloc_extend", "alloc_decode")


def check_buildable(trace: Trace, max_pool_bytes: int = MAX_POOL_BYTES, with_original: bool = False) -> None:
    """Raise :class:`TraceError` if replay cannot build the recorded pool here: another kind, or too large.

    Too large: the pools' state (:func:`pool_bytes`), or the array the
    largest recorded allocation returns, past ``max_pool_bytes``.
    """
    if trace.pool not in REPLAYS:
        raise TraceError(f"it records a {trace.pool}; replay builds {', '.join(REPLAYS)} only")
    need = pool_bytes(trace, with_original)
    if need > max_pool_bytes:
        raise TraceError(
            f"the recorded pool (size={trace.size}, page_size={trace.page_size}) needs {need:,} bytes to replay, "
            f"more than the {max_pool_bytes:,} allowed; raise --max-pool-bytes to replay it"
        )
    served = [op for op in trace.operations if op.name in _ALLOCATIONS and op.result > 0]
    largest = max(served, key=lambda op: op.result, default=None)
    if largest is not None and largest.result * 8 > max_pool_bytes:  # each returns a new array of its slots
        raise TraceError(
            f"operation {largest.index} ({largest.name}) returned {largest.result:,} slots: replaying it takes "
            f"{largest.result * 8:,} bytes, more than the {max_pool_bytes:,} allowed; raise --max-pool-bytes "
            "to replay it"
        )


def fresh_pool(trace: Trace, track: bool = False) -> Any:
    """A pool (or allocator) of the recorded shape, in the state the recording began from.

    ``HOSTPOOL_NB_RECORD`` does not record it: a replay would time the recording.
    """
    with unrecorded():
        return _fresh_pool(trace, track)


def _fresh_pool(trace: Trace, track: bool) -> Any:
    if trace.ranked:
        return _fresh_allocator(trace, track)
    pool = _host_pool(trace, track)
    start = trace.start
    if start is not None and not start.fresh:
        shape = (trace.size // trace.page_size, trace.page_size, trace.merge == "sorted", track)
        words = _layout.state_of_lists(shape, (start.free, start.released, start.pending), start.group_depth)
        sites = Tracker().table() if track else None
        try:
            pool.restore_state(PoolState(trace.size, trace.page_size, trace.merge, words, sites))
        except HostPoolError as exc:
            raise TraceError(f"the trace's start state is not one the recorded pool can be in: {exc}") from None
    return pool


def _host_pool(trace: Trace, track: bool) -> Any:
    """A host pool of the recorded kind: hostpool_nb's, or the books it keeps for one of sglang's host pools."""
    if trace.pool not in HOST_KV_BOOKS:
        return LogicalHostPool(trace.size, trace.page_size, merge=trace.merge, track=track)
    if importlib.util.find_spec("torch") is None:
        raise TraceError(f"it records a {trace.pool} (sglang's host pool's books): replaying it needs torch")
    from .integrations._sglang_host import replayed  # noqa: PLC0415 - torch, only for these traces

    return replayed(trace.pool, trace.size, trace.page_size, trace.strict)  # tracked as HOSTPOOL_NB_TRACK says


def _fresh_allocator(trace: Trace, track: bool) -> Any:
    """A paged allocator of the recorded shape, each rank in the state the recording began from.

    The state is loaded as a pickle of it would be (``__setstate__``), so
    that every rank's lists, its pending pages and the group flag are
    checked as one allocator's, also the states only ``clear()`` of another
    rank leads to (pages pending outside a group, or pending and free).
    """
    if trace.pool == SWA:
        return _fresh_swa(trace, track)
    token = trace.pool == "TokenToKVPoolAllocator"
    ps, dp = trace.page_size, trace.dp_size
    args: dict[str, Any] = {"size": trace.size, "dp_size": dp, "strict": trace.strict, "track": track}
    if not token:
        args.update(page_size=ps, debug_mode=trace.debug_mode)
    cls: Any = TokenToKVPoolAllocator if token else PagedTokenToKVPoolAllocator
    if trace.starts is None:
        return cls(kvcache=None, **args)
    pages = trace.pages_per_rank
    lists = _lists_state("token" if token else "paged", (trace.size, ps, dp, pages), trace.starts, track)
    saved = {
        "format": FORMATS["PagedAllocator"],
        "args": args,
        "kvcache": None,
        "ranks": lists._ranks,
        "groups": tuple(_layout.group_of_pages(pages, s.pending) for s in trace.starts),
        "group_frees": [[s.pending * ps] if s.pending.shape[0] else [] for s in trace.starts],
        "in_group": bool(trace.starts[0].group_depth),
        "sites": lists.sites,
    }
    pool = cls.__new__(cls)
    try:
        pool.__setstate__(saved)
    except HostPoolError as exc:
        raise TraceError(f"the trace's start state is not one the recorded allocator can be in: {exc}") from None
    return pool


def _lists_state(kind: str, shape: tuple[int, int, int, int], lists: tuple[StartState, ...], track: bool) -> PagedState:
    """A ``kind`` ("paged", "token") allocator's snapshot whose ranks hold ``lists``' free and release lists.

    ``shape`` is the allocator's ``(size, page_size, dp_size, pages per rank)``;
    pending pages are not a snapshot's (its free group is not part of it).
    """
    size, ps, dp, pages = shape
    none = np.empty(0, dtype=np.int64)
    words = (pages + 1, ps, kind == "paged", track)
    ranks = tuple(_layout.state_of_lists(words, (s.free, s.released, none), 0) for s in lists)
    sites = tuple(Tracker().table() for _ in ranks) if track else None
    return PagedState(kind, size, ps, dp, ranks, sites)


def _sub_state(sub: Any, lists: tuple[StartState, ...]) -> PagedState:
    """What hostpool_nb's paged or token allocator ``sub`` restores for recorded lists."""
    return _lists_state(sub._snapshot_kind, (sub.size, sub.page_size, sub.dp_size, sub._pages), lists, sub.track)


def _original_state(sub: Any, lists: tuple[StartState, ...]) -> Any:
    """What the original paged or token allocator ``sub`` restores for recorded lists."""
    if isinstance(sub, original_paged.TokenToKVPoolAllocator):
        return [np.concatenate([s.free, s.released]).astype(np.int32) for s in lists]
    return [s.free.astype(np.int32) for s in lists], [s.released.astype(np.int32) for s in lists]


def _fresh_swa(trace: Trace, track: bool) -> Any:
    """A sliding-window allocator of the recorded shape, in the state the recording began from (checked)."""
    kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    pool = SWATokenToKVPoolAllocator(trace.size, trace.size_swa, kv, trace.page_size, trace.dp_size, track=track)
    if trace.starts is None or trace.swa_starts is None or trace.mappings is None:
        return pool
    try:
        pool.restore_state(_swa_state(pool, (*trace.starts, *trace.swa_starts), trace.mappings))
    except HostPoolError as exc:
        raise TraceError(f"the trace's start state is not one the recorded allocator can be in: {exc}") from None
    if trace.starts[0].group_depth:
        pool.free_group_begin()
    return pool


def replay(trace: Trace, max_pool_bytes: int = MAX_POOL_BYTES) -> tuple[int, int, Divergence | None]:
    """Replay ``trace`` on a pool in the state its recording began from, comparing every result and error.

    Parameters
    ----------
    trace : Trace
        A trace from :func:`hostpool_nb.trace.load`.
    max_pool_bytes : int, optional
        The most memory the replay may build its pool with (1 GiB by
        default).

    Returns
    -------
    (int, int, Divergence or None)
        The operations replayed, those skipped (not replayable: their input
        was not numbers), and the first operation that differs, or ``None``.

    Raises
    ------
    TraceError
        If replay cannot build the recorded pool: a kind it does not build,
        a pool larger than ``max_pool_bytes``, or a start state that pool
        cannot be in.
    """
    check_buildable(trace, max_pool_bytes)
    # Untracked: a tracking pool's error texts end with the call sites of
    # the recording, which a replay cannot have; they are compared without.
    pool = fresh_pool(trace)
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


def _ranked_call(pool: Any, op: Operation, backups: dict[int, Any]) -> Any:
    """The recorded call of a paged allocator's trace, made on ``pool`` (hostpool_nb's, or the original's)."""
    r = op.rank
    batch = tuple(as_given(v, op.kind) for v in op.batch or ())
    calls = {
        "alloc": lambda: pool.alloc(op.arg, r),
        "alloc_extend": lambda: pool.alloc_extend(*batch, op.arg, r),
        "alloc_decode": lambda: pool.alloc_decode(*batch, r),
        "free": lambda: pool.free(as_given(op.slots, op.kind), r),
        "free_swa": lambda: pool.free_swa(as_given(op.slots, op.kind), r),
        "merge_and_sort_free": lambda: pool.merge_and_sort_free(r),
        "clear": lambda: pool.clear(None if r < 0 else r),
        "backup": lambda: backups.__setitem__(op.arg, pool.backup_state()),
        "restore": lambda: pool.restore_state(backups[op.arg] if op.state is None else _snapshot_of(pool, op)),
        **{name: functools.partial(getattr(pool, name), r) for name in SIZES if hasattr(pool, name)},
    }
    call: Any = calls.get(op.name) or getattr(pool, op.name)  # free_group_begin, free_group_end
    return call()


#: The calls that only answer how much is available: replay compares the answer.
SIZES = ("available_size", "full_available_size", "swa_available_size")


def as_given(values: Any, kind: str) -> Any:
    """A recorded argument (int64 numbers) as the recorded call gave it: a list, an int32 array, or int64."""
    if values is None or kind in ("int64 array", "other"):
        return values
    return values.tolist() if kind == "list" else values.astype(np.int32)


def _snapshot_of(pool: Any, op: Operation) -> Any:
    """What ``pool`` (hostpool_nb's allocator, or the original) restores for a snapshot's recorded lists."""
    lists = op.state or ()
    if isinstance(pool, SWATokenToKVPoolAllocator):
        return _swa_state(pool, lists, op.mappings or ())
    if isinstance(pool, (PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator)):
        return _sub_state(pool, lists)
    return _original_state(pool, lists)


def _swa_state(pool: Any, lists: tuple[StartState, ...], mappings: tuple[NDArray[np.int64], ...]) -> SWAState:
    """A sliding-window allocator's snapshot: ``lists`` every rank's full side, then every rank's SWA side."""
    dp = pool.dp_size
    return SWAState(
        _sub_state(pool.full_attn_allocator, lists[:dp]),
        _sub_state(pool.swa_attn_allocator, lists[dp:]),
        tuple(np.asarray(m, dtype=np.int32) for m in mappings),
    )


def _run(pool: Any, op: Operation, backups: dict[int, Any]) -> tuple[Any, BaseException | None]:
    if hasattr(pool, "dp_size"):
        try:
            return _ranked_call(pool, op, backups), None
        except Exception as exc:  # noqa: BLE001 - every error is compared with the record
            return None, exc
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
    if op.name in ("alloc", "alloc_many", "alloc_extend", "alloc_decode"):
        want_slots = op.slots if op.result >= 0 else None
        got_slots = value if op.name != "alloc_many" or value is None else value[0]
        if not _same_slots(want_slots, got_slots):
            return Divergence(op.index, op.name, describe_slots(want_slots), describe_slots(got_slots))
    if op.name in ("free", "merge", "free_swa", *SIZES) and value != op.result:
        return Divergence(op.index, op.name, f"{op.result}", f"{value}")
    return None


# -- timing a trace -----------------------------------------------------------------------

_ALLOC, _FREE, _ALLOC_MANY, _OTHER, _RAISES = range(5)
#: The fewest operations ``--time`` times (below, a fresh pool's first calls would be most of the figure).
MIN_TIMED = 100
MIN_SAMPLE_S = 0.005  # each sample lasts at least this long: a batch of replays
MAX_BATCH = 50


def _pool_steps(trace: Trace) -> list[tuple[int, Any]]:
    """Every replayable call as recorded, a call that raised among them (its error is expected)."""
    steps: list[tuple[int, Any]] = []
    for op in trace.operations:
        if not op.replayable:
            continue
        if op.error:
            steps.append((_RAISES, op))
        elif op.name == "alloc":
            steps.append((_ALLOC, op.arg))
        elif op.name == "free":
            steps.append((_FREE, op.slots))
        elif op.name == "alloc_many":
            steps.append((_ALLOC_MANY, op.sizes))
        else:
            steps.append((_OTHER, op))
    return steps


def _swa_original_problem(trace: Trace) -> str | None:
    snapshots = sorted({op.name for op in trace.operations if op.name in ("backup", "restore")})
    if snapshots:
        return f"it has {'/'.join(snapshots)} calls, which the original raises NotImplementedError for"
    if any(op.name == "merge_and_sort_free" for op in trace.operations):
        return (
            "it has merge_and_sort_free calls, which the original fails with a TypeError (its base class's method "
            "reads page lists the sliding-window allocator does not keep)"
        )
    refused = [op for op in trace.operations if op.name in ("alloc_extend", "alloc_decode") and op.result < 0]
    if refused and trace.page_size > 1:
        return (
            f"operation {refused[0].index} ({refused[0].name}) was refused; where the SWA side was the short "
            "one, the original takes the full side's pages and frees them again, and its lists differ from then on"
        )
    return None


def original_problem(trace: Trace) -> str | None:
    """Why the original algorithm cannot replay ``trace`` (it has no such calls), or ``None``."""
    if trace.pool == SWA:
        return _swa_original_problem(trace)
    if trace.ranked:
        return None  # the paged allocators' originals have every call a trace of them holds
    if trace.merge != "fifo":
        return f"the pool merges {trace.merge!r}; the original merges in FIFO order only"
    if trace.start is not None and (trace.start.group_depth or trace.start.pending.shape[0]):
        return "the recording began inside a free group, which the original does not have"
    snapshots = sorted({op.name for op in trace.operations if op.name in ("backup", "restore") and not op.error})
    return f"it has {'/'.join(snapshots)} calls, which the original does not have" if snapshots else None


def _original_steps(trace: Trace, convert: Any) -> list[tuple[int, Any, Operation]]:
    """The calls a scheduler on the original makes: alloc_many as one alloc of the total, a free group's
    frees at its end, nothing for merge (FIFO order does not change) or for calls that raised."""
    steps: list[tuple[int, Any, Operation]] = []
    depth = 0
    pending: list[tuple[int, Any, Operation]] = []
    for op in trace.operations:
        if not op.replayable or op.error:
            continue
        if op.name == "alloc":
            steps.append((_ALLOC, op.arg, op))
        elif op.name == "alloc_many" and op.sizes is not None:
            steps.append((_ALLOC, int(op.sizes.sum()), op))
        elif op.name == "free":
            (pending if depth else steps).append((_FREE, convert(op.slots), op))
        elif op.name == "free_group_begin":
            depth += 1
        elif op.name == "free_group_end":
            depth -= 1
            if depth == 0:
                steps += pending
                pending = []
        elif op.name == "clear":
            steps.append((_OTHER, op, op))
            depth, pending = 0, []
    return steps


def _run_steps(pool: Any, steps: list[Any]) -> None:
    """The timed replay: every step, results dropped."""
    alloc, free = pool.alloc, pool.free
    backups: dict[int, Any] = {}
    for step in steps:
        code, arg = step[0], step[1]
        if code == _ALLOC:
            alloc(arg)
        elif code == _FREE:
            free(arg)
        elif code == _ALLOC_MANY:  # hostpool_nb's steps only
            pool.alloc_many(arg)
        else:  # the rare calls, and those that raise: _run catches and returns the error
            _run(pool, arg, backups)


def _check_original(pool: Any, steps: list[tuple[int, Any, Operation]], name: str) -> tuple[int, str] | None:
    """One replay with every answer compared to the record; the first operation where the original does
    otherwise (or fails), and how, or ``None``."""
    for code, arg, op in steps:
        try:
            got = pool.alloc(arg) if code == _ALLOC else pool.free(arg) if code == _FREE else pool.clear()
        except Exception as exc:  # noqa: BLE001 - the original's own failure (an assert): where it stops
            return op.index, f"the original ({name}) fails at operation {op.index} ({op.name}): {exc!r}"
        if code == _ALLOC:
            want = op.slots if op.result >= 0 else None
            if not _same_slots(want, None if got is None else np.asarray(got)):
                return op.index, (
                    f"the original ({name}) diverges at operation {op.index} ({op.name}): "
                    f"expected {describe_slots(want)}, got {describe_slots(got)}"
                )
        elif code == _FREE and got != op.result:
            return op.index, f"the original ({name}) diverges at operation {op.index} (free): {got}, not {op.result}"
    return None


def _original_at_start(trace: Trace, backend: str) -> Any:
    """The original algorithm's pool, in the state the recording began from."""
    pool = Original(trace.size, trace.page_size, backend=backend)
    start = trace.start
    if start is not None and not start.fresh:
        ps = trace.page_size
        slots = (np.concatenate([start.free, start.released]) * ps)[:, None] + np.arange(ps)
        flat = slots.reshape(-1)
        nfree = start.free.shape[0] * ps
        pool.free_slots = pool._xp.flat(flat[:nfree])
        pool.release_list = [pool._xp.flat(flat[nfree:])] if flat.shape[0] > nfree else []
        pool.released = flat.shape[0] - nfree
    return pool


# -- an allocator's trace: both implementations make the same calls ----------------------------


def _ranked_plan(trace: Trace, with_errors: bool, like: Any) -> list[tuple[str, tuple[Any, ...], Operation]]:
    """Each replayable call as (method, arguments, its record); the calls that raised only ``with_errors``.

    A restore of a snapshot from before the recording takes the snapshot
    ``like`` (a pool of the kind that replays the plan) restores, made here.
    """
    plan: list[tuple[str, tuple[Any, ...], Operation]] = []
    for op in trace.operations:
        if not op.replayable or (op.error and not with_errors):
            continue
        r, batch = op.rank, tuple(as_given(v, op.kind) for v in op.batch or ())
        args: dict[str, tuple[Any, ...]] = {
            "alloc": (op.arg, r),
            "alloc_extend": (*batch, op.arg, r),
            "alloc_decode": (*batch, r),
            "free": (as_given(op.slots, op.kind), r),
            "free_swa": (as_given(op.slots, op.kind), r),
            "merge_and_sort_free": (r,),
            **dict.fromkeys(SIZES, (r,)),
            "clear": (None if r < 0 else r,),
            "backup": (op.arg,),
            "restore": (op.arg if op.state is None else _snapshot_of(like, op),),
        }
        plan.append((op.name, args.get(op.name, ()), op))
    return plan


def _run_ranked(pool: Any, plan: list[tuple[str, tuple[Any, ...], Operation]]) -> None:
    """The timed replay of an allocator's trace: every call, results dropped, recorded errors caught."""
    backups: dict[int, Any] = {}
    for name, args, op in plan:
        if name == "backup":
            backups[args[0]] = pool.backup_state()
        elif name == "restore":
            pool.restore_state(backups[args[0]] if op.state is None else args[0])
        elif op.error:
            with contextlib.suppress(Exception):  # it raised when recorded: replay() checked that it does
                getattr(pool, name)(*args)
        else:
            getattr(pool, name)(*args)


def _original_allocator_at_start(trace: Trace) -> Any:
    """The original allocator, each rank in the state the recording began from."""
    ps, dp = trace.page_size, trace.dp_size
    pool: Any
    if trace.pool == SWA:
        return _original_swa_at_start(trace)
    if trace.pool == "TokenToKVPoolAllocator":
        pool = original_paged.TokenToKVPoolAllocator(trace.size, None, dp)
    else:
        pool = original_paged.PagedTokenToKVPoolAllocator(trace.size, ps, None, trace.debug_mode, dp)
    if trace.starts is None:
        return pool
    pool.restore_state(_original_state(pool, trace.starts))
    for r, s in enumerate(trace.starts):
        pool.free_group[r] = [s.pending * ps] if s.pending.shape[0] else []
    pool.is_not_in_free_group = not trace.starts[0].group_depth
    return pool


def _original_swa_at_start(trace: Trace) -> Any:
    """The original sliding-window allocator, each side of each rank and each mapping as the recording found them."""
    kv = SimpleNamespace(full_kv_pool=None, swa_kv_pool=None)
    pool = original_paged.SWATokenToKVPoolAllocator(trace.size, trace.size_swa, kv, trace.page_size, trace.dp_size)
    if trace.starts is None or trace.swa_starts is None or trace.mappings is None:
        return pool
    for sub, starts in ((pool.full_attn_allocator, trace.starts), (pool.swa_attn_allocator, trace.swa_starts)):
        sub.restore_state(_original_state(sub, starts))
    for mine, saved in zip(pool._maps, trace.mappings, strict=True):
        mine[:] = saved
    pool.is_not_in_free_group = not trace.starts[0].group_depth
    return pool


def _check_original_ranked(pool: Any, plan: list[tuple[str, tuple[Any, ...], Operation]]) -> tuple[int, str] | None:
    """One replay on the original allocator with every allocation compared to the record; the first operation
    where the original does otherwise (or fails: its own asserts), and how, or ``None``."""
    backups: dict[int, Any] = {}
    for _, _, op in plan:
        try:
            got = _ranked_call(pool, op, backups)
        except Exception as exc:  # noqa: BLE001 - the original's own failure (an assert): where it stops
            return op.index, f"the original fails at operation {op.index} ({op.name}): {exc!r}"
        if op.name in ("alloc", "alloc_extend", "alloc_decode"):
            want = op.slots if op.result >= 0 else None
            if not _same_slots(want, None if got is None else np.asarray(got)):
                return op.index, (
                    f"the original diverges at operation {op.index} ({op.name}): "
                    f"expected {describe_slots(want)}, got {describe_slots(got)}"
                )
    return None


def time_trace(
    trace: Trace,
    repeats: int = 5,
    with_torch: bool | None = None,
    max_pool_bytes: int = MAX_POOL_BYTES,
    min_operations: int | None = None,
) -> TraceTiming:
    """Seconds per recorded operation of ``trace`` on hostpool_nb and on the original algorithm.

    Every repeat replays the trace on a fresh pool (built outside the timed
    region), the implementations interleaved; the figure is the median.
    First, hostpool_nb's replay must match the record (:func:`replay`) and
    the original's every allocation and free, or a :class:`TraceError`
    says where it does not.

    Parameters
    ----------
    trace : Trace
        A trace from :func:`hostpool_nb.trace.load`.
    repeats : int, optional
        Timed replays of each implementation (5 by default).
    with_torch : bool, optional
        Time the original on torch too; by default, when torch imports.
        The original always runs on numpy.
    max_pool_bytes : int, optional
        The most memory the pools may take (1 GiB by default).
    min_operations : int, optional
        The fewest replayable operations it times (:data:`MIN_TIMED`, 100,
        by default): a shorter trace's figure would be mostly a fresh pool's
        first calls, and is not given (``per_op`` empty, a note says why).

    Where the original algorithm does otherwise than the record, or fails
    (its own asserts), both are timed on the operations before, and a note
    says where and why; where it cannot run the trace at all (calls it
    lacks), hostpool_nb is timed alone, and a note says why. Each sample
    replays the trace on as many fresh pools (built outside the timed
    region) as make it last 5 ms, up to 50.

    Returns
    -------
    TraceTiming
        Seconds per operation of each implementation, the samples, and notes.
    """
    check_buildable(trace, max_pool_bytes, with_original=original_problem(trace) is None)
    done, skipped, divergence = replay(trace, max_pool_bytes)
    if divergence is not None:
        raise TraceError(f"hostpool_nb diverges from the trace at {divergence}: was it recorded on this version?")
    notes = [f"{done} operations replayed" + (f", {skipped} not replayable skipped" if skipped else "")]
    if with_torch is None:
        with_torch = importlib.util.find_spec("torch") is not None
    problem = original_problem(trace)
    originals = [] if problem is not None else ["numpy"] if trace.ranked or not with_torch else ["numpy", "torch"]
    if problem is not None:
        notes.append(f"the original algorithm is not timed: {problem}")
    for backend in originals:  # where the original does otherwise, both are timed on the calls before
        makers, plans = _implementations(trace, [backend])
        stop = _original_stops(trace, backend, makers[backend](), plans[backend])
        if stop is not None:
            index, why = stop
            trace = dataclasses.replace(trace, operations=trace.operations[:index])
            kept = sum(op.replayable for op in trace.operations)
            notes.append(f"{why}; both are timed on the {_operations(kept)} before it")
    timed = sum(op.replayable for op in trace.operations)
    if timed < (MIN_TIMED if min_operations is None else min_operations):
        notes.append(
            f"not timed: {_operations(timed)} {'is' if timed == 1 else 'are'} too few to time (a pool's first calls, "
            f"on memory not touched yet, would be most of it); record a stretch of {MIN_TIMED} or more"
        )
        return TraceTiming({}, {}, notes)
    makers, plans = _implementations(trace, originals)
    run: Any = _run_ranked if trace.ranked else _run_steps
    samples: dict[str, list[float]] = {name: [] for name in makers}
    names = list(makers)
    batch = 1
    for r in range(repeats + 1):  # the first round warms up (kernels loaded), sizes the batches, and is dropped
        for name in names[r % len(names) :] + names[: r % len(names)]:
            pools = [makers[name]() for _ in range(batch)]  # built outside the timed region
            gc.disable()
            t0 = time.perf_counter()
            for pool in pools:
                run(pool, plans[name])
            seconds = (time.perf_counter() - t0) / (batch * timed)
            gc.enable()
            if r:
                samples[name].append(seconds)
            else:  # enough replays a sample that it lasts MIN_SAMPLE_S (the fastest implementation's)
                batch = max(batch, min(MAX_BATCH, math.ceil(MIN_SAMPLE_S / max(seconds * timed, 1e-9))))
    if batch > 1:
        notes.append(f"each sample times {batch} replays, each on a fresh pool (built untimed)")
    per_op = {name: float(np.median(s)) for name, s in samples.items()}
    return TraceTiming(per_op, samples, notes)


@dataclass
class MethodTiming:
    """An allocator's trace timed call by call: per implementation, the seconds each method's calls took.

    ``seconds[impl][method]`` is the median over the repeats of the total
    time of that method's calls in one replay; ``calls[method]`` how many
    calls of it the trace holds. ``backup`` and ``restore`` are
    ``backup_state`` and ``restore_state``.
    """

    seconds: dict[str, dict[str, float]]
    calls: dict[str, int]
    notes: list[str] = field(default_factory=list)

    def total(self, impl: str) -> float:
        """The seconds of every call of the trace, on ``impl``."""
        return sum(self.seconds[impl].values())


#: The calls after which :func:`time_methods` evicts the caches, as the forward that follows them does (a batch: at
#: page size 1 an engine allocates with ``alloc``).
BATCH_CALLS = ("alloc", "alloc_extend", "alloc_decode")


def time_methods(trace: Trace, repeats: int = 5, evict_bytes: int = 32 << 20) -> MethodTiming:
    """Time each call of an allocator's ``trace`` alone, on hostpool_nb and on the original algorithm.

    An engine calls its allocator between model forwards, which evict the
    caches; most of its calls are tiny, so what a call costs there is what
    it costs cold. Each replay therefore writes ``evict_bytes`` of memory
    (at least the last-level cache) after each batch call (:data:`BATCH_CALLS`),
    untimed, and times every call on its own (``time.perf_counter_ns``),
    summing by method. The replays of the two implementations alternate,
    each on a fresh allocator in the recorded start state (built untimed),
    the first of each dropped; both must first give every recorded result
    (:func:`replay`, and the original's allocations), or a
    :class:`TraceError` says where not.

    Parameters
    ----------
    trace : Trace
        A trace of a ``hostpool_nb.paged`` allocator (paged or token).
    repeats : int, optional
        Timed replays of each implementation (5 by default).
    evict_bytes : int, optional
        The memory written after each batch call (32 MiB by default; 0:
        none, a warm replay).
    """
    if not trace.ranked or trace.pool == SWA:
        raise TraceError(f"time_methods times a paged or token allocator's trace, not a {trace.pool}'s")
    check_buildable(trace, with_original=True)
    done, skipped, divergence = replay(trace)
    if divergence is not None:
        raise TraceError(f"hostpool_nb diverges from the trace at {divergence}: was it recorded on this version?")
    makers, plans = _implementations(trace, ["numpy"])
    stop = _original_stops(trace, "numpy", makers["numpy"](), plans["numpy"])
    if stop is not None:
        raise TraceError(stop[1])
    calls: dict[str, int] = {}
    for name, _, _ in plans["hostpool_nb"]:
        calls[name] = calls.get(name, 0) + 1
    sweep = np.zeros(max(evict_bytes, 0) // 8, dtype=np.int64)
    samples: dict[str, list[dict[str, int]]] = {name: [] for name in makers}
    names = list(makers)
    for r in range(repeats + 1):
        for name in names[r % 2 :] + names[: r % 2]:
            pool = makers[name]()
            gc.disable()
            try:
                spent = _timed_calls(pool, plans[name], sweep)
            finally:
                gc.enable()
            if r:
                samples[name].append(spent)
    seconds = {
        name: {m: float(np.median([s.get(m, 0) for s in runs])) / 1e9 for m in calls} for name, runs in samples.items()
    }
    notes = [
        f"{done} operations replayed, each timed alone" + (f", {skipped} not replayable skipped" if skipped else "")
    ]
    return MethodTiming(seconds, calls, notes)


def _timed_calls(
    pool: Any, plan: list[tuple[str, tuple[Any, ...], Operation]], sweep: NDArray[np.int64]
) -> dict[str, int]:
    """One replay of ``plan`` on ``pool``, each call timed alone: nanoseconds by method."""
    clock = time.perf_counter_ns
    spent: dict[str, int] = {}
    backups: dict[int, Any] = {}
    for name, args, op in plan:
        if name == "backup":
            t0 = clock()
            state = pool.backup_state()
            took = clock() - t0
            backups[args[0]] = state
        elif name == "restore":
            state = backups[args[0]] if op.state is None else args[0]
            t0 = clock()
            pool.restore_state(state)
            took = clock() - t0
        else:
            method = getattr(pool, name)
            t0 = clock()
            try:
                method(*args)
            except Exception:
                if not op.error:
                    raise
            took = clock() - t0
            if name in BATCH_CALLS and sweep.shape[0]:
                sweep[::8] += 1  # a word of every cache line: what the caches held is gone, untimed
        spent[name] = spent.get(name, 0) + took
    return spent


def _operations(n: int) -> str:
    return f"{n} operation" + ("" if n == 1 else "s")


def _implementations(trace: Trace, originals: list[str]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """For hostpool_nb and each of ``originals`` ("numpy", "torch"): how to make a fresh pool, and its calls."""
    makers: dict[str, Any] = {"hostpool_nb": lambda: fresh_pool(trace, trace.track)}
    plans: dict[str, list[Any]] = {
        "hostpool_nb": _ranked_plan(trace, True, makers["hostpool_nb"]()) if trace.ranked else _pool_steps(trace)
    }
    for backend in originals:
        if trace.ranked:  # the original allocator runs on numpy alone
            makers[backend] = functools.partial(_original_allocator_at_start, trace)
            plans[backend] = _ranked_plan(trace, False, makers[backend]())
        else:
            convert: Any = (lambda a: a) if backend == "numpy" else _torch_of
            makers[backend] = functools.partial(_original_at_start, trace, backend)
            plans[backend] = _original_steps(trace, convert)
    return makers, plans


def _original_stops(trace: Trace, backend: str, pool: Any, plan: list[Any]) -> tuple[int, str] | None:
    """Where the original algorithm does otherwise than the record on ``trace`` (or fails), and how."""
    if trace.ranked:
        return _check_original_ranked(pool, plan)
    return _check_original(pool, plan, backend)


def _torch_of(slots: Any) -> Any:
    import torch  # noqa: PLC0415 - only for the torch baseline, when torch is installed

    return torch.from_numpy(np.array(slots))


def main(argv: list[str] | None = None) -> int:
    """``python -m hostpool_nb.replay PATH``: 0 if every operation matches, 1 at the first divergence."""
    ap = argparse.ArgumentParser(
        prog="python -m hostpool_nb.replay",
        description="Replay a trace recorded with pool.recording(path) on a fresh pool, checking every result.",
    )
    ap.add_argument("path", help="the trace file")
    ap.add_argument(
        "--time", action="store_true", help="also time it on hostpool_nb and on the original algorithm, side by side"
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed replays of each implementation (default 5)")
    ap.add_argument(
        "--max-pool-bytes",
        type=int,
        default=MAX_POOL_BYTES,
        metavar="N",
        help=f"refuse to build pools taking more memory than this (default {MAX_POOL_BYTES:,}: 1 GiB)",
    )
    args = ap.parse_args(argv)
    os.environ.pop(RECORD_ENV, None)  # a server's shell: the tool's own pools are never recorded (fresh_pool's aren't)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.max_pool_bytes < 1:
        ap.error(f"--max-pool-bytes must be positive, got {args.max_pool_bytes}")
    try:
        trace = load(args.path)
    except FileNotFoundError:
        print(f"python -m hostpool_nb.replay: error: no such file: {args.path}", file=sys.stderr)
        return 2
    except TraceError as exc:
        print(f"python -m hostpool_nb.replay: error: {exc}", file=sys.stderr)
        return 2
    try:
        check_buildable(trace, args.max_pool_bytes, with_original=args.time and original_problem(trace) is None)
        done, skipped, divergence = replay(trace, args.max_pool_bytes)
    except (HostPoolError, MemoryError) as exc:  # the recorded pool cannot be built here
        print(
            f"python -m hostpool_nb.replay: error: {args.path}: cannot build the recorded pool: {exc}", file=sys.stderr
        )
        return 2
    pool = f"{trace.pool}(size={trace.size}, page_size={trace.page_size}, merge={trace.merge!r}, track={trace.track})"
    if trace.ranked:
        pool = (
            f"{trace.pool}(size={trace.size}, page_size={trace.page_size}, dp_size={trace.dp_size}, "
            f"strict={trace.strict}, debug_mode={trace.debug_mode}, track={trace.track})"
        )
    if divergence is not None:
        print(f"{args.path}: {pool}: DIVERGES at {divergence} (after {done} matching operations)")
        return 1
    note = f"; {skipped} not replayable (what they were given is not in the record), skipped" if skipped else ""
    matched = "the one operation matches" if done == 1 else f"all {done} operations match"
    print(f"{args.path}: {pool}: {matched}{note}")
    if args.time:
        try:
            timing = time_trace(trace, args.repeats, max_pool_bytes=args.max_pool_bytes)
        except TraceError as exc:
            print(f"python -m hostpool_nb.replay: error: {exc}", file=sys.stderr)
            return 2
        for line in timing_lines(timing, args.repeats):
            print(f"  {line}")
    return 0


__all__ = [
    "MAX_POOL_BYTES",
    "REPLAYS",
    "Divergence",
    "TraceTiming",
    "check_buildable",
    "fresh_pool",
    "main",
    "pool_bytes",
    "replay",
    "time_trace",
]


if __name__ == "__main__":
    sys.exit(main())
