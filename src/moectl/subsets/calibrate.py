"""Calibration for expert selection: what every MoE block sees on a few texts, streamed batch by batch.

The texts run through the model ``batch_size`` rows at a time; a forward hook on each
``info.layers[i].block`` reads the hidden states that entered the block, a read-only routing
policy keeps the router logits the block computed from them, and each batch is reduced at once
into the statistics the selection method needs (``stats.py``: running sums for router, frequency,
Wanda and Easy-EP, a bounded token sample for reconstruction). Padding positions are dropped, so
every method sees only real tokens (EMO §4.2: padding excluded). Memory: one batch's forward,
plus per layer a few [E] / [H] sums or at most ``max_tokens`` sampled block inputs.

The residual stream h_t entering the MoE sublayer (Easy-EP's h_t) is the input of the decoder
layer's norm whose output is the block input (pre-norm layers), or the block input itself where no
norm precedes the block (post-norm layers such as FlexOlmo) or where the layer adds the block
output to the normed stream (MiniMax: ``mlp_alpha_factor``); it is looked up only for the
methods that need it. With ``keep`` given, the already-selected layers are routed under
``ExpertMask(..., renorm="pruned")`` — the ``layerwise`` mode measures layer l+1 on the model
with layers 0..l already pruned. ``capture`` keeps every token instead (for inspection and tests).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import ConfigError
from moectl.routing import ExpertMask, route
from moectl.routing.routing_state import RoutingState
from moectl.subsets.stats import LayerStats


def tokenize(tokenizer, texts: Sequence[str], max_length: int | None = None) -> dict[str, Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` for ``texts`` (truncated to ``max_length``)."""
    if not texts:
        raise ConfigError("the calibration set is empty: give at least one text")
    # verbose=False: documents longer than model_max_length are expected here (cut to max_length below)
    batch = tokenizer(list(texts), return_tensors="pt", padding=True, verbose=False)
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


def capture(
    model: nn.Module,
    info: ModelInfo,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    keep: Mapping[int, Sequence[int]] | None = None,
    layers: Sequence[int] | None = None,
    batch_size: int | None = None,
) -> dict[int, LayerInputs]:
    """Block inputs and residual streams (float32) of every real token at the MoE layers ``layers``."""
    stats = collect(model, info, input_ids, attention_mask, {"inputs"}, keep, layers, batch_size)
    out: dict[int, LayerInputs] = {}
    for index, s in stats.items():
        assert s.sample is not None and s.residual is not None
        assert s.sample.x is not None and s.residual.x is not None
        out[index] = LayerInputs(s.sample.x.float(), s.residual.x.float())
    return out


class _LogitsObserver:
    """A routing policy that changes nothing and keeps each wanted layer's raw router logits."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = frozenset(layers)
        self.logits: dict[int, Tensor] = {}

    def bind(self, info: ModelInfo) -> None:
        self.logits.clear()

    def apply(self, state: RoutingState) -> None:
        if state.layer in self.layers:
            self.logits[state.layer] = state.logits


def _same(a: Tensor, b: Tensor) -> bool:
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return (a.data_ptr() == b.data_ptr() and a.stride() == b.stride()) or torch.equal(a, b)


@torch.no_grad()
def collect(
    model: nn.Module,
    info: ModelInfo,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    needs: set[str] | frozenset[str] = frozenset(),
    keep: Mapping[int, Sequence[int]] | None = None,
    layers: Sequence[int] | None = None,
    batch_size: int | None = 8,
    max_tokens: int | None = None,
    seed: int = 0,
    advance: Callable[[int], object] | None = None,
) -> dict[int, LayerStats]:
    """``{layer: LayerStats}`` of the real tokens at MoE layers ``layers`` (default all), streamed.

    ``needs``: the statistics to keep (``stats.NEEDS[method]``, or ``{"inputs"}`` for every token);
    ``batch_size`` rows per forward (None: all at once); ``max_tokens`` bounds the token sample;
    ``advance(rows)`` after each forward (a progress bar's).
    """
    wanted = list(range(info.num_moe_layers)) if layers is None else list(layers)
    needs = frozenset(needs)
    stats = {i: LayerStats(needs, max_tokens, seed) for i in wanted}
    if not needs:
        return stats
    valid_all = (
        torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    )
    device = next(model.parameters()).device
    observer = _LogitsObserver(wanted) if needs & {"probs", "counts", "easy_ep", "reap"} else None
    norms: dict[int, list[tuple[Tensor, Tensor]]] = {i: [] for i in wanted}
    batch: dict[str, Tensor] = {}

    def real(h: Tensor) -> Tensor:
        valid = batch["valid"]
        return h.reshape(valid.shape[0], valid.shape[1], -1)[valid].detach()

    def block_hook(index: int):
        layer = info.layer(index)

        def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            residual = None
            if stats[index].wants_residual:
                residual = next((inp for inp, out in norms[index] if _same(out, x)), None)
            norms[index].clear()
            logits = None if observer is None else observer.logits.pop(index, None)
            if not bool(batch["any"]):
                return
            stats[index].update(
                layer,
                real(x),
                None if logits is None else real(logits),
                None if residual is None else real(residual),
            )

        return hook

    def norm_hook(index: int):
        def hook(module: nn.Module, args: tuple, output) -> None:
            if isinstance(output, Tensor) and args and output.shape == args[0].shape:
                norms[index].append((args[0], output))

        return hook

    handles = []
    for i in wanted:
        layer = info.layer(i)
        handles.append(layer.block.register_forward_hook(block_hook(i), with_kwargs=True))
        if stats[i].wants_residual:
            for module in _decoder_norms(model, layer.name):
                handles.append(module.register_forward_hook(norm_hook(i)))
    policies: list = [ExpertMask.from_lists(info, dict(keep), renorm="pruned")] if keep else []
    if observer is not None:
        policies.append(observer)
    rows = input_ids.shape[0] if batch_size is None else max(1, int(batch_size))
    try:
        with route(model, policies, info=info):
            for first in range(0, input_ids.shape[0], rows):  # batches of calibration texts
                batch["valid"] = valid_all[first : first + rows].to(device)
                batch["any"] = batch["valid"].any()
                for pending in norms.values():
                    pending.clear()
                model(  # the LM head sees one position: calibration needs no [B, T, V] logits
                    input_ids=input_ids[first : first + rows].to(device),
                    attention_mask=None
                    if attention_mask is None
                    else attention_mask[first : first + rows].to(device),
                    logits_to_keep=1,
                )
                if advance is not None:
                    advance(min(rows, input_ids.shape[0] - first))
    finally:
        for handle in handles:
            handle.remove()
        for pending in norms.values():
            pending.clear()
    return stats


def _decoder_norms(model: nn.Module, router_name: str) -> list[nn.Module]:
    """The norm modules that are direct children of the decoder layer holding ``router_name``."""
    match = re.match(r"^(.*\.layers\.\d+)\.", router_name)
    if match is None:
        return []
    decoder = model.get_submodule(match.group(1))
    if hasattr(decoder, "mlp_alpha_factor"):  # MiniMax: residual = the normed stream = the block input
        return []
    return [m for name, m in decoder.named_children() if "norm" in name.lower() or "Norm" in type(m).__name__]
