"""Start an engine's server with hostpool_nb installed: ``python -m hostpool_nb.serve sgl_jax.launch_server ...``.

The convention of ``ddtrace-run`` and ``opentelemetry-instrument``: the
first argument is the server's module, the rest are the server's own
arguments, unchanged. This process installs the engine's integration
(``hostpool_nb.integrations.sgl_jax`` or ``.sglang``, chosen by the
module's top package), then runs the module as ``__main__``. The engines
start their schedulers in spawned processes, which import this module
again as ``__mp_main__`` (it is the main module): there it installs the
same integration, named by :data:`ENGINE_ENV`, before the child unpickles
anything of the engine's.

Exit status 2, with one line on stderr, for a module of no engine
hostpool_nb knows, one that cannot be found, or an integration that cannot
install (the engine missing, or not the release it expects).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import sys
from typing import Any

#: The engines hostpool_nb installs into, by their top-level package.
ENGINES = {"sgl_jax": "hostpool_nb.integrations.sgl_jax", "sglang": "hostpool_nb.integrations.sglang"}
#: Set by the launching process for its children: the engine whose integration they install.
ENGINE_ENV = "HOSTPOOL_NB_SERVE_ENGINE"
PROG = "python -m hostpool_nb.serve"
USAGE = f"usage: {PROG} MODULE [ARGUMENTS ...]  (MODULE: sgl_jax.launch_server or sglang.launch_server)"


def _install(engine: str) -> Any:
    """Install ``engine``'s integration; what its ``install()`` returns."""
    return importlib.import_module(ENGINES[engine]).install()


def _refuse(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Install the integration of the engine ``argv[0]`` belongs to, then run that module as ``__main__``."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    module, rest = args[0], args[1:]
    engine = module.partition(".")[0]
    if engine not in ENGINES:
        return _refuse(f"{module!r} is not a module of an engine hostpool_nb installs into ({', '.join(ENGINES)})")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # its package is missing, or the name is not a module's
        found = None
    if found is None:
        return _refuse(f"no module named {module!r} here: is {engine} installed in this environment?")
    from .integrations import IntegrationError  # noqa: PLC0415 - after the cheap checks

    try:
        _install(engine)
    except IntegrationError as exc:
        return _refuse(str(exc))
    os.environ[ENGINE_ENV] = engine  # the engine's spawned processes install it too (below)
    sys.argv = [found.origin or module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=False)
    return 0


if __name__ == "__mp_main__" and os.environ.get(ENGINE_ENV) in ENGINES:  # a spawned child of the server
    _install(os.environ[ENGINE_ENV])

if __name__ == "__main__":
    sys.exit(main())
