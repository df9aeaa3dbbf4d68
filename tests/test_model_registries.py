"""moectl stamps no attribute on a user's model: what it remembers about a model or one of its modules
(the controller merged into it, a remote-code block's GateRouter, the pending delta of lazy experts)
lives in a registry keyed weakly by the module, and the entry goes when the model does."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import moectl
from moectl.adapters import linear_gate
from moectl.offload import delta_store
from moectl.offload.delta_store import pending_delta, set_pending_delta
from moectl.options import ControllerPolicy, build_controller
from moectl.options import policy as controller_policy
from moectl.options.expert_lora import PendingExpertLoRA
from moectl.routing import ExpertMask, load_policy, route

torch.set_num_threads(1)


def moectl_attributes(model: nn.Module) -> list[str]:
    """Every ``NAME.attr`` of ``model``'s modules whose attribute name mentions moectl."""
    return [f"{name}.{a}" for name, m in model.named_modules() for a in vars(m) if "moectl" in a]


def _gone(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


def test_a_merged_controller_is_remembered_beside_the_model(tmp_path):
    model = moectl.load("tiny:olmoe")[0]
    folder = tmp_path / "ctrl"
    ControllerPolicy(build_controller(moectl.inspect(model), k_hat=4)).save(folder)
    policy = load_policy(folder, model)  # merges the controller's (here untrained) weights into model
    assert controller_policy.merged_controller(model) == str(folder.resolve())
    assert load_policy(folder, model).path == policy.path  # the same controller again: accepted
    assert moectl_attributes(model) == []
    ref, before = weakref.ref(model), len(controller_policy._MERGED)
    del model, policy
    assert _gone(ref) and len(controller_policy._MERGED) == before - 1


@torch.no_grad()
def test_a_gate_router_is_kept_beside_its_block():
    model = moectl.tiny("emo")  # a remote-code block with a bare gate Linear: linear_gate's GateRouter
    info = moectl.inspect(model)
    routers = [layer.router for layer in info.layers]
    assert all(isinstance(r, linear_gate.GateRouter) for r in routers)
    assert [layer.router for layer in moectl.inspect(model).layers] == routers  # one router per block
    with route(model, ExpertMask.everywhere(info, range(4))):
        model(torch.tensor([[5, 6, 7]]))
        assert moectl_attributes(model) == []
    assert moectl_attributes(model) == []
    ref, before, blocks = weakref.ref(model), len(linear_gate._ROUTERS), info.num_moe_layers
    del model, info, routers
    assert _gone(ref) and len(linear_gate._ROUTERS) == before - blocks


def test_a_pending_delta_is_kept_beside_its_experts():
    model = moectl.load("tiny:olmoe")[0]
    experts = moectl.inspect(model).layers[0].block.experts
    pending = PendingExpertLoRA(experts, {}, r=4, alpha=8.0)
    set_pending_delta(experts, pending)
    assert pending_delta(experts) is pending and moectl_attributes(model) == []
    ref, before = weakref.ref(experts), len(delta_store._PENDING)
    del model, experts
    assert _gone(ref) and len(delta_store._PENDING) == before - 1
