"""Which transformers MoE architectures become which llama.cpp architecture, and on what terms.

llama.cpp builds each architecture's graph in C++ with some choices fixed that transformers keeps
in the config. A checkpoint whose config asks for something else would load and run, silently
wrong, so every such difference is refused here, before anything is written:

- the top-k renormalisation: llama.cpp's ``qwen2moe`` and ``olmoe`` graphs never renormalise the
  kept softmax weights, ``qwen3moe`` always does (``norm_topk_prob`` must agree);
- dense (non-MoE) layers, sliding-window attention, RoPE scaling, activations other than SiLU,
  attention biases the loader does not take, OLMoE's ``clip_qkv`` and OLMoE with grouped-query
  attention (its q/k norms are loaded with the full width).

``output.weight``: the ``qwen2moe`` and ``olmoe`` loaders require it (no fallback to the token
embedding), so a model with tied embeddings is *untied* in the file: the embedding is written
twice. ``qwen3moe`` falls back to ``token_embd`` by itself, so a tied Qwen3-MoE keeps one copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf

from moectl.errors import ConfigError


@dataclass(frozen=True)
class ArchSpec:
    """One supported architecture: transformers ``model_type`` -> llama.cpp ``MODEL_ARCH``."""

    model_type: str
    arch: gguf.MODEL_ARCH
    norm_topk_prob: bool  # what llama.cpp's graph does, fixed in C++
    needs_output: bool  # the loader requires output.weight
    expert_ff_key: str  # config key of one routed expert's FFN width
    shared_expert: bool
    attention_bias: bool  # the loader takes q/k/v biases (Qwen2: always present)
    full_width_qk_norm: bool = False  # OLMoE: q_norm/k_norm over all heads at once

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


ARCHS: dict[str, ArchSpec] = {
    "qwen2_moe": ArchSpec(
        "qwen2_moe", gguf.MODEL_ARCH.QWEN2MOE, norm_topk_prob=False, needs_output=True,
        expert_ff_key="moe_intermediate_size", shared_expert=True, attention_bias=True,
    ),
    "olmoe": ArchSpec(
        "olmoe", gguf.MODEL_ARCH.OLMOE, norm_topk_prob=False, needs_output=True,
        expert_ff_key="intermediate_size", shared_expert=False, attention_bias=False,
        full_width_qk_norm=True,
    ),
    "qwen3_moe": ArchSpec(
        "qwen3_moe", gguf.MODEL_ARCH.QWEN3MOE, norm_topk_prob=True, needs_output=False,
        expert_ff_key="moe_intermediate_size", shared_expert=False, attention_bias=False,
    ),
}  # fmt: skip


def _get(config: Any, key: str, default: Any = None) -> Any:
    return getattr(config, key, default)


def head_dim(config: Any) -> int:
    return int(_get(config, "head_dim") or config.hidden_size // config.num_attention_heads)


def rope_theta(config: Any) -> float:
    """``rope_parameters["rope_theta"]`` (transformers 5), else the older ``rope_theta``."""
    params = _get(config, "rope_parameters") or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else _get(config, "rope_theta", 10000.0))


def spec_for(config: Any) -> ArchSpec:
    """The spec of ``config``'s architecture; ``ValueError`` naming what llama.cpp cannot run."""
    model_type = _get(config, "model_type")
    spec = ARCHS.get(model_type)
    if spec is None:
        raise ConfigError(
            f"architecture {model_type!r} cannot be written as GGUF by moectl; supported: {', '.join(ARCHS)}"
        )
    problems = _problems(config, spec)
    if problems:
        raise ConfigError(f"{model_type} -> llama.cpp {spec.name}: {problems[0]}")
    return spec


def _problems(config: Any, spec: ArchSpec) -> list[str]:
    out = []
    norm = bool(_get(config, "norm_topk_prob", False))
    if norm != spec.norm_topk_prob:
        out.append(
            f"norm_topk_prob={norm}, but llama.cpp's {spec.name} graph always uses norm_topk_prob={spec.norm_topk_prob}"
        )
    if _get(config, "mlp_only_layers") or int(_get(config, "decoder_sparse_step", 1) or 1) != 1:
        out.append(
            "dense (non-MoE) layers (mlp_only_layers / decoder_sparse_step) are not in llama.cpp's graph"
        )
    if _get(config, "use_sliding_window", False):
        out.append("sliding-window attention is not in llama.cpp's graph for this architecture")
    params = _get(config, "rope_parameters") or {}
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    if rope_type != "default":
        out.append(f"RoPE scaling {rope_type!r} is not written; only rope_type 'default'")
    if float(params.get("partial_rotary_factor", 1.0) if isinstance(params, dict) else 1.0) != 1.0:
        out.append("partial rotary embeddings are not written")
    act = _get(config, "hidden_act", "silu")
    if act != "silu":
        out.append(f"hidden_act {act!r}; llama.cpp's MoE FFN here is SiLU-gated")
    if _get(config, "attention_bias", False) and not spec.attention_bias:
        out.append("attention biases (attention_bias=True) are not taken by llama.cpp's loader")
    if _get(config, "clip_qkv") is not None:
        out.append("clip_qkv is not in llama.cpp's graph")
    if spec.full_width_qk_norm and config.num_key_value_heads != config.num_attention_heads:
        out.append("grouped-query attention: llama.cpp loads OLMoE's k_norm with the full hidden width")
    if spec.shared_expert and not _get(config, "shared_expert_intermediate_size"):
        out.append("no shared expert; llama.cpp's qwen2moe loader requires one")
    return out


def write_hparams(writer: gguf.GGUFWriter, config: Any, spec: ArchSpec, num_experts: int) -> dict[str, Any]:
    """Write the keys llama.cpp's loader reads for ``spec``; returns them (for the report)."""
    hd = head_dim(config)
    values: dict[str, Any] = {
        "context_length": int(config.max_position_embeddings),
        "embedding_length": int(config.hidden_size),
        "block_count": int(config.num_hidden_layers),
        "feed_forward_length": int(config.intermediate_size),
        "head_count": int(config.num_attention_heads),
        "head_count_kv": int(_get(config, "num_key_value_heads") or config.num_attention_heads),
        "key_length": hd,
        "value_length": hd,
        "rope_dimension_count": hd,
        "rope_freq_base": rope_theta(config),
        "layer_norm_rms_eps": float(config.rms_norm_eps),
        "expert_count": int(num_experts),
        "expert_used_count": int(config.num_experts_per_tok),
        "expert_feed_forward_length": int(_get(config, spec.expert_ff_key)),
    }
    if spec.shared_expert:
        values["expert_shared_feed_forward_length"] = int(config.shared_expert_intermediate_size)
    for key, value in values.items():
        getattr(writer, f"add_{key}")(value)
    return values
