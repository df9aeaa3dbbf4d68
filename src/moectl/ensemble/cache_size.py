"""What a KV cache holds: bytes of its distinct storages and tokens per row (RoE §3.3's memory figures).

Read by the overhead benchmark (``bench``) and the tests that check the clean cache holds one
sequence whatever K is (RoE §2.3), while separate caches grow with K.
"""

from __future__ import annotations

from torch import Tensor
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin


def cache_bytes(cache) -> int:
    """Bytes of every distinct storage the cache holds (keys, values, conv and recurrent states).

    Storages, not views: a cropped view that pins a larger buffer counts the whole buffer.
    """
    if cache is None:
        return 0
    seen: dict[int, int] = {}
    for layer in getattr(cache, "layers", []):
        tensors: list[Tensor] = []
        if isinstance(layer, CacheLayerMixin) and getattr(layer, "is_initialized", False):
            tensors += [t for t in (layer.keys, layer.values) if isinstance(t, Tensor)]
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            tensors += [
                t for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None
            ]
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def cache_tokens(cache) -> int:
    """Tokens held per sequence row by the attention layers (max over layers)."""
    lengths = [
        layer.keys.shape[-2]
        for layer in getattr(cache, "layers", [])
        if isinstance(layer, CacheLayerMixin)
        and getattr(layer, "is_initialized", False)
        and layer.keys is not None
    ]
    return max(lengths, default=0)
