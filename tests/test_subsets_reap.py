"""REAP (router-weighted mean expert output norm): hand computation, streamed = all at once, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from tests.test_subsets_select import calibration, hand_expert
from typer.testing import CliRunner

import moectl
from moectl.cli import app
from moectl.subsets import select_subset
from moectl.subsets.calibrate import block_inputs
from moectl.subsets.methods import reap_scores
from moectl.subsets.scores import top_experts

runner = CliRunner()


@pytest.fixture(scope="module")
def toy():
    model = moectl.tiny("olmoe", num_experts=4, num_experts_per_tok=2)  # softmax -> top-2, no renorm
    info = moectl.inspect(model)
    ids, mask = calibration(batch=2, length=6)
    return info, block_inputs(model, info, ids, mask, layers=[0])[0]


@torch.no_grad()
def test_reap_matches_hand_computation(toy):
    info, x = toy
    layer = info.layers[0]
    logits = x @ layer.router.weight.T
    sums, counts = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    for t in range(x.shape[0]):
        p = torch.softmax(logits[t], dim=-1)
        for i in sorted(range(4), key=lambda i: -float(p[i]))[:2]:
            sums[i] += float(p[i] * hand_expert(layer, x[t : t + 1], i)[0].norm())
            counts[i] += 1
    expected = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    torch.testing.assert_close(reap_scores(layer, x), expected, rtol=1e-5, atol=1e-9)
    assert (counts > 0).sum() >= 2
    # a mean, not a sum: doubling the calibration set leaves the scores as they are
    torch.testing.assert_close(reap_scores(layer, torch.cat([x, x])), expected, rtol=1e-5, atol=1e-9)


@torch.no_grad()
def test_an_expert_no_token_reaches_scores_zero(toy):
    info, x = toy
    layer = info.layers[0]
    one = x[:1]  # one token reaches exactly two experts
    scores = reap_scores(layer, one)
    assert int((scores > 0).sum()) == 2 and int((scores == 0).sum()) == 2


@torch.no_grad()
def test_streamed_selection_equals_the_all_at_once_scores():
    model = moectl.tiny("qwen3_moe")
    info = moectl.inspect(model)
    ids, mask = calibration(batch=3, length=10)
    inputs = block_inputs(model, info, ids, mask)
    expected = {layer.index: top_experts(layer, reap_scores(layer, inputs[layer.index]), 3) for layer in info.layers}
    assert select_subset(model, ids, 3, "reap", mask, info=info, batch_size=1) == expected


def test_cli_subset_select_and_baselines(tmp_path):
    data = tmp_path / "calib.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in ["1 + 1 = 2", "the cat sat on the mat"]) + "\n")
    out = tmp_path / "reap.json"
    result = runner.invoke(
        app, ["subset", "select", "tiny:olmoe", "--data", str(data), "--keep", "4", "--method", "reap",
              "--out", str(tmp_path / "reap.subset.json"), "--json", str(out)]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert all(len(v) == 4 for v in json.loads(out.read_text())["keep"].values())
    result = runner.invoke(
        app, ["baselines", "tiny:olmoe", "--k-hat", "4", "--method", "reap", "--calib", str(data),
              "--json", str(tmp_path / "b.json")]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "b.json").read_text())["method"] == "reap"
