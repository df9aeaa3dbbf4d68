"""Tiny random-initialised MoE models of every supported family, built offline from configs.

Tests and the README's default run use these: no hub, milliseconds to build. Each config keeps
the family's routing features (shared experts, grouped routing, score-correction bias, dense
leading layers) so that adapters are exercised on what makes the family different.

EMO's checkpoints run remote code, so ``emo`` builds moectl's replica of its MoE block
(``models/tiny_emo.py``) with the released checkpoints' layout: routed experts plus one shared
expert that is last among the gate's outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from moectl.errors import ConfigError
from moectl.models.tiny_emo import TinyEmoConfig

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Per-family overrides: expert counts use each config's own key names.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False},
    "flex_olmo": {"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "minimax": {
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "layer_types": ["full_attention"] * 3,
    },
    "qwen2_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": False,
    },
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "qwen3_next": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
    },
    "gpt_oss": {
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 64,
    },
    "deepseek_v3": {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "head_dim": 8,
        "num_key_value_heads": 4,
    },
    "glm4_moe": {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.5,
    },
    "dots1": {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
    },
    "granitemoe": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "granitemoeshared": {
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
    },
    "ernie4_5_moe": {
        "moe_num_experts": 8,
        "moe_k": 2,
        "moe_num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "moe_layer_start_index": 1,
        "use_bias": False,
    },
    "jamba": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 1,
        "expert_layer_offset": 0,
        "mamba_d_state": 8,
        "mamba_expand": 2,
        "use_mamba_kernels": False,
    },
    "hunyuan_v1_moe": {"num_experts": 8, "moe_topk": 2, "use_qk_norm": True},
    "deepseek_v2": {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "topk_method": "group_limited_greedy",  # DeepSeek-V2; V2-Lite is "greedy" (tested too)
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.0,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "num_key_value_heads": 4,
    },
    "phimoe": {
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        # Phi-3.5-MoE uses 0.01; wider here so the masked softmaxes hold several experts at tiny scale
        "router_jitter_noise": 0.3,
    },
    "emo": {  # 8 routed + 1 shared (the last), top-3 = 2 routed + the shared one; EMO-1B-14B: 127 + 1, top-8
        "num_experts": 9,
        "num_experts_per_tok": 3,
        "num_shared_experts": 1,
        "norm_topk_prob": False,
    },
    "llama4_text": {
        "num_local_experts": 8,
        "num_experts_per_tok": 1,
        "intermediate_size": 32,
        "intermediate_size_mlp": 96,
        "interleave_moe_layer_step": 1,
        "no_rope_layers": [1, 1, 1],
        "attention_chunk_size": 64,
    },
}

FAMILIES: tuple[str, ...] = tuple(TINY_CONFIGS)
_ALIASES = {"llama4": "llama4_text", "ernie": "ernie4_5_moe", "deepseek": "deepseek_v3", "phi_moe": "phimoe"}
_MODEL_TYPES = {"emo": TinyEmoConfig.model_type}  # family -> model_type where they differ
# routers initialised like any Linear (std 0.02), which route near-uniformly at this size
_SMALL_ROUTERS = {
    "deepseek_v2": ("mlp.gate.weight",),
    "phimoe": ("mlp.router.weight",),
    "emo": ("mlp.gate.weight",),
}


def tiny_config(family: str, **overrides: Any):
    """The config of a tiny model of ``family`` (a transformers ``model_type``)."""
    family = _ALIASES.get(family, family)
    if family not in TINY_CONFIGS:
        raise ConfigError(f"no tiny config for family {family!r}; choose one of: {', '.join(FAMILIES)}")
    kwargs = {**_COMMON, **TINY_CONFIGS[family], **overrides}
    return AutoConfig.for_model(_MODEL_TYPES.get(family, family), **kwargs)


def tiny(family: str = "olmoe", seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Build a tiny random-initialised MoE of ``family`` in eval mode, float32, on the CPU."""
    family = _ALIASES.get(family, family)
    config = tiny_config(family, **overrides)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        # Router weights are zero-initialised in some families: give them scale so that
        # routing is non-trivial and ties are improbable.
        for name, param in model.named_parameters():
            if param.dim() == 2 and (param.abs().sum() == 0 or name.endswith(_SMALL_ROUTERS.get(family, ()))):
                torch.nn.init.normal_(param, std=0.5)
            if "e_score_correction_bias" in name or "moe_statics" in name:
                torch.nn.init.uniform_(param, -0.05, 0.05)
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.uniform_(-0.05, 0.05)
    if hasattr(model, "set_experts_implementation") and family not in _MODEL_TYPES:
        model.set_experts_implementation("eager")  # ~10x faster than grouped_mm on CPU at this size
    return model.eval()
