"""Drop-ins for sglang-jax's device KV-cache allocators, on Numba kernels.

``PagedTokenToKVPoolAllocator`` and ``TokenToKVPoolAllocator`` take the
arguments, return the values (with their dtypes) and allocate in the order
of the numpy allocators of sglang-jax (JAX serving), for every call those
handle correctly (``docs/behaviour.md`` section 3), and raise a
:class:`~hostpool_nb.HostPoolError` (a ``ValueError``), before changing
anything, for the calls they get silently wrong: slots of the padding page
0 or beyond the rank, a ``dp_rank`` outside ``[0, dp_size)``, a misaligned
``alloc``, batch arguments of different lengths, negative lengths,
``seq_lens < prefix_lens``, a wrong ``extend_num_tokens``, ``debug_mode``
violations, and a token allocator's double free.

Costs: ``free`` is O(its input), whatever the free list holds (the original
de-duplicates and set-subtracts against the whole free list); a merge is
O(pages) with no comparison sort; ``alloc_extend`` and ``alloc_decode`` are
one kernel call for the whole batch. Lists are accepted wherever the
original takes them; numpy int64 arrays are read without a conversion and
are faster.

Importing this module imports neither torch nor jax; a jax array passed in
is read through ``numpy.asarray``. Use::

    from hostpool_nb.paged import PagedTokenToKVPoolAllocator  # instead of sgl_jax's

Where docs/behaviour.md (section 3) leaves a choice, this module takes the one below (and
``hostpool_nb.originals.paged``, the oracle, the same where it applies):

- Free groups do not nest and ``free_group_end()`` outside one does
  nothing, as the original's flag. A free inside a group is checked at
  the call and fixes then which pages it frees (those allocated at that
  moment); the original evaluates it at the group's end. Both agree unless
  a page that was free at the call is handed out again before the end,
  which the original would then free under its new owner.
- ``clear(r)`` resets rank ``r`` (its pending frees too) and leaves the
  group; other ranks' pending frees stay pending until the next
  ``free_group_end()``. Snapshots hold the lists, not the group.
- ``free`` returns the number of pages freed (the original returns
  ``None``); ``alloc(0)`` returns an empty array; ``free_pages``,
  ``release_pages`` and ``free_slots`` are read-only int32 copies, the
  release list's order not being part of the contract.
- An allocator pickles and deep-copies with every rank, the open free
  group and its pending frees, and its ``kvcache`` (pickled or copied as
  pickle and ``copy.deepcopy`` do, with it); a damaged pickle is a
  ``HostPoolError``, checked as ``restore_state`` checks a snapshot.
- ``alloc_decode`` requires ``seq_lens >= 1`` (they count the new token);
  a pool whose slot ids would not fit the int32 results is refused at
  construction.
- As the original, a ``size`` that is not a whole number of pages for every
  rank leaves the rest unused (``PagedTokenToKVPoolAllocator(size=1000,
  page_size=16, ...)`` serves 62 pages, 992 slots); the allocator's
  ``repr`` says how many slots of ``size`` are in no page. (The host pool,
  whose original refuses such a size, refuses it.)
- The three derive from :class:`BaseTokenToKVPoolAllocator`, as sglang-jax's
  from its base of that name, and offer what it gives them; where the
  original's inherited method fails (``merge_and_sort_free`` on the token
  and sliding-window allocators), it does what its name says.
"""

from __future__ import annotations

from .._core.host import HostPagePool
from .._diagnostics.snapshot import PagedState, SWAState
from ._allocators import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from ._base import BaseTokenToKVPoolAllocator
from ._host import HostKVPoolMixin
from ._swa import SWATokenToKVPoolAllocator

# help(), reprs, tracebacks and pickles name the public path, where each is imported from.
for _cls in (
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    SWATokenToKVPoolAllocator,
    HostKVPoolMixin,
    PagedState,
    SWAState,
):
    _cls.__module__ = __name__
del _cls

__all__ = [
    "BaseTokenToKVPoolAllocator",
    "HostKVPoolMixin",
    "HostPagePool",
    "PagedState",
    "PagedTokenToKVPoolAllocator",
    "SWAState",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
]
