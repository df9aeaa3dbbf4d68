"""Gumbel-top-k routing noise keyed by (sample, position): RoE §2.1 eq. (1) for K-sample ensembles.

Indices = TopK(R + tau·G, k) with G ~ Gumbel(0, 1) i.i.d. per token, expert and sample, weights from
the un-noised scores (the routing core's rule does the selection). This differs from the core's
``GumbelTopK`` only in *where G comes from*: ``GumbelTopK`` draws from a generator in call order,
whereas here G is a counter-based hash of (seed, MoE layer, sample index, position, expert)
(``moectl.routing.keyed_hash``, shared with evaluation's per-request noise). So
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
from moectl.errors import ConfigError
from moectl.routing.keyed_hash import layer_word, mix, mix_int, seed_key, uniforms
from moectl.routing.routing_state import RoutingState


def layer_keys(seed: int, layers: Sequence[int]) -> list[int]:
    """One 32-bit key per (seed, MoE layer)."""
    base = seed_key(seed)
    return [mix_int(base ^ mix_int(layer_word(layer))) for layer in layers]


_CHUNK_ELEMENTS = 1 << 20  # hash draws computed at once: int64 temporaries stay ~8 MiB each


def _token_codes(sample: Tensor, position: Tensor) -> Tensor:
    """Per routed token, the 32-bit code of (sample, position) [broadcast shape], int64."""
    return (sample.long() << 20) ^ (position.long() & 0xFFFFF)


def _gumbel_of_codes(key: int, token: Tensor, num_experts: int, out: Tensor) -> None:
    """Write Gumbel(0, 1) draws of layer ``key`` for token codes ``token`` [N] into ``out`` [N, E]."""
    u = uniforms(mix(token ^ key), num_experts)
    out.copy_(u.log_().neg_().log_().neg_())


def layer_gumbel(
    key: int,
    sample: Tensor,
    position: Tensor,
    num_experts: int,
    dtype: torch.dtype = torch.float32,
    chunk: int = _CHUNK_ELEMENTS,
) -> Tensor:
    """Gumbel(0, 1) draws [*shape, E] of one MoE layer from the hash of (key, sample, position, expert).

    ``key`` is the layer's ``layer_keys`` entry; ``sample`` (< 2**12) and ``position`` (< 2**20)
    are broadcastable integer tensors. The integer hash runs over chunks of about ``chunk``
    draws, so its int64 temporaries stay bounded whatever the batch; the draws are written
    straight into a tensor of ``dtype`` (the router logits' dtype). Computed in float32 and then
    cast, so the values are those of :func:`hashed_gumbel` for the same layer, bit for bit.
    """
    token = _token_codes(sample, position)
    shape = token.shape
    token = token.reshape(-1)
    out = torch.empty((token.numel(), num_experts), dtype=dtype, device=token.device)
    rows = max(1, chunk // max(1, num_experts))
    for first in range(0, token.numel(), rows):  # a handful of chunks per layer, not per token
        part = out[first : first + rows]
        if dtype == torch.float32:
            _gumbel_of_codes(key, token[first : first + rows], num_experts, part)
        else:
            tmp = torch.empty(part.shape, dtype=torch.float32, device=part.device)
            _gumbel_of_codes(key, token[first : first + rows], num_experts, tmp)
            part.copy_(tmp)
    return out.reshape(*shape, num_experts)


def hashed_gumbel(keys: Tensor, sample: Tensor, position: Tensor, num_experts: int) -> Tensor:
    """Gumbel(0, 1) draws [L, *shape, E] from the hash of (layer key, sample, position, expert).

    ``keys`` [L] are ``layer_keys``; ``sample`` (< 2**12) and ``position`` (< 2**20) are
    broadcastable integer tensors. Uniforms use 24 bits: u = (h + 0.5) / 2**24 lies strictly
    inside (0, 1), so −log(−log u) is finite. One :func:`layer_gumbel` per layer (routing draws
    each layer's noise when that layer routes; this stacked form is for inspection and tests).
    """
    sample, position = torch.broadcast_tensors(sample, position)
    return torch.stack([layer_gumbel(int(k), sample, position, num_experts) for k in keys.tolist()])


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
    Each layer draws its own noise when it routes ([B, T, E] in the router logits' dtype, hashed
    in bounded chunks: ``layer_gumbel``), so no forward ever holds the noise of several layers.
    """

    def __init__(self, tau: Sequence[float], seed: int = 0) -> None:
        self.tau = [float(t) for t in tau]
        self.seed = int(seed)
        self._layout: NoiseLayout | None = None
        self._keys = layer_keys(self.seed, range(len(self.tau)))

    @property
    def layout(self) -> NoiseLayout | None:
        return self._layout

    @layout.setter
    def layout(self, layout: NoiseLayout | None) -> None:
        self._layout = layout

    def bind(self, info: ModelInfo) -> None:
        if len(self.tau) != info.num_moe_layers:
            raise ConfigError(
                f"SampleGumbel: {len(self.tau)} temperatures given, the model has {info.num_moe_layers} MoE layers"
            )
        bad = {i: t for i, t in enumerate(self.tau) if not t >= 0}
        if bad:
            raise ConfigError(f"SampleGumbel: temperatures must be >= 0 (finite), got {bad}")
        self.layout = None

    def noise(self, layer: int, logits: Tensor) -> Tensor:
        """tau_layer · scale · G for ``logits`` [B, T, E], G drawn for this layer alone."""
        layout = self._layout
        assert layout is not None
        b, t, e = logits.shape
        device = logits.device
        sample = layout.sample.to(device).expand(b, t)
        position = layout.position.to(device).expand(b, t)
        scale = layout.scale.to(device=device, dtype=torch.float32).expand(b, t)
        g = layer_gumbel(self._keys[layer], sample, position, e, dtype=logits.dtype)
        tau = torch.tensor(self.tau[layer], dtype=torch.float32, device=device)
        return g.mul_((tau * scale).unsqueeze(-1).to(g.dtype))

    def apply(self, state: RoutingState) -> None:
        if self._layout is None or self.tau[state.layer] == 0.0:
            return
        state.add_noise(self.noise(state.layer, state.logits))
