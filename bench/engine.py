"""sglang-jax's engine, in its own call mix: what its scheduler called on the device allocator, replayed.

The traces in ``bench/data/engine/`` were recorded with ``HOSTPOOL_NB_RECORD`` from sglang-jax 0.1.0rc0's
engine serving the engine job's tiny Qwen3 on a CPU (``python -m tests.engine.timing --record``: 64 prompts of
100-480 tokens, two rounds, 16 new tokens each), at pools of 65,536, 262,144 and 1,048,576 tokens, page sizes
1 and 16, the radix cache on and off, and with the HiCache host tier. Each is replayed call by call on
hostpool_nb's allocator and on the original algorithm, each call timed alone, the caches evicted after each
batch call as the model's forward that follows it would (``hostpool_nb.replay.time_methods``). The rows: each
trace whole (seconds per call, all calls), and for each pool size each method over every trace of that size.
"""

from __future__ import annotations

import re
from pathlib import Path

from .core import HOSTPOOL, NUMPY, Context, Row, fmt_count, workload

TRACES = Path(__file__).parent / "data" / "engine"
_NAME = re.compile(r"^p(?P<ps>\d+)-(?P<pool>\d+[KM])(?P<rest>(-noradix|-host)?)\.trace$")
# What the whole trace of a 1M-token pool must reach, by page size; every method at every size: 1x.
WHOLE_1M = {1: 10.0, 16: 3.0}
_POOL_ORDER = {"64K": 0, "256K": 1, "1M": 2}


def traces() -> list[Path]:
    """The recorded traces, smallest pool first, page size 1 before 16, the radix cache's before the others."""
    found = [p for p in TRACES.glob("*.trace") if _NAME.match(p.name)]

    def key(p: Path) -> tuple[int, int, str]:
        m = _NAME.match(p.name)
        assert m is not None  # filtered above
        return _POOL_ORDER.get(m["pool"], 9), int(m["ps"]), m["rest"]

    return sorted(found, key=key)


@workload("engine", seconds=40)
def engine_mix(ctx: Context) -> list[Row]:
    """Each engine trace whole, then each method by pool size, hostpool_nb against the original algorithm."""
    from hostpool_nb.replay import time_methods
    from hostpool_nb.trace import load

    paths = traces()
    if ctx.tiny:
        paths = paths[:1]
    whole: list[Row] = []
    by_size: dict[str, dict[str, dict[str, float]]] = {}
    calls_by_size: dict[str, dict[str, int]] = {}
    for i, path in enumerate(paths):
        m = _NAME.match(path.name)
        assert m is not None
        ctx.label(f"engine mix: {path.stem}")
        trace = load(path)
        timing = time_methods(trace, ctx.repeats(3), evict_bytes=ctx.size(32 << 20, 1 << 20))
        n = sum(timing.calls.values())
        values = {impl: timing.total(impl) / n for impl in (HOSTPOOL, NUMPY)}
        what = {"": "radix", "-noradix": "no radix", "-host": "host tier"}[m["rest"]]
        row = Row(
            "engine mix", f"p{m['ps']} {m['pool']} {what} {fmt_count(n)} calls", "s", values, columns=(HOSTPOOL, NUMPY)
        )
        if m["pool"] == "1M":
            row.at_least(NUMPY, WHOLE_1M.get(int(m["ps"]), 1.0))
        whole.append(row)
        sizes = by_size.setdefault(m["pool"], {HOSTPOOL: {}, NUMPY: {}})
        counts = calls_by_size.setdefault(m["pool"], {})
        for method, k in timing.calls.items():
            counts[method] = counts.get(method, 0) + k
            for impl in (HOSTPOOL, NUMPY):
                sizes[impl][method] = sizes[impl].get(method, 0.0) + timing.seconds[impl][method]
        ctx.tick((i + 1) / len(paths))
    rows = list(whole)
    for pool, sizes in by_size.items():
        for method, k in sorted(calls_by_size[pool].items(), key=lambda kv: -kv[1]):
            values = {impl: sizes[impl][method] / k for impl in (HOSTPOOL, NUMPY)}
            params = f"{pool} {method.replace('_', ' ')} {fmt_count(k)}"
            rows.append(
                Row("engine mix, by method", params, "s", values, columns=(HOSTPOOL, NUMPY)).at_least(NUMPY, 1.0)
            )
    ctx.notes.append(
        "engine mix: traces sglang-jax 0.1.0rc0's scheduler recorded serving a tiny Qwen3 on a CPU (64 prompts, two "
        "rounds), replayed call by call with the caches evicted after each batch call, as the forward after it "
        "does; time per call, the original algorithm's over hostpool_nb.paged's (docs/benchmarks.md)"
    )
    return rows
