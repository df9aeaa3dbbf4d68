"""Checkpoint configs that every loader reads, not only the transformers that wrote them.

transformers 5 writes a checkpoint's ``config.json`` and ``tokenizer_config.json`` in its own
spelling, which the loaders users serve with do not all read: they pin transformers 4.x (vLLM,
SGLang) or parse the JSON themselves (mlx_lm, llama.cpp's ``convert_hf_to_gguf.py``, fastllm).
:func:`portable_config` and :func:`portable_tokenizer_config` add the other spellings beside
transformers 5's, with the same values (nothing is removed, so transformers 5 reads the file as
before), and :func:`make_portable` applies both to a folder. Every moectl writer of a checkpoint
calls it: subset export (loaded and streamed), merge, fine-tune, pretraining checkpoints and final
model, shape checkpoints, trained tokenizers.

What is added, and who needs it:

- **Expert count, both spellings** (``num_experts`` and ``num_local_experts``). transformers 5
  writes ``num_local_experts`` for Qwen3-MoE, Mixtral and gpt-oss and ``num_experts`` for OLMoE
  and Qwen2-MoE. transformers 4.x's ``Qwen3MoeConfig``, vLLM's and SGLang's Qwen2/3-MoE and
  OLMoE models, and mlx_lm's ``olmoe``/``qwen2_moe``/``qwen3_moe`` read ``num_experts`` (4.x
  falls back to its default of 128 for a Qwen3-MoE without it; mlx_lm's qwen3_moe refuses);
  transformers 4.x's ``MixtralConfig``, vLLM's Mixtral and mlx_lm's ``mixtral`` read
  ``num_local_experts`` (mlx_lm silently takes 8 without it); llama.cpp's converter looks for
  either. Families counted in ``n_routed_experts`` (DeepSeek and the like) are left as written.
- **``rope_theta`` at the top level** (and ``rope_scaling`` for a scaled RoPE, and
  ``partial_rotary_factor``), which transformers 5 nests in ``rope_parameters``: transformers
  4.x, vLLM's and SGLang's pinned 4.x configs, mlx_lm (``qwen3_moe`` requires it; ``mixtral``
  silently takes 1e6) and older converters read it there, and fall back to a default otherwise.
- **``torch_dtype`` beside ``dtype``**: transformers before 4.56 and the loaders pinned to it read
  only ``torch_dtype``.
- **A tokenizer class older loaders know**: transformers 5 writes ``"TokenizersBackend"``, which
  no transformers 4.x, vLLM before its transformers-5 support, or fastllm can resolve
  ("Unsupport tokenizer_class"); a folder with ``tokenizer.json`` is a fast tokenizer, so it
  becomes ``"PreTrainedTokenizerFast"``, which every version loads from that file and
  transformers 5 maps back onto its ``TokenizersBackend``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

EXPERT_COUNTS = ("num_experts", "num_local_experts")
ROUTED_ONLY = ("n_routed_experts", "moe_num_experts")  # families counted another way: left as written
BACKEND_CLASSES = ("TokenizersBackend",)  # transformers 5's generic class names, unknown before 5
FAST_CLASS = "PreTrainedTokenizerFast"
CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def portable_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.json`` as a dict) with the keys other loaders read added beside
    transformers 5's (see the module doc), in the model's section and in nested sub-configs that
    name a ``model_type`` (a ``text_config``). A new dict; the values of keys present are kept."""
    out = copy.deepcopy(config)
    for section in [out, *(v for v in out.values() if isinstance(v, dict) and "model_type" in v)]:
        _expert_counts(section)
        _rope(section)
        if "dtype" in section and "torch_dtype" not in section:
            section["torch_dtype"] = section["dtype"]
    return out


def portable_tokenizer_config(config: dict[str, Any], fast: bool = True) -> dict[str, Any]:
    """``config`` (a ``tokenizer_config.json`` as a dict) with transformers 5's generic tokenizer
    class replaced by one every loader knows; ``fast``: the folder holds ``tokenizer.json`` (the
    class that reads it). A new dict."""
    out = dict(config)
    if out.get("tokenizer_class") in BACKEND_CLASSES and fast:
        out["tokenizer_class"] = FAST_CLASS
    return out


def make_portable(folder: str | Path) -> list[str]:
    """Rewrite ``folder``'s ``config.json`` and ``tokenizer_config.json`` (those present) portably;
    returns the names of the files changed. Called on a checkpoint folder before it is published
    (inside the writers' temporary folders), and on the shipped reference models."""
    folder = Path(folder)
    changed = []
    fast = (folder / "tokenizer.json").is_file()
    for name, make in (
        (CONFIG, portable_config),
        (TOKENIZER_CONFIG, lambda c: portable_tokenizer_config(c, fast)),
    ):
        path = folder / name
        if not path.is_file():
            continue
        before = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(before, dict):
            continue
        after = make(before)
        if after != before:
            path.write_text(
                json.dumps(after, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
            )
            changed.append(name)
    return changed


def _expert_counts(section: dict[str, Any]) -> None:
    """Both spellings of the expert count, with the value transformers 5 reads for the family."""
    if any(key in section for key in ROUTED_ONLY):
        return
    present = [key for key in EXPERT_COUNTS if isinstance(section.get(key), int)]
    if not present:
        return
    canonical = _canonical_count(section.get("model_type"), present)
    for key in EXPERT_COUNTS:
        section[key] = section[canonical]


def _canonical_count(model_type: Any, present: list[str]) -> str:
    """The spelling transformers 5's config class of ``model_type`` holds (its other spelling is an
    alias, ``attribute_map``); the one present where the class is unknown or has no alias."""
    if len(present) == 1:
        return present[0]
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        aliases = getattr(CONFIG_MAPPING[str(model_type)], "attribute_map", {}) or {}
    except (ImportError, KeyError, ValueError):
        aliases = {}
    for alias, target in aliases.items():
        if alias in EXPERT_COUNTS and target in EXPERT_COUNTS:
            return target
    return "num_experts"


def _rope(section: dict[str, Any]) -> None:
    """``rope_theta`` (and a scaled RoPE's ``rope_scaling``, ``partial_rotary_factor``) at the top
    level, from transformers 5's ``rope_parameters`` (one set of parameters, not one per layer type)."""
    params = section.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params:
        return
    section["rope_theta"] = params["rope_theta"]
    if "partial_rotary_factor" in params and "partial_rotary_factor" not in section:
        section["partial_rotary_factor"] = params["partial_rotary_factor"]
    kind = params.get("rope_type", "default")
    if kind != "default" and section.get("rope_scaling") is None:
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
        section["rope_scaling"] = {**scaling, "rope_type": kind, "type": kind}  # "type": readers before 4.45
