"""The running batch's KV cache: rows join (left-padded to a common length) and leave at step boundaries.

The batch cache is a transformers ``DynamicCache`` whose every layer holds keys and values
[B, H, L, D]; ``valid`` [B, L] marks each row's real positions (a row that joined shorter than the
batch is padded on the left, and padding is masked out of attention by the 2-D attention mask).
Position ids are passed explicitly (each row's count of real tokens), so a row's numbers do not
depend on the padding in front of it. A join copies the cache once (O(B·L) per join, none per
step); a leave selects the remaining rows and drops columns that are padding in every row.

Only full-attention caches can be re-batched this way: a sliding-window or recurrent layer (gpt-oss's
sliding layers, Qwen3-Next's linear attention) keeps a state whose length is not the row's, so
``check_batchable`` refuses such models with a clear error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class UnbatchableCacheError(ValueError):
    """The model's KV cache has layers that cannot be padded and re-batched."""


def new_cache(model: nn.Module):
    """An empty ``DynamicCache`` for ``model``."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def check_batchable(cache) -> None:
    """Refuse caches with sliding-window or recurrent layers (see the module doc)."""
    from transformers.cache_utils import DynamicLayer

    odd = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if odd:
        raise UnbatchableCacheError(
            f"the engine batches full-attention KV caches only; this model's cache has {', '.join(odd)} "
            "layers (sliding-window or recurrent attention), which it cannot pad and re-batch"
        )


def _pad_left(t: Tensor, length: int) -> Tensor:
    """[B, H, L, D] -> [B, H, length, D] with zeros in front."""
    return F.pad(t, (0, 0, length - t.shape[-2], 0)) if t.shape[-2] < length else t


def join(batch, valid: Tensor | None, row_cache, row_length: int) -> tuple[object, Tensor]:
    """Append one prefilled row (its cache holding ``row_length`` real positions) to the batch.

    Returns the batch cache (the row's own when the batch is empty) and the new ``valid`` [B + 1, L']."""
    device = row_cache.layers[0].keys.device
    row_valid = torch.ones(1, row_length, dtype=torch.bool, device=device)
    if batch is None or valid is None or valid.shape[0] == 0:
        return row_cache, row_valid
    length = max(valid.shape[1], row_length)
    for mine, theirs in zip(batch.layers, row_cache.layers, strict=True):
        mine.keys = torch.cat([_pad_left(mine.keys, length), _pad_left(theirs.keys, length)])
        mine.values = torch.cat([_pad_left(mine.values, length), _pad_left(theirs.values, length)])
    valid = torch.cat(
        [F.pad(valid, (length - valid.shape[1], 0)), F.pad(row_valid, (length - row_length, 0))]
    )
    return batch, valid


def keep(batch, valid: Tensor, rows: Tensor) -> tuple[object, Tensor]:
    """Keep the batch rows ``rows`` (indices, in order), then drop leading all-padding columns."""
    valid = valid[rows]
    for layer in batch.layers:
        layer.keys, layer.values = layer.keys[rows], layer.values[rows]
    if valid.shape[0] == 0:
        return None, valid
    first_real = int(valid.any(0).long().argmax())  # one host sync per leave, not per step
    if first_real > 0:
        valid = valid[:, first_real:]
        for layer in batch.layers:
            layer.keys, layer.values = layer.keys[:, :, first_real:], layer.values[:, :, first_real:]
    return batch, valid
