"""TE-MoE's four pruning baselines (§5 "Baselines", A2), and REAP, as routing policies.

- ``frequency``: keep the k-hat experts most often in the top-k on the calibration set.
- ``reconstruction`` (Lu et al.): keep the k-hat experts minimising ‖F'(X, C) − F(X)‖_F per layer;
  exhaustive over all sets when few, else greedy forward selection (A2).
- ``wanda`` (structured, Sun et al.): keep the k-hat experts of largest Σ|W|·‖X‖.
- ``reap`` (Lasby et al. 2025): keep the k-hat experts of largest router-weighted mean output norm
  over the calibration tokens routed to them (not one of the paper's four; added beside them).
- ``random``: a fresh random set of k-hat experts at every token (``RandomOptions``).

The three fixed baselines are ``moectl.subsets`` selection methods on the calibration tokens,
applied as ``ExpertMask(..., renorm="pruned")``: the router recomputes top-k and the softmax over
the allowed experts only, which is TE-MoE's masking (A2). The paper's calibration set is 128
prompts, each followed by a response the model itself generated (prompt + response ≤ 2048
tokens); ``generate_tokens`` appends such a response (``moectl.generate``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.errors import ConfigError
from moectl.generate import Prompt, generate
from moectl.options.random_options import RandomOptions, check_k_hat
from moectl.routing import ExpertMask
from moectl.routing.routing_state import Policy
from moectl.subsets.calibrate import tokenize
from moectl.subsets.select import select_subset

BASELINES = ("frequency", "reconstruction", "random", "wanda", "reap")
FIXED_BASELINES = ("frequency", "reconstruction", "wanda", "reap")


def baseline_name(name: str) -> str:
    """Canonical baseline name (case-insensitive); ValueError naming the allowed values."""
    canonical = name.strip().lower()
    if canonical not in BASELINES:
        raise ConfigError(f"unknown baseline method {name!r}; choose one of: {', '.join(BASELINES)}")
    return canonical


@torch.no_grad()
def calibration_batch(
    model: nn.Module,
    tokenizer,
    texts: Sequence[str],
    max_length: int = 512,
    generate_tokens: int = 0,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Tensor]:
    """Left-padded ``input_ids`` / ``attention_mask`` of the calibration texts (last ``max_length``
    tokens each), each followed by ``generate_tokens`` tokens the model generates (0: none)."""
    if generate_tokens < 0:
        raise ConfigError(f"generate_tokens must be >= 0, got {generate_tokens}")
    batch = tokenize(tokenizer, texts, max_length)
    if generate_tokens == 0:
        return batch
    prompts = [
        tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
    ]
    responses = generate(
        model,
        tokenizer,
        [Prompt(p) for p in prompts],
        max_new_tokens=generate_tokens,
        temperature=temperature,
        seed=seed,
        ignore_eos=False,
        progress=progress,
    )
    texts = [p + r for p, r in zip(prompts, responses, strict=True)]
    return tokenize(tokenizer, texts, max_length + generate_tokens)


def baseline_keep(
    model: nn.Module,
    batch: dict[str, Tensor],
    method: str,
    k_hat: int,
    seed: int = 0,
    info: ModelInfo | None = None,
    layerwise: bool = False,
) -> dict[int, list[int]]:
    """``{moe_layer: k-hat kept expert ids}`` of a fixed baseline on a calibration batch."""
    method = baseline_name(method)
    if method == "random":
        raise ConfigError("the random baseline keeps no fixed set: it redraws k-hat experts at every token")
    info = info or inspect(model)
    check_k_hat(info, k_hat)
    return select_subset(
        model, batch["input_ids"], k_hat, method, batch["attention_mask"], layerwise, seed, info
    )


def baseline_policy(
    model: nn.Module,
    tokenizer,
    method: str,
    k_hat: int,
    calib_texts: Sequence[str] = (),
    seed: int = 0,
    info: ModelInfo | None = None,
    max_length: int = 512,
    generate_tokens: int = 0,
    temperature: float = 0.0,
    layerwise: bool = False,
) -> Policy:
    """The routing policy of a baseline: an ``ExpertMask`` of k-hat experts per MoE layer selected
    on ``calib_texts``, or ``RandomOptions(k_hat, seed)`` for ``random`` (no calibration needed)."""
    method = baseline_name(method)
    info = info or inspect(model)
    check_k_hat(info, k_hat)
    if method == "random":
        return RandomOptions(k_hat, seed)
    batch = calibration_batch(model, tokenizer, calib_texts, max_length, generate_tokens, temperature, seed)
    keep = baseline_keep(model, batch, method, k_hat, seed, info, layerwise)
    return ExpertMask.from_lists(info, keep, renorm="pruned")
