"""The compiled step's cache buffers (moectl.lm.kv_buffers): written in place only where that is safe.

A layer's buffer is taken again only while the layer holds the very view the last step left; a
trimmed, re-batched or extended cache is copied into a new buffer; views handed out earlier never
see their columns change; a full buffer is replaced by a larger one.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from moectl.lm.kv_buffers import HEADROOM_MAX, HEADROOM_MIN, advance, buffers, headroom, release


def _cache(rows: int = 2, length: int = 5, layers: int = 2) -> DynamicCache:
    cache = DynamicCache()
    for i in range(layers):
        cache.update(torch.randn(rows, 3, length, 4), torch.randn(rows, 3, length, 4), i)
    return cache


def _step(cache: DynamicCache, fill: float) -> tuple[list, list]:
    """What the compiled step does: take the buffers, write column T, point the layers at T + 1."""
    keys, values = buffers(cache)
    t = cache.layers[0].keys.shape[2]
    for k, v in zip(keys, values, strict=True):
        k[:, :, t] = fill
        v[:, :, t] = -fill
    advance(cache, keys, values, t + 1)
    return keys, values


def test_headroom_is_a_quarter_of_the_cache_within_bounds():
    assert headroom(0) == HEADROOM_MIN and headroom(400) == 100 and headroom(10**6) == HEADROOM_MAX


def test_the_cache_is_copied_once_then_written_in_place():
    cache = _cache()
    before = [layer.keys.clone() for layer in cache.layers]
    keys, _ = _step(cache, 1.0)
    assert keys[0].shape[2] == 5 + HEADROOM_MIN
    for layer, k, old in zip(cache.layers, keys, before, strict=True):
        assert layer.keys.shape[2] == 6 and layer.keys.data_ptr() == k.data_ptr()
        assert torch.equal(layer.keys[:, :, :5], old) and bool((layer.keys[:, :, 5] == 1.0).all())
    again, _ = _step(cache, 2.0)
    assert all(a is b for a, b in zip(again, keys, strict=True))  # the same buffers: no copy
    assert cache.layers[1].keys.shape[2] == 7 and bool((cache.layers[1].values[:, :, 6] == -2.0).all())


def test_earlier_views_keep_their_columns():
    cache = _cache()
    _step(cache, 1.0)
    snapshot = cache.layers[0].keys  # what a prefix cache would keep: a view of 6 columns
    kept = snapshot.clone()
    for fill in (2.0, 3.0, 4.0):
        _step(cache, fill)
    assert torch.equal(snapshot, kept)
    cache.layers[0].keys = snapshot  # rolled back: that view is not the last step's, so it is copied
    cache.layers[1].keys, cache.layers[1].values = cache.layers[1].keys[:, :, :6], cache.layers[1].values[:, :, :6]
    cache.layers[0].values = cache.layers[0].values[:, :, :6]
    newest = cache.layers[0]._moectl_keys[0]
    keys, _ = _step(cache, 9.0)
    assert keys[0] is not newest
    assert torch.equal(newest[:, :, 6], torch.full_like(newest[:, :, 6], 2.0))  # the old buffer untouched


def test_a_trimmed_or_rebatched_cache_gets_a_new_buffer():
    cache = _cache(rows=3)
    keys, _ = _step(cache, 1.0)
    layer = cache.layers[0]
    layer.keys, layer.values = layer.keys[[0, 2]], layer.values[[0, 2]]  # a row left (engine/kv.py)
    cache.layers[1].keys, cache.layers[1].values = cache.layers[1].keys[[0, 2]], cache.layers[1].values[[0, 2]]
    want = layer.keys.clone()
    again, _ = _step(cache, 2.0)
    assert again[0] is not keys[0] and again[0].shape[0] == 2
    assert torch.equal(cache.layers[0].keys[:, :, :6], want)
    trimmed = [(x.keys[:, :, -4:], x.values[:, :, -4:]) for x in cache.layers]  # left columns dropped
    for x, (k, v) in zip(cache.layers, trimmed, strict=True):
        x.keys, x.values = k, v
    third, _ = _step(cache, 3.0)
    assert third[0] is not again[0] and cache.layers[0].keys.shape[2] == 5
    assert torch.equal(cache.layers[0].keys[:, :, :4], trimmed[0][0])


def test_a_full_buffer_is_replaced_by_a_larger_one():
    cache = _cache(length=2)
    first, _ = _step(cache, 0.0)
    for i in range(HEADROOM_MIN + 2):
        keys, _ = _step(cache, float(i))
    assert keys[0] is not first[0] and keys[0].shape[2] > first[0].shape[2]
    assert cache.layers[0].keys.shape[2] == 2 + HEADROOM_MIN + 3
    assert torch.equal(cache.layers[0].keys[0, 0, 2:, 0], torch.tensor([0.0, *range(HEADROOM_MIN + 2)]))


def test_released_buffers_are_let_go():
    """A forward other than the step (the lean one) extends the cache by concatenation: ``release``
    drops the buffers so they do not live on beside it; the next step copies into new ones."""
    cache = _cache()
    keys, _ = _step(cache, 1.0)
    release(cache)
    assert not any(hasattr(layer, "_moectl_keys") for layer in cache.layers)
    release(cache)  # nothing to let go: nothing happens
    again, _ = _step(cache, 2.0)
    assert again[0] is not keys[0] and cache.layers[0].keys.shape[2] == 7
