"""RoE §2.3 Clean Cache: the K samples of a token as K queries at one position over one clean KV cache.

One KV cache (``cache.CleanCacheMixin``), built by the clean path only. A step feeds the current
token as **K query tokens of one sequence** at the same position id (shape [B, K] instead of
[B·K, 1]), so attention reads the cached prefix once for all K samples — nothing is repeated or
expanded over a B·K batch — and each query also sees its own key (``masks.shared_prefix_mask``).
Only query 0's (the clean sample's) keys/values are appended, so the cache holds exactly one
sequence's keys and values whatever K is. Routing noise applies to queries 1 … K−1 only
(``noise.SampleGumbel``).

Hybrid models (linear-attention / Mamba layers: Qwen3-Next, Jamba): a recurrent layer cannot take
K samples as a sequence, so ``hybrid.RecurrentUnfold`` reshapes its input to [B·K, 1] around its
forward, reads the clean conv/recurrent states repeated K times (O(1) in sequence length) and
keeps the clean sample's new states only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moectl.ensemble.clean_cache import CleanCacheMixin, StepPlan, new_clean_cache
from moectl.ensemble.masks import attention_kinds, mask_dtype, step_masks
from moectl.ensemble.noise import NoiseLayout, SampleGumbel
from moectl.errors import UnsupportedModelError
from moectl.lm.padding import left_padded, token_column
from moectl.routing.kv_cache import with_cache

_SUPPORTED_ATTN = ("eager", "sdpa")


def _check_attention(model: nn.Module) -> None:
    impl = getattr(model.config, "_attn_implementation", "eager")
    if impl not in _SUPPORTED_ATTN:
        raise UnsupportedModelError(
            f"RoE clean cache passes explicit attention masks, which attn_implementation {impl!r} does not take; "
            f"load the model with attn_implementation in {_SUPPORTED_ATTN} (or use cache='separate')"
        )


class CleanCacheVariant:
    """RoE §2.3 Clean Cache: K samples as K queries at one position over one clean KV cache.

    State: ``valid`` [B, length + 1] real-token flags by absolute index (the current token
    included), ``length`` committed tokens, ``n_real`` [B] real tokens committed, ``left_pad`` [B].
    """

    def __init__(self, model: nn.Module, K: int, noise: SampleGumbel) -> None:
        _check_attention(model)
        self.model, self.K, self.noise = model, int(K), noise
        self.kinds, self.as_dict = attention_kinds(model.config)
        self.dtype = mask_dtype(model)
        self.cache: CleanCacheMixin | None = None
        from moectl.ensemble.hybrid import RecurrentUnfold  # hybrid models only; no cost otherwise

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
                **with_cache(self.cache),
                use_cache=True,
                logits_to_keep=1,
            )
            self.cache.trim()
            self.length = input_ids.shape[1] - 1
            self.n_real = valid[:, :-1].sum(1)
        return input_ids[:, -1]

    def push(self, tokens: Tensor, valid: Tensor | None = None) -> None:
        """Make ``tokens`` [B] the current token (``valid`` False: padding)."""
        self.valid = torch.cat([self.valid, token_column(valid, tokens)[:, None]], dim=1)

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
                    **with_cache(self.cache),
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
