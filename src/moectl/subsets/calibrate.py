"""Calibration data for expert selection: the inputs of every MoE block on a few texts.

A forward pre-hook on each ``info.layers[i].block`` records the hidden states that enter the MoE
block; padding positions are dropped, so every method sees only real tokens (EMO §4.2: padding
excluded). ``capture`` also records the residual stream h_t entering the MoE sublayer (Easy-EP's
h_t): the input of the decoder layer's norm whose output is the block input (pre-norm layers), or
the block input itself where no norm precedes the block (post-norm layers such as FlexOlmo) or
where the layer adds the block output to the normed stream (MiniMax: ``mlp_alpha_factor``).
With ``keep`` given, the already-selected layers are routed under
``ExpertMask(..., renorm="pruned")`` — the ``layerwise`` mode measures layer l+1 on the model
with layers 0..l already pruned.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.routing import ExpertMask, route


def tokenize(tokenizer, texts: Sequence[str], max_length: int | None = None) -> dict[str, Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` for ``texts`` (truncated to ``max_length``)."""
    if not texts:
        raise ValueError("the calibration set is empty: give at least one text")
    batch = tokenizer(list(texts), return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if max_length is not None and ids.shape[1] > max_length:
        ids, mask = ids[:, -max_length:], mask[:, -max_length:]
    return {"input_ids": ids, "attention_mask": mask}


@dataclass
class LayerInputs:
    """Calibration tokens at one MoE layer: block inputs ``x`` and residual stream, both [N_valid, H]."""

    x: Tensor
    residual: Tensor


def block_inputs(
    model: nn.Module,
    info: ModelInfo,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    keep: Mapping[int, Sequence[int]] | None = None,
    layers: Sequence[int] | None = None,
) -> dict[int, Tensor]:
    """Hidden states entering the MoE blocks of ``layers`` (default all): ``{layer: [N_valid, H]}`` float32."""
    captured = capture(model, info, input_ids, attention_mask, keep, layers)
    return {index: inputs.x for index, inputs in captured.items()}


@torch.no_grad()
def capture(
    model: nn.Module,
    info: ModelInfo,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    keep: Mapping[int, Sequence[int]] | None = None,
    layers: Sequence[int] | None = None,
) -> dict[int, LayerInputs]:
    """Block inputs and residual streams of the real tokens at the MoE layers ``layers`` (default all)."""
    wanted = list(range(info.num_moe_layers)) if layers is None else list(layers)
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    blocks: dict[int, Tensor] = {}
    norms: dict[int, list[tuple[Tensor, Tensor]]] = {i: [] for i in wanted}

    def real(h: Tensor) -> Tensor:
        h = h.reshape(valid.shape[0], valid.shape[1], -1)
        return h[valid.to(h.device)].float().detach()

    def block_hook(index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            blocks[index] = real(args[0] if args else kwargs["hidden_states"])

        return hook

    def norm_hook(index: int):
        def hook(module: nn.Module, args: tuple, output) -> None:
            if isinstance(output, Tensor) and args and output.shape == args[0].shape:
                norms[index].append((real(args[0]), real(output)))

        return hook

    handles = []
    for i in wanted:
        layer = info.layer(i)
        handles.append(layer.block.register_forward_pre_hook(block_hook(i), with_kwargs=True))
        for module in _decoder_norms(model, layer.name):
            handles.append(module.register_forward_hook(norm_hook(i)))
    policies = [ExpertMask.from_lists(info, dict(keep), renorm="pruned")] if keep else []
    device = next(model.parameters()).device
    try:
        with route(model, policies):
            model(
                input_ids=input_ids.to(device),
                attention_mask=None if attention_mask is None else attention_mask.to(device),
            )
    finally:
        for handle in handles:
            handle.remove()
    out: dict[int, LayerInputs] = {}
    for i in wanted:
        x = blocks[i]
        residual = next((inp for inp, o in norms[i] if torch.equal(o, x)), x)
        out[i] = LayerInputs(x, residual)
    return out


def _decoder_norms(model: nn.Module, router_name: str) -> list[nn.Module]:
    """The norm modules that are direct children of the decoder layer holding ``router_name``."""
    match = re.match(r"^(.*\.layers\.\d+)\.", router_name)
    if match is None:
        return []
    decoder = model.get_submodule(match.group(1))
    if hasattr(decoder, "mlp_alpha_factor"):  # MiniMax: residual = the normed stream = the block input
        return []
    return [m for name, m in decoder.named_children() if "norm" in name.lower() or "Norm" in type(m).__name__]
