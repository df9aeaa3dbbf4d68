"""Quantize a loaded MoE model's experts in place: ``quantize_model(model, "int4")`` (issue 40 item 1).

Issue 40: users run a 7B MoE on a CPU at 4 or 8 bits, not bf16. This turns any bf16/fp16/fp32 model
that ``moectl.inspect`` understands into one whose experts are int8 (per output channel) or int4
(group-wise), quantized where it stands, one module at a time (the peak is the model plus one
module's quantized copy):

- every MoE layer's fused experts module (``block.experts``: ``gate_up_proj`` [E, 2I, H],
  ``down_proj`` [E, H, I]) becomes a :class:`~moectl.quant.quantized_experts.QuantizedExperts`;
  experts held as a list of MLPs (EMO's replica) have their Linear layers quantized instead;
- the block's shared experts (Qwen2-MoE's ``shared_expert``, DeepSeek's ``shared_experts``) have
  their Linear layers quantized (:class:`~moectl.quant.quantized_linear.QuantizedLinear`): experts
  too, read by every token;
- with ``scope="all"`` every other Linear layer as well: attention projections, dense MLPs, the LM
  head.

Routers are never quantized, nor are gates beside them (Qwen2-MoE's ``shared_expert_gate``), norms
or embeddings: routing (masks, traces, controllers, Gumbel / RoE noise) sees the scores it always
saw, computed in the model's dtype. Quantizing is not undone: reload the model for its original
weights. :func:`quantized_scheme` says what a model was quantized to (read from its modules).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from moectl.adapters.inspect import inspect
from moectl.errors import ConfigError, NotSupportedError
from moectl.models.grouped_experts import fits
from moectl.quant.int4_groups import group_for
from moectl.quant.packed_weights import Int4Weights
from moectl.quant.quant_config import DEFAULT_GROUP_SIZE, check_group_size, check_scheme, check_scope
from moectl.quant.quantized_experts import QuantizedExperts
from moectl.quant.quantized_linear import QuantizedLinear

SHARED_ATTRS = ("shared_expert", "shared_experts", "shared_mlp")  # as moectl.adapters.inspect counts them
GATE_NAMES = ("gate", "router")  # a module's last name that marks a gate (also any *_gate)


@dataclass
class QuantSummary:
    """What :func:`quantize_model` did: the modules it replaced and the bytes, before and after, of the
    weights it quantized and of the whole model (parameters and buffers, a tied weight once)."""

    scheme: str
    group_size: int | None  # int4's group (a tensor whose width it does not divide: a smaller one)
    scope: str
    experts_modules: int
    linear_modules: int
    quantized_bytes_before: int
    quantized_bytes_after: int
    model_bytes_before: int
    model_bytes_after: int

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        mib = 1 << 20
        group = f" (group {self.group_size})" if self.group_size else ""
        return (
            f"{self.scheme}{group}, scope {self.scope}: {self.experts_modules} experts modules and "
            f"{self.linear_modules} linear layers; their weights {self.quantized_bytes_before / mib:.1f} -> "
            f"{self.quantized_bytes_after / mib:.1f} MiB, the model {self.model_bytes_before / mib:.1f} -> "
            f"{self.model_bytes_after / mib:.1f} MiB"
        )


def model_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers (each tensor once, a tied weight once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def quantized_scheme(model: nn.Module) -> str | None:
    """The scheme (``int8`` | ``int4``) ``model``'s quantized modules hold, None if it has none."""
    for m in model.modules():
        if isinstance(m, QuantizedExperts):
            return m.gate_up.scheme
        if isinstance(m, QuantizedLinear):
            return m.qweight.scheme
    return None


def already_quantized(model: nn.Module, scheme: str, group_size: int | None = None) -> bool:
    """Whether ``model`` holds ``scheme`` already (a quantized checkpoint, issue 40 item 2: asking for
    its own scheme again is a no-op); False for an unquantized model. ``ConfigError`` for another
    scheme, or for int4 in other groups than an explicit ``group_size`` gives."""
    current = quantized_scheme(model)
    if current is None:
        return False
    if current != scheme:
        raise ConfigError(
            f"the model is quantized already ({current}, e.g. a quantized checkpoint): it cannot be "
            f"quantized to {scheme}; quantize the unquantized model to {scheme} instead"
        )
    if scheme == "int4" and group_size is not None:
        held = [m for m in model.modules() if isinstance(m, Int4Weights)]
        if any(w.group != group_for(w.in_features, group_size) for w in held):
            groups = ", ".join(str(g) for g in sorted({w.group for w in held}))
            raise ConfigError(
                f"the model is int4 in groups of {groups} already: group size {group_size} needs the "
                "unquantized model"
            )
    return True


def _is_gate(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last in GATE_NAMES or last.endswith("_gate")


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _check_fused(experts: nn.Module) -> None:
    """Refuse a fused experts layout :class:`QuantizedExperts` does not compute (biases, interleaved or
    transposed weights, a post-expert norm, a gate of its own), naming it."""
    from transformers.integrations.moe import _default_apply_gate

    own_gate = getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate
    if not fits(experts) or own_gate:
        raise NotSupportedError(
            f"quantize does not support {type(experts).__name__}: its experts are not gated [E, out, in] "
            "weights without bias (supported: OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral and families of that layout)"
        )


def _check_weights(model: nn.Module, scheme: str) -> None:
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is None:
        raise ConfigError("quantize needs a model with floating-point weights")
    if scheme == "int4" and param.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(
            f"int4 takes bfloat16, float16 or float32 weights, not {param.dtype}; load the model in one"
        )
    if scheme == "int4" and any(p.device.type != "cpu" for p in model.parameters()):
        raise ConfigError(
            "int4 runs PyTorch's CPU kernel: quantize a model on the CPU (int8 runs on any device)"
        )


@torch.no_grad()
def quantize_model(
    model: nn.Module, scheme: str = "int4", group_size: int = DEFAULT_GROUP_SIZE, scope: str = "experts"
) -> QuantSummary:
    """Quantize ``model``'s experts (``scope="experts"``) or every Linear layer but the routers
    (``scope="all"``) to ``scheme`` (``int8`` | ``int4``; int4 in groups of ``group_size`` inputs),
    in place; returns a :class:`QuantSummary`. Raises ``ConfigError`` for a value out of range or a
    model quantized already, ``UnsupportedModelError`` for a model without MoE layers and
    ``NotSupportedError`` for an experts layout it does not compute."""
    if check_scheme(scheme) is None:
        raise ConfigError("quantize_model needs a scheme: int8 or int4")
    group = check_group_size(group_size) if scheme == "int4" else None
    check_scope(scope)
    if quantized_scheme(model) is not None:
        already_quantized(model, scheme)  # another scheme: its ConfigError, naming both
        raise ConfigError(
            f"the model is quantized already ({quantized_scheme(model)}): load it again to re-quantize"
        )
    info = inspect(model)
    _check_weights(model, scheme)
    before_model = model_bytes(model)
    keep = {id(m) for layer in info.layers for m in layer.router.modules()}  # routers stay as they are
    linears: dict[str, nn.Linear] = {}
    before = after = experts_done = 0
    names = {id(m): n for n, m in model.named_modules()}
    for layer in info.layers:
        experts = getattr(layer.block, "experts", None)
        owners = [
            getattr(layer.block, a)
            for a in SHARED_ATTRS
            if isinstance(getattr(layer.block, a, None), nn.Module)
        ]
        if hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
            _check_fused(experts)
            quantized = QuantizedExperts(experts, scheme, group or DEFAULT_GROUP_SIZE)
            before += sum(t.numel() * t.element_size() for t in (experts.gate_up_proj, experts.down_proj))
            after += quantized.gate_up.nbytes() + quantized.down.nbytes()
            _replace(model, names[id(experts)], quantized)
            experts_done += 1
        elif isinstance(experts, nn.ModuleList):
            owners.append(experts)
        else:
            raise NotSupportedError(
                f"quantize does not support the experts of {type(layer.block).__name__} "
                f"({type(experts).__name__}): neither fused gate_up_proj/down_proj nor a list of MLPs"
            )
        for owner in owners:
            for name, m in owner.named_modules(prefix=names[id(owner)]):
                if isinstance(m, nn.Linear) and id(m) not in keep and not _is_gate(name):
                    linears[name] = m
    if scope == "all":
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and id(m) not in keep and not _is_gate(name):
                linears.setdefault(name, m)
    for name, linear in linears.items():
        quantized = QuantizedLinear(linear, scheme, group or DEFAULT_GROUP_SIZE)
        before += linear.weight.numel() * linear.weight.element_size()
        after += quantized.qweight.nbytes()
        _replace(model, name, quantized)
    return QuantSummary(
        scheme=scheme,
        group_size=group,
        scope=scope,
        experts_modules=experts_done,
        linear_modules=len(linears),
        quantized_bytes_before=before,
        quantized_bytes_after=after,
        model_bytes_before=before_model,
        model_bytes_after=model_bytes(model),
    )
