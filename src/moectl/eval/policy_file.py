"""``--policy FILE``: routing policies for an evaluation — any file ``moectl.load_policy`` reads.

A file holds one policy object or a list of them (composed in order, as ``route()`` does)::

    {"type": "expert_mask", "experts": {"0": [0, 1, 2, 3], "2": [4, 5, 6, 7]}, "renorm": "pruned"}
    {"type": "expert_mask", "everywhere": [0, 1, 2, 3]}            # same experts at every MoE layer
    {"type": "gumbel", "tau": 0.3, "seed": 0}                       # tau: number, list or {layer: tau}
    {"type": "document_pool", "d": 4, "mode": "causal"}

and every other form of ``routing/policy_files.py``: a subset file (``moectl subset select``,
``moectl baselines --out``), a RoE tau profile, a controller folder, ``option:8``. Keys of
``experts`` are MoE layer indices (0 … number of MoE layers − 1); layers not named allow every
expert. This module keeps the evaluation's view: :func:`setup_routing` turns ``--policy``,
``--roe`` and ``--controller`` (or lm-eval's ``policy=``, ``roe=``, ``controller=`` model_args)
into the routing policies bound to the model, the RoE config and the routing plan — one setup for
``moectl eval`` and ``lm_eval --model moectl`` — and the mean number of experts a fixed mask allows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.ensemble.roe_config import RoEConfig, parse_roe_spec
from moectl.errors import ConfigError
from moectl.eval.forward import RoutingPlan, static_plan
from moectl.routing import ExpertMask, load_policy
from moectl.routing.policy_config import PolicyConfig, policy_types
from moectl.routing.policy_files import routing_policies
from moectl.routing.routing_state import Policy

POLICY_TYPES = tuple(policy_types())


def policy_from_dict(spec: dict[str, Any], info: ModelInfo, where: str = "policy") -> Policy:
    """One policy from its JSON object (``ValueError`` naming the field and the allowed values)."""
    try:
        return load_policy(spec, info)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None


def load_policies(path: str | os.PathLike, info: ModelInfo) -> tuple[list[Policy], list[dict[str, Any]]]:
    """Routing policies of a policy file, bound-checked against ``info``; also their configs."""
    loaded = load_policy(os.fspath(path), info)
    loaded = loaded if isinstance(loaded, list) else [loaded]
    policies = bind_all(routing_policies(loaded, None, info), info, path)
    return policies, [p.to_dict() for p in loaded]


def bind_all(policies: list[Policy], info: ModelInfo, where: Any) -> list[Policy]:
    """Bind each policy now, so that a mismatch fails naming the file rather than inside the harness."""
    for policy in policies:
        try:
            policy.bind(info)
        except ValueError as err:
            raise ConfigError(f"{where}: {err}") from None
    return policies


def evaluation_routing(
    loaded: list[Any], info: ModelInfo, roe: RoEConfig | None, seed: int, where: Any
) -> tuple[list[Policy], RoEConfig | None, dict[str, Any] | None]:
    """Split loaded policies into (routing policies, RoE config, controller summary) for ``moectl eval``.

    A RoE profile becomes the evaluation's RoE config (as ``--roe``); controllers and RoE are
    seeded with the evaluation's ``--seed`` (as ``--controller`` and ``--roe`` are); residency
    policies contribute their routing (``static``: its mask; ``lru``, ``option``: none).
    """
    policies: list[Policy] = []
    controller = None
    for policy in loaded:
        kind = policy.policy_type if isinstance(policy, PolicyConfig) else None
        if kind == "roe":
            if roe is not None:
                raise ConfigError(f"{where}: a RoE config is given twice (--roe and --policy); give one")
            roe = policy.with_(seed=seed)
            continue
        if kind == "controller":
            policy.reset(seed=seed)
            controller = {
                "path": str(policy.path),
                "k_hat": policy.controller.k_hat,
                "eta": policy.options.get("eta"),
            }
        policies += routing_policies([policy], None, info)
    return bind_all(policies, info, where), roe, controller


def experts_allowed(policies: list[Policy], info: ModelInfo) -> float | None:
    """Mean number of allowed experts per MoE layer under the fixed masks (None without a mask)."""
    masks = [p for p in policies if isinstance(p, ExpertMask)]
    if not masks:
        return None
    counts = []
    for layer in info.layers:
        allowed = None
        for mask in masks:
            m = mask.masks.get(layer.index)
            if m is not None and m.dim() == 1:
                allowed = m if allowed is None else allowed & m
        counts.append(layer.num_experts if allowed is None else int(allowed.sum()))
    return sum(counts) / len(counts)


@dataclass
class EvalRouting:
    """An evaluation's routing: policies bound to the model, RoE config, controller summary, plan."""

    policies: list[Policy]
    roe: RoEConfig | None
    controller: dict[str, Any] | None
    specs: list[dict[str, Any]] = field(default_factory=list)  # the policy file's configs
    label: str = "full"
    info: ModelInfo | None = None

    @property
    def plan(self) -> RoutingPlan:
        return static_plan(self.policies, self.roe)


def check_routing_args(
    roe: str | RoEConfig | None, controller: str | os.PathLike | None, seed: int
) -> RoEConfig | None:
    """Check ``roe`` and ``controller`` before any model is loaded; returns the parsed RoE config."""
    if controller is not None:
        from moectl.options.option_state import check_controller_dir

        check_controller_dir(controller)
    if roe is None or isinstance(roe, RoEConfig):
        return roe
    return parse_roe_spec(str(roe), seed)


def setup_routing(
    model: nn.Module,
    policy: Any = None,
    roe: str | RoEConfig | None = None,
    controller: str | os.PathLike | None = None,
    seed: int = 1234,
) -> EvalRouting:
    """The routing of an evaluation of ``model``.

    ``policy``: anything ``moectl.load_policy`` reads (a file, a folder, ``option:K``, a dict, a
    list); ``roe``: a tau profile path, ``K=16,tau=0.3`` or a RoEConfig; ``controller``: a
    controller folder (TE-MoE: adapters and trained routers merged into the model, per-sequence
    option state). Controllers and RoE are seeded with ``seed``.
    """
    roe_cfg = check_routing_args(roe, controller, seed)
    loaded = (
        load_policy(policy if isinstance(policy, (dict, list)) else os.fspath(policy), model)
        if policy is not None
        else []
    )
    from_file = list(loaded) if isinstance(loaded, list) else [loaded]
    specs = [p.to_dict() for p in from_file]
    if controller is not None:
        from_file.append(load_policy({"type": "controller", "path": str(controller)}, model))
    info = inspect(model)
    where = policy if policy is not None else controller
    policies, roe_cfg, controller_info = evaluation_routing(from_file, info, roe_cfg, seed, where)
    parts = (
        [Path(str(policy)).stem] if isinstance(policy, (str, os.PathLike)) else (["policy"] if policy else [])
    )
    parts += ["controller"] if controller else []
    parts += [f"roe-K{roe_cfg.K}"] if roe_cfg is not None else []
    return EvalRouting(policies, roe_cfg, controller_info, specs, "+".join(parts) or "full", info)
