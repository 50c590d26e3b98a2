"""``python -m tests.flatten`` writes ``hostpool_nb/_kernels/flat.py``: the short kernels, their callees spliced in.

A kernel that a new process compiles first (the short alloc and free) must
compile as one unit: numba compiles a callee as a unit of its own and links
it in again, and ``inline="always"`` types the inlined IR again, both
slower to compile (docs/architecture.md). So each is written once as a
template that calls the run kernels' helpers, and this tool writes the
flat kernel's source into the package, each call replaced by the callee's
body: a real file, stamped into the kernel cache, that tracebacks and
coverage read. ``tests/kernels/test_flat_kernels.py`` fails when the file
is not what this tool writes from today's templates.

A spliced callee is a function the module ``callees`` defines, whose only
``return`` is its last statement (or that has none), with no nested
function, ``global`` or ``nonlocal``, called positionally as a statement of
its own: ``x = f(...)``, ``x: int = f(...)``, ``a, b = f(...)``, ``f(...)``
or ``return f(...)``. Its locals are renamed for each call site, its
parameters bound to the arguments, and its return value assigned to the
call's target; its own calls of such functions are spliced too. A
condition that is a name of ``constants`` alone (``if _FLAG:``) is decided
while splicing: the branch not taken, and whatever it calls, never reaches
the output.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import itertools
import linecache
import sys
import textwrap
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

_F = TypeVar("_F", bound=Callable[..., Any])
_Node = TypeVar("_Node", bound=ast.AST)
_NOT_SPLICED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Global, ast.Nonlocal)


def splice(
    template: Any, *, name: str, callees: types.ModuleType, constants: Mapping[str, Any] | None = None
) -> tuple[ast.FunctionDef, dict[str, Any]]:
    """``template`` as ``name``, each statement calling a function of the module ``callees`` replaced by its body.

    Returns the function's tree and its globals: the template's module's,
    with each global a spliced callee reads from its own module, and
    ``constants``, which decide ``if NAME:`` statements. A name that two of
    them bind to different objects is a ``ValueError``, as is a callee that
    cannot be spliced. Line numbers are the template's: a spliced statement
    has its call's.
    """
    py_func = _py_func(template)
    _, fn = _source(py_func)
    ast.increment_lineno(fn, py_func.__code__.co_firstlineno - 1)  # the file's lines, before anything is spliced
    splicer = _Splicer(callees, dict(constants or {}))
    fn.name = name
    fn.decorator_list = []
    fn.body = splicer.block(fn.body)
    namespace = dict(py_func.__globals__)
    for global_name, value in splicer.globals_read.items():
        if namespace.setdefault(global_name, value) is not value and global_name not in splicer.constants:
            raise ValueError(f"splicing into {name}: the global {global_name!r} of a callee is another object here")
    namespace.update(splicer.constants)
    return fn, namespace


def spliced(template: _F, *, name: str, callees: types.ModuleType, constants: Mapping[str, Any] | None = None) -> _F:
    """:func:`splice`'s function, made in memory: what the tests of splicing itself run."""
    py_func = _py_func(template)
    fn, namespace = splice(template, name=name, callees=callees, constants=constants)
    module = ast.Module(body=[fn], type_ignores=[])  # every node made here is given its line (_at)
    exec(compile(module, py_func.__code__.co_filename, "exec"), namespace)
    made = namespace[name]
    made.__module__ = py_func.__module__
    made.__qualname__ = name
    made.__doc__ = py_func.__doc__
    return cast("_F", made)


def _py_func(func: Any) -> Any:
    """The Python function of a numba dispatcher, or the function itself."""
    return getattr(func, "py_func", func)


def _source(py_func: types.FunctionType) -> tuple[str, ast.FunctionDef]:
    """A function's definition, dedented, and a tree of it: its lines to its code's last (``inspect`` tokenizes)."""
    code = py_func.__code__
    end = max(line for *_, line in code.co_lines() if line is not None)
    text = textwrap.dedent("".join(linecache.getlines(code.co_filename)[code.co_firstlineno - 1 : end]))
    try:
        return text, _definition(text, py_func.__name__)
    except SyntaxError:  # its last statement runs on past its code's last line
        text = textwrap.dedent(inspect.getsource(py_func))
        return text, _definition(text, py_func.__name__)


def _definition(text: str, name: str) -> ast.FunctionDef:
    """A fresh tree of a function's definition (each splice changes its own)."""
    fn = ast.parse(text).body[0]
    if not isinstance(fn, ast.FunctionDef):
        raise ValueError(f"{name} is not a plain function")
    return fn


@dataclass(frozen=True)
class _Callee:
    """What splicing needs of a callee, checked once: its source, parameters, locals and module's globals."""

    name: str
    text: str
    params: tuple[str, ...]
    local: frozenset[str]
    assigned: frozenset[str]  # the locals the body assigns to, parameters among them
    returns: bool
    module_globals: dict[str, Any]


@functools.cache
def _callee(py_func: types.FunctionType) -> _Callee:
    name = py_func.__name__
    text, fn = _source(py_func)
    args = fn.args
    if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs or args.defaults:
        raise ValueError(f"{name} cannot be spliced: it takes other than plain parameters")
    body = _body(fn)
    nodes = list(ast.walk(ast.Module(body=body, type_ignores=[])))
    returns = [n for n in nodes if isinstance(n, ast.Return)]
    if returns and (len(returns) > 1 or returns[0] is not body[-1]):
        raise ValueError(f"{name} cannot be spliced: its only return must be its last statement")
    if any(isinstance(n, _NOT_SPLICED) for n in nodes):
        raise ValueError(f"{name} cannot be spliced: it holds a function, global or nonlocal")
    params = tuple(a.arg for a in args.args)
    stored = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return _Callee(
        name, text, params, frozenset(stored | set(params)), frozenset(stored), bool(returns), py_func.__globals__
    )


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    """A definition's statements without its docstring."""
    first = fn.body[0]
    docstring = (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    )
    return fn.body[1:] if docstring else fn.body


class _Splicer:
    """The splicing of one template: its callees' module, the constants, and the globals the spliced code reads."""

    def __init__(self, callees: types.ModuleType, constants: dict[str, Any]) -> None:
        self.callees = callees
        self.constants = constants
        self.globals_read: dict[str, Any] = {}
        self.sites = itertools.count()

    def block(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for stmt in body:
            out += self.statement(stmt)
        return out

    def statement(self, stmt: ast.stmt) -> list[ast.stmt]:
        if isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Name) and stmt.test.id in self.constants:
            return self.block(stmt.body if self.constants[stmt.test.id] else stmt.orelse)
        call, target = _call_of(stmt)
        callee = None if call is None else self.callee(call)
        if call is not None and callee is not None:
            if not isinstance(stmt, ast.Return):
                return self.splice(callee, call, target, stmt)
            returned = f"_returned{next(self.sites)}"
            out = self.splice(callee, call, _at(ast.Name(id=returned, ctx=ast.Store()), stmt), stmt)
            return [*out, _at(ast.Return(value=_at(ast.Name(id=returned, ctx=ast.Load()), stmt)), stmt)]
        for field in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list) and inner:
                setattr(stmt, field, self.block(inner))
        return [stmt]

    def callee(self, call: ast.Call) -> _Callee | None:
        """The callee ``call`` calls, if it is one of the module's functions."""
        if not isinstance(call.func, ast.Name):
            return None
        func = _py_func(getattr(self.callees, call.func.id, None))
        if not isinstance(func, types.FunctionType) or func.__module__ != self.callees.__name__:
            return None
        return _callee(func)

    def splice(self, callee: _Callee, call: ast.Call, target: ast.expr | None, at: ast.stmt) -> list[ast.stmt]:
        """The statements that do what ``at`` (which calls ``callee``) did, each at its line."""
        if call.keywords or len(call.args) != len(callee.params) or any(isinstance(a, ast.Starred) for a in call.args):
            raise ValueError(f"{callee.name} is spliced only where each of its parameters is passed positionally")
        if target is not None and not callee.returns:
            raise ValueError(f"{callee.name} returns nothing, but its result is assigned")
        prefix = f"_{callee.name}{next(self.sites)}_"
        # A parameter the body never assigns, given a name or a constant, is that name or constant in the body:
        # fewer variables for numba to type. Any other is bound to its argument first.
        passed = {
            p: arg
            for p, arg in zip(callee.params, call.args, strict=True)
            if p not in callee.assigned and isinstance(arg, (ast.Name, ast.Constant))
        }
        renamer = _Renamer(callee, prefix, at, passed)
        body = [renamer.visit(stmt) for stmt in _body(_definition(callee.text, callee.name))]
        for global_name in renamer.globals_read & callee.module_globals.keys():
            self.globals_read[global_name] = callee.module_globals[global_name]
        bound = [
            _at(ast.Assign(targets=[_at(ast.Name(id=prefix + p, ctx=ast.Store()), at)], value=arg), at)
            for p, arg in zip(callee.params, call.args, strict=True)
            if p not in passed
        ]
        tail: list[ast.stmt] = []
        if callee.returns:
            result = body.pop()  # the renamed ``return``
            value = result.value if isinstance(result, ast.Return) else None
            if target is not None and value is not None:
                tail = [_at(ast.Assign(targets=[t], value=v), at) for t, v in _pairs(target, value)]
            elif value is not None:
                tail = [_at(ast.Expr(value=value), at)]  # unused, but computed as the call would
        return self.block(bound + body) + tail


def _pairs(target: ast.expr, value: ast.expr) -> list[tuple[ast.expr, ast.expr]]:
    """``a, b = x, y`` as ``a = x`` and ``b = y`` where no value reads a target: no tuple for numba to type."""
    if not (isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts)):
        return [(target, value)]
    written = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    if any(isinstance(n, ast.Name) and n.id in written for n in ast.walk(value)) or any(
        isinstance(e, ast.Starred) for e in (*target.elts, *value.elts)
    ):
        return [(target, value)]
    return list(zip(target.elts, value.elts, strict=True))


def _at(node: _Node, at: ast.AST) -> _Node:
    """``node`` at ``at``'s line and columns."""
    return ast.copy_location(node, at)


def _call_of(stmt: ast.stmt) -> tuple[ast.Call | None, ast.expr | None]:
    """The call a statement is, and the target it assigns (``None``: an expression or a ``return``)."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.value, ast.Call):
        return stmt.value, stmt.targets[0]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.value, ast.Call):
        return stmt.value, stmt.target
    if isinstance(stmt, (ast.Expr, ast.Return)) and isinstance(stmt.value, ast.Call):
        return stmt.value, None
    return None, None


class _Renamer(ast.NodeTransformer):
    """Prefixes a callee's locals (or puts the arguments passed for them) and puts every node at the call's line."""

    def __init__(self, callee: _Callee, prefix: str, at: ast.stmt, passed: Mapping[str, ast.expr]) -> None:
        self.local = callee.local
        self.prefix = prefix
        self.at = at
        self.passed = passed
        self.globals_read: set[str] = set()

    def visit(self, node: ast.AST) -> Any:
        if "lineno" in node._attributes:
            _at(node, self.at)
        return super().visit(node)

    def visit_Name(self, node: ast.Name) -> ast.expr:
        arg = self.passed.get(node.id)
        if isinstance(arg, ast.Name):
            return _at(ast.Name(id=arg.id, ctx=ast.Load()), self.at)
        if isinstance(arg, ast.Constant):
            return _at(ast.Constant(value=arg.value), self.at)
        if node.id in self.local:
            return _at(ast.Name(id=self.prefix + node.id, ctx=node.ctx), self.at)
        self.globals_read.add(node.id)
        return node


# -- the package's flat kernels ---------------------------------------------
OUTPUT = Path(__file__).resolve().parent.parent / "hostpool_nb" / "_kernels" / "flat.py"
# (kernel, template's module, template, the constants splicing decides)
FLAT = (
    ("alloc_short", "hostpool_nb._kernels.pool", "alloc_pages", {"_LONE_STRETCHES": False}),
    ("free_short", "hostpool_nb._kernels.short", "_free_short", {"_WHOLE_BLOCKS": False, "_WORD_FLAGS": False}),
)
# Where a global of the flat kernels is imported from: the first of these that binds it to the same object.
HOMES = (
    "hostpool_nb._kernels.layout",
    "hostpool_nb._kernels.jit",
    "hostpool_nb._kernels.runs",
    "hostpool_nb._kernels.short",
)
_TYPING = {"np": "import numpy as np", "NDArray": "from numpy.typing import NDArray"}

HEADER = '''"""The short kernels, flat: written by ``python -m tests.flatten`` from their templates. Do not edit.

``alloc_short`` is ``_kernels.pool.alloc_pages`` and ``free_short`` is ``_kernels.short._free_short``, each call of
a run kernels' helper replaced by the helper's body, so that each compiles as one unit (tests/flatten.py says
why). ``_kernels.pool`` compiles them.
"""
'''


def _free_names(fn: ast.FunctionDef) -> list[str]:
    """The globals a function reads, in order of first reading."""
    not_global = {a.arg for a in fn.args.args} | set(vars(builtins))
    not_global |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    names: dict[str, None] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in not_global:
            names[n.id] = None
    return list(names)


_MISSING = object()


def module_text() -> str:
    """The source of ``hostpool_nb/_kernels/flat.py`` as the templates make it today."""
    from hostpool_nb._kernels import runs

    functions, imports, typing = [], {}, set()
    for name, module_name, template_name, constants in FLAT:
        template = getattr(importlib.import_module(module_name), template_name)
        fn, namespace = splice(template, name=name, callees=runs, constants=constants)
        doc = (_py_func(template).__doc__ or "").strip().splitlines()[0]
        fn.body = [ast.Expr(value=ast.Constant(value=doc)), *_body(fn)]  # the template's summary line only
        for global_name in _free_names(fn):
            if global_name in _TYPING:
                typing.add(_TYPING[global_name])
                continue
            value = namespace[global_name]
            home = next((h for h in HOMES if getattr(importlib.import_module(h), global_name, _MISSING) is value), None)
            if home is None:
                raise ValueError(f"{name} reads {global_name!r}, which none of {HOMES} binds")
            imports.setdefault(home, set()).add(global_name)
        functions.append(ast.unparse(ast.fix_missing_locations(fn)))
    lines = [HEADER, "from __future__ import annotations", ""]
    lines += [*sorted(typing, key=lambda line: line.startswith("from")), ""]
    for home, names in imports.items():
        relative = "." + home.rsplit(".", 1)[1]
        lines += [f"from {relative} import (", *(f"    {n}," for n in sorted(names)), ")"]
    text = "\n".join(lines) + "\n"
    for function in functions:
        text += "\n\n" + function + "\n"
    return text


# What flat.py holds while the package cannot import the one written last (it names a helper's global since gone).
_STUB = "def alloc_short(st, out):\n    return 0\n\n\ndef free_short(st, slots):\n    return 0\n"


def main() -> int:
    """Write the flat kernels' module; exit status 0."""
    try:
        text = module_text()
    except ImportError:  # the package imports flat.py: from a stub it imports again, once; a second failure is raised
        OUTPUT.write_text(_STUB)
        for name in [m for m in sys.modules if m == "hostpool_nb" or m.startswith("hostpool_nb.")]:
            del sys.modules[name]
        text = module_text()
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
