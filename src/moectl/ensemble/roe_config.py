"""RoEConfig: the knobs of Roster of Experts under the paper's names, and tau profiles on disk.

- ``K`` — routing samples per token (the paper's N / K: Appendix A Table 1 "N", §3.4 "sample size K").
  Sample 0 is the clean path (tau = 0, §2.3); samples 1 … K−1 use Gumbel-top-k routing.
- ``tau`` — the Gumbel temperature per MoE layer (§2.2: a vector τ = {τ_i}, i ∈ L_MoE): one float
  for every MoE layer, a list with one value per MoE layer, or ``{moe_layer: tau}`` (others 0).
  The default 0 is the plain model (every sample clean): tune tau (``moectl roe tune``) or set it.
- ``aggregation`` — how the K next-token distributions become one: ``"prob_mean"`` (probability
  averaging, what the paper uses: §3.1 "RoE predictions are aggregated by probability averaging")
  or ``"logprob_mean"`` (mean of log-probabilities, renormalised: a geometric mean).
- ``cache`` — ``"clean"`` (§2.3 Clean Cache: one KV cache from the clean path, shared by all K
  samples), ``"separate"`` (K caches, each sample keeps its own noisy history) or ``"none"``
  (recompute every sample from scratch with the clean prefix each step: the definition the clean
  cache must reproduce, and the paper's Figure 4(b) no-cache baseline).
- ``seed`` — seeds the Gumbel noise; the noise for (MoE layer, sample, position, expert) is a fixed
  function of the seed, so every cache variant and batch layout sees the same draws.

A *profile* is the JSON that ``moectl roe tune`` writes: the tuned per-layer tau and how it was
found. It is a policy config (``routing/policy_config.py``) of type ``"roe"``::

    {"type": "roe", "format_version": 1, "K": 16, "tau": [0.0, 0.31, ...], "aggregation": "prob_mean",
     "cache": "clean", "seed": 0, ...provenance (objective, value, history, ...)}

``RoEConfig.from_profile`` / ``moectl.load_policy`` read it back, and the profiles of earlier
versions (``{"format": "moectl-roe-profile/1", "tau": [...], "K": ..., ...}``, no type): from
those only K, tau and aggregation are read, as before (their ``seed`` was the tuner's, and the
old reader ignored it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from moectl.errors import ConfigError, FileFormatError, MoectlFileError
from moectl.io.atomic import write_text_atomic
from moectl.routing.made_for import check_profile_made_for
from moectl.routing.policy_config import PolicyConfig, check_version, register_policy

if TYPE_CHECKING:
    from moectl.adapters.inspect import ModelInfo

Aggregation = Literal["prob_mean", "logprob_mean"]
CacheMode = Literal["clean", "separate", "none"]
TauSpec = float | Sequence[float] | Mapping[int, float]

AGGREGATIONS: tuple[str, ...] = ("prob_mean", "logprob_mean")
CACHE_MODES: tuple[str, ...] = ("clean", "separate", "none")
PROFILE_FORMAT = "moectl-roe-profile/1"
# K samples per token run as K batch rows (K caches with cache="separate"): K = 100,000 ran for
# minutes without a word. 256 is 4x the largest K of RoE's sweeps and of ``moectl roe bench``.
MAX_K = 256


def check_k(K: object, what: str = "K (routing samples per token)") -> int:
    """``K`` as an int in 1..MAX_K, else ValueError naming the allowed range."""
    if isinstance(K, bool) or not isinstance(K, int) or not 1 <= K <= MAX_K:
        raise ConfigError(f"{what} must be an integer >= 1 and <= {MAX_K}, got {K!r}")
    return K


@register_policy("roe")
@dataclass(frozen=True)
class RoEConfig(PolicyConfig):
    """Roster of Experts settings (RoE §2). Validated on construction; ``taus(n)`` checks tau's length."""

    K: int = 16
    tau: TauSpec = 0.0
    aggregation: Aggregation = "prob_mean"
    cache: CacheMode = "clean"
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_k(self.K, "RoEConfig: K (routing samples per token)")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(
                f"RoEConfig: aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}"
            )
        if self.cache not in CACHE_MODES:
            raise ConfigError(f"RoEConfig: cache must be one of {', '.join(CACHE_MODES)}, got {self.cache!r}")
        _check_tau_values(self.tau)

    def taus(self, num_moe_layers: int) -> list[float]:
        """tau for each of the model's MoE layers (RoE §2.2's vector τ), checked against the model (a
        profile that records another model is refused: ``moectl.routing.made_for``)."""
        count = len(self.tau) if isinstance(self.tau, Sequence) and not isinstance(self.tau, str) else None
        check_profile_made_for(self.meta.get("model"), count, num_moe_layers)
        return resolve_tau(self.tau, num_moe_layers)

    def with_(self, **changes: Any) -> RoEConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    # -- config / profiles ---------------------------------------------------------------------
    def config_fields(self) -> dict[str, Any]:
        tau = self.tau
        if isinstance(tau, Mapping):
            tau = {str(k): float(v) for k, v in tau.items()}
        elif not isinstance(tau, (int, float)):
            tau = [float(v) for v in tau]
        fields = {
            "K": self.K,
            "tau": tau,
            "aggregation": self.aggregation,
            "cache": self.cache,
            "seed": self.seed,
        }
        skip = {"type", "format_version", "format", *fields}
        return {**fields, **{k: v for k, v in self.meta.items() if k not in skip}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], info: ModelInfo | None = None, **_: Any) -> RoEConfig:
        """A config from ``to_dict``'s object or a tau profile of any version (see the module doc)."""
        data = check_profile(data)
        fields = {
            "K": data.get("K", 16),
            "tau": data["tau"],
            "aggregation": data.get("aggregation", "prob_mean"),
        }
        if "format" not in data:  # not a profile of the old writer (whose "seed" was the tuner's)
            fields.update({k: data[k] for k in ("cache", "seed") if k in data})
        config = cls(**fields, meta={k: v for k, v in data.items() if k != "tau"})
        if info is not None:
            config.taus(info.num_moe_layers)
        return config

    @classmethod
    def from_profile(cls, path: str | Path, **overrides: Any) -> RoEConfig:
        """Read a tau profile written by ``save_profile`` (``moectl roe tune --out``) or ``save``."""
        return cls.from_dict(load_profile(path)).with_(**overrides)


def _check_tau_values(spec: TauSpec) -> None:
    if isinstance(spec, bool):
        raise ConfigError(
            f"RoEConfig: tau must be a number, a list or a {{moe_layer: tau}} mapping, got {spec!r}"
        )
    if isinstance(spec, (int, float)):
        values = {"all layers": spec}
    elif isinstance(spec, Mapping):
        values = {f"MoE layer {k}": v for k, v in spec.items()}
    elif isinstance(spec, Sequence) and not isinstance(spec, str):
        values = {f"MoE layer {i}": v for i, v in enumerate(spec)}
    else:
        raise ConfigError(
            f"RoEConfig: tau must be a number, a list (one per MoE layer) or a {{moe_layer: tau}} mapping, "
            f"got {type(spec).__name__}"
        )
    bad = {}
    for where, v in values.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            bad[where] = v
            continue
        if not (math.isfinite(f) and f >= 0):
            bad[where] = v
    if bad:
        raise ConfigError(f"RoEConfig: Gumbel temperatures tau must be finite and >= 0 (RoE §2.1), got {bad}")


def resolve_tau(spec: TauSpec, num_moe_layers: int) -> list[float]:
    """Expand a tau spec to one value per MoE layer; raise on a length or layer mismatch."""
    _check_tau_values(spec)
    n = int(num_moe_layers)
    if isinstance(spec, (int, float)):
        return [float(spec)] * n
    if isinstance(spec, Mapping):
        bad = [k for k in spec if not (isinstance(k, int) or str(k).isdigit()) or not 0 <= int(k) < n]
        if bad:
            raise ConfigError(
                f"RoEConfig: tau given for MoE layers {bad}; the model has MoE layers 0..{n - 1}"
            )
        out = [0.0] * n
        for k, v in spec.items():
            out[int(k)] = float(v)
        return out
    values = [float(v) for v in spec]
    if len(values) != n:
        raise ConfigError(
            f"RoEConfig: {len(values)} temperatures given, the model has {n} MoE layers "
            "(give one tau per MoE layer, one float for all, or a {moe_layer: tau} mapping)"
        )
    return values


# -- profile files ---------------------------------------------------------------------------
def save_profile(path: str | Path, tau: Sequence[float], **info: Any) -> Path:
    """Write a tau profile: ``{"type": "roe", "format_version", "tau": [per MoE layer], ...info}``
    (atomic replace; ``info`` holds K, aggregation, seed and how tau was found)."""
    data = {"type": "roe", "format_version": RoEConfig.format_version, "tau": [float(t) for t in tau], **info}
    return write_text_atomic(path, json.dumps(data, indent=2))


def load_profile(path: str | Path) -> dict[str, Any]:
    """Read and check a tau profile."""
    path = Path(path)
    if not path.exists():
        raise MoectlFileError(f"tau profile {path} does not exist (write one with `moectl roe tune --out`)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise FileFormatError(f"{path}: not a JSON tau profile ({err.msg})") from err
    except UnicodeDecodeError as err:
        raise FileFormatError(f"{path}: not a JSON tau profile (not UTF-8 text: {err.reason})") from err
    except OSError as err:
        raise MoectlFileError(f"tau profile {path} cannot be read: {err.strerror or err}") from err
    try:
        return check_profile(data)
    except ValueError as err:
        raise FileFormatError(f"{path}: {err}") from None


def check_profile(data: Any) -> dict[str, Any]:
    """A profile's object, checked, with a ``{layer: tau}`` mapping's keys as ints (a copy)."""
    if not isinstance(data, Mapping) or "tau" not in data:
        raise FileFormatError("a tau profile is a JSON object with a 'tau' list (one value per MoE layer)")
    data = dict(data)
    if data.get("type", "roe") != "roe":
        raise FileFormatError(f"not a tau profile: a policy of type {data['type']!r} (a profile has type 'roe')")
    if data.get("format", PROFILE_FORMAT) != PROFILE_FORMAT:
        raise FileFormatError(f"unknown profile format {data.get('format')!r}, expected {PROFILE_FORMAT!r}")
    check_version(data, RoEConfig)
    tau = data["tau"]
    if isinstance(tau, Mapping):
        try:
            tau = {int(k): v for k, v in tau.items()}
        except (TypeError, ValueError):
            raise FileFormatError(f"tau: layer keys must be MoE layer indices, got {sorted(tau)}") from None
    _check_tau_values(tau)
    data["tau"] = tau
    return data


def as_config(config: Any) -> RoEConfig:
    """``config`` as a RoEConfig: None (K=16, tau=0), a RoEConfig, or a profile path / dict (``load_policy``)."""
    if config is None:
        return RoEConfig()
    if isinstance(config, RoEConfig):
        return config
    from moectl.routing.policy_files import load_policy

    loaded = load_policy(config)
    if not isinstance(loaded, RoEConfig):
        raise ConfigError(
            f"expected a RoE config (a tau profile, type 'roe'), got {type(loaded).__name__}; "
            "masks and pools go to `policies=`"
        )
    return loaded


def config_dict(config: RoEConfig, num_moe_layers: int) -> dict[str, Any]:
    """A JSON-ready description of a config with tau expanded per MoE layer."""
    d = asdict(config)
    d.pop("meta", None)
    d["tau"] = config.taus(num_moe_layers)
    return d


def config_from_options(
    k: int | None,
    temperatures: str | None,
    cache: str = "clean",
    aggregation: str = "prob_mean",
    seed: int = 0,
) -> RoEConfig:
    """A config from ``moectl roe``'s options: ``temperatures`` is a tau profile path, one number for
    every MoE layer or a comma list, one per MoE layer; K defaults to the profile's, else 16.
    Raises ``ValueError`` naming ``--temperatures`` when it is neither a file nor numbers."""
    if temperatures is None:
        return RoEConfig(K=16 if k is None else k, tau=0.0, cache=cache, aggregation=aggregation, seed=seed)
    path = Path(temperatures)
    if path.suffix == ".json" or path.exists():
        overrides: dict[str, Any] = {"cache": cache, "aggregation": aggregation, "seed": seed}
        if k is not None:
            overrides["K"] = k
        return RoEConfig.from_profile(path, **overrides)
    try:
        values = [float(v) for v in temperatures.split(",")]
    except ValueError:
        raise ConfigError(
            f"--temperatures {temperatures!r} is neither a profile file nor numbers (e.g. 0.3 or 0,0.2,0.3,0)"
        ) from None
    tau: float | list[float] = values[0] if len(values) == 1 else values
    return RoEConfig(K=16 if k is None else k, tau=tau, cache=cache, aggregation=aggregation, seed=seed)


def parse_roe_spec(spec: str, seed: int) -> RoEConfig:
    """A config from ``moectl eval --roe``: a tau profile (``moectl roe tune --out``) or ``K=16,tau=0.5[,...]``.

    Inline keys are RoEConfig's (``K``, ``tau``, ``aggregation``, ``cache``, ``seed``); ``tau`` is one
    value for every MoE layer or ``/``-separated values, one per MoE layer. A profile's K may be
    overridden inline after the path: ``profile.json,K=8``.
    """
    head, *rest = [part.strip() for part in spec.split(",") if part.strip()] or [""]
    items = rest if "=" not in head else [head, *rest]
    fields: dict[str, Any] = {"seed": seed}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in ("K", "tau", "aggregation", "cache", "seed"):
            raise ConfigError(
                f"--roe: cannot read {item!r}; give a tau profile path or K=…,tau=…[,aggregation=…,cache=…,seed=…]"
            )
        try:
            if key in ("K", "seed"):
                fields[key] = int(value)
            elif key == "tau":
                taus = [float(v) for v in value.split("/")]
                fields[key] = taus[0] if len(taus) == 1 else taus
            else:
                fields[key] = value
        except ValueError:  # a placeholder pasted as given (K=K, tau=TAU): one line, not a traceback
            kind = "an integer" if key in ("K", "seed") else "a number or /-separated numbers, one per MoE layer"
            raise ConfigError(f"--roe: {key} must be {kind}, got {value!r} (e.g. K=16,tau=0.5)") from None
    if "=" not in head:
        if not Path(head).exists():
            raise MoectlFileError(
                f"--roe: {head!r} is neither a tau profile file nor K=…,tau=… (write a profile with `moectl roe tune`)"
            )
        return RoEConfig.from_profile(head, **fields)
    return RoEConfig(**fields)
