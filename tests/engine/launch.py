"""Launch sglang-jax's engine on a CPU, plain or with hostpool_nb installed as the docs say, and run prompts.

Run as a script by ``tests/integrations/test_sgl_jax_engine.py``: ``python tests/engine/launch.py``, with the run's
settings as JSON in ``HOSTPOOL_NB_ENGINE_RUN``. The engine spawns its scheduler and detokenizer, which
import this script again as ``__mp_main__``: everything at the top level runs in every process of the
engine, as a user's ``install()`` at the top of their launcher does. Besides the engine's own outputs
(``result.json``: each request's generated token ids and cached-token count), each process writes into
the run's folder what the test compares and checks:

- ``log-<pid>.txt``: the ``hostpool_nb`` logger's lines, each with the process id and the function the
  process was started for (``run_scheduler_process``);
- ``calls-<pid>.json``: how often the process called the allocator's and host pool's methods (outermost
  calls only: the sliding-window allocator's calls on its sub-allocators are its own business), tokens
  the radix caches evicted, and the engine's own leak checks passed;
- ``leak-<pid>.json`` (tracking on): after each of the engine's leak checks, what hostpool_nb's
  ``outstanding()`` finds held by no one, the radix cache's slots left out.

Settings (keys of the JSON): ``out``, ``model``, ``install``, ``engine`` (keyword arguments of
``Engine``), ``prompts``, ``max_new_tokens``, ``swa`` (patch the CPU attention for a sliding-window
model, in this process tree only: ``cpu_swa``), ``fault`` (plant an allocator that hands one slot out
twice: the comparison must then fail), ``host_tier`` (Pallas's interpret mode, which loading from the
host tier needs on a CPU).
"""

from __future__ import annotations

import collections
import functools
import inspect
import json
import logging
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = json.loads(os.environ["HOSTPOOL_NB_ENGINE_RUN"])
OUT = Path(CONFIG["out"])
if "prompts_file" in CONFIG:  # a workload too long for an environment variable
    CONFIG["prompts"] = json.loads(Path(CONFIG["prompts_file"]).read_text())
ALLOCATOR_METHODS = (
    "alloc",
    "alloc_extend",
    "alloc_decode",
    "free",
    "free_swa",
    "merge_and_sort_free",
    "free_group_begin",
    "free_group_end",
    "clear",
)
HOST_METHODS = ("alloc", "free", "reserve", "release")
# The keyword-only parameters hostpool_nb's methods take beyond the engine's (tags, generations): not logged.
HOSTPOOL_NB_EXTRAS = ("tag", "tags", "generation", "generations")


class _Started(logging.Filter):
    """Adds the function the process was started for (the scheduler's, the detokenizer's) to each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        target = getattr(multiprocessing.current_process(), "_target", None)
        record.started_for = getattr(target, "__name__", "main")
        return True


def _log_to_file() -> None:
    handler = logging.FileHandler(OUT / f"log-{os.getpid()}.txt")
    handler.addFilter(_Started())
    handler.setFormatter(logging.Formatter("%(process)d %(started_for)s %(levelname)s %(message)s"))
    logger = logging.getLogger("hostpool_nb")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


_COUNTS: collections.Counter[str] = collections.Counter()
_DEPTH = threading.local()


def _save_counts() -> None:
    path = OUT / f"calls-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(_COUNTS)))
    os.replace(tmp, path)  # the engine ends its processes with SIGKILL: each count is saved as it changes


def _plain(value: Any) -> Any:
    """A call's argument or result as JSON: arrays as lists (numpy's or jax's), the rest as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "tolist"):
        return value.tolist()
    return type(value).__name__


_CALL_LOG: list[Any] = []


def _log_call(name: str, arguments: dict[str, Any], result: Any) -> None:
    """Each call, its arguments by name (defaults filled in) and its result: a JSON line each, in order."""
    if not _CALL_LOG:
        _CALL_LOG.append(open(OUT / f"calls-{os.getpid()}.jsonl", "a", buffering=1))  # noqa: SIM115 - the process's life
    _CALL_LOG[0].write(json.dumps([name, _plain(arguments), _plain(result)]) + "\n")


def _counting(cls: type, name: str, label: str) -> None:
    method = getattr(cls, name, None)
    if method is None:
        return
    signature = inspect.signature(method)

    @functools.wraps(method)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_DEPTH, "n", 0)
        _DEPTH.n = depth + 1
        try:
            result = method(self, *args, **kwargs)
        finally:
            _DEPTH.n = depth
        if depth == 0:  # an outermost call: what the engine asked of the allocator or pool
            _COUNTS[f"{label}.{name}"] += 1
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = {k: v for k, v in bound.arguments.items() if k not in ("self", *HOSTPOOL_NB_EXTRAS)}
            _log_call(f"{label}.{name}", arguments, result)
            if label == "host" and name == "alloc" and result is not None:
                _COUNTS["host.pages allocated"] += len(result)
            _save_counts()
        return result

    setattr(cls, name, counted)


def _uncounted(cls: type, name: str) -> None:
    """Calls made inside ``cls.name`` (a constructor's own ``clear()``) are not the engine's: not counted."""
    method = getattr(cls, name)

    @functools.wraps(method)
    def scoped(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_DEPTH, "n", 0)
        _DEPTH.n = depth + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _DEPTH.n = depth

    setattr(cls, name, scoped)


def _count_calls() -> None:
    from sgl_jax.srt.managers import scheduler
    from sgl_jax.srt.mem_cache import allocator, host_kv_pool, radix_cache

    for name in ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator", "SWATokenToKVPoolAllocator"):
        for method in ALLOCATOR_METHODS:
            _counting(getattr(allocator, name), method, "allocator")
        _uncounted(getattr(allocator, name), "__init__")
    for method in HOST_METHODS:
        _counting(host_kv_pool.LRUHostKVPool, method, "host")
    evict = radix_cache.RadixCache.evict

    def counted_evict(self: Any, params: Any) -> Any:
        result = evict(self, params)
        _COUNTS["radix cache tokens evicted"] += result.num_tokens_evicted
        _save_counts()
        return result

    radix_cache.RadixCache.evict = counted_evict
    check_memory = scheduler.Scheduler.check_memory

    def checked_memory(self: Any) -> None:
        check_memory(self)  # the engine's own leak check: raises if a slot went missing
        _COUNTS["engine leak checks passed"] += 1
        _save_counts()
        _hostpool_nb_leak_check(self)

    scheduler.Scheduler.check_memory = checked_memory


def _radix_cache_slots(tree_cache: Any) -> list[int]:
    """Every device slot the radix cache holds (its nodes' values)."""
    held: list[int] = []
    stack = [getattr(tree_cache, "root_node", None)]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if node.value is not None:
            held.extend(int(x) for x in node.value)
        stack.extend(node.children.values())
    return held


def _hostpool_nb_leak_check(scheduler: Any) -> None:
    allocator = scheduler.token_to_kv_pool_allocator
    if not getattr(allocator, "track", False):
        return
    held = _radix_cache_slots(scheduler.tree_cache)
    records = allocator.outstanding(exclude=held)
    found = {
        "radix cache slots": len(held),
        "unaccounted": [(o.site, o.pages) for o in records],
        "report": allocator.leak_report(exclude=held),
        "outstanding": sum(o.pages for o in allocator.outstanding()),
    }
    path = OUT / f"leak-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(found))
    os.replace(tmp, path)


def _plant_fault() -> None:
    """A broken allocator, in this process tree only: each prefill hands its first slot out twice."""
    from sgl_jax.srt.mem_cache import allocator

    cls = allocator.PagedTokenToKVPoolAllocator
    extend = cls.alloc_extend

    def twice(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = extend(self, *args, **kwargs)
        if out is not None and len(out) > 1:
            out[1] = out[0]  # two tokens of the prompt written to one slot
        return out

    cls.alloc_extend = twice


_log_to_file()
if CONFIG["install"]:
    from hostpool_nb.integrations import sgl_jax

    sgl_jax.install()  # as the docs say: at the top level, so the spawned scheduler runs it too
if CONFIG.get("swa"):
    from tests.engine import cpu_swa

    cpu_swa.patch()
if CONFIG.get("host_tier"):
    import jax.experimental.pallas.tpu as pltpu

    pltpu.set_tpu_interpret_mode()
if CONFIG.get("timing"):
    from tests.engine import timing

    timing.instrument(OUT)  # times the calls instead of logging them: a log per call would be timed too
else:
    _count_calls()
if CONFIG.get("fault"):
    _plant_fault()


_TIMED: dict[str, float] = {}


def _rounds(engine: Any, results: list[dict[str, Any]]) -> None:
    """One request alone (its latency timed), then ``rounds`` rounds of every prompt, each round one batch."""
    sampling = {"temperature": 0, "max_new_tokens": CONFIG["max_new_tokens"], "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(prompt=CONFIG["prompts"][0], sampling_params=sampling)
    _TIMED["first_request_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(CONFIG["rounds"]):
        outs = engine.generate(prompt=CONFIG["prompts"], sampling_params=sampling)
        results.extend({"output_ids": o["output_ids"], "cached_tokens": o["meta_info"]["cached_tokens"]} for o in outs)
    _TIMED["batch_seconds"] = time.perf_counter() - start
    _TIMED["tokens"] = sum(len(r["output_ids"]) for r in results)


def main() -> None:
    from sgl_jax.srt.entrypoints.engine import Engine

    started = time.monotonic()
    model = CONFIG["model"]
    engine = Engine(model_path=model, tokenizer_path=model, **CONFIG["engine"])
    ready = time.monotonic()
    results = []
    try:
        if CONFIG.get("rounds"):
            _rounds(engine, results)
        for prompt in (
            [] if CONFIG.get("rounds") else CONFIG["prompts"]
        ):  # one call per request: the plain engine is reproducible so
            out = engine.generate(
                prompt=prompt,
                sampling_params={"temperature": 0, "max_new_tokens": CONFIG["max_new_tokens"], "ignore_eos": True},
            )
            results.append({"output_ids": out["output_ids"], "cached_tokens": out["meta_info"]["cached_tokens"]})
        # The scheduler's idle checks (the leak checks) after the last request, and with HOSTPOOL_NB_RECORD a
        # write of the trace (about once a second): the engine ends the scheduler with SIGKILL.
        time.sleep(2.5 if os.environ.get("HOSTPOOL_NB_RECORD") else 0.5)
    finally:
        engine.shutdown()
    done = time.monotonic()
    (OUT / "result.json").write_text(
        json.dumps(
            {
                **_TIMED,
                "pid": os.getpid(),
                "requests": results,
                "start_seconds": ready - started,
                "run_seconds": done - ready,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
