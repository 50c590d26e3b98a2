"""README's Python examples run as written (the front door must not lie)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code: str, capsys: pytest.CaptureFixture[str]) -> None:
    if "hostpool_nb.torch" in code or "import torch" in code:
        pytest.importorskip("torch")
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})  # our own README
    capsys.readouterr()
