"""Exceptions raised by hostpool_nb, and the warning it issues.

Every caller mistake is a :class:`HostPoolError`, which is a ``ValueError``:
code written for sglang's pool (``except ValueError``) keeps working, and new
code can catch this package's errors specifically. Wrong argument types are
plain ``TypeError``. A ``RuntimeError`` means the pool's own state is broken,
which no sequence of public calls should be able to cause; the one
exception is :class:`PageStateError`, which keeps the ``RuntimeError`` that
sglang-jax's host pools raise for a double free, a pinned page and an
underflow.
"""

from __future__ import annotations


class HostPoolError(ValueError):
    """Base class of the pool's argument errors; a ``ValueError``."""


class AlignmentError(HostPoolError):
    """A size, an allocation or a free is not a whole number of pages."""


class PartialPageError(HostPoolError):
    """Freed slots are not whole pages, each in ascending order."""


class SlotRangeError(HostPoolError):
    """A freed slot (or a host page id) lies outside the pool."""


class DoubleFreeError(HostPoolError):
    """A freed page is not currently allocated.

    Raised for a page freed twice while it is still free (in two calls or
    within one), a page freed after ``clear()``, and a page that was never
    handed out.

    What it cannot catch: the pool knows whether each page is allocated now,
    not to whom. Once a freed page has been handed out again, freeing it a
    second time through a stale copy of the first owner's slots is a valid
    free of an allocated page: it is accepted, and releases the page under
    its new owner. Catching that would need a generation tag per
    allocation, carried by the caller; the pool keeps none.
    """


class PageStateError(HostPoolError, RuntimeError):
    """A host page is not in the state a call needs (``HostPagePool``).

    Both a :class:`HostPoolError` and a ``RuntimeError``: sglang-jax's host
    pools raise ``RuntimeError`` for these caller mistakes, so code written
    against them (``except RuntimeError``) keeps working, while new code can
    catch this package's errors as for every other pool.
    """


class PageDoubleFreeError(DoubleFreeError, PageStateError):
    """A host page freed or released while it is free (twice, or never handed out)."""


class StaleFreeError(PageDoubleFreeError):
    """A host page freed through a stale copy: it has been handed out again since.

    Raised when the caller passes the generations it got at allocation
    (``free(pages, generations=g)``, ``release(page, generation=g)``) and a
    page's generation has moved on: freeing it would release the page
    under its new owner.
    """


class PinnedPageError(PageStateError):
    """A pinned host page (``lock_ref > 0``) freed or released."""


class PageNotAllocatedError(PageStateError):
    """A pin count changed on a host page that is free."""


class LockRefUnderflowError(PageStateError):
    """``dec_lock_ref`` of a host page that is not pinned."""


class PoolForkedError(RuntimeError):
    """A pool used in a child process that was forked while another thread was using it.

    Its state may be half-written (the fork copied the process in the
    middle of that thread's call), so every call on it in the child raises
    this, rather than hang on the copied lock or act on a broken state.
    Make a new pool in the child, or fork before other threads use the
    pool. See :mod:`hostpool_nb._fork`.
    """


class KernelCacheWarning(UserWarning):
    """The kernels could not use numba's on-disk cache and were compiled in memory.

    Not an error: the pool works the same, but every start compiles the
    kernels again (about 10 s). The message says how to get the cache back.
    Issued at most once per process.
    """


__all__ = [
    "AlignmentError",
    "DoubleFreeError",
    "HostPoolError",
    "KernelCacheWarning",
    "LockRefUnderflowError",
    "PageDoubleFreeError",
    "PageNotAllocatedError",
    "PageStateError",
    "PartialPageError",
    "PinnedPageError",
    "PoolForkedError",
    "SlotRangeError",
    "StaleFreeError",
]
