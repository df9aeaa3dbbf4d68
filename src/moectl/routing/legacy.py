"""The readers of earlier file formats, in one module: policy files written before every policy had a
``"type"`` (``routing/policy_config.py``), recognised by their fields.

- ``{"keep": {layer: [ids]}}``: subset files (``subset select``, ``baselines --out``/``--json``, an
  exported model's ``moectl_subset.json``) -> ``expert_mask``; ``{"keep": null, "method": "random",
  "k_hat": K}`` (``baselines --json`` of the random baseline) -> ``random_options``;
- ``{"tau": [...]}``: RoE tau profiles -> ``roe``;
- ``{"subsets": {...}}`` or a bare ``{"moe_layer": [experts]}`` (``serve-offload --policy
  static:FILE``'s files) -> ``expert_mask``.

``load_policy`` (``routing/policy_files.py``) reads every file through :func:`normalise`;
:func:`check_subset_layers` keeps the rule ``subset export`` applies to subset files.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moectl.errors import ConfigError
from moectl.routing.policy_config import policy_types


def normalise(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with a ``"type"``: older files (no type) are recognised by their fields."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"each policy must be a JSON object, got {type(data).__name__}")
    if "type" in data:
        return dict(data)
    if "keep" in data:
        if data["keep"] is None and data.get("method") == "random" and "k_hat" in data:
            return {"type": "random_options", "k_hat": data["k_hat"], "seed": data.get("seed", 0)}
        return {"type": "expert_mask", **data}
    if "tau" in data:
        return {"type": "roe", **data}
    if isinstance(data.get("subsets"), Mapping):
        return {"type": "expert_mask", "experts": data["subsets"]}
    if data and all(str(k).strip().isdigit() and isinstance(v, list) for k, v in data.items()):
        return {"type": "expert_mask", "experts": dict(data)}
    raise ConfigError(
        f'a policy needs a "type" (one of {", ".join(policy_types())}); without one moectl reads older '
        'files: a subset file ({"keep": {layer: [ids]}}), a tau profile ({"tau": [...]}) or a '
        f'{{"moe_layer": [experts]}} mapping; got fields {sorted(data)}'
    )


def check_subset_layers(data: Any, info, path: Path) -> None:
    """A subset file (an expert mask spelled ``keep``, as ``subset select`` writes) must list every MoE
    layer, the rule ``subset export`` applies: a layer it leaves out would run unmasked, silently.
    (A policy meant for some layers only spells its lists ``experts``.) Also warns when the file
    records another expert count than the model's (chosen on another model)."""
    if info is None or not isinstance(data, Mapping) or data.get("type", "expert_mask") != "expert_mask":
        return
    keep = data.get("keep")
    if not isinstance(keep, Mapping) or not keep:
        return
    listed = {int(k) for k in keep if str(k).lstrip("-").isdigit()}
    missing = [layer.index for layer in info.layers if layer.index not in listed]
    if missing:
        raise ConfigError(
            f"subset file {path} lists MoE layers {sorted(listed)} of 0..{info.num_moe_layers - 1}: a subset keeps "
            f"experts in every MoE layer (as `moectl subset export` requires; missing {missing}); for a policy "
            "on some layers only, name the lists 'experts' instead of 'keep'"
        )
    recorded = data.get("num_experts")
    if isinstance(recorded, int) and recorded != info.num_experts:
        warnings.warn(
            f"subset file {path} was chosen on {data.get('model') or 'a model'} with {recorded} experts per "
            f"MoE layer; this model has {info.num_experts}",
            stacklevel=3,
        )
