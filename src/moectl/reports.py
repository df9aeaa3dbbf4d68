"""The JSON-ready reports behind ``moectl inspect`` and ``moectl switch-rate``, for a loaded model.

- :func:`inspect_report`: family, MoE layers, experts, top-k, shared experts, router rule, self-test.
- :func:`switch_rate_report`: generate, record routing, switch rates by prompt category (TE-MoE Table 1).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moectl.adapters.inspect import inspect
from moectl.adapters.selftest import self_test
from moectl.generate import generate_traced, load_prompts
from moectl.metrics.switch_rate import switch_rate
from moectl.routing.policy_config import PolicyConfig
from moectl.routing.policy_files import load_policy


def _summarise(values: list[list[float]]) -> dict:
    """Mean/std over sequences of the per-sequence mean, and the per-layer means."""
    rates = torch.tensor(values)  # [S, L]
    per_seq = rates.mean(1)
    return {
        "mean": float(per_seq.mean()),
        "std": float(per_seq.std(unbiased=False)) if len(values) > 1 else 0.0,
        "n": len(values),
        "per_layer": rates.mean(0).tolist(),
    }


def inspect_report(model, model_spec: str) -> dict:
    """What ``moectl inspect`` prints: ``ModelInfo.summary()``, the spec, the parameter count and the
    adapter self-test."""
    info = inspect(model)
    result = self_test(model, info)
    summary = info.summary()
    summary["model"] = model_spec
    summary["parameters"] = sum(p.numel() for p in model.parameters())
    summary["self_test"] = {
        "passed": result.passed,
        "layers_checked": result.layers_checked,
        "tokens": result.tokens,
        "index_mismatches": result.index_mismatches,
        "max_weight_error": result.max_weight_error,
    }
    return summary


def switch_rate_report(
    model,
    tokenizer,
    model_spec: str,
    prompts_path: str | None = None,
    k_hat: int | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.5,
    batch_size: int = 8,
    seed: int = 0,
    plot_dir: str | None = None,
    trace_path: str | None = None,
    progress: bool = True,
    policy: str | None = None,
) -> dict:
    """Measure the switch rate of ``model`` (loaded from ``model_spec``) on generated tokens;
    returns a JSON-ready dict.

    Without ``policy`` the plain router as an option policy (k-hat, default top-k). With one (any
    spec ``moectl.load_policy`` reads) generation runs under it; where it records a mask at every
    MoE layer (a controller, a subset) that mask is ω, else the router with the policy's k-hat
    (``option:K``) or ``k_hat`` (``switch_rate``'s ``source="auto"``).
    """
    prompts = load_prompts(prompts_path)
    loaded = load_policy(policy, model) if policy is not None else []
    if k_hat is None and isinstance(loaded, PolicyConfig) and loaded.policy_type == "option":
        k_hat = loaded.k_hat  # the router as the option policy the file names
    info = inspect(model)
    _, trace = generate_traced(
        model, tokenizer, prompts, max_new_tokens, temperature, batch_size, seed,
        progress=progress, policies=loaded or None,
    )  # fmt: skip
    trace.meta["categories"] = [p.category for p in prompts]
    report = switch_rate(trace, k_hat=k_hat)
    by_category: dict[str, list[list[float]]] = {}
    for row, values in zip(report.rows, report.per_sequence_layer, strict=True):
        by_category.setdefault(prompts[row].category, []).append(values)
    result = {
        "model": model_spec,
        "family": info.family,
        "k_hat": report.k_hat,
        "policy": policy,
        "source": report.source,
        "top_k": info.top_k,
        "num_experts": info.num_experts,
        "moe_layers": [layer.layer_idx for layer in info.layers],
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "overall": {
            "mean": report.mean,
            "std": report.std,
            "n": len(report.rows),
            "per_layer": report.per_layer,
        },
        "categories": {cat: _summarise(vals) for cat, vals in by_category.items()},
    }
    if trace_path:
        result["trace"] = str(trace.save(trace_path))
    if plot_dir:
        from moectl.reporting.plots import model_label, plot_expert_activation, plot_switch_rate_per_layer

        out = Path(plot_dir)
        name = model_label(model_spec)  # its last two path parts: a title never wraps a long path
        under = f", under {model_label(policy)}" if policy else ""
        omega = f"k-hat = {report.k_hat}"
        if report.source == "allowed":
            sizes = torch.cat([trace.allowed[layer][trace.valid].sum(-1) for layer in trace.allowed]).unique()
            omega = "recorded ω" + (f", k-hat = {int(sizes[0])}" if len(sizes) == 1 else "")
        first = prompts[0]
        figure = plot_expert_activation(
            trace, out / "expert_activation_layer0.png", layer=0,
            k_hat=report.k_hat if report.source == "router" else None,
            title=f"Activated experts, MoE layer 0 (TE-MoE Fig. 2), {name}{under}",
            label=f"prompt 0 ({first.category}): {first.text!r}",
        )  # fmt: skip
        lines = {cat: v["per_layer"] for cat, v in result["categories"].items()}
        per_layer = plot_switch_rate_per_layer(
            lines, out / "switch_rate_per_layer.png", title=f"Switch rate per MoE layer ({omega})\n{name}{under}"
        )
        result["plots"] = [str(figure), str(per_layer)]
    return result
