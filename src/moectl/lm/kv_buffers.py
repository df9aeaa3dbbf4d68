"""A ``DynamicCache``'s layers backed by buffers with free columns, which the compiled step writes in place.

transformers' ``DynamicLayer.update`` concatenates each new token's keys and values onto the
cache: a copy of the whole cache, every layer, every step (at OLMoE-1B-7B's width, 4 layers, 8
rows, the compiled step took 112.9 ms over 16 cached tokens and 155.5 over 1,024; written in place,
110.6 and 98.4: ``benchmarks/compiled_step_cache.py``). vLLM and SGLang write
into preallocated memory instead; here each layer's keys and values live in a buffer of C > T + 1
columns, the layer's ``keys`` / ``values`` are views of its first T, and the step
(:func:`moectl.lm.decode_step.decode_step`) writes column T and attends over the first T + 1.

The engine keeps handling the cache as a plain ``DynamicCache``: it re-batches, pads, trims and
prefills it (each of which makes new tensors), and the lean and model forwards extend it by
concatenation. :func:`buffers` takes a layer's buffer again only where the layer still holds the
very view the last step left (``is``: a view someone trimmed, re-batched or extended is another
tensor); anything else is copied into a new buffer, with ``headroom`` free columns (between 16 and
256, a quarter of the cache: a copy every T / 4 steps, and at most 25% more memory than the cache,
or 256 columns). Views handed out earlier (the prefix cache's snapshots) cover only columns the
step never writes again: it writes only past the newest view's end. Where a step runs through
another forward (a routing the compiled step does not take), the model runner lets the buffers go
(:func:`release`), so they do not stay alive beside the concatenated cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

HEADROOM_MIN, HEADROOM_MAX = 16, 256


def headroom(t: int) -> int:
    """Free columns of a new buffer over a cache of ``t`` columns (see the module doc)."""
    return min(HEADROOM_MAX, max(HEADROOM_MIN, t // 4))


def _buffer(view: Tensor, state: tuple[Tensor, Tensor] | None) -> Tensor:
    """The buffer ``view`` (a layer's keys or values, [B, heads, T, D]) is the head of, with free
    columns at T and T + 1; a new one (the view copied in) where it is not the last step's view or
    the buffer is full."""
    if state is not None and view is state[1] and state[0].shape[2] > view.shape[2] + 1:
        return state[0]  # (never its last column: a step that fills its buffer would compile a graph
        # of its own, dynamo guarding C != T + 1 on the graph the buffers' first steps made)
    b, heads, t, d = view.shape
    buf = torch.empty(b, heads, t + headroom(t), d, dtype=view.dtype, device=view.device)
    buf[:, :, :t].copy_(view)
    return buf


def buffers(cache: Any) -> tuple[list[Tensor], list[Tensor]]:
    """Each layer's keys and values buffer [B, heads, C, D], C > T + 1 (see the module doc)."""
    keys, values = [], []
    for layer in cache.layers:
        keys.append(_buffer(layer.keys, getattr(layer, "_moectl_keys", None)))
        values.append(_buffer(layer.values, getattr(layer, "_moectl_values", None)))
    return keys, values


def advance(cache: Any, keys: list[Tensor], values: list[Tensor], length: int) -> None:
    """Point each layer at its buffers' first ``length`` columns (after a step wrote column
    ``length - 1``) and remember the views, for :func:`buffers` to take the buffers again."""
    for layer, k, v in zip(cache.layers, keys, values, strict=True):
        layer.keys, layer.values = k.narrow(2, 0, length), v.narrow(2, 0, length)
        layer._moectl_keys, layer._moectl_values = (k, layer.keys), (v, layer.values)


def release(cache: Any) -> None:
    """Forget the layers' buffers (a forward other than the compiled step extends this cache now:
    the buffers would otherwise stay alive beside the concatenated cache, up to twice its memory)."""
    for layer in getattr(cache, "layers", ()):
        if hasattr(layer, "_moectl_keys"):
            del layer._moectl_keys, layer._moectl_values
