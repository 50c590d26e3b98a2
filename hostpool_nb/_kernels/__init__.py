"""The numba kernels: every function that changes a pool's state arrays, and how they are compiled (:mod:`.jit`).

:data:`MODULES` lists the modules that define kernels or feed them
constants: the kernel cache's stamp and ``hostpool_nb.warmup`` read it.
"""

# jit and layout compile into every kernel; the others define kernels.
MODULES = ("jit", "layout", "runs", "short", "flat", "pool", "paged", "swa", "host", "interleaved", "envelope")
