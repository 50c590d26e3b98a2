"""The original algorithms hostpool_nb replaces, written from their observed behaviour.

One copy serves two purposes: the oracles the tests compare hostpool_nb
with, call for call, and the baselines ``python -m bench`` and
``python -m hostpool_nb.replay --time`` measure it against, side by side.
Each keeps the original's costs and its silent failure modes (no checks
beyond the original's own), since that is what hostpool_nb is judged
against; none of them is meant for serving. ``docs/behaviour.md`` says what
each original does.

- :mod:`.sglang`: sglang's ``LogicalHostPool`` (host KV slots), on numpy or,
  with ``backend="torch"``, on torch CPU tensors as the original is;
- :mod:`.sglang_host`: sglang's HiCache host pools (the ``HostKVCache``
  family: MHA, MLA, DSA, MiniMax, Mamba, DeepSeek V4 paged), their
  bookkeeping on torch CPU tensors;
- :mod:`.paged`: sglang-jax's device allocators, in numpy;
- :mod:`.host_tier`: sglang-jax's host KV pool bookkeeping, in Python lists.

Importing this package imports neither torch nor jax.
"""
