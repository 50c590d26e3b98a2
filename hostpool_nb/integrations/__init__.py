"""Swap hostpool_nb into a running engine from outside its source: one call before the engine starts.

::

    from hostpool_nb.integrations import sgl_jax
    sgl_jax.install()          # before sglang-jax builds its allocators and host pools

    from hostpool_nb.integrations import sglang
    sglang.install()           # before sglang builds its host pool (needs torch)

``install()`` puts hostpool_nb's classes where the engine looks its own up
(the module that defines them, and every module of the engine already
imported that imported them by name), and returns ``{"module.attribute":
original class}`` of what it replaced. It checks every class first and
replaces nothing unless all fit: an engine version whose classes differ
from what the integration knows is an :class:`IntegrationError` naming the
attribute. Calling it again changes nothing; ``uninstall()`` puts the
originals back. Each pool an engine then builds says so in one INFO line
on the ``hostpool_nb`` logger; :func:`status` lists what is installed.
"""

from ._patch import IntegrationError, Replacement, status

__all__ = ["IntegrationError", "Replacement", "status"]
