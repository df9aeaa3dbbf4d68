"""``--policy FILE``: routing policies for an evaluation — any file ``moectl.load_policy`` reads.

A file holds one policy object or a list of them (composed in order, as ``route()`` does)::

    {"type": "expert_mask", "experts": {"0": [0, 1, 2, 3], "2": [4, 5, 6, 7]}, "renorm": "pruned"}
    {"type": "expert_mask", "everywhere": [0, 1, 2, 3]}            # same experts at every MoE layer
    {"type": "gumbel", "tau": 0.3, "seed": 0}                       # tau: number, list or {layer: tau}
    {"type": "document_pool", "d": 4, "mode": "causal"}

and every other form of ``routing/loader.py``: a subset file (``moectl subset select``,
``moectl baselines --out``), a RoE tau profile, a controller folder, ``option:8``. Keys of
``experts`` are MoE layer indices (0 … number of MoE layers − 1); layers not named allow every
expert. This module keeps the evaluation's view: the routing policies bound to the model, and
the mean number of experts a fixed mask allows.
"""

from __future__ import annotations

import os
from typing import Any

from moectl.adapters.inspect import ModelInfo
from moectl.roe.config import RoEConfig
from moectl.routing import ExpertMask, load_policy
from moectl.routing.config import policy_types
from moectl.routing.loader import routing_policies
from moectl.routing.state import Policy

POLICY_TYPES = tuple(policy_types())


def policy_from_dict(spec: dict[str, Any], info: ModelInfo, where: str = "policy") -> Policy:
    """One policy from its JSON object (``ValueError`` naming the field and the allowed values)."""
    try:
        return load_policy(spec, info)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


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
            raise ValueError(f"{where}: {err}") from None
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
        kind = getattr(policy, "policy_type", None)
        if kind == "roe":
            if roe is not None:
                raise ValueError(f"{where}: a RoE config is given twice (--roe and --policy); give one")
            roe = policy.with_(seed=seed)
            continue
        if kind == "controller":
            policy.reset(seed=seed)
            controller = {"path": str(policy.path), "k_hat": policy.controller.k_hat, "eta": policy.options.get("eta")}
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
