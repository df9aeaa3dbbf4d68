"""``moectl inspect``: family, MoE layers, experts, top-k, shared experts, router rule, self-test."""

from __future__ import annotations

from moectl.adapters.inspect import inspect
from moectl.adapters.selftest import self_test
from moectl.models.load import load_model


def run_inspect(model_spec: str, seed: int = 0) -> dict:
    model, _ = load_model(model_spec, seed=seed, with_tokenizer=False)
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
