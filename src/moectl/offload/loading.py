"""Load a model for serving with offloaded experts: from its checkpoint's shards when it has them.

A checkpoint folder served with a disk or checkpoint store is built on the meta device and its
experts stay in the checkpoint's own safetensors shards (``moectl.models.load_lazy``), read on
demand: a checkpoint larger than memory can be served. Before any weight is read the budget is
checked against the policy's minimum and the memory limit (``plan.preflight``). Anything else
(``tiny:`` / ``shape:`` specs, hub ids, ``--store host``) loads whole and is then offloaded.
Both ``moectl serve-offload`` and ``moectl serve --budget`` load through here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moectl.errors import ConfigError


def controller_k_hat(policy: str) -> int | None:
    """k-hat of a ``controller:DIR`` policy (or a controller / run folder), None for other policies."""
    from moectl.options.option_state import controller_dir

    path = Path(policy.removeprefix("controller:"))
    try:
        return int(json.loads((controller_dir(path) / "controller.json").read_text())["k_hat"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def preflight(folder: str, dtype: str, budget: float | int, policy: str, slot_dtype: str) -> None:
    """Refuse a budget below the policy's minimum, or one the memory limit cannot hold, before any
    weight is read (the model built on meta; a policy that needs the loaded model is checked later)."""
    from moectl.models.meta_model import build_meta, load_config

    check_budget(
        build_meta(load_config(folder), None if dtype == "auto" else dtype), budget, policy, slot_dtype
    )


def check_budget(model: Any, budget: float | int, policy: str, slot_dtype: str) -> None:
    """``preflight``'s checks on a model whose experts are not loaded (built on meta, or a quantized
    checkpoint's with its experts unread)."""
    from moectl.offload.plan import preflight as plan_preflight
    from moectl.offload.residency import parse_policy

    k_hat = controller_k_hat(policy)
    try:  # a controller's minimum is its k-hat: read it, do not merge its adapters into the model
        residency = parse_policy(f"option:{k_hat}" if k_hat is not None else policy, model)
    except Exception:  # a policy that needs the loaded model: checked when installed
        residency = None
    plan_preflight(model, budget, residency, slot_dtype)


def load_for_offload(
    spec: str,
    config: Any,
    dtype: str = "auto",
    device: str = "cpu",
    seed: int = 0,
    quantize: str | None = None,
) -> tuple:
    """(model, tokenizer, reader) for serving ``spec`` under ``config`` (an ``OffloadConfig``; its
    ``policy`` a string). ``reader`` is the checkpoint's shard reader (close it when done), or None.

    ``quantize`` (int4 | int8): the caller quantizes the model loaded here before offloading it
    (``moectl.loaded.quantize_loaded``), so its store holds quantized experts. Refused for a bf16
    checkpoint folder whose experts would stay in its shards (each miss would read bf16 and
    quantize it again): quantize that checkpoint once (``moectl checkpoint quantize``) and serve
    the quantized folder, whose store reads the quantized bytes."""
    from moectl.models.folder_loaders import claimed_by, lazy_loader_for
    from moectl.models.load import load_model
    from moectl.models.load_lazy import is_checkpoint_folder, load_lazy

    policy = config.policy if isinstance(config.policy, str) else "lru"
    folder = Path(spec).expanduser()
    kind, lazy = claimed_by(folder), lazy_loader_for(folder)
    if lazy is not None and config.store != "host":  # a quantized checkpoint: a miss reads int4 (issue 40)
        model, tokenizer, store = lazy(folder, dtype, device, config.read_method)
        try:
            check_budget(model, config.budget, policy, config.slot_dtype)
        except BaseException:
            store.close()
            raise
        return model, tokenizer, store
    if kind is not None and lazy is None:
        raise ConfigError(
            f"{spec} is a {kind}, whose experts offloading (serve-offload, serve --budget) cannot "
            "stream: serve it whole (moectl serve MODEL), or offload the model it was made from"
        )
    if config.store != "host" and is_checkpoint_folder(spec):  # experts stay in the checkpoint's shards
        if quantize is not None:
            raise ConfigError(
                f"--quantize {quantize} with --budget: {spec}'s experts would be read in bf16 and quantized "
                f"at every miss; quantize it once (moectl checkpoint quantize {spec} --quantize {quantize} "
                "--out DIR) and serve DIR, or load it whole with --store host"
            )
        preflight(spec, dtype, config.budget, policy, config.slot_dtype)
        return load_lazy(spec, dtype, device, method=config.read_method)
    if config.store == "checkpoint":
        raise ConfigError(
            f"--store checkpoint needs a checkpoint folder with safetensors shards, got {spec!r}"
        )
    model, tokenizer = load_model(spec, dtype=dtype, device=device, seed=seed)
    return model, tokenizer, None
