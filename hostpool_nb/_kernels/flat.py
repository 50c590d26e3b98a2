"""The short kernels, flat: written by ``python -m tests.flatten`` from their templates. Do not edit.

``alloc_short`` is ``_kernels.pool.alloc_pages`` and ``free_short`` is ``_kernels.short._free_short``, each call of
a run kernels' helper replaced by the helper's body, so that each compiles as one unit (tests/flatten.py says
why). ``_kernels.pool`` compiles them.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from .layout import (
    E_CORRUPT,
    E_DUPLICATE,
    E_LENGTH,
    E_MERGE_FIRST,
    E_MISALIGNED,
    E_NOT_ALLOCATED,
    E_PARTIAL,
    E_RANGE,
    E_SHORT,
    HEADER,
    H_ALLOC_CALLS,
    H_AVAIL,
    H_EFREE,
    H_EPEND,
    H_EREL,
    H_FAILED_ALLOCS,
    H_FREE_CALLS,
    H_GROUP_DEPTH,
    H_HEAD,
    H_MERGES,
    H_NFREE,
    H_NPAGES,
    H_NPEND,
    H_NREL,
    H_PAGE_SHIFT,
    H_PAGE_SIZE,
    H_PEAK,
    H_SORTED,
    OWNER_ALLOCATED,
    OWNER_FREE,
    OWNER_PENDING,
    fail,
    owner_view,
    ring_view,
)
from .runs import (
    _ALL_BYTES,
    _EVERY_BYTE,
    _FLAGS_PER_WORD,
    _LOW_BYTE,
    _RUN_BLOCK,
    _RUN_PROBE,
)
from .short import (
    _LARGER_PAGES_LOOP,
    _PAGE_SIZE_1_LOOP,
)
from .jit import (
    trailing_zeros,
)


def alloc_short(st: NDArray[np.int64], out: NDArray[np.int64]) -> int:
    """Pop ``len(out) // page_size`` pages from the front of the free list (:func:`take_front`)."""
    _alloc_begin0_page_size: int = st[H_PAGE_SIZE]
    _alloc_begin0_need: int = out.shape[0] // _alloc_begin0_page_size
    if out.shape[0] % _alloc_begin0_page_size != 0:
        _alloc_begin0_need = fail(E_MISALIGNED, 0)
    elif _alloc_begin0_need == 0 or _alloc_begin0_need > st[H_NFREE] + st[H_NREL]:
        st[H_ALLOC_CALLS] += 1
        if _alloc_begin0_need != 0:
            st[H_FAILED_ALLOCS] += 1
        _count_alloc1_held: int = st[H_NPAGES] - st[H_NFREE] - st[H_NREL] - st[H_NPEND]
        st[H_PEAK] = max(st[H_PEAK], _count_alloc1_held)
        if _alloc_begin0_need > 0:
            _alloc_begin0_need = fail(E_SHORT, 0)
    need = _alloc_begin0_need
    if need <= 0:
        return need
    if need > st[H_NFREE] and st[H_SORTED] != 0:
        return fail(E_MERGE_FIRST, 0)
    page_size: int = st[H_PAGE_SIZE]
    _take_front2_owner = owner_view(st)
    _take_front2_ring = ring_view(st)
    _take_front2_n = _take_front2_ring.shape[0]
    _take_front2_nfree: int = st[H_NFREE]
    _take_front2_into_released = need > _take_front2_nfree
    _take_front2_avail: int = st[H_EFREE] + st[H_EREL] if _take_front2_into_released else st[H_EFREE]
    _take_front2_head: int = st[H_HEAD]
    _take_front2_pos = _take_front2_head
    _take_front2_used = 0
    _take_front2_got = 0
    _take_front2_length = 0
    _take_front2_take = 0
    _take_front2_bad = False
    while _take_front2_got < need:
        if _take_front2_used >= _take_front2_avail:
            _take_front2_bad = True
            break
        _take_front2_p: int = _take_front2_ring[_take_front2_pos]
        _take_front2_nxt = _take_front2_pos + 1 if _take_front2_pos + 1 < _take_front2_n else 0
        if _take_front2_avail - _take_front2_used == 1 or _take_front2_ring[_take_front2_nxt] >= 0:
            if _take_front2_p < 0 or _take_front2_p >= _take_front2_n or _take_front2_owner[_take_front2_p] != OWNER_FREE:
                _take_front2_bad = True
                break
            _take_front2_owner[_take_front2_p] = OWNER_ALLOCATED
            if page_size == 1:
                out[_take_front2_got] = _take_front2_p
            else:
                _take_front2_dst = out[_take_front2_got * page_size:(_take_front2_got + 1) * page_size]
                _take_front2_first = _take_front2_p * page_size
                for _take_front2_j in range(page_size):
                    _take_front2_dst[_take_front2_j] = _take_front2_first + _take_front2_j
            _take_front2_got += 1
            _take_front2_pos = _take_front2_nxt
            _take_front2_used += 1
            _take_front2_length = _take_front2_take = 1
            continue
        _take_front2_length = -_take_front2_ring[_take_front2_nxt]
        _take_front2_take = _take_front2_length if _take_front2_length < need - _take_front2_got else need - _take_front2_got
        if _take_front2_p < 0 or _take_front2_length > _take_front2_n - _take_front2_p:
            _take_front2_bad = True
            break
        __claim_flags3_words = st[HEADER + (st[H_NPAGES] + 1) // 2:]
        __word_masks4_lo = _take_front2_p >> 3
        __word_masks4_hi = _take_front2_p + _take_front2_take - 1 >> 3
        __word_masks4_first = _ALL_BYTES << ((_take_front2_p & 7) << 3)
        __word_masks4_top = (_take_front2_p + _take_front2_take - 1 & 7) + 1
        __word_masks4_last = _ALL_BYTES if __word_masks4_top == _FLAGS_PER_WORD else (_LOW_BYTE << (__word_masks4_top << 3)) - 1
        if __word_masks4_lo == __word_masks4_hi:
            __word_masks4_first &= __word_masks4_last
            __word_masks4_last = __word_masks4_first
        __claim_flags3_lo = __word_masks4_lo
        __claim_flags3_hi = __word_masks4_hi
        __claim_flags3_first = __word_masks4_first
        __claim_flags3_last = __word_masks4_last
        __claim_flags3_expect = OWNER_FREE * _EVERY_BYTE
        __claim_flags3_wrong = (__claim_flags3_words[__claim_flags3_lo] ^ __claim_flags3_expect) & __claim_flags3_first | (__claim_flags3_words[__claim_flags3_hi] ^ __claim_flags3_expect) & __claim_flags3_last
        __claim_flags3_middle = __claim_flags3_words[__claim_flags3_lo + 1:__claim_flags3_hi]
        for __claim_flags3_q in range(__claim_flags3_middle.shape[0]):
            __claim_flags3_wrong |= __claim_flags3_middle[__claim_flags3_q] ^ __claim_flags3_expect
        if __claim_flags3_wrong == 0:
            __claim_flags3_pattern = OWNER_ALLOCATED * _EVERY_BYTE
            __claim_flags3_words[__claim_flags3_lo] = __claim_flags3_words[__claim_flags3_lo] & ~__claim_flags3_first | __claim_flags3_pattern & __claim_flags3_first
            __claim_flags3_words[__claim_flags3_hi] = __claim_flags3_words[__claim_flags3_hi] & ~__claim_flags3_last | __claim_flags3_pattern & __claim_flags3_last
            for __claim_flags3_q in range(__claim_flags3_middle.shape[0]):
                __claim_flags3_middle[__claim_flags3_q] = __claim_flags3_pattern
        __claim_flags3_claimed: bool = __claim_flags3_wrong == 0
        _take_front2_claimed = __claim_flags3_claimed
        if not _take_front2_claimed:
            _take_front2_bad = True
            break
        _take_front2_at = _take_front2_got * page_size
        _take_front2_span = _take_front2_take * page_size
        if _take_front2_at + _take_front2_span + 15 < need * page_size:
            _take_front2_span = _take_front2_span + 15 & ~15
        _take_front2_dst = out[_take_front2_at:_take_front2_at + _take_front2_span]
        _take_front2_first = _take_front2_p * page_size
        for _take_front2_j in range(_take_front2_span):
            _take_front2_dst[_take_front2_j] = _take_front2_first + _take_front2_j
        _take_front2_got += _take_front2_take
        if _take_front2_take < _take_front2_length:
            break
        _take_front2_w = 1 if _take_front2_length == 1 else 2
        _take_front2_pos = _take_front2_pos + _take_front2_w if _take_front2_pos + _take_front2_w < _take_front2_n else _take_front2_pos + _take_front2_w - _take_front2_n
        _take_front2_used += _take_front2_w
    _take_front2_status = 0
    if _take_front2_bad:
        _take_front2_q = _take_front2_head
        _take_front2_done = 0
        _take_front2_left = _take_front2_avail
        while _take_front2_done < _take_front2_got:
            _take_front2_nxt = _take_front2_q + 1 if _take_front2_q + 1 < _take_front2_n else 0
            _take_front2_length = -_take_front2_ring[_take_front2_nxt] if _take_front2_left > 1 and _take_front2_ring[_take_front2_nxt] < 0 else 1
            _take_front2_part = _take_front2_length if _take_front2_length < _take_front2_got - _take_front2_done else _take_front2_got - _take_front2_done
            _take_front2_back = _take_front2_owner[_take_front2_ring[_take_front2_q]:_take_front2_ring[_take_front2_q] + _take_front2_part]
            for _take_front2_j in range(_take_front2_part):
                _take_front2_back[_take_front2_j] = OWNER_FREE
            _take_front2_done += _take_front2_part
            _take_front2_w = 1 if _take_front2_length == 1 else 2
            _take_front2_q = _take_front2_q + _take_front2_w if _take_front2_q + _take_front2_w < _take_front2_n else _take_front2_q + _take_front2_w - _take_front2_n
            _take_front2_left -= _take_front2_w
        _take_front2_status = fail(E_CORRUPT, _take_front2_got)
    else:
        if _take_front2_take < _take_front2_length:
            _take_front2_rest = _take_front2_length - _take_front2_take
            _take_front2_nxt = _take_front2_pos + 1 if _take_front2_pos + 1 < _take_front2_n else 0
            if _take_front2_rest > 1:
                _take_front2_ring[_take_front2_pos] += _take_front2_take
                _take_front2_ring[_take_front2_nxt] = -_take_front2_rest
            else:
                _take_front2_ring[_take_front2_nxt] = _take_front2_ring[_take_front2_pos] + _take_front2_take
                _take_front2_pos = _take_front2_nxt
                _take_front2_used += 1
        if _take_front2_into_released:
            st[H_NFREE] += st[H_NREL]
            st[H_EFREE] += st[H_EREL]
            st[H_NREL] = 0
            st[H_EREL] = 0
            st[H_MERGES] += 1
        st[H_HEAD] = _take_front2_pos
        st[H_NFREE] -= need
        st[H_EFREE] -= _take_front2_used
        st[H_AVAIL] = (st[H_NFREE] + st[H_NREL]) * st[H_PAGE_SIZE]
    status = _take_front2_status
    if status < 0:
        return status
    st[H_ALLOC_CALLS] += 1
    if 0 != 0:
        st[H_FAILED_ALLOCS] += 1
    _count_alloc5_held: int = st[H_NPAGES] - st[H_NFREE] - st[H_NREL] - st[H_NPEND]
    st[H_PEAK] = max(st[H_PEAK], _count_alloc5_held)
    return need * page_size


def free_short(st: NDArray[np.int64], slots: NDArray[np.int64]) -> int:
    """Validate ``slots`` as whole allocated pages, then release them, a page at a time."""
    page_size: int = st[H_PAGE_SIZE]
    if slots.shape[0] % page_size != 0:
        return fail(E_LENGTH, 0)
    n: int = st[H_NPAGES]
    count: int = slots.shape[0] // page_size
    if n == 0 and count > 0:
        return fail(E_RANGE, 0)
    shift: int = st[H_PAGE_SHIFT]
    mask = page_size - 1
    size = n * page_size
    owner = owner_view(st)
    ring = ring_view(st)
    mark = OWNER_PENDING if st[H_GROUP_DEPTH] > 0 else OWNER_FREE
    _ring_tail0_n: int = st[H_NPAGES]
    _ring_tail0_tail: int = st[H_HEAD] + st[H_EFREE] + st[H_EREL] + st[H_EPEND]
    tail = _ring_tail0_tail - _ring_tail0_n if _ring_tail0_tail >= _ring_tail0_n else _ring_tail0_tail
    pos = tail
    status = 0
    missing = -1
    c = 0
    entries = 0
    if _PAGE_SIZE_1_LOOP:
        if page_size == 1:
            reach = _RUN_PROBE - 1
            skip = 0
            while c < count:
                p = slots[c]
                if p < 0 or p >= n:
                    status = fail(E_RANGE, c)
                    break
                if c >= skip and c + reach < count and (slots[c + reach] == p + reach):
                    limit = count - c if count - c < n - p else n - p
                    __run_length1_k = 1
                    __run_length1_off = 0
                    while __run_length1_k + _RUN_BLOCK <= limit:
                        __run_length1_block = slots[c + __run_length1_k:c + __run_length1_k + _RUN_BLOCK]
                        for __run_length1_t in range(_RUN_BLOCK):
                            __run_length1_off |= np.int64(__run_length1_block[__run_length1_t] != p + __run_length1_k + __run_length1_t) << __run_length1_t
                        if __run_length1_off != 0:
                            break
                        __run_length1_k += _RUN_BLOCK
                    if __run_length1_off == 0:
                        __run_length1_end = __run_length1_k + _RUN_BLOCK if __run_length1_k + _RUN_BLOCK < limit else limit
                        __run_length1_block = slots[c + __run_length1_k:c + __run_length1_end]
                        for __run_length1_t in range(__run_length1_block.shape[0]):
                            __run_length1_off |= np.int64(__run_length1_block[__run_length1_t] != p + __run_length1_k + __run_length1_t) << __run_length1_t
                    __run_length1_length = __run_length1_k + trailing_zeros(__run_length1_off) if __run_length1_off != 0 else limit if limit > 1 else 1
                    run = __run_length1_length
                    if run > 1:
                        __claim_flags2_words = st[HEADER + (st[H_NPAGES] + 1) // 2:]
                        __word_masks3_lo = p >> 3
                        __word_masks3_hi = p + run - 1 >> 3
                        __word_masks3_first = _ALL_BYTES << ((p & 7) << 3)
                        __word_masks3_top = (p + run - 1 & 7) + 1
                        __word_masks3_last = _ALL_BYTES if __word_masks3_top == _FLAGS_PER_WORD else (_LOW_BYTE << (__word_masks3_top << 3)) - 1
                        if __word_masks3_lo == __word_masks3_hi:
                            __word_masks3_first &= __word_masks3_last
                            __word_masks3_last = __word_masks3_first
                        __claim_flags2_lo = __word_masks3_lo
                        __claim_flags2_hi = __word_masks3_hi
                        __claim_flags2_first = __word_masks3_first
                        __claim_flags2_last = __word_masks3_last
                        __claim_flags2_expect = OWNER_ALLOCATED * _EVERY_BYTE
                        __claim_flags2_wrong = (__claim_flags2_words[__claim_flags2_lo] ^ __claim_flags2_expect) & __claim_flags2_first | (__claim_flags2_words[__claim_flags2_hi] ^ __claim_flags2_expect) & __claim_flags2_last
                        __claim_flags2_middle = __claim_flags2_words[__claim_flags2_lo + 1:__claim_flags2_hi]
                        for __claim_flags2_q in range(__claim_flags2_middle.shape[0]):
                            __claim_flags2_wrong |= __claim_flags2_middle[__claim_flags2_q] ^ __claim_flags2_expect
                        if __claim_flags2_wrong == 0:
                            __claim_flags2_pattern = mark * _EVERY_BYTE
                            __claim_flags2_words[__claim_flags2_lo] = __claim_flags2_words[__claim_flags2_lo] & ~__claim_flags2_first | __claim_flags2_pattern & __claim_flags2_first
                            __claim_flags2_words[__claim_flags2_hi] = __claim_flags2_words[__claim_flags2_hi] & ~__claim_flags2_last | __claim_flags2_pattern & __claim_flags2_last
                            for __claim_flags2_q in range(__claim_flags2_middle.shape[0]):
                                __claim_flags2_middle[__claim_flags2_q] = __claim_flags2_pattern
                        __claim_flags2_claimed: bool = __claim_flags2_wrong == 0
                        held = __claim_flags2_claimed
                        if held:
                            _put_run4_pos = pos
                            _put_run4_n = ring.shape[0]
                            ring[_put_run4_pos] = p
                            _put_run4_pos = _put_run4_pos + 1 if _put_run4_pos + 1 < _put_run4_n else 0
                            if run > 1:
                                ring[_put_run4_pos] = -run
                                _put_run4_pos = _put_run4_pos + 1 if _put_run4_pos + 1 < _put_run4_n else 0
                            pos = _put_run4_pos
                            entries += 2
                            c += run
                            continue
                    skip = c + run
                if owner[p] != OWNER_ALLOCATED:
                    missing = p
                    break
                owner[p] = mark
                ring[pos] = p
                pos = pos + 1 if pos + 1 < n else 0
                entries += 1
                c += 1
    if _LARGER_PAGES_LOOP:
        while page_size > 1 and c < count:
            b = c * page_size
            head_slot = slots[b]
            if head_slot < 0 or head_slot >= size:
                status = fail(E_RANGE, b)
                break
            misaligned = head_slot & mask if shift >= 0 else head_slot % page_size
            if misaligned != 0:
                status = fail(E_MISALIGNED, b)
                break
            p = head_slot >> shift if shift >= 0 else head_slot // page_size
            page = slots[b:b + page_size]
            bad = 0
            for j in range(page_size):
                bad |= page[j] ^ head_slot + j
            if bad != 0:
                status = fail(E_PARTIAL, b + 1)
                for j in range(page_size):
                    if page[j] != head_slot + j:
                        status = fail(E_PARTIAL, b + j)
                        break
                break
            if owner[p] != OWNER_ALLOCATED:
                missing = p
                break
            owner[p] = mark
            ring[pos] = p
            pos = pos + 1 if pos + 1 < n else 0
            entries += 1
            c += 1
    if missing >= 0:
        _staged_twice5_position = c * page_size
        _staged_twice5_n = ring.shape[0]
        _staged_twice5_pos = tail
        _staged_twice5_left = entries
        _staged_twice5_status = fail(E_NOT_ALLOCATED, _staged_twice5_position)
        while _staged_twice5_left > 0:
            _run_at6_length = 1
            if _staged_twice5_left > 1:
                _run_at6_nxt = _staged_twice5_pos + 1 if _staged_twice5_pos + 1 < ring.shape[0] else 0
                _run_at6_e: int = ring[_run_at6_nxt]
                if _run_at6_e < 0:
                    _run_at6_length = -_run_at6_e
            _staged_twice5_length = _run_at6_length
            if ring[_staged_twice5_pos] <= missing < ring[_staged_twice5_pos] + _staged_twice5_length:
                _staged_twice5_status = fail(E_DUPLICATE, _staged_twice5_position)
                break
            _staged_twice5_w = 1 if _staged_twice5_length == 1 else 2
            _staged_twice5_pos = _staged_twice5_pos + _staged_twice5_w if _staged_twice5_pos + _staged_twice5_w < _staged_twice5_n else _staged_twice5_pos + _staged_twice5_w - _staged_twice5_n
            _staged_twice5_left -= _staged_twice5_w
        status = _staged_twice5_status
    _free_end9_status = status if status != 0 else count * page_size
    if _free_end9_status < 0:
        _set_runs10_pos = tail
        _set_runs10_ring = ring_view(st)
        _set_runs10_owner = owner_view(st)
        _set_runs10_n = _set_runs10_ring.shape[0]
        _set_runs10_left = entries
        while _set_runs10_left > 0:
            _run_at11_length = 1
            if _set_runs10_left > 1:
                _run_at11_nxt = _set_runs10_pos + 1 if _set_runs10_pos + 1 < _set_runs10_ring.shape[0] else 0
                _run_at11_e: int = _set_runs10_ring[_run_at11_nxt]
                if _run_at11_e < 0:
                    _run_at11_length = -_run_at11_e
            _set_runs10_length = _run_at11_length
            if _set_runs10_length == 1:
                _set_runs10_owner[_set_runs10_ring[_set_runs10_pos]] = OWNER_ALLOCATED
            else:
                _set_runs10_back = _set_runs10_owner[_set_runs10_ring[_set_runs10_pos]:_set_runs10_ring[_set_runs10_pos] + _set_runs10_length]
                for _set_runs10_j in range(_set_runs10_length):
                    _set_runs10_back[_set_runs10_j] = OWNER_ALLOCATED
            _set_runs10_w = 1 if _set_runs10_length == 1 else 2
            _set_runs10_pos = _set_runs10_pos + _set_runs10_w if _set_runs10_pos + _set_runs10_w < _set_runs10_n else _set_runs10_pos + _set_runs10_w - _set_runs10_n
            _set_runs10_left -= _set_runs10_w
    elif st[H_GROUP_DEPTH] > 0:
        st[H_NPEND] += c
        st[H_EPEND] += entries
    else:
        st[H_NREL] += c
        st[H_EREL] += entries
        st[H_AVAIL] = (st[H_NFREE] + st[H_NREL]) * st[H_PAGE_SIZE]
    if _free_end9_status >= 0 and c > 0:
        st[H_FREE_CALLS] += 1
    _returned8 = _free_end9_status
    return _returned8
