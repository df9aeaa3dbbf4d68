"""Physically remove experts: slice expert weights, router rows, router bias and score-correction bias.

The result is an ordinary transformers model with fewer experts per MoE layer; its outputs equal
the full model routed under ``ExpertMask(..., renorm="pruned")`` with the same kept experts
(tested for every family). transformers configs hold one expert count for all layers, so every
MoE layer must keep the same number; grouped routers (DeepSeek-V3 family) must keep the same
number in every group, at least as many as a group's score sums (two for DeepSeek-V3, one for
DeepSeek-V2), so that group scores are computed as before.

``write_experts`` is the inverse: it writes a sliced model's experts (and their router rows) back
into the full model at the kept indices (EMO §6, ``moectl subset merge``). Both directions find the
per-expert tensors the same way (``per_expert_tensors``), so what one slices the other restores.

Remote-code blocks with a bare gate Linear (``linear_gate``, EMO) hold their experts as an
``nn.ModuleList`` and may keep shared experts among them: keep lists name routed experts; the
block's shared experts are always kept, the list and the gate rows are sliced in the block's own
expert ids, and the family fixes the ids it holds (``GateFamily.after_slice``). ``write_experts``
does not support them yet (refused).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, MoELayer, inspect
from moectl.adapters.linear_gate import GateRouter
from moectl.errors import ConfigError

# the config fields that hold the routed-expert count, across families
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def check_keep(info: ModelInfo, keep: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
    """Validate a per-layer keep list; return it sorted. Raises ValueError naming the problem."""
    missing = [layer.index for layer in info.layers if layer.index not in keep]
    unknown = [k for k in keep if not 0 <= int(k) < info.num_moe_layers]
    if unknown:
        raise ConfigError(
            f"keep names MoE layers {unknown}; the model has MoE layers 0..{info.num_moe_layers - 1}"
        )
    if missing:
        raise ConfigError(
            f"keep must list every MoE layer (the config has one expert count); missing layers {missing}"
        )
    clean: dict[int, list[int]] = {}
    for index, ids in keep.items():
        layer = info.layer(int(index))
        ids = sorted(int(i) for i in ids)
        if len(set(ids)) != len(ids):
            raise ConfigError(f"MoE layer {index}: duplicate experts in {ids}")
        if ids and not (ids[0] >= 0 and ids[-1] < layer.num_experts):
            raise ConfigError(
                f"MoE layer {index}: expert ids must lie in 0..{layer.num_experts - 1}, got {ids}"
            )
        if len(ids) < layer.top_k:
            raise ConfigError(f"MoE layer {index}: keeps {len(ids)} experts, fewer than top-k = {layer.top_k}")
        rule = layer.rule
        if rule.grouped or rule.n_group > 1:
            size = layer.num_experts // rule.n_group
            per_group = torch.bincount(torch.tensor(ids) // size, minlength=rule.n_group)
            if len(set(per_group.tolist())) != 1 or int(per_group[0]) < rule.group_topn:
                raise ConfigError(
                    f"MoE layer {index}: a grouped router ({rule.n_group} groups) needs the same number of kept "
                    f"experts in every group, at least {rule.group_topn}; got {per_group.tolist()} per group"
                )
        clean[int(index)] = ids
    counts = {len(v) for v in clean.values()}
    if len(counts) != 1:
        raise ConfigError(f"every MoE layer must keep the same number of experts; got counts {sorted(counts)}")
    return clean


def expert_tensors(module: nn.Module, n: int) -> list[tuple[str, Tensor, int]]:
    """(name, tensor, expert dim) of every parameter and buffer of ``module`` (not its children) with a
    size-``n`` expert dim: the leading dim when it is ``n`` (stacked experts, router rows), else the last."""
    found = []
    for name, tensor in list(module.named_parameters(recurse=False)) + list(
        module.named_buffers(recurse=False)
    ):
        dims = [d for d, size in enumerate(tensor.shape) if size == n]
        if dims:
            found.append((name, tensor, dims[0] if tensor.dim() > 1 and tensor.shape[0] == n else dims[-1]))
    return found


@dataclass(frozen=True)
class ExpertTensor:
    """One per-expert tensor of a model: its dotted name, MoE layer, expert dim, and which part holds it."""

    name: str
    layer: int
    dim: int
    part: Literal["router", "experts"]


def layer_modules(layer: MoELayer) -> list[tuple[str, nn.Module]]:
    """The modules whose tensors carry the expert dim: the router (and its children), the experts module."""
    modules: dict[int, tuple[str, nn.Module]] = {}
    for part, module in [("router", m) for m in layer.router.modules()] + [("experts", layer.block.experts)]:
        modules.setdefault(id(module), (part, module))
    return list(modules.values())


def per_expert_tensors(model: nn.Module, info: ModelInfo | None = None) -> dict[str, ExpertTensor]:
    """Every tensor that ``slice_experts`` slices, by dotted name (``model.get_parameter``/``get_buffer``)."""
    info = info or inspect(model)
    names = {id(m): name for name, m in model.named_modules()}
    found: dict[str, ExpertTensor] = {}
    for layer in info.layers:
        if isinstance(layer.router, GateRouter):
            raise ConfigError(
                f"MoE layer {layer.index} ({layer.adapter.family}): its experts are a list of modules, not "
                "tensors with an expert dimension; writing experts back (merge) is not supported for it"
            )
        for part, module in layer_modules(layer):
            for name, _, dim in expert_tensors(module, layer.num_experts):
                full = f"{names[id(module)]}.{name}" if names[id(module)] else name
                found[full] = ExpertTensor(full, layer.index, dim, part)
    return found


def _slice_module(module: nn.Module, ids: torch.Tensor, n: int) -> None:
    """Slice every parameter and buffer of ``module`` (not its children) along its size-``n`` expert dim."""
    for name, tensor, dim in expert_tensors(module, n):
        new = tensor.detach().index_select(dim, ids.to(tensor.device)).clone()
        if isinstance(tensor, nn.Parameter):
            setattr(module, name, nn.Parameter(new, requires_grad=tensor.requires_grad))
        else:
            module.register_buffer(name, new)
    for attr in ("num_experts", "out_features"):
        if getattr(module, attr, None) == n:
            setattr(module, attr, len(ids))


@torch.no_grad()
def slice_experts(
    model: nn.Module, keep: Mapping[int, Sequence[int]], info: ModelInfo | None = None
) -> nn.Module:
    """Keep only ``keep[moe_layer]`` experts in every MoE layer, in place; returns the model."""
    info = info or inspect(model)
    keep = check_keep(info, keep)
    config = getattr(model, "config", None)
    kept = 0
    for layer in info.layers:
        n, ids = _block_ids(layer, keep[layer.index])
        for _, module in layer_modules(layer):
            _slice_module(module, ids, n)
        experts = layer.block.experts
        if isinstance(experts, nn.ModuleList) and len(experts) == n:
            layer.block.experts = nn.ModuleList([experts[i] for i in ids.tolist()])
        if getattr(layer.block, "num_experts", None) == n:
            layer.block.num_experts = len(ids)
        if isinstance(layer.router, GateRouter):
            layer.router.family.after_slice(layer.block, ids.tolist(), config, layer.layer_idx)
        kept = len(ids)
    for sub in (config, getattr(config, "text_config", None)):
        for key in EXPERT_COUNT_KEYS:
            if sub is not None and isinstance(getattr(sub, key, None), int):
                setattr(sub, key, kept)
    return model


def _block_ids(layer: MoELayer, keep: list[int]) -> tuple[int, Tensor]:
    """(experts in the block, the block's expert ids to keep): the kept routed experts, plus the shared
    experts of a bare-Linear block (``GateRouter``), in the block's own ids."""
    if not isinstance(layer.router, GateRouter):
        return layer.num_experts, torch.tensor(keep, dtype=torch.long)
    routed = layer.router.routed_ids()[torch.tensor(keep, dtype=torch.long)].tolist()
    shared = layer.router.family.shared(layer.block)
    return int(layer.router.gate.out_features), torch.tensor(sorted({*routed, *shared}), dtype=torch.long)


def get_tensor(model: nn.Module, name: str) -> Tensor:
    """The parameter or buffer ``name`` (dotted path) of ``model``."""
    module, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module) if module else model, attr)


@torch.no_grad()
def write_experts(
    model: nn.Module,
    subset_model: nn.Module,
    keep: Mapping[int, Sequence[int]],
    parts: Sequence[str] = ("router", "experts"),
    info: ModelInfo | None = None,
) -> dict[str, float]:
    """The inverse of ``slice_experts``: copy the experts of ``subset_model`` (sliced to ``keep``) into
    ``model`` at the kept indices, in place. ``parts``: ``"experts"`` (the experts module's weights)
    and/or ``"router"`` (the kept experts' router rows, router bias, score-correction bias).

    Returns ``{tensor name: max |change|}`` over the tensors written. Raises ValueError when the two
    models do not fit (MoE layers, expert counts, tensor names or shapes).
    """
    info = info or inspect(model)
    keep = check_keep(info, keep)
    counts = {layer.index: layer.num_experts for layer in inspect(subset_model).layers}
    wanted = {i: len(ids) for i, ids in keep.items()}
    if counts != wanted:
        raise ConfigError(f"the subset model has experts per MoE layer {counts}; the keep list needs {wanted}")
    changes: dict[str, float] = {}
    for name, entry in per_expert_tensors(model, info).items():
        if entry.part not in parts:
            continue
        try:
            source = get_tensor(subset_model, name)
        except AttributeError:
            raise ConfigError(f"the subset model has no tensor {name}") from None
        target = get_tensor(model, name)
        ids = torch.tensor(keep[entry.layer], dtype=torch.long, device=target.device)
        shape = list(target.shape)
        shape[entry.dim] = len(ids)
        if list(source.shape) != shape:
            raise ConfigError(f"{name}: the subset model's tensor is {list(source.shape)}, expected {shape}")
        source = source.detach().to(target.device, target.dtype)
        changes[name] = (
            float((source - target.index_select(entry.dim, ids)).abs().max()) if source.numel() else 0.0
        )
        target.index_copy_(entry.dim, ids, source)
    return changes
