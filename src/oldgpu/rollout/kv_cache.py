"""The decode loop's KV cache: each layer's keys and values in a buffer reserved for the
whole pass, written one token a step.

transformers' ``DynamicCache`` appends with ``torch.cat``: every step, every layer, the
whole cache is read and written again (4 cache-sizes of traffic for keys and values),
and both the old and the new copy are alive for a moment. Reserved for the prompt plus
the longest response, a step writes one token's keys and values and hands attention a
view of the filled part. The cache's final size is the same; the peak is lower (no
second copy while appending).

transformers 5's layered cache only (``Cache.layers``); with an older transformers, or
a model with sliding-window or other special layers, the decode keeps the model's own
cache.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def _dynamic_layer() -> type | None:
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # transformers 4: no per-layer cache classes
        return None
    return DynamicLayer


def reserved_cache(model: torch.nn.Module, capacity: int) -> Any | None:
    """A ``DynamicCache`` for ``model`` whose layers reserve ``capacity`` positions, or
    None where the decode should keep the model's own (see above)."""
    base = _dynamic_layer()
    if base is None:
        return None
    from transformers.cache_utils import DynamicCache

    config = getattr(model, "config", None)
    if config is None:
        return None
    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not base for layer in layers):
        return None
    cache.layers = [_reserved_layer_class()(capacity) for _ in layers]
    return cache


@functools.cache
def _reserved_layer_class() -> type:
    """Made on first use: its base exists only in transformers 5."""
    base: Any = _dynamic_layer()

    class ReservedLayer(base):
        """A ``DynamicLayer`` whose keys and values are views of reserved buffers."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity
            self.length = 0

        def lazy_initialization(self, key_states, value_states, *args, **kwargs) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            rows, heads, _, dim = key_states.shape
            self._keys = key_states.new_empty((rows, heads, self.capacity, dim))
            width = value_states.shape[-1]
            self._values = value_states.new_empty((rows, heads, self.capacity, width))
            self._views()
            self.is_initialized = True

        def _views(self) -> None:
            # narrow: one op each (a step is host-bound on a fast card; indexing with
            # slices on every dimension is several)
            self.keys = self._keys.narrow(2, 0, self.length)
            self.values = self._values.narrow(2, 0, self.length)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self.capacity:  # past the reservation: grow, as a cat would
                self.capacity = max(end, 2 * self.capacity)
                self._keys = self._grown(self._keys)
                self._values = self._grown(self._values)
            n = end - self.length
            self._keys.narrow(2, self.length, n).copy_(key_states)
            self._values.narrow(2, self.length, n).copy_(value_states)
            self.length = end
            self._views()
            return self.keys, self.values

        def _grown(self, buffer: torch.Tensor) -> torch.Tensor:
            rows, heads, _, dim = buffer.shape
            grown = buffer.new_empty((rows, heads, self.capacity, dim))
            grown[:, :, : self.length] = buffer[:, :, : self.length]
            return grown

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if not self.is_initialized:
                return
            self._keys = self._selected(self._keys, indices)
            self._values = self._selected(self._values, indices)
            self._views()

        def _selected(self, buffer: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
            kept = buffer.new_empty((len(indices), *buffer.shape[1:]))
            kept[:, :, : self.length] = buffer[indices, :, : self.length]
            return kept

    return ReservedLayer
