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
def test_readme_example_runs(
    code: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if "hostpool_nb.torch" in code or "import torch" in code:
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)  # examples that write files write them there
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})  # our own README
    capsys.readouterr()


def test_finding_leaks_prints_what_the_readme_shows(capsys: pytest.CaptureFixture[str]) -> None:
    """The leak report and the double-free text in "Finding leaks" are the code's own output."""
    section = README.read_text().split("## Finding leaks", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL)
    shown = re.search(r"```text\n(.*?)```", section, flags=re.DOTALL)
    assert code is not None
    assert shown is not None
    # The README says the example ran as /tmp/app/serve.py: its sites name that file.
    exec(compile(code.group(1), "/tmp/app/serve.py", "exec"), {"__name__": "__main__"})  # our own README
    assert capsys.readouterr().out == shown.group(1)
