"""``reroute:TOL``: cache-aware rerouting while serving offloaded — trade a little routing fidelity
for misses.

At a decoding step, each expert of the router's top-k that is not resident is replaced by a
resident expert the token did not choose, when that expert's router probability is within TOL of
it (p_r ≥ p_j − TOL): the missing experts in descending p are paired with the resident candidates
in descending p, and each pair within TOL is swapped. The token then routes to the resulting k
experts with their own router probabilities (``renorm="stock"``: the model's rule on the new set).
TOL = 0 changes nothing (except exact ties); TOL = 1 serves every token from the resident set once
it holds enough experts. Prompt tokens are never rerouted. Residency itself is S3-FIFO
(``CacheResidency``), the best heuristic of ``moectl offload simulate`` on the reference traces.

Deviation: the literature's cache-aware routers (e.g. Skliar et al. 2024, cache-conditional
experts) bias the router's logits towards cached experts; this rule instead bounds the
probability given up per substituted expert by TOL, a knob stated in the router's own units.
Routers with expert groups or sigmoid scores are refused (the swap would bypass their selection).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import ConfigError
from moectl.offload.residency import S3FIFOResidency
from moectl.routing.policy_config import register_policy
from moectl.routing.routing_state import RoutingState


def reroute(probs: Tensor, chosen: Tensor, resident: Tensor, tol: float) -> tuple[Tensor, int]:
    """The experts to route to ([E] bool) and how many were swapped, for one token.

    ``probs`` [E] the router distribution, ``chosen`` [k] its top-k, ``resident`` [E] bool."""
    picked, swapped = reroute_rows(probs.unsqueeze(0), chosen.unsqueeze(0), resident, tol)
    return picked[0], swapped


def reroute_rows(probs: Tensor, chosen: Tensor, resident: Tensor, tol: float) -> tuple[Tensor, int]:
    """:func:`reroute` for R tokens at once (the rows of a decoding step share one resident set):
    ``probs`` [R, E], ``chosen`` [R, k], ``resident`` [E] bool or [R, E] -> ([R, E] bool, swaps).

    Per row, its missing experts in descending p are paired with its resident candidates (resident,
    not chosen) in descending p, the i-th with the i-th, and a pair within ``tol`` is swapped."""
    rows, experts = probs.shape
    k = chosen.shape[-1]
    resident = resident.to(probs.device).expand(rows, experts)
    picked = torch.zeros(rows, experts, dtype=torch.bool, device=probs.device).scatter_(1, chosen, True)
    p_chosen = probs.gather(1, chosen)
    p_missing = p_chosen.masked_fill(resident.gather(1, chosen), float("-inf"))  # resident: not missing
    p_missing, order = p_missing.sort(dim=1, descending=True)
    missing = chosen.gather(1, order)
    p_cand, candidates = probs.masked_fill(~resident | picked, float("-inf")).topk(min(k, experts), dim=1)
    p_missing, missing = p_missing[:, : p_cand.shape[1]], missing[:, : p_cand.shape[1]]
    swap = (p_missing > float("-inf")) & (p_cand > float("-inf")) & (p_cand >= p_missing - tol)
    picked.scatter_(1, missing, ~swap & picked.gather(1, missing))
    picked.scatter_(1, candidates, swap | picked.gather(1, candidates))
    return picked, int(swap.sum())


class CacheAwareRouting:
    """The routing half of ``RerouteResidency``: reads each layer's resident set as the last step left it."""

    def __init__(self, owner: RerouteResidency) -> None:
        self.owner = owner

    def bind(self, info: ModelInfo) -> None:
        for layer in info.layers:
            rule = layer.rule
            if rule.grouped or rule.kind not in ("softmax_topk", "topk_softmax"):
                raise ConfigError(
                    f"reroute: MoE layer {layer.index} has a {rule.kind} router"
                    f"{' with expert groups' if rule.grouped else ''}; rerouting supports ungrouped softmax "
                    "routers (softmax then top-k, or top-k then softmax)"
                )

    def apply(self, state: RoutingState) -> None:
        """At a decoding step (one token per row; every row of a batch, against the resident set
        they share), the swaps of :func:`reroute_rows`; a prompt's tokens are never rerouted."""
        res = self.owner.sets.get(state.layer)
        b, t, e = state.logits.shape
        if res is None or t != 1 or not res.where:
            return
        probs = state.probs.reshape(b, e)
        resident = torch.zeros(b, e, dtype=torch.bool, device=probs.device)
        resident[:, list(res.where)] = True
        if state.allowed is not None:  # another policy's restriction holds: only allowed experts
            allowed = state.allowed.reshape(b, e)
            probs = probs.masked_fill(~allowed, -1.0)
            resident &= allowed
        chosen = torch.topk(probs, state.rule.top_k, dim=-1).indices
        allowed, swapped = reroute_rows(probs, chosen, resident, self.owner.tol)
        if swapped:
            self.owner.rerouted += swapped
            state.restrict(allowed.view(b, 1, e), renorm="stock")


@register_policy("reroute")
class RerouteResidency(S3FIFOResidency):
    """S3-FIFO residency with cache-aware rerouting of decoding tokens (see the module doc)."""

    def __init__(self, tol: float) -> None:
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol <= 1:
            raise ConfigError(f"reroute needs a tolerance TOL in [0, 1] (router probability), got {tol!r}")
        super().__init__()
        self.tol = float(tol)
        self.name = f"reroute:{self.tol:g}"
        self.sets: dict[int, Any] = {}  # MoE layer -> its ResidentSet, as the runtime passes it
        self.rerouted = 0  # experts swapped for resident ones
        self.router = CacheAwareRouting(self)

    def config_fields(self) -> dict[str, Any]:
        return {"tol": self.tol}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> RerouteResidency:
        return cls(data.get("tol"))

    def routing(self, info) -> list:
        return [self.router]

    def before(self, layer: int, res, chosen: Tensor, probs: Tensor | None) -> None:
        self.sets[layer] = res
        super().before(layer, res, chosen, probs)


def parse_reroute(spec: str) -> RerouteResidency:
    """``reroute:TOL`` → the policy; ValueError naming the form."""
    try:
        tol = float(spec.removeprefix("reroute:"))
    except ValueError:
        raise ConfigError(f"policy {spec!r}: reroute needs a tolerance, as reroute:0.05") from None
    return RerouteResidency(tol)
