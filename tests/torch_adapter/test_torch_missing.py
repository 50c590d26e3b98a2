"""hostpool_nb.torch where torch is missing: a clear ImportError, a working core.

No ``importorskip`` here, so this runs in the torch-free CI environment too;
with torch installed, a meta path finder in the child makes it look missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

_BLOCK_TORCH = textwrap.dedent(
    """
    import json, sys

    attempts = []

    class BlockTorch:
        # A meta path finder that makes torch look uninstalled and records
        # every attempt to import it.
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                attempts.append(name)
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    for mod in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        del sys.modules[mod]
    sys.meta_path.insert(0, BlockTorch())

    import hostpool_nb
    pool = hostpool_nb.LogicalHostPool(64, 16)
    pool.free(pool.alloc(32))
    result = {"core_attempts": list(attempts), "torch_loaded": "torch" in sys.modules}
    try:
        import hostpool_nb.torch
    except ImportError as exc:
        result.update(
            raised=type(exc).__name__,
            message=str(exc),
            cause=type(exc.__cause__).__name__ if exc.__cause__ else None,
            adapter_left_in_modules="hostpool_nb.torch" in sys.modules,
        )
    else:
        result.update(raised=None)
    result["attempts"] = attempts
    print(json.dumps(result))
    """
)


def run_child(code: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_without_torch_says_how_to_install() -> None:
    result = run_child(_BLOCK_TORCH)
    # The core works and never even tries to import torch.
    assert result["core_attempts"] == []
    assert result["torch_loaded"] is False
    # The adapter fails with the install hint, chained from the real error.
    assert result["raised"] == "ImportError"
    # Commands that work from a clone: the package is not on an index, so
    # ``pip install "hostpool_nb[torch]"`` would fail.
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in result["message"]  # as README
    assert 'pip install ".[torch]"' in result["message"]
    assert "hostpool_nb[torch]" not in result["message"]
    assert result["cause"] == "ModuleNotFoundError"
    assert result["adapter_left_in_modules"] is False
    assert result["attempts"]
    assert result["attempts"][0] == "torch"
