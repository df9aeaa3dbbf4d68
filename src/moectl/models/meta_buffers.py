"""Give a meta-built model's non-persistent buffers their real values (rotary ``inv_freq`` et al.).

A model built on the meta device computes its non-persistent buffers — values made at init and
never saved, such as the rotary embedding's ``inv_freq`` / ``original_inv_freq`` — on meta too:
shapes without values. No checkpoint holds them. ``from_pretrained`` makes them real by
allocating each on the target device and running the model's own ``_init_weights`` on the
owning module (which recomputes the rotary frequencies from the config); this does exactly
that, so the values are bit-identical to ``from_pretrained``'s (the module's other tensors are
flagged ``_is_hf_initialized`` first, as ``from_pretrained`` flags loaded ones, so that init
touches nothing else). Should a module's
``_init_weights`` not fill its buffers (a buffer still holds the NaN it was allocated with), the
module is rebuilt on the real device from its config and its buffers taken from there; a buffer
neither fills raises ``RuntimeError`` naming it — never silent garbage.
"""

from __future__ import annotations

import torch
from torch import nn

from moectl.models.meta_model import set_tensor


def non_persistent_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(full name, owning module, leaf name) of every non-persistent buffer."""
    return [
        (f"{owner}.{leaf}" if owner else leaf, module, leaf)
        for owner, module in model.named_modules()
        for leaf, buffer in module.named_buffers(recurse=False)
        if buffer is not None and leaf in module._non_persistent_buffers_set
    ]


def _placeholder(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    if like.dtype.is_floating_point:
        return torch.full(like.shape, float("nan"), dtype=like.dtype, device=device)
    return torch.zeros(like.shape, dtype=like.dtype, device=device)


def _unfilled(module: nn.Module, leaf: str) -> bool:
    value = module._buffers[leaf]
    return value is not None and value.dtype.is_floating_point and bool(torch.isnan(value).any())


def _rebuild(module: nn.Module, device: torch.device) -> nn.Module | None:
    """The module built again from its config on ``device`` (None when that is not possible)."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    try:
        with torch.device(device):
            return type(module)(config=config)
    except TypeError:
        return None


@torch.no_grad()
def materialize_buffers(model: nn.Module, device: torch.device | str = "cpu") -> list[str]:
    """Allocate every non-persistent buffer of ``model`` on ``device`` and compute its value as
    ``from_pretrained`` does; returns their names."""
    device = torch.device(device)
    buffers = non_persistent_buffers(model)
    owners: dict[int, nn.Module] = {}
    for name, module, leaf in buffers:
        set_tensor(model, name, _placeholder(module._buffers[leaf], device))
        owners[id(module)] = module
    init = getattr(model, "_init_weights", None)
    for module in owners.values():
        for leaf, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None and leaf not in module._non_persistent_buffers_set:
                tensor._is_hf_initialized = True  # loaded: transformers' init functions leave it alone
        if init is not None:
            init(module)
    for name, module, leaf in buffers:
        if not _unfilled(module, leaf):
            continue
        fresh = _rebuild(module, device)
        value = None if fresh is None else fresh._buffers.get(leaf)
        if (
            value is None
            or value.is_meta
            or (value.dtype.is_floating_point and bool(torch.isnan(value).any()))
        ):
            raise RuntimeError(
                f"non-persistent buffer {name} of {type(module).__name__} could not be computed on {device}: "
                "neither the model's _init_weights nor rebuilding the module from its config fills it"
            )
        module._buffers[leaf] = value.to(device=device, dtype=module._buffers[leaf].dtype)
    return [name for name, _, _ in buffers]
