"""Padding tokens of a batched prefill skip the experts.

Requests prefilled together are left-padded to the longest prompt (``lm.padding.left_pad``); the
padding is masked out of attention, but the MoE layers would still run it through the experts:
wasted compute in proportion to the padding and, under the offload runtime, expert loads for
experts that only padding chose. ``PadSkip`` hooks each MoE layer's experts module (whatever sits at
``block.experts``: transformers' experts under any implementation — eager, grouped_mm, batched_mm,
moectl's grouped forward — or the offload runtime's ``OffloadedExperts``): while the engine has
set the forward's real tokens, the experts get only those rows (hidden states, chosen ids and
weights cut to them) and their output is scattered back, zero at padding.

The router still runs on every token, so routing, policies, traces and switch counts are as before;
what padding positions hold after the MoE layer changes, and attention never reads it. Not applied
where the experts module is not called with [tokens, H] hidden states (none of the supported
families) or in the dense parts of the block (a shared expert still runs on padding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo


def real_tokens(lengths: Sequence[int], width: int) -> Tensor:
    """The flat indices (row-major in a [len(lengths), width] batch) of left-padded rows' real tokens,
    built on the host (no device sync)."""
    n = torch.tensor(list(lengths))
    grid = torch.arange(width)[None, :] >= (width - n)[:, None]
    return grid.reshape(-1).nonzero().squeeze(1)


class PadSkip:
    """Cut each experts call to the forward's real tokens while ``keep`` is set (see the module doc)."""

    def __init__(self) -> None:
        self.index: Tensor | None = None  # [n] flat indices of the real tokens of the next forward
        self.tokens = 0  # B·T rows of that forward
        self._cut: set[int] = set()  # experts modules whose current call was cut
        self._handles: list = []

    def install(self, info: ModelInfo) -> None:
        for layer in info.layers:
            experts = getattr(layer.block, "experts", None)
            if isinstance(experts, nn.Module):
                self._handles.append(experts.register_forward_pre_hook(self._before, with_kwargs=True))
                self._handles.append(experts.register_forward_hook(self._after))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def keep(self, lengths: Sequence[int] | None, width: int = 0, device: torch.device | str = "cpu") -> None:
        """Before a left-padded forward: its rows' real lengths and its width (None: every token runs)."""
        self._cut.clear()
        if lengths is None or all(n == width for n in lengths):
            self.index, self.tokens = None, 0
            return
        self.index = real_tokens(lengths, width).to(device, non_blocking=True)
        self.tokens = len(lengths) * width

    def _before(self, module: nn.Module, args: tuple, kwargs: dict):
        index, n = self.index, self.tokens
        hidden = args[0] if args else kwargs.get("hidden_states")
        if index is None or not isinstance(hidden, Tensor) or hidden.dim() != 2 or hidden.shape[0] != n:
            return None

        def cut(value):
            if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == n:
                return value.index_select(0, index)
            return value

        keep_tokens = getattr(module, "keep_tokens", None)  # the offload runtime's experts: its router probs
        if callable(keep_tokens):
            keep_tokens(index)
        self._cut.add(id(module))
        return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}

    def _after(self, module: nn.Module, args: tuple, output):
        if id(module) not in self._cut:
            return None
        self._cut.discard(id(module))
        assert self.index is not None and isinstance(output, Tensor)
        full = output.new_zeros(self.tokens, *output.shape[1:])
        return full.index_copy_(0, self.index, output)
