"""Rows of a running RoE ensemble: append the rows of another (started on new prompts), keep a subset.

What ``engine.roe_rows`` needs to let RoE requests join and leave one ``moectl.roe.Ensemble`` at
step boundaries, per way of running the K samples (``ensemble.variants``); between two steps:

- clean cache (RoE §2.3): one ``CleanCache`` row per prompt with ``length`` columns, ``valid``
  [B, length] real-token flags by column, ``n_real`` [B] real tokens. Rows join left-padded to the
  longer length (padding is masked by ``valid``; position ids come from ``n_real``, so a row's
  numbers do not depend on the padding in front of it).
- separate caches: K consecutive cache rows per prompt, ``mask`` [B·K, L] and ``n_real`` [B·K]:
  a plain batch cache, joined and kept as the engine's own (``engine.kv``).
- no cache: the token ids and mask [B, L] themselves, re-padded on the left.

A leave then drops columns that are padding in every row. Caches whose layers cannot be padded this
way (hybrid models' recurrent states, sliding-window, chunked or model-specific layers) are not
re-batched (``rebatchable``): such a routing runs one ensemble per request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moectl.engine.kv import join, keep
from moectl.ensemble.clean_cache import new_clean_cache
from moectl.ensemble.masks import attention_kinds


def rebatchable(model: nn.Module, config) -> bool:
    """Whether ensembles of ``config`` (a ``RoEConfig``) on ``model`` can take and drop rows."""
    if config.cache == "none":
        return True  # nothing cached: the ids are re-padded
    from transformers.cache_utils import DynamicLayer

    kinds, _ = attention_kinds(model.config)
    if any(k.kind != "full" for k in kinds):
        return False
    layers = new_clean_cache(model).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def join_rows(ensemble, other) -> None:
    """Append ``other``'s rows (an ensemble of the same config, started on new prompts) to ``ensemble``'s."""
    mine, theirs = ensemble.variant, other.variant
    if hasattr(mine, "length"):  # clean cache
        length = max(mine.length, theirs.length)
        for a, b in zip(mine.cache.layers, theirs.cache.layers, strict=True):
            a.keys = torch.cat([_pad_columns(a.keys, length), _pad_columns(b.keys, length)])
            a.values = torch.cat([_pad_columns(a.values, length), _pad_columns(b.values, length)])
        mine.valid = torch.cat([_pad_flags(mine.valid, length), _pad_flags(theirs.valid, length)])
        mine.n_real = torch.cat([mine.n_real, theirs.n_real])
        mine.length = length
    elif mine.cache is not None:  # separate caches: K rows per prompt, a plain batch cache
        mine.cache, valid = join(mine.cache, mine.mask.bool(), theirs.cache, theirs.mask.bool())
        mine.mask = valid.to(mine.mask.dtype)
        mine.n_real = torch.cat([mine.n_real, theirs.n_real])
    else:  # no cache: the sequences themselves
        length = max(mine.ids.shape[1], theirs.ids.shape[1])
        mine.ids = torch.cat([_pad_flags(mine.ids, length), _pad_flags(theirs.ids, length)])
        mine.mask = torch.cat([_pad_flags(mine.mask, length), _pad_flags(theirs.mask, length)])
    for name in ("samples_run", "tokens_run"):  # adaptive K's counters
        if hasattr(ensemble, name):
            setattr(ensemble, name, getattr(ensemble, name) + getattr(other, name))
    if hasattr(ensemble, "entropies"):
        ensemble.entropies += other.entropies


def keep_rows(ensemble, rows: Tensor) -> None:
    """Keep the prompts ``rows`` (indices, in order) of ``ensemble``, then drop leading columns that
    are padding in every row (one host sync per leave, none per step)."""
    v = ensemble.variant
    if hasattr(v, "length"):  # clean cache
        v.valid, v.n_real = v.valid[rows], v.n_real[rows]
        for layer in v.cache.layers:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        first = _first_real(v.valid)
        if first > 0:
            v.valid = v.valid[:, first:]
            v.length -= first
            for layer in v.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
    elif v.cache is not None:  # separate caches: a prompt's K rows together
        samples = (rows[:, None] * v.K + torch.arange(v.K, device=rows.device)).flatten()
        v.cache, valid = keep(v.cache, v.mask.bool(), samples)
        v.mask, v.n_real = valid.to(v.mask.dtype), v.n_real[samples]
    else:  # no cache
        v.ids, v.mask = v.ids[rows], v.mask[rows]
        first = _first_real(v.mask.bool())
        v.ids, v.mask = v.ids[:, first:], v.mask[:, first:]


def _first_real(valid: Tensor) -> int:
    return int(valid.any(0).long().argmax())


def _pad_columns(t: Tensor, length: int) -> Tensor:
    """[B, H, L, D] -> [B, H, length, D] with zeros in front."""
    return F.pad(t, (0, 0, length - t.shape[-2], 0)) if t.shape[-2] < length else t


def _pad_flags(t: Tensor, length: int) -> Tensor:
    """[B, L] -> [B, length] with zeros (False, padding ids) in front."""
    return F.pad(t, (length - t.shape[1], 0)) if t.shape[1] < length else t
