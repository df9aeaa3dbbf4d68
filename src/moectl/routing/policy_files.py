"""``load_policy``: one reader for every policy — a file, a folder, a dict, a list or a short string.

    load_policy("math.subset.json", model)     # an expert mask (a subset file is one)
    load_policy("profile.json")                # a RoE tau profile (RoEConfig)
    load_policy("runs/ctrl", model)            # a trained controller; its adapters merge into model
    load_policy([{"type": "document_pool", "d": 4}, {"type": "gumbel", "tau": 0.3}], model)
    load_policy("option:8") | load_policy("lru") | load_policy("static:FILE") | load_policy("controller:DIR")

What each argument may be:

- a policy object: returned as it is;
- a dict with a ``"type"`` (see ``routing/policy_config.py``), or an older file's object without one
  (recognised by ``routing/legacy.py``):
  ``{"keep": {...}}`` (subset files, ``subset select --json``, ``baselines --out``/``--json``,
  an exported model's ``moectl_subset.json``), ``{"keep": null, "method": "random", "k_hat": K}``
  (``baselines --json`` of the random baseline), ``{"tau": [...]}`` (RoE tau profiles, with or
  without ``"format": "moectl-roe-profile/1"``), ``{"subsets": {...}}`` or a bare
  ``{"moe_layer": [experts]}`` (``serve-offload --policy static:FILE``'s files);
- a list: a composition, applied in order (as ``route()`` applies a list) — returned as a list;
- a path to a JSON file holding any of these; relative ``"path"`` fields resolve against its folder;
- a folder: its ``policy.json``, else a controller (``controller.json`` in it or in its
  ``final/``, as ``moectl options train`` writes), else an exported subset's ``moectl_subset.json``;
- a string holding JSON (starting with ``{`` or ``[``): read as a policy file's contents;
- ``topk:N`` (N experts per token: ``routing/top_k.py``);
- ``lru``, ``option:K_HAT``, ``static:FILE`` (FILE's expert mask kept resident),
  ``controller:DIR`` — the residency policies of ``moectl serve-offload``.

``model_or_info`` is the model (or its ``ModelInfo``) the policy is for: needed where the file
alone does not say enough (an expert list needs the number of experts). A trained controller's
LoRA adapters and routers are merged into the model, in place: here when the model is given,
else when the policy first enters ``route(model, ...)``. Errors are ``ValueError`` (or
``FileNotFoundError``) naming the file, the field and what is allowed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.errors import ConfigError, FileFormatError, MoectlFileError
from moectl.routing.legacy import check_subset_layers, normalise
from moectl.routing.made_for import MadeForAnotherModelError
from moectl.routing.policy_config import PolicyConfig, check_version, policy_class
from moectl.routing.protocols import MergingPolicy, RoutingPolicy, RoutingSource

PolicySpec = Any  # str | os.PathLike | Mapping | Sequence | a policy object
SHORT_FORMS = "lru, option:K_HAT, topk:N, static:FILE, controller:DIR"


def load_policy(spec: PolicySpec, model_or_info: nn.Module | ModelInfo | None = None) -> Any:
    """The policy (or, for a list, the policies in order) that ``spec`` describes; see the module doc."""
    model, info = _target(model_or_info)
    return _load(spec, model, info, base=None, where=None)


def routing_policies(
    specs: Sequence[Any], model: nn.Module | None, info: ModelInfo | None = None
) -> list[Any]:
    """What ``route()`` installs for ``specs``: files/dicts/strings loaded, lists flattened, residency
    policies replaced by the routing they need (``policy.routing(info)``). A RoE config is refused:
    it is K routings at once, not one."""
    out: list[Any] = []
    for spec in specs:
        if _is_spec(spec) and info is None and model is not None:
            info = inspect(model)
        item = _load(spec, model, info, None, None) if _is_spec(spec) else spec
        if isinstance(item, (list, tuple)):
            out += routing_policies(item, model, info)
        elif isinstance(item, PolicyConfig) and item.policy_type == "roe":
            raise ConfigError(
                "a RoE config is an ensemble of K routings (RoE §2.3), not one routing policy: use "
                "moectl.roe.score / moectl.roe.generate, or `moectl eval --roe`"
            )
        elif isinstance(item, RoutingPolicy):
            if isinstance(item, MergingPolicy) and model is not None:
                item.attach(model)  # a controller loaded without its model: trained weights merge in now
            out.append(item)
        elif isinstance(item, RoutingSource):
            if info is None:
                info = inspect(model)
            out += routing_policies(list(item.routing(info)), model, info)
        else:
            raise TypeError(f"{type(item).__name__} is not a routing policy (needs bind() and apply())")
    return out


# -- dispatch -------------------------------------------------------------------------------------
def _is_spec(spec: Any) -> bool:
    return isinstance(spec, (str, os.PathLike, Mapping, list, tuple))


def _target(model_or_info: Any) -> tuple[nn.Module | None, ModelInfo | None]:
    if model_or_info is None:
        return None, None
    if isinstance(model_or_info, ModelInfo):
        return None, model_or_info
    if isinstance(model_or_info, nn.Module):
        return model_or_info, inspect(model_or_info)
    raise TypeError(f"model_or_info must be a model or a ModelInfo, got {type(model_or_info).__name__}")


def _load(spec: Any, model, info, base: Path | None, where: str | None) -> Any:
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ConfigError(f"{where or 'policy'}: the policy list is empty")
        return [_load(s, model, info, base, f"{where or 'policy'} [{i}]") for i, s in enumerate(spec)]
    if isinstance(spec, Mapping):
        return _from_dict(spec, model, info, base, where)
    if isinstance(spec, os.PathLike):
        return _from_path(Path(spec), model, info)
    if isinstance(spec, str):
        return _from_string(spec, model, info)
    if isinstance(spec, (PolicyConfig, RoutingPolicy, RoutingSource)):
        return spec
    raise TypeError(
        f"cannot load a policy from {type(spec).__name__}: give a path, a dict, a list or one of {SHORT_FORMS}"
    )


def _from_dict(data: Mapping[str, Any], model, info, base: Path | None, where: str | None) -> Any:
    try:
        data = normalise(data)
        cls = policy_class(data["type"])
        check_version(data, cls)
        if base is not None and isinstance(data.get("path"), str) and not Path(data["path"]).is_absolute():
            data = {**data, "path": str(base / data["path"])}
        return cls.from_dict(data, info, model=model)
    except ValueError as err:
        if where is None:
            raise
        kind = MadeForAnotherModelError if isinstance(err, MadeForAnotherModelError) else ConfigError
        raise kind(f"{where}: {err}") from None


def read_policy_json(path: Path, what: str = "policy file") -> Any:
    """The JSON value of ``path``: the one reader of policy and subset files (``load_policy``,
    ``moectl.subsets.load_subset``, ``static:FILE``). Every way a file can fail to be read — missing,
    a folder, unreadable, not UTF-8, not JSON — is a ``MoectlError`` naming the file (as ``what``
    ``path``), what is wrong and what is allowed: one ``error:`` line on the command line."""
    path = Path(path)
    if not path.exists():
        raise MoectlFileError(f"{what} {path} does not exist")
    if path.is_dir():
        raise MoectlFileError(f"{what} {path} is a folder: give a JSON file{_folder_hint(path)}")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise MoectlFileError(f"{what} {path} cannot be read: {err.strerror or err}") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise FileFormatError(
            f"{what} {path}: not valid JSON (not UTF-8 text: {err.reason} at byte {err.start}); "
            "policy and subset files are UTF-8 JSON"
        ) from None
    except json.JSONDecodeError as err:
        raise FileFormatError(f"{what} {path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except RecursionError:
        raise FileFormatError(f"{what} {path}: not valid JSON (nested too deeply)") from None


def _folder_hint(path: Path) -> str:
    """Where the file a folder stands for is, when it is one moectl writes."""
    for name in ("moectl_subset.json", "policy.json"):
        if (path / name).is_file():
            return f" (this folder's is {path / name})"
    return ""


# what a malformed field raises deep inside a policy's reader (a wrong JSON type where a number,
# a list or an object was meant): reported as a ValueError naming the file, like every other error
_MALFORMED = (TypeError, KeyError, IndexError, AttributeError, OverflowError, RuntimeError)


def _from_path(path: Path, model, info) -> Any:
    if not path.exists():
        raise MoectlFileError(f"policy {path} does not exist (expected a policy JSON file or a folder)")
    try:
        if path.is_dir():
            return _from_folder(path, model, info)
        data = read_policy_json(path)
        check_subset_layers(data, info, path, model)
        if not isinstance(data, (Mapping, list)):
            raise ConfigError(
                f"{path}: a policy file holds a JSON object (or a list of them), got {json.dumps(data)[:40]}"
            )
        return _load(data, model, info, path.parent, str(path))
    except _MALFORMED as err:
        detail = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(
            f"{path}: not a policy moectl can read ({type(err).__name__}: {detail[:200]}); "
            "see moectl.load_policy for the forms a policy file takes"
        ) from err


def _from_folder(path: Path, model, info) -> Any:
    if (path / "policy.json").exists():
        return _from_path(path / "policy.json", model, info)
    if (path / "controller.json").exists() or (path / "final" / "controller.json").exists():
        return _from_dict({"type": "controller", "path": str(path)}, model, info, None, str(path))
    if (path / "moectl_subset.json").exists():
        return _from_path(path / "moectl_subset.json", model, info)
    raise ConfigError(
        f"{path}: a folder with no policy in it; expected policy.json, a controller (controller.json, as "
        "`moectl options train` writes, in it or in its final/) or an exported subset's moectl_subset.json"
    )


def _from_string(spec: str, model, info) -> Any:
    if spec.lstrip().startswith(("{", "[")):  # inline JSON: what a policy file would hold
        return _from_inline(spec, model, info)
    kind, sep, arg = spec.partition(":")
    if spec == "lru":
        return policy_class("lru")()
    counted = {"option": ("k_hat", "an integer k-hat, as option:8"), "topk": ("n", "an integer number of experts, as topk:4")}
    if sep and kind in counted:
        field, what = counted[kind]
        try:
            value = int(arg)
        except ValueError:
            raise ConfigError(f"policy {spec!r}: {kind} needs {what}") from None
        return policy_class(kind).from_dict({"type": kind, field: value}, info)
    if sep and kind == "static":
        path = Path(arg)
        data = read_policy_json(path, f"policy {spec!r}: subset file")
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: static:FILE needs one expert mask, got a {type(data).__name__}")
        check_subset_layers(data, info, path, model)
        data = normalise(data)
        if data["type"] not in ("expert_mask", "static"):
            raise ConfigError(
                f"{path}: static:FILE needs an expert mask (a subset file), got type {data['type']!r}"
            )
        return _from_dict({**data, "type": "static"}, model, info, path.parent, str(path))
    if sep and kind == "controller":
        folder = Path(arg)
        found = folder.is_file() or any((folder / sub / "controller.json").exists() for sub in ("", "final"))
        policy = _from_path(folder, model, info) if found else None
        if not isinstance(policy, PolicyConfig) or policy.policy_type != "controller":
            raise ConfigError(
                f"policy {spec!r}: {arg} is not a controller folder (needs controller.json and "
                "controller.safetensors, as `moectl options train` writes)"
            )
        return policy
    path = Path(spec).expanduser()
    if path.exists():
        return _from_path(path, model, info)
    if path.suffix == ".json" or os.sep in spec:
        raise MoectlFileError(f"policy {path} does not exist (expected a policy JSON file or a folder)")
    raise ConfigError(f"unknown policy {spec!r}: give a policy JSON file, a folder, or one of {SHORT_FORMS}")


def _from_inline(spec: str, model, info) -> Any:
    """A policy written inline as JSON (``--routing 'g={"type": "gumbel", "tau": 0.5}'``): read as a
    policy file's contents would be, relative paths against the working folder."""
    try:
        data = json.loads(spec)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"inline policy {spec[:60]!r}: not valid JSON ({err.msg} at character {err.pos}); "
            'give an object such as {"type": "gumbel", "tau": 0.5}, a list of them, a file or one of '
            f"{SHORT_FORMS}"
        ) from None
    except RecursionError:
        raise ConfigError(f"inline policy {spec[:60]!r}: not valid JSON (nested too deeply)") from None
    try:
        check_subset_layers(data, info, Path("inline policy"), model)
        return _load(data, model, info, Path.cwd(), "inline policy")
    except _MALFORMED as err:
        detail = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(
            f"inline policy: not a policy moectl can read ({type(err).__name__}: {detail[:200]})"
        ) from err

