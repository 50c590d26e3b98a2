"""The data-plane hooks of sglang's host pools, as no-ops: a logical pool holds no KV data.

sglang calls these on any host pool, so the pool must have them; they live
here, apart from the allocator they have nothing to do with.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class DataPlaneHooks:
    """The hooks sglang calls on every host pool, each doing nothing and returning what sglang's does.

    The class attributes and the ``*_physical`` / ``prepare_transfer_indices``
    / ``get_page_buffer_element_size`` hooks are those that later sglang
    revisions' ``HostPoolGroup`` reads on every host pool. Every hook takes
    sglang's parameters, under sglang's names (``device_pool``,
    ``host_indices``, ``device_indices``, ``io_backend``, ``layer_id``,
    ``is_draft``, ``index``, ``flat``, ``data_page``, ``indices``,
    ``split_factor``), and ignores them: only
    ``prepare_transfer_indices`` returns two of them, unchanged.
    """

    #: ``None``, a pool that shares no allocation domain (sglang's ``HostPoolGroup`` reads it).
    shared_allocation_domain = None
    #: ``False``, no page envelope stored (sglang's ``HostPoolGroup`` reads it).
    stores_page_envelope = False
    #: ``None``, no storage format (sglang's ``HostPoolGroup`` reads it).
    storage_format_tag = None

    def destroy(self) -> None:
        """Release resources; the pool owns no buffers, so nothing happens."""
        return None

    def backup_from_device_all_layer(
        self, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: Any
    ) -> None:
        """No-op: a logical pool stores no KV data."""
        return None

    def load_to_device_per_layer(  # noqa: PLR0913 - sglang's hook signature, kept for drop-in use
        self,
        device_pool: Any,
        host_indices: Any,
        device_indices: Any,
        layer_id: int,
        io_backend: Any,
        *,
        is_draft: bool = False,
    ) -> None:
        """No-op: a logical pool stores no KV data."""
        return None

    # The physical variants sglang also calls: the same no-ops, under their names.
    backup_from_device_all_layer_physical = backup_from_device_all_layer
    load_to_device_per_layer_physical = load_to_device_per_layer

    def prepare_transfer_indices(self, host_indices: Any, device_indices: Any, io_backend: Any) -> tuple[Any, Any]:
        """Return ``(host_indices, device_indices)`` unchanged: a logical pool needs no remapping."""
        return host_indices, device_indices

    def get_page_buffer_element_size(self, split_factor: int = 1) -> None:
        """Return ``None``: a logical pool has no page buffers."""
        return None

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        """Return an empty uint8 array: a logical pool stores no KV data."""
        return self._empty_page()

    def get_dummy_flat_data_page(self) -> Any:
        """Return an empty uint8 array: a logical pool stores no KV data."""
        return self._empty_page()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        """No-op: a logical pool stores no KV data."""
        return None

    def get_page_buffer_meta(self, indices: Any) -> None:
        """Return ``None``: a logical pool has no page buffers."""
        return None

    def get_ksize_per_token(self) -> int:
        """Return 0: a logical pool stores no KV data."""
        return 0

    def _empty_page(self) -> Any:
        """An empty data page; the torch adapter returns a torch tensor."""
        return np.empty(0, dtype=np.uint8)
