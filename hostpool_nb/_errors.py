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
    """Base class of the pool's argument errors; a ``ValueError``.

    Examples
    --------
    >>> from hostpool_nb import HostPoolError, LogicalHostPool
    >>> pool = LogicalHostPool(64, 16)
    >>> try:
    ...     pool.alloc(-16)
    ... except ValueError as error:  # sglang's except clauses still catch it
    ...     print(type(error).__name__, isinstance(error, HostPoolError))
    HostPoolError True
    """


class AlignmentError(HostPoolError):
    """A size, an allocation or a free is not a whole number of pages.

    Examples
    --------
    >>> from hostpool_nb import LogicalHostPool
    >>> LogicalHostPool(64, 16).alloc(8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hostpool_nb.AlignmentError: LogicalHostPool allocation must be page-aligned, ...
    """


class PartialPageError(HostPoolError):
    """Freed slots are not whole pages, each in ascending order.

    Examples
    --------
    >>> from hostpool_nb import LogicalHostPool
    >>> pool = LogicalHostPool(64, 16)
    >>> slots = pool.alloc(32)
    >>> pool.free(slots[8:24])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hostpool_nb.PartialPageError: free takes whole pages: indices[0] (flattened) ...
    """


class SlotRangeError(HostPoolError):
    """A freed slot (or a host page id) lies outside the pool.

    Examples
    --------
    >>> from hostpool_nb import LogicalHostPool
    >>> LogicalHostPool(64, 16).free(range(64, 80))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hostpool_nb.SlotRangeError: free got slot 64 at indices[0] ..., outside [0, 64)
    """


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

    Examples
    --------
    >>> from hostpool_nb import LogicalHostPool
    >>> pool = LogicalHostPool(64, 16)
    >>> slots = pool.alloc(16)
    >>> pool.free(slots)
    16
    >>> pool.free(slots)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hostpool_nb.DoubleFreeError: page 0 (slots 0..15), freed at indices[0] ...
    """


class PagedOnlyError(HostPoolError, NotImplementedError):
    """A call only a paged allocator serves, made on one at page size 1 (``alloc_extend``, ``alloc_decode``).

    Both a :class:`HostPoolError` and a ``NotImplementedError``: sglang-jax's
    token allocator raises ``NotImplementedError("alloc_extend is only for
    paged allocator")`` for these (its base class's methods), and its
    sliding-window allocator at page size 1 does the same through its
    token sub-allocators; code that catches that keeps working.

    Examples
    --------
    >>> from hostpool_nb.paged import TokenToKVPoolAllocator
    >>> alloc = TokenToKVPoolAllocator(16, None)
    >>> alloc.alloc_decode([2], [1])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hostpool_nb.PagedOnlyError: alloc_decode is only for paged allocator: ...
    """


class HostKVAlignmentError(AlignmentError, AssertionError):
    """An allocation from one of sglang's HiCache host pools that is not a whole number of (logical) pages.

    Both an :class:`AlignmentError` and an ``AssertionError``: sglang's
    ``HostKVCache.alloc`` checks the size with an ``assert``, whose text
    this error's message begins with; code that catches ``AssertionError``
    keeps working, and, unlike the ``assert``, the check does not vanish
    under ``python -O``. Raised only by the pools
    :mod:`hostpool_nb.integrations.sglang` keeps the books of.

    Examples
    --------
    Code written around sglang's ``assert`` still catches it:

    >>> from hostpool_nb import AlignmentError, HostKVAlignmentError
    >>> try:
    ...     raise HostKVAlignmentError("The requested size should be ...")
    ... except AssertionError as error:
    ...     print(isinstance(error, AlignmentError))
    True
    """


class HostKVDoubleFreeError(DoubleFreeError, AssertionError):
    """A free of one of sglang's HiCache host pools names a slot that is not allocated (or names one twice).

    Both a :class:`DoubleFreeError` and an ``AssertionError``, whose text
    (``Double-free detected: ...``) its message begins with: sglang's
    ``HostKVCache.free`` checks with an ``assert``. Raised for every pool
    :mod:`hostpool_nb.integrations.sglang` keeps the books of, the Mamba
    and DeepSeek V4 paged pools included, whose originals check nothing
    (``docs/sglang.md`` says how to accept those pools' double frees as
    the originals do).

    Examples
    --------
    >>> from hostpool_nb import HostKVDoubleFreeError
    >>> [base.__name__ for base in HostKVDoubleFreeError.__mro__[1:5]]
    ['DoubleFreeError', 'HostPoolError', 'ValueError', 'AssertionError']
    """


class HostKVArgumentError(HostPoolError, AssertionError):
    """A call of one of sglang's HiCache host pools that sglang refuses with an ``assert``, other than a size or a free.

    Both a :class:`HostPoolError` and an ``AssertionError``: an
    interleaved host pool's ``alloc`` without ``start_owner``, or of no
    pages, which sglang's ``assert``s refuse (and which, unlike them, this
    check keeps under ``python -O``).

    Examples
    --------
    >>> from hostpool_nb import HostKVArgumentError as E, HostPoolError
    >>> [issubclass(E, cls) for cls in (HostPoolError, AssertionError)]
    [True, True]
    """


class HostKVUnknownPoolError(HostPoolError, KeyError):
    """A call of sglang's unified host backing naming a side (a pool label) it does not have.

    Both a :class:`HostPoolError` (a ``ValueError``, which sglang's
    ``alloc`` raises) and a ``KeyError`` (which its ``free``, ``clear`` and
    the rest raise, from a dict).

    Examples
    --------
    >>> from hostpool_nb import HostKVUnknownPoolError as E
    >>> [issubclass(E, cls) for cls in (ValueError, KeyError)]
    [True, True]
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # a KeyError's str() would quote the message


class HostKVSlotRangeError(SlotRangeError, IndexError):
    """A free of one of sglang's HiCache host pools names a slot outside the pool, or a negative one.

    Both a :class:`SlotRangeError` and an ``IndexError``, which sglang's
    ``HostKVCache.free`` raises (from torch) for an id past the end; a
    negative id, which the original takes for one counted from the end,
    is refused too.

    Examples
    --------
    >>> from hostpool_nb import HostKVSlotRangeError as E, SlotRangeError
    >>> [issubclass(E, cls) for cls in (SlotRangeError, IndexError, AssertionError)]
    [True, True, False]
    """


class PageStateError(HostPoolError, RuntimeError):
    """A host page is not in the state a call needs (``HostPagePool``).

    Both a :class:`HostPoolError` and a ``RuntimeError``: sglang-jax's host
    pools raise ``RuntimeError`` for these caller mistakes, so code written
    against them (``except RuntimeError``) keeps working, while new code can
    catch this package's errors as for every other pool.

    Examples
    --------
    >>> from hostpool_nb import HostPagePool, PageStateError
    >>> pool = HostPagePool(4)
    >>> try:
    ...     pool.dec_lock_ref(0)  # a free page has no pins to take away
    ... except RuntimeError as error:  # as sglang-jax's host pools raise it
    ...     print(type(error).__name__, isinstance(error, PageStateError))
    PageNotAllocatedError True
    """


class PageDoubleFreeError(DoubleFreeError, PageStateError):
    """A host page freed or released while it is free (twice, or never handed out).

    Examples
    --------
    >>> from hostpool_nb import HostPagePool
    >>> pool = HostPagePool(4)
    >>> pool.release(2)
    Traceback (most recent call last):
    ...
    hostpool_nb.PageDoubleFreeError: double free of buffer_id=2
    """


class StaleFreeError(PageDoubleFreeError):
    """A host page freed through a stale copy: it has been handed out again since.

    Raised when the caller passes the generations it got at allocation
    (``free(pages, generations=g)``, ``release(page, generation=g)``) and a
    page's generation has moved on: freeing it would release the page
    under its new owner.

    Examples
    --------
    >>> from hostpool_nb import HostPagePool
    >>> pool = HostPagePool(1)
    >>> page = pool.reserve()
    >>> mine = int(pool.generation[page])
    >>> pool.release(page)
    >>> pool.reserve()  # handed out again: a new generation
    0
    >>> pool.release(page, generation=mine)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hostpool_nb.StaleFreeError: ...
    """


class PinnedPageError(PageStateError):
    """A pinned host page (``lock_ref > 0``) freed or released.

    Examples
    --------
    >>> from hostpool_nb import HostPagePool
    >>> pool = HostPagePool(4)
    >>> page = pool.reserve()
    >>> pool.inc_lock_ref(page)
    >>> pool.release(page)
    Traceback (most recent call last):
    ...
    hostpool_nb.PinnedPageError: release of locked buffer_id=0 (lock_ref=1)
    """


class PageNotAllocatedError(PageStateError):
    """A pin count changed on a host page that is free.

    Examples
    --------
    >>> from hostpool_nb import HostPagePool
    >>> HostPagePool(4).inc_lock_ref(1)
    Traceback (most recent call last):
    ...
    hostpool_nb.PageNotAllocatedError: buffer_id=1 is not allocated (in free-list)
    """


class LockRefUnderflowError(PageStateError):
    """``dec_lock_ref`` of a host page that is not pinned.

    Examples
    --------
    >>> from hostpool_nb import HostPagePool
    >>> pool = HostPagePool(4)
    >>> pool.dec_lock_ref(pool.reserve())
    Traceback (most recent call last):
    ...
    hostpool_nb.LockRefUnderflowError: dec_lock_ref underflow on buffer_id=0
    """


class PoolForkedError(RuntimeError):
    """A pool used in a child process that was forked while another thread was using it.

    Its state may be half-written (the fork copied the process in the
    middle of that thread's call), so every call on it in the child raises
    this, rather than hang on the copied lock or act on a broken state.
    Make a new pool in the child, or fork before other threads use the
    pool (docs/sglang.md, "Threads and fork").

    Examples
    --------
    A ``RuntimeError``, and not an argument error: the caller did nothing
    wrong in the child.

    >>> from hostpool_nb import HostPoolError, PoolForkedError
    >>> issubclass(PoolForkedError, RuntimeError)
    True
    >>> issubclass(PoolForkedError, HostPoolError)
    False
    """


class KernelCacheWarning(UserWarning):
    """The kernels could not use numba's on-disk cache and were compiled in memory.

    Not an error: the pool works the same, but every start compiles the
    kernels again (seconds). The message says how to get the cache back.
    Issued at most once per process.

    Examples
    --------
    A service that must not compile at start-up can make it an error:

    >>> import warnings
    >>> from hostpool_nb import KernelCacheWarning
    >>> warnings.simplefilter("error", KernelCacheWarning)
    >>> warnings.resetwarnings()
    """


# Tracebacks and reprs name the public path (hostpool_nb.DoubleFreeError), where every one is imported from.
for _cls in tuple(globals().values()):
    if isinstance(_cls, type) and _cls.__module__ == __name__:
        _cls.__module__ = "hostpool_nb"
del _cls
