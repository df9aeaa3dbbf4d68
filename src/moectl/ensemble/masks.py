"""Attention masks for Q queries at one position that share a prefix: the K samples of a clean-cache step.

In a clean-cache step (RoE §2.3) the K samples of the current token are fed to the model as K query
tokens of one sequence, all at the same position id. Each attends to the clean prefix (the keys
in the cache) and to its *own* key only — never to the other samples' keys:

    keys:      prefix a_0 … a_{n-1} | current q_0 q_1 … q_{Q-1}
    query j:   prefix visible        | only q_j

"Prefix visible" follows the layer's attention kind exactly as transformers' own masks do
(``masking_utils``): padding, a sliding window (key index > query index − W) or a chunk (same
chunk after left padding). One 4D additive mask per kind; a dict keyed by layer type when a model
mixes kinds (gpt-oss, Llama-4, hybrids), a single tensor otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.cache_utils import get_layer_types_and_kwargs

from moectl.errors import NotSupportedError

_KINDS = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "linear_attention": "recurrent",
}


@dataclass(frozen=True)
class AttentionKind:
    """One layer type of the model: ``kind`` is full | sliding | chunked | recurrent."""

    layer_type: str
    kind: str
    window: int | None = None  # sliding window W or chunk size C
    first_layer: int = 0  # a decoder layer of this type (to read its cache length)


def attention_kinds(config) -> tuple[list[AttentionKind], bool]:
    """The distinct attention kinds of a model, and whether its forward takes a per-type mask dict."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types, _ = get_layer_types_and_kwargs(text_config)
    kinds: dict[str, AttentionKind] = {}
    for i, layer_type in enumerate(layer_types):
        if layer_type in kinds:
            continue
        kind = _KINDS.get(layer_type)
        if kind is None:
            raise NotSupportedError(
                f"RoE clean cache: layer type {layer_type!r} (decoder layer {i}) is not supported; supported "
                f"layer types are {', '.join(_KINDS)}. Use cache='separate' or cache='none' for this model."
            )
        window = None
        if kind == "sliding":
            window = int(text_config.sliding_window)
        elif kind == "chunked":
            window = int(text_config.attention_chunk_size)
        kinds[layer_type] = AttentionKind(layer_type, kind, window, i)
    as_dict = len(kinds) > 1 and getattr(text_config, "layer_types", None) is not None
    return list(kinds.values()), as_dict


def mask_dtype(model: nn.Module) -> torch.dtype:
    """The additive masks' dtype: that of the model's floating-point weights."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def prefix_visibility(
    kind: AttentionKind, key_index: Tensor, query_index: Tensor, valid: Tensor, left_pad: Tensor
) -> Tensor:
    """[B, m, n] bool: may a query at absolute index ``query_index`` [m] see earlier keys ``key_index`` [n]?

    ``valid`` [B, ≥ n] marks real (non-padding) tokens by absolute index; ``left_pad`` [B] counts
    each row's leading padding (chunk boundaries start at the first real token, as in
    transformers' ``chunked_overlay``). Keys at or after the query are never visible.
    """
    key, query = key_index[None, None, :], query_index[None, :, None]
    visible = valid[:, key_index][:, None, :] & (key < query)
    if kind.kind == "sliding":
        visible = visible & (key > query - kind.window)
    elif kind.kind == "chunked":
        lp = left_pad[:, None, None]
        visible = visible & ((key - lp) // kind.window == (query - lp) // kind.window)
    return visible


def shared_prefix_mask(prefix_visible: Tensor, num_queries: int, dtype: torch.dtype) -> Tensor:
    """[B, 1, Q, n + Q] additive mask: every query sees the visible prefix and its own key only."""
    b, n = prefix_visible.shape
    own = torch.eye(num_queries, dtype=torch.bool, device=prefix_visible.device)
    allowed = torch.cat(
        [
            prefix_visible[:, None, None, :].expand(b, 1, num_queries, n),
            own.expand(b, 1, num_queries, num_queries),
        ],
        dim=-1,
    )
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def step_masks(
    kinds: list[AttentionKind],
    as_dict: bool,
    prefix_lengths: dict[str, int],
    query_index: int,
    num_queries: int,
    valid: Tensor,
    left_pad: Tensor,
    dtype: torch.dtype,
) -> Tensor | dict[str, Tensor | None]:
    """The model's ``attention_mask`` argument for one shared-prefix step.

    ``prefix_lengths[layer_type]`` is how many prefix keys that type's cache layers return (the
    last n before ``query_index``). Recurrent layer types get None (their padding is handled by
    the caller).
    """
    query = torch.tensor([query_index], device=valid.device)

    def mask(kind: AttentionKind) -> Tensor:
        n = prefix_lengths[kind.layer_type]
        key_index = torch.arange(query_index - n, query_index, device=valid.device)
        visible = prefix_visibility(kind, key_index, query, valid, left_pad)[:, 0]
        return shared_prefix_mask(visible, num_queries, dtype)

    return _per_kind(kinds, as_dict, mask)


def teacher_forced_masks(
    kinds: list[AttentionKind], as_dict: bool, valid: Tensor, left_pad: Tensor, dtype: torch.dtype
) -> Tensor | dict[str, Tensor | None]:
    """[B, 1, L, 2L] masks for scoring all positions at once over a clean cache of the same L tokens.

    Keys are the clean sequence (cached) followed by the noisy sample's own tokens: query t sees
    the clean keys before t (by the layer's attention kind) and its own key t only — every
    position's prediction conditions on the clean prefix, as in a clean-cache decoding step.
    """
    index = torch.arange(valid.shape[1], device=valid.device)
    return _per_kind(
        kinds,
        as_dict,
        lambda kind: _clean_then_own(prefix_visibility(kind, index, index, valid, left_pad), dtype),
    )


def teacher_forced_span_masks(
    kinds: list[AttentionKind],
    as_dict: bool,
    valid: Tensor,
    left_pad: Tensor,
    first: int,
    stop: int,
    copies: int,
    dtype: torch.dtype,
) -> Tensor | dict[str, Tensor | None]:
    """[B, 1, Q, n + Q] masks for ``copies`` noisy samples of positions ``first … stop − 1`` at once.

    The queries are the span's tokens repeated ``copies`` times (sample-major, Q = copies ·
    (stop − first)); the keys are the clean cache's first n = stop − 1 tokens followed by the
    queries' own keys. Query (k, t) sees the clean keys before t (by the layer's attention kind)
    and its own key only — :func:`teacher_forced_masks` restricted to a span of positions, with
    several samples folded into the query dimension as in a clean-cache step (RoE §2.3).
    """
    query = torch.arange(first, stop, device=valid.device).repeat(copies)
    keys = torch.arange(max(stop - 1, 0), device=valid.device)
    return _per_kind(
        kinds,
        as_dict,
        lambda kind: _clean_then_own(prefix_visibility(kind, keys, query, valid, left_pad), dtype),
    )


def _clean_then_own(clean: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, 1, Q, n + Q] additive mask: query i sees the clean keys ``clean`` [B, Q, n] allows, then its own key only."""
    b, q, _ = clean.shape
    own = torch.eye(q, dtype=torch.bool, device=clean.device).expand(b, q, q)
    allowed = torch.cat([clean, own], dim=-1)[:, None]
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=clean.device), torch.finfo(dtype).min)


def _per_kind(
    kinds: list[AttentionKind], as_dict: bool, mask: Callable[[AttentionKind], Tensor]
) -> Tensor | dict[str, Tensor | None]:
    """The model's ``attention_mask`` argument: ``mask(kind)`` per attention kind (None for recurrent
    layer types, whose padding the caller handles), by layer type when the model takes a dict, else
    the one mask."""
    masks = {kind.layer_type: None if kind.kind == "recurrent" else mask(kind) for kind in kinds}
    if as_dict:
        return masks
    (only,) = [m for m in masks.values() if m is not None]
    return only
