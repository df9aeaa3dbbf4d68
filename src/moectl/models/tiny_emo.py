"""A tiny offline stand-in for EMO's released checkpoints (``EmoForCausalLM``, ``trust_remote_code``).

No machine here reaches the hub, and EMO's modeling code is remote code, so moectl's tests and
``moectl inspect --tiny emo`` use this replica of its *routing structure*, written from reading
allenai/EMO ``src/hf_trust_remote_code/emo/modeling_emo.py``: an ``EmoSparseMoeBlock`` holding a
bare ``gate`` Linear over all experts, an ``nn.ModuleList`` of SwiGLU ``experts``, ``top_k``,
``norm_topk_prob``, ``num_shared_experts``, ``always_active_experts``, routing inline in its forward
by the same three paths, returning (output, gate logits).

Deviations (none touches routing): attention, norms and the decoder loop are OLMoE's from
transformers (EMO's attention has no QK-norm); no ghost-expert eval, no per-layer expert counts, no
dense layers, no load-balancing loss. The config's model_type is ``moectl_tiny_emo``, not ``emo``,
so that a real EMO checkpoint never loads into this replica by mistake.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.activations import ACT2FN
from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeDecoderLayer, OlmoeForCausalLM, OlmoeModel


class TinyEmoConfig(OlmoeConfig):
    model_type = "moectl_tiny_emo"

    num_shared_experts: int = 0
    always_active_experts: list[int] | None = None
    always_active_experts_per_layer: list[list[int] | None] | None = None


class EmoExpert(nn.Module):
    """One SwiGLU expert."""

    def __init__(self, config: TinyEmoConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class EmoSparseMoeBlock(nn.Module):
    """EMO's MoE block, routing in its forward (the class name is what moectl's registry matches)."""

    def __init__(self, config: TinyEmoConfig, always_active_experts: list[int] | None) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.num_experts = config.num_experts
        self.num_shared_experts = config.num_shared_experts
        self.always_active_experts = always_active_experts
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList([EmoExpert(config) for _ in range(self.num_experts)])

    def _route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """(weights [N, top_k] float32, expert ids [N, top_k])."""
        if self.always_active_experts:  # softmax over all; the always-active ones, then the best others
            always = torch.tensor(self.always_active_experts, device=logits.device)
            p = F.softmax(logits, dim=-1, dtype=torch.float32)
            others = p.index_fill(-1, always, float("-inf"))
            routed_w, routed_i = others.topk(self.top_k - len(always), dim=-1)
            routed_w = p.gather(-1, routed_i)
            always_i = always.expand(p.shape[0], -1)
            return torch.cat([p.gather(-1, always_i), routed_w], -1), torch.cat([always_i, routed_i], -1)
        s = self.num_shared_experts
        if s > 0:  # legacy: the last s experts are shared, each part with its own softmax
            routed = F.softmax(logits[:, :-s], dim=-1, dtype=torch.float32).topk(self.top_k - s, dim=-1)
            shared = F.softmax(logits[:, -s:], dim=-1, dtype=torch.float32).topk(s, dim=-1)
            shared_i = shared.indices + self.num_experts - s
            return torch.cat([routed.values, shared.values], -1), torch.cat([routed.indices, shared_i], -1)
        weights, idx = F.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, idx

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        b, t, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        logits = self.gate(x)
        weights, idx = self._route(logits)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        hits = F.one_hot(idx, self.num_experts).permute(2, 1, 0)  # [E, k, N]
        for e in range(self.num_experts):
            slot, token = torch.where(hits[e])
            out.index_add_(0, token, (self.experts[e](x[token]) * weights[token, slot, None]).to(x.dtype))
        return out.view(b, t, h), logits


class EmoDecoderLayer(OlmoeDecoderLayer):
    """OLMoE's pre-norm decoder layer with EMO's block, whose (output, logits) it unpacks."""

    def __init__(self, config: TinyEmoConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        per_layer = config.always_active_experts_per_layer
        always = per_layer[layer_idx] if per_layer is not None else config.always_active_experts
        self.mlp = EmoSparseMoeBlock(config, always)

    def forward(self, hidden_states: Tensor, **kwargs) -> Tensor:
        residual = hidden_states
        attn, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        hidden_states = residual + attn
        moe, _ = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + moe


class EmoModel(OlmoeModel):
    config_class = TinyEmoConfig

    def __init__(self, config: TinyEmoConfig) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList([EmoDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.post_init()


class EmoForCausalLM(OlmoeForCausalLM):
    config_class = TinyEmoConfig

    def __init__(self, config: TinyEmoConfig) -> None:
        super().__init__(config)
        self.model = EmoModel(config)
        self.post_init()


AutoConfig.register(TinyEmoConfig.model_type, TinyEmoConfig, exist_ok=True)
AutoModelForCausalLM.register(TinyEmoConfig, EmoForCausalLM, exist_ok=True)
