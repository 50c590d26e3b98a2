"""The data-plane hooks of sglang's host pools, as no-ops: a logical pool holds no KV data.

sglang calls these on any host pool (SPEC section 1), so the pool must have
them; they live here, apart from the allocator they have nothing to do with.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class DataPlaneHooks:
    """The hooks of SPEC section 1, each doing nothing and returning what sglang's does."""

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
