"""Find a model's MoE layers and describe them: family, experts, top-k, shared experts, rule."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from torch import nn

from moectl.adapters.linear_gate import gate_router
from moectl.adapters.registry import Adapter, gate_families, registry, supported_routers
from moectl.adapters.rules import RouterRule
from moectl.errors import NoSuchLayerError, UnsupportedModelError

__all__ = ["MoELayer", "ModelInfo", "UnsupportedModelError", "check_not_bypassed", "inspect"]

_SHARED_ATTRS = ("shared_expert", "shared_experts", "shared_mlp")


@dataclass
class MoELayer:
    """One MoE layer: its router module, the block that owns it and the selection rule."""

    index: int  # position among the MoE layers (what masks, policies and traces are keyed by)
    layer_idx: int  # decoder layer index
    name: str  # router module path
    router: nn.Module = field(repr=False)
    block: nn.Module = field(repr=False)
    adapter: Adapter = field(repr=False)
    rule: RouterRule
    shared_experts: int

    @property
    def num_experts(self) -> int:
        return self.rule.num_experts

    @property
    def top_k(self) -> int:
        return self.rule.top_k


@dataclass
class ModelInfo:
    """What ``moectl.inspect`` reports about a model."""

    family: str
    model_type: str
    num_layers: int
    layers: list[MoELayer]
    dense_layers: list[int]

    @property
    def num_moe_layers(self) -> int:
        return len(self.layers)

    @property
    def num_experts(self) -> int:
        return self.layers[0].num_experts

    @property
    def top_k(self) -> int:
        return self.layers[0].top_k

    def layer(self, index: int) -> MoELayer:
        if not 0 <= index < len(self.layers):
            raise NoSuchLayerError(
                f"MoE layer {index} does not exist; the model has MoE layers 0..{len(self.layers) - 1}"
            )
        return self.layers[index]

    def summary(self) -> dict:
        """A JSON-ready description."""
        rules = {asdict(layer.rule)["kind"] for layer in self.layers}
        return {
            "family": self.family,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "moe_layers": [layer.layer_idx for layer in self.layers],
            "dense_layers": self.dense_layers,
            "num_experts": sorted({layer.num_experts for layer in self.layers}),
            "top_k": sorted({layer.top_k for layer in self.layers}),
            "shared_experts": sorted({layer.shared_experts for layer in self.layers}),
            "router_rule": sorted(rules),
            "rule": asdict(self.layers[0].rule),
            "router_class": _router_class(self.layers[0]),
        }


def _router_class(layer: MoELayer) -> str:
    """The router's class, or for a bare-Linear router (``GateRouter``) the block's and its gate's."""
    block_class = getattr(layer.router, "block_class", None)
    return f"{block_class}.{layer.name.rsplit('.', 1)[-1]}" if block_class else type(layer.router).__name__


def _layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[0]) if found else -1


def _count_shared(block: nn.Module, decoder_layer: nn.Module | None, config) -> int:
    """Shared experts live in the MoE block, or (Granite-MoE-Shared) beside it in the decoder layer."""
    for owner in (block, decoder_layer):
        for attr in _SHARED_ATTRS:
            if isinstance(getattr(owner, attr, None), nn.Module):
                return int(
                    getattr(config, "n_shared_experts", None)
                    or getattr(config, "moe_num_shared_experts", 1)
                    or 1
                )
    return 0


def check_not_bypassed(model: nn.Module) -> None:
    """Refuse models whose MoE forward does not go through the router module."""
    if getattr(model, "use_kernels", False):
        raise UnsupportedModelError(
            "this model was loaded with use_kernels=True: hub kernels may replace the MoE block's "
            "forward and skip the router module, so moectl's routing hooks would silently do nothing; "
            "load it without use_kernels"
        )
    quant = getattr(getattr(model, "config", None), "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    mxfp4 = [n for n, m in model.named_modules() if type(m).__name__.startswith("Mxfp4")]
    if str(method).lower().endswith("mxfp4") or mxfp4:
        raise UnsupportedModelError(
            "this model runs MXFP4-quantised experts (e.g. gpt-oss with its Triton kernels), whose fused "
            "MoE forward does not honour a re-routed selection; load it dequantised "
            "(Mxfp4Config(dequantize=True)) to use moectl"
        )


def inspect(model: nn.Module) -> ModelInfo:
    """Find the MoE layers of a transformers model; fail closed on unknown routers.

    Dense layers are skipped. Raises ``UnsupportedModelError`` naming the unknown router class
    and listing the supported ones. A remote-code block whose router is a bare Linear
    (``linear_gate``) becomes a layer whose ``router`` is a ``GateRouter`` over its gate.
    """
    check_not_bypassed(model)
    adapters, gates = registry(), gate_families()
    layers: list[MoELayer] = []
    unknown: set[str] = set()
    parents = dict(model.named_modules())
    for name, module in model.named_modules():
        family = next((gates[c.__name__] for c in type(module).__mro__ if c.__name__ in gates), None)
        if family is not None:
            router = gate_router(module, family)
            layers.append(
                MoELayer(
                    index=len(layers),
                    layer_idx=_layer_index(name),
                    name=f"{name}.{family.gate_attr}" if name else family.gate_attr,
                    router=router,
                    block=module,
                    adapter=family.adapter,
                    rule=family.adapter.build_rule(router),
                    shared_experts=len(family.shared(module)),
                )
            )
            continue
        adapter = next((adapters[c] for c in type(module).__mro__ if c in adapters), None)
        if adapter is None:
            cls = type(module).__name__
            if (
                re.search(r"(Router|Gate|MoeBlock|MoEBlock)$", cls)
                and "Expert" not in cls
                and "Shared" not in cls
            ):
                unknown.add(cls)
            continue
        block_name = name.rsplit(".", 1)[0] if "." in name else ""
        block = parents[block_name]
        decoder_layer = parents.get(block_name.rsplit(".", 1)[0]) if "." in block_name else None
        layers.append(
            MoELayer(
                index=len(layers),
                layer_idx=_layer_index(name),
                name=name,
                router=module,
                block=block,
                adapter=adapter,
                rule=adapter.build_rule(module),
                shared_experts=_count_shared(block, decoder_layer, getattr(model, "config", None)),
            )
        )
    if not layers:
        found = f" (found router-like classes: {', '.join(sorted(unknown))})" if unknown else ""
        raise UnsupportedModelError(
            f"no supported MoE router in {type(model).__name__}{found}; supported routers: "
            + ", ".join(supported_routers())
        )
    config = getattr(model, "config", None)
    num_layers = int(getattr(config, "num_hidden_layers", 0) or max(layer.layer_idx for layer in layers) + 1)
    moe_idx = {layer.layer_idx for layer in layers}
    return ModelInfo(
        family=layers[0].adapter.family,
        model_type=str(getattr(config, "model_type", layers[0].adapter.family)),
        num_layers=num_layers,
        layers=layers,
        dense_layers=[i for i in range(num_layers) if i not in moe_idx],
    )
