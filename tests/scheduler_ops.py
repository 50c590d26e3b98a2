"""A reproducible sequence of scheduler calls, for "identical future behaviour" checks.

:func:`run_ops` drives a pool (the core one or the torch adapter) through a
seeded random sequence of ``alloc``, ``alloc_many``, ``free`` (of held pages
in random order, and of pages that are not held), free groups, ``merge``
and ``clear``, and returns everything the pool answered as plain,
JSON-serializable data: slots, ``None``, the type and message of every
error, and the statistics at the end. Two pools in the same state must
return equal lists; a copy, an unpickled pool (in this process or a later
one) and a restored snapshot are checked that way.

It is a module of its own so that a child process can import it
(``tests/core/test_scheduler_api.py`` runs it in a fresh interpreter).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np


def _ints(values: Any) -> list[int]:
    """A numpy array or a CPU tensor as a list of Python ints."""
    return [int(v) for v in values.tolist()]


def run_ops(pool: Any, seed: int, held: list[int], steps: int = 80) -> list[Any]:
    """Run ``steps`` seeded calls on ``pool``; return what it answered.

    ``held`` lists the pages a caller holds when the sequence starts (the
    pool's state does not say which caller holds what); the sequence frees
    some of them and the pages it allocates itself. The list is not changed.
    """
    wrap: Any = np.asarray
    if type(pool).__module__ == "hostpool_nb.torch":
        import torch

        wrap = torch.from_numpy
    rng = random.Random(seed)
    ps = pool.page_size
    n = pool.size // ps
    mine = list(held)
    out: list[Any] = []

    def slots_of(pages: list[int]) -> Any:
        arr = (np.asarray(pages, dtype=np.int64).reshape(-1, 1) * ps + np.arange(ps, dtype=np.int64)).reshape(-1)
        return wrap(arr)

    for _ in range(steps):
        op = rng.choice(
            ["alloc"] * 4 + ["alloc_many"] * 3 + ["free"] * 4 + ["bad_free", "begin", "end", "merge", "clear"]
        )
        try:
            if op == "alloc":
                got = pool.alloc(rng.randint(0, n + 1) * ps)
                if got is not None:
                    mine.extend(_ints(got[::ps] // ps) if ps > 1 else _ints(got))
                out.append((op, None if got is None else _ints(got)))
            elif op == "alloc_many":
                # At most the pool's size in total (larger batches: see the xfail test).
                budget = rng.randint(0, n)
                sizes = []
                for _ in range(rng.randint(0, 3)):
                    k = rng.randint(0, budget)
                    budget -= k
                    sizes.append(k * ps)
                got_many = pool.alloc_many(sizes)
                if got_many is not None:
                    slots, offsets = got_many
                    mine.extend(_ints(slots[::ps] // ps) if ps > 1 else _ints(slots))
                    got_many = (_ints(slots), _ints(offsets))
                out.append((op, sizes, got_many))
            elif op == "free":
                batch = rng.sample(mine, rng.randint(0, len(mine)))
                freed = pool.free(slots_of(batch))
                mine = [p for p in mine if p not in set(batch)]
                out.append((op, batch, freed))
            elif op == "bad_free":
                candidates = [p for p in range(n) if p not in mine]
                if candidates:
                    out.append((op, pool.free(slots_of([rng.choice(candidates)]))))
            elif op == "begin":
                out.append((op, pool.free_group_begin()))
            elif op == "end":
                out.append((op, pool.free_group_end()))
            elif op == "merge":
                out.append((op, int(pool.merge())))  # its type: test_merge_returns_an_int
            else:
                pool.clear()
                mine = []
                out.append((op,))
        except ValueError as exc:  # the pool's errors: HostPoolError and its subclasses
            out.append((op, "raised", type(exc).__name__, str(exc)))
        out.append(("available", pool.available_size()))
    out.append(("stats", dataclasses.astuple(pool.stats())))
    out.append(("repr", repr(pool)))
    return out


def summary(results: list[Any]) -> dict[str, int]:
    """How many calls returned slots, returned ``None`` and raised.

    A sequence that never did all three proves little about a copy.
    """
    counts = {"slots": 0, "none": 0, "raised": 0}
    for entry in results:
        if len(entry) > 1 and entry[1] == "raised":
            counts["raised"] += 1
        elif entry[0] in ("alloc", "alloc_many"):
            counts["none" if entry[-1] is None else "slots"] += 1
    return counts
