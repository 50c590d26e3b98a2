"""Command-line plumbing shared by ``python -m bench`` and ``python -m bench.profile``.

Both are run by people trying the package for the first time, so a mistake
on the command line gets one line saying what is wrong, on stderr, with
exit status 2 - never a traceback, and never after minutes of measuring.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import NoReturn

# Printed text (table, header, notes) fits a 120-column terminal, the width
# the issue tracker asked for; prose wraps earlier, for reading.
TABLE_WIDTH = 120
TEXT_WIDTH = 100


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line.

    argparse's default prints the usage first, which for this many options
    runs to several lines and buries the one that says what was wrong.
    """

    def __init__(self, prog: str, doc: str) -> None:
        super().__init__(prog=prog, description=plain(doc), formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)


def fail(prog: str, message: str) -> NoReturn:
    """Exit with status 2 after ``prog: error: message`` on stderr."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def plain(doc: str | None) -> str:
    """A module docstring as plain text for ``--help`` (reST's ``double backticks`` removed)."""
    return re.sub(r"``(.+?)``", r"\1", doc or "", flags=re.DOTALL).strip()


def output_path_error(option: str, path: str) -> str | None:
    """Why ``path`` cannot be written, as one line; ``None`` when it can.

    Checked before measuring: the results are written last, so a typo in
    the directory would otherwise cost the whole run (minutes with
    ``--full``) and end in a traceback.
    """
    what = f"cannot write {option} {path}"
    p = Path(path)
    if path.endswith(("/", os.sep)) or p.is_dir():
        return f"{what}: it is a directory"
    parent = p.parent
    if not parent.exists():
        return f"{what}: directory {parent} does not exist"
    if not parent.is_dir():
        return f"{what}: {parent} is not a directory"
    if p.exists():
        if not os.access(p, os.W_OK):
            return f"{what}: the file is not writable"
    elif not os.access(parent, os.W_OK | os.X_OK):
        return f"{what}: directory {parent} is not writable"
    return None


def wrap(text: str, first: str = "", rest: str = "", width: int = TEXT_WIDTH) -> str:
    """``text`` filled to ``width``; words (paths, identifiers) are never split."""
    return textwrap.fill(
        text, width, initial_indent=first, subsequent_indent=rest, break_long_words=False, break_on_hyphens=False
    )
