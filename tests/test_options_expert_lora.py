"""Expert LoRA on the selected experts' activations equals PEFT's materialised expert LoRA."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict

import moectl
from moectl.models.peft_quiet import get_peft_model
from moectl.options.controller import build_controller
from moectl.options.expert_lora import (
    ExpertLoRA,
    _peft_keys,
    add_expert_lora,
    expert_lora_modules,
    expert_lora_state_dict,
    load_expert_lora_state_dict,
    merge_expert_lora,
)
from moectl.options.option_state import load_controlled, load_weights, save_folder
from moectl.options.teacher import add_lora, expert_parameter_names, teacher_mode


def _peft_experts(model, r=4, alpha=8):
    """PEFT's LoRA on the fused expert parameters only, with random (non-zero) A and B."""
    names = expert_parameter_names(model, moectl.inspect(model))
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_parameters=names))
    g = torch.Generator().manual_seed(1)
    state = {
        k: 0.1 * torch.randn(v.shape, generator=g) for k, v in get_peft_model_state_dict(peft_model).items()
    }
    set_peft_model_state_dict(peft_model, state)
    return peft_model, state


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "gpt_oss"])  # gpt_oss: biases, [E, in, out]
def test_forward_and_gradients_equal_peft(family):
    model = moectl.tiny(family)
    cheap = copy.deepcopy(model)
    peft_model, state = _peft_experts(model)
    params = add_expert_lora(cheap, r=4, alpha=8)
    # the same A and B, read from PEFT's keys (the layout is PEFT's, so this is a copy, no reshaping)
    assert load_expert_lora_state_dict(cheap, state) == set(state)
    assert set(expert_lora_state_dict(cheap)) == set(state)
    ids = torch.randint(3, 200, (3, 10), generator=torch.Generator().manual_seed(0))
    a = peft_model(input_ids=ids).logits
    b = cheap(input_ids=ids).logits
    assert torch.allclose(a, b, atol=2e-5), float((a - b).abs().max())
    a.square().mean().backward()
    b.square().mean().backward()
    peft_grads = {n: p.grad for n, p in peft_model.named_parameters() if p.grad is not None}
    checked = 0
    for name, module in expert_lora_modules(cheap):  # gradients reach A and B, equal to PEFT's
        for (proj, which), key in _peft_keys(name, module.experts).items():
            grad = (module.lora_A if which == "A" else module.lora_B)[proj].grad
            peft_key = key.replace(".weight", ".default.weight")
            assert grad is not None and grad.abs().sum() > 0, key
            assert torch.allclose(grad, peft_grads[peft_key], atol=1e-5, rtol=1e-4), key
            checked += 1
    assert checked == len(state)
    # the experts' own weights are frozen: of the experts modules, only the factors train
    for _, module in expert_lora_modules(cheap):
        assert all(not p.requires_grad and p.grad is None for p in module.experts.parameters())
    assert {id(p) for _, m in expert_lora_modules(cheap) for p in m.parameters() if p.requires_grad} == {
        id(p) for p in params
    }


def test_disabled_and_merged_are_the_plain_and_the_adapted_model():
    model = moectl.tiny("qwen2_moe")
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        add_expert_lora(model, r=4, alpha=4)
        for _, module in expert_lora_modules(model):
            for p in module.lora_B.values():
                p.normal_(0, 0.1)
        adapted = model(input_ids=ids).logits
        for _, module in expert_lora_modules(model):
            module.enabled = False
        off = model(input_ids=ids).logits
        for _, module in expert_lora_modules(model):
            module.enabled = True
        merged = merge_expert_lora(model)(input_ids=ids).logits
    assert not torch.allclose(adapted, plain, atol=1e-3)
    assert torch.allclose(off, plain, atol=1e-6)
    assert torch.allclose(merged, adapted, atol=2e-5)
    assert not any(isinstance(m, ExpertLoRA) for m in model.modules())  # unwrapped


def test_add_lora_saves_a_folder_peft_loads_and_options_merge(tmp_path):
    model = moectl.tiny("olmoe")
    original = copy.deepcopy(model)
    info = moectl.inspect(model)
    peft_model, snapshot = add_lora(model, info, r=4, alpha=8)
    assert expert_lora_modules(peft_model) and not any(
        "experts" in k for k in peft_model.peft_config["default"].target_modules
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    info = moectl.inspect(peft_model)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        trained = peft_model(input_ids=ids).logits
        with teacher_mode(peft_model, info, snapshot):  # adapters off (attention and experts)
            teacher = peft_model(input_ids=ids).logits
        base = original(input_ids=ids).logits
    assert torch.allclose(teacher, base, atol=1e-5) and not torch.allclose(trained, base, atol=1e-3)
    folder = save_folder(tmp_path / "final", build_controller(info, 4), peft_model, info, {"k_hat": 4})
    config = json.loads((folder / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]

    # PEFT alone reads the folder: its ParamWrapper (materialised) gives the same logits
    from safetensors.torch import load_file

    plain_peft = get_peft_model(
        copy.deepcopy(original),
        LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"], target_modules=config["target_modules"],
                   target_parameters=config["target_parameters"]),
    )  # fmt: skip
    result = set_peft_model_state_dict(plain_peft, load_file(str(folder / "adapter.safetensors")))
    assert not [k for k in result.missing_keys if "lora_" in k]
    with torch.no_grad():
        assert torch.allclose(plain_peft(input_ids=ids).logits, trained, atol=2e-5)

    # moectl's loader: the adapters merged into a plain model (what eval --controller runs)
    merged, _, _, _ = load_controlled(copy.deepcopy(original), folder, merge=True)
    assert not any(isinstance(m, ExpertLoRA) for m in merged.modules()) and not hasattr(merged, "peft_config")
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, trained, atol=2e-5)

    # unmerged (options runs reload and resume): the cheap modules again, same weights
    again, _, _, _ = load_controlled(copy.deepcopy(original), folder, merge=False)
    assert expert_lora_modules(again)
    with torch.no_grad():
        assert torch.allclose(again(input_ids=ids).logits, trained, atol=1e-6)
    fresh, _ = add_lora(copy.deepcopy(original), moectl.inspect(original), r=4, alpha=8)
    load_weights(folder, fresh, moectl.inspect(fresh))
    with torch.no_grad():
        assert torch.allclose(fresh(input_ids=ids).logits, trained, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])  # gpt_oss: biases gathered per padded row
def test_padded_groups_under_bf16_autocast_change_nothing(family, monkeypatch):
    """On the CPU in bf16 the groups are padded (``cpu_pad``: oneDNN compiles a kernel per new group
    size); outputs and the factors' gradients are those of the unpadded grouping."""
    import moectl.options.expert_lora as expert_lora

    model = moectl.tiny(family)
    add_expert_lora(model, r=4, alpha=8)
    g = torch.Generator().manual_seed(2)
    for _, module in expert_lora_modules(model):
        for p in module.parameters():
            if p.requires_grad:
                p.data = 0.1 * torch.randn(p.shape, generator=g)
    ids = torch.randint(3, 200, (4, 160), generator=torch.Generator().manual_seed(0))
    pads, results, real = [], [], expert_lora.cpu_pad
    for force_plain in (False, True):
        if force_plain:
            monkeypatch.setattr(expert_lora, "cpu_pad", lambda *a: 1)
        else:
            monkeypatch.setattr(expert_lora, "cpu_pad", lambda *a: pads.append(real(*a)) or pads[-1])
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits.float()
        logits.square().mean().backward()
        grads = [
            p.grad.clone() for _, m in expert_lora_modules(model) for p in m.parameters() if p.requires_grad
        ]
        results.append((logits, grads))
    assert pads and all(p == 32 for p in pads)  # the padded path ran
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b)


def test_adapters_over_a_bf16_model_are_float32_and_train():
    """PEFT keeps adapters over a half-precision base in float32 (``autocast_adapter_dtype``): so do
    the expert adapters, and an AdamW step moves them where bf16 factors would round it away."""
    model = moectl.tiny("qwen2_moe").to(torch.bfloat16)
    params = add_expert_lora(model, r=4, alpha=8)
    assert params and all(p.dtype == torch.float32 for p in params)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    logits.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    a_factors = [p for _, m in expert_lora_modules(model) for p in m.lora_A.values()]
    before = [p.detach().clone() for p in a_factors]
    torch.optim.AdamW(params, lr=1e-5).step()
    # every entry of A (≈ 0.1 in size) moves by ≈ 1e-5; in bf16 (spacing ≈ 5e-4 there) ≈ 4% would
    for p, b in zip(a_factors, before, strict=True):
        assert (p != b).float().mean() > 0.99
