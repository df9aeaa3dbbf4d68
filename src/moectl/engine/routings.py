"""Named routings a request may pick: what each name resolves to, and the policies one request gets.

A routing is anything ``moectl.load_policy`` reads — an expert-mask or subset file, a policy file,
``option:K``, ``controller:DIR`` or a controller folder, a list of them — or a policy object.
Policies with per-sequence state (``SequencePolicy``: a controller, a document pool, Gumbel noise)
are forked for each request; the others are shared by every request that names the routing.

Names, not paths, reach the engine from a request: a server registers the routings it offers and
a request can only pick among them. In process a caller may also hand ``Engine.submit`` /
``Engine.generate`` a ``Routing`` object of its own (``Routing.of``): evaluation builds one per request
(request-keyed noise, ``repeats`` routed copies averaged, RoE), never reachable from HTTP.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import ConfigError
from moectl.routing.policy_config import PolicyConfig
from moectl.routing.protocols import Policy, SequencePolicy, carries_weights, renorm_of

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")


@dataclass
class Routing:
    """One registered routing: its name, the spec it came from, its (bound) policies."""

    name: str
    spec: str
    policies: list[Policy] = field(default_factory=list)
    changes_model: bool = False  # merged trained weights (a controller's adapters/routers) into the model
    roe: Any = None  # a RoEConfig: K routing samples per token, averaged (RoE §2), instead of policies
    adaptive: float | None = None  # with ``roe``: adaptive K's clean-entropy threshold (nats; roe.adaptive)
    repeats: int = 1  # K routed copies per request (K rows), distributions averaged (engine/repeats.py)
    owned: bool = False  # the policies already belong to one request: used as they are, never forked
    # Draws keyed by request (eval's request-keyed noise): this request's code per row [repeats].
    # Requests whose routings hold one ``policies`` list then share one group of rows (one policy
    # call per layer for all of them), each row drawing with its own code and position.
    row_codes: Any = None
    # the name its figures are kept under (switch rates, expert counts, /metrics labels): the
    # routing's own unless set — a server's inline routings share "inline", keeping label sets bounded
    label: str | None = None

    @property
    def stats_name(self) -> str:
        return self.label or self.name

    def __post_init__(self) -> None:
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ConfigError(f"routing {self.name!r}: repeats must be an integer >= 1, got {self.repeats!r}")
        if self.roe is not None and self.repeats != 1:
            raise ConfigError(f"routing {self.name!r}: give repeats (independent copies) or roe, not both")
        if self.row_codes is not None and (not self.owned or tuple(self.row_codes.shape) != (self.repeats,)):
            raise ConfigError(f"routing {self.name!r}: row_codes needs owned policies and one code per copy")

    @classmethod
    def of(
        cls,
        policies: list[Policy],
        *,
        name: str = "call",
        repeats: int = 1,
        roe: Any = None,
        owned: bool = False,
        row_codes: Any = None,
    ) -> Routing:
        """A caller's own routing of bound policy objects (not registered; in process only).
        ``owned``: the policies are one request's (its own forks / keyed copies), used as they are,
        or (with ``row_codes``) a list of keyed policies shared by requests: pass the same list
        object to each request's routing and they batch in one group."""
        items = policies if owned and isinstance(policies, list) else list(policies)
        return cls(name, "policies", items, roe=roe, repeats=int(repeats), owned=owned, row_codes=row_codes)

    @property
    def per_request(self) -> bool:
        """Whether requests get their own fork (some policy keeps sequence state)."""
        return any(isinstance(p, SequencePolicy) for p in self.policies)

    def for_request(self, seed: int, info: ModelInfo) -> list[Policy]:
        """The policies one request routes with: stateful ones forked with ``seed`` and bound."""
        if self.owned or not self.per_request:
            return self.policies
        out = []
        for policy in self.policies:
            if isinstance(policy, SequencePolicy):
                policy = policy.fork(seed)
                policy.bind(info)
            out.append(policy)
        return out


def resolve(name: str, spec: Any, model: nn.Module, info: ModelInfo) -> Routing:
    """The routing ``spec`` describes for ``model``, checked against it (``ValueError`` if not)."""
    from moectl.routing.policy_files import routing_policies

    if not NAME.match(name):
        raise ConfigError(
            f"routing name {name!r} must be 1-64 letters, digits, '_', '.', ':' or '-', starting with a "
            "letter or digit"
        )
    roe = _roe_config(spec)
    if roe is not None:
        roe.taus(info.num_moe_layers)  # checks tau's length against the model
        return Routing(name, spec if isinstance(spec, str) else "roe", [], False, roe)
    _refuse_residency(name, spec, info)
    changes_model = _carries_weights(spec, info)
    policies = routing_policies([spec], model, info)
    renorms = {renorm_of(p) for p in policies}
    if len(renorms) > 1:
        raise ConfigError(f"routing {name!r} mixes renormalisation modes {sorted(renorms)}")
    for policy in policies:
        policy.bind(info)
    label = spec if isinstance(spec, str) else type(spec).__name__
    return Routing(name, str(label), list(policies), changes_model)


def _roe_config(spec: Any) -> Any:
    """The RoEConfig ``spec`` is (a RoE profile file, dict or config), else None."""
    if isinstance(spec, PolicyConfig) and spec.policy_type == "roe":
        return spec
    if not isinstance(spec, (str, Mapping)) and not isinstance(spec, os.PathLike):
        return None
    from moectl.routing.policy_files import load_policy

    try:
        loaded = load_policy(spec)
    except (ValueError, OSError, TypeError, KeyError):
        return None  # not loadable without the model: not a RoE profile (the real load says why)
    return loaded if isinstance(loaded, PolicyConfig) and loaded.policy_type == "roe" else None


def _carries_weights(spec: Any, info: ModelInfo) -> bool:
    """Whether loading ``spec`` merges trained weights into the model (a trained controller's
    LoRA adapters and routers: ``ControllerPolicy.pending``)."""
    return any(carries_weights(item) for item in _loaded(spec, info))


def _loaded(spec: Any, info: ModelInfo) -> list[Any]:
    """What ``spec`` loads to without the model (a policy object: itself), as a list; [] when it
    does not load so (the real load, with the model, reports what is wrong)."""
    from moectl.routing.policy_files import load_policy

    if not isinstance(spec, (str, Mapping, list, tuple)) and not isinstance(spec, os.PathLike):
        return [spec]
    try:
        loaded = load_policy(spec, info)
    except (ValueError, OSError, TypeError, KeyError):
        return []
    return list(loaded) if isinstance(loaded, (list, tuple)) else [loaded]


ROUTING_RESIDENCIES = frozenset({"option", "static"})
"""Residency policy types that are also a routing a request can pick: ``option:K`` counts a
request's switches with options of K experts, ``static`` masks each layer to its set. The others
(lru, s3fifo, arc, reroute, pregate) decide what stays resident under a budget, which one request
cannot: as a routing they did nothing (reroute needs the server's resident sets)."""


def _refuse_residency(name: str, spec: Any, info: ModelInfo) -> None:
    """``ConfigError`` for a spec that is a residency policy and no routing (reroute, lru, ...)."""
    for item in _loaded(spec, info):
        kind = getattr(item, "policy_type", "")
        if callable(getattr(item, "min_budget", None)) and kind and kind not in ROUTING_RESIDENCIES:
            raise ConfigError(
                f"routing {name!r}: a {kind!r} policy decides which experts stay resident under a budget, "
                f"which one request cannot pick; serve it with --residency (and --budget), not as a routing"
            )


def resolve_all(specs: Mapping[str, Any] | None, model: nn.Module, info: ModelInfo) -> dict[str, Routing]:
    """Every named routing, checked before any is loaded into the model; one renormalisation mode
    across them (the rows of a batch are selected with one mode)."""
    specs = dict(specs or {})
    merging = [name for name, spec in specs.items() if _carries_weights(spec, info)]
    if merging and len(specs) > 1:
        raise ConfigError(
            f"routing {merging[0]!r} merges a controller's trained adapters and routers into the model, "
            "which every request would then run with; register it alone (requests without a routing then "
            "also run the merged weights), or serve its model separately"
        )
    routings = {name: resolve(name, spec, model, info) for name, spec in specs.items()}
    renorms = {renorm_of(p) for r in routings.values() for p in r.policies}
    if len(renorms) > 1:
        raise ConfigError(
            f"the registered routings mix renormalisation modes {sorted(renorms)}; rows of one batch are "
            "selected with one mode: register routings of one mode"
        )
    return routings
