"""Sphinx configuration: python -m sphinx -W -b html docs docs/_build (the docs extra)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # document the checkout, installed or not

import hostpool_nb  # noqa: E402 - after the path is set

project = "hostpool_nb"
author = "hostpool_nb maintainers"
copyright = "2026, hostpool_nb maintainers"
release = version = hostpool_nb.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
myst_enable_extensions = ["deflist"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "bench-full.json"]
myst_heading_anchors = 3  # links to sections of other pages

# numpydoc-style docstrings, read by napoleon.
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "mixed"
# Members a class inherits are its members too (the pools share their protocol through private bases), but
# not what every exception or warning inherits from Python's own classes.
autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
    "inherited-members": "BaseException,ImportError,object",  # an exception's msg, name, path are not its API
}
# The docs build from the docs extra alone: the torch adapter's page is made without torch installed.
autodoc_mock_imports = ["torch"]

html_theme = "alabaster"
html_title = f"hostpool_nb {release}"
html_static_path: list[str] = []


def _public_bases(app: object, name: str, obj: object, options: object, bases: list[type]) -> None:
    """Never show a private base (``Bases: _RankedAllocator``): the class's own public bases only."""
    public = set(hostpool_nb.__all__)
    bases[:] = [
        b
        for b in bases
        if not b.__name__.startswith("_") and (not b.__module__.startswith("hostpool_nb._") or b.__name__ in public)
    ]


def setup(app: object) -> None:
    app.connect("autodoc-process-bases", _public_bases)  # type: ignore[attr-defined]
