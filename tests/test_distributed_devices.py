"""Models larger than one device: ``--device-map auto|balanced`` loading, and policies whose tensors sit
on another device than the layer they route.

No second accelerator here, so the "other device" is ``meta``: a layer's logits on meta and a policy's
masks, valid-token mask or row codes on the CPU. Any tensor a policy makes on a fixed device, or
hands to the layer without moving, fails loudly on meta (and would on a second GPU).
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import moectl
from moectl.distributed import Ranks, process_device
from moectl.models.load import load_model
from moectl.routing import ExpertMask
from moectl.routing.routing_state import RouteContext, RoutingState

B, T = 2, 5


def _state(info, layer: int = 0) -> RoutingState:
    """Layer ``layer``'s routing inputs on meta; the call's valid-token mask on the CPU (the input's device)."""
    e, d = info.layers[layer].num_experts, info.layers[layer].router.weight.shape[-1]
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :2] = False  # left padding
    ctx = RouteContext(batch=B, length=T, offset=0, valid=valid)
    logits = torch.empty(B, T, e, device="meta")
    return RoutingState(
        layer, logits, info.layers[layer].rule, ctx, hidden=torch.empty(B, T, d, device="meta")
    )


@pytest.mark.parametrize("shape", ["[E]", "[B,T,E]"])
def test_a_mask_on_the_cpu_restricts_a_layer_on_another_device(shape):
    info = moectl.inspect(moectl.tiny("olmoe"))
    keep = torch.tensor([True] * 4 + [False] * 4)
    mask = keep if shape == "[E]" else keep.expand(B, T, 8).clone()
    policy = ExpertMask({0: mask})
    policy.bind(info)
    state = _state(info)
    policy.apply(state)
    assert state.allowed is not None and state.allowed.device.type == "meta"
    assert state.allowed.shape == (B, T, 8)


@pytest.mark.parametrize("mode", ["greedy", "keyed"])
def test_a_controller_routes_a_layer_whatever_device_its_inputs_come_from(mode):
    from moectl.options.controller import build_controller
    from moectl.options.policy import ControllerPolicy
    from moectl.options.row_noise import row_codes

    info = moectl.inspect(moectl.tiny("olmoe"))
    ctrl = build_controller(info, 4).to("meta")  # the controller and the layer on one device ...
    policy = ControllerPolicy(ctrl, mode="greedy" if mode == "greedy" else "sample", record=True)
    if mode == "keyed":
        policy.key_rows(row_codes(0, 0, torch.arange(B)))  # ... the row codes and valid mask on the CPU
    policy.bind(info)
    for layer in range(info.num_moe_layers):
        state = _state(info, layer)
        policy.apply(state)
        assert state.allowed.device.type == "meta" and state.allowed.shape == (B, T, 8)
    record = policy.layer_records()[0]
    assert record.option.device.type == "meta" and record.switch.shape == (B, T)


@pytest.mark.parametrize("device_map", ["auto", "balanced"])
def test_a_device_map_loads_and_routes_like_the_plain_model(device_map):
    plain, _ = load_model("tiny:olmoe")
    mapped, _ = load_model("tiny:olmoe", device=device_map)  # the CLI's --device-map
    assert getattr(mapped, "hf_device_map", None)  # placed by accelerate (every module on the CPU here)
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = ExpertMask({i: torch.tensor([True] * 4 + [False] * 4) for i in range(2)})
    with torch.no_grad(), moectl.route(plain, mask, record=True) as a:
        want = plain(input_ids=ids).logits
    with torch.no_grad(), moectl.route(mapped, mask, record=True) as b:
        got = mapped(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    assert a.trace.chosen.keys() == b.trace.chosen.keys() == {0, 1, 2}
    for layer, chosen in a.trace.chosen.items():  # the trace of the mapped model is the plain model's
        assert torch.equal(b.trace.chosen[layer], chosen)
        assert bool((chosen < 4).all()) == (layer < 2)  # the masked layers chose among experts 0–3


def test_a_bad_device_map_and_one_over_several_processes_are_refused():
    with pytest.raises(ValueError, match=r"auto .* or balanced"):
        load_model("tiny:olmoe", device_map="sideways")
    with pytest.raises(ValueError, match="--device cuda"):
        process_device("auto", Ranks(rank=1, world=2, local_rank=1))
    assert process_device("cuda", Ranks(rank=1, world=2, local_rank=1)) == "cuda:1"
    assert process_device("cuda", Ranks()) == "cuda"


def test_every_verb_that_loads_a_model_takes_device_map():
    from moectl.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["inspect", "tiny:olmoe", "--device-map", "balanced"])
    assert result.exit_code == 0, result.output
    helps = [
        ["options", "train"], ["subset", "finetune"], ["eval"], ["roe", "tune"], ["switch-rate"],
        ["subset", "select"],
    ]  # fmt: skip
    for verb in helps:
        text = runner.invoke(app, [*verb, "--help"]).output
        assert "--device-map" in text, verb
