"""Differential state machines: hostpool_nb.paged against the oracle of hostpool_nb.originals.paged.

Hypothesis drives an allocator and the oracle (sglang-jax's algorithm from
docs/behaviour.md, section 3, in numpy) with the same calls, as a scheduler makes
them: ``alloc_extend`` batches mixing new requests (prefix 0, ``last_loc``
-1) and live ones (prefixes ending mid-page and at page ends), ``alloc_decode``
batches (new requests too), ``alloc`` of whole pages, frees of whole
requests, of suffixes, of overlapping token ranges, of pages nobody holds
any more and of pages already free, ``merge_and_sort_free``, free groups
spanning ranks, ``backup_state``/``restore_state`` at random moments,
``clear(r)`` and ``clear()``; on 1 to 3 ranks of a few pages each, so that
allocations are refused (``None``, after the merge the original makes
first) often. Inputs come as lists and as int64 and int32 arrays, ``dp_rank``
as an int or a numpy integer, with ``debug_mode`` on and off.

After every step the results and their dtypes, every rank's free list in
order, its released pages as a set and its ``available_size`` must equal the
oracle's, ``check_invariants()`` must pass, the group buffer must hold the
pages the caller freed in the open group, and the caller's model must be
sound (the requests hold only allocated pages, none twice). The same
machine runs with ``strict=True`` on paths that never free a free page.
A second machine does the same for ``TokenToKVPoolAllocator``. Half the
runs build the allocator with ``track=True`` (passing ``tags=`` to some
batches): its results must not change, and after every step
``outstanding(r)`` must hold exactly the oracle's allocated pages but those
pending in the group, from this file's call sites and the tags given, and
``outstanding(r, exclude=<the model's requests' slots>)`` exactly the pages
no request holds (a leak report's answer).

Where the library and the oracle may differ (the docstring of ``hostpool_nb.paged``), the
callers here stay on the side where both agree: inside a free group they
free only pages the model's live requests (or nobody) hold, so no page that
was free at an in-group call is handed out again before the group ends; a
freed page is dropped from its request at once. The token machine restores
a backup only while no free is pending (the original would append a pending
slot that the restored list holds already a second time).

Each run records the rules and situations it reached: every run must reach
each rule and each refusal; the runs of one test together (dp_size 1, 2
and 3 at one page size) every situation listed below.
"""

from __future__ import annotations

import collections
import copy
import os
import pickle
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hostpool_nb import PagedOnlyError
from hostpool_nb import replay as R
from hostpool_nb import trace as T
from hostpool_nb.originals import paged as oracle_mod
from hostpool_nb.paged import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from tests.paged_model import Requests, compare, oracle_allocated, pending_pages

PAGE_SIZES = [1, 2, 16, 64]
TAGS = [None, "req-1", 7, ("req", 2)]
FORMS = ["list", "int64", "int32"]


def as_form(values: list[int], form: str) -> Any:
    """The same integers as a list or a 1-D int64 / int32 array (or 2-D: one row)."""
    if form == "list":
        return list(values)
    if form == "2d":
        return np.array(values, dtype=np.int64).reshape(1, -1)
    return np.array(values, dtype=form)


def check_array(got: Any, want: Any, dtype: Any) -> None:
    """Both refused, or the same values with the dtype of docs/behaviour.md, section 3."""
    if want is None:
        assert got is None, f"the oracle refused, the allocator returned {got!r}"
        return
    assert isinstance(got, np.ndarray), f"the allocator returned {got!r}, the oracle {want!r}"
    assert isinstance(want, np.ndarray)
    assert got.dtype == dtype
    assert want.dtype == dtype  # the oracle follows docs/behaviour.md (section 3) too: a broken oracle judges nothing
    assert got.ndim == 1
    assert got.tolist() == want.tolist()


class _Machine(RuleBasedStateMachine):
    """What both machines share: ranks, the comparison, free groups, backups, clears."""

    token = False

    def __init__(self, page_size: int, dp_size: int, strict: bool, events: set[str]) -> None:
        super().__init__()
        self.ps = page_size
        self.dp = dp_size
        self.strict = strict
        self.events = events  # rules and situations reached, shared by all runs of one test
        self.pickled: set[str] = set()  # this example's pickles, outside a group and in one (snapshot steers)

    def setup(self, lib: Any, ora: Any) -> None:
        self.lib = lib
        self.ora = ora
        assert lib.dp_size == ora.dp_size == self.dp
        self.model = Requests(self.dp, self.ps)
        self.pending: list[set[int]] = [set() for _ in range(self.dp)]  # the group buffer's pages, per rank
        self.backups: list[tuple[Any, Any, Requests]] = []
        self.only_rank: int | None = None  # set by free_group_block: the rank every call then uses
        self.beyond = False  # set by free: the next allocation asks for more than the free list holds
        self.recording: tuple[Any, str, int] | None = None  # (the block, its file, calls made) while recording
        self.records = 0

    # -- recordings: a stretch of the run, replayed on a fresh allocator and on the original -------

    @rule()
    def record(self) -> None:
        """Begin recording, or end the recording and replay it: every recorded call must match."""
        if self.recording is None:
            self.begin_recording()
        else:
            self.end_recording()

    def begin_recording(self) -> None:
        if not hasattr(self, "tmp"):
            self.tmp = tempfile.mkdtemp(prefix="paged-machine-")
        self.records += 1
        path = os.path.join(self.tmp, f"{self.records}.npz")
        block = self.lib.recording(path)
        block.__enter__()
        self.recording = (block, path, 0)
        if self.in_group() or any(self.pending):
            self.events.add("recording begun with frees pending")

    def end_recording(self) -> None:
        block, path, _ = self.recording  # type: ignore[misc]  # recording
        self.recording = None
        block.__exit__(None, None, None)
        trace = T.load(path)
        done, skipped, divergence = R.replay(trace)
        assert divergence is None, f"the recording's replay: {divergence}"
        assert (done, skipped) == (len(trace), 0)
        # The original from the same start, the calls that did not raise: the same slots.
        original = R._original_allocator_at_start(trace)
        R._check_original_ranked(original, R._ranked_plan(trace, False, original))
        os.unlink(path)
        self.events.add("recording replayed" if len(trace) else "recording of nothing")

    def teardown(self) -> None:
        if hasattr(self, "lib") and {"pickled", "pickled in a group"} - self.pickled:
            # Every example pickles, outside a group and inside one, whatever rules hypothesis chose to run
            # (it may leave a rule out of a whole run): the copies must still agree with the oracle.
            self.copy_lib("pickle")
            if not self.in_group():
                self.lib.free_group_begin()
                self.ora.free_group_begin()
            self.copy_lib("deepcopy")
            self.agrees()
        if self.recording is not None:
            self.end_recording()
        if hasattr(self, "tmp"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- helpers ----------------------------------------------------------------

    def in_group(self) -> bool:
        return not self.ora.is_not_in_free_group

    def draw_rank(self, data: st.DataObject, among: list[int] | None = None) -> tuple[int, dict[str, Any]]:
        """A rank (of ``among`` if given), and how to pass it: default, an int, or a numpy integer keyword."""
        if self.only_rank is not None:
            r = self.only_rank
        else:
            r = data.draw(st.sampled_from(among) if among else st.integers(0, self.dp - 1), label="rank")
        how = data.draw(st.sampled_from(["default", "int", "numpy"]), label="dp_rank form") if r == 0 else "int"
        if how == "default":
            return r, {}
        return r, {"dp_rank": np.int64(r) if how == "numpy" else r}

    def free_both(self, r: int, slots: list[int], form: str, kw: dict[str, Any]) -> None:
        """``free`` on both; the allocator reports the pages it freed (or made pending); the model follows."""
        ps = self.ps
        in_group = self.in_group()
        pages = {s // ps for s in slots}
        allocated = oracle_allocated(self.ora, r)
        if in_group:
            assert form != "2d", "test bug: the oracle concatenates in-group frees, which must be 1-D"
            expected = len(pages & allocated - self.pending[r])
        else:
            expected = len(pages & allocated)
        arg = as_form(slots, form)
        got = self.lib.free(arg, **kw)
        assert self.ora.free(arg, **kw) is None
        assert type(got) is int
        assert got == expected, f"free reported {got} pages, expected {expected}"
        if in_group:
            self.pending[r] |= pages & allocated
            if got:
                self.events.add("free inside a group")
        self.model.drop_pages(r, pages)
        self.events.add(f"free as {form}")

    def busy_ranks(self, data: st.DataObject) -> list[int] | None:
        """The ranks with requests, mostly; None (any rank) now and then, or when none has any."""
        among = [r for r in range(self.dp) if self.model.ranks[r]]
        return among if data.draw(st.sampled_from([True, True, True, False]), label="a rank with requests") else None

    def ranks_to_free(self, data: st.DataObject) -> list[int] | None:
        """The ranks with requests (allocating first if there are none), or None (any rank) now and then."""
        if not any(self.model.ranks):
            self.allocate_some(data)
        among = [r for r in range(self.dp) if self.model.ranks[r]]
        return among if data.draw(st.sampled_from([True, True, True, False]), label="a rank with requests") else None

    # -- free groups, snapshots, clears ------------------------------------------------

    def end_group_both(self) -> None:
        """``free_group_end()``: each rank releases its pending pages still allocated; the model drops them."""
        before = [oracle_allocated(self.ora, r) for r in range(self.dp)]
        self.lib.free_group_end()
        self.ora.free_group_end()
        for r in range(self.dp):
            freed = before[r] - oracle_allocated(self.ora, r)
            # Exactly the pending pages that were still allocated, on both sides.
            assert freed == self.pending[r] & before[r]
            if freed:
                self.events.add("free_group_end released")
            if self.model.drop_pages(r, freed):
                self.events.add("free_group_end released a page a restored request held")
            self.pending[r] = set()

    @rule(data=st.data())
    def free_group(self, data: st.DataObject) -> None:
        # Begin or end a group; a second begin continues it (groups do not nest),
        # and an end outside a group does nothing.
        if not self.in_group():
            if data.draw(st.sampled_from([False, False, False, True]), label="end outside"):
                self.events.add("free_group_end outside a group")
                self.end_group_both()
                return
            self.begin_both()
            return
        if data.draw(st.sampled_from([False, False, True]), label="begin again"):
            self.begin_both()
            return
        self.end_group_both()

    def begin_both(self) -> None:
        self.events.add("free_group_begin inside a group" if self.in_group() else "free_group_begin")
        self.lib.free_group_begin()
        self.ora.free_group_begin()

    @rule(data=st.data())
    def free_group_block(self, data: st.DataObject) -> None:
        # A free group as a scheduler's step makes one: frees on several ranks,
        # with what may happen between them: allocations, merges, backups and
        # restores (the pending frees stay), clear(r) (which leaves the group:
        # frees after it are direct, other ranks' pending frees wait for the
        # end); and a backup just before the end, which a later restore brings
        # back with pages whose frees are gone with the group (nobody's pages).
        self.begin_both()
        ranks = data.draw(st.permutations(range(self.dp)), label="ranks")
        ranks = ranks[: data.draw(st.integers(min(2, self.dp), self.dp), label="how many")]
        ranks_freed: set[int] = set()
        between = ["allocate", "free", "backup", "restore", "clear(r)", *self.block_extras]
        for r in ranks:
            self.only_rank = r
            try:
                if not self.model.ranks[r]:
                    self.allocate_some(data)
                    self.agrees()
                in_group = self.in_group()
                if self.free_some(data, allow_empty=False) is not None and in_group:
                    ranks_freed.add(r)
            finally:
                self.only_rank = None
            self.agrees()  # each call compared at once, not only at the end of the rule
            if self.in_group() and data.draw(st.sampled_from([False, False, True]), label="begin again"):
                self.begin_both()  # continues the group: its pending frees stay
            for _ in range(data.draw(st.sampled_from([0, 0, 1, 2]), label="between")):
                step = data.draw(st.sampled_from(between), label="step")
                if step == "allocate":
                    self.allocate_some(data)
                elif step == "free":
                    self.free_some(data, allow_empty=False)
                elif step == "backup":
                    self.backup_both()
                elif step == "restore":
                    self.restore_both(data)
                elif step == "clear(r)":
                    self.clear_rank_both(data)
                else:
                    self.block_extra(step, data)
                self.agrees()
        if len(ranks_freed) > 1:
            self.events.add("a free group spanning ranks")
        if self.in_group() and data.draw(st.sampled_from([False, False, True]), label="clear(r) at the end"):
            self.clear_rank_both(data)
            self.agrees()
            if data.draw(st.booleans(), label="free after leaving the group"):
                self.free_some(data, allow_empty=False)
                self.agrees()
        backup = data.draw(st.sampled_from([False, True]), label="backup before the end")
        if backup:
            self.backup_both()
        self.end_group_both()
        if backup and data.draw(st.sampled_from([False, False, True]), label="restore it"):
            self.agrees()
            self.restore_both(data, latest=True)  # the released pages come back, allocated and nobody's
        elif data.draw(st.sampled_from([False, False, True]), label="end again"):
            self.agrees()
            self.events.add("free_group_end outside a group")
            self.end_group_both()  # nothing pending any more: nothing happens

    block_extras: tuple[str, ...] = ()

    def block_extra(self, step: str, data: st.DataObject) -> None:
        raise NotImplementedError

    @rule(data=st.data())
    def snapshot(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(["backup", "backup", "restore", "pickle"]), label="snapshot step")
        if step == "restore" and self.backups:
            self.restore_both(data)
        elif step == "pickle":
            self.copy_lib(data.draw(st.sampled_from(["pickle", "deepcopy"]), label="copy"))
        else:
            self.backup_both()

    def copy_lib(self, copier: str) -> None:
        """The allocator goes on as its pickled copy (or deep copy): lists, groups and pending frees with it."""
        if self.recording is not None:  # the recording is of the allocator the copy replaces
            self.end_recording()
        self.lib = pickle.loads(pickle.dumps(self.lib)) if copier == "pickle" else copy.deepcopy(self.lib)
        self.lib.check_invariants()
        pickled = "pickled" + (" in a group" if self.in_group() else "")
        self.pickled.add(pickled)
        self.events.add(pickled)

    def backup_both(self) -> None:
        self.backups = [*self.backups[-2:], (self.lib.backup_state(), self.ora.backup_state(), self.model.copy())]
        self.events.add("backup_state")
        if any(self.pending):
            self.events.add("backup_state with pending frees")

    def restore_both(self, data: st.DataObject, latest: bool = False) -> None:
        if not self.backups:
            return
        # The latest backup half the time: it may be the one taken at the end of a group.
        latest = latest or data.draw(st.booleans(), label="latest")
        lib_state, ora_state, model = self.backups[-1] if latest else data.draw(st.sampled_from(self.backups))
        if self.token and any(self.pending):
            # The original appends an in-group free at the group's end even if the
            # restored list holds the slot already (a duplicate); the allocator
            # skips it. A caller restoring over its own pending frees is wrong there.
            return
        self.lib.restore_state(lib_state)
        self.ora.restore_state(ora_state)
        self.model = model.copy()  # a state can be restored again later
        self.events.add("restore_state")
        if any(self.pending):
            self.events.add("restore_state over pending frees")

    # Only when a rank is nearly full: a clear at random would wipe the requests
    # that the other rules need, in one step out of ten.
    @precondition(lambda self: any(self.ora.available_size(r) <= self.ps for r in range(self.dp)))
    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        if data.draw(st.booleans(), label="one rank"):
            self.clear_rank_both(data)
            return
        self.lib.clear()
        self.ora.clear()
        self.model = Requests(self.dp, self.ps)
        self.pending = [set() for _ in range(self.dp)]
        self.events.add("clear()")

    def clear_rank_both(self, data: st.DataObject) -> None:
        r, kw = self.draw_rank(data)
        if self.in_group():
            self.events.add("clear(r) inside a group")
            if any(self.pending[q] for q in range(self.dp) if q != r):
                self.events.add("clear(r) keeps other ranks' pending frees")
        self.lib.clear(kw.get("dp_rank", r))  # always a rank: clear() alone clears them all
        self.ora.clear(r)
        self.model.ranks[r] = []
        self.pending[r] = set()
        self.events.add("clear(r)")

    # -- after every step ------------------------------------------------------------

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "lib"):
            return
        compare(self.lib, self.ora)
        self.model.check(self.ora)
        for r in range(self.dp):
            assert pending_pages(self.lib, r) == self.pending[r], f"rank {r} group buffer"
        if self.lib.track:
            self.tracking_agrees()

    def tracking_agrees(self) -> None:
        ps = self.ps
        for r in range(self.dp):
            held = oracle_allocated(self.ora, r) - self.pending[r]
            records = self.lib.outstanding(dp_rank=r)
            assert sum(o.pages for o in records) == len(held), f"rank {r}: outstanding() is not what is allocated"
            assert sum(o.slots for o in records) == len(held) * ps
            assert all(o.file == __file__ for o in records), [o.site for o in records]
            assert {o.tag for o in records} <= set(TAGS)
            claimed = [p * ps + ps - 1 for p in self.model.held(r)]  # any slot of a page names it
            lost = held - self.model.held(r)
            left = self.lib.outstanding(dp_rank=r, exclude=claimed)
            assert sum(o.pages for o in left) == len(lost), f"rank {r}: exclude= left {left}, expected {lost}"
            self.events.add("tracked pages nobody holds" if lost else "tracked")

    def tag_for(self, data: st.DataObject) -> dict[str, Any]:
        """``tag=`` for an ``alloc`` now and then, on a tracking allocator."""
        if not self.lib.track or not data.draw(st.booleans(), label="tag"):
            return {}
        return {"tag": data.draw(st.sampled_from(TAGS), label="tag value")}

    def tags_for(self, data: st.DataObject, n: int) -> dict[str, Any]:
        """``tags=`` for a batch of ``n`` requests now and then, on a tracking allocator."""
        if not self.lib.track or not data.draw(st.booleans(), label="tags"):
            return {}
        return {"tags": data.draw(st.lists(st.sampled_from(TAGS), min_size=n, max_size=n), label="tag list")}

    # Implemented by each machine: used by free_group_block.
    def free_some(self, data: st.DataObject, allow_empty: bool = True) -> int | None:
        raise NotImplementedError

    def allocate_some(self, data: st.DataObject) -> None:
        raise NotImplementedError


class PagedMachine(_Machine):
    @initialize(pages=st.sampled_from([1, 2, 3, 3, 4, 4, 5, 6]), data=st.data())
    def make(self, pages: int, data: st.DataObject) -> None:
        ps, dp = self.ps, self.dp
        # A size that is no multiple of anything: spare pages beyond dp * pages and
        # spare slots beyond the last page are not the ranks'.
        num_pages = dp * pages + data.draw(st.integers(0, dp - 1), label="spare pages")
        size = num_pages * ps + data.draw(st.integers(0, ps - 1), label="spare slots")
        debug = data.draw(st.booleans(), label="debug_mode")
        track = data.draw(st.booleans(), label="track")
        lib = PagedTokenToKVPoolAllocator(size, ps, None, debug_mode=debug, dp_size=dp, strict=self.strict, track=track)
        ora = oracle_mod.PagedTokenToKVPoolAllocator(size, ps, None, debug_mode=debug, dp_size=dp)
        assert (lib.pages_per_rank, ora.pages_per_rank) == (pages, pages)
        self.setup(lib, ora)
        self.events.add(f"debug_mode {debug}")

    # -- allocation ---------------------------------------------------------------

    def refused_or_merged(self, call: str, r: int, want: Any, released_before: int) -> None:
        """Record whether the call merged (the oracle's release list emptied) and whether it was refused."""
        merged = released_before > 0 and len(self.ora.release_pages[r]) == 0
        if want is None:
            self.events.add(f"{call} refused")
            if merged:
                self.events.add(f"{call} refused after merging")
        else:
            self.events.add(call)
            if merged:
                self.events.add(f"{call} merged")

    def draw_extension(self, data: st.DataObject, prefix: int) -> int:
        """Tokens to add: none, one, up to the page end, one page more, or any up to two pages and a bit."""
        ps = self.ps
        to_page_end = -prefix % ps
        return data.draw(
            st.sampled_from([to_page_end or ps, 1, to_page_end + ps, 0]) | st.integers(1, 2 * ps + 1),
            label="extension",
        )

    def beyond_free_list(self, data: st.DataObject, r: int) -> int:
        """A number of pages beyond the rank's free list: served after a merge, or refused after one."""
        free = len(self.ora.free_pages[r])
        available = self.ora.available_size(r) // self.ps
        # Both ends often: one more than everything (refused, after the merge), one page
        # more than the free list (a merge serves it, if pages were released).
        kind = data.draw(st.sampled_from(["refused", "merged", "any"]), label="beyond")
        if kind == "refused":
            return available + 1
        if kind == "merged":
            return free + 1
        return data.draw(st.integers(free + 1, available + 1), label="pages beyond the free list")

    def ensure_live(self, data: st.DataObject, r: int) -> None:
        """Half the time, make sure rank ``r`` has a request at a page end and one inside a page.

        What the continuing extends and decodes need: without them, a run may go
        long without a live request of each kind. One page (``alloc``) is a
        request at a page end; a new request's first token (``alloc_decode``)
        one inside its page (page size > 1). Both are compared like any call.
        """
        if not data.draw(st.booleans(), label="ensure live requests"):
            return
        ps = self.ps
        reqs = self.model.ranks[r]
        if not any(len(q) % ps == 0 for q in reqs):
            got, want = self.lib.alloc(ps, dp_rank=r), self.ora.alloc(ps, dp_rank=r)
            check_array(got, want, np.int64)
            if want is not None:
                reqs.append(want.tolist())
            self.agrees()
        if ps > 1 and not any(len(q) % ps for q in reqs):
            got, want = self.lib.alloc_decode([1], [-1], dp_rank=r), self.ora.alloc_decode([1], [-1], dp_rank=r)
            check_array(got, want, np.int32)
            if want is not None:
                reqs.append(want.tolist())
            self.agrees()

    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        r, kw = self.draw_rank(data, self.busy_ranks(data))
        ps = self.ps
        mode = "sized" if self.beyond else data.draw(st.sampled_from(["continue", "batch", "continue", "sized"]))
        if mode == "continue":
            self.ensure_live(data, r)
        reqs = self.model.ranks[r]
        live = list(range(len(reqs)))
        batch: list[tuple[int | None, int]] = []  # (live request or None for a new one, extension)
        if mode == "continue" and live:
            # Live requests continued (by up to a page beyond their current one) beside a new one.
            picked = set(data.draw(st.lists(st.sampled_from(live), max_size=2), label="reqs"))
            for inside in (False, True):  # one at a page end, one inside its page, half the time each
                fitting = [i for i in live if (len(reqs[i]) % ps != 0) == inside]
                if fitting and (not picked or data.draw(st.booleans(), label="inside" if inside else "at an end")):
                    picked.add(data.draw(st.sampled_from(fitting), label="request"))
            for i in sorted(picked):
                # Mostly within the current page (no new page: served even by a full rank).
                to_page_end = -len(reqs[i]) % ps
                within = st.integers(1, to_page_end) if to_page_end else st.just(ps)
                batch.append((i, data.draw(within | st.integers(1, ps + 1), label="extension")))
            if data.draw(st.booleans(), label="and a new request"):
                batch.insert(data.draw(st.integers(0, len(batch)), label="at"), (None, data.draw(st.integers(1, ps))))
        elif mode == "sized":
            # One new request needing more pages than the free list holds (the last
            # one partly used), and maybe a live request that stays within its page.
            batch.append((None, self.beyond_free_list(data, r) * ps - data.draw(st.integers(0, ps - 1))))
            if live and data.draw(st.booleans(), label="with a live request"):
                i = data.draw(st.sampled_from(live), label="request")
                batch.insert(data.draw(st.integers(0, 1), label="at"), (i, -len(reqs[i]) % ps))
        else:
            for _ in range(data.draw(st.integers(1, 4) | st.just(0), label="batch")):
                i = None
                if live and data.draw(st.sampled_from([True, True, False]), label="existing"):
                    i = live.pop(data.draw(st.integers(0, len(live) - 1), label="request"))
                batch.append((i, self.draw_extension(data, 0 if i is None else len(reqs[i]))))
        prefix = [0 if i is None else len(reqs[i]) for i, _ in batch]
        last = [-1 if i is None else reqs[i][-1] for i, _ in batch]
        seq = [p + ext for p, (_, ext) in zip(prefix, batch, strict=True)]
        total: Any = sum(ext for _, ext in batch)
        if data.draw(st.booleans(), label="numpy total"):
            total = np.int64(total)
        form = data.draw(st.sampled_from(FORMS), label="form")
        args = [as_form(v, form) for v in (prefix, seq, last)]
        released = len(self.ora.release_pages[r])
        got = self.lib.alloc_extend(*args, total, **kw, **self.tags_for(data, len(batch)))
        want = self.ora.alloc_extend(*args, total, **kw)
        check_array(got, want, np.int32)
        self.refused_or_merged("alloc_extend", r, want, released)
        self.events.add(f"alloc_extend as {form}")
        if want is None:
            return
        pos = 0
        for (i, ext), p in zip(batch, prefix, strict=True):
            new = want[pos : pos + ext].tolist()
            pos += ext
            if ext and i is not None:
                self.events.add("alloc_extend prefix mid-page" if p % ps else "alloc_extend prefix at a page end")
            if i is None:
                if new:
                    reqs.append(new)
            else:
                reqs[i].extend(new)
        kinds = {i is None for i, ext in batch if ext}
        if kinds == {True, False}:
            self.events.add("alloc_extend mixing new and live requests")

    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        r, kw = self.draw_rank(data, self.busy_ranks(data))
        ps = self.ps
        self.ensure_live(data, r)
        reqs = self.model.ranks[r]
        # Live requests, one at a page end (it takes a new page) and one inside its page
        # (it continues there) half the time each; then no new request, a few, or a burst
        # of new ones (a page each) beyond the free list.
        chosen: set[int] = set()
        if reqs:
            chosen |= set(data.draw(st.lists(st.integers(0, len(reqs) - 1), max_size=3), label="reqs"))
        for inside in (False, True):
            fitting = [i for i, q in enumerate(reqs) if (len(q) % ps != 0) == inside]
            if fitting and data.draw(st.booleans(), label="inside a page" if inside else "at a page end"):
                chosen.add(data.draw(st.sampled_from(fitting), label="request"))
        if self.beyond or data.draw(st.sampled_from([False, False, True]), label="burst"):
            new = self.beyond_free_list(data, r)
        else:
            new = data.draw(st.sampled_from([0, 0, 1, 2]), label="new")
        order: list[int | None] = data.draw(st.permutations([*sorted(chosen), *[None] * new]), label="order")
        seq = [1 if i is None else len(reqs[i]) + 1 for i in order]
        last = [-1 if i is None else reqs[i][-1] for i in order]
        form = data.draw(st.sampled_from(FORMS), label="form")
        released = len(self.ora.release_pages[r])
        got = self.lib.alloc_decode(as_form(seq, form), as_form(last, form), **kw, **self.tags_for(data, len(seq)))
        want = self.ora.alloc_decode(as_form(seq, form), as_form(last, form), **kw)
        check_array(got, want, np.int32)
        self.refused_or_merged("alloc_decode", r, want, released)
        self.events.add(f"alloc_decode as {form}")
        if want is None:
            return
        for i, s, slot in zip(order, seq, want.tolist(), strict=True):
            if i is None:
                reqs.append([slot])
            else:
                reqs[i].append(slot)
            if s > 1:
                self.events.add("alloc_decode new page" if (s - 1) % ps == 0 else "alloc_decode same page")

    @rule(data=st.data())
    def alloc_pages(self, data: st.DataObject) -> None:
        r, kw = self.draw_rank(data)
        ps = self.ps
        available = self.ora.available_size(r) // ps
        kinds = ["fits"] * 3 if available else []
        kinds += ["beyond the free list"] * (3 if len(self.ora.release_pages[r]) else 1) + ["zero", "beyond the rank"]
        kind = "beyond the free list" if self.beyond else data.draw(st.sampled_from(kinds), label="kind")
        if kind == "fits":
            k = data.draw(st.integers(1, available), label="pages")
        elif kind == "beyond the free list":
            k = self.beyond_free_list(data, r)  # merges first if pages were released; refused if still short
        elif kind == "zero":
            k = 0  # takes nothing, merges nothing
        else:
            k = self.ora.pages_per_rank + 1
        need: Any = k * ps
        if data.draw(st.booleans(), label="numpy need"):
            need = np.int64(need)
        released = len(self.ora.release_pages[r])
        got = self.lib.alloc(need, **kw, **self.tag_for(data))
        want = self.ora.alloc(need, **kw)
        check_array(got, want, np.int64)
        self.refused_or_merged("alloc", r, want, released)
        if want is not None and len(want):
            # Whole pages: a request whose prefix ends at a page end.
            self.model.ranks[r].append(want.tolist())
        elif want is not None:
            self.events.add("alloc(0)")

    def allocate_some(self, data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from(["extend", "extend", "decode", "alloc"]), label="allocation")
        {"extend": self.extend, "decode": self.decode, "alloc": self.alloc_pages}[kind](data)

    block_extras = ("merge",)

    def block_extra(self, step: str, data: st.DataObject) -> None:
        assert step == "merge"
        self.merge(data)

    # -- freeing --------------------------------------------------------------------

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        r = self.free_some(data)
        if r is None or not len(self.ora.release_pages[r]):
            return
        # Then, as a scheduler may: merge, or ask for more pages than the free list
        # holds: the released pages merge first, and serve it or not.
        then = data.draw(st.sampled_from(["nothing", "merge", "alloc", "extend", "decode"]), label="then")
        if then == "nothing":
            return
        self.agrees()
        self.only_rank, self.beyond = r, True
        try:
            {"merge": self.merge, "alloc": self.alloc_pages, "extend": self.extend, "decode": self.decode}[then](data)
        finally:
            self.only_rank, self.beyond = None, False

    def free_some(self, data: st.DataObject, allow_empty: bool = True) -> int | None:
        """One free of some kind, mostly on a rank with requests; returns the rank, or None if nothing was freed."""
        r, kw = self.draw_rank(data, self.ranks_to_free(data))
        ps = self.ps
        in_group = self.in_group()
        reqs = self.model.ranks[r]
        # strict=True: a page already pending in a group is a DoubleFreeError (the
        # original ignores it), also after clear() of another rank left the group
        # with the page still pending: such requests (restored ones) are left alone.
        freeable = [q for q in reqs if not (self.strict and set(self.model.pages(q)) & self.pending[r])]
        allocated = oracle_allocated(self.ora, r)
        leaked = sorted(allocated - self.model.held(r) - self.pending[r])  # nobody holds them (restores, groups)
        listed = sorted(set(range(1, self.ora.pages_per_rank + 1)) - allocated)
        kinds = ["whole", "suffix", "overlap"] * 3 if freeable else []
        kinds += ["leaked"] * 3 if leaked else []
        # Pages already free are ignored by both, outside groups (inside one the
        # original would free them at the end even if handed out again meanwhile).
        kinds += ["stale"] if listed and not in_group and not self.strict else []
        kinds += ["empty"] if allow_empty else []
        if not kinds:
            return None
        kind = data.draw(st.sampled_from(kinds), label="free kind")
        slots: list[int] = []
        if kind == "whole":
            picked = data.draw(st.lists(st.sampled_from(freeable), min_size=1, max_size=2, unique_by=id), label="reqs")
            for q in picked:
                slots += q[::-1] if data.draw(st.booleans(), label="reversed") else q
        elif kind == "suffix":
            q = data.draw(st.sampled_from(freeable), label="request")
            slots = q[data.draw(st.integers(0, len(q) - 1), label="from") :]
        elif kind == "overlap":
            # Ranges [k, m2) and [m1, n) with m1 < m2 share tokens; their union is the suffix from k.
            for q in data.draw(st.lists(st.sampled_from(freeable), min_size=1, max_size=2, unique_by=id), label="rs"):
                k = data.draw(st.integers(0, len(q) - 1), label="from")
                m1 = data.draw(st.integers(k, len(q) - 1), label="m1")
                m2 = data.draw(st.integers(m1 + 1, len(q)), label="m2")
                slots += q[k:m2] + q[m1:]
        elif kind == "leaked":
            pages = data.draw(st.lists(st.sampled_from(leaked), min_size=1, unique=True), label="pages")
            slots = [p * ps + data.draw(st.integers(0, ps - 1), label="offset") for p in pages]
        elif kind == "stale":
            pages = data.draw(st.lists(st.sampled_from(listed), min_size=1, max_size=3), label="pages")
            slots = [p * ps + data.draw(st.integers(0, ps - 1), label="offset") for p in pages]
            if freeable and data.draw(st.booleans(), label="with a request"):
                slots += data.draw(st.sampled_from(freeable), label="request")
        forms = [*FORMS, "2d"] if not in_group and slots else FORMS
        self.free_both(r, slots, data.draw(st.sampled_from(forms), label="form"), kw)
        self.events.add(f"free {kind}")
        return r if slots else None

    @rule(data=st.data())
    def merge(self, data: st.DataObject) -> None:
        r, kw = self.draw_rank(data)
        released = len(self.ora.release_pages[r])
        assert self.lib.merge_and_sort_free(**kw) is None
        self.ora.merge_and_sort_free(**kw)
        self.events.add("merge_and_sort_free" if released else "merge_and_sort_free with nothing released")


class TokenMachine(_Machine):
    token = True

    @initialize(per_rank=st.integers(1, 8), data=st.data())
    def make(self, per_rank: int, data: st.DataObject) -> None:
        dp = self.dp
        size = dp * per_rank + data.draw(st.integers(0, dp - 1), label="spare slots")
        lib = TokenToKVPoolAllocator(size, None, dp_size=dp, track=data.draw(st.booleans(), label="track"))
        ora = oracle_mod.TokenToKVPoolAllocator(size, None, dp_size=dp)
        assert (lib.size_per_rank, ora.size_per_rank) == (per_rank, per_rank)
        self.setup(lib, ora)

    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        self.allocate_some(data)

    @rule(data=st.data())
    def alloc_again(self, data: st.DataObject) -> None:
        # Allocations and frees as often as the other rules together: the pools cycle.
        self.allocate_some(data)

    def allocate_some(self, data: st.DataObject) -> None:
        r, kw = self.draw_rank(data)
        n = data.draw(st.integers(0, self.ora.size_per_rank + 1), label="need")
        got = self.lib.alloc(n, **kw, **self.tag_for(data))
        want = self.ora.alloc(n, **kw)
        check_array(got, want, np.int32)
        if want is None:
            self.events.add("alloc refused")
        elif len(want):
            self.events.add("alloc")
            self.model.ranks[r].append(want.tolist())

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.free_some(data)

    @rule(data=st.data())
    def free_again(self, data: st.DataObject) -> None:
        self.free_some(data)

    @rule(data=st.data())
    def merge(self, data: st.DataObject) -> None:
        # The original inherits a merge that fails (no page lists); hostpool_nb's has nothing to merge.
        _, kw = self.draw_rank(data)
        assert self.lib.merge_and_sort_free(**kw) is None
        with pytest.raises(TypeError):
            self.ora.merge_and_sort_free(**kw)
        self.events.add("merge_and_sort_free, nothing to merge")

    @rule(data=st.data(), decode=st.booleans())
    def batch(self, data: st.DataObject, decode: bool) -> None:
        # A paged allocator's call: NotImplementedError from both, nothing changes (the invariant).
        _, kw = self.draw_rank(data)
        name, args = ("alloc_decode", ([2], [1])) if decode else ("alloc_extend", ([0], [1], [-1], 1))
        with pytest.raises(PagedOnlyError, match=f"^{name} is only for paged allocator: "):
            getattr(self.lib, name)(*args, **kw)
        with pytest.raises(NotImplementedError, match=f"^{name} is only for paged allocator$"):
            getattr(self.ora, name)(*args, **kw)
        self.events.add(f"{name} refused: not paged")

    def free_some(self, data: st.DataObject, allow_empty: bool = True) -> int | None:
        r, kw = self.draw_rank(data, self.ranks_to_free(data))
        held = [s for q in self.model.ranks[r] for s in q]
        if not held:
            if allow_empty:
                self.free_both(r, [], data.draw(st.sampled_from(FORMS), label="form"), kw)
                self.events.add("free empty")
            return None
        # Any held slots, from any requests, in any order: appended in that order.
        chosen = data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True), label="slots")
        chosen = data.draw(st.permutations(chosen), label="order")
        forms = [*FORMS, "2d"] if not self.in_group() else FORMS
        self.free_both(r, chosen, data.draw(st.sampled_from(forms), label="form"), kw)
        if len(chosen) > 1 and chosen != sorted(chosen):
            self.events.add("free out of order")
        return r


# Each run's share of the loaded profile's examples: 17 runs share the time budget.
SHARE = 0.4


def _examples(share: float) -> settings:
    """The loaded profile's examples, scaled: several parametrized runs share the time budget."""
    return settings(settings.default, max_examples=max(10, int(settings.default.max_examples * share)))


PAGED_EVENTS = {
    "debug_mode True",
    "debug_mode False",
    # Allocations, served and refused, with and without the merge before.
    "alloc_extend",
    "alloc_extend refused",
    "alloc_extend refused after merging",
    "alloc_extend merged",
    "alloc_extend prefix at a page end",
    "alloc_extend mixing new and live requests",
    "alloc_decode",
    "alloc_decode refused",
    "alloc_decode merged",
    "alloc_decode new page",
    "alloc",
    "alloc(0)",
    "alloc refused",
    "alloc refused after merging",
    "alloc merged",
    *(f"alloc_extend as {f}" for f in FORMS),
    *(f"alloc_decode as {f}" for f in FORMS),
    # Frees of every kind and form, and merges.
    "free whole",
    "free suffix",
    "free overlap",
    "free leaked",
    "free empty",
    *(f"free as {f}" for f in [*FORMS, "2d"]),
    "merge_and_sort_free",
    "merge_and_sort_free with nothing released",
    # Free groups, snapshots, clears.
    "free_group_begin",
    "free_group_begin inside a group",
    "free_group_end outside a group",
    "free_group_end released",
    "free inside a group",
    "backup_state",
    "restore_state",
    "restore_state over pending frees",
    "clear(r)",
    "clear(r) inside a group",
    "clear()",
    # Tracking: every page held accounted for, and the pages nobody holds found.
    "tracked",
    "tracked pages nobody holds",
    # Recordings, replayed.
    "recording replayed",
    "recording begun with frees pending",
}
# Only with several ranks.
MULTI_RANK_EVENTS = {"a free group spanning ranks", "clear(r) keeps other ranks' pending frees"}
# What every single run must reach: each rule, each allocation served and refused.
PAGED_RULES = {
    "alloc_extend",
    "alloc_extend refused",
    "alloc_decode",
    "alloc_decode refused",
    "alloc",
    "alloc refused",
    "free whole",
    "free suffix",
    "free overlap",
    "free inside a group",
    "merge_and_sort_free",
    "free_group_begin",
    "free_group_end released",
    "backup_state",
    "restore_state",
    "pickled",
    "clear(r)",
    "clear()",
}
TOKEN_RULES = {"alloc", "alloc refused", "free inside a group", "free_group_end released", "restore_state", "clear()"}


def paged_events(page_size: int, strict: bool) -> set[str]:
    """What the runs of one page size must reach together."""
    events = PAGED_EVENTS | MULTI_RANK_EVENTS
    if page_size > 1:  # with one slot per page every prefix ends at a page end, every decode takes a page
        events |= {"alloc_extend prefix mid-page", "alloc_decode same page"}
    if not strict:
        events |= {"free stale"}
    return events


TOKEN_EVENTS = {
    "tracked",
    "recording replayed",
    "recording begun with frees pending",
    "alloc",
    "alloc refused",
    "free empty",
    "free out of order",
    *(f"free as {f}" for f in [*FORMS, "2d"]),
    "free inside a group",
    "free_group_begin",
    "free_group_begin inside a group",
    "free_group_end outside a group",
    "free_group_end released",
    "backup_state",
    "restore_state",
    "pickled",
    "pickled in a group",
    "clear(r)",
    "clear(r) inside a group",
    "clear()",
    "merge_and_sort_free, nothing to merge",
    "alloc_extend refused: not paged",
    "alloc_decode refused: not paged",
}


class Events(set[str]):
    """The rules and situations a test's runs reached, and how often (to see how close to missing one was)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def add(self, event: str) -> None:
        self.counts[event] += 1
        super().add(event)


def run_machine(machine: type[_Machine], page_size: int, dp_size: int, strict: bool, share: float) -> Events:
    """Run ``machine``'s examples; return what they reached.

    One factory for every run: hypothesis derives a derandomized run's seed
    from the factory's source, so each test here draws the same sequences
    however it is called.
    """
    events = Events()
    run_state_machine_as_test(lambda: machine(page_size, dp_size, strict, events), settings=_examples(share))
    return events


def assert_reached(events: Events, expected: set[str], what: str) -> None:
    missing = expected - events
    rarest = sorted((events.counts[e], e) for e in expected & events)[:3]
    assert not missing, f"{what} never reached: {sorted(missing)} (the rarest reached: {rarest})"


def run_all(machine: type[_Machine], shapes: list[tuple[int, int]], strict: bool, rules: set[str]) -> Events:
    """Run the machine at each (page_size, dp_size); each run must reach ``rules``; return all they reached."""
    reached = Events()
    for page_size, dp_size in shapes:
        events = run_machine(machine, page_size, dp_size, strict, SHARE)
        assert_reached(events, rules | (MULTI_RANK_EVENTS if dp_size > 1 else set()), f"{(page_size, dp_size)}")
        reached |= events
        reached.counts += events.counts
    return reached


@pytest.mark.slow
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_matches_oracle(page_size: int) -> None:
    reached = run_all(PagedMachine, [(page_size, dp) for dp in (1, 2, 3)], False, PAGED_RULES)
    assert_reached(reached, paged_events(page_size, strict=False), "the runs at dp_size 1, 2 and 3")


@pytest.mark.slow
def test_strict_paged_matches_oracle() -> None:
    # strict=True must change nothing for callers that never free a free page.
    reached = run_all(PagedMachine, [(2, 2), (16, 3)], True, PAGED_RULES)
    assert_reached(reached, paged_events(2, strict=True), "the strict runs")


@pytest.mark.slow
def test_token_matches_oracle() -> None:
    reached = run_all(TokenMachine, [(1, dp) for dp in (1, 2, 3)], False, TOKEN_RULES)
    assert_reached(reached, TOKEN_EVENTS | MULTI_RANK_EVENTS, "the runs at dp_size 1, 2 and 3")
