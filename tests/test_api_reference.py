"""The API reference is complete: every public name has an entry, every public class an example that fits the page.

Public: every name in the ``__all__`` of a module of the package whose path
has no part starting with an underscore, and every public method and
property of such a class. The reference is built from docs/ as CI builds
it (warnings as errors) and read back through its inventory, so an entry
that Sphinx did not make is missing, whatever the page's source says.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hostpool_nb"
WIDTH = 80  # the widest example line the theme's column shows whole


def _public_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(part.startswith("_") for part in parts) or "__all__" not in path.read_text():
            continue
        names.append(".".join(parts))
    return names


def _all_of(module: str) -> list[str]:
    """A module's ``__all__``, read from its source (``hostpool_nb.torch`` needs torch to import)."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise LookupError(module)


def _importable(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:  # hostpool_nb.torch without torch: its own names are checked by name
        return None


def _resolve(name: str) -> Any:
    """The object an inventory entry names, or None."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module = _importable(".".join(parts[:split]))
        if module is None:
            continue
        obj: Any = module
        try:
            for part in parts[split:]:
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    return None


@pytest.fixture(scope="module")
def html(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The docs, built as CI builds them: the folder of their HTML."""
    pytest.importorskip("myst_parser")
    pytest.importorskip("sphinx")
    out = tmp_path_factory.mktemp("html")
    # As CI builds it (every warning an error), and nitpicky: a reference that resolves to no entry is
    # said too. Those of docstrings' types (numpy.ndarray, ...) are allowed; a guide page's are not.
    command = [sys.executable, "-m", "sphinx", "-n", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line]
    unresolved = [line for line in warnings if "reference target not found" in line]
    assert [line for line in warnings if line not in unresolved] == []
    # Warnings of docstrings are located in api.md, which pulls them in; every other page is a guide page.
    assert [line for line in unresolved if ".md:" in line and "/api.md:" not in line] == []
    return out


@pytest.fixture(scope="module")
def inventory(html: Path) -> set[str]:
    from sphinx.util.inventory import InventoryFile

    with (html / "objects.inv").open("rb") as f:
        loaded = InventoryFile.load(f, "", lambda base, uri: uri)
    return {name for kind, entries in loaded.items() if kind.startswith("py:") for name in entries}


def _documented(inventory: set[str]) -> tuple[set[int], dict[int, set[str]]]:
    """Ids of the objects with an entry; for each documented class, the names of its members with one."""
    objects: set[int] = set()
    members: dict[int, set[str]] = {}
    for name in inventory:
        obj = _resolve(name)
        if obj is not None:
            objects.add(id(obj))
        owner_name, _, member = name.rpartition(".")
        owner = _resolve(owner_name) if owner_name else None
        if isinstance(owner, type):
            members.setdefault(id(owner), set()).add(member)
    return objects, members


def _public_members(cls: type) -> list[str]:
    """Methods and properties a caller of ``cls`` uses: public, and not Python's own (``object``'s, exceptions')."""
    skip = set(dir(BaseException)) | set(dir(object)) if issubclass(cls, BaseException) else set(dir(object))
    found = []
    for name in dir(cls):
        if name.startswith("_") or name in skip:
            continue
        value = inspect.getattr_static(cls, name)
        if isinstance(value, (property, staticmethod, classmethod)) or inspect.isfunction(value):
            found.append(name)
    return found


def _public_objects() -> list[tuple[str, str, Any]]:
    found = []
    for module in _public_modules():
        imported = _importable(module)
        found += [(module, name, None if imported is None else getattr(imported, name)) for name in _all_of(module)]
    return found


def test_every_public_name_has_an_entry(inventory: set[str]) -> None:
    objects, _ = _documented(inventory)
    missing = []
    for module, name, obj in _public_objects():
        if obj is None:  # not importable here: its entry by name, or the name's at the package's top
            if f"{module}.{name}" not in inventory and f"hostpool_nb.{name}" not in inventory:
                missing.append(f"{module}.{name}")
        elif id(obj) not in objects:
            missing.append(f"{module}.{name}")
    assert missing == []


def test_every_public_method_and_property_of_a_public_class_has_an_entry(inventory: set[str]) -> None:
    _, members = _documented(inventory)
    missing = []
    for module, name, obj in _public_objects():
        if isinstance(obj, type):
            have = members.get(id(obj), set())
            missing += [f"{module}.{name}.{m}" for m in _public_members(obj) if m not in have]
    assert missing == []


def _examples(doc: str) -> str:
    found = re.search(r"^Examples\n-{8,}\n(.*)", doc, flags=re.M | re.S)
    return "" if found is None else found.group(1)


def test_every_public_class_has_an_example_that_fits_the_page() -> None:
    """The examples run as doctests (tests/test_docs.py); here: there is one, and no line is cut off."""
    without, wide = [], []
    seen: set[int] = set()
    for module, name, obj in _public_objects():
        if not isinstance(obj, type) or id(obj) in seen:
            continue
        seen.add(id(obj))
        examples = _examples(inspect.getdoc(obj) or "")
        if ">>>" not in examples:
            without.append(f"{module}.{name}")
        wide += [f"{module}.{name}: {line}" for line in examples.splitlines() if len(line) > WIDTH]
    assert without == []
    assert wide == []


def test_the_errors_name_their_public_path() -> None:
    import hostpool_nb

    for name in hostpool_nb.__all__:
        obj = getattr(hostpool_nb, name)
        if isinstance(obj, type) and issubclass(obj, Warning | Exception):
            assert obj.__module__ == "hostpool_nb", name


# A type as docstrings give them: ``int``, ``numpy.ndarray``, ``tuple of Site, or None``, ``list[int]``.
_TYPE = re.compile(r"^[\w.]+(\[[\w., ]+\])?( of [\w.]+)?((, or| or|,) [\w.]+(\[[\w., ]+\])?)*$")


def test_every_type_field_on_the_api_page_is_a_type(html: Path) -> None:
    """An attribute's doc whose first line has a colon is read as ``type: description``: no sentence as a type."""
    page = (html / "api.html").read_text()
    field = r'<dt class="field-\w+">Type<span class="colon">:</span></dt>\s*<dd[^>]*>(.*?)</dd>'
    fields = re.findall(field, page, re.S)
    assert fields, "the page has no Type fields: the pattern needs updating"
    types = [" ".join(re.sub(r"<[^>]+>", " ", f).split()) for f in fields]
    assert [t for t in types if not _TYPE.match(t)] == []


def test_an_exceptions_inherited_attributes_are_not_its_api(inventory: set[str]) -> None:
    assert "hostpool_nb.integrations.IntegrationError" in inventory
    assert not {"msg", "name", "path"} & {n.rpartition(".")[2] for n in inventory if ".IntegrationError." in n}
