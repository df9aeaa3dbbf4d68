"""Serving under a trained controller: only the current option is resident (TE-MoE §3.2)."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

import moectl
from moectl.cli.serve_offload import serve_app
from moectl.models.load import load_model
from moectl.offload import offload
from moectl.offload.residency import ControllerResidency
from moectl.options.controller import build_controller
from moectl.options.policy import ControllerPolicy
from moectl.options.trainer import OptionsConfig, train_options
from moectl.routing.kv_cache import cache_out, with_cache


@torch.no_grad()
def _greedy(model, ids: torch.Tensor, steps: int = 8) -> torch.Tensor:
    out = model(input_ids=ids, use_cache=True)
    cache, tokens = cache_out(out), [out.logits[:, -1].argmax(-1)]
    for _ in range(steps - 1):
        out = model(input_ids=tokens[-1][:, None], **with_cache(cache), use_cache=True)
        cache = cache_out(out)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, 1)


def test_controller_residency_equals_in_memory_controller():
    model = moectl.tiny("qwen2_moe")
    info = moectl.inspect(model)
    ctrl = build_controller(info, 4)
    with torch.no_grad():
        for layer in ctrl.layers:
            layer.termination[-1].bias.fill_(-1.0)  # some switches
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    with moectl.route(model, ControllerPolicy(ctrl, seed=3)):
        reference = _greedy(model, ids)
    with offload(model, 4, ControllerResidency(ctrl, seed=3), store="host") as rt:
        with moectl.route(model, rt.policy.routing(rt.info)):
            out = _greedy(model, ids)
        options = [set(rt.policy.route_policy.current_option[i][0].nonzero().flatten().tolist()) for i in range(3)]
        assert [set(r.resident) for r in rt.resident_sets] == options
    assert torch.equal(out, reference)


def test_cli_serve_offload_with_a_trained_controller(tmp_path):
    model, tok = load_model("tiny:olmoe")
    cfg = OptionsConfig(k_hat=4, steps=1, batch_size=2, max_new_tokens=4, lora_r=4, lora_alpha=4)
    train_options(model, tok, ["hello", "world"], cfg, tmp_path / "ctl", progress=False)
    out = tmp_path / "serve.json"
    args = ["--tiny", "olmoe", "--budget", "4", "--policy", f"controller:{tmp_path / 'ctl'}", "--max-new-tokens", "4"]
    result = CliRunner().invoke(serve_app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["policy"] == "controller:4" and data["generated_tokens"] > 0
