"""GumbelTopK: Gumbel-perturbed expert selection (RoE §2.1, eq. 1).

Indices = TopK(R + tau · G, k) with G ~ Gumbel(0, 1) i.i.d. per token, expert and sample; the
combine weights come from the un-noised scores. tau is per MoE layer (RoE §2.2); tau = 0 is the
identity. Noise is drawn from a generator seeded when the policy is bound (at ``route()`` entry),
so a session is reproducible; every row of a batch draws its own noise. ``row_scale`` ([B])
multiplies tau per row, e.g. 0 for RoE's clean sample 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import ConfigError
from moectl.routing.policy_config import PolicyConfig, layer_key, register_policy
from moectl.routing.routing_state import RoutingState


def gumbel_noise(shape: torch.Size, generator: torch.Generator, device: torch.device) -> Tensor:
    """Standard Gumbel samples -log(-log U), U ~ U(0, 1) clamped away from 0 and 1."""
    u = torch.rand(shape, generator=generator, device=generator.device).to(device)
    eps = torch.finfo(u.dtype).eps
    return -torch.log(-torch.log(u.clamp(eps, 1 - eps)))


def check_tau(tau: object) -> None:
    """Refuse a tau spec that is not finite and >= 0 everywhere (ValueError naming the layer).

    tau = 0 is allowed: it is the identity (RoE §2.3's clean path, and layers a profile skips).
    """
    if isinstance(tau, Mapping):
        values = {f"MoE layer {k}": v for k, v in tau.items()}
    elif isinstance(tau, (int, float)) and not isinstance(tau, bool):
        values = {"every MoE layer": tau}
    elif isinstance(tau, Sequence) and not isinstance(tau, (str, bytes)):
        values = {f"MoE layer {i}": v for i, v in enumerate(tau)}
    else:
        raise ConfigError(f"GumbelTopK: tau must be a number, a list per MoE layer or {{layer: tau}}, got {tau!r}")
    bad = {}
    for where, v in values.items():
        try:
            f = float(v) if not isinstance(v, (bool, str, bytes)) else math.nan
        except (TypeError, ValueError):
            f = math.nan
        if not (math.isfinite(f) and f >= 0):
            bad[where] = v
    if bad:
        raise ConfigError(f"GumbelTopK: temperatures tau must be >= 0 and finite, got {bad}")


@register_policy("gumbel")
class GumbelTopK(PolicyConfig):
    """Gumbel-top-k routing with per-layer temperature tau.

    ``tau`` is one float for every MoE layer, a sequence (one per MoE layer) or a mapping from
    MoE layer index to tau (missing layers: 0). As a config:
    ``{"type": "gumbel", "format_version": 1, "tau": 0.3 | [..] | {"layer": tau}, "seed": 0}``
    (plus ``"row_scale": [B floats]`` when set).
    """

    def __init__(
        self,
        tau: float | Sequence[float] | Mapping[int, float],
        seed: int = 0,
        row_scale: Tensor | None = None,
    ) -> None:
        check_tau(tau)
        self.tau_spec = tau
        self.seed = int(seed)
        self.row_scale = row_scale
        self.tau: dict[int, float] = {}
        self.generator: torch.Generator | None = None

    def __repr__(self) -> str:
        return f"GumbelTopK(tau={self.tau_spec!r}, seed={self.seed})"

    # -- config -------------------------------------------------------------------------------
    def config_fields(self) -> dict[str, Any]:
        spec = self.tau_spec
        if isinstance(spec, Mapping):
            tau: Any = {str(k): float(v) for k, v in spec.items()}
        elif isinstance(spec, (int, float)):
            tau = float(spec)
        else:
            tau = [float(v) for v in spec]
        fields: dict[str, Any] = {"tau": tau, "seed": self.seed}
        if self.row_scale is not None:
            fields["row_scale"] = self.row_scale.float().tolist()
        return fields

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> GumbelTopK:
        if "tau" not in data:
            raise ConfigError("a gumbel policy needs 'tau' (a number, a list per MoE layer or {layer: tau})")
        tau = data["tau"]
        if isinstance(tau, Mapping):
            tau = {layer_key(k, "tau"): float(v) for k, v in tau.items()}
        elif isinstance(tau, bool) or not isinstance(tau, (int, float, list)):
            raise ConfigError(f"gumbel 'tau' must be a number, a list or {{layer: tau}}, got {tau!r}")
        seed = data.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"gumbel 'seed' must be an integer, got {seed!r}")
        row_scale = data.get("row_scale")
        return cls(tau, seed=seed, row_scale=None if row_scale is None else torch.tensor(row_scale))

    # -- policy ---------------------------------------------------------------------------------
    def fork(self, seed: int) -> GumbelTopK:
        """The same temperatures with a fresh generator seeded by ``seed`` (``SequencePolicy``)."""
        return GumbelTopK(self.tau_spec, seed=seed, row_scale=self.row_scale)

    def draws(self) -> bool:
        """Gumbel noise is drawn from the seeded generator (``SeededPolicy``)."""
        return True

    def bind(self, info: ModelInfo) -> None:
        n = info.num_moe_layers
        spec = self.tau_spec
        if isinstance(spec, Mapping):
            bad = [k for k in spec if not 0 <= int(k) < n]
            if bad:
                raise ConfigError(
                    f"GumbelTopK: tau given for MoE layers {bad}; the model has MoE layers 0..{n - 1}"
                )
            tau = {int(k): float(v) for k, v in spec.items()}
        elif isinstance(spec, (int, float)):
            tau = dict.fromkeys(range(n), float(spec))
        else:
            values = [float(v) for v in spec]
            if len(values) != n:
                raise ConfigError(
                    f"GumbelTopK: {len(values)} temperatures given, the model has {n} MoE layers"
                )
            tau = dict(enumerate(values))
        negative = {k: v for k, v in tau.items() if not v >= 0}
        if negative:
            raise ConfigError(f"GumbelTopK: temperatures must be >= 0 (finite), got {negative}")
        self.tau = {k: v for k, v in tau.items() if v > 0}
        device = info.layers[0].router.weight.device if hasattr(info.layers[0].router, "weight") else "cpu"
        self.generator = torch.Generator(device=device).manual_seed(self.seed)

    def apply(self, state: RoutingState) -> None:
        tau = self.tau.get(state.layer, 0.0)
        if tau == 0.0:
            return
        assert self.generator is not None, "GumbelTopK used before bind()"
        noise = gumbel_noise(state.logits.shape, self.generator, state.logits.device) * tau
        if self.row_scale is not None:
            scale = self.row_scale.to(noise)
            if scale.shape != (state.logits.shape[0],):
                raise ConfigError(
                    f"GumbelTopK: row_scale has shape {tuple(scale.shape)}, batch is {state.logits.shape[0]}"
                )
            noise = noise * scale[:, None, None]
        state.add_noise(noise)
