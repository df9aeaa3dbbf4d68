"""Policies as configs: one JSON format for every routing and residency policy (as PEFT's adapter configs).

Every policy serialises to a JSON object with a ``"type"`` and a ``"format_version"``::

    {"type": "expert_mask", "format_version": 1, "experts": {"0": [0, 1, 2, 3]}, "renorm": "pruned"}

and reads back with ``Class.from_dict(data, info)``; ``policy.save(path)`` writes it.
``moectl.load_policy`` (``routing/policy_files.py``) reads any of them — and the files earlier versions
wrote — through this registry.

Registration goes type → class: a policy class says ``@register_policy("expert_mask")``. The
classes of higher packages (RoE profiles in ``roe/``, controllers in ``options/``, residency
policies in ``offload/``) are found by importing the module that registers them, named in
``_PROVIDERS``, only when a file of that type is read: nothing here imports a package above
``routing/``, and heavy dependencies (a controller needs peft) load only when used.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from moectl.errors import ConfigError
from moectl.io.atomic import write_text_atomic

if TYPE_CHECKING:
    from torch import nn

    from moectl.adapters.inspect import ModelInfo

FORMAT_VERSION = 1

_REGISTRY: dict[str, type[PolicyConfig]] = {}

# type -> the module whose import registers it (imported on first use)
_PROVIDERS: dict[str, str] = {
    "expert_mask": "moectl.routing.mask",
    "experts": "moectl.routing.force_omit",
    "topk": "moectl.routing.top_k",
    "replay": "moectl.routing.replay",
    "document_pool": "moectl.routing.pool",
    "gumbel": "moectl.routing.gumbel",
    "roe": "moectl.ensemble.roe_config",
    "controller": "moectl.options.policy",
    "random_options": "moectl.options.random_options",
    "lru": "moectl.offload.residency",
    "static": "moectl.offload.residency",
    "option": "moectl.offload.residency",
    "s3fifo": "moectl.offload.residency",
    "arc": "moectl.offload.residency",
    "reroute": "moectl.offload.reroute",
    "pregate": "moectl.offload.pregate",
}


class PolicyConfig:
    """Mixin: a policy that is a config — ``to_dict`` / ``from_dict`` / ``save`` with a type and a version.

    Subclasses set ``policy_type`` (by ``@register_policy``) and implement ``config_fields`` (the
    JSON fields besides type and version) and ``from_dict``.
    """

    policy_type: ClassVar[str] = ""
    format_version: ClassVar[int] = FORMAT_VERSION

    def config_fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """``{"type", "format_version", **fields}``, JSON-ready."""
        return {"type": self.policy_type, "format_version": self.format_version, **self.config_fields()}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> PolicyConfig:
        raise NotImplementedError

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``to_dict()`` as JSON to ``path`` (atomically; parent folders created)."""
        return write_json_atomic(path, self.to_dict())


def register_policy(policy_type: str):
    """Class decorator: register ``cls`` as the reader of ``{"type": policy_type}``."""

    def wrap(cls: type[PolicyConfig]) -> type[PolicyConfig]:
        cls.policy_type = policy_type
        _REGISTRY[policy_type] = cls
        return cls

    return wrap


def policy_types() -> list[str]:
    """Every type ``load_policy`` reads."""
    return sorted(set(_REGISTRY) | set(_PROVIDERS))


def policy_class(policy_type: Any) -> type[PolicyConfig]:
    """The class registered for ``policy_type`` (its module imported on first use)."""
    if isinstance(policy_type, str) and policy_type not in _REGISTRY and policy_type in _PROVIDERS:
        importlib.import_module(_PROVIDERS[policy_type])
    if not isinstance(policy_type, str) or policy_type not in _REGISTRY:
        raise ConfigError(f"unknown policy type {policy_type!r}; allowed: {', '.join(policy_types())}")
    return _REGISTRY[policy_type]


def check_version(data: Mapping[str, Any], cls: type[PolicyConfig]) -> None:
    """Refuse a ``format_version`` newer than this moectl reads (absent: written before versions existed)."""
    version = data.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigError(f"format_version must be an integer >= 1, got {version!r}")
    if version > cls.format_version:
        raise ConfigError(
            f"a {cls.policy_type!r} policy of format_version {version} was written by a newer moectl; "
            f"this one reads format_version <= {cls.format_version}"
        )


def layer_key(key: Any, what: str = "layer") -> int:
    """A MoE layer index from a JSON key ("0", 0); ValueError otherwise."""
    if isinstance(key, bool):
        raise ConfigError(f"{what} key {key!r} is not an integer MoE layer index")
    try:
        return int(key)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} key {key!r} is not an integer MoE layer index") from None


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON: a temporary file beside ``path``, renamed into place."""
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def save_policy(path: str | os.PathLike, policy: PolicyConfig | list[PolicyConfig]) -> Path:
    """Write one policy, or a list of them (a composition, applied in order), as a policy file."""
    if isinstance(policy, (list, tuple)):
        return write_json_atomic(path, [p.to_dict() for p in policy])
    return policy.save(path)
