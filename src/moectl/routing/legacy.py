"""The readers of earlier file formats, in one module: policy files written before every policy had a
``"type"`` (``routing/policy_config.py``), recognised by their fields.

- ``{"keep": {layer: [ids]}}``: subset files (``subset select``, ``baselines --out``/``--json``, an
  exported model's ``moectl_subset.json``) -> ``expert_mask``; ``{"keep": null, "method": "random",
  "k_hat": K}`` (``baselines --json`` of the random baseline) -> ``random_options``;
- ``{"tau": [...]}``: RoE tau profiles -> ``roe``;
- ``{"subsets": {...}}`` or a bare ``{"moe_layer": [experts]}`` (``serve-offload --policy
  static:FILE``'s files) -> ``expert_mask``.

``load_policy`` (``routing/policy_files.py``) reads every file through :func:`normalise`;
:func:`check_subset_layers` and :func:`check_expert_count` keep the rules ``subset export`` applies
to subset files (a file made for another model: ``routing/made_for.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from moectl.errors import ConfigError, FileFormatError
from moectl.routing.made_for import check_made_for
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


def check_subset_layers(data: Any, info, path: Path, model: Any = None) -> None:
    """A subset file (an expert mask spelled ``keep``, as ``subset select`` writes) must list every MoE
    layer, the rule ``subset export`` applies: a layer it leaves out would run unmasked, silently.
    (A policy meant for some layers only spells its lists ``experts``.) An expert mask that records
    another model (another expert count, or another ``model`` than ``model``'s: the rule ``subset
    export`` applies too) is refused first, naming both (``moectl.routing.made_for``); under
    ``--force`` it applies as it is, on the layers it lists. A list is checked item by item."""
    if isinstance(data, list):
        for item in data:
            check_subset_layers(item, info, path, model)
        return
    if not isinstance(data, Mapping) or data.get("type", "expert_mask") not in ("expert_mask", "static"):
        return
    check_expert_count(data, path)  # a positive integer or null
    if "keep" in data and data["keep"] is None:  # the random baseline: no expert ids of any model
        return
    if check_made_for(data, path, info, model, "subset file" if "keep" in data else "expert mask"):
        return  # made for another model, applied anyway (--force)
    keep = data.get("keep")
    if info is None or not isinstance(keep, Mapping) or not keep:
        return
    listed = {int(k) for k in keep if str(k).lstrip("-").isdigit()}
    missing = [layer.index for layer in info.layers if layer.index not in listed]
    if missing:
        raise ConfigError(
            f"subset file {path} lists MoE layers {sorted(listed)} of 0..{info.num_moe_layers - 1}: a subset keeps "
            f"experts in every MoE layer (as `moectl subset export` requires; missing {missing}); for a policy "
            "on some layers only, name the lists 'experts' instead of 'keep'"
        )


def check_expert_count(
    data: Mapping[str, Any], path: str | Path, counts: Iterable[int] | None = None
) -> None:
    """Refuse the subset file or expert mask ``data`` (read from ``path``) when its ``num_experts`` (the
    experts per MoE layer of the model it was made for; null or absent: not recorded) is not a positive
    integer, or is none of ``counts`` (the experts per MoE layer of the model or trace it is used on): its
    expert ids would name other experts than the ones it was chosen as."""
    recorded = data.get("num_experts")
    if recorded is None or ("keep" in data and data["keep"] is None):  # not recorded; a random baseline
        return
    if isinstance(recorded, bool) or not isinstance(recorded, int) or recorded < 1:
        raise FileFormatError(
            f'subset file {path}: "num_experts" must be a positive integer (the experts per MoE layer of '
            f"the model it was made for) or null, got {recorded!r}"
        )
    counts = sorted(set(counts)) if counts is not None else [recorded]
    if recorded not in counts:
        made_on = f" ({data['model']})" if isinstance(data.get("model"), str) else ""
        raise ConfigError(
            f"subset file {path} was made for another model{made_on}: it records {recorded} experts per MoE "
            f"layer, this model has {' or '.join(map(str, counts))}; select a subset on this model "
            "(`moectl subset select`)"
        )
