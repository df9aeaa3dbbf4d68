"""Gumbel-top-k routing noise keyed by (sample, position): RoE §2.1 eq. (1) for K-sample ensembles.

Indices = TopK(R + tau·G, k) with G ~ Gumbel(0, 1) i.i.d. per token, expert and sample, weights from
the un-noised scores (the routing core's rule does the selection). This differs from the core's
``GumbelTopK`` only in *where G comes from*: ``GumbelTopK`` draws from a generator in call order,
whereas here G is a counter-based hash of (seed, MoE layer, sample index, position, expert). So
the draw for sample k at position t is the same whatever the batch layout — K samples folded into
the query dimension of one sequence (clean cache), K batch rows (separate caches) or a full
recomputation (no cache) — which is what lets the tests check the clean cache against its
definition token for token with tau > 0.

The driver sets ``layout`` before each forward: per routed token, which sample it belongs to,
its position id, and a 0/1 ``scale`` (0 for the clean sample 0 and for the clean prefix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moectl.adapters.inspect import ModelInfo
from moectl.routing.state import RoutingState

_M32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # < 2**27: x * _MULT stays below 2**59 for x < 2**32, no int64 overflow


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors holding values < 2**32."""
    x = ((x >> 16) ^ x) * _MULT & _M32
    x = ((x >> 16) ^ x) * _MULT & _M32
    return (x >> 16) ^ x


def _mix_int(x: int) -> int:
    """``_mix`` on a Python int (for the per-layer keys, computed once)."""
    x &= _M32
    x = ((x >> 16) ^ x) * _MULT & _M32
    x = ((x >> 16) ^ x) * _MULT & _M32
    return (x >> 16) ^ x


def layer_keys(seed: int, layers: Sequence[int]) -> list[int]:
    """One 32-bit key per (seed, MoE layer)."""
    base = _mix_int(seed ^ 0x9E3779B9)
    return [_mix_int(base ^ _mix_int(layer * 0x632BE5AB + 0x1B873593)) for layer in layers]


def hashed_gumbel(keys: Tensor, sample: Tensor, position: Tensor, num_experts: int) -> Tensor:
    """Gumbel(0, 1) draws [L, *shape, E] from the hash of (layer key, sample, position, expert).

    ``keys`` [L] are ``layer_keys``; ``sample`` (< 2**12) and ``position`` (< 2**20) are
    broadcastable integer tensors. Uniforms use 24 bits: u = (h + 0.5) / 2**24 lies strictly
    inside (0, 1), so −log(−log u) is finite.
    """
    token = (sample.long() << 20) ^ (position.long() & 0xFFFFF)
    h = _mix(keys.view(-1, *([1] * token.dim())) ^ token.unsqueeze(0))
    experts = torch.arange(num_experts, dtype=torch.int64, device=h.device) * 0x61C88647 & _M32
    h = _mix(h.unsqueeze(-1) ^ experts)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


@dataclass
class NoiseLayout:
    """Which routed tokens get noise in the next forward, as tensors broadcastable to [B, T].

    ``sample``: sample index k (0 … K−1); ``position``: position id (padding-aware);
    ``scale``: 1 where Gumbel noise applies, 0 for clean tokens (sample 0, the clean prefix).
    """

    sample: Tensor
    position: Tensor
    scale: Tensor


class SampleGumbel:
    """Routing policy: Gumbel-top-k with per-layer tau and noise keyed by (sample, position).

    ``tau`` has one value per MoE layer (RoE §2.2). Layers with tau = 0 are untouched; so is every
    forward whose ``layout`` is None (e.g. the clean prefill) — the model routes as it always does.
    The noise of all noisy layers is drawn in one vectorised call at the first MoE layer of each
    forward (the layout fixes it) and sliced per layer.
    """

    def __init__(self, tau: Sequence[float], seed: int = 0) -> None:
        self.tau = [float(t) for t in tau]
        self.seed = int(seed)
        self._layout: NoiseLayout | None = None
        self._noise: dict[int, Tensor] | None = None
        self._noisy = [i for i, t in enumerate(self.tau) if t > 0]

    @property
    def layout(self) -> NoiseLayout | None:
        return self._layout

    @layout.setter
    def layout(self, layout: NoiseLayout | None) -> None:
        self._layout, self._noise = layout, None

    def bind(self, info: ModelInfo) -> None:
        if len(self.tau) != info.num_moe_layers:
            raise ValueError(
                f"SampleGumbel: {len(self.tau)} temperatures given, the model has {info.num_moe_layers} MoE layers"
            )
        bad = {i: t for i, t in enumerate(self.tau) if not t >= 0}
        if bad:
            raise ValueError(f"SampleGumbel: temperatures must be >= 0 (finite), got {bad}")
        self.layout = None

    def _draw(self, layers: list[int], b: int, t: int, e: int, device: torch.device) -> dict[int, Tensor]:
        layout = self._layout
        assert layout is not None
        sample = layout.sample.to(device).expand(b, t)
        position = layout.position.to(device).expand(b, t)
        scale = layout.scale.to(device=device, dtype=torch.float32).expand(b, t)
        tau = torch.tensor([self.tau[i] for i in layers], device=device)
        keys = torch.tensor(layer_keys(self.seed, layers), dtype=torch.int64, device=device)
        g = hashed_gumbel(keys, sample, position, e)  # [L, b, t, E]
        g = g * (tau[:, None, None] * scale).unsqueeze(-1)
        return dict(zip(layers, g.unbind(0), strict=True))

    def apply(self, state: RoutingState) -> None:
        if self._layout is None or self.tau[state.layer] == 0.0:
            return
        b, t, e = state.logits.shape
        if self._noise is None:  # first noisy layer of this forward: draw for all of them at once
            self._noise = self._draw(self._noisy, b, t, e, state.logits.device)
        noise = self._noise[state.layer]
        if noise.shape != state.logits.shape:  # a layer with another expert count
            noise = self._draw([state.layer], b, t, e, state.logits.device)[state.layer]
        state.add_noise(noise)
