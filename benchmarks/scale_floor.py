"""The memory floor of a row: weights + KV cache + one decoder layer's activations, from the config.

    floor = W + KV(T_kv) + A(T)

W   bytes of every parameter and persistent buffer of the model the config builds (counted on the
    meta device: ``moectl.models.shapes.parameter_counts(...)["bytes"]``).
KV  B · T_kv · b · Σ over attention layers of (key width + value width): n_kv · d_head each for
    multi-head / grouped-query attention; n_heads · (qk_nope + qk_rope) and n_heads · v_head for
    MLA (transformers caches MLA's keys and values decompressed). Every attention layer holds
    T_kv tokens (sliding-window layers too: RoE's span scoring keeps the whole clean cache).
A   B · T · max(attention, MoE) — the tensors one decoder layer holds at once, per token:
      attention = b · (2H + (n_q + 2 n_kv) · d_head + n_q · d_head)
                  [stream in, normed input, q k v, attention output]
                  + b · n_q · T_kv_att   when the model's attention is eager (scores [n_q, T, T]:
                  gpt-oss, whose sinks SDPA cannot take); SDPA/flash never holds them
      MoE       = b · (2H + k · (2H + 3 I)) + 4 E
                  [stream in, normed input; per routed copy: its input and output rows, the
                  gate/up product (2I) and the activation (I); fp32 router logits]
    plus the shared experts' b · (3 I_shared) where the model has them.

b = bytes per element of the model dtype (bf16: 2), B = batch rows, T = tokens per forward,
H = hidden size, E = routed experts, k = top-k, I = expert width, n_q / n_kv = query / key-value
heads. The LM head's logits are not part of the floor: scoring must not hold [T, V] floats.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from moectl.models.shape_build import build_from_config, parameter_counts, top_k_of


@dataclass(frozen=True)
class Floor:
    weights: int
    kv: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "kv": self.kv, "activations": self.activations, "total": self.total}


def _get(config: PretrainedConfig, *names: str, default: int = 0) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def _attention_layers(config: PretrainedConfig) -> int:
    types = getattr(config, "layer_types", None)
    if types:
        return sum(1 for t in types if t != "linear_attention")
    return int(config.num_hidden_layers)


def kv_bytes_per_token(config: PretrainedConfig, dtype_bytes: int) -> int:
    """Key + value bytes one token adds to one attention layer's cache."""
    heads = int(config.num_attention_heads)
    if getattr(config, "kv_lora_rank", None):  # MLA, cached decompressed
        key = heads * (_get(config, "qk_nope_head_dim") + _get(config, "qk_rope_head_dim"))
        value = heads * _get(config, "v_head_dim")
        return (key + value) * dtype_bytes
    head_dim = _get(config, "head_dim", default=config.hidden_size // heads)
    kv_heads = _get(config, "num_key_value_heads", default=heads)
    return 2 * kv_heads * head_dim * dtype_bytes


def layer_activation_bytes(
    config: PretrainedConfig, tokens: int, dtype_bytes: int, keys: int | None = None
) -> int:
    """A(T): one decoder layer's activations for ``tokens`` tokens (``keys`` attended, default T)."""
    b, h = dtype_bytes, int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = _get(config, "head_dim", "v_head_dim", default=h // heads)
    kv_heads = _get(config, "num_key_value_heads", default=heads)
    attention = b * (2 * h + (heads + 2 * kv_heads) * head_dim + heads * head_dim)
    if getattr(config, "_attn_implementation", "eager") == "eager":
        attention += b * heads * (tokens if keys is None else keys)
    experts = _get(config, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    width = _get(config, "moe_intermediate_size", "intermediate_size")
    shared = _get(config, "shared_expert_intermediate_size") or _get(config, "n_shared_experts") * width
    moe = b * (2 * h + top_k_of(config) * (2 * h + 3 * width) + 3 * shared) + 4 * experts
    return tokens * max(attention, moe)


def floor(
    config: PretrainedConfig, tokens: int, kv_tokens: int | None = None, batch: int = 1, dtype_bytes: int = 2
) -> Floor:
    """The floor of a row whose largest forward has ``batch`` × ``tokens`` tokens and whose KV cache
    ends at ``kv_tokens`` (default ``tokens``) per row."""
    kv_tokens = tokens if kv_tokens is None else kv_tokens
    weights = parameter_counts(build_from_config(config, device="meta"))["bytes"]
    kv = batch * kv_tokens * _attention_layers(config) * kv_bytes_per_token(config, dtype_bytes)
    activations = batch * layer_activation_bytes(config, tokens, dtype_bytes)
    return Floor(weights, kv, activations)
