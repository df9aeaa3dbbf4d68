"""The trained controllers shipped in models/: each loads onto its base model, routes a forward
within its options, and its card's figures are those of its own training log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

import moectl
from moectl.models.load import load_model
from moectl.reporting.option_curves import summarise

MODELS = Path(__file__).resolve().parents[1] / "models"
SHIPPED = sorted(p for p in MODELS.glob("*-controller-*") if (p / "controller.json").exists())


def test_controllers_are_shipped():
    assert SHIPPED, "models/ holds no trained controller"


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_shipped_controller_loads_routes_and_reports_its_log(folder):
    card = ModelCard.load(folder / "README.md")
    model, tok = load_model(str(MODELS / card.data.base_model))
    ids = torch.tensor([tok("The history of the city begins with the river", verbose=False)["input_ids"]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    policy = moectl.load_policy(f"controller:{folder}", model)  # merges its adapters and routers
    assert policy.controller.k_hat == json.loads((folder / "controller.json").read_text())["k_hat"]
    with moectl.route(model, policy), torch.no_grad():
        routed = model(input_ids=ids).logits
    assert torch.isfinite(routed).all() and not torch.allclose(routed, plain, atol=1e-3)

    rows = [json.loads(line) for line in (folder / "training_log.jsonl").read_text().splitlines() if line]
    summary = summarise(folder.name, rows, 20)
    metrics = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert metrics["switch_rate"] == pytest.approx(summary["switch_rate"]["last_20"]["mean"], abs=1e-6)
    assert metrics["reward"] == pytest.approx(summary["reward"]["last_20"]["mean"], abs=1e-6)
