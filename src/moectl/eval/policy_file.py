"""``--policy FILE``: routing policies for an evaluation, as JSON.

A file holds one policy object or a list of them (composed in order, as ``route()`` does)::

    {"type": "expert_mask", "experts": {"0": [0, 1, 2, 3], "2": [4, 5, 6, 7]}, "renorm": "pruned"}
    {"type": "expert_mask", "everywhere": [0, 1, 2, 3]}            # same experts at every MoE layer
    {"type": "gumbel", "tau": 0.3, "seed": 0}                       # tau: number, list or {layer: tau}
    {"type": "document_pool", "d": 4, "mode": "causal"}

Keys of ``experts`` are MoE layer indices (0 … number of MoE layers − 1); layers not named allow
every expert. An exported expert subset is an ``expert_mask``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moectl.adapters.inspect import ModelInfo
from moectl.routing import DocumentPool, ExpertMask, GumbelTopK
from moectl.routing.state import Policy

POLICY_TYPES = ("expert_mask", "gumbel", "document_pool")


def policy_from_dict(spec: dict[str, Any], info: ModelInfo, where: str = "policy") -> Policy:
    """One policy from its JSON object (``ValueError`` naming the field and the allowed values)."""
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: each policy must be a JSON object, got {type(spec).__name__}")
    kind = spec.get("type")
    if kind == "expert_mask":
        renorm = spec.get("renorm", "pruned")
        if ("experts" in spec) == ("everywhere" in spec):
            raise ValueError(
                f"{where}: an expert_mask needs exactly one of 'experts' ({{layer: [ids]}}) or 'everywhere' ([ids])"
            )
        if "everywhere" in spec:
            return ExpertMask.everywhere(info, spec["everywhere"], renorm=renorm)
        try:
            experts = {int(layer): ids for layer, ids in spec["experts"].items()}
        except (AttributeError, ValueError) as err:
            raise ValueError(f"{where}: 'experts' must map MoE layer indices to lists of expert ids") from err
        return ExpertMask.from_lists(info, experts, renorm=renorm)
    if kind == "gumbel":
        if "tau" not in spec:
            raise ValueError(f"{where}: a gumbel policy needs 'tau'")
        tau = spec["tau"]
        if isinstance(tau, dict):
            tau = {int(k): float(v) for k, v in tau.items()}
        return GumbelTopK(tau, seed=int(spec.get("seed", 0)))
    if kind == "document_pool":
        if "d" not in spec:
            raise ValueError(f"{where}: a document_pool policy needs 'd' (pool size)")
        return DocumentPool(int(spec["d"]), mode=spec.get("mode", "causal"))
    raise ValueError(f"{where}: unknown policy type {kind!r}; allowed: {', '.join(POLICY_TYPES)}")


def load_policies(path: str | os.PathLike, info: ModelInfo) -> tuple[list[Policy], list[dict[str, Any]]]:
    """Policies of a policy file, bound-checked against ``info``; also returns the raw specs."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"policy file {path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from err
    specs = raw if isinstance(raw, list) else [raw]
    if not specs:
        raise ValueError(f"{path}: the policy list is empty")
    policies = [policy_from_dict(s, info, where=f"{path} [{i}]") for i, s in enumerate(specs)]
    for policy in policies:
        policy.bind(info)  # fail now, with the file named, rather than inside the harness
    return policies, specs


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
