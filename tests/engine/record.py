"""Record the device allocator's calls of a real sglang-jax engine run: ``python -m tests.engine.record OUT``.

Runs the engine (Python 3.12+, sglang-jax installed) with hostpool_nb installed and
``HOSTPOOL_NB_RECORD`` set, in the page-size-16 configuration of ``tests/test_sgl_jax_engine.py``
(tracking off), and copies the scheduler's trace to ``OUT``. This is how the bench's ``engine`` row's
trace (``bench/data/``) was made; ``python -m hostpool_nb.replay OUT --time`` times it.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

from tests.engine import tiny_models
from tests.test_sgl_jax_engine import CONFIGS, run_engine


def main(out: str) -> None:
    config = dataclasses.replace(CONFIGS["p16-tracked"], env=())  # untracked: as a server runs
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        models = {"qwen3": tiny_models.qwen3(where / "qwen3")}
        run = run_engine(where / "run", models, config, install=True, record=True)
        (trace,) = (run.folder / "traces").glob("PagedTokenToKVPoolAllocator-*.trace")
        shutil.copyfile(trace, out)
    print(f"{out}: {len(run.calls)} calls of the scheduler, {len(run.requests)} requests")


if __name__ == "__main__":
    main(sys.argv[1])
