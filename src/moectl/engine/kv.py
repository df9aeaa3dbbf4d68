"""The running batch's KV cache: rows join (left-padded to a common length) and leave at step boundaries.

The batch cache is a transformers ``DynamicCache`` whose every layer holds keys and values
[B, H, L, D]; ``valid`` [B, L] marks each row's real positions (a row that joined shorter than the
batch is padded on the left, and padding is masked out of attention by the 2-D attention mask).
Position ids are passed explicitly (each row's count of real tokens), so a row's numbers do not
depend on the padding in front of it. Rows prefilled together arrive already left-padded to their
longest prompt (``rows_valid``). A join copies the cache once (O(B·L) per join, none per step); a
leave selects the remaining rows and drops columns that are padding in every row.

Sliding-window layers (gpt-oss) keep the last W − 1 columns of the same padded layout: with
padding on the left, a column distance is a position distance, so the window stays exact; their
``cumulative_length`` is kept equal to the batch's length L. Recurrent or linear-attention layers
(Qwen3-Next, Jamba), caches of a model's own (MiniMax) and chunked attention (Llama 4, whose chunks
are aligned to absolute positions) cannot be padded this way: ``check_batchable`` refuses them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moectl.errors import MoectlError
from moectl.routing.kv_cache import cache_out, with_cache


class UnbatchableCacheError(MoectlError, ValueError):
    """The model's KV cache has layers that cannot be padded and re-batched."""


def new_cache(model: nn.Module):
    """An empty ``DynamicCache`` for ``model``."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def check_batchable(cache, config=None) -> None:
    """Refuse caches the engine cannot pad and re-batch (see the module doc)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    ok = (DynamicLayer, DynamicSlidingWindowLayer)
    odd = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in ok})
    chunked = "chunked_attention" in (getattr(config, "layer_types", None) or ())
    if odd or chunked:
        what = ", ".join(odd) + " layers" if odd else "chunked attention"
        raise UnbatchableCacheError(
            f"the engine batches full- and sliding-window attention caches only; this model has {what} "
            "(recurrent, linear or chunked attention), which it cannot pad and re-batch"
        )


def batchable(model: nn.Module) -> bool:
    """Whether the engine can pad and re-batch ``model``'s KV cache (else run it with
    ``EngineConfig(solo=True)``): a one-token forward into the engine's cache, checked."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, **with_cache(new_cache(model)), use_cache=True, logits_to_keep=1)
        cache = cache_out(out)
        check_batchable(cache if cache is not None else new_cache(model), model.config)
    except (UnbatchableCacheError, ValueError, TypeError, AttributeError):
        return False  # a model with a cache of its own refuses the engine's (MiniMax)
    return True


def _window(layer) -> int | None:
    """How many columns a sliding-window layer keeps (W − 1), None for a full-attention layer."""
    return layer.sliding_window - 1 if getattr(layer, "is_sliding", False) else None


def _pad_left(t: Tensor, length: int) -> Tensor:
    """[B, H, L, D] -> [B, H, length, D] with zeros in front."""
    return F.pad(t, (0, 0, length - t.shape[-2], 0)) if t.shape[-2] < length else t


def join(batch, valid: Tensor | None, rows_cache, rows_valid: Tensor) -> tuple[object, Tensor]:
    """Append prefilled rows (their cache, left-padded as ``rows_valid`` [k, L_k] marks) to the batch.

    Returns the batch cache (the rows' own when the batch is empty) and the new ``valid`` [B + k, L']."""
    rows_valid = rows_valid.bool()
    if batch is None or valid is None or valid.shape[0] == 0:
        return rows_cache, rows_valid
    row_length = rows_valid.shape[1]
    length = max(valid.shape[1], row_length)
    for mine, theirs in zip(batch.layers, rows_cache.layers, strict=True):
        window = _window(mine)
        cols = length if window is None else min(length, window)
        mine.keys = torch.cat([_pad_left(mine.keys, cols), _pad_left(theirs.keys, cols)])
        mine.values = torch.cat([_pad_left(mine.values, cols), _pad_left(theirs.values, cols)])
        if window is not None:
            mine.cumulative_length = length
    valid = torch.cat(
        [F.pad(valid, (length - valid.shape[1], 0)), F.pad(rows_valid, (length - row_length, 0))]
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
        length = valid.shape[1]
        for layer in batch.layers:
            window = _window(layer)
            cols = length if window is None else min(length, window)
            layer.keys, layer.values = layer.keys[:, :, -cols:], layer.values[:, :, -cols:]
            if window is not None:
                layer.cumulative_length = length
    return batch, valid
