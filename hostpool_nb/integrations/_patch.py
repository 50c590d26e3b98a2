"""Putting classes where an engine looks them up, taking them back, and saying what is in place.

An engine names its classes in one module (``sgl_jax.srt.mem_cache.allocator``)
and other modules import them by name (``from ... import
PagedTokenToKVPoolAllocator``). ``install`` checks every target first (the
module imports, the attribute is a class, hostpool_nb's replacement offers
its whole public surface: ``_surface.py``) and changes nothing unless all
pass; then it sets each attribute, and the same attribute of every module
of the engine already imported that holds the original by name. Modules
imported later read the replaced attribute. ``uninstall`` puts back every
attribute that still holds what ``install`` put there.

A :class:`MethodsTarget` replaces methods of an engine class in place
instead, for a class whose subclasses the engine has already defined (they
would keep the original class as their base): each subclass that inherits
a method, defined before the call or after, then runs hostpool_nb's.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from ._surface import Parameters, parameters_of, surface_of, surface_problems

_log = logging.getLogger("hostpool_nb")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the hostpool_nb folder in use


class IntegrationError(ImportError):
    """The engine is not installed, or its classes are not what the integration expects: nothing was replaced.

    An ``ImportError``: like a failed ``from module import name``, it says
    that the engine does not provide what was asked of it, naming the
    module or attribute.

    Examples
    --------
    >>> from hostpool_nb.integrations import IntegrationError, sgl_jax
    >>> try:
    ...     sgl_jax.install()  # sglang-jax is not installed here
    ... except ImportError as error:
    ...     print(type(error).__name__, error.name)
    IntegrationError sgl_jax.srt.mem_cache.allocator
    """

    __module__ = "hostpool_nb.integrations"


@dataclass(frozen=True)
class Target:
    """One class an engine looks up: ``module.attribute``, and how to make hostpool_nb's stand-in for it.

    ``replacement(original)`` returns the class to put there; ``needs`` are
    members the original must have for that replacement to serve it (the
    host pools' mixin keeps the original's own methods and needs these).
    With ``surface=True`` the replacement must offer the original's whole
    public surface.
    """

    module: str
    attribute: str
    replacement: Callable[[type], type]
    needs: tuple[str, ...] = ()
    surface: bool = True

    @property
    def where(self) -> str:
        return f"{self.module}.{self.attribute}"


@dataclass(frozen=True)
class MethodsTarget:
    """Methods of one engine class, ``module.attribute``, replaced on the class itself.

    ``parameters``: each method, as the release hostpool_nb is tested with
    defines it on that class (not inherited), with its parameters; a method
    the class does not define, or defines with other parameters, is another
    release's, and ``install()`` refuses it. ``replacement(cls, originals)``
    returns hostpool_nb's methods, given the class's own by name.
    """

    module: str
    attribute: str
    parameters: Mapping[str, Parameters]
    replacement: Callable[[type, dict[str, Any]], dict[str, Any]]

    @property
    def where(self) -> str:
        return f"{self.module}.{self.attribute}"


@dataclass(frozen=True)
class _Planned:
    """A target checked: on ``holder`` (a module, or a class for methods), attribute -> (original, replacement)."""

    target: Target | MethodsTarget
    holder: Any
    swaps: dict[str, tuple[Any, Any]]

    def where(self, attribute: str) -> str:
        if isinstance(self.target, MethodsTarget):
            return f"{self.target.where}.{attribute}"
        return self.target.where


@dataclass(frozen=True)
class Replacement:
    """An attribute ``install`` set: ``where`` (``module.attribute``) held ``original``, now ``replacement``.

    Examples
    --------
    >>> from hostpool_nb.integrations import sgl_jax, status
    >>> from hostpool_nb.originals.engines import stand_in_engine
    >>> with stand_in_engine("sgl_jax"):
    ...     replaced = sgl_jax.install()
    ...     first = status()[0]
    >>> first.where
    'sgl_jax.srt.mem_cache.allocator.TokenToKVPoolAllocator'
    >>> first.original.__module__, first.replacement.__module__
    ('hostpool_nb.originals.paged', 'hostpool_nb.integrations.sgl_jax')
    """

    __module__ = "hostpool_nb.integrations"

    engine: str
    where: str
    original: Any  # a class, or a function for a method replaced on its class
    replacement: Any
    # The class a method was replaced on; None for a module's attribute (looked up by name, as it may be unloaded).
    holder: Any = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        mine = f"{self.replacement.__module__}.{self.replacement.__qualname__}"
        return f"{self.engine}: {self.where} -> {mine}"


_SAID = 5  # problems an error names; the rest are "..."
_LOCK = threading.Lock()
_INSTALLED: dict[str, list[Replacement]] = {}


def _import(engine: str, module: str, how: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise IntegrationError(
            f"{engine} is not importable here: import {module} failed ({error}); install the release hostpool_nb "
            f"is tested with first ({how}), or try the stand-in engine "
            f"(hostpool_nb.originals.engines.stand_in_engine({engine!r}))",
            name=module,
        ) from error


def _planned(
    engine: str, targets: tuple[Target | MethodsTarget, ...], how: str, ours: dict[str, Replacement]
) -> list[_Planned]:
    """Every target checked, its replacement made; an ``IntegrationError`` naming the first that does not fit.

    ``ours``: the replacements an earlier install put in place and that are
    still there; each is planned as its original, which it will be again.
    """
    plan = []
    for target in targets:
        module = _import(engine, target.module, how)
        original = getattr(module, target.attribute, None)
        earlier = ours.get(target.where)
        if earlier is not None and original is earlier.replacement:
            original = earlier.original
        if not isinstance(original, type):
            what = "missing" if original is None else f"a {type(original).__name__}, not a class"
            raise IntegrationError(
                f"{engine}: {target.where} is {what}; this version of {engine} is not one hostpool_nb's "
                f"integration knows (help(hostpool_nb.integrations.{engine}) says which were tested). "
                "Nothing was replaced.",
                name=target.module,
            )
        if isinstance(target, MethodsTarget):
            plan.append(_planned_methods(engine, target, original, ours))
            continue
        if original.__module__.startswith(__package__ + "."):
            raise IntegrationError(
                f"{engine}: {target.where} holds hostpool_nb's {original.__qualname__} already, put there by "
                "another copy of hostpool_nb's integrations: uninstall it there first. Nothing was replaced.",
                name=target.module,
            )
        for need in target.needs:
            if not hasattr(original, need):
                raise IntegrationError(
                    f"{engine}: {target.where}.{need} is missing, which hostpool_nb's replacement needs. "
                    "Nothing was replaced.",
                    name=target.module,
                )
        replacement = target.replacement(original)
        if target.surface:
            problems = surface_problems(surface_of(original), surface_of(replacement), target.where)
            if problems:
                raise IntegrationError(
                    f"{engine}: hostpool_nb's {replacement.__qualname__} does not offer what {target.where} does: "
                    + "; ".join(problems[:_SAID])
                    + ("; ..." if len(problems) > _SAID else "")
                    + ". Nothing was replaced.",
                    name=target.module,
                )
        plan.append(_Planned(target, module, {target.attribute: (original, replacement)}))
    return plan


def _planned_methods(engine: str, target: MethodsTarget, cls: type, ours: dict[str, Replacement]) -> _Planned:
    """The methods of ``cls`` checked against the release the target pins, and hostpool_nb's made from them."""
    originals = {}
    for name, pinned in target.parameters.items():
        where = f"{target.where}.{name}"
        current = vars(cls).get(name)
        earlier = ours.get(where)
        if earlier is not None and current is earlier.replacement:
            current = earlier.original
        problem = None
        if current is None:
            problem = "is not defined there (inherited or missing)"
        elif not callable(current):
            problem = f"is a {type(current).__name__}, not a method"
        elif getattr(current, "__module__", "").startswith(__package__ + "."):
            problem = "is hostpool_nb's already, put there by another copy of hostpool_nb's integrations"
        else:
            theirs = parameters_of(current)
            if theirs != pinned:
                found = pinned.problems(theirs) or theirs.problems(pinned) or ["its parameters differ"]
                problem = "takes other parameters than the release tested: " + "; ".join(found)
        if problem is not None:
            raise IntegrationError(
                f"{engine}: {where} {problem}; this version of {engine} is not one hostpool_nb's integration "
                f"knows (help(hostpool_nb.integrations.{engine}) says which were tested). Nothing was replaced.",
                name=target.module,
            )
        originals[name] = current
    made = target.replacement(cls, dict(originals))
    swaps = {}
    for name, mine in made.items():
        problems = target.parameters[name].problems(parameters_of(mine))
        if problems:  # hostpool_nb's own mistake: said before anything changes
            raise IntegrationError(
                f"{engine}: hostpool_nb's {target.where}.{name} does not take what the original does: "
                + "; ".join(problems)
                + ". Nothing was replaced.",
                name=target.module,
            )
        swaps[name] = (originals[name], mine)
    return _Planned(target, cls, swaps)


def install(engine: str, package: str, targets: tuple[Target | MethodsTarget, ...], how: str) -> dict[str, Any]:
    """Replace ``targets`` (and the engine's by-name imports of them); ``{where: original}`` of what was replaced.

    Installed already: nothing changes and the same mapping is returned.
    ``how``: how to install the engine release the integration is tested
    with, for the error when it is missing.
    """
    with _LOCK:
        done = _INSTALLED.get(engine)
        if done is not None and all(_in_place(r) for r in done):
            return {r.where: r.original for r in done}
        # Some were replaced or unloaded since: install afresh over what is there, the rest put back first. The
        # plan comes first, as if they were back: a refused install changes nothing.
        earlier = {r.where: r.original for r in done} if done is not None else {}
        plan = _planned(engine, targets, how, {r.where: r for r in done or () if _in_place(r)})
        _restore(engine)
        replaced: list[Replacement] = []
        originals: dict[int, type] = {}
        for planned in plan:
            methods = isinstance(planned.target, MethodsTarget)
            for attribute, (original, replacement) in planned.swaps.items():
                setattr(planned.holder, attribute, replacement)
                where = planned.where(attribute)
                replaced.append(Replacement(engine, where, original, replacement, planned.holder if methods else None))
                if methods:
                    continue
                originals[id(original)] = replacement
                if where in earlier:  # what the engine's modules imported by name before another patch
                    originals.setdefault(id(earlier[where]), replacement)
        defining = {t.module for t in targets if isinstance(t, Target)}
        replaced += _rebind_imported_names(engine, package, originals, defining)
        _INSTALLED[engine] = replaced
        return {r.where: r.original for r in replaced}


def _rebind_imported_names(
    engine: str, package: str, originals: dict[int, type], defining: set[str]
) -> list[Replacement]:
    """The engine's modules imported so far that hold an original by name, pointed at its replacement."""
    found = []
    for name, module in list(sys.modules.items()):
        if name in defining or not (name == package or name.startswith(package + ".")):
            continue
        attributes = getattr(module, "__dict__", None)  # None where an import is blocked (sys.modules[name] = None)
        for attribute, value in list((attributes or {}).items()):
            replacement = originals.get(id(value)) if isinstance(value, type) else None
            if replacement is not None:
                setattr(module, attribute, replacement)
                found.append(Replacement(engine, f"{name}.{attribute}", value, replacement))
    return found


def _in_place(r: Replacement) -> bool:
    """Whether ``r``'s attribute still holds its replacement (on its class, or in its module, which is loaded)."""
    holder_name, _, attribute = r.where.rpartition(".")
    if r.holder is not None:
        return vars(r.holder).get(attribute) is r.replacement
    module = sys.modules.get(holder_name)
    return module is not None and getattr(module, attribute, None) is r.replacement


def _restore(engine: str) -> dict[str, Any]:
    """Under the lock: the originals back where ``engine``'s replacements still are; what was put back."""
    restored = {}
    for r in _INSTALLED.pop(engine, []):
        if _in_place(r):
            holder_name, _, attribute = r.where.rpartition(".")
            setattr(r.holder if r.holder is not None else sys.modules[holder_name], attribute, r.original)
            restored[r.where] = r.original
    return restored


def uninstall(engine: str) -> dict[str, Any]:
    """Put back what ``install`` replaced, where it is still in place; ``{where: original}`` of what was put back."""
    with _LOCK:
        return _restore(engine)


def status() -> list[Replacement]:
    """Every attribute the integrations replaced that still holds hostpool_nb's class, engine by engine.

    Examples
    --------
    >>> from hostpool_nb.integrations import sgl_jax, status
    >>> from hostpool_nb.originals.engines import stand_in_engine
    >>> status()  # nothing installed
    []
    >>> with stand_in_engine("sgl_jax"):
    ...     _ = sgl_jax.install()
    ...     first = status()[0]
    >>> first.where.rpartition(".")[2], first.replacement.__module__
    ('TokenToKVPoolAllocator', 'hostpool_nb.integrations.sgl_jax')
    >>> status()  # the stand-in's end uninstalled it
    []
    """
    with _LOCK:
        return [r for replaced in _INSTALLED.values() for r in replaced if _in_place(r)]


def log_in_use(engine: str, what: str, pool: Any) -> None:
    """Load every kernel ``pool`` may call, then log the one INFO line an engine's pool logs when it is built.

    The kernels load while the engine starts, so its first requests wait
    for none (``hostpool_nb.warmup.load``); the line says how long it took.
    """
    from ..warmup import load  # noqa: PLC0415 - a module of its own, for its command line

    took = load(pool)
    count = len(pool._kernel_calls())
    _log.info(
        "hostpool_nb in use: %s builds %s; %d kernels loaded in %.0f ms (hostpool_nb %s from %s)",
        engine,
        what,
        count,
        took * 1e3,
        __version__,
        _PACKAGE,  # which copy: a clone's source can shadow the installed package
    )


def announcing(base: type, engine: str, describe: Callable[[Any], str], module: str, name: str | None = None) -> type:
    """A subclass of ``base`` that logs one INFO line when it is constructed: that hostpool_nb is in use, and how.

    Named as ``base`` (or ``name``) and defined in ``module``, the
    integration's, where the caller binds it: so it pickles by reference.
    Its ``__init__`` wraps ``base``'s (the same signature, as
    ``inspect.signature`` reads it).
    """

    init: Any = vars(base).get("__init__") or getattr(base, "__init__")  # noqa: B009 - the class's own, as wrapped

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        log_in_use(engine, describe(self), self)

    made = type(name or base.__name__, (base,), {"__init__": __init__, "__doc__": base.__doc__, "__module__": module})
    made.__qualname__ = made.__name__
    return made
