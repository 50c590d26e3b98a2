"""Packaging facts: no torch at import, a consistent public API, typing marker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import hostpool_nb

ROOT = Path(__file__).resolve().parent.parent


def test_import_does_not_load_torch() -> None:
    """Nor do the integrations: each imports torch (sglang's) only when installed, and no engine at all."""
    code = (
        "import json, sys\n"
        "import hostpool_nb\n"
        "import hostpool_nb.integrations.sglang, hostpool_nb.integrations.sgl_jax, hostpool_nb.originals.engines\n"
        "pool = hostpool_nb.LogicalHostPool(32, 16)\n"
        "pool.free(pool.alloc(16))\n"  # the kernels run without pulling torch in either
        "print(json.dumps({'torch': sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'sglang')),"
        " 'file': hostpool_nb.__file__}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["torch"] == []
    assert Path(result["file"]).resolve().parent == Path(hostpool_nb.__file__).resolve().parent


def test_all_names_exist() -> None:
    assert len(hostpool_nb.__all__) == len(set(hostpool_nb.__all__))
    for name in hostpool_nb.__all__:
        assert hasattr(hostpool_nb, name), name
    for name in (
        "LogicalHostPool",
        "HostPoolError",
        "AlignmentError",
        "DoubleFreeError",
        "PartialPageError",
        "SlotRangeError",
    ):
        assert name in hostpool_nb.__all__


def test_version_is_a_string() -> None:
    assert isinstance(hostpool_nb.__version__, str)
    assert hostpool_nb.__version__.strip()
    assert hostpool_nb.__version__[0].isdigit()


def test_py_typed_ships_in_the_package() -> None:
    marker = Path(hostpool_nb.__file__).resolve().parent / "py.typed"
    assert marker.is_file()


def test_every_subpackage_is_in_the_wheel() -> None:
    """pyproject.toml lists the packages setuptools ships: a subpackage missing there imports from a checkout
    (where the tests run) and is absent from every installed wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later; the other CI Pythons run it
    root = Path(hostpool_nb.__file__).resolve().parent
    config = root.parent / "pyproject.toml"
    if not config.is_file():
        pytest.skip(f"hostpool_nb is imported from {root}, not from a checkout")
    listed = set(tomllib.loads(config.read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(("hostpool_nb", *init.parent.relative_to(root).parts))
        for init in root.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert listed == found


def test_the_modules_that_import_torch_are_the_ones_the_tests_leave_out_without_it() -> None:
    """tests.conftest.TORCH_MODULES lists every module importing torch when imported: else a run without torch fails."""
    import ast
    from pathlib import Path

    import hostpool_nb
    from tests.conftest import TORCH_MODULES

    def imports_torch(body: list[ast.stmt]) -> bool:  # at the top, or in a try or if there, not in a function
        for node in body:
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
                return True
            if isinstance(node, (ast.Try, ast.If)) and imports_torch(
                [*node.body, *node.orelse, *[s for h in getattr(node, "handlers", []) for s in h.body]]
            ):
                return True
        return False

    root = Path(hostpool_nb.__file__).parent
    found = {
        "hostpool_nb." + ".".join(path.relative_to(root).with_suffix("").parts)
        for path in root.rglob("*.py")
        if imports_torch(ast.parse(path.read_text()).body)
    }
    assert found == TORCH_MODULES
