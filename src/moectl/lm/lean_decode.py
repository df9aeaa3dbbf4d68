"""A decoding forward without transformers' per-layer plumbing: one new token per row, same numbers.

A decode step of a small MoE model in transformers is mostly Python around tiny tensors: the mask
builder, the rotary module, every decoder layer's and attention's keyword plumbing and wrappers.
:class:`LeanDecode` runs the same step as the base model's ``forward`` for a call of one token per
row with a ``DynamicCache``-like cache: the same modules' weights through the same operations in
the same order (the norms, projections and MoE blocks are the model's own modules, called as they
are, so routing hooks, offloaded experts and LoRA layers act as in the model's forward; the
attention is transformers' own attention function for the model's implementation). What it skips
is the plumbing: the causal mask is the call's padding mask (for one query token the causal part
is empty), rotary cos/sin are computed once per call, no per-layer keyword dictionaries.

Families: decoder layers of pre-norm attention + MLP/MoE blocks with standard rotary attention —
Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral (``FAMILIES``). Anything else (and any call it does not
cover: several tokens per row, a sliding window the cache has passed, no cache) takes the model's
own forward; :func:`lean_decode` says which and why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

# model_type -> (query/key norm: None, "flat" over the projection's output, "head" per head)
FAMILIES: dict[str, str | None] = {
    "qwen2_moe": None,
    "qwen3_moe": "head",
    "olmoe": "flat",
    "mixtral": None,
}


def _rotate_half(x: Tensor) -> Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class _Layer:
    index: int
    module: nn.Module
    input_norm: nn.Module
    post_norm: nn.Module
    attn: nn.Module
    mlp: nn.Module
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    sliding: bool


class LeanDecode:
    """The base model's decoding forward for one token per row (see the module doc)."""

    def __init__(self, base: nn.Module, qk_norm: str | None) -> None:
        self.base = base
        config = base.config
        self.config = config
        self.qk_norm = qk_norm
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.clip = getattr(config, "clip_qkv", None)
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.window = getattr(config, "sliding_window", None)
        self.layers = []
        for i, layer in enumerate(base.layers[: config.num_hidden_layers]):
            attn = layer.self_attn
            self.layers.append(
                _Layer(
                    index=i,
                    module=layer,
                    input_norm=layer.input_layernorm,
                    post_norm=layer.post_attention_layernorm,
                    attn=attn,
                    mlp=layer.mlp,
                    q_proj=attn.q_proj,
                    k_proj=attn.k_proj,
                    v_proj=attn.v_proj,
                    o_proj=attn.o_proj,
                    q_norm=getattr(attn, "q_norm", None),
                    k_norm=getattr(attn, "k_norm", None),
                    sliding=types[i] == "sliding_attention",
                )
            )
        self.rotary = base.rotary_emb
        self.embed = base.embed_tokens
        self.norm = base.norm

    def _attention_fn(self) -> Callable:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        impl = self.config._attn_implementation
        if impl == "eager" or impl is None:
            from importlib import import_module

            return import_module(type(self.layers[0].attn).__module__).eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS[impl]

    def covers(self, input_ids: Tensor | None, cache: Any, attention_mask: Tensor | None) -> str | None:
        """None where this call is one this forward computes exactly as the model's, else why not."""
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1:
            return "not one token per row"
        if cache is None or not hasattr(cache, "update"):
            return "no KV cache"
        if attention_mask is not None and (not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2):
            return "a prepared attention mask"
        if self.window and any(layer.sliding for layer in self.layers):
            return "sliding-window attention"
        if self.config._attn_implementation not in ("sdpa", "eager"):
            return f"attention implementation {self.config._attn_implementation!r}"
        if self.base.training or torch.is_grad_enabled():
            return "training or autograd (the lean forward is for inference)"
        if self._hooked():
            return "hooks on decoder layers or attention modules (they would not fire)"
        return None

    def _hooked(self) -> bool:
        from torch.nn.modules import module as nn_module

        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        return any(
            m._forward_hooks or m._forward_pre_hooks for layer in self.layers for m in (layer.module, layer.attn)
        )

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None, cache: Any
    ) -> Tensor:
        """The final hidden states [B, 1, H] after one token per row, the cache extended by it."""
        h = self.embed(input_ids)
        b = h.shape[0]
        past = int(cache.get_seq_length())
        if position_ids is None:
            position_ids = torch.full((b, 1), past, dtype=torch.long, device=h.device)
        cos, sin = self.rotary(h, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        mask = self._mask(attention_mask, b, past + 1, h)
        attention = self._attention_fn()
        shape = (b, 1, -1, self.head_dim)
        for layer in self.layers:
            residual = h
            x = layer.input_norm(h)
            q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
            if self.qk_norm == "flat":
                q, k = layer.q_norm(q), layer.k_norm(k)
            if self.clip is not None:
                q.clamp_(min=-self.clip, max=self.clip)
                k.clamp_(min=-self.clip, max=self.clip)
                v.clamp_(min=-self.clip, max=self.clip)
            q, k, v = q.view(shape), k.view(shape), v.view(shape)
            if self.qk_norm == "head":
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            k, v = cache.update(k, v, layer.index)
            out, _ = attention(layer.attn, q, k, v, mask, dropout=0.0, scaling=layer.attn.scaling)
            h = residual + layer.o_proj(out.reshape(b, 1, -1).contiguous())
            residual = h
            h = residual + layer.mlp(layer.post_norm(h))
        return self.norm(h)

    @contextmanager
    def installed(self, stats: dict[str, int] | None = None) -> Iterator[None]:
        """Inside the block the base model's ``forward`` is this one for the calls it covers (the
        model's own for the rest), so a caller keeps calling the causal LM as before: its LM head,
        the base model's hooks (routing sessions, recorders) and its output are unchanged.
        ``stats`` counts ``lean`` and ``model`` calls."""
        base = self.base
        before = base.__dict__.get("forward")  # someone else's instance forward, kept
        own = before if before is not None else type(base).forward.__get__(base)

        def forward(*args: Any, **kwargs: Any) -> Any:
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache = next((kwargs[n] for n in _CACHE_NAMES if kwargs.get(n) is not None), None)
            extra = set(kwargs) - {"input_ids", "attention_mask", "position_ids", "use_cache", *_CACHE_NAMES}
            extra -= {k for k in extra if not kwargs[k]}  # output_router_logits=False and the like
            if len(args) > 1 or extra or self.covers(ids, cache, kwargs.get("attention_mask")) is not None:
                if stats is not None:
                    stats["model"] = stats.get("model", 0) + 1
                return own(*args, **kwargs)
            if stats is not None:
                stats["lean"] = stats.get("lean", 0) + 1
            hidden = self.forward(ids, kwargs.get("attention_mask"), kwargs.get("position_ids"), cache)
            return _output(base, hidden, cache)

        base.forward = forward
        try:
            yield
        finally:
            if before is not None:
                base.forward = before
            else:
                del base.forward

    def _mask(self, attention_mask: Tensor | None, b: int, length: int, h: Tensor) -> Tensor | None:
        """What transformers' mask builder gives a one-token query: None without padding (every key
        is visible), else the padding mask [B, 1, 1, L] (bool for sdpa, additive for eager)."""
        if attention_mask is None:
            return None
        valid = attention_mask[:, -length:].bool()
        if bool(valid.all()):
            return None
        mask = valid[:, None, None, :]
        if self.config._attn_implementation == "eager":
            return torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(
                ~mask, torch.finfo(h.dtype).min
            )
        return mask


_CACHE_NAMES = ("cache", "past_key_values")  # transformers >= 5.24, before it


def _output(base: nn.Module, hidden: Tensor, cache: Any) -> Any:
    """The base model's own output type holding ``hidden`` and ``cache`` (under the field its
    transformers release names the cache)."""
    from transformers.modeling_outputs import MoeModelOutputWithPast

    fields = getattr(MoeModelOutputWithPast, "__dataclass_fields__", {})
    name = _CACHE_NAMES[0] if _CACHE_NAMES[0] in fields else _CACHE_NAMES[1]
    return MoeModelOutputWithPast(last_hidden_state=hidden, **{name: cache})


def lean_decode(model: nn.Module) -> tuple[LeanDecode | None, str]:
    """A :class:`LeanDecode` for ``model`` (a causal LM, PEFT-wrapped or not) and what it is, or None
    and why not."""
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(root, "config", None)
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return None, f"family {family!r} has no lean decoding forward (those that do: {', '.join(FAMILIES)})"
    base = getattr(root, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return None, f"{type(root).__name__} has no decoder with layers and a rotary embedding"
    return LeanDecode(base, FAMILIES[family]), f"lean decoding forward for {family}"
