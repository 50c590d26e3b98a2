"""Two stand-ins that let sglang-jax 0.1.0rc0 run a sliding-window model on JAX's CPU platform (tests only).

Neither touches an allocator: both sit where the engine's own CPU path stops short of the sliding-window
pool, and both are applied to the plain engine and to the engine with hostpool_nb installed alike.

- The native attention backend writes and reads one KV pool through ``set_kv_buffer_legacy``, which the
  hybrid pool (``SWAKVPool``) lacks, and reads with the full pool's slot ids. Here a layer of the hybrid
  pool is served by its sub-pool (the full or the sliding-window one), with every slot id above 0 read
  through the allocator's full-to-SWA mapping on the sliding-window layers (slot ids 0 and below stay:
  the backend treats them as padding). A token whose SWA slot was freed (``free_swa``) maps to 0 and is
  masked, as it has left the window.
- Gemma2's attention projects q, k and v with shardings the CPU's einsums refuse to mix
  (``ShardingTypeError``); here they are resharded to one before the attention, as the Qwen3 model's are.
"""

from __future__ import annotations

import copy
import functools
from typing import Any


class _LayerOfSubPool:
    """The attention layer as its sub-pool numbers it: its own attributes but ``layer_id``."""

    def __init__(self, layer: Any, layer_id: int) -> None:
        self._layer = layer
        self.layer_id = layer_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def _remapped(pool: Any, loc: Any, layer_id: int) -> Any:
    """Full-pool slot ids as the sub-pool of ``layer_id`` numbers them (ids of 0 and below kept)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    _, is_swa = pool.layers_mapping[layer_id]
    if not is_swa or loc is None:
        return loc
    sharding = jax.typeof(loc).sharding
    mapping = jax.sharding.reshard(
        jnp.asarray(pool.full_to_swa_index_mapping), NamedSharding(sharding.mesh, PartitionSpec())
    )
    inside = jnp.clip(loc, 0, mapping.shape[0] - 1)
    mapped = mapping.at[inside].get(out_sharding=sharding)
    return jnp.where(loc > 0, mapped, loc).astype(loc.dtype)


def _attention_on_sub_pools(call: Any) -> Any:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from sgl_jax.srt.mem_cache.memory_pool import SWAKVPool

    @functools.wraps(call)
    def attention(self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, pool: Any, **kwargs: Any) -> Any:
        heads = NamedSharding(self.mesh, PartitionSpec("data", "tensor", None))  # as Qwen3's q, k and v are
        q, k, v = (jax.sharding.reshard(x, heads) for x in (q, k, v))
        if not isinstance(pool, SWAKVPool):
            return call(self, q, k, v, layer, forward_batch, pool, **kwargs)
        index, is_swa = pool.layers_mapping[layer.layer_id]
        sub = pool.swa_kv_pool if is_swa else pool.full_kv_pool
        batch = copy.copy(forward_batch)
        batch.out_cache_loc = _remapped(pool, forward_batch.out_cache_loc, layer.layer_id)
        batch.cache_loc = _remapped(pool, forward_batch.cache_loc, layer.layer_id)
        sub_layer = _LayerOfSubPool(layer, index + getattr(sub, "start_layer", 0))
        return call(self, q, k, v, sub_layer, batch, sub, **kwargs)

    return attention


def patch() -> None:
    """Apply both, in this process (the launcher calls it at its top level: in every process of the engine)."""
    from sgl_jax.srt.layers.attention import native_backend

    backend = native_backend.NativeAttention
    if not getattr(backend.__call__, "hostpool_nb_test_patch", False):
        backend.__call__ = _attention_on_sub_pools(backend.__call__)
        backend.__call__.hostpool_nb_test_patch = True  # type: ignore[attr-defined]
