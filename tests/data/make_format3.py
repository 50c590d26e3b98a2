"""Run with the main before runs (8ab7b25): pickles in its formats, and what the next calls return."""

import pickle
import sys

from hostpool_nb import LogicalHostPool
from hostpool_nb.paged import PagedTokenToKVPoolAllocator


def calls(pool):
    out = []
    for n in (3, 5, 2):
        a = pool.alloc(n * pool.page_size)
        out.append(None if a is None else a.tolist())
    return out


pool = LogicalHostPool(12 * 4, 4)
held = pool.alloc(40)
pool.free(held[8:16])
pool.free(held[0:4])
pool.free(held[28:32])
pool.free_group_begin()
pool.free(held[20:24])
blob = {"pool": pickle.dumps(pool), "state": pickle.dumps(pool.backup_state())}
expected = {"pool": calls(pickle.loads(blob["pool"]))}
paged = PagedTokenToKVPoolAllocator(16 * 4, 4, None)
x = paged.alloc(24)
paged.free(x[4:12])
paged.free(x[:4])
blob["paged"] = pickle.dumps(paged)
blob["paged_state"] = pickle.dumps(paged.backup_state())
p2 = pickle.loads(blob["paged"])
expected["paged"] = [p2.alloc(12).tolist(), p2.alloc(40).tolist() if p2.alloc(0) is not None else None]
with open(sys.argv[1], "wb") as f:
    pickle.dump({"blobs": blob, "expected": expected}, f)
print(expected)
