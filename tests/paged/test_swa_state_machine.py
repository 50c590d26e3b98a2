"""Differential state machine: hostpool_nb.paged.SWATokenToKVPoolAllocator against the oracle of the originals.

Hypothesis drives the allocator and the oracle (docs/behaviour.md section 3, in
numpy, ``hostpool_nb.originals.paged``) with the same calls, as a
scheduler of a hybrid model makes them: ``alloc`` of whole pages (or
slots at page size 1), ``alloc_extend`` batches of new and live requests
and ``alloc_decode`` batches (page size > 1), frees of whole requests and
of their last pages, ``free_swa`` of a request's oldest tokens (those that
left the window), free groups, ``clear(r)`` and ``clear()``, on 1 or 2
ranks of a few pages, the SWA side smaller or larger than the full one,
so that either side refuses often. ``backup_state`` / ``restore_state``
(the oracle has none) are checked against a deep copy of the oracle taken
at the backup.

After every step: the results and dtypes, both sub-allocators' lists and
sizes, every rank's mapping and ``available_size`` equal the oracle's, and
``check_invariants()`` passes. At page size 1 a second free of a slot is a
``DoubleFreeError`` that changes nothing (the oracle would list the slot
twice, and is not called).

Where the allocator and the oracle differ on purpose (``hostpool_nb.paged``'s docstring): an
``alloc_extend`` / ``alloc_decode`` the full side could serve and the SWA
side cannot is refused here without taking and freeing the full side's
pages; the machine does not make such calls (a test in
``test_swa.py`` checks that case).
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hostpool_nb import DoubleFreeError, HostPoolError
from hostpool_nb import replay as R
from hostpool_nb import trace as T
from hostpool_nb.originals import paged as oracle_mod
from hostpool_nb.paged import SWATokenToKVPoolAllocator
from tests.paged.test_paged_state_machine import Events, _examples, assert_reached
from tests.paged_model import oracle_allocated, pending_pages


def hybrid() -> Any:
    return SimpleNamespace(full_kv_pool=object(), swa_kv_pool=object())


def lists(sub: Any, r: int) -> tuple[Any, ...]:
    if getattr(sub, "free_pages", None) is not None:  # the token allocator's is None
        return tuple(sub.free_pages[r].tolist()), tuple(sorted(sub.release_pages[r].tolist()))
    return (tuple(sub.free_slots[r].tolist()),)


class SWAMachine(RuleBasedStateMachine):
    def __init__(self, page_size: int, dp_size: int, events: Events) -> None:
        super().__init__()
        self.ps = page_size
        self.dp = dp_size
        self.events = events

    @initialize(full=st.integers(2, 6), swa=st.integers(1, 7), taken=st.integers(0, 2), track=st.booleans())
    def make(self, full: int, swa: int, taken: int, track: bool) -> None:
        ps, dp = self.ps, self.dp
        self.lib = SWATokenToKVPoolAllocator(
            dp * full * ps, dp * swa * ps, hybrid(), page_size=ps, dp_size=dp, track=track
        )
        self.ora = oracle_mod.SWATokenToKVPoolAllocator(
            dp * full * ps, dp * swa * ps, hybrid(), page_size=ps, dp_size=dp
        )
        for a in (self.lib, self.ora):  # SWA pages held by others: the two sides' slot ids differ
            for r in range(dp):
                a.swa_attn_allocator.alloc(min(taken, swa - 1) * ps, r)
        self.reqs: list[list[list[int]]] = [[] for _ in range(dp)]  # per rank: each request's full slots in order
        self.pending: list[list[list[int]]] = [[] for _ in range(dp)]  # slots freed in the open group
        self.backups: list[tuple[Any, Any, list[list[list[int]]]]] = []
        self.mapping = self.lib.full_to_swa_index_mapping  # the same object for the allocator's life
        self.recording: tuple[Any, str] | None = None
        self.reached: set[str] = set()  # this example's events, for wants()

    # -- recordings: a stretch of the run, replayed on a fresh allocator (and the original, if it can) -------

    def wants(self, event: str) -> bool:
        """Whether this example has not reached ``event`` yet: rules steer towards what every run must reach.

        Per example, not per run: hypothesis replays an example (to shrink
        it) and must see the same draws, so the steering may depend only on
        the example's own steps.
        """
        return event not in self.reached

    def reach(self, event: str) -> None:
        self.reached.add(event)
        self.events.add(event)

    @rule(data=st.data())
    def record(self, data: st.DataObject) -> None:
        if self.recording is not None:
            self.end_recording()
            return
        if not hasattr(self, "tmp"):
            self.tmp = tempfile.mkdtemp(prefix="swa-machine-")
        path = os.path.join(self.tmp, "t.npz")
        if self.wants("recording refused with frees pending") and not any(self.pending) and any(self.reqs):
            # Steered, whatever the profile's budget: a free pending in a group, for the recording to refuse.
            if self.lib.is_not_in_free_group:
                self.group(data)
            self.free(data)
        block = self.lib.recording(path)
        if any(self.pending):
            with pytest.raises(HostPoolError, match="no frees pending"):
                block.__enter__()
            self.reach("recording refused with frees pending")
            return
        block.__enter__()
        self.recording = (block, path)

    def end_recording(self) -> None:
        block, path = self.recording  # type: ignore[misc]  # recording
        self.recording = None
        block.__exit__(None, None, None)
        trace = T.load(path)
        done, skipped, divergence = R.replay(trace)
        assert divergence is None, f"the recording's replay: {divergence}"
        assert (done, skipped) == (len(trace), 0)
        if R.original_problem(trace) is None:
            original = R._original_allocator_at_start(trace)
            R._check_original_ranked(original, R._ranked_plan(trace, False, original))
            self.events.add("recording replayed on the original")
        os.unlink(path)
        self.events.add("recording replayed")

    def teardown(self) -> None:
        if self.recording is not None:
            self.end_recording()
        if hasattr(self, "tmp"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- helpers ----------------------------------------------------------------------

    def rank(self, data: st.DataObject) -> int:
        return data.draw(st.integers(0, self.dp - 1), label="rank")

    def maps(self, a: Any) -> list[list[int]]:
        m = a.full_to_swa_index_mapping
        return [x.tolist() for x in (m if self.dp > 1 else [m])]

    def pages_available(self, a: Any, r: int) -> tuple[int, int]:
        return a.full_available_size(r) // self.ps, a.swa_available_size(r) // self.ps

    def held(self, r: int) -> set[int]:
        return {s for q in self.reqs[r] for s in q} | {s for f in self.pending[r] for s in f}

    # -- rules ------------------------------------------------------------------------------

    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        r = self.rank(data)
        n = (
            data.draw(st.integers(0, self.lib.full_attn_allocator.size_per_rank // self.ps + 1), label="pages")
            * self.ps
        )
        got, want = self.lib.alloc(n, r), self.ora.alloc(n, r)
        check(got, want)
        self.events.add("alloc refused" if want is None else "alloc")
        if want is not None and len(want):
            self.reqs[r].append(want.tolist())

    def _batch_fits(self, r: int, pages: int) -> bool:
        full, swa = self.pages_available(self.ora, r)
        return not (pages <= full and pages > swa)  # the case where the two differ on purpose

    @precondition(lambda self: self.ps > 1)
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        r = self.rank(data)
        ps = self.ps
        live = self.reqs[r]
        picked = data.draw(st.lists(st.integers(0, max(len(live) - 1, 0)), max_size=2, unique=True), label="live")
        picked = [i for i in picked if i < len(live)]
        batch: list[tuple[int | None, int]] = [(i, data.draw(st.integers(0, 2 * ps), label="ext")) for i in picked]
        batch += [(None, data.draw(st.integers(1, 2 * ps), label="new")) for _ in range(data.draw(st.integers(0, 2)))]
        prefix = [0 if i is None else len(live[i]) for i, _ in batch]
        last = [-1 if i is None else live[i][-1] for i, _ in batch]
        seq = [p + e for p, (_, e) in zip(prefix, batch, strict=True)]
        pages = sum(-(-s // ps) - -(-p // ps) for p, s in zip(prefix, seq, strict=True))
        if not self._batch_fits(r, pages):
            self.events.add("alloc_extend skipped: the SWA side alone is short")
            return
        total = sum(e for _, e in batch)
        got = self.lib.alloc_extend(prefix, seq, last, total, r)
        want = self.ora.alloc_extend(prefix, seq, last, total, r)
        check(got, want)
        self.events.add("alloc_extend refused" if want is None else "alloc_extend")
        if want is None:
            return
        pos = 0
        for i, e in batch:
            new = want[pos : pos + e].tolist()
            pos += e
            if i is None:
                if new:
                    live.append(new)
            else:
                live[i].extend(new)

    @precondition(lambda self: self.ps > 1 and any(self.reqs))
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from([q for q in range(self.dp) if self.reqs[q]]), label="rank")
        live = self.reqs[r]
        chosen = data.draw(st.lists(st.integers(0, len(live) - 1), min_size=1, max_size=3, unique=True), label="reqs")
        seq = [len(live[i]) + 1 for i in chosen]
        last = [live[i][-1] for i in chosen]
        pages = sum(1 for s in seq if (s - 1) % self.ps == 0)
        if not self._batch_fits(r, pages):
            self.events.add("alloc_decode skipped: the SWA side alone is short")
            return
        got, want = self.lib.alloc_decode(seq, last, r), self.ora.alloc_decode(seq, last, r)
        check(got, want)
        self.events.add("alloc_decode refused" if want is None else "alloc_decode")
        if want is not None:
            for i, x in zip(chosen, want.tolist(), strict=True):
                live[i].append(x)

    @precondition(lambda self: any(self.reqs))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from([q for q in range(self.dp) if self.reqs[q]]), label="rank")
        live = self.reqs[r]
        i = data.draw(st.integers(0, len(live) - 1), label="request")
        q = live[i]
        k = data.draw(st.sampled_from([0, len(q) // 2]), label="from")
        k -= k % self.ps  # whole pages: freeing a token frees its page
        freed = q[k:]
        if k:
            live[i] = q[:k]
        else:
            live.pop(i)
        got = self.lib.free(np.array(freed, dtype=np.int64), r)
        assert self.ora.free(np.array(freed, dtype=np.int64), r) is None
        assert type(got) is int
        if not self.lib.is_not_in_free_group:
            self.pending[r].append(freed)
            self.events.add("free in a group")
        else:
            self.events.add("free")

    @precondition(lambda self: any(self.reqs))
    @rule(data=st.data())
    def free_swa(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from([q for q in range(self.dp) if self.reqs[q]]), label="rank")
        q = data.draw(st.sampled_from(self.reqs[r]), label="request")
        # Whole pages before the request's last one, as a window slides (at page size 1 any
        # tokens but the last): a request that goes on has its last token's SWA slot.
        ps = self.ps
        whole = (len(q) - 1) // ps * ps
        left = q[: data.draw(st.integers(0, whole // ps), label="pages that left the window") * ps]
        if self.wants("free_swa"):
            left = q[:whole]  # steered: each run frees some SWA slots, whatever the profile's budget
        before = self.ora.count_swa_mapped(left, r) if left else 0
        assert self.lib.count_swa_mapped(left, r) == before
        got = self.lib.free_swa(left, r)
        self.ora.free_swa(left, r)
        assert got == before
        self.reach("free_swa" if got else "free_swa of nothing mapped")

    @rule(data=st.data())
    def merge(self, data: st.DataObject) -> None:
        # The original inherits a merge that fails here; hostpool_nb's merges each side, as its name says.
        r = self.rank(data)
        released = [len(a.release_pages[r]) for a in self._paged_sides(self.ora)]
        assert self.lib.merge_and_sort_free(r) is None
        with pytest.raises(TypeError):
            self.ora.merge_and_sort_free(r)
        for side in self._paged_sides(self.ora):
            side.merge_and_sort_free(r)
        self.events.add("merge_and_sort_free" if any(released) else "merge_and_sort_free with nothing released")

    def _paged_sides(self, a: Any) -> list[Any]:
        """The sub-allocators that keep page lists: both above page size 1, none at it."""
        return [] if self.ps == 1 else [a.full_attn_allocator, a.swa_attn_allocator]

    @precondition(lambda self: self.ps == 1 and any(self.reqs))
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        # A slot freed again at page size 1: an error, and nothing changes (the oracle is not called).
        r = data.draw(st.sampled_from([q for q in range(self.dp) if self.reqs[q]]), label="rank")
        pool = sorted(set(range(1, self.lib.full_attn_allocator.size_per_rank + 1)) - self.held(r))
        if not pool:
            return
        slot = data.draw(st.sampled_from(pool), label="slot")
        before = (self.state(self.lib), self.maps(self.lib))
        with pytest.raises(DoubleFreeError):
            self.lib.free([slot], r)
        assert (self.state(self.lib), self.maps(self.lib)) == before
        self.events.add("double free refused")

    @rule(data=st.data())
    def group(self, data: st.DataObject) -> None:
        if self.lib.is_not_in_free_group:
            self.lib.free_group_begin()
            self.ora.free_group_begin()
            self.events.add("free_group_begin")
            return
        self.lib.free_group_end()
        self.ora.free_group_end()
        self.pending = [[] for _ in range(self.dp)]
        self.events.add("free_group_end")

    @precondition(lambda self: any(self.lib.available_size(r) <= self.ps for r in range(self.dp)))
    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        if data.draw(st.booleans(), label="one rank"):
            r = self.rank(data)
            self.lib.clear(r)
            self.ora.clear(r)
            self.reqs[r] = []
            self.pending[r] = []
            self.events.add("clear(r)")
        else:
            self.lib.clear()
            self.ora.clear()
            self.reqs = [[] for _ in range(self.dp)]
            self.pending = [[] for _ in range(self.dp)]
            self.events.add("clear()")

    @rule(data=st.data())
    def snapshot(self, data: st.DataObject) -> None:
        if self.backups and data.draw(st.booleans(), label="restore"):
            if any(self.pending):
                return  # the group is not part of a snapshot, on either side
            state, oracle, reqs = data.draw(st.sampled_from(self.backups), label="backup")
            self.lib.restore_state(state)
            restored = copy.deepcopy(oracle)
            restored.is_not_in_free_group = self.ora.is_not_in_free_group  # a snapshot holds no group
            restored.free_group = self.ora.free_group
            self.ora = restored
            self.reqs = copy.deepcopy(reqs)
            self.events.add("restore_state")
            return
        self.backups = [
            *self.backups[-2:],
            (self.lib.backup_state(), copy.deepcopy(self.ora), self.held_at_backup()),
        ]
        self.events.add("backup_state")

    def held_at_backup(self) -> list[list[list[int]]]:
        """The requests, and the slots pending in the group: allocated in a snapshot, requests once restored."""
        return [copy.deepcopy(self.reqs[r]) + copy.deepcopy(self.pending[r]) for r in range(self.dp)]

    # -- after every step ----------------------------------------------------------------------

    def state(self, a: Any) -> tuple[Any, ...]:
        return tuple(
            (lists(a.full_attn_allocator, r), lists(a.swa_attn_allocator, r), a.available_size(r))
            for r in range(self.dp)
        )

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "lib"):
            return
        assert self.lib.full_to_swa_index_mapping is self.mapping
        assert self.lib.get_kvcache().full_to_swa_index_mapping is self.mapping
        assert self.state(self.lib) == self.state(self.ora)
        assert self.maps(self.lib) == self.maps(self.ora)
        assert self.lib.is_not_in_free_group == self.ora.is_not_in_free_group
        for r in range(self.dp):
            assert self.lib.debug_print(r) == self.ora.debug_print(r)
        self.lib.check_invariants()
        if self.lib.track:
            self.tracking_agrees()

    def tracking_agrees(self) -> None:
        """Each side's outstanding() holds exactly the oracle's allocated pages but those pending, from here."""
        for r in range(self.dp):
            for side in ("full_attn_allocator", "swa_attn_allocator"):
                lib, ora = getattr(self.lib, side), getattr(self.ora, side)
                held = oracle_allocated(ora, r) - pending_pages(lib, r)
                records = lib.outstanding(dp_rank=r)
                assert sum(o.pages for o in records) == len(held), f"rank {r} {side}: outstanding() is not held"
                assert all(o.file == __file__ for o in records), [o.site for o in records]
            assert self.lib.outstanding(r) == self.lib.full_attn_allocator.outstanding(r)
        self.events.add("tracked")


def check(got: Any, want: Any) -> None:
    if want is None:
        assert got is None, f"the oracle refused, the allocator returned {got!r}"
        return
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype
    assert got.tolist() == want.tolist()


SWA_EVENTS = {
    "tracked",
    "recording replayed",
    "recording replayed on the original",
    "recording refused with frees pending",
    "alloc",
    "alloc refused",
    "free",
    "free in a group",
    "free_swa",
    "free_group_begin",
    "free_group_end",
    "backup_state",
    "restore_state",
    "clear(r)",
    "merge_and_sort_free with nothing released",
}
PAGED_EVENTS = {"alloc_extend", "alloc_extend refused", "alloc_decode", "merge_and_sort_free"}


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 4])
def test_swa_matches_oracle(page_size: int) -> None:
    reached = Events()
    for dp in (1, 2):
        events = Events()
        run_state_machine_as_test(lambda d=dp, e=events: SWAMachine(page_size, d, e), settings=_examples(0.5))
        reached |= events
        reached.counts += events.counts
    expected = SWA_EVENTS | (PAGED_EVENTS if page_size > 1 else {"double free refused"})
    assert_reached(reached, expected, f"the SWA runs at page size {page_size}")
