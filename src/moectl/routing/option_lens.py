"""``option:K`` as a request's routing: the router seen as an option policy, its outputs unchanged.

TE-MoE §2.2 reads a plain router as an option policy: an option ω is a set of k-hat experts, taken
at a switch as the activated experts plus the most probable others (``metrics.switch_rate.option_of``)
and kept while the router's activated experts stay inside it; the switch rate counts how often it
must be renewed. ``option:K`` names that lens with k-hat = K. As a serving residency policy it says
which experts stay resident (``offload/residency.py``); as a routing of ``moectl serve`` /
``Engine`` it changes nothing the model computes and makes the request's reported ``switch_rate``
the router's at k-hat = K (the engine's ``SwitchMeter`` keeps ω by this rule for its rows), equal
to ``moectl.switch_rate(trace, k_hat=K)`` of the request's recorded trace.
"""

from __future__ import annotations

from moectl.adapters.inspect import ModelInfo
from moectl.errors import ConfigError
from moectl.routing.routing_state import RoutingState, RowEffect


class OptionLens:
    """k-hat for the switch rate of the rows it routes; no change to their routing."""

    def __init__(self, k_hat: int) -> None:
        if isinstance(k_hat, bool) or not isinstance(k_hat, int) or k_hat < 1:
            raise ConfigError(f"option:K needs an integer k-hat >= 1, got {k_hat!r}")
        self.k_hat = k_hat

    def bind(self, info: ModelInfo) -> None:
        for layer in info.layers:
            if not layer.top_k <= self.k_hat <= layer.num_experts:
                raise ConfigError(
                    f"option:{self.k_hat}: k-hat must be between top-k = {layer.top_k} and the "
                    f"{layer.num_experts} experts of MoE layer {layer.index} (an option holds the "
                    "activated experts)"
                )

    def row_effect(self, layer: int) -> RowEffect:
        """Nothing, for every token (``RowConstantPolicy``)."""
        return RowEffect()

    def apply(self, state: RoutingState) -> None:
        """Nothing: the lens only changes how switches are counted."""

    def __repr__(self) -> str:
        return f"OptionLens(k_hat={self.k_hat})"
