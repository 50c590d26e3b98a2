"""Time sglang-jax's engine, plain and with hostpool_nb installed: ``python -m tests.engine.timing``.

Runs the real engine (Python 3.12+, sglang-jax installed; a tiny Qwen3 built on the spot, nothing
downloaded) on a serving workload, plain and with ``sgl_jax.install()``, the two interleaved, and reports
per configuration (medians over the runs, their range):

- the scheduler's time in the allocator's and host pool's methods: its first call of each method (what a
  cold kernel load would stall) apart from the steady calls after it, and construction apart from both;
- the scheduler's own time per step outside the model's forward (what competes with a TPU's forward);
- the first request's latency (the first ``generate`` after the engine is up, one prompt), the tokens per
  second of the batch rounds, and whether every request's output ids equal the plain engine's.

The workload: one request alone, then ``--rounds`` rounds of ``--prompts`` prompts of 100 to 500 words
(one token each: the tiny tokenizer is word-level) sharing a few prefixes, each round sent as one batch
(the second round hits the radix cache), ``--new-tokens`` tokens each, greedy, the overlap scheduler off.

``--record DIR`` runs only the installed engine, with ``HOSTPOOL_NB_RECORD=DIR/<config>``: the traces the
bench's engine-mix rows replay (``bench/data/``).

Instrumented in the scheduler's process by :func:`instrument` (the launcher, ``tests/engine/launch.py``,
calls it when its settings say ``timing``), which writes ``timing-<pid>.json`` into the run's folder when
the scheduler goes idle.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ALLOCATOR_METHODS = (
    "alloc",
    "alloc_extend",
    "alloc_decode",
    "free",
    "free_swa",
    "free_group_begin",
    "free_group_end",
    "available_size",
    "full_available_size",
    "swa_available_size",
    "merge_and_sort_free",
    "clear",
    "backup_state",
    "restore_state",
)
HOST_METHODS = ("alloc", "free", "reserve", "release", "available_size", "inc_lock_ref", "dec_lock_ref")
ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator", "SWATokenToKVPoolAllocator")

# -- in the engine's processes ---------------------------------------------------------------------------


class _Clock:
    """What the scheduler's process spent, by method, kept until the scheduler goes idle."""

    def __init__(self) -> None:
        self.depth = threading.local()
        self.first: dict[str, int] = {}  # a method's first call, in ns
        self.steady: dict[str, list[int]] = {}  # every later call, in ns
        self.shapes: dict[str, dict[str, int]] = {}  # what the calls were given: a kind of argument, a count
        self.construction: list[int] = []
        self.scheduler = {"busy_ns": 0, "forward_ns": 0, "steps": 0, "idle_ns": 0}
        self.received = 0  # requests the scheduler has taken in: while it has one, it serves the first request
        self.first_request_ns = 0  # the allocator's time while it served the first request alone
        self.saved_at = 0.0


_CLOCK = _Clock()


def _shape_of(args: tuple[Any, ...]) -> str:
    """The kind and size of a call's first argument: ``"ndarray:int64:0"``, ``"list:3"``, ``"int"``."""
    if not args:
        return "-"
    a = args[0]
    if isinstance(a, (list, tuple)):
        return f"{type(a).__name__}:{_size_class(len(a))}"
    dtype = getattr(a, "dtype", None)
    if dtype is not None and hasattr(a, "shape"):
        n = int(getattr(a, "size", 0))
        return f"{type(a).__name__}:{dtype}:{_size_class(n)}"
    return type(a).__name__


def _size_class(n: int) -> str:
    return "0" if n == 0 else "1" if n == 1 else "<=16" if n <= 16 else "<=256" if n <= 256 else ">256"


def _timed(cls: type, name: str, label: str) -> None:
    method = cls.__dict__.get(name) or getattr(cls, name, None)
    if method is None or isinstance(method, property):
        return
    key = f"{label}.{name}"
    clock = _CLOCK
    perf = time.perf_counter_ns

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(clock.depth, "n", 0)
        if depth:
            return method(self, *args, **kwargs)
        clock.depth.n = 1
        start = perf()
        try:
            return method(self, *args, **kwargs)
        finally:
            spent = perf() - start
            clock.depth.n = 0
            if clock.received <= 1:
                clock.first_request_ns += spent
            if key in clock.first:
                clock.steady[key].append(spent)
            else:
                clock.first[key] = spent
                clock.steady[key] = []
            shapes = clock.shapes.setdefault(key, {})
            shape = _shape_of(args) + ("" if getattr(self, "is_not_in_free_group", True) else " in a group")
            shapes[shape] = shapes.get(shape, 0) + 1

    setattr(cls, name, timed)


def _constructed(cls: type) -> None:
    init = cls.__init__
    clock = _CLOCK

    @functools.wraps(init)
    def timed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        depth = getattr(clock.depth, "n", 0)
        clock.depth.n = depth + 1  # a constructor's own calls (its clear()) are construction
        start = time.perf_counter_ns()
        try:
            init(self, *args, **kwargs)
        finally:
            clock.depth.n = depth
            if depth == 0:
                clock.construction.append(time.perf_counter_ns() - start)

    cls.__init__ = timed_init  # type: ignore[misc]


def _scheduler_timed(cls: type, name: str, field: str) -> None:
    method = getattr(cls, name)
    clock = _CLOCK
    perf = time.perf_counter_ns

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = perf()
        try:
            return method(self, *args, **kwargs)
        finally:
            clock.scheduler[field] += perf() - start
            if name == "run_batch":
                clock.scheduler["steps"] += 1

    setattr(cls, name, timed)


def _forward_timed(cls: type) -> None:
    """The model's forward, timed until its results are ready: JAX returns before it has computed them.

    With the overlap scheduler off the scheduler waits for them right after anyway (its ``device_get``).
    """
    import jax

    method = cls.forward_batch_generation
    clock = _CLOCK
    perf = time.perf_counter_ns

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = perf()
        try:
            return jax.block_until_ready(method(self, *args, **kwargs))
        finally:
            clock.scheduler["forward_ns"] += perf() - start

    cls.forward_batch_generation = timed


def _save(out: Path) -> None:
    clock = _CLOCK
    path = out / f"timing-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "first": clock.first,
                "steady": clock.steady,
                "shapes": clock.shapes,
                "construction": clock.construction,
                "scheduler": clock.scheduler,
                "first_request_ns": clock.first_request_ns,
            }
        )
    )
    os.replace(tmp, path)


def instrument(out: Path) -> None:
    """Time the allocator's, host pool's and scheduler's methods in this process (every process of the engine)."""
    from sgl_jax.srt.managers import scheduler, tp_worker
    from sgl_jax.srt.mem_cache import allocator, host_kv_pool

    for name in ALLOCATORS:
        cls = getattr(allocator, name)
        for method in ALLOCATOR_METHODS:
            _timed(cls, method, "allocator")
        _constructed(cls)
    for name in ("LRUHostKVPool",):
        cls = getattr(host_kv_pool, name)
        for method in HOST_METHODS:
            _timed(cls, method, "host")
        _constructed(cls)
    # The scheduler's own work: each step's batch chosen, run, its result processed, and new requests taken in.
    for name in ("process_input_requests", "get_next_batch_to_run", "run_batch", "process_batch_result"):
        _scheduler_timed(scheduler.Scheduler, name, "busy_ns")
    taken = scheduler.Scheduler.process_input_requests

    def counted(self: Any, recv_reqs: Any) -> Any:
        _CLOCK.received += len(recv_reqs or ())
        return taken(self, recv_reqs)

    scheduler.Scheduler.process_input_requests = counted
    _forward_timed(tp_worker.ModelWorker)
    on_idle = scheduler.Scheduler.on_idle

    def idle(self: Any) -> None:
        start = time.perf_counter_ns()
        # The idle loop's own calls (the engine's leak checks) are the engine's, timed like any other.
        on_idle(self)
        _CLOCK.scheduler["idle_ns"] += time.perf_counter_ns() - start
        now = time.monotonic()
        if _CLOCK.first and now - _CLOCK.saved_at > 0.2:  # the engine ends the scheduler with SIGKILL
            _CLOCK.saved_at = now
            _save(out)

    scheduler.Scheduler.on_idle = idle


# -- the driver ------------------------------------------------------------------------------------------

_POOLS = {"64K": 1 << 16, "256K": 1 << 18, "1M": 1 << 20}
CONFIGS: dict[str, dict[str, Any]] = {
    **{
        f"p{ps}-{name}{'-noradix' * off}": {
            "page_size": ps,
            "max_total_tokens": tokens,
            **({"disable_radix_cache": True} if off else {}),
        }
        for off in (False, True)
        for name, tokens in _POOLS.items()
        for ps in (1, 16)
    },
    # The HiCache host tier: two host pages for each device page, evicted to and loaded back.
    "p16-64K-host": {"page_size": 16, "max_total_tokens": 1 << 16, "hicache_storage": "none", "hicache_ratio": 2},
}
DEFAULT_CONFIGS = ("p1-1M", "p16-1M", "p1-64K", "p16-64K")


def workload(prompts: int, seed: int = 0) -> list[str]:
    """``prompts`` prompts of 100 to 480 words: three in four begin with one of six shared 60-word prefixes.

    The tiny model's context is 512 tokens: a prompt and its new tokens stay within it.
    """
    from tests.engine.tiny_models import SENTENCES

    words = sorted({w for sentence in SENTENCES for w in sentence.split()})
    rng = random.Random(seed)
    bases = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(8)]
    made = []
    for i in range(prompts):
        if i % 4:
            made.append(bases[i % 8] + " " + " ".join(rng.choice(words) for _ in range(rng.randrange(40, 420))))
        else:
            made.append(" ".join(rng.choice(words) for _ in range(rng.randrange(100, 480))))
    return made


def _run(
    folder: Path, model: Path, config: str, install: bool, args: argparse.Namespace, record: Path | None
) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2]
    folder.mkdir(parents=True)
    (folder / "prompts.json").write_text(json.dumps(workload(args.prompts)))
    settings = {
        "out": str(folder),
        "model": str(model),
        "install": install,
        "timing": True,
        "engine": {
            "device": "cpu",
            "max_running_requests": 256,
            "chunked_prefill_size": 4096,
            "max_prefill_tokens": 16384,
            "disable_precompile": True,
            "skip_server_warmup": True,
            "disable_overlap_schedule": True,
            "grammar_backend": "none",
            "random_seed": 0,
            **CONFIGS[config],
        },
        "prompts_file": str(folder / "prompts.json"),
        "rounds": args.rounds,
        "max_new_tokens": args.new_tokens,
        "swa": False,
        "host_tier": "hicache_storage" in CONFIGS[config],
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTPOOL_NB_")}
    env |= {
        "HOSTPOOL_NB_ENGINE_RUN": json.dumps(settings),
        "JAX_PLATFORMS": "cpu",
        # XLA's compiles, kept across runs: the engine compiles per batch shape, and that is not what is timed.
        "JAX_COMPILATION_CACHE_DIR": str(args.jax_cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    if record is not None:
        env["HOSTPOOL_NB_RECORD"] = str(record)
    done = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "launch.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=args.timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the engine run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads((folder / "result.json").read_text())
    timings = sorted(folder.glob("timing-*.json"), key=lambda p: p.stat().st_size)
    result["timing"] = json.loads(timings[-1].read_text()) if timings else None
    return result


def summarise(result: dict[str, Any]) -> dict[str, float]:
    """One run's figures, in ms (but tokens per second and the step count)."""
    t = result["timing"]
    first = sum(t["first"].values()) / 1e6
    steady = sum(sum(v) for v in t["steady"].values()) / 1e6
    sched = t["scheduler"]
    steps = max(sched["steps"], 1)
    calls = sum(len(v) + 1 for v in t["steady"].values())
    return {
        "construction_ms": sum(t["construction"]) / 1e6,
        "first_calls_ms": first,
        "steady_ms": steady,
        "serving_ms": first + steady,
        "calls": calls,
        "us_per_call": (first + steady) * 1e3 / max(calls, 1),
        "steps": sched["steps"],
        "outside_forward_ms_per_step": (sched["busy_ns"] - sched["forward_ns"]) / 1e6 / steps,
        "allocator_ms_per_step": (first + steady) / steps,
        "first_request_ms": result["first_request_seconds"] * 1e3,
        "allocator_in_first_request_ms": t["first_request_ns"] / 1e6,
        "tokens_per_s": result["tokens"] / result["batch_seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.engine.timing", description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--runs", type=int, default=3, help="runs of each side, interleaved (default 3)")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--record", help="record the installed engine's traces into this folder, and time nothing")
    parser.add_argument("--keep", help="keep the runs' folders here")
    parser.add_argument(
        "--jax-cache",
        default=Path(tempfile.gettempdir()) / "hostpool_nb-jax-cache",
        type=Path,
        help="XLA's compilation cache, kept across runs (default: in the temporary folder)",
    )
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    from tests.engine import tiny_models

    with tempfile.TemporaryDirectory() as tmp:
        where = Path(args.keep) if args.keep else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        model = tiny_models.qwen3(where / "qwen3")
        if args.record:
            for config in configs:
                _run(where / f"record-{config}", model, config, True, args, Path(args.record) / config)
                print(f"{config}: recorded into {Path(args.record) / config}", flush=True)
            return 0
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {"plain": [], "installed": []} for c in configs}
        for i in range(args.runs):
            for config in configs:
                sides = ("plain", "installed") if i % 2 == 0 else ("installed", "plain")
                for side in sides:
                    result = _run(where / f"{config}-{side}-{i}", model, config, side == "installed", args, None)
                    runs[config][side].append(result)
                    s = summarise(result)
                    print(
                        f"{config} {side} run {i}: allocator {s['serving_ms']:.1f} ms "
                        f"(first calls {s['first_calls_ms']:.1f}), {s['calls']} calls, construction "
                        f"{s['construction_ms']:.1f} ms, first request {s['first_request_ms']:.0f} ms",
                        flush=True,
                    )
        print(_report(runs))
        if args.json:
            Path(args.json).write_text(json.dumps(runs, indent=1))
    differ = [c for c, sides in runs.items() if not _identical(sides)]
    if differ:
        print(f"the installed engine's outputs differ from the plain engine's: {', '.join(differ)}", file=sys.stderr)
        return 1
    return 0


def _outputs(run: dict[str, Any]) -> list[Any]:
    return [r["output_ids"] for r in run["requests"]]


def _identical(sides: dict[str, list[dict[str, Any]]]) -> bool:
    """Whether every installed run generated the tokens the first plain run did, request by request.

    Cache hits are not compared: whether a request finds another's prefix in the radix cache depends on the
    step that admitted it, which moves with timing in the plain engine too (seen: 7 of 80 requests).
    """
    first = _outputs(sides["plain"][0])
    return all(_outputs(r) == first for r in sides["installed"])


def _hits_moved(sides: dict[str, list[dict[str, Any]]]) -> int:
    """The most requests of any run whose cache hits differ from the first plain run's."""
    first = [r["cached_tokens"] for r in sides["plain"][0]["requests"]]
    runs = sides["plain"][1:] + sides["installed"]
    return max(
        (sum(r["cached_tokens"] != c for r, c in zip(run["requests"], first, strict=True)) for run in runs), default=0
    )


def _median_range(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) < 2:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def _report(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    rows = [
        ("allocator while serving, ms (first calls included)", "serving_ms", ".1f"),
        ("  of which first calls, ms", "first_calls_ms", ".1f"),
        ("  steady, ms", "steady_ms", ".1f"),
        ("  calls", "calls", ".0f"),
        ("  us a call", "us_per_call", ".1f"),
        ("allocator per step, ms", "allocator_ms_per_step", ".3f"),
        ("scheduler outside the forward, per step, ms", "outside_forward_ms_per_step", ".2f"),
        ("construction, ms", "construction_ms", ".1f"),
        ("first request, ms", "first_request_ms", ".0f"),
        ("  of which the allocator's calls, ms", "allocator_in_first_request_ms", ".2f"),
        ("tokens/s", "tokens_per_s", ".0f"),
        ("steps", "steps", ".0f"),
    ]
    lines = []
    for config, sides in runs.items():
        plain = [summarise(r) for r in sides["plain"]]
        mine = [summarise(r) for r in sides["installed"]]
        same = _identical(sides)
        plain_same = all(_outputs(r) == _outputs(sides["plain"][0]) for r in sides["plain"])
        lines.append(
            f"\n{config} ({len(plain)} runs each; outputs identical: {same}; plain repeats itself: {plain_same}; "
            f"cache hits moved with timing in at most {_hits_moved(sides)} requests of a run)"
        )
        lines.append(f"  {'':48} {'plain':>22} {'installed':>22} {'ratio':>7}")
        for label, key, fmt in rows:
            p = [s[key] for s in plain]
            m = [s[key] for s in mine]
            ratio = statistics.median(p) / statistics.median(m) if statistics.median(m) else float("nan")
            lines.append(f"  {label:48} {_median_range(p, fmt):>22} {_median_range(m, fmt):>22} {ratio:>7.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
