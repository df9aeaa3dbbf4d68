"""int8 resident slots (offload/int8.py): the quantiser's error bound, the kernel against its reference,
and an offloaded model with int8 slots computing exactly the model whose expert weights were
quantised and dequantised — in the grouped forward, the eager fallback and other layouts."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

import moectl
from _serve_helpers import greedy, prompt
from moectl.cli import app
from moectl.offload import OffloadConfig, offload
from moectl.offload.int8 import dequantize_rows, expert_slot_bytes, int8_linear, quantize_rows
from moectl.offload.plan import plan_memory

torch.set_num_threads(1)


def test_quantised_weights_are_within_half_a_step_of_the_original():
    w = torch.randn(4, 48, 80) * torch.logspace(-3, 1, 48)[None, :, None]  # rows of very different scales
    w[0, 3] = 0  # an all-zero row: no division by zero
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (4, 48)
    assert q.abs().max() <= 127
    err = (dequantize_rows(q, scale) - w).abs()
    assert (err <= scale.unsqueeze(-1) * (0.5 + 1e-5)).all()
    assert torch.equal(dequantize_rows(q, scale)[0, 3], torch.zeros(80))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "width"), [(1, 64), (3, 2048), (5, 48), (2, 40), (40, 64)])
def test_int8_linear_equals_the_dequantised_product(dtype, rows, width):
    """The kernel (width a multiple of 16, few rows) and the fallback (other widths, many rows) both
    compute x @ (q·s)ᵀ: within the output dtype's rounding of the product's magnitude."""
    g = torch.Generator().manual_seed(width + rows)
    x = torch.randn(rows, width, generator=g).to(dtype)
    q, scale = quantize_rows(torch.randn(96, width, generator=g).to(dtype))
    out = int8_linear(x, q, scale)
    reference = x.double() @ dequantize_rows(q.double(), scale.double()).T
    magnitude = x.double().abs() @ dequantize_rows(q.double(), scale.double()).abs().T
    eps = torch.finfo(dtype).eps
    assert out.dtype == dtype
    assert ((out.double() - reference).abs() <= 4 * eps * magnitude + 1e-6).all()


def _dequantised_copy(model):
    """``model`` with every expert weight replaced by its int8 round trip."""
    model = copy.deepcopy(model)
    info = moectl.inspect(model)
    with torch.no_grad():
        for layer in info.layers:
            for p in layer.block.experts.parameters(recurse=False):
                if p.dim() == 3:
                    p.copy_(dequantize_rows(*quantize_rows(p)))
    return model


@pytest.mark.parametrize(
    ("family", "budget", "length"),
    [
        ("olmoe", 3, 6),  # grouped forward over int8 slots
        ("qwen2_moe", 2, 24),  # a prefill wider than the budget: the eager loop over dequantised views
        ("gpt_oss", 3, 6),  # biases and a transposed layout: the eager loop, biases kept as they are
    ],
)
def test_int8_slots_compute_the_dequantised_model(family, budget, length):
    model = moectl.tiny(family)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = prompt(3, length=length)
    reference_model = _dequantised_copy(model)
    reference = greedy(reference_model, ids)
    with torch.no_grad():
        reference_logits = reference_model(reference).logits
    with offload(model, OffloadConfig(budget=budget, store="host", slot_dtype="int8")) as rt:
        tokens = greedy(model, ids)
        with torch.no_grad():
            logits = model(reference).logits
        assert any(t.dtype == torch.int8 for r in rt.resident_sets for t in r.slots.values())
    assert torch.equal(tokens, reference)
    torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)
    for name, p in model.named_parameters():  # leaving the block restores the original weights exactly
        assert torch.equal(p, original[name]), name


def test_int8_slots_hold_int8_weights_and_scales_and_the_plan_counts_them():
    model = moectl.tiny("olmoe").to(torch.bfloat16)
    info = moectl.inspect(model)
    experts = info.layers[0].block.experts
    params = {n: p for n, p in experts.named_parameters(recurse=False)}
    bf16 = sum(p[0].numel() * 2 for p in params.values())
    int8 = sum(p[0].numel() + p.shape[1] * 4 for p in params.values())  # weights + one float32 scale per row
    assert expert_slot_bytes(params, "int8") == int8 < 0.6 * bf16
    with offload(model, OffloadConfig(budget=3, store="host", slot_dtype="int8")) as rt:
        greedy(model, prompt(), n=2)
        totals = rt.totals()
    assert totals["resident_expert_bytes"] == 3 * int8 * len(info.layers)
    assert totals["stored_expert_bytes"] == [bf16] * len(info.layers)
    plan = plan_memory(model, [3] * len(info.layers), [2] * len(info.layers), "int8")
    assert plan.resident_expert_bytes == 3 * int8 * len(info.layers)


def test_unknown_slot_dtype_refused():
    with pytest.raises(ValueError, match="slot dtype must be one of same, int8"):
        OffloadConfig(slot_dtype="int4")
    result = CliRunner().invoke(app, ["serve-offload", "--tiny", "olmoe", "--slot-dtype", "fp8"])
    assert result.exit_code == 2
    assert "--slot-dtype must be one of same, int8" in " ".join(result.output.split())


def test_serve_offload_with_int8_slots(tmp_path):
    """The verb reports int8 slots: a quarter of float32's resident bytes (+ scales), the same
    checkpoint size, the setting in the JSON."""
    reports = {}
    for slot_dtype in ("same", "int8"):
        out = tmp_path / f"{slot_dtype}.json"
        args = [
            "serve-offload",
            "--tiny",
            "olmoe",
            "--budget",
            "4",
            "--store",
            "host",
            "--max-new-tokens",
            "4",
        ]
        result = CliRunner().invoke(app, [*args, "--slot-dtype", slot_dtype, "--json", str(out)])
        assert result.exit_code == 0, result.output
        reports[slot_dtype] = json.loads(out.read_text())
    same, int8 = reports["same"], reports["int8"]
    assert int8["config"]["slot_dtype"] == "int8"
    assert int8["total_expert_bytes"] == same["total_expert_bytes"]
    assert 0.25 < int8["resident_expert_bytes"] / same["resident_expert_bytes"] < 0.3
