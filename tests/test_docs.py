"""The front door must not lie: every Python example in README.md and docs/ runs, and docstring examples pass."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

from tests.conftest import TORCH_MODULES

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```python\n(.*?)```", flags=re.DOTALL)
BLOCKS = [(page, i, code) for page in PAGES for i, code in enumerate(FENCE.findall(page.read_text()))]
# Every module of the package: the examples in its docstrings are run as doctests.
MODULES = sorted(
    f"hostpool_nb.{path.relative_to(ROOT / 'hostpool_nb').with_suffix('').as_posix().replace('/', '.')}".removesuffix(
        ".__init__"
    )
    for path in (ROOT / "hostpool_nb").rglob("*.py")
)


def test_the_pages_have_examples() -> None:
    pages_with_code = {page.name for page, _, _ in BLOCKS}
    assert {"README.md", "diagnostics.md", "jax-serving.md", "sglang.md"} <= pages_with_code


def _needs_torch(code: str) -> bool:
    # sglang's integration installs hostpool_nb.torch's pool.
    return "hostpool_nb.torch" in code or "import torch" in code or "integrations import sglang" in code


@pytest.mark.parametrize(
    ("page", "index", "code"),
    [
        pytest.param(page, i, code, id=f"{page.name}-{i}", marks=[pytest.mark.torch] if _needs_torch(code) else [])
        for page, i, code in BLOCKS
    ],
)
def test_each_example_runs(
    page: Path,
    index: int,
    code: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if _needs_torch(code):
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)  # examples that write files write them there
    exec(compile(code, f"{page}:{index}", "exec"), {"__name__": "docs_example"})  # our own docs
    capsys.readouterr()


def _section(page: str, heading: str) -> str:
    return (ROOT / page).read_text().split(heading, 1)[1]


def test_finding_leaks_prints_what_the_page_shows(capsys: pytest.CaptureFixture[str]) -> None:
    """The leak report and the double-free text in docs/diagnostics.md are the code's own output."""
    section = _section("docs/diagnostics.md", "## Finding leaks")
    code = FENCE.search(section)
    shown = re.search(r"```text\n(.*?)```", section, flags=re.DOTALL)
    assert code is not None
    assert shown is not None
    # The page says the example ran as /tmp/app/serve.py: its sites name that file.
    exec(compile(code.group(1), "/tmp/app/serve.py", "exec"), {"__name__": "__main__"})  # our own docs
    assert capsys.readouterr().out == shown.group(1)


def test_readme_example_prints_what_its_comments_say(capsys: pytest.CaptureFixture[str]) -> None:
    """The first README example's printed double-free message is the one its comment quotes."""
    code = FENCE.search((ROOT / "README.md").read_text())
    assert code is not None
    quoted = re.search(r"print\(err\)\s+# (.+?) \.\.\.", code.group(1))
    assert quoted is not None
    exec(compile(code.group(1), "README.md:0", "exec"), {"__name__": "docs_example"})  # our own docs
    assert capsys.readouterr().out.startswith(quoted.group(1))


# The modules whose examples need torch (the originals of sglang's host pools run on it).
_TORCH_MODULES = {*TORCH_MODULES, "hostpool_nb.originals.sglang_host"}


@pytest.mark.parametrize(
    "name", [pytest.param(m, marks=[pytest.mark.torch] if m in _TORCH_MODULES else []) for m in MODULES]
)
def test_docstring_examples_pass(name: str) -> None:
    if name in _TORCH_MODULES:
        pytest.importorskip("torch")
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
    if name in EXAMPLES:
        assert result.attempted >= EXAMPLES[name]  # the examples were found and ran


# Modules whose public classes carry examples, and how many lines at least. The classes defined in private
# modules are the public module's (their __module__), and their examples run there.
EXAMPLES = {"hostpool_nb.torch": 5, "hostpool_nb": 15, "hostpool_nb.paged": 8, "hostpool_nb.originals.sglang_host": 15}


def test_the_sglang_page_names_the_release_the_integration_pins() -> None:
    from hostpool_nb.integrations.sglang import TESTED_VERSION

    page = (ROOT / "docs" / "sglang.md").read_text()
    assert f"**Versions.** sglang {TESTED_VERSION}:" in page


def test_every_module_is_checked() -> None:
    assert "hostpool_nb._core.pool" in MODULES
    assert "hostpool_nb" in MODULES
    assert "hostpool_nb.originals" in MODULES
    assert set(EXAMPLES) <= set(MODULES)


def test_finding_a_leak_in_sglang_jax_prints_what_the_page_shows(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/jax-serving.md's double free and leak report are the code's own output."""
    section = _section("docs/jax-serving.md", "## Finding a leak in sglang-jax")
    code = FENCE.search(section)
    shown = re.search(r"```text\n(.*?)```", section, flags=re.DOTALL)
    assert code is not None
    assert shown is not None
    exec(compile(code.group(1), "/tmp/app/sched.py", "exec"), {"__name__": "__main__"})  # our own docs
    assert capsys.readouterr().out == shown.group(1)


def test_finding_a_leak_replays_the_recording_as_the_page_shows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 4 of docs/jax-serving.md's "Finding a leak": the recording, and what its replay prints."""
    from hostpool_nb import replay

    section = _section("docs/jax-serving.md", "4. To hand the case to someone else").split("\n## ", 1)[0]
    code = FENCE.search(section)
    shown = re.search(r"```text\n\$ python -m hostpool_nb.replay (\S+)\n(.*?)```", section, flags=re.DOTALL)
    assert code is not None
    assert shown is not None
    monkeypatch.chdir(tmp_path)
    exec(compile(code.group(1), "jax-serving.md", "exec"), {"__name__": "__main__"})  # our own docs
    assert replay.main([shown.group(1)]) == 0
    assert capsys.readouterr().out == shown.group(2)


def test_the_readme_links_nowhere_it_cannot_reach() -> None:
    """README.md is the wheel's description too, read where docs/ is not: it names files, it does not link them."""
    readme = (ROOT / "README.md").read_text()
    assert re.findall(r"\]\((?!https?://)[^)]*\)", readme) == []
    for path in re.findall(r"`(docs/[\w.-]+\.md)`", readme):
        assert (ROOT / path).is_file(), path
