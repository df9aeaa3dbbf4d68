"""Self-test tolerance from the weights' dtype: bf16/fp16 models pass, broken rules still fail."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import moectl
from moectl.adapters import registry
from moectl.adapters.selftest import ULPS, tolerance

SMALL = Path(__file__).resolve().parents[1] / "models" / "moectl-small-standard"  # bf16, shipped in the repo


@pytest.fixture(scope="module")
def small():
    if not (SMALL / "config.json").exists():
        pytest.skip("models/moectl-small-standard is not in this checkout")
    return AutoModelForCausalLM.from_pretrained(SMALL).eval()


def _broken(info, **changes):
    """``info`` with every layer's rule changed."""
    layers = [
        dataclasses.replace(layer, rule=dataclasses.replace(layer.rule, **changes)) for layer in info.layers
    ]
    return dataclasses.replace(info, layers=layers)


def test_tolerance_is_eps_of_the_dtype_times_the_weights_scale():
    assert tolerance(torch.bfloat16, 0.5) == ULPS * 2**-7 * 0.5
    assert tolerance(torch.float32, 2.5) == ULPS * torch.finfo(torch.float32).eps * 2.5


@torch.no_grad()
def test_shipped_bf16_model_passes(small):
    result = moectl.self_test(small)
    assert next(small.parameters()).dtype == torch.bfloat16
    assert result.passed, str(result)
    assert result.dtype == "bfloat16" and result.index_mismatches == 0
    assert 0 < result.max_weight_error <= result.tolerance  # bf16 rounding of the weights, explained
    assert result.max_weight_error > 1e-5  # the old float32 tolerance would have failed it


@torch.no_grad()
def test_broken_rules_still_fail_in_bf16(small):
    info = moectl.inspect(small)
    wrong_indices = moectl.self_test(small, _broken(info, n_group=4, topk_group=1))
    assert not wrong_indices.passed and wrong_indices.index_mismatches > 0
    wrong_weights = moectl.self_test(
        small, _broken(info, norm_topk_prob=True)
    )  # the model does not renormalise
    assert not wrong_weights.passed and wrong_weights.index_mismatches == 0
    assert wrong_weights.max_weight_error > 10 * wrong_weights.tolerance
    assert not moectl.self_test(small, info, atol=1e-5).passed  # an explicit tolerance is honoured


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "family", ["olmoe", "qwen3_moe", "deepseek_v3", "gpt_oss", "deepseek_v2", "phimoe", "emo"]
)
def test_half_precision_tiny_models_pass(family, dtype):
    result = moectl.self_test(moectl.tiny(family).to(dtype))
    assert result.passed, str(result)


@torch.no_grad()
def test_broken_bare_linear_family_fails(monkeypatch):
    model = moectl.tiny("emo")
    family = registry.gate_families()["EmoSparseMoeBlock"]
    monkeypatch.setitem(
        registry._GATES, family.block_class, dataclasses.replace(family, finish=lambda b, g, w, i: (w, i))
    )
    result = moectl.self_test(model)  # the shared expert dropped: the block's own selection disagrees
    assert not result.passed and result.index_mismatches == result.tokens * result.layers_checked
    monkeypatch.setitem(registry._GATES, family.block_class, family)
    broken = moectl.self_test(model, _broken(moectl.inspect(model), scaling=0.9))
    assert moectl.self_test(model).passed and not broken.passed
