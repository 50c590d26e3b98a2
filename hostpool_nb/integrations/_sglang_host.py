"""sglang's HiCache host pools (the ``HostKVCache`` family) keeping their free slots in hostpool_nb.

sglang builds a host pool per model family (MHA, MLA, the DSA indexer,
MiniMax, Mamba state, DeepSeek V4's paged pools), each a subclass of
``HostKVCache``, most inheriting its bookkeeping, two with their own
(docs/behaviour.md, section 5). Replacing the classes where sglang looks
them up would miss the subclasses already defined, so ``install()``
replaces the bookkeeping methods themselves, on the three classes that
define them: every subclass that inherits them, defined before the call or
after, then keeps its books here. Everything else of the engine's pool
(buffers, layouts, transfers, attributes) is untouched.

Each pool built while installed gets, at its constructor's ``clear()``, a
:class:`HostKVBooks` (``hostpool_nb.torch.LogicalHostPool`` with sglang's
exception types) under the attribute ``_hostpool_nb``, holding the pool's
own ``self.lock``. A pool built before ``install()`` keeps the original
bookkeeping (its own lists); ``uninstall()`` hands each pool that has books
back its lists, so it goes on under the original methods. :func:`books`
gives the books of a pool, for ``check_invariants()``, ``leak_report()``
and the rest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import _errors, _fork
from .._convert import as_count, as_slots
from .._diagnostics.tracking import ENV_OFF, ENV_ON
from .._kernels import layout as _layout
from ..torch import LogicalHostPool as _TorchPool
from ..torch import _check_tensor_dtype, _tensor_as_numpy, _tensor_count
from ._sglang_books import BOOKKEEPINGS, DEEPSEEK_V4_PAGED, DOUBLE_FREES, HOST_KV_CACHE, Bookkeeping

_log = logging.getLogger("hostpool_nb")
_Tensor = torch.Tensor
_INT64 = np.dtype(np.int64)

#: The attribute of an engine's pool that holds its books.
KEY = "_hostpool_nb"


def accepts_double_frees_by_default() -> bool:
    """Whether :data:`DOUBLE_FREES` asks pools whose original checks no free to accept double frees.

    Read as ``HOSTPOOL_NB_TRACK`` is (the same words mean the same), plus
    ``accept`` and ``refuse``; anything else is refused, not read as off.
    """
    value = os.environ.get(DOUBLE_FREES, "")
    word = value.strip().lower()
    if word in ("accept", *ENV_ON):
        return True
    if word in ("refuse", *ENV_OFF):
        return False
    raise _errors.HostPoolError(
        f"{DOUBLE_FREES} must be accept or refuse (or 1/0, true/false, yes/no, on/off), got {DOUBLE_FREES}={value!r}"
    )


def trace_kind(bookkeeping: Bookkeeping) -> str:
    """The pool kind a trace of these books names (one of ``hostpool_nb.trace.HOST_KV_BOOKS``)."""
    return "HostKVBooks/" + bookkeeping.defined_by.removesuffix("PoolHost").removesuffix("HostPool")


def replayed(kind: str, size: int, page_size: int, strict: bool) -> HostKVBooks:
    """Books of a trace's pool ``kind``, for replay: its bookkeeping, double frees refused where ``strict``."""
    for bookkeeping in BOOKKEEPINGS:
        if trace_kind(bookkeeping) == kind:
            return HostKVBooks(size, page_size, bookkeeping=bookkeeping, accept_double_frees=not strict)
    raise _errors.HostPoolError(f"no bookkeeping of sglang's is recorded as {kind!r}")


class HostKVBooks(_TorchPool):
    """The free-slot books of one of sglang's host pools: :class:`hostpool_nb.torch.LogicalHostPool`, sglang's errors.

    Every check of the torch pool, raised before anything changes, with
    the exception types code written against sglang catches: a partial
    page in ``alloc`` is a :class:`~hostpool_nb.HostKVAlignmentError` (an
    ``AssertionError``, as sglang's ``assert``), a double free a
    :class:`~hostpool_nb.HostKVDoubleFreeError` (likewise), a slot out of
    range or negative a :class:`~hostpool_nb.HostKVSlotRangeError` (an
    ``IndexError``, as torch raises for sglang). ``free`` takes 1-D input
    only (sglang counts a 2-D tensor's rows), and an empty tensor of any
    dtype frees nothing, as sglang's does.

    ``accept_double_frees`` (only where the original checks no free: the
    Mamba and DeepSeek V4 paged pools): a free that names slots already
    free, or a slot twice, frees the others and returns the length given,
    as the original returns; the slots already free stay free once (the
    original would list them twice and hand them out twice). The first such
    free of a pool logs a WARNING.
    """

    def __init__(self, size: int, page_size: int, *, bookkeeping: Bookkeeping, accept_double_frees: bool) -> None:
        self.bookkeeping = bookkeeping
        self.accept_double_frees = accept_double_frees  # checked before anything is built
        super().__init__(size, page_size)
        self._warned = False
        self._caller: tuple[Any, Any] | None = None

    @property
    def accept_double_frees(self) -> bool:
        """Whether a free naming slots already free frees the others, as the original does (not only refused)."""
        return self._accepts

    @accept_double_frees.setter
    def accept_double_frees(self, value: bool) -> None:
        if type(value) is not bool:
            raise TypeError(f"accept_double_frees must be a bool, got {type(value).__name__} {value!r}")
        if value and self.bookkeeping.checks_frees:
            raise _errors.HostPoolError(
                "accept_double_frees=True is only for pools whose original accepts double frees; "
                f"{self.bookkeeping.defined_by}'s refuses them (an AssertionError)"
            )
        self._accepts = value

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "bookkeeping": self.bookkeeping, "accept_double_frees": self._accepts}

    def _trace_shape(self) -> dict[str, Any]:
        return {**super()._trace_shape(), "pool": trace_kind(self.bookkeeping), "strict": not self._accepts}

    def __setstate__(self, saved: Any) -> None:
        fields = dict(saved) if isinstance(saved, dict) else {}
        self.bookkeeping = fields.pop("bookkeeping", HOST_KV_CACHE)
        self._accepts = False
        self.accept_double_frees = fields.pop("accept_double_frees", False)  # checked against the bookkeeping
        self._warned = False
        self._caller = None
        super().__setstate__(fields if isinstance(saved, dict) else saved)

    def _alloc_misaligned(self, need_size: int) -> _errors.AlignmentError:
        return _errors.HostKVAlignmentError(
            "The requested size should be a multiple of the page size: "
            f"need_size={need_size}, page_size={self.page_size}"
        )

    def _free_error(self, status: int, slots: Any) -> Exception:
        if self._caller is not None:  # a free of the pages left once double frees are accepted: the caller's place
            code, pos = _layout.decode_status(status)
            caller, kept = self._caller
            ps = self.page_size
            status, slots = _layout.status_for(code, int(kept[pos // ps]) * ps + pos % ps), caller
        error = super()._free_error(status, slots)
        if isinstance(error, _errors.DoubleFreeError):
            return _errors.HostKVDoubleFreeError(f"Double-free detected: {error}")
        if isinstance(error, _errors.SlotRangeError):
            return _errors.HostKVSlotRangeError(str(error))
        return error

    def free(self, indices: Any) -> int:
        """``hostpool_nb.torch.LogicalHostPool.free``, 1-D input only; double frees accepted where asked.

        Parameters
        ----------
        indices : torch.Tensor or array_like of int
            Slot ids, 1-D: whole pages, each in ascending order.

        Returns
        -------
        int
            The number of slots freed (with double frees accepted, the
            number given).
        """
        if (type(indices) is not _Tensor or indices.dim() != 1) and nothing_to_free(indices):
            return 0
        try:
            return super().free(indices)
        except _errors.HostKVDoubleFreeError:
            if not self._accepts:
                raise
        except _errors.SlotRangeError as exc:  # one the reading of the slots raised (uint64 past int64): sglang's type
            if isinstance(exc, _errors.HostKVSlotRangeError):
                raise
            raise _errors.HostKVSlotRangeError(str(exc)) from None
        except TypeError:
            if isinstance(indices, _Tensor) and indices.numel() == 0:
                return 0  # an empty tensor of any dtype frees nothing, as sglang's free returns
            raise
        return self._free_accepting(indices)

    def _free_accepting(self, indices: Any) -> int:
        """A free whose pages already free (or named twice) are left out, the others freed; the length given."""
        # One read of the caller's array, into a copy of ours: the filter, the free and any error all use it.
        slots = np.array(as_slots(_tensor_as_numpy(indices) if isinstance(indices, _Tensor) else indices))
        ps = self.page_size
        with self.lock:
            if slots.shape[0] % ps:  # not whole pages: the free says so
                return super().free(slots)
            chunks = slots.reshape(-1, ps)
            pages = chunks[:, 0] // ps
            listed = (pages >= 0) & (pages < self.size // ps)
            held = np.zeros(pages.shape[0], dtype=bool)
            held[listed] = self._owner[pages[listed]] == _layout.OWNER_ALLOCATED
            first = np.zeros(pages.shape[0], dtype=bool)
            first[np.unique(pages, return_index=True)[1]] = True
            whole = (chunks == chunks[:, :1] - chunks[:, :1] % ps + np.arange(ps)).all(axis=1)
            keep = (held & first) | ~listed | ~whole  # only double frees are left out: the free refuses the rest
            self._caller = (slots, np.flatnonzero(keep))  # an error names the caller's entry (_free_error)
            try:
                super().free(chunks[keep].reshape(-1))
            finally:
                self._caller = None
            if not self._warned:
                self._warned = True
                _log.warning(
                    "hostpool_nb: a %s accepted a double free of %d slots (as sglang's own bookkeeping does; "
                    "they stay free once): a bug in the caller. Further ones are accepted silently.",
                    self.bookkeeping.defined_by,
                    (~keep).sum() * ps,
                )
        return int(slots.shape[0])

    def hand_back(self) -> dict[str, Any]:
        """The original bookkeeping's lists for this state: what ``uninstall()`` gives the engine's pool back.

        The free list in the order allocation takes it (the release list
        already merged into it: the same order), and which slots are in use.
        """
        with self.lock:  # read, not copied: a copy would be a new pool (HOSTPOOL_NB_RECORD would record it)
            free, released, _ = _layout.lists_of(self._st)
        ps = self.page_size
        pages = torch.from_numpy(np.concatenate([free, released]))
        order = (pages[:, None] * ps + torch.arange(ps)).reshape(-1)
        used = torch.ones(self.size, dtype=torch.bool)
        used[order] = False
        return {"free_slots": order, "slot_used": used}

    def give_back(self, pool: Any) -> None:
        """Set the engine's ``pool`` up to go on under sglang's own methods, from this state (under the lock)."""
        lists = self.hand_back()
        pool.free_slots = lists["free_slots"]
        pool.release_slots = []
        pool.num_release_slots = 0
        if self.bookkeeping.checks_frees:
            pool.slot_used = lists["slot_used"]
        if self.bookkeeping is not DEEPSEEK_V4_PAGED:
            pool.mem_state = torch.zeros((self.size,), dtype=torch.uint8, device=getattr(pool, "device", "cpu"))


_live: weakref.WeakSet[Any] = weakref.WeakSet()  # the engine's pools that have books
_live_lock = threading.Lock()
_taking = False  # installed: a pool built now gets books (methods() sets it, hand_back_all() clears it)
_UNLOCKED = contextlib.nullcontext()


def _held(pool: Any) -> Any:
    """The pool's lock to hold while its books are read: a pool with books has an RLock; another needs none."""
    lock = pool.__dict__.get("lock")
    return lock if type(lock) is _RLOCK else _UNLOCKED


def nothing_to_free(indices: Any) -> bool:
    """Whether ``indices`` is an empty tensor (any dtype: sglang frees nothing); 2-D or more: ``HostPoolError``."""
    if isinstance(indices, _Tensor):
        if indices.numel() == 0:
            return True
        shape = tuple(indices.shape)
    else:
        try:
            shape = np.shape(indices)
        except (ValueError, TypeError):  # ragged: the pool says what is wrong with it
            return False
    if len(shape) > 1:  # a scalar goes on to the pool's TypeError
        raise _errors.HostPoolError(
            f"indices must be 1-D, got shape {shape}: sglang's host pools count a 2-D input's rows, not its "
            "slots; flatten it first"
        )
    return False


def one_d_slots(indices: Any) -> Any:
    """A free's or a translation's ``indices`` as the core reads them: a 1-D tensor viewed as numpy (a device one
    copied), an array as given; ``None`` for an empty tensor of any dtype (sglang's do nothing with it)."""
    if type(indices) is _Tensor:  # the hot path: a plain CPU int64 tensor, viewed
        try:
            arr = indices.numpy()
        except (RuntimeError, TypeError):
            arr = None
        if arr is not None and arr.ndim == 1 and arr.dtype is _INT64 and arr.shape[0]:
            return arr
    if nothing_to_free(indices):  # the family's check: an empty tensor frees nothing, 2-D or more is refused
        return None
    if isinstance(indices, _Tensor):
        try:
            arr = indices.numpy()  # a plain CPU tensor: a view, which the pool copies
        except (RuntimeError, TypeError):  # another device, a dtype numpy lacks, ...
            arr = _tensor_as_numpy(indices)
        if arr.dtype is not _INT64:
            _check_tensor_dtype(indices.dtype)
        return arr
    return indices


def lock_of(pool: Any) -> Any:
    """The lock to hold while a facade's books are read: the one it reads through to its wrapped pool (an RLock)."""
    lock = getattr(pool, "lock", None)
    return lock if type(lock) is _RLOCK else _UNLOCKED


def own_books(pool: Any) -> Any:
    """The books the engine's ``pool`` holds itself (not ones a facade reads through to its wrapped pool), or None."""
    return getattr(pool, "__dict__", {}).get(KEY)


def books(pool: Any) -> Any:
    """The hostpool_nb books of one of sglang's host pools built after ``install()``.

    For the diagnostics of :class:`hostpool_nb.LogicalHostPool`:
    ``check_invariants()``, ``leak_report()`` and ``outstanding()`` (with
    ``HOSTPOOL_NB_TRACK=1``), ``recording()``, ``stats()``. A unified host
    pool's books are its shared backing's (an ``EnvelopePagePool``), a
    page-interleaved pool's an ``InterleavedPagePool``.

    Raises
    ------
    HostPoolError
        If ``pool`` keeps its own books: not one of sglang's host pools,
        or one built before ``install()``.
    """
    found = own_books(pool)
    if found is None:  # a unified host pool: its books are the backing's it shares with its other side
        backing = getattr(pool, "__dict__", {}).get("_shared_backing")
        found = None if backing is None else own_books(backing)
    if found is None:
        raise _errors.HostPoolError(
            f"{type(pool).__name__} keeps its own books: hostpool_nb keeps those of sglang's host pools built "
            "after hostpool_nb.integrations.sglang.install()"
        )
    return found


_RLOCK = type(threading.RLock())


def _keep_books(
    pool: Any, bookkeeping: Bookkeeping, announce: Callable[[Any, HostKVBooks], None]
) -> HostKVBooks | None:
    """Give the engine's ``pool`` its books (its constructor's first ``clear()``), sharing the pool's lock.

    ``None`` if ``uninstall()`` began meanwhile: the pool keeps its own lists (the caller clears them).
    """
    size, page_size = bookkeeping.geometry(pool)
    accepts = accepts_double_frees_by_default()  # read for every pool: a value it cannot mean is refused everywhere
    kept = HostKVBooks(
        size, page_size, bookkeeping=bookkeeping, accept_double_frees=accepts and not bookkeeping.checks_frees
    )
    return kept if keep_books(pool, kept, announce) is not None else None


def keep_books(pool: Any, kept: Any, announce: Callable[[Any, Any], None]) -> Any:
    """Attach ``kept`` (books built for ``pool``) to the engine's pool, sharing its lock; ``None`` if uninstalling."""
    lock = getattr(pool, "lock", None)  # a facade's reads through to the pool it wraps: one lock for both
    if type(lock) is _RLOCK:
        kept.lock = lock  # the engine's own lock: a caller holding it holds the books too
    else:
        pool.lock = kept.lock
    with _live_lock:  # in one hold with uninstall()'s hand-back: the pool is handed back, or never gets books
        if not _taking:
            return None
        _fork.follow(pool, "lock", kept)  # a fork that leaves the books' lock unusable in a child, leaves this one
        setattr(pool, KEY, kept)
        _live.add(pool)
    announce(pool, kept)
    return kept


def start_taking() -> None:
    """Installed: the pools built from now on get books (until ``hand_back_all()``)."""
    global _taking  # noqa: PLW0603 - the one switch install() and uninstall() share
    _taking = True


def methods(
    bookkeeping: Bookkeeping, originals: dict[str, Callable[..., Any]], announce: Callable[[Any, HostKVBooks], None]
) -> dict[str, Callable[..., Any]]:
    """hostpool_nb's versions of ``bookkeeping.methods``, for the class that defines them.

    ``originals``: that class's own, which a pool built before ``install()``
    (it has its own lists) goes on using.
    """
    original_clear = originals["clear"]
    rounds_up = bookkeeping.rounds_up
    start_taking()

    # Each method reads the pool's books holding the pool's lock, which the books share: uninstall() hands them
    # back under it, so a call either finds them, or runs the original method on the lists handed back.

    def clear(self: Any) -> None:
        with _held(self):
            kept = self.__dict__.get(KEY)
            if kept is None:
                # The constructor's clear() while installed: the pool's books start here. Else its own lists:
                # built before install(), or after uninstall() began.
                if "free_slots" in vars(self) or _keep_books(self, bookkeeping, announce) is None:
                    original_clear(self)
                return
            kept.clear()

    def available_size(self: Any) -> Any:
        with _held(self):
            kept = self.__dict__.get(KEY)
            return originals["available_size"](self) if kept is None else kept.available_size()

    def _merge_release_slots(self: Any) -> None:
        with _held(self):
            kept = self.__dict__.get(KEY)
            if kept is None:
                originals["_merge_release_slots"](self)
            else:
                kept.merge()

    if rounds_up:

        def alloc(self: Any, need_size: Any) -> Any:
            with _held(self):
                kept = self.__dict__.get(KEY)
                if kept is None:
                    return originals["alloc"](self, need_size)
                if type(need_size) is not int:  # a 0-d tensor or a numpy integer: checked first
                    need_size = (
                        _tensor_count(need_size) if isinstance(need_size, _Tensor) else as_count(need_size, "need_size")
                    )
                ps = kept.page_size
                return kept.alloc((need_size + ps - 1) // ps * ps)  # up, as the original rounds (negative: refused)

    else:

        def alloc(self: Any, need_size: Any) -> Any:
            with _held(self):
                kept = self.__dict__.get(KEY)
                return originals["alloc"](self, need_size) if kept is None else kept.alloc(need_size)

    def free(self: Any, indices: Any) -> Any:
        with _held(self):
            kept = self.__dict__.get(KEY)
            return originals["free"](self, indices) if kept is None else kept.free(indices)

    mine: dict[str, Callable[..., Any]] = {
        "clear": clear,
        "available_size": available_size,
        "_merge_release_slots": _merge_release_slots,
        "alloc": alloc,
        "free": free,
    }
    made = {}
    for name in bookkeeping.methods:
        fn = mine[name]
        fn.__qualname__ = f"{bookkeeping.defined_by}.{name}"
        fn.__doc__ = f"hostpool_nb's {name} of sglang's {bookkeeping.defined_by} (hostpool_nb.integrations.sglang)."
        made[name] = fn
    return made


def take_over(classes: dict[str, type], announce: Callable[[Any, HostKVBooks], None] | None = None) -> None:
    """Replace the bookkeeping methods on ``classes`` (by sglang's class names) as ``install()`` does on the engine's:
    for the tests' and the bench's own copies of the hierarchy."""
    for b in BOOKKEEPINGS:
        cls = classes[b.defined_by]
        own = {name: vars(cls)[name] for name in b.methods}
        for name, fn in methods(b, own, announce or (lambda pool, kept: None)).items():
            setattr(cls, name, fn)


def hand_back_all() -> int:
    """Give every engine pool with books its original lists back (``uninstall()``); how many pools.

    From here on no pool gets books (a pool built before the methods are put back keeps its own), and each
    pool is handed back under its lock, which the replaced methods hold while they read the books.
    """
    global _taking  # noqa: PLW0603 - uninstalling: no more books
    with _live_lock:
        _taking = False
        pools = list(_live)
        _live.clear()
    for pool in pools:
        kept = own_books(pool)
        if kept is None:
            continue
        with kept.lock:
            kept.give_back(pool)
            delattr(pool, KEY)
    return len(pools)


__all__ = [
    "KEY",
    "HostKVBooks",
    "accepts_double_frees_by_default",
    "books",
    "hand_back_all",
    "keep_books",
    "lock_of",
    "methods",
    "nothing_to_free",
    "one_d_slots",
    "own_books",
    "start_taking",
    "take_over",
]
