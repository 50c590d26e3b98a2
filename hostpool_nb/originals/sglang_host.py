"""sglang's HiCache host pools (the ``HostKVCache`` family): their free-slot bookkeeping, on torch CPU tensors.

Written from docs/behaviour.md, section 5 (sglang 0.5.23's observed
behaviour), not from sglang's code. Only the bookkeeping is here: a pool
keeps no KV bytes, and its constructor takes the geometry directly rather
than sizing itself from a device pool and the host's memory. The classes
keep sglang's names, its hierarchy (the base class's bookkeeping inherited
unchanged by the MHA, MLA, DSA and MiniMax pools; the Mamba and DeepSeek V4
paged pools with their own) and its silent failures:

- ``HostKVCache`` checks with ``assert``: a partial page in ``alloc``, a
  slot freed while free (an ``AssertionError``, or nothing under
  ``python -O``); a negative id indexes from the end; an id past the end
  is torch's ``IndexError``; the double-alloc check runs after the free
  list was cut;
- ``MambaPoolHost`` and ``DeepSeekV4PagedHostPool`` check nothing on
  ``free``; the latter rounds ``alloc`` up to a page.

torch is imported when a pool is built, not with this module.

Examples
--------
>>> from hostpool_nb.originals.sglang_host import MambaPoolHost
>>> pool = MambaPoolHost(host_token_capacity=4)
>>> slots = pool.alloc(2)
>>> pool.free(slots), pool.free(slots)  # a double free, accepted
(2, 2)
>>> pool.available_size()  # more than the pool holds
6
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def _torch() -> Any:
    import torch  # noqa: PLC0415 - when a pool is built: importing this module never imports torch

    return torch


def locked(method: _F) -> _F:
    """The method runs holding the pool's ``self.lock``, as sglang's host pools' are."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class _FreeList:
    """What every pool here shares: the free list and the lazily merged release list."""

    size: int
    free_slots: Any
    release_slots: list[Any]
    num_release_slots: int
    available_size: Callable[[], int]
    _merge_release_slots: Callable[[], None]

    def _available(self) -> int:
        return len(self.free_slots) + self.num_release_slots

    def _merge(self) -> None:
        if self.num_release_slots == 0:
            return
        if len(self.free_slots) == 0 and len(self.release_slots) == 1:
            self.free_slots = self.release_slots[0]  # the one chunk becomes the free list, as it is
        else:
            self.free_slots = _torch().cat([self.free_slots, *self.release_slots])
        self.release_slots = []
        self.num_release_slots = 0

    def _take(self, need_size: int) -> Any:
        """Steps 2-4 of an allocation: ``None`` when short, else the front of the free list (merged if needed)."""
        if need_size > self.available_size():
            return None
        if need_size > len(self.free_slots):
            self._merge_release_slots()
        taken = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return taken

    def _release(self, indices: Any) -> int:
        """A free without checks: the CPU copy appended, counted by ``len``."""
        on_cpu = indices.cpu()
        if on_cpu.numel() == 0:
            return 0
        self.release_slots.append(on_cpu)
        self.num_release_slots += len(on_cpu)
        return len(indices)


class ClassedFreeLists:
    """``PageInterleavePoolAllocator``'s books as sglang's interleaved host pool keeps them (docs/behaviour.md, 6.2).

    Plain lists, one per owner class (page ``p`` is class ``p % N``'s);
    pages ``0 .. N - 1`` are never listed. ``alloc_cyclic`` draws page
    ``j`` from class ``(start + j) % N``'s front; ``free`` takes any slots,
    files each page named (once) at the front of its class, lowest first,
    and checks nothing: a page freed twice is listed twice.

    Examples
    --------
    >>> from hostpool_nb.originals.sglang_host import ClassedFreeLists
    >>> books = ClassedFreeLists(size=8, page_size=4, shard_size=2)
    >>> books.class_free_pages
    [[2, 4], [3, 5]]
    >>> books.alloc_cyclic(1, 8)  # page 3 (class 1), then page 2 (class 0)
    [12, 13, 14, 15, 8, 9, 10, 11]
    >>> books.free([8, 9, 10, 11, 8]); books.class_free_pages
    [[2, 4], [5]]
    """

    def __init__(self, size: int, page_size: int, shard_size: int) -> None:
        assert shard_size > 1, "PageInterleavePoolAllocator requires shard_size > 1"
        self.page_size = page_size
        self.shard_size = shard_size
        per_class = size * shard_size // page_size // shard_size
        self.class_free_pages = [[shard_size * k + r for k in range(1, per_class + 1)] for r in range(shard_size)]

    def available_size(self) -> int:
        return self.shard_size * self.page_size * min(len(listed) for listed in self.class_free_pages)

    def alloc_cyclic(self, start_class: int, need_size: int) -> list[int] | None:
        n, ps = self.shard_size, self.page_size
        pages = -(-need_size // ps)
        assert pages > 0
        start = start_class % n
        shares = [pages // n + (1 if (c - start) % n < pages % n else 0) for c in range(n)]
        if any(share > len(listed) for share, listed in zip(shares, self.class_free_pages, strict=True)):
            return None
        drawn = [0] * pages
        for c in range(n):
            for i, page in enumerate(self.class_free_pages[c][: shares[c]]):
                drawn[(c - start) % n + i * n] = page
            self.class_free_pages[c] = self.class_free_pages[c][shares[c] :]
        return [drawn[o // ps] * ps + o % ps for o in range(need_size)]

    def free(self, slots: list[int]) -> None:
        pages = sorted({slot // self.page_size for slot in slots})
        for r in range(self.shard_size):
            self.class_free_pages[r] = [p for p in pages if p % self.shard_size == r] + self.class_free_pages[r]


class _EnvelopeSide:
    """One side of :class:`EnvelopeBacking`: its pages, its growth direction, and its books (plain Python)."""

    def __init__(self, page_size: int, page_bytes: int, page_num: int, grow_direction: str) -> None:
        self.page_size, self.page_bytes, self.page_num = page_size, page_bytes, page_num
        self.grow_direction = grow_direction
        self.down = grow_direction == "down"
        self.clear()

    def clear(self) -> None:
        self.free_logical_extents = [(0, self.page_num)]  # logical pages, half-open, sorted, merged
        self.logical_to_physical: dict[int, int] = {}
        self.physical_to_logical: dict[int, int] = {}
        self.free_physical_pages: set[int] = set()
        self.watermark = self.page_num - 1 if self.down else 0

    def free_logical(self) -> int:
        return sum(end - start for start, end in self.free_logical_extents)


class EnvelopeBacking:
    """sglang's shared page-envelope host backing's books (docs/behaviour.md, section 7), in plain Python.

    One byte envelope of ``total_bytes``, one or two sides by name, each
    ``(page_size, page_bytes, "up" | "down")``. Logical pages go out lowest
    first; physical pages are a side's holes first (nearest its own end),
    then pages past its watermark; when the sides' watermarks leave too
    small a gap but the live pages and the request fit, both sides are
    compacted towards their ends first (``moves`` lists each page moved,
    ``(name, source, target)``). Errors are sglang's: ``AssertionError``
    for a partial page, a page not live or named twice; ``ValueError`` for
    an unknown side.

    Examples
    --------
    >>> from hostpool_nb.originals.sglang_host import EnvelopeBacking
    >>> env = EnvelopeBacking(64, {"full": (1, 8, "up"), "swa": (1, 16, "down")})
    >>> env.alloc("full", 2), env.alloc("swa", 1)
    ([0, 1], [0])
    >>> env.translate("full", [0, 1]), env.translate("swa", [0]), env.free_bytes()
    ([0, 1], [3], 32)
    """

    def __init__(self, total_bytes: int, sides: dict[str, tuple[int, int, str]]) -> None:
        self.sides = {name: _EnvelopeSide(ps, pb, total_bytes // pb, grow) for name, (ps, pb, grow) in sides.items()}
        down = [side for side in self.sides.values() if side.down]
        only = down[0] if down else next(iter(self.sides.values()))
        self.allocatable = only.page_num * only.page_bytes
        self.moves: list[tuple[str, int, int]] = []

    def _side(self, name: str) -> _EnvelopeSide:
        if name not in self.sides:
            raise ValueError(f"Unknown unified host pool {name!r}.")
        return self.sides[name]

    def _counts(self, requests: list[tuple[str, int]]) -> tuple[list[int], dict[str, int]]:
        each, total = [], dict.fromkeys(self.sides, 0)
        for name, need in requests:
            side = self._side(name)
            if need % side.page_size != 0:
                raise AssertionError("The requested size should be a multiple of the page size.")
            each.append(need // side.page_size)
            total[name] += need // side.page_size
        return each, total

    def _gap(self) -> int:
        up = [s for s in self.sides.values() if not s.down]
        down = [s for s in self.sides.values() if s.down]
        low = up[0].watermark * up[0].page_bytes if up else 0
        high = (down[0].watermark + 1) * down[0].page_bytes if down else self.allocatable
        return max(0, high - low)

    def _fits_now(self, total: dict[str, int]) -> bool:
        extension = 0
        for name, pages in total.items():
            side = self.sides[name]
            if pages > side.free_logical():
                return False
            extension += max(0, pages - len(side.free_physical_pages)) * side.page_bytes
        return extension <= self._gap()

    def _fits(self, live: dict[str, int], free: dict[str, int], total: dict[str, int]) -> bool:
        used = 0
        for name, pages in total.items():
            if pages > free[name]:
                return False
            used += (live[name] + pages) * self.sides[name].page_bytes
        return used <= self.allocatable

    def free_bytes(self) -> int:
        return self.allocatable - sum(len(s.logical_to_physical) * s.page_bytes for s in self.sides.values())

    def available_size(self, name: str) -> int:
        side = self.sides[name]
        return min(side.free_logical(), self.free_bytes() // side.page_bytes) * side.page_size

    def _compact(self) -> None:
        for name, side in self.sides.items():
            live = sorted(side.physical_to_logical.items(), reverse=side.down)
            step = -1 if side.down else 1
            first = side.page_num - 1 if side.down else 0
            side.logical_to_physical, side.physical_to_logical = {}, {}
            for i, (source, logical) in enumerate(live):
                target = first + step * i
                if source != target:
                    self.moves.append((name, source, target))
                side.logical_to_physical[logical] = target
                side.physical_to_logical[target] = logical
            side.free_physical_pages = set()
            side.watermark = first + step * len(live)

    def alloc_many(self, requests: list[tuple[str, int]]) -> list[list[int]] | None:
        each, total = self._counts(requests)
        if not self._fits_now(total):
            live = {name: len(s.logical_to_physical) for name, s in self.sides.items()}
            free = {name: s.free_logical() for name, s in self.sides.items()}
            if not self._fits(live, free, total):
                return None
            self._compact()
        physical = {name: self._physical(self.sides[name], pages) for name, pages in total.items()}
        used = dict.fromkeys(self.sides, 0)
        out = []
        for (name, _), pages in zip(requests, each, strict=True):
            side = self.sides[name]
            logical = self._lowest(side, pages)
            for page, at in zip(logical, physical[name][used[name] : used[name] + pages], strict=True):
                side.logical_to_physical[page] = at
                side.physical_to_logical[at] = page
            used[name] += pages
            out.append([p * side.page_size + k for p in logical for k in range(side.page_size)])
        return out

    def alloc(self, name: str, need: int) -> list[int] | None:
        got = self.alloc_many([(name, need)])
        return None if got is None else got[0]

    @staticmethod
    def _lowest(side: _EnvelopeSide, pages: int) -> list[int]:
        taken: list[int] = []
        rest: list[tuple[int, int]] = []
        for start, end in side.free_logical_extents:
            take = min(pages - len(taken), end - start)
            taken += range(start, start + take)
            if start + take < end:
                rest.append((start + take, end))
        side.free_logical_extents = rest
        return taken

    @staticmethod
    def _physical(side: _EnvelopeSide, pages: int) -> list[int]:
        holes = sorted(side.free_physical_pages, reverse=side.down)[:pages]
        side.free_physical_pages.difference_update(holes)
        step = -1 if side.down else 1
        more = [side.watermark + step * i for i in range(pages - len(holes))]
        side.watermark += step * len(more)
        return holes + more

    def _pages(self, side: _EnvelopeSide, slots: list[int]) -> list[int]:
        ps = side.page_size
        if len(slots) % ps:
            raise AssertionError("Host indices must contain whole pages.")
        chunks = [slots[i : i + ps] for i in range(0, len(slots), ps)]
        if any(c[0] % ps or c != list(range(c[0], c[0] + ps)) for c in chunks):
            raise AssertionError("Host indices must contain contiguous pages.")
        return [c[0] // ps for c in chunks]

    def free(self, name: str, slots: list[int]) -> int:
        side = self.sides[name]
        pages = self._pages(side, slots)
        if len(pages) != len(set(pages)):
            raise AssertionError("Host pages cannot be freed more than once.")
        if any(p not in side.logical_to_physical for p in pages):
            raise AssertionError(f"Host pages are not allocated in {name!r}.")
        for page in pages:
            at = side.logical_to_physical.pop(page)
            del side.physical_to_logical[at]
            side.free_physical_pages.add(at)
        merged: list[tuple[int, int]] = []
        for start, end in sorted([*side.free_logical_extents, *((p, p + 1) for p in pages)]):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        side.free_logical_extents = merged
        step = -1 if side.down else 1
        while 0 <= side.watermark - step < side.page_num and side.watermark - step in side.free_physical_pages:
            side.watermark -= step
            side.free_physical_pages.remove(side.watermark)
        return len(slots)

    def clear(self, name: str) -> None:
        self.sides[name].clear()

    def translate(self, name: str, slots: list[int]) -> list[int]:
        side = self.sides[name]
        ps = side.page_size
        for page in self._pages(side, slots):
            if page not in side.logical_to_physical:
                raise AssertionError(f"Host page {page} is not allocated in {name!r}.")
        return [side.logical_to_physical[s // ps] * ps + s % ps for s in slots]


class EnvelopeDevicePool:
    """What the unified backing's constructor reads of a device pool: one shared region, its page envelope.

    ``pages`` pages of ``page_bytes`` (a torch uint8 tensor), ``region``
    bytes in the device region the sides share.

    Examples
    --------
    >>> from hostpool_nb.originals.sglang_host import EnvelopeDevicePool
    >>> pool = EnvelopeDevicePool(4, 64, 10, "up", 640)
    >>> tuple(pool.get_page_envelope_buffer().shape)
    (10, 64)
    >>> pool.get_contiguous_buf_infos()  # one region: pointer, length, page bytes
    ([0], [640], [64])
    """

    def __init__(self, page_size: int, page_bytes: int, pages: int, grow_direction: str, region: int) -> None:
        self.page_size = page_size
        self.grow_direction = grow_direction
        self.size = pages * page_size
        self.host_capacity_tokens = None
        self._buffer = _torch().empty((pages, page_bytes), dtype=_torch().uint8)
        self._region = region

    def get_page_envelope_buffer(self) -> Any:
        return self._buffer

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        return [0], [self._region], [int(self._buffer.shape[1])]


def envelope_device_pools(total_bytes: int, sides: dict[str, tuple[int, int, str]]) -> list[EnvelopeDevicePool]:
    """Device pools whose backing (ratio 1, no fixed size) is exactly ``total_bytes``: sglang sizes it as the
    region plus the largest page, or each side's pages plus one, whichever is more."""
    region = total_bytes - max(pb for _, pb, _ in sides.values())
    return [EnvelopeDevicePool(ps, pb, total_bytes // pb - 1, grow, region) for ps, pb, grow in sides.values()]


def hierarchy() -> dict[str, type]:
    """A fresh copy of the classes, by name: what the stand-in engine puts at sglang's paths for one ``with`` block.

    ``install()`` replaces methods on the classes themselves; a fresh copy
    per block keeps this module's own classes (the tests' oracles) as
    written.
    """

    class HostKVCache(_FreeList):
        """The base class's bookkeeping: logical slot ids, per-slot "in use" flags checked by ``assert``.

        Parameters (keyword-only) are the geometry the real constructor
        computes: ``page_size`` (the widened page, a multiple of ``dcp_size``),
        ``host_token_capacity`` (physical slots, whole physical pages), and the
        decode-context-parallel ``dcp_size`` and ``dcp_rank``.

        Examples
        --------
        >>> from hostpool_nb.originals.sglang_host import HostKVCache
        >>> pool = HostKVCache(page_size=4, host_token_capacity=16)
        >>> pool.alloc(8).tolist(), pool.available_size()
        ([0, 1, 2, 3, 4, 5, 6, 7], 8)
        """

        dcp_size = 1
        dcp_rank = 0

        def __init__(  # noqa: PLR0913 - the geometry the real constructor computes, by name
            self,
            *,
            page_size: int,
            host_token_capacity: int,
            dcp_size: int = 1,
            dcp_rank: int = 0,
            layout: str = "layer_first",
            device: str = "cpu",
            pool_label: str = "kv",
        ) -> None:
            self.pool_label = pool_label
            self.dcp_size = dcp_size
            self.dcp_rank = dcp_rank
            if page_size % dcp_size != 0:
                raise AssertionError(f"page_size {page_size} must be a multiple of dcp_size {dcp_size}")
            self.page_size = page_size // dcp_size  # the physical page
            if host_token_capacity <= 0 or host_token_capacity % self.page_size:
                raise ValueError(f"host_token_capacity must be positive whole pages, got {host_token_capacity}")
            self.size = host_token_capacity
            self.page_num = self.size // self.page_size
            self.layout = layout
            self.device = device
            self.lock = threading.RLock()
            self.clear()

        @property
        def logical_size(self) -> int:
            return self.size * self.dcp_size

        @property
        def logical_page_size(self) -> int:
            return self.page_size * self.dcp_size

        def available_size(self) -> int:
            return self._available()

        def _merge_release_slots(self) -> None:
            self._merge()

        @locked
        def clear(self) -> None:
            torch = _torch()
            n = self.logical_size
            self.mem_state = torch.zeros((n,), dtype=torch.uint8, device=self.device)
            self.free_slots = torch.arange(n, dtype=torch.int64)
            self.release_slots = []
            self.num_release_slots = 0
            self.slot_used = torch.zeros(n, dtype=torch.bool)

        @locked
        def alloc(self, need_size: int) -> Any:
            # The original's asserts: an AssertionError, and nothing at all under python -O.
            assert need_size % self.logical_page_size == 0, "The requested size should be a multiple of the page size."
            taken = self._take(need_size)
            if taken is None:
                return None
            # After the free list was cut, as the original checks it.
            assert not self.slot_used[taken].any(), (
                f"Double-alloc detected: slots already allocated: {taken[self.slot_used[taken]].tolist()}."
            )
            self.slot_used[taken] = True
            return taken

        @locked
        def free(self, indices: Any) -> int:
            on_cpu = indices.cpu()
            if on_cpu.numel() == 0:
                return 0
            assert self.slot_used[on_cpu].all(), (
                f"Double-free detected: slots not currently allocated: {on_cpu[~self.slot_used[on_cpu]].tolist()}."
            )
            self.slot_used[on_cpu] = False
            self.release_slots.append(on_cpu)
            self.num_release_slots += len(on_cpu)
            return len(indices)

    class PageInterleaveHostPool:
        """``pool_host.page_interleave``: a facade over a host pool, its slots from owner-classed lists.

        Attributes it lacks are the wrapped pool's (its lock among them).
        ``shard_size`` stands for the placement the original takes.

        Examples
        --------
        >>> from hostpool_nb.originals import sglang_host as S
        >>> host = S.MHATokenToKVPoolHost(page_size=4, host_token_capacity=12)
        >>> pool = S.PageInterleaveHostPool(host, shard_size=2)
        >>> pool.alloc(8, start_owner=1).tolist(), pool.available_size()
        ([12, 13, 14, 15, 8, 9, 10, 11], 8)
        """

        def __init__(self, host_pool: Any, shard_size: int, shard_rank: int = 0) -> None:
            self.host_pool = host_pool
            self.shard_size = shard_size
            self.shard_rank = shard_rank
            self.clear()

        def __getattr__(self, name: str) -> Any:
            return getattr(object.__getattribute__(self, "host_pool"), name)

        @property
        def logical_size(self) -> int:
            return int(self.size) * self.shard_size

        @locked
        def clear(self) -> None:
            self._slots = ClassedFreeLists(self.size - self.page_size, self.page_size, self.shard_size)

        def available_size(self) -> int:
            return self._slots.available_size()

        @locked
        def alloc(self, need_size: int, start_owner: int | None = None) -> Any:
            assert start_owner is not None, "sharded host slots must follow the owners of the device pages"
            taken = self._slots.alloc_cyclic(start_owner, need_size)
            return None if taken is None else _torch().tensor(taken, dtype=_torch().int64)

        @locked
        def free(self, indices: Any) -> int:
            self._slots.free(indices.cpu().tolist())
            return len(indices)

    class _SharedPageEnvelopeHostBacking:
        """``pool_host.unified``: the byte envelope two unified host pools share, its books an :class:`EnvelopeBacking`.

        Built from its device pools as sglang's is (ratio 1 and no fixed
        size: the device region plus the largest page, or each side's pages
        plus one, whichever is more); compaction moves the bytes of
        ``raw``. Its layout lease is a count, and a compaction that finds
        one raises, as sglang's does when the same thread holds one.

        Examples
        --------
        >>> from hostpool_nb.originals import sglang_host as S
        >>> pools = S.envelope_device_pools(64, {"full": (1, 8, "up"), "swa": (1, 16, "down")})
        >>> env = S._SharedPageEnvelopeHostBacking(
        ...     device_pools=pools, pool_names=["full", "swa"], host_to_device_ratio=1.0,
        ...     host_size=0, pin_memory=False, device="cpu", allocator_type="default")
        >>> env.alloc("full", 2).tolist(), env.free_bytes()
        ([0, 1], 48)
        """

        def __init__(  # noqa: PLR0913 - sglang's keyword-only parameters
            self,
            *,
            device_pools: Any,
            pool_names: Any,
            host_to_device_ratio: float,
            host_size: float,
            pin_memory: bool,
            device: str,
            allocator_type: str,
        ) -> None:
            torch = _torch()
            page_bytes = [int(p.get_page_envelope_buffer().shape[1]) for p in device_pools]
            region = device_pools[0].get_contiguous_buf_infos()[1][0]
            nominal = [
                (int(p.size * host_to_device_ratio) // p.page_size + 1) * pb
                for p, pb in zip(device_pools, page_bytes, strict=True)
            ]
            total = max(int(region * host_to_device_ratio) + max(page_bytes), *nominal)
            sides = {
                name: (p.page_size, pb, p.grow_direction)
                for name, p, pb in zip(pool_names, device_pools, page_bytes, strict=True)
            }
            self.books = EnvelopeBacking(total, sides)
            self.sides = self.books.sides
            self.capacity_bytes = total
            self._allocatable_bytes = self.books.allocatable
            self.raw = torch.zeros((total,), dtype=torch.uint8, device=device)
            self.lock = threading.RLock()
            self._layout_condition = threading.Condition(self.lock)
            self.leases = 0
            self.compactions = 0

        def _begin_compaction(self) -> list[Any]:
            if self.leases:
                raise RuntimeError("Cannot compact a unified host pool while the current thread holds a layout lease.")
            self.compactions += 1
            return []

        def _finish_compaction(self) -> None:
            pass

        def _move(self, moves: list[tuple[str, int, int]]) -> None:
            for name, source, target in moves:
                pb = self.sides[name].page_bytes
                self.raw[target * pb : (target + 1) * pb] = self.raw[source * pb : (source + 1) * pb].clone()

        @locked
        def clear(self, name: str) -> None:
            self.books.clear(name)

        @locked
        def available_size(self, name: str) -> int:
            return self.books.available_size(name)

        @locked
        def free_bytes(self) -> int:
            return self.books.free_bytes()

        def alloc(self, name: str, need_size: int) -> Any:
            got = self.alloc_many(((name, need_size),))
            return None if got is None else got[0]

        @locked
        def alloc_many(self, requests: Any) -> Any:
            before = len(self.books.moves)
            _each, total = self.books._counts(list(requests))
            if not self.books._fits_now(total):
                live = {n: len(s.logical_to_physical) for n, s in self.sides.items()}
                free = {n: s.free_logical() for n, s in self.sides.items()}
                if self.books._fits(live, free, total):
                    self._begin_compaction()
            got = self.books.alloc_many(list(requests))
            self._move(self.books.moves[before:])
            if got is None:
                return None
            return [_torch().tensor(slots, dtype=_torch().int64) for slots in got]

        @locked
        def can_fit_many_then(self, requests: Any, following_requests: Any, *, empty: bool = False) -> bool:
            first, then = self.books._counts(list(requests))[1], self.books._counts(list(following_requests))[1]
            live = {n: 0 if empty else len(s.logical_to_physical) for n, s in self.sides.items()}
            free = {n: s.page_num if empty else s.free_logical() for n, s in self.sides.items()}
            if not self.books._fits(live, free, first):
                return False
            return self.books._fits({n: live[n] + first[n] for n in live}, {n: free[n] - first[n] for n in free}, then)

        @locked
        def free(self, name: str, indices: Any) -> int:
            self.books.free(name, indices.to(dtype=_torch().int64, device="cpu").flatten().tolist())
            return len(indices)

        @locked
        def translate_indices(self, name: str, indices: Any) -> Any:
            got = self.books.translate(name, indices.to(dtype=_torch().int64, device="cpu").flatten().tolist())
            return _torch().tensor(got, dtype=_torch().int64).to(device=indices.device)

        @locked
        def translate_index(self, name: str, index: int) -> int:
            ps = self.sides[name].page_size
            page = index - index % ps
            return self.books.translate(name, list(range(page, page + ps)))[index % ps]

    class HiSparseHostPoolMixin:
        """What sglang's HiSparse pools add to a host pool that the bookkeeping serves: allocation by pages.

        Examples
        --------
        >>> from hostpool_nb.originals import sglang_host as S
        >>> class Paged(S.HiSparseHostPoolMixin, S.HostKVCache):
        ...     pass
        >>> Paged(page_size=4, host_token_capacity=8).alloc_page(1).tolist()
        [0, 1, 2, 3]
        """

        page_size: int
        alloc: Callable[[int], Any]

        def alloc_page(self, num_pages: int) -> Any:
            return self.alloc(num_pages * self.page_size)

    # The pools that inherit the base class's bookkeeping unchanged (their buffers and transfers are not here).
    class MHATokenToKVPoolHost(HostKVCache):
        """``pool_host.mha``: the base class's bookkeeping.

        Examples
        --------
        >>> from hostpool_nb.originals.sglang_host import MHATokenToKVPoolHost
        >>> pool = MHATokenToKVPoolHost(page_size=4, host_token_capacity=16)
        >>> slots = pool.alloc(4)
        >>> pool.free(slots)
        4
        >>> pool.free(slots)  # under python -O: accepted, and the slots listed twice
        Traceback (most recent call last):
        ...
        AssertionError: Double-free detected: slots not currently allocated: [0, ...].
        """

    class MHATokenToKOnlyPoolHost(HostKVCache):
        """``pool_host.mha``: the base class's bookkeeping.

        Examples
        --------
        A negative id passes the check by wrapping around, and is handed out:

        >>> import torch
        >>> from hostpool_nb.originals.sglang_host import MHATokenToKOnlyPoolHost
        >>> pool = MHATokenToKOnlyPoolHost(page_size=1, host_token_capacity=4)
        >>> held = pool.alloc(4)
        >>> pool.free(torch.tensor([-1]))  # the last slot's flag, cleared
        1
        >>> pool.alloc(1).tolist()
        [-1]
        """

    class HiSparseMHATokenToKVPoolHost(HiSparseHostPoolMixin, MHATokenToKVPoolHost):
        """``pool_host.mha``: the base class's bookkeeping, allocated by pages too.

        Examples
        --------
        >>> from hostpool_nb.originals.sglang_host import HiSparseMHATokenToKVPoolHost
        >>> pool = HiSparseMHATokenToKVPoolHost(page_size=4, host_token_capacity=16)
        >>> pool.alloc_page(2).tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
        """

    class AsymmetricMHATokenToKVPoolHost(MHATokenToKVPoolHost):
        """``pool_host.mha``: the base class's bookkeeping.

        Examples
        --------
        The same id twice in one free: both pass the check, both are listed.

        >>> import torch
        >>> from hostpool_nb.originals.sglang_host import AsymmetricMHATokenToKVPoolHost
        >>> pool = AsymmetricMHATokenToKVPoolHost(page_size=1, host_token_capacity=4)
        >>> slot = pool.alloc(1)
        >>> pool.free(torch.cat([slot, slot])), pool.available_size()
        (2, 5)
        """

    class MLATokenToKVPoolHost(HiSparseHostPoolMixin, HostKVCache):
        """``pool_host.mla``: the base class's bookkeeping, allocated by pages too.

        Examples
        --------
        Decode context parallelism: physical pages, logical slot ids.

        >>> from hostpool_nb.originals.sglang_host import MLATokenToKVPoolHost
        >>> pool = MLATokenToKVPoolHost(page_size=8, dcp_size=2, host_token_capacity=16)
        >>> pool.page_size, pool.logical_page_size, pool.logical_size
        (4, 8, 32)
        """

    class DSAIndexerPoolHost(HostKVCache):
        """``pool_host.dsa``: the base class's bookkeeping.

        Examples
        --------
        A 2-D input is counted by its rows:

        >>> from hostpool_nb.originals.sglang_host import DSAIndexerPoolHost
        >>> pool = DSAIndexerPoolHost(page_size=1, host_token_capacity=8)
        >>> pool.free(pool.alloc(4).reshape(2, 2))
        2
        """

    class MiniMaxM3Nvfp4IndexKPoolHost(HostKVCache):
        """``pool_host.minimax_m3_nvfp4``: the base class's bookkeeping.

        Examples
        --------
        >>> from hostpool_nb.originals.sglang_host import MiniMaxM3Nvfp4IndexKPoolHost
        >>> MiniMaxM3Nvfp4IndexKPoolHost(page_size=4, host_token_capacity=16).alloc(3)
        Traceback (most recent call last):
        ...
        AssertionError: The requested size should be a multiple of the page size.
        """

    class MiniMaxM3Nvfp4MainKVPoolHost(MiniMaxM3Nvfp4IndexKPoolHost):
        """``pool_host.minimax_m3_nvfp4``: the base class's bookkeeping.

        Examples
        --------
        >>> import torch
        >>> from hostpool_nb.originals.sglang_host import MiniMaxM3Nvfp4MainKVPoolHost
        >>> pool = MiniMaxM3Nvfp4MainKVPoolHost(page_size=1, host_token_capacity=4)
        >>> pool.free(torch.tensor([4]))
        Traceback (most recent call last):
        ...
        IndexError: index 4 is out of bounds for dimension 0 with size 4
        """

    class MambaPoolHost(HostKVCache):
        """``pool_host.mamba``: a slot per request's state, page size 1; no "in use" flags, no checks on ``free``.

        Examples
        --------
        >>> import torch
        >>> from hostpool_nb.originals.sglang_host import MambaPoolHost
        >>> pool = MambaPoolHost(host_token_capacity=4)
        >>> pool.free(torch.tensor([9])), pool.available_size()  # out of range: listed
        (1, 5)
        """

        def __init__(self, *, host_token_capacity: int, layout: str = "page_first", device: str = "cpu") -> None:
            self.page_size = 1
            self.size = host_token_capacity
            self.page_num = self.size
            self.layout = layout
            self.device = device
            self.lock = threading.RLock()
            self.clear()

        @locked
        def clear(self) -> None:
            torch = _torch()
            self.mem_state = torch.zeros((self.size,), dtype=torch.uint8, device=self.device)
            self.free_slots = torch.arange(self.size, dtype=torch.int64)
            self.release_slots = []
            self.num_release_slots = 0

        def available_size(self) -> int:
            return self._available()

        @locked
        def alloc(self, need_size: int) -> Any:
            assert need_size % self.page_size == 0, "The requested size should be a multiple of the page size."
            return self._take(need_size)

        @locked
        def free(self, indices: Any) -> int:
            return self._release(indices)

    class DeepSeekV4PagedHostPool(HiSparseHostPoolMixin, HostKVCache):
        """``memory_pool_host``: a DeepSeek V4 paged pool's host mirror; rounds ``alloc`` up, checks no ``free``.

        Examples
        --------
        >>> from hostpool_nb.originals.sglang_host import DeepSeekV4PagedHostPool
        >>> pool = DeepSeekV4PagedHostPool("c4", num_host_pages=4, slot_page_size=4)
        >>> pool.alloc(5).tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
        """

        def __init__(
            self,
            pool_name: str,
            num_host_pages: int,
            slot_page_size: int,
            layout: str = "layer_first",
            device: str = "cpu",
        ) -> None:
            self.pool_name = pool_name
            self.num_host_pages = num_host_pages
            self.slot_page_size = slot_page_size
            self.page_size = slot_page_size
            self.size = num_host_pages * slot_page_size
            self.layout = layout
            self.device = device
            self.lock = threading.RLock()
            self.clear()

        def clear(self) -> None:  # not locked, as the original's
            self.free_slots = _torch().arange(self.size, dtype=_torch().int64)
            self.release_slots = []
            self.num_release_slots = 0

        def available_size(self) -> int:
            return self._available()

        @locked
        def alloc(self, need_size: int) -> Any:
            page = self.slot_page_size
            return self._take((need_size + page - 1) // page * page)

        @locked
        def free(self, indices: Any) -> int:
            return self._release(indices)

    class QSAIndexerPoolHost(DeepSeekV4PagedHostPool):
        """``pool_host.qsa``: the DeepSeek V4 paged pool's bookkeeping, inherited.

        Examples
        --------
        >>> from hostpool_nb.originals.sglang_host import QSAIndexerPoolHost
        >>> pool = QSAIndexerPoolHost("qsa", num_host_pages=2, slot_page_size=4)
        >>> pool.alloc_page(1).tolist()
        [0, 1, 2, 3]
        """

    class DeepSeekV4StateHostPool(HostKVCache):
        """``memory_pool_host``: no allocator of its own (it reuses another pool's indices).

        Examples
        --------
        >>> from hostpool_nb.originals.sglang_host import DeepSeekV4StateHostPool
        >>> DeepSeekV4StateHostPool("state", 2, 4).alloc(4)
        Traceback (most recent call last):
        ...
        NotImplementedError: state reuses SWA transfer indices and has no allocator
        """

        def __init__(self, pool_name: str, num_host_pages: int, slot_page_size: int) -> None:
            self.pool_name = pool_name
            self.page_size = slot_page_size
            self.size = num_host_pages * slot_page_size
            self.lock = threading.RLock()
            self.clear()

        def clear(self) -> None:
            pass

        def available_size(self) -> int:
            raise NotImplementedError(f"{self.pool_name} reuses SWA transfer indices and has no allocator")

        @locked
        def alloc(self, need_size: int) -> Any:
            raise NotImplementedError(f"{self.pool_name} reuses SWA transfer indices and has no allocator")

        @locked
        def free(self, indices: Any) -> int:
            raise NotImplementedError(f"{self.pool_name} reuses SWA transfer indices and has no free list")

    return {name: value for name, value in locals().items() if isinstance(value, type)}


_CLASSES = hierarchy()
HostKVCache = _CLASSES["HostKVCache"]
HiSparseHostPoolMixin = _CLASSES["HiSparseHostPoolMixin"]
MHATokenToKVPoolHost = _CLASSES["MHATokenToKVPoolHost"]
MHATokenToKOnlyPoolHost = _CLASSES["MHATokenToKOnlyPoolHost"]
HiSparseMHATokenToKVPoolHost = _CLASSES["HiSparseMHATokenToKVPoolHost"]
AsymmetricMHATokenToKVPoolHost = _CLASSES["AsymmetricMHATokenToKVPoolHost"]
MLATokenToKVPoolHost = _CLASSES["MLATokenToKVPoolHost"]
DSAIndexerPoolHost = _CLASSES["DSAIndexerPoolHost"]
MiniMaxM3Nvfp4IndexKPoolHost = _CLASSES["MiniMaxM3Nvfp4IndexKPoolHost"]
MiniMaxM3Nvfp4MainKVPoolHost = _CLASSES["MiniMaxM3Nvfp4MainKVPoolHost"]
MambaPoolHost = _CLASSES["MambaPoolHost"]
DeepSeekV4PagedHostPool = _CLASSES["DeepSeekV4PagedHostPool"]
QSAIndexerPoolHost = _CLASSES["QSAIndexerPoolHost"]
DeepSeekV4StateHostPool = _CLASSES["DeepSeekV4StateHostPool"]
_SharedPageEnvelopeHostBacking = _CLASSES["_SharedPageEnvelopeHostBacking"]
PageInterleaveHostPool = _CLASSES["PageInterleaveHostPool"]


#: Module (under ``sglang.srt.mem_cache``) -> the names of the classes sglang 0.5.23 defines there.
MODULES: dict[str, tuple[str, ...]] = {
    "pool_host.base": ("HostKVCache",),
    "pool_host.hisparse": ("HiSparseHostPoolMixin",),
    "pool_host.mha": (
        "MHATokenToKVPoolHost",
        "MHATokenToKOnlyPoolHost",
        "HiSparseMHATokenToKVPoolHost",
        "AsymmetricMHATokenToKVPoolHost",
    ),
    "pool_host.mla": ("MLATokenToKVPoolHost",),
    "pool_host.dsa": ("DSAIndexerPoolHost",),
    "pool_host.minimax_m3_nvfp4": ("MiniMaxM3Nvfp4IndexKPoolHost", "MiniMaxM3Nvfp4MainKVPoolHost"),
    "pool_host.mamba": ("MambaPoolHost",),
    "pool_host.qsa": ("QSAIndexerPoolHost",),
    "pool_host.page_interleave": ("PageInterleaveHostPool",),
    "pool_host.unified": ("_SharedPageEnvelopeHostBacking",),
    "memory_pool_host": ("DeepSeekV4PagedHostPool", "DeepSeekV4StateHostPool"),
}

__all__ = [
    "MODULES",
    "AsymmetricMHATokenToKVPoolHost",
    "ClassedFreeLists",
    "DSAIndexerPoolHost",
    "DeepSeekV4PagedHostPool",
    "DeepSeekV4StateHostPool",
    "EnvelopeBacking",
    "EnvelopeDevicePool",
    "HiSparseHostPoolMixin",
    "HiSparseMHATokenToKVPoolHost",
    "HostKVCache",
    "MHATokenToKOnlyPoolHost",
    "MHATokenToKVPoolHost",
    "MLATokenToKVPoolHost",
    "MambaPoolHost",
    "MiniMaxM3Nvfp4IndexKPoolHost",
    "MiniMaxM3Nvfp4MainKVPoolHost",
    "PageInterleaveHostPool",
    "QSAIndexerPoolHost",
    "envelope_device_pools",
    "hierarchy",
    "locked",
]
