"""Residency policies: which experts of a layer stay resident between steps.

- ``lru``: per-token routing (the model's own), experts loaded on demand into an LRU cache
  (the mixtral-offloading / MoE-Infinity baseline).
- ``static``: a fixed per-layer subset ``{moe_layer: [experts]}``, loaded once and pinned; routing
  is restricted to it with ``ExpertMask(..., renorm="pruned")`` (EMO's expert subsets).
- ``option:K_HAT``: the router-as-option rule of the switch-rate metric (TE-MoE §2.2): at a switch
  the top-k-hat option (activated experts first, then the most probable) is loaded and pinned; it
  persists until an activated expert falls outside it. Routing is the model's own.

- ``s3fifo``, ``arc``: per-token routing (the model's own) with S3-FIFO's or ARC's eviction instead of
  LRU's: the replacement policies of ``moectl.residency`` that ``moectl offload simulate`` found best
  on the reference models' traces (``CacheResidency``).

- ``controller:DIR``: a trained TE-MoE controller (``moectl options train``): routing is restricted
  to each layer's current option, and that option (k-hat experts) is what stays resident; a switch
  loads the new option's missing experts.

A step is one forward of the model. Generation is one sequence at a time: a step with one token
is a decoding step; a step with several (the prompt) streams its experts through the cache, and
the option policy then takes its first option at the last prompt token, as the metric's
``region="generated"`` does.

``predict`` (decoding steps, when prefetching is on) returns the experts to prefetch because a
switch is predicted (``prefetch.py``): the option and controller policies predict; lru and static
never switch options and return nothing.

Each is a policy config (``routing/policy_config.py``): ``{"type": "lru"}``, ``{"type": "static",
"experts": {"0": [...]}}``, ``{"type": "option", "k_hat": 8}``; the controller residency is its
controller's ``{"type": "controller", "path": ...}``. ``residency_policy`` turns whatever
``moectl.load_policy`` read into one of them: an expert mask (a subset file) becomes ``static``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import ConfigError
from moectl.metrics.switch_rate import option_of
from moectl.offload.prefetch import HiddenTap, PrefetchConfig, controller_prediction, option_prediction
from moectl.routing.mask import MASK_FORMS, expert_lists_of
from moectl.routing.policy_config import PolicyConfig, register_policy


class ResidencyPolicy(PolicyConfig, ABC):
    """What the offload runtime asks of a residency policy, per MoE layer and step.

    ``before`` runs when a layer's experts are selected, before they run: it decides what stays
    resident (``res.pinned``, loads with ``res.ensure``); ``after`` runs once they ran. ``pins``
    says whether the policy keeps a set pinned between steps, so that the runtime's count of
    changes of that set (``switches``) is a switch rate (TE-MoE §2.2); ``k_hat`` is that set's size
    (None: the model's top-k). ``routing(info)`` names the routing policies serving needs (none:
    the model's own routing); ``needs_probs``: ``before`` reads the router's distribution.
    """

    name: str = ""
    needs_probs: bool = False
    k_hat: int | None = None

    @property
    @abstractmethod
    def pins(self) -> bool:
        """Whether the policy keeps a set of experts pinned between steps (its changes count as switches)."""

    @abstractmethod
    def before(self, layer: int, res, chosen: Tensor, probs: Tensor | None) -> None:
        """Pin / load what stays resident for this step (``chosen`` [tokens, k], ``probs`` [tokens, E])."""

    def after(self, layer: int, res, chosen: Tensor, probs: Tensor | None) -> None:
        """After the layer's experts ran (nothing by default)."""

    def min_budget(self, layer: int, top_k: int) -> int:
        """The fewest resident slots per layer the policy can serve with."""
        return top_k

    def routing(self, info) -> list:
        """The routing policies serving installs for this residency ([]: the model's own routing)."""
        return []

    def report(self) -> dict[str, Any]:
        """Figures of the policy's own for ``serve_offload``'s result (none by default)."""
        return {}

    def predict(
        self, layer: int, res, chosen: Tensor, probs: Tensor | None, config: PrefetchConfig
    ) -> list[int]:
        """Experts to prefetch for the next token at a decoding step (after ``before``); [] for none."""
        return []


@register_policy("lru")
class LRUPolicy(ResidencyPolicy):
    """Experts loaded on demand into an LRU cache; nothing pinned."""

    name = "lru"

    @property
    def pins(self) -> bool:
        return False

    def config_fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> LRUPolicy:
        return cls()

    def before(self, layer: int, res, chosen: Tensor, probs: Tensor | None) -> None:
        res.pinned.clear()


@register_policy("static")
class StaticPolicy(ResidencyPolicy):
    """A fixed expert subset per MoE layer; layers not named keep every expert (served as LRU)."""

    pins = True  # the subset stays pinned

    def __init__(self, subsets: dict[int, list[int]]) -> None:
        self.subsets = {int(k): sorted({int(e) for e in v}) for k, v in subsets.items()}
        self.name = "static"

    def config_fields(self) -> dict[str, Any]:
        return {"experts": {str(k): v for k, v in sorted(self.subsets.items())}}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> StaticPolicy:
        """From ``{"experts" | "keep": {layer: [ids]}}`` or ``{"everywhere": [ids]}`` (with the model)."""
        forms = [k for k in MASK_FORMS if k in data and k != "masks"]
        if len(forms) != 1:
            raise ConfigError(
                "a static residency needs exactly one of 'experts' / 'keep' ({layer: [ids]}) or "
                f"'everywhere' ([ids]); got {forms or 'none'}"
            )
        if forms[0] == "everywhere":
            from moectl.routing.mask import ExpertMask

            if info is None:
                raise ConfigError(
                    "a static residency with 'everywhere' needs the model: load_policy(spec, model)"
                )
            return cls(ExpertMask.from_dict(data, info).expert_lists())
        return cls(expert_lists_of(data[forms[0]], forms[0]))

    def min_budget(self, layer: int, top_k: int) -> int:
        return max(top_k, len(self.subsets.get(layer, [])))

    def routing(self, info) -> list:
        from moectl.routing import ExpertMask

        return [ExpertMask.from_lists(info, self.subsets, renorm="pruned")]

    def before(self, layer: int, res, chosen: Tensor, probs: Tensor | None) -> None:
        subset = self.subsets.get(layer)
        if subset is None:
            res.pinned.clear()
            return
        if res.pinned != set(subset):
            res.pinned = set(subset)
            for e in subset:
                res.ensure(e)


@register_policy("option")
class OptionPolicy(ResidencyPolicy):
    """The router treated as an option policy with k-hat experts per option."""

    pins = True  # the current option stays pinned

    needs_probs = True

    def __init__(self, k_hat: int) -> None:
        if isinstance(k_hat, bool) or not isinstance(k_hat, int) or k_hat < 1:
            raise ConfigError(f"k-hat must be an integer >= 1, got {k_hat!r}")
        self.k_hat = k_hat
        self.name = f"option:{k_hat}"
        self.option: dict[int, set[int]] = {}
        self.switches: dict[int, int] = {}

    def config_fields(self) -> dict[str, Any]:
        return {"k_hat": self.k_hat}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> OptionPolicy:
        return cls(data.get("k_hat"))

    def min_budget(self, layer: int, top_k: int) -> int:
        if self.k_hat < top_k:
            raise ConfigError(f"k-hat = {self.k_hat} is smaller than top-k = {top_k}")
        return self.k_hat

    def routing(self, info) -> list:
        """The lens that makes a row's switch rate the router's at k-hat (``routing/option_lens``);
        the routing itself is the model's."""
        from moectl.routing.option_lens import OptionLens

        return [OptionLens(self.k_hat)]

    def _take(self, layer: int, res, probs: Tensor, chosen: Tensor) -> None:
        onehot = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, chosen.long(), True)
        option = option_of(probs[None], onehot[None], self.k_hat)[0].nonzero().flatten().tolist()
        self.option[layer] = set(option)
        self.switches[layer] = self.switches.get(layer, 0) + 1
        res.pinned = set(option)
        for e in option:
            res.ensure(e)

    def before(self, layer: int, res, chosen: Tensor, probs: Tensor | None) -> None:
        if chosen.shape[0] > 1:  # the prompt: stream its experts, the option starts at its last token
            res.pinned.clear()
            self.option.pop(layer, None)
            return
        current = self.option.get(layer)
        if current is None or not set(chosen[0].tolist()) <= current:
            self._take(layer, res, probs[0], chosen[0])

    def after(self, layer: int, res, chosen: Tensor, probs: Tensor | None) -> None:
        if chosen.shape[0] > 1:
            self._take(layer, res, probs[-1], chosen[-1])

    def predict(
        self, layer: int, res, chosen: Tensor, probs: Tensor | None, config: PrefetchConfig
    ) -> list[int]:
        current = self.option.get(layer)
        if current is None or probs is None:
            return []
        return option_prediction(probs[-1], current, chosen.shape[-1], self.k_hat, config.lookahead)


class ControllerResidency(ResidencyPolicy):
    """Residency = the controller's current option per layer (TE-MoE §3.2: only ω lives in fast memory).

    Its config is its controller's (type ``controller``): ``residency_policy`` makes one of a loaded
    ``ControllerPolicy``."""

    policy_type = "controller"
    pins = True  # the controller's current option stays pinned

    def __init__(self, controller, seed: int = 0) -> None:
        from moectl.options.policy import ControllerPolicy

        path = pending = None
        if isinstance(controller, ControllerPolicy):  # a loaded controller policy: its controller and folder
            controller, path, pending = controller.controller, controller.path, controller.pending
        self.k_hat = controller.k_hat
        self.name = f"controller:{controller.k_hat}"
        self.route_policy = ControllerPolicy(controller, mode="sample", seed=seed, path=path)
        self.route_policy.pending = pending  # trained weights not merged yet: route() merges them
        self.tap = HiddenTap()  # h_t per layer, for the switch prediction

    def to_dict(self) -> dict[str, Any]:
        """Its controller's config (``{"type": "controller", ...}``)."""
        return self.route_policy.to_dict()

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> ControllerResidency:
        from moectl.options.policy import ControllerPolicy

        policy = ControllerPolicy.from_dict(data, info, model=model)
        return cls(policy, seed=policy.seed)

    def min_budget(self, layer: int, top_k: int) -> int:
        return self.k_hat

    def routing(self, info) -> list:
        return [self.route_policy, self.tap]

    def _pin(self, layer: int, res) -> None:
        option = set(self.route_policy.current_option[layer][0].nonzero().flatten().tolist())
        if res.pinned != option:
            res.pinned = option
            for e in sorted(option):
                res.ensure(e)

    def before(self, layer: int, res, chosen: Tensor, probs: Tensor | None) -> None:
        if chosen.shape[0] > 1:  # the prompt: its experts stream through; the option is pinned after it
            res.pinned.clear()
            return
        self._pin(layer, res)

    def after(self, layer: int, res, chosen: Tensor, probs: Tensor | None) -> None:
        if chosen.shape[0] > 1:
            self._pin(layer, res)

    def predict(
        self, layer: int, res, chosen: Tensor, probs: Tensor | None, config: PrefetchConfig
    ) -> list[int]:
        hidden, option = self.tap.hidden.get(layer), self.route_policy.current_option.get(layer)
        if hidden is None or option is None:
            return []
        controller = self.route_policy.controller
        if controller.config.cross_layer and layer > 0:  # one switch decision, MoE layer 0's head
            h0, o0 = self.tap.hidden.get(0), self.route_policy.current_option.get(0)
            if (
                h0 is None
                or o0 is None
                or not controller_prediction(controller.layers[0], h0[0], o0[0], self.k_hat, config.beta)
            ):
                return []
            return controller_prediction(controller.layers[layer], hidden[0], option[0], self.k_hat, None)
        return controller_prediction(controller.layers[layer], hidden[0], option[0], self.k_hat, config.beta)


class CacheResidency(ResidencyPolicy):
    """Residency decided by a replacement policy of ``moectl.residency.caches``: the simulator's
    own cache objects, one per MoE layer, so serving and ``moectl offload simulate`` share one
    implementation (tests/test_residency_runtime.py checks equal hits and misses on a recorded trace).

    At a decoding step the layer's cache serves the token's experts; its victims are moved to the
    front of the resident set's eviction order and the token's resident experts pinned, so the
    loads that follow evict exactly the cache's victims. A prompt (several tokens in one step)
    streams its experts through the slots (LRU, as every policy here), and the cache restarts from
    what is resident after it (in LRU order, fresh metadata). Deviation: the simulator serves a
    prompt token by token, so the two agree on decoding steps, not on the prompt forward.
    """

    cache_name: str = ""
    pins = True  # a decoding token's resident experts, as the cache served them

    def __init__(self) -> None:
        self.name = self.cache_name
        self.caches: dict[int, Any] = {}

    def config_fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> CacheResidency:
        return cls()

    def _new(self, res) -> Any:
        from moectl.residency.caches import ONLINE

        return ONLINE[self.cache_name](res.budget, 0)  # ARC and S3-FIFO never read num_experts

    def _restart(self, layer: int, res) -> Any:
        cache = self.caches[layer] = self._new(res)
        for e in res.where:  # least recently used first
            cache.step([e])
        return cache

    def before(self, layer: int, res, chosen: Tensor, probs: Tensor | None) -> None:
        res.pinned.clear()
        if chosen.shape[0] > 1:  # the prompt streams through; the cache restarts after it
            return
        cache = self.caches.get(layer)
        if cache is None or set(cache.resident) != set(res.where):
            cache = self._restart(layer, res)
        need = chosen[0].tolist()
        before = set(res.where)
        cache.step(need)
        after = cache.resident
        for victim in [e for e in res.where if e not in after][::-1]:
            res.where.move_to_end(victim, last=False)
        res.pinned = {e for e in need if e in before}

    def after(self, layer: int, res, chosen: Tensor, probs: Tensor | None) -> None:
        if chosen.shape[0] > 1:
            self._restart(layer, res)


@register_policy("s3fifo")
class S3FIFOResidency(CacheResidency):
    """S3-FIFO (Yang et al., SOSP 2023): the best heuristic of ``moectl offload simulate`` on both
    reference models' traces at 8 and 16 of 32 experts."""

    cache_name = "s3fifo"


@register_policy("arc")
class ARCResidency(CacheResidency):
    """ARC (Megiddo & Modha, FAST 2003): the second best there."""

    cache_name = "arc"


CACHE_RESIDENCIES = {"s3fifo": S3FIFOResidency, "arc": ARCResidency}


RESIDENCY = "lru, s3fifo, arc, reroute:TOL, pregate, option:K_HAT, static:FILE (or any expert mask / subset file) or a controller"


def residency_policy(policy: Any) -> ResidencyPolicy:
    """The residency policy for what ``moectl.load_policy`` read (an expert mask: ``static``)."""
    from moectl.options.policy import ControllerPolicy
    from moectl.routing.mask import ExpertMask

    if isinstance(policy, (list, tuple)) and len(policy) == 1:
        policy = policy[0]
    if isinstance(policy, ResidencyPolicy):
        return policy
    if isinstance(policy, ExpertMask):
        return StaticPolicy(policy.expert_lists())
    if isinstance(policy, ControllerPolicy):
        return ControllerResidency(policy, seed=policy.seed)
    what = f"a list of {len(policy)} policies" if isinstance(policy, (list, tuple)) else type(policy).__name__
    raise ConfigError(f"serve-offload needs one residency policy ({RESIDENCY}); got {what}")


def parse_policy(spec: Any, model: nn.Module | None = None) -> ResidencyPolicy:
    """``lru`` | ``s3fifo`` | ``arc`` | ``reroute:TOL`` | ``pregate`` | ``static:SUBSET.json`` | ``option:K_HAT`` | ``controller:DIR`` | any
    policy file or folder.

    ``model`` is needed for a trained controller (its adapters merge into it) and for masks that
    name experts with ``everywhere``.
    """
    from moectl.routing.policy_files import load_policy

    if isinstance(spec, str) and spec in CACHE_RESIDENCIES:
        return CACHE_RESIDENCIES[spec]()
    if spec == "pregate":
        from moectl.offload.pregate import PregateResidency

        return PregateResidency()
    if isinstance(spec, str) and spec.startswith("reroute:"):
        from moectl.offload.reroute import parse_reroute

        return parse_reroute(spec)
    return residency_policy(load_policy(spec, model))
