"""``EnvelopePagePool``: two page sizes sharing one byte envelope (sglang's unified host pool), on kernels.

All state changes happen in the kernels of ``_kernels/envelope.py``; this
class checks arguments, holds the lock around the kernels, runs the
caller's compaction hooks between them, and turns status codes into
exceptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from .._convert import INT64, as_count, as_slots, own_slots, shown
from .._diagnostics.invariants import envelope_problems
from .._diagnostics.snapshot import EnvelopePageState, checked_envelope_words
from .._errors import AlignmentError, DoubleFreeError, HostPoolError, PartialPageError, SlotRangeError
from .._kernels import envelope as _kernels
from .._kernels import layout as _layout
from .._kernels import pool as _pool_kernels
from .._kernels.jit import Entries
from .protocol import ArrayStatePool

KERNELS = Entries(_kernels.KERNELS)
_CORE = Entries(_pool_kernels.POOL)  # load_state: checked words copied in
STATUS_SHORT = _layout.status_of(_layout.E_SHORT)
STATUS_COMPACT = _layout.status_of(_layout.E_COMPACT_FIRST)
empty = np.empty
array = np.array
GROWS = ("up", "down")


class Compactor(Protocol):
    """What an ``EnvelopePagePool`` calls around a compaction: the owner of the bytes its pages stand for."""

    def begin(self) -> None:
        """Before any page moves, or a side's pages are all let go by ``clear`` (sglang drains its transfers here)."""

    def move(self, name: str, sources: NDArray[np.int64], targets: NDArray[np.int64]) -> None:
        """Side ``name``'s physical pages ``sources[i]`` now live at ``targets[i]``: copy their bytes, in order."""

    def finish(self) -> None:
        """After every move (also when one raised)."""


class EnvelopePagePool(ArrayStatePool):
    """Pages of one or two sizes sharing one byte envelope, each side growing from its own end.

    Keeps the books sglang 0.5.23's ``_SharedPageEnvelopeHostBacking``
    keeps for its unified page-envelope host pools (hybrid sliding-window
    models), with the same results for every correct call. Each side,
    ``name: (page_size, page_bytes, grow)``, has ``total_bytes //
    page_bytes`` logical pages, handed out lowest first, each mapped to a
    physical page: the side's holes nearest its own end first, then the
    next page past its watermark (up from byte 0, or down from the top).
    When the sides' watermarks leave too small a gap for a request that
    the live pages leave room for, both sides are compacted towards their
    ends first: ``compactor`` (a :class:`Compactor`, or None) is told,
    moves the bytes, and logical ids never change;
    :meth:`translate_indices` gives a logical slot's physical slot.

    Unlike the original, a free checks all of its input before it changes
    anything, and ids out of range are refused by name.

    Parameters
    ----------
    total_bytes : int
        The envelope's size in bytes.
    sides : mapping of str to (int, int, str)
        One or two sides: ``name: (page_size, page_bytes, "up" | "down")``;
        two grow from opposite ends.

    Examples
    --------
    >>> from hostpool_nb import EnvelopePagePool
    >>> pool = EnvelopePagePool(64, {"full": (1, 8, "up"), "swa": (1, 16, "down")})
    >>> pool.alloc("full", 2).tolist(), pool.alloc("swa", 1).tolist()
    ([0, 1], [0])
    >>> pool.translate_indices("swa", [0]).tolist()  # the top page of 16 bytes
    [3]
    >>> pool.free_bytes(), pool.available_size("full"), pool.available_size("swa")
    (32, 4, 2)
    """

    __module__ = "hostpool_nb"  # its public path, where help(), reprs and pickles find it
    _kind = _format = "EnvelopePagePool"
    _state_class = EnvelopePageState
    compactor: Compactor | None = None

    def _kernel_calls(self) -> list[tuple[Any, str]]:
        return [(KERNELS, name) for name in _kernels.KERNELS._fields] + [(_CORE, "load_state")]

    def __init__(self, total_bytes: int, sides: Any) -> None:
        shape = _shape(total_bytes, sides)
        st = np.zeros(_layout.envelope_state_length(tuple(total_bytes // pb for _, _, pb, _ in shape[1])), INT64)
        st[_layout.EV_SIDES] = len(shape[1])
        base = _layout.EV_HEADER + _layout.EV_SIDE_WORDS * len(shape[1])
        down = [pb for _, _, pb, grow in shape[1] if grow == "down"]
        only = down[0] if down else shape[1][0][2]
        st[_layout.EV_ALLOCATABLE] = (total_bytes // only) * only
        for s, (_, ps, pb, grow) in enumerate(shape[1]):
            b = _layout.EV_HEADER + s * _layout.EV_SIDE_WORDS
            n = total_bytes // pb
            st[b + _layout.S_PAGE_SIZE] = ps
            st[b + _layout.S_PAGE_BYTES] = pb
            st[b + _layout.S_PAGE_NUM] = n
            st[b + _layout.S_DOWN] = grow == "down"
            st[b + _layout.S_BASE] = base
            base += _layout.envelope_words(n)
        self._setup(shape, st)
        for s in range(len(shape[1])):
            KERNELS.reset_side(st, s)
        st[_layout.EV_CLEARS] = 0  # the construction is not a clear() call

    def _setup(self, shape: tuple[int, tuple[tuple[str, int, int, str], ...]], st: NDArray[np.int64]) -> None:
        self.shape = shape
        self.total_bytes = shape[0]
        self._index = {name: s for s, (name, _, _, _) in enumerate(shape[1])}
        self._page_sizes = [ps for _, ps, _, _ in shape[1]]
        self._make_lock()
        self._st = st
        most = max(self.total_bytes // pb for _, _, pb, _ in shape[1])
        self._scratch = np.empty(2 * most + 2, INT64)  # a free's pages, two words each: at most every page passes
        self._plan = np.empty(2, INT64)  # a one-request allocation's plan
        self._moves = np.empty(3 * sum(self.total_bytes // pb for _, _, pb, _ in shape[1]), INT64)

    @property
    def sides(self) -> dict[str, tuple[int, int, str]]:
        """The sides by name, each ``(page_size, page_bytes, grow)``."""
        return {name: (ps, pb, grow) for name, ps, pb, grow in self.shape[1]}

    def page_num(self, name: str) -> int:
        """Side ``name``'s logical (and physical) pages: ``total_bytes // page_bytes``."""
        return self.total_bytes // self.sides[self._name(name)][1]

    # -- calls -----------------------------------------------------------------------------

    def alloc(self, name: str, need_size: int) -> NDArray[np.int64] | None:
        """``need_size`` slots (whole pages) of side ``name``; ``None`` (nothing taken) when they cannot fit."""
        s = self._index.get(name)
        if s is None or type(need_size) is not int or need_size < 0 or need_size % self._page_sizes[s]:
            got = self.alloc_many(((name, need_size),))  # its checks raise, naming what is wrong
            return None if got is None else got[0]
        out = empty(need_size, INT64)
        pages = need_size // self._page_sizes[s]
        with self.lock:  # one request: the pool's own plan array, filled and read under the lock
            plan = self._plan
            plan[0] = s
            plan[1] = pages
            status = KERNELS.alloc(self._st, plan, out)
            if status >= 0:
                return out
        if status == STATUS_SHORT:
            return None
        if status != STATUS_COMPACT:
            raise self._corrupt("alloc", status)
        # Again, compacting first, with a plan of its own: a compaction's wait lets other calls fill the pool's.
        return out if self._run(array((s, pages), INT64), out) else None

    def alloc_many(self, requests: Sequence[tuple[str, int]]) -> list[NDArray[np.int64]] | None:
        """Every request ``(name, need_size)`` at once, in order, or none (``None``), compacting first if that fits.

        Raises
        ------
        HostPoolError
            For a side this pool lacks.
        TypeError, AlignmentError
            For a size that is not an integer, or not whole pages (or negative).
        """
        plan, sizes = self._requests(requests)
        out = empty(sum(sizes), INT64)
        if not self._run(plan, out):
            return None
        if len(sizes) == 1:
            return [out]
        got, at = [], 0
        for size in sizes:
            got.append(out[at : at + size])
            at += size
        return got

    def can_fit_many_then(
        self, requests: Sequence[tuple[str, int]], following: Sequence[tuple[str, int]], *, empty: bool = False
    ) -> bool:
        """Whether ``requests`` and then ``following`` would fit (compacting as needed), changing nothing.

        ``empty``: as if the pool were empty.
        """
        first, then = self._pages(requests), self._pages(following)
        with self.lock:
            live, free = self._counts()
        if empty:
            live = [0] * len(live)
            free = [self.total_bytes // pb for _, _, pb, _ in self.shape[1]]
        if not self._fits(live, free, first):
            return False
        after = [a + b for a, b in zip(live, first, strict=True)]
        left = [a - b for a, b in zip(free, first, strict=True)]
        return self._fits(after, left, then)

    def free(self, name: str, indices: Any) -> int:
        """Free whole pages of side ``name``; each becomes a hole, and the holes at the watermark are given up.

        Raises
        ------
        AlignmentError, PartialPageError, SlotRangeError, DoubleFreeError
            If the slots are not whole pages, lie outside the side, or
            name a page not allocated (or one twice); nothing is freed.
        """
        s = self._index.get(name)
        if s is None:
            s = self._index[self._name(name)]  # raises, naming it
        return self._free(s, name, as_slots(indices))

    def _free(self, s: int, name: str, slots: NDArray[np.int64]) -> int:
        """``free`` of ``slots`` (C-contiguous int64; the kernel reads each slot once, so no copy) on side ``s``."""
        if slots.shape[0] == 0:
            return 0
        with self.lock:
            status: int = KERNELS.free(self._st, s, slots, self._scratch)
        if status >= 0:
            return status
        raise self._slot_error(name, status, slots, "free")

    def translate_indices(self, name: str, indices: Any) -> NDArray[np.int64]:
        """The physical slot of each logical slot of side ``name`` (whole pages, each allocated)."""
        s = self._index[self._name(name)]
        slots = own_slots(indices)
        out = np.empty(slots.shape[0], INT64)
        if slots.shape[0] == 0:
            return out
        with self.lock:
            status = KERNELS.translate(self._st, s, slots, out)
        if status >= 0:
            return out
        raise self._slot_error(name, status, slots, "translate_indices")

    def translate_index(self, name: str, index: int) -> int:
        """The physical slot of one logical slot of side ``name`` (its page allocated)."""
        index = as_count(index, "index")
        ps = self.sides[self._name(name)][0]
        first = index - index % ps
        return int(self.translate_indices(name, np.arange(first, first + ps))[index % ps])

    def available_size(self, name: str) -> int:
        """Slots side ``name`` can still get: its free logical pages, or the free bytes' worth, whichever is less."""
        s = self._index[self._name(name)]
        ps, pb, _ = self.sides[name]
        with self.lock:
            b = _layout.EV_HEADER + s * _layout.EV_SIDE_WORDS
            free_pages = int(self._st[b + _layout.S_FREE])
            left = self._free_bytes()
        return min(free_pages, left // pb) * ps

    def free_bytes(self) -> int:
        """Bytes of the envelope no side's live page holds."""
        with self.lock:
            return self._free_bytes()

    def clear(self, name: str) -> None:
        """Side ``name`` empty: every logical page free, its watermark at its end; the other side untouched."""
        s = self._index[self._name(name)]
        hooks = self.compactor
        with self.lock:
            if hooks is not None:
                hooks.begin()  # the bytes of the side's pages may still be in transfer: drained first
            try:
                KERNELS.reset_side(self._st, s)
            finally:
                if hooks is not None:
                    hooks.finish()

    def side_state(self, name: str) -> dict[str, Any]:
        """Side ``name``'s books as sglang's backing keeps them: ``free_extents`` (sorted half-open logical
        ranges), ``to_physical`` (logical -> physical page), ``holes`` (physical pages) and ``watermark``."""
        s = self._index[self._name(name)]
        b = _layout.EV_HEADER + s * _layout.EV_SIDE_WORDS
        with self.lock:
            head = self._st[b : b + _layout.EV_SIDE_WORDS].copy()
            n, base = int(head[_layout.S_PAGE_NUM]), int(head[_layout.S_BASE])
            to_d = self._st[base : base + n].copy()
            to_l = self._st[base + n : base + 2 * n].copy()
        down, mark = bool(head[_layout.S_DOWN]), int(head[_layout.S_MARK])
        physical = (n - 1 - to_d) if down else to_d
        live = np.flatnonzero(to_d >= 0)
        free = np.concatenate([[False], to_d == -1, [False]])
        edges = np.flatnonzero(free[1:] != free[:-1]).reshape(-1, 2)
        holes = np.flatnonzero((to_l == -1) & (np.arange(n) < mark))
        return {
            "free_extents": [(int(a), int(b)) for a, b in edges],
            "to_physical": dict(zip(live.tolist(), physical[live].tolist(), strict=True)),
            "holes": set(((n - 1 - holes) if down else holes).tolist()),
            "watermark": n - 1 - mark if down else mark,
        }

    # -- internals -------------------------------------------------------------------------

    def _name(self, name: Any) -> str:
        if name not in self._index:
            raise HostPoolError(f"no side {name!r}: this pool's sides are {list(self._index)}")
        return str(name)

    def _run(self, plan: NDArray[np.int64], out: NDArray[np.int64]) -> bool:
        """The allocation ``plan`` into ``out``, compacting first when it fits only that way; False when short."""
        with self.lock:
            status = KERNELS.alloc(self._st, plan, out)
            if status == STATUS_COMPACT:
                self._compact()
                status = KERNELS.alloc(self._st, plan, out)
        if status >= 0:
            return True
        if status == STATUS_SHORT:
            return False
        raise self._corrupt("alloc", status)

    def _requests(self, requests: Sequence[tuple[str, int]]) -> tuple[NDArray[np.int64], list[int]]:
        """The kernel's plan (side, pages, side, pages, ...) and each request's slots; checked first."""
        plan: list[int] = []
        sizes = []
        index = self._index
        for name, asked in requests:
            s = index.get(name)
            if s is None:
                s = index[self._name(name)]  # raises, naming it
            ps = self.shape[1][s][1]
            need = asked if type(asked) is int else as_count(asked, "need_size")
            if need < 0:
                raise HostPoolError(f"need_size must be non-negative, got {shown(need)} for {name!r}")
            if need % ps:
                raise AlignmentError(f"need_size must be a multiple of {name!r}'s page_size={ps}, got {shown(need)}")
            plan += (s, need // ps)
            sizes.append(need)
        return array(plan, INT64), sizes

    def _pages(self, requests: Sequence[tuple[str, int]]) -> list[int]:
        """Pages each side's requests ask for (checked as an allocation checks them)."""
        plan = self._requests(requests)[0].tolist()
        pages = [0] * len(self.shape[1])
        for i in range(0, len(plan), 2):
            pages[plan[i]] += plan[i + 1]
        return pages

    def _counts(self) -> tuple[list[int], list[int]]:
        live, free = [], []
        for s in range(len(self.shape[1])):
            b = _layout.EV_HEADER + s * _layout.EV_SIDE_WORDS
            live.append(int(self._st[b + _layout.S_LIVE]))
            free.append(int(self._st[b + _layout.S_FREE]))
        return live, free

    def _fits(self, live: list[int], free: list[int], want: list[int]) -> bool:
        used = 0
        for s, (_, _, pb, _) in enumerate(self.shape[1]):
            if want[s] > free[s]:
                return False
            used += (live[s] + want[s]) * pb
        return used <= int(self._st[_layout.EV_ALLOCATABLE])

    def _free_bytes(self) -> int:
        live = self._counts()[0]
        used = sum(n * pb for n, (_, _, pb, _) in zip(live, self.shape[1], strict=True))
        return int(self._st[_layout.EV_ALLOCATABLE]) - used

    def _compact(self) -> None:
        """Compact both sides (under the lock), the compactor told before, between and after."""
        hooks = self.compactor
        if hooks is not None:
            hooks.begin()  # may raise (sglang's, while this thread holds a layout lease): nothing has moved
        try:
            count = KERNELS.compact(self._st, self._moves)
            if hooks is not None and count:
                moves = self._moves[: 3 * count].reshape(count, 3)
                for s, (name, _, _, _) in enumerate(self.shape[1]):
                    mine = moves[moves[:, 0] == s]
                    if mine.shape[0]:
                        hooks.move(name, mine[:, 1].copy(), mine[:, 2].copy())
        finally:
            if hooks is not None:
                hooks.finish()

    def _slot_error(self, name: str, status: int, slots: NDArray[np.int64], op: str) -> Exception:
        code, pos = _layout.decode_status(status)
        ps = self.sides[name][0]
        if code == _layout.E_LENGTH:
            return AlignmentError(f"{op} takes whole pages of {name!r}: got {slots.shape[0]} slots, page_size={ps}")
        slot = int(slots[pos])
        if code == _layout.E_RANGE:
            limit = self.page_num(name) * ps
            return SlotRangeError(f"{op} got slot {slot} at indices[{pos}], outside {name!r}'s [0, {limit})")
        if code in (_layout.E_MISALIGNED, _layout.E_PARTIAL):
            return PartialPageError(
                f"{op} takes whole pages: indices[{pos}] is slot {slot}; each run of {ps} entries must be one "
                f"page's slots in ascending order"
            )
        if code == _layout.E_DUPLICATE:
            return DoubleFreeError(f"page {slot // ps} of {name!r} is named twice in one call (at indices[{pos}])")
        if code == _layout.E_NOT_ALLOCATED:
            return DoubleFreeError(f"page {slot // ps} of {name!r}, at indices[{pos}], is not allocated")
        return self._corrupt(op, status)

    # -- the protocol ----------------------------------------------------------------------

    def _corruption(self) -> str | None:
        found = envelope_problems(self._st, self.shape)
        return "EnvelopePagePool state is corrupted: " + "; ".join(found) if found else None

    def _snapshot(self) -> EnvelopePageState:
        return EnvelopePageState(self.shape, self._st)

    def _checked(self, state: EnvelopePageState) -> NDArray[np.int64]:
        if state.shape != self.shape:
            raise HostPoolError(f"the state is from a pool of shape {state.shape}; this one is {self.shape}")
        return checked_envelope_words(state._words, self.shape, "the state")

    def _load(self, checked: NDArray[np.int64]) -> None:
        _CORE.load_state(self._st, checked, 0)

    def _pickled(self) -> dict[str, Any]:
        return {"shape": self.shape, "state": self._st.copy()}

    def _unpickled(self, saved: dict[str, Any], what: str) -> None:
        shape = saved.get("shape")
        try:
            checked = _shape(shape[0], {n: (ps, pb, g) for n, ps, pb, g in shape[1]})  # type: ignore[index]
        except (TypeError, ValueError, IndexError) as error:
            raise HostPoolError(f"{what} has shape={shape!r}: {error}") from None
        self._setup(checked, checked_envelope_words(saved.get("state"), checked, what))

    def __repr__(self) -> str:
        with self.lock:
            live = self._counts()[0]
        held = ", ".join(f"{n}: {k} pages held" for (n, _, _, _), k in zip(self.shape[1], live, strict=True))
        return f"EnvelopePagePool(total_bytes={self.total_bytes}: {held}; {self.free_bytes()} bytes free)"


def _shape(total_bytes: Any, sides: Any) -> tuple[int, tuple[tuple[str, int, int, str], ...]]:
    """The constructor's arguments, checked: ``(total_bytes, ((name, page_size, page_bytes, grow), ...))``."""
    total_bytes = as_count(total_bytes, "total_bytes")
    if total_bytes <= 0:
        raise HostPoolError(f"total_bytes must be positive, got {shown(total_bytes)}")
    if not hasattr(sides, "items") or not 1 <= len(sides) <= 2:  # noqa: PLR2004 - the original's bound
        raise HostPoolError(f"sides must map one or two names to (page_size, page_bytes, grow), got {sides!r}")
    made = []
    for name, spec in sides.items():
        if type(name) is not str:
            raise TypeError(f"a side's name must be a str, got {type(name).__name__} {name!r}")
        if not isinstance(spec, tuple) or len(spec) != 3:  # noqa: PLR2004 - (page_size, page_bytes, grow)
            raise HostPoolError(f"side {name!r} must be (page_size, page_bytes, grow), got {spec!r}")
        ps, pb = as_count(spec[0], "page_size"), as_count(spec[1], "page_bytes")
        if ps < 1 or pb < 1:
            raise HostPoolError(f"side {name!r}: page_size and page_bytes must be positive, got {ps}, {pb}")
        if spec[2] not in GROWS:
            raise HostPoolError(f"side {name!r}: grow must be 'up' or 'down', got {spec[2]!r}")
        if total_bytes // pb == 0:
            raise HostPoolError(f"side {name!r}: total_bytes={total_bytes} holds no page of {pb} bytes")
        if total_bytes // pb > _layout.MAX_PAGES:
            raise HostPoolError(f"side {name!r}: {total_bytes // pb} pages is more than one pool indexes")
        made.append((name, ps, pb, spec[2]))
    if len(made) == 2 and made[0][3] == made[1][3]:  # noqa: PLR2004 - two sides
        raise HostPoolError(f"two sides must grow from opposite ends, got {made[0][3]!r} twice")
    return total_bytes, tuple(made)
