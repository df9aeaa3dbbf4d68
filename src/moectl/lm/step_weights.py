"""The tensors :func:`moectl.lm.decode_step.decode_step` reads, taken off a loaded model, or why not.

Families (issue 39 item 3, those users serve most that share one decoder shape): OLMoE, Qwen2-MoE,
Qwen3-MoE and Mixtral — pre-norm rotary attention, softmax top-k routers, experts stored as
transformers 5's stacked ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]. The tensors are the
model's own parameters (views, nothing copied). Quantized projections and experts
(``moectl.quant``, on the CPU) are called as they are, one opaque call each (``step_modules``).
:func:`step_weights` returns None and the reason for anything else: another family, a sliding
window, LoRA or offloaded experts (their modules would not run), biases on the router, a model
being trained. The engine then decodes through the lean forward (``moectl.lm.lean_decode``) and
says why once.
"""

from __future__ import annotations

from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.lm.decode_step import LayerWeights, StepWeights, Weight
from moectl.lm.lean_decode import FAMILIES  # the lean forward's families: the same decoder shape
from moectl.lm.step_modules import register
from moectl.lm.step_ops import large_experts


def _weight(module: nn.Module | None) -> Tensor | None:
    """A plain linear layer's weight; None for anything else (LoRA, quantized, another kernel)."""
    if module is None or type(module).__name__ not in ("Linear", "CpuBf16Linear"):
        return None
    w = getattr(module, "weight", None)
    return w if isinstance(w, Tensor) and w.dim() == 2 else None


def _quantized(module: nn.Module | None) -> bool:
    """A layer that says the step may call it as it is (``moectl.quant``'s quantized layers set
    ``compiled_step_calls``), its own forward, its tensors all in CPU memory (not offloaded, no GPU)."""
    if module is None or not getattr(type(module), "compiled_step_calls", False) or "forward" in module.__dict__:
        return False
    return all(t.device.type == "cpu" for t in (*module.buffers(), *module.parameters()))


def _projection(module: nn.Module | None) -> Weight | None:
    """A plain layer's weight, a quantized layer as a :class:`ModuleCall`, else None."""
    if _quantized(module):
        return register(module, int(module.out_features))  # type: ignore[union-attr, arg-type]
    return _weight(module)


def _bias(module: nn.Module) -> Tensor | None:
    """A plain layer's bias (a quantized layer adds its own)."""
    b = getattr(module, "bias", None)
    return b if isinstance(b, Tensor) and not _quantized(module) else None


def _glu(mlp: nn.Module) -> tuple[Weight, Weight, Weight] | None:
    parts = [_projection(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(p is None for p in parts) or any(_bias(getattr(mlp, n)) is not None for n in ("gate_proj", "up_proj", "down_proj")):
        return None
    return parts[0], parts[1], parts[2]  # type: ignore[return-value]


def step_weights(model: nn.Module, info: ModelInfo) -> tuple[StepWeights | None, str]:
    """The step's tensors of ``model`` and what it is, or None and why not (see the module doc)."""
    if hasattr(model, "get_base_model"):
        return None, "a PEFT-wrapped model (adapters run inside its modules)"
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return None, f"family {family!r} has no compiled decoding step (those that do: {', '.join(FAMILIES)})"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return None, f"{type(model).__name__} has no decoder with layers and a rotary embedding"
    if getattr(config, "sliding_window", None) and "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return None, "sliding-window attention"
    if getattr(config, "hidden_act", "silu") != "silu":
        return None, f"activation {config.hidden_act!r}"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager", None):
        return None, f"attention implementation {config._attn_implementation!r}"
    head = _projection(model.get_output_embeddings())
    embed = getattr(base.embed_tokens, "weight", None)
    if head is None or not isinstance(embed, Tensor) or type(base.embed_tokens) is not nn.Embedding:
        return None, "the embedding or LM head is not a plain layer (quantized or adapted)"
    moe = {layer.layer_idx: layer for layer in info.layers}
    layers: list[LayerWeights] = []
    for i, decoder in enumerate(base.layers[: config.num_hidden_layers]):
        attn = decoder.self_attn
        proj = [_projection(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if any(p is None for p in proj):
            return None, f"layer {i}'s attention projections are not plain or quantized linear layers (LoRA?)"
        w = LayerWeights(
            input_norm=decoder.input_layernorm, post_norm=decoder.post_attention_layernorm,
            q=proj[0], k=proj[1], v=proj[2], o=proj[3],  # type: ignore[arg-type]
            q_bias=_bias(attn.q_proj), k_bias=_bias(attn.k_proj), v_bias=_bias(attn.v_proj), o_bias=_bias(attn.o_proj),
            q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None), scaling=float(attn.scaling),
        )  # fmt: skip
        why = _mlp(w, decoder.mlp, moe.get(i), i)
        if why is not None:
            return None, why
        layers.append(w)
    if len(moe) != sum(w.router is not None for w in layers):
        return None, "the model's MoE layers are not all decoder MLPs"
    top_k = {layer.top_k for layer in info.layers}
    if len(top_k) != 1:
        return None, "MoE layers choose different numbers of experts"
    heads = int(config.num_attention_heads)
    return StepWeights(
        embed=embed, rotary=base.rotary_emb, norm=base.norm, lm_head=head,
        lm_head_bias=_bias(model.get_output_embeddings()), layers=layers, num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads), qk_norm=FAMILIES[family],
        clip=getattr(config, "clip_qkv", None), top_k=top_k.pop(), dtype=embed.dtype,
        num_experts=max(layer.num_experts for layer in info.layers),
    ), f"compiled decoding step for {family}"  # fmt: skip


def _mlp(w: LayerWeights, mlp: nn.Module, layer, i: int) -> str | None:
    """Fill ``w``'s MLP part from the decoder layer's ``mlp``; the reason it cannot be, else None."""
    if layer is None:
        dense = _glu(mlp)
        if dense is None:
            return f"layer {i}'s dense MLP is not plain linear layers"
        w.dense = dense
        return None
    experts = getattr(mlp, "experts", None)
    why = _router(w, layer, i)
    if why is not None:
        return why
    if _quantized(experts):
        w.experts_call = register(experts)  # type: ignore[arg-type]
        return _shared(w, mlp, i)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, Tensor) or not isinstance(down, Tensor) or gate_up.dim() != 3 or down.dim() != 3:
        return f"layer {i}'s experts are not stacked tensors (quantized, offloaded or adapted experts)"
    if gate_up.is_meta or down.is_meta:
        return f"layer {i}'s experts are not in memory (left in the checkpoint's shards to be offloaded)"
    if not type(experts).__module__.startswith("transformers.") or getattr(experts, "has_bias", False):
        return f"layer {i}'s experts are {type(experts).__name__}, not the family's own (quantized or adapted)"
    if "forward" in experts.__dict__:  # (the engine's own hooks on them act in prefills only: pad_skip)
        return f"layer {i}'s experts run a forward of their own (offloading or LoRA)"
    w.gate_up, w.down = gate_up, down
    w.kernel_experts = large_experts(gate_up, down)
    return _shared(w, mlp, i)


def _router(w: LayerWeights, layer, i: int) -> str | None:
    """Fill ``w``'s router and rule from the MoE layer; the reason it cannot be, else None."""
    if layer.rule.kind != "softmax_topk" or layer.rule.grouped:
        return f"layer {i}'s router rule {layer.rule.kind!r} (the compiled step takes ungrouped softmax top-k)"
    router = getattr(layer.router, "weight", None)
    plain = type(layer.router).__module__.startswith("transformers.") or _weight(layer.router) is not None
    if not plain or not isinstance(router, Tensor) or router.dim() != 2 or _bias(layer.router) is not None:
        return f"layer {i}'s router is not a plain [E, H] weight"
    w.router, w.rule, w.moe_index = router, layer.rule, layer.index
    bias = layer.adapter.bias(layer.router)
    w.router_bias = bias if isinstance(bias, Tensor) else None
    return None


def _shared(w: LayerWeights, mlp: nn.Module, i: int) -> str | None:
    """Fill ``w``'s shared expert (Qwen2-MoE) from the MoE block; the reason it cannot be, else None."""
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        w.shared = _glu(shared)
        if w.shared is None:
            return f"layer {i}'s shared expert is not plain linear layers"
        gate = getattr(mlp, "shared_expert_gate", None)
        w.shared_gate = _projection(gate) if gate is not None else None
        if gate is not None and w.shared_gate is None:
            return f"layer {i}'s shared expert gate is not a plain linear layer"
    return None
