"""A file made for another model is refused, naming both models; ``--force`` applies it anyway.

Subset files and expert masks record the model they were made for (``"model"``: its spec, as
``moectl subset select`` was given it) and its experts per MoE layer (``"num_experts"``); a RoE tau
profile of ``moectl roe tune`` records ``"model"`` and has one tau per MoE layer. Expert ids chosen
on one model name other experts on another, and a tau profile tuned on one model's routers is
another model's guess; so such a file given another model is refused in one line::

    subset file math.subset.json was made for tiny:olmoe (8 experts per MoE layer), not for
    models/moectl-small-standard (32 experts per MoE layer): select one on this model (`moectl subset
    select`), or pass --force to apply it anyway

The model given is the spec of the surrounding :func:`policy_target` (each verb that loads such a
file sets it, with its ``--force``), else the loaded model's ``config.name_or_path``. Two specs
name one model when they are equal, name one folder, or end in the same folder name (a hub id
``org/NAME`` and a local copy ``.../NAME``). A file that records no model is checked on its
structure only (another expert count is still another model). ``--force`` cannot make a file fit
what it cannot: expert ids beyond the model's experts, or a tau profile of another layer count.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from moectl.errors import ConfigError

_TARGET: ContextVar[tuple[str | None, bool]] = ContextVar("moectl_policy_target", default=(None, False))
HINTS = {
    "subset file": "select one on this model (`moectl subset select`)",
    "tau profile": "tune one on this model (`moectl roe tune`)",
}


class MadeForAnotherModelError(ConfigError):
    """A subset, mask or tau profile made for another model (the message names both, and --force)."""


@contextmanager
def policy_target(model: str | None = None, *, force: bool = False) -> Iterator[None]:
    """Within the block, policy files are checked against ``model`` (a spec: ``tiny:olmoe``, a
    folder, a hub id) and, with ``force``, applied even when made for another model."""
    token = _TARGET.set((model, force))
    try:
        yield
    finally:
        _TARGET.reset(token)


def forced() -> bool:
    """Whether the surrounding :func:`policy_target` applies files made for another model."""
    return _TARGET.get()[1]


def target_name(model: Any = None) -> str | None:
    """The spec of the model files are applied to: :func:`policy_target`'s, else ``model``'s
    ``config.name_or_path`` (what ``from_pretrained`` was given), else None (not known)."""
    name = _TARGET.get()[0]
    if name is None and model is not None:
        name = getattr(getattr(model, "config", None), "name_or_path", None) or None
    return str(name) if name else None


def same_model(recorded: str, given: str) -> bool:
    """Whether two specs name one model: equal, one folder, or the same last folder name (``tiny:``
    and ``shape:`` specs only when equal)."""
    if recorded == given:
        return True
    if any(s.startswith(("tiny:", "shape:")) for s in (recorded, given)):
        return False
    a, b = Path(recorded).expanduser(), Path(given).expanduser()
    try:
        if a.exists() and b.exists():
            return a.samefile(b)
    except OSError:
        pass
    return a.name == b.name and a.name != ""


def _experts(counts: list[int]) -> str:
    return f"{'/'.join(map(str, counts))} experts per MoE layer"


def check_made_for(
    data: Mapping[str, Any], path: str | Path, info: Any = None, model: Any = None, kind: str = "subset file"
) -> bool:
    """Refuse ``data`` (read from ``path``) when it records being made for another model than the
    one given (``info``: its ModelInfo; ``model``: the model, for its name): another ``num_experts``
    than the model's, or another ``model`` name. Returns whether it was made for another model
    (True only under ``force``, which applies it anyway), so a caller relaxes its own rules then."""
    recorded = data.get("model") if isinstance(data.get("model"), str) and data.get("model") else None
    experts = data.get("num_experts")
    experts = experts if isinstance(experts, int) and not isinstance(experts, bool) and experts > 0 else None
    counts = sorted({layer.num_experts for layer in info.layers}) if info is not None else None
    given = target_name(model)
    other_count = experts is not None and counts is not None and experts not in counts
    other_name = recorded is not None and given is not None and not same_model(recorded, given)
    if not (other_count or other_name):
        return False
    if forced():
        return True
    made = (recorded or "another model") + (f" ({_experts([experts])})" if experts is not None else "")
    target = (given or "this model") + (f" ({_experts(counts)})" if counts is not None else "")
    hint = HINTS.get(kind, "make one on this model")
    raise MadeForAnotherModelError(
        f"{kind} {path} was made for {made}, not for {target}: {hint}, or pass --force to apply it anyway"
    )


def check_profile_made_for(recorded: Any, tau_count: int | None, num_moe_layers: int) -> None:
    """Refuse a tau profile that records another ``model`` than the one given: with another
    number of MoE layers (``tau_count``, a list's length) it cannot apply, so ``--force`` is not
    offered; with the same, it applies under ``--force``."""
    given = target_name()
    if not isinstance(recorded, str) or not recorded or given is None or same_model(recorded, given):
        return
    fits = tau_count is None or tau_count == num_moe_layers
    if fits and forced():
        return
    layers = f" ({tau_count} MoE layers)" if tau_count is not None else ""
    ending = ", or pass --force to apply it anyway" if fits else f" (its {tau_count} temperatures cannot apply here)"
    raise MadeForAnotherModelError(
        f"tau profile was made for {recorded}{layers}, not for {given} ({num_moe_layers} MoE layers): "
        f"{HINTS['tau profile']}{ending}"
    )
