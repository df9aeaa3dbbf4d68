"""How the K routing samples of each token see the past: clean cache (RoE §2.3), separate caches, no cache.

Each variant answers the same two calls — ``start(prompt ids, mask)`` and ``step(next tokens)`` —
with the next-token logits of every sample, [B, K, V], for the last token fed. Sample 0 is always
the clean path (tau = 0). They differ in the history the noisy samples condition on and in cost:

``CleanCacheVariant`` (the paper's Clean Cache, §2.3)
    One KV cache, built by the clean path only. A step feeds the current token as **K query tokens
    of one sequence** at the same position id (shape [B, K] instead of [B·K, 1]), so attention
    reads the cached prefix once for all K samples — nothing is repeated or expanded over a
    B·K batch — and each query also sees its own key (``masks.shared_prefix_mask``).
    ``CleanCacheMixin.update`` appends only query 0's (the clean sample's) keys/values to the
    cache and hands the attention call prefix + the K new keys (one concatenation, freed after
    that layer: the same per-layer copy transformers' ``DynamicCache`` makes for the plain model
    every step). The cache therefore holds exactly one sequence's keys and values whatever K is.
    Routing noise applies to queries 1 … K−1 only (``noise.SampleGumbel``).
    Hybrid models (linear-attention / Mamba layers: Qwen3-Next, Jamba): a recurrent layer cannot
    take K samples as a sequence, so ``hybrid.RecurrentUnfold`` reshapes its input to [B·K, 1]
    around its forward, reads the clean conv/recurrent states repeated K times (O(1) in sequence
    length) and keeps the clean sample's new states only.

``SeparateCachesVariant`` (the naive scheme §2.3 argues against)
    K batch rows per prompt, each with its own cache and its own noisy history (prompt included);
    memory grows linearly with K.

``NoCacheVariant`` (the definition, and Figure 4(b)'s no-cache baseline)
    Every step recomputes all K samples over the whole sequence from scratch, noise only at the
    current token: sample k sees the clean prefix and its own noisy routing for the current
    token. The clean cache must give the same logits (tests check it, greedy tokens included).

Prompts are left-padded batches: ``attention_mask`` [B, P] with ones at the right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

from moectl.roe.masks import attention_kinds, step_masks
from moectl.roe.noise import NoiseLayout, SampleGumbel

_SUPPORTED_ATTN = ("eager", "sdpa")


# -- the shared clean cache --------------------------------------------------------------------
@dataclass(frozen=True)
class StepPlan:
    """How ``CleanCache.update`` treats the next forward's keys/values.

    ``commit``: how many leading new tokens to append (1: the clean sample; 0: none).
    ``exclude``: how many of the newest cached tokens the queries must not see (1 when the clean
    token of this position was already committed, as in adaptive K's second pass).
    ``rows``: batch rows taking part (None: all), for passes over a subset of the prompts.
    """

    commit: int = 1
    exclude: int = 0
    rows: Tensor | None = None


class CleanCacheMixin:
    """Makes a transformers cache append only the clean sample's K/V during an RoE step.

    Outside a step (``plan is None``: the clean prefill) the cache behaves as its base class.
    Sliding-window layers record their past until ``trim()`` so that a step can still see the
    token a commit just pushed out of the window.
    """

    layers: list
    plan: StepPlan | None = None

    def _init_clean(self) -> None:
        for layer in self.layers:
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.activate_past_recording()
        self.plan = None

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        plan = self.plan
        if plan is None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)  # type: ignore[misc]
        while len(self.layers) <= layer_idx:  # caches that add layers lazily
            self.layers.append(DynamicLayer())
        layer = self.layers[layer_idx]
        keep = self.prefix_length(layer_idx, plan.exclude)
        if keep > 0:
            past_k, past_v = layer.keys[..., :keep, :], layer.values[..., :keep, :]
            if plan.rows is not None:
                past_k, past_v = past_k[plan.rows], past_v[plan.rows]
        else:
            past_k, past_v = key_states[..., :0, :], value_states[..., :0, :]
        if plan.commit:
            layer.update(key_states[..., : plan.commit, :], value_states[..., : plan.commit, :])
        return torch.cat([past_k, key_states], dim=-2), torch.cat([past_v, value_states], dim=-2)

    def prefix_length(self, layer_idx: int, exclude: int = 0) -> int:
        """Cached tokens a step's queries read at decoder layer ``layer_idx``."""
        if layer_idx >= len(self.layers):
            return 0
        layer = self.layers[layer_idx]
        if not getattr(layer, "is_initialized", False) or layer.keys is None or layer.keys.numel() == 0:
            return 0
        return layer.keys.shape[-2] - exclude

    def trim(self) -> None:
        """Drop what sliding-window layers no longer need (their last W − 1 tokens stay)."""
        for layer in self.layers:
            if (
                isinstance(layer, DynamicSlidingWindowLayer)
                and layer.is_initialized
                and layer.keys is not None
            ):
                layer.crop(0)


class CleanCache(CleanCacheMixin, DynamicCache):
    """The clean cache on a ``DynamicCache`` (per-layer types from the model config)."""

    def __init__(self, config) -> None:
        DynamicCache.__init__(self, config=config)
        self._init_clean()


def new_clean_cache(model: nn.Module) -> CleanCacheMixin:
    """A clean cache of the cache class the model requires (MiniMax insists on its own)."""
    if getattr(model.config, "model_type", "") == "minimax":
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        class CleanMiniMaxCache(CleanCacheMixin, MiniMaxCache):
            def __init__(self) -> None:
                MiniMaxCache.__init__(self)
                self._init_clean()

        return CleanMiniMaxCache()
    return CleanCache(model.config)


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


# -- prompts --------------------------------------------------------------------------------
def left_padded(attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(valid [B, P] bool, left padding [B], position ids [B, P]) of a left-padded batch; raise otherwise.

    A row may still be all padding (teacher-forced scoring starts batches mid-way); what is
    refused is padding *after* a real token.
    """
    valid = attention_mask.bool()
    if valid.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, length], got shape {tuple(attention_mask.shape)}")
    if bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        raise ValueError("RoE needs left-padded batches: a row has padding after a real token")
    left_pad = (~valid).sum(1)
    position = (valid.long().cumsum(1) - 1).clamp(min=0)
    return valid, left_pad, position


class SampleVariant(Protocol):
    """A way to run the K samples of each token (see the module docstring)."""

    K: int
    cache: object | None

    def start(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Feed a left-padded prompt batch; logits [B, K, V] of every sample at the last column."""

    def step(self, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
        """Feed the next token of each row [B] (``valid`` False: a padding token, for scoring
        batches that start mid-way); logits [B, K, V] of every sample at it."""


def _check_attention(model: nn.Module) -> None:
    impl = getattr(model.config, "_attn_implementation", "eager")
    if impl not in _SUPPORTED_ATTN:
        raise ValueError(
            f"RoE clean cache passes explicit attention masks, which attn_implementation {impl!r} does not take; "
            f"load the model with attn_implementation in {_SUPPORTED_ATTN} (or use cache='separate')"
        )


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _column(valid: Tensor | None, like: Tensor) -> Tensor:
    return torch.ones_like(like, dtype=torch.bool) if valid is None else valid.to(like.device, torch.bool)


# -- variants --------------------------------------------------------------------------------
class CleanCacheVariant:
    """RoE §2.3 Clean Cache: K samples as K queries at one position over one clean KV cache.

    State: ``valid`` [B, length + 1] real-token flags by absolute index (the current token
    included), ``length`` committed tokens, ``n_real`` [B] real tokens committed, ``left_pad`` [B].
    """

    def __init__(self, model: nn.Module, K: int, noise: SampleGumbel) -> None:
        _check_attention(model)
        self.model, self.K, self.noise = model, int(K), noise
        self.kinds, self.as_dict = attention_kinds(model.config)
        self.dtype = _model_dtype(model)
        self.cache: CleanCacheMixin | None = None
        from moectl.roe.hybrid import RecurrentUnfold  # hybrid models only; no cost otherwise

        self.unfold = RecurrentUnfold.for_model(model, self.kinds)

    def prefill(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Cache the clean prefix (every column but the last); return the last column's tokens."""
        valid, _, position = left_padded(attention_mask)
        self.cache = new_clean_cache(self.model)
        self.valid, self.length = valid, 0
        self.n_real = torch.zeros(valid.shape[0], dtype=torch.long, device=valid.device)
        if input_ids.shape[1] > 1:
            self.noise.layout = None
            self.model(
                input_ids=input_ids[:, :-1],
                attention_mask=attention_mask[:, :-1],
                position_ids=position[:, :-1],
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            self.cache.trim()
            self.length = input_ids.shape[1] - 1
            self.n_real = valid[:, :-1].sum(1)
        return input_ids[:, -1]

    def push(self, tokens: Tensor, valid: Tensor | None = None) -> None:
        """Make ``tokens`` [B] the current token (``valid`` False: padding)."""
        self.valid = torch.cat([self.valid, _column(valid, tokens)[:, None]], dim=1)

    def start(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        tokens = self.prefill(input_ids, attention_mask)
        return self.feed(tokens, torch.arange(self.K, device=tokens.device))

    def step(self, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
        self.push(tokens, valid)
        return self.feed(tokens, torch.arange(self.K, device=tokens.device))

    @property
    def left_pad(self) -> Tensor:
        """Leading padding per row (chunked attention counts chunks from the first real token)."""
        return (self.valid.long().cumsum(1) == 0).sum(1)

    def feed(
        self,
        tokens: Tensor,
        samples: Tensor,
        commit: bool = True,
        rows: Tensor | None = None,
        trim: bool = True,
    ) -> Tensor:
        """Run samples ``samples`` [Q] of the current token ``tokens`` [B] over the clean prefix.

        ``commit=True``: ``samples[0]`` must be the clean sample 0; its keys/values are appended.
        ``commit=False``: the current token's clean keys/values are already cached (adaptive K's
        second pass); the queries read the prefix before it. ``rows``: only these batch rows.
        ``trim=False`` keeps sliding layers' evicted token for such a second pass.
        Returns logits [B or len(rows), Q, V].
        """
        assert self.cache is not None, "start() first"
        if commit and int(samples[0]) != 0:
            raise ValueError("a committing step must put the clean sample 0 first")
        if commit and rows is not None:
            raise ValueError("a committing step runs every row (the cache must stay aligned)")
        q = samples.numel()
        query_index = self.length if commit else self.length - 1
        valid = self.valid[:, : query_index + 1]
        n_real = self.n_real if commit else self.n_real - valid[:, -1].long()
        left_pad = self.left_pad
        if rows is not None:
            tokens, valid, n_real, left_pad = tokens[rows], valid[rows], n_real[rows], left_pad[rows]
        b = tokens.shape[0]
        position = torch.where(valid[:, -1], n_real, 0)  # position id of the current token
        exclude = 0 if commit else 1
        lengths = {k.layer_type: self.cache.prefix_length(k.first_layer, exclude) for k in self.kinds}
        masks = step_masks(self.kinds, self.as_dict, lengths, query_index, q, valid, left_pad, self.dtype)
        noisy = samples > 0
        self.noise.layout = (
            NoiseLayout(sample=samples[None, :], position=position[:, None], scale=noisy[None, :])
            if bool(noisy.any())
            else None
        )
        self.cache.plan = StepPlan(commit=1 if commit else 0, exclude=exclude, rows=rows)
        try:
            with self.unfold(self.cache, q, commit=commit, rows=rows, valid=valid[:, -1]):
                out = self.model(
                    input_ids=tokens[:, None].expand(b, q).contiguous(),
                    attention_mask=masks,
                    position_ids=position[:, None].expand(b, q).contiguous(),
                    past_key_values=self.cache,
                    use_cache=True,
                )
        finally:
            self.cache.plan = None
            self.noise.layout = None
        if commit:
            self.length += 1
            self.n_real = self.n_real + self.valid[:, query_index].long()
        if trim:
            self.cache.trim()
        return out.logits


class SeparateCachesVariant:
    """K cache rows per prompt, each sample with its own noisy history (memory grows with K)."""

    def __init__(self, model: nn.Module, K: int, noise: SampleGumbel) -> None:
        self.model, self.K, self.noise = model, int(K), noise
        self.cache = None

    def start(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        valid, _, position = left_padded(attention_mask)
        self.cache = None  # the model creates the cache class it needs on the first forward
        self.mask = attention_mask.repeat_interleave(self.K, dim=0)
        self.n_real = valid.sum(1).repeat_interleave(self.K)
        return self._run(
            input_ids.repeat_interleave(self.K, dim=0), position.repeat_interleave(self.K, dim=0)
        )

    def step(self, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
        column = _column(valid, tokens).repeat_interleave(self.K)
        self.mask = torch.cat([self.mask, column[:, None].to(self.mask.dtype)], dim=1)
        position = torch.where(column, self.n_real, 0)[:, None]
        self.n_real = self.n_real + column.long()
        return self._run(tokens.repeat_interleave(self.K)[:, None], position)

    def _run(self, ids: Tensor, position: Tensor) -> Tensor:
        sample = (torch.arange(ids.shape[0], device=ids.device) % self.K)[:, None]
        self.noise.layout = (
            NoiseLayout(sample=sample, position=position, scale=sample > 0) if self.K > 1 else None
        )
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=self.mask,
                position_ids=position,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            self.noise.layout = None
        self.cache = out.past_key_values
        return out.logits[:, -1].reshape(-1, self.K, out.logits.shape[-1])


class NoCacheVariant:
    """Recompute all K samples from scratch each token, clean prefix, noise at the current token only."""

    def __init__(self, model: nn.Module, K: int, noise: SampleGumbel) -> None:
        self.model, self.K, self.noise = model, int(K), noise
        self.cache = None

    def start(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        left_padded(attention_mask)
        self.ids, self.mask = input_ids, attention_mask
        return self._run()

    def step(self, tokens: Tensor, valid: Tensor | None = None) -> Tensor:
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=1)
        self.mask = torch.cat([self.mask, _column(valid, tokens)[:, None].to(self.mask.dtype)], dim=1)
        return self._run()

    def _run(self) -> Tensor:
        _, _, position = left_padded(self.mask)
        k, length = self.K, self.ids.shape[1]
        device = self.ids.device
        sample = (torch.arange(self.ids.shape[0] * k, device=device) % k)[:, None]
        current = torch.arange(length, device=device)[None, :] == length - 1
        self.noise.layout = (
            NoiseLayout(
                sample=sample, position=position.repeat_interleave(k, dim=0), scale=(sample > 0) & current
            )
            if k > 1
            else None
        )
        try:
            out = self.model(
                input_ids=self.ids.repeat_interleave(k, dim=0),
                attention_mask=self.mask.repeat_interleave(k, dim=0),
                position_ids=position.repeat_interleave(k, dim=0),
                use_cache=False,
                logits_to_keep=1,
            )
        finally:
            self.noise.layout = None
        return out.logits[:, -1].reshape(-1, k, out.logits.shape[-1])


VARIANTS: dict[str, type] = {
    "clean": CleanCacheVariant,
    "separate": SeparateCachesVariant,
    "none": NoCacheVariant,
}


def make_variant(mode: str, model: nn.Module, K: int, noise: SampleGumbel) -> SampleVariant:
    """The sample runner for ``RoEConfig.cache``."""
    if mode not in VARIANTS:
        raise ValueError(f"cache must be one of {', '.join(VARIANTS)}, got {mode!r}")
    return VARIANTS[mode](model, K, noise)
