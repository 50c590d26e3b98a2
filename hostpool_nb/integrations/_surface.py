"""A class's public surface, and whether a stand-in offers all of it: from live classes or from source.

An integration puts hostpool_nb's class where an engine looks its own class
up, so every call the engine makes must still be valid: each public method,
property and class attribute of the engine's class must exist on
hostpool_nb's, each method taking the same positional parameters (names,
order, defaults) and the same keyword-only ones. hostpool_nb's may take
more, if they are optional. The same comparison serves ``install()``, on the
engine's imported class, and the check of a release's source that is not
imported (:func:`surface_of_source`).
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from typing import Any

NO_DEFAULT = "<required>"


@dataclass(frozen=True)
class Parameters:
    """A method's parameters, ``self`` left out: ``(name, default)`` pairs, defaults as ``repr`` text."""

    positional: tuple[tuple[str, str], ...]
    keyword_only: tuple[tuple[str, str], ...]
    var_positional: bool
    var_keyword: bool

    def problems(self, mine: Parameters) -> list[str]:
        """Why a call valid against these parameters might not be against ``mine`` (empty: none)."""
        if mine.var_positional and mine.var_keyword:
            return []  # takes anything; it passes everything on
        found = self._positional_problems(mine) + self._keyword_problems(mine)
        if self.var_positional and not mine.var_positional:
            found.append("*args is not taken")
        if self.var_keyword and not mine.var_keyword:
            found.append("**kwargs is not taken")
        return found

    def _positional_problems(self, mine: Parameters) -> list[str]:
        found = []
        for i, (name, default) in enumerate(self.positional):
            if i >= len(mine.positional):
                if not mine.var_positional:
                    found.append(f"positional parameter {i} ({name}) is missing")
                continue
            own_name, own_default = mine.positional[i]
            if own_name != name:
                found.append(f"positional parameter {i} is {own_name!r}, not {name!r}")
            elif own_default != default:
                found.append(f"parameter {name!r} defaults to {own_default}, not {default}")
        found.extend(
            f"positional parameter {name!r} is required, which a caller does not pass"
            for name, default in mine.positional[len(self.positional) :]
            if default == NO_DEFAULT
        )
        return found

    def _keyword_problems(self, mine: Parameters) -> list[str]:
        found = []
        own = dict(mine.keyword_only) | dict(mine.positional)  # a positional parameter takes a keyword too
        for name, default in self.keyword_only:
            if name not in own:
                if not mine.var_keyword:
                    found.append(f"keyword-only parameter {name!r} is missing")
            elif own[name] != default:
                found.append(f"parameter {name!r} defaults to {own[name]}, not {default}")
        theirs = dict(self.keyword_only)
        found.extend(
            f"keyword-only parameter {name!r} is required, which a caller does not pass"
            for name, default in mine.keyword_only
            if default == NO_DEFAULT and name not in theirs
        )
        return found


# What a public name is: a method (its parameters), or anything else (a property, a class attribute).
Surface = dict[str, Parameters | None]


def _default_text(value: Any) -> str:
    return NO_DEFAULT if value is inspect.Parameter.empty else repr(value)


def parameters_of(function: Any) -> Parameters:
    """The parameters of a live function or method (its first, ``self``, left out)."""
    params = list(inspect.signature(function, follow_wrapped=True).parameters.values())
    if params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]
    kinds = inspect.Parameter
    return Parameters(
        positional=tuple(
            (p.name, _default_text(p.default))
            for p in params
            if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
        ),
        keyword_only=tuple((p.name, _default_text(p.default)) for p in params if p.kind is kinds.KEYWORD_ONLY),
        var_positional=any(p.kind is kinds.VAR_POSITIONAL for p in params),
        var_keyword=any(p.kind is kinds.VAR_KEYWORD for p in params),
    )


def surface_of(cls: type) -> Surface:
    """The public names a class defines or inherits (not ``object``'s), each method with its parameters."""
    found: Surface = {}
    for klass in reversed(cls.__mro__[:-1]):  # object's last: later classes override earlier ones
        for name, value in vars(klass).items():
            if name.startswith("_") and name != "__init__":
                continue
            function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            found[name] = parameters_of(function) if inspect.isfunction(function) else None
    return found


def _literal_text(node: ast.expr | None) -> str:
    if node is None:
        return NO_DEFAULT
    return repr(ast.literal_eval(node))


def _parameters_of_def(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Parameters:
    args = node.args
    every = [*args.posonlyargs, *args.args]  # defaults belong to the last of these
    defaults: list[ast.expr | None] = [None] * (len(every) - len(args.defaults)) + list(args.defaults)
    return Parameters(
        positional=tuple((a.arg, _literal_text(d)) for a, d in zip(every[1:], defaults[1:], strict=True)),  # no self
        keyword_only=tuple((a.arg, _literal_text(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)),
        var_positional=args.vararg is not None,
        var_keyword=args.kwarg is not None,
    )


# Bases a class may name that add no public member a caller could use.
_PLAIN_BASES = frozenset({"object", "abc.ABC", "ABC", "typing.Protocol", "Protocol", "typing.Generic", "Generic"})


def _classes_of(source: str, class_name: str) -> list[ast.ClassDef]:
    """Class ``class_name`` of ``source`` and every base it has there, bases first (later ones override).

    A base that is neither defined in the source nor one of the plain ones
    (``abc.ABC``, ``object``, ``Generic``...) is a ``LookupError``: its
    members would go unseen.
    """
    tree = ast.parse(source)
    defined = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if class_name not in defined:
        raise LookupError(f"no class {class_name} in the source")
    ordered: list[ast.ClassDef] = []

    def visit(node: ast.ClassDef) -> None:
        for base in reversed(node.bases):  # the first base overrides the later ones
            name = ast.unparse(base).split("[")[0]
            if name in defined:
                visit(defined[name])
            elif name not in _PLAIN_BASES:
                raise LookupError(f"class {node.name} derives from {name}, which the source does not define")
        if node not in ordered:
            ordered.append(node)

    visit(defined[class_name])
    return ordered


def surface_of_source(source: str, class_name: str) -> Surface:
    """The public surface of class ``class_name`` as ``source`` defines it, read with ``ast``, never imported.

    Methods (``property`` getters included, as names), class attributes
    (plain and annotated) and ``__init__``, the class's own and those of
    its bases defined in the same source (a subclass's overriding its
    base's). A base the source does not define, other than ``abc.ABC``,
    ``object`` and the like, is a ``LookupError``.
    """
    found: Surface = {}
    for node in _classes_of(source, class_name):
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if item.name.startswith("_") and item.name != "__init__":
                    continue
                decorators = {ast.unparse(d) for d in item.decorator_list}
                is_attribute = bool(decorators & {"property", "functools.cached_property", "cached_property"})
                found[item.name] = None if is_attribute else _parameters_of_def(item)
            elif isinstance(item, ast.Assign):
                for target in item.targets:
                    if isinstance(target, ast.Name) and not target.id.startswith("_"):
                        found[target.id] = None
            elif (
                isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and not item.target.id.startswith("_")
            ):
                found[item.target.id] = None
    return found


def own_methods_of_source(source: str, class_name: str) -> dict[str, Parameters]:
    """The methods class ``class_name`` of ``source`` defines itself (private ones too), whatever its bases."""
    tree = ast.parse(source)
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    if not found:
        raise LookupError(f"no class {class_name} in the source")
    return {
        item.name: _parameters_of_def(item)
        for item in found[0].body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def methods_of_source(source: str, class_name: str) -> dict[str, Parameters]:
    """Every method class ``class_name`` of ``source`` defines or inherits there, private ones too, by name."""
    found: dict[str, Parameters] = {}
    for node in _classes_of(source, class_name):
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[item.name] = _parameters_of_def(item)
    return found


def attributes_set_in_init(source: str, class_name: str) -> set[str]:
    """Every ``self.name`` that class ``class_name``'s ``__init__`` (or an inherited one in ``source``) assigns."""
    names: set[str] = set()
    for node in _classes_of(source, class_name):
        for item in node.body:
            if not (isinstance(item, ast.FunctionDef) and item.name == "__init__"):
                continue
            for statement in ast.walk(item):
                if isinstance(statement, ast.Assign):
                    targets = statement.targets
                elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
                    targets = [statement.target]
                else:
                    continue
                names.update(
                    t.attr
                    for target in targets
                    for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                )
    return names


def surface_problems(theirs: Surface, mine: Surface, where: str) -> list[str]:
    """What of ``theirs`` ``mine`` lacks or takes otherwise, each naming ``where.name`` (empty: compatible)."""
    found = []
    for name, params in theirs.items():
        if name not in mine:
            found.append(f"{where}.{name} is missing")
            continue
        if params is None:
            continue
        own = mine[name]
        if own is None:
            found.append(f"{where}.{name} is not a method")
            continue
        found.extend(f"{where}.{name}: {problem}" for problem in params.problems(own))
    return found


__all__ = [
    "NO_DEFAULT",
    "Parameters",
    "Surface",
    "attributes_set_in_init",
    "methods_of_source",
    "own_methods_of_source",
    "parameters_of",
    "surface_of",
    "surface_of_source",
    "surface_problems",
]
