"""The flat short kernels (``hostpool_nb/_kernels/flat.py``): what ``tests/flatten.py`` writes, and splicing itself.

Splicing a callee's source must give the same results as calling it: the
callees and templates here are plain functions of this module, which
serves as the ``callees`` module, as the run kernels' module does for the
package. The checked-in flat module must be exactly what the tool writes
from today's templates, and call nothing of ``_kernels.runs``.
"""

from __future__ import annotations

import sys
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st_

from hostpool_nb._kernels import flat as _flat
from hostpool_nb._kernels import pool as _kernels
from hostpool_nb._kernels import runs as _run_kernels
from tests.flatten import OUTPUT, module_text, spliced

HERE = sys.modules[__name__]
FLAG = True
DEBUG = False
SCALE = 3


def clamp(x: int, lo: int, hi: int) -> int:
    y = x
    if y < lo:
        y = lo
    elif y > hi:
        y = hi
    return y


def span(a: int, b: int) -> tuple[int, int]:
    lo = clamp(a, -50, 50)  # a callee calling a callee
    hi = clamp(b, -50, 50)
    x = lo * SCALE  # a local the template has too
    return (lo, hi) if lo <= hi else (hi, lo + x - x)


def bump(acc: list[int], k: int) -> None:
    acc.append(k)


def template(a: int, b: int, c: int) -> tuple[int, int, int, list[int]]:
    x = c  # the callees' ``x`` and ``y`` are theirs
    y: int = clamp(a, 0, 10)
    lo, hi = span(b, c)
    acc: list[int] = []
    for k in range(3):
        bump(acc, k + x)
        if FLAG:
            bump(acc, -1)
        else:
            bump(acc, -2)
        if DEBUG:
            never_spliced(acc)
    if x > 100:
        z = clamp(x, 0, 5)
        return z, lo, hi, acc
    return y, lo, hi, acc


def never_spliced(acc: list[int]) -> None:
    raise AssertionError("a branch decided by a constant is not spliced")


def two_returns(x: int) -> int:
    if x > 0:
        return 1
    return 0


def keyword_template(a: int) -> int:
    r = clamp(a, lo=0, hi=1)
    return r


def early_return_template(a: int) -> int:
    r = two_returns(a)
    return r


def assigned_nothing_template(a: int) -> None:
    acc: list[int] = []
    r = bump(acc, a)  # type: ignore[func-returns-value]
    del r


@settings(max_examples=300, deadline=None)
@given(st_.integers(-200, 200), st_.integers(-200, 200), st_.integers(-200, 200), st_.booleans())
def test_a_spliced_template_returns_what_calling_its_callees_returns(a: int, b: int, c: int, flag: bool) -> None:
    made = spliced(template, name="template_flat", callees=HERE, constants={"FLAG": flag, "DEBUG": False})
    global FLAG  # noqa: PLW0603 - the template reads the flag as the spliced copy has it frozen
    was, FLAG = FLAG, flag
    try:
        assert made(a, b, c) == template(a, b, c)
    finally:
        FLAG = was


def test_a_spliced_template_calls_no_callee_and_keeps_its_lines() -> None:
    made = spliced(template, name="template_flat", callees=HERE, constants={"FLAG": False, "DEBUG": False})
    names = set(made.__code__.co_names)
    assert not names & {"clamp", "span", "bump", "never_spliced", "AssertionError", "FLAG", "DEBUG"}, names
    lines = [line for *_, line in made.__code__.co_lines() if line is not None]
    first = template.__code__.co_firstlineno
    last = max(line for *_, line in template.__code__.co_lines() if line is not None)
    assert first <= min(lines)
    assert max(lines) <= last
    assert made.__name__ == made.__qualname__ == "template_flat"
    assert made.__doc__ == template.__doc__
    assert made.__module__ == template.__module__


@pytest.mark.parametrize(
    ("template_", "match"),
    [
        (keyword_template, "clamp is spliced only where each of its parameters is passed positionally"),
        (early_return_template, "two_returns cannot be spliced: its only return must be its last statement"),
        (assigned_nothing_template, "bump returns nothing, but its result is assigned"),
    ],
)
def test_a_call_that_cannot_be_spliced_is_refused_by_name(template_: types.FunctionType, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        spliced(template_, name="refused", callees=HERE)


def test_a_global_a_callee_reads_that_the_template_binds_otherwise_is_refused() -> None:
    scoped = types.FunctionType(template.__code__, {**vars(HERE), "SCALE": 4}, "template")
    with pytest.raises(ValueError, match="the global 'SCALE' of a callee is another object here"):
        spliced(scoped, name="refused", callees=HERE, constants={"DEBUG": False})


@pytest.mark.parametrize("kernel", ["alloc_short", "free_short", "free_p1_short", "free_pn_short"])
def test_the_short_kernels_call_nothing_the_run_kernels_define(kernel: str) -> None:
    """Flat: what they share with the run kernels is spliced in, so each compiles as one unit."""
    made = getattr(_kernels, kernel, None) or getattr(_flat, kernel)
    py_func = getattr(made, "py_func", made)
    defined = {
        name
        for name, value in vars(_run_kernels).items()
        if getattr(getattr(value, "py_func", value), "__module__", None) == _run_kernels.__name__
    }
    assert defined, "the run kernels' module defines functions"
    assert not set(py_func.__code__.co_names) & defined


def test_the_flat_module_is_what_the_tool_writes_from_todays_templates() -> None:
    """A change to a template or a helper it splices is not in the short kernels until ``python -m tests.flatten``."""
    assert OUTPUT.read_text() == module_text(), "run: python -m tests.flatten"
