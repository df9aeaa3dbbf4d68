"""RandomOptions: TE-MoE's random pruning baseline, a fresh random set of k-hat experts per token.

TE-MoE §5 ("Baselines"): "For random selection, we randomly select a set of k̂ experts at each
token." Per MoE layer and per token the allowed set is drawn uniformly among the k-hat-subsets
(top-k of i.i.d. uniform noise, vectorised over the batch); the model's router then picks its
top-k inside that set, with p renormalised over it (``renorm="pruned"``, the masking of TE-MoE
A2). Grouped routers (DeepSeek-V3, GLM4-MoE) draw k-hat / n_group experts in every group, the
balanced sets that ``moectl.subsets`` keeps too. Noise comes from one generator per MoE layer,
seeded at ``bind()`` (``route()`` entry), so a session is reproducible and a layer's draws do not
depend on the other layers. Shared experts are always on: masks never touch them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, MoELayer
from moectl.adapters.rules import Renorm
from moectl.errors import ConfigError
from moectl.routing.policy_config import PolicyConfig, register_policy
from moectl.routing.routing_state import RoutingState
from moectl.subsets.scores import check_k


def check_k_hat(info: ModelInfo, k_hat: int) -> None:
    """Refuse a k-hat some MoE layer cannot keep (top-k <= k-hat <= E; balanced groups)."""
    for layer in info.layers:
        if not layer.top_k <= k_hat <= layer.num_experts:
            raise ConfigError(
                f"k-hat = {k_hat} is out of range: MoE layer {layer.index} has top-k = {layer.top_k} and "
                f"{layer.num_experts} experts; allowed k-hat: {layer.top_k}..{layer.num_experts}"
            )
        try:
            check_k(layer, k_hat)  # router groups: k-hat / n_group experts per group, at least 2
            layer.rule.check_allowed(balanced_mask(layer, k_hat), where=f"MoE layer {layer.index}")
        except ValueError as err:
            raise ConfigError(f"k-hat = {k_hat} does not fit the model: {err}") from None


def balanced_mask(layer: MoELayer, k_hat: int) -> Tensor:
    """[E] bool: the first k-hat / n_group experts of every router group (one representative set)."""
    groups = layer.rule.n_group
    size = layer.num_experts // groups
    return (torch.arange(layer.num_experts) % size) < k_hat // groups


def random_allowed(shape: tuple[int, ...], groups: int, k_hat: int, generator: torch.Generator) -> Tensor:
    """[*shape[:-1], E] bool: per row a uniformly random set of k-hat experts, k-hat / groups per group."""
    *lead, experts = shape
    noise = torch.rand(*lead, groups, experts // groups, generator=generator, device=generator.device)
    idx = noise.topk(k_hat // groups, dim=-1).indices
    allowed = torch.zeros_like(noise, dtype=torch.bool).scatter_(-1, idx, True)
    return allowed.reshape(*lead, experts)


@register_policy("random_options")
class RandomOptions(PolicyConfig):
    """Allow a fresh uniformly random set of ``k_hat`` experts at every token of every MoE layer.

    As a config: ``{"type": "random_options", "format_version": 1, "k_hat": 4, "seed": 0,
    "renorm": "pruned"}`` (``moectl baselines --method random --json``'s report loads as one too).
    """

    def __init__(self, k_hat: int, seed: int = 0, renorm: Renorm = "pruned") -> None:
        if isinstance(k_hat, bool) or not isinstance(k_hat, int) or k_hat < 1:
            raise ConfigError(f"RandomOptions: k_hat must be a positive integer, got {k_hat!r}")
        if renorm not in ("pruned", "stock"):
            raise ConfigError(f"RandomOptions: renorm must be 'pruned' or 'stock', got {renorm!r}")
        self.k_hat = k_hat
        self.seed = int(seed)
        self.renorm: Renorm = renorm
        self._groups: dict[int, int] = {}
        self._generators: dict[int, torch.Generator] = {}

    def config_fields(self) -> dict[str, Any]:
        return {"k_hat": self.k_hat, "seed": self.seed, "renorm": self.renorm}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> RandomOptions:
        seed = data.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"random_options 'seed' must be an integer, got {seed!r}")
        return cls(data.get("k_hat"), seed=seed, renorm=data.get("renorm", "pruned"))

    def draws(self) -> bool:
        """The k-hat sets are drawn from per-layer generators seeded by ``seed`` (``SeededPolicy``)."""
        return True

    def bind(self, info: ModelInfo) -> None:
        """Check k-hat against every MoE layer and (re)seed one generator per layer."""
        check_k_hat(info, self.k_hat)
        self._groups = {layer.index: layer.rule.n_group for layer in info.layers}
        self._generators = {}
        for layer in info.layers:
            weight = getattr(layer.router, "weight", None)
            device = weight.device if isinstance(weight, Tensor) else torch.device("cpu")
            seed = self.seed * 1_000_003 + layer.index
            self._generators[layer.index] = torch.Generator(device=device).manual_seed(seed)

    def groups(self, layer: int) -> int:
        """The number of expert groups of MoE layer ``layer`` (the k-hat set is drawn within them; bound)."""
        groups = self._groups.get(layer)
        if groups is None:
            raise RuntimeError("RandomOptions used before bind(): install it with moectl.route(...)")
        return groups

    def apply(self, state: RoutingState) -> None:
        """Restrict every token of ``state.layer`` to its own random k-hat experts."""
        groups = self.groups(state.layer)
        generator = self._generators[state.layer]
        allowed = random_allowed(tuple(state.logits.shape), groups, self.k_hat, generator)
        state.restrict(allowed.to(state.logits.device), self.renorm)

    def __repr__(self) -> str:
        return f"RandomOptions(k_hat={self.k_hat}, seed={self.seed}, renorm={self.renorm!r})"
