"""TE-MoE's pruning baselines (§5, A2): fixed masks, the per-token random policy, ``moectl baselines``."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import moectl
from moectl.cli import app
from moectl.models.load import ByteTokenizer
from moectl.options.baselines import BASELINES, baseline_keep, baseline_policy, calibration_batch
from moectl.options.random_options import RandomOptions
from moectl.routing import ExpertMask
from moectl.subsets import load_subset

runner = CliRunner()
TEXTS = ["1 + 1 = 2 and 2 + 2 = 4", "Der schnelle braune Fuchs", "def f(x):\n    return x * x"]


@pytest.mark.parametrize("method", ["frequency", "reconstruction", "wanda"])
def test_fixed_baselines_keep_k_hat_experts_deterministically(olmoe, method):
    tok = ByteTokenizer()
    policy = baseline_policy(olmoe, tok, method, 4, TEXTS, seed=0, max_length=32)
    again = baseline_policy(olmoe, tok, method, 4, TEXTS, seed=0, max_length=32)
    assert isinstance(policy, ExpertMask) and policy.renorm == "pruned"
    info = moectl.inspect(olmoe)
    assert sorted(policy.masks) == [layer.index for layer in info.layers]
    for layer, mask in policy.masks.items():
        assert mask.shape == (info.num_experts,) and int(mask.sum()) == 4
        assert torch.equal(mask, again.masks[layer])


def test_frequency_equals_a_hand_count(olmoe):
    tok = ByteTokenizer()
    batch = calibration_batch(olmoe, tok, TEXTS, max_length=16)
    keep = baseline_keep(olmoe, batch, "frequency", 3)
    valid = batch["attention_mask"].bool()
    with torch.no_grad(), moectl.route(olmoe, record=True) as session:
        olmoe(**batch)
    for layer, chosen in session.trace.chosen.items():
        counts = torch.bincount(chosen[valid].reshape(-1), minlength=8)
        order = torch.sort(-counts, stable=True).indices[:3]  # ties to the lower id
        assert keep[layer] == sorted(order.tolist())


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_random_options_redraws_per_token_and_routing_stays_inside(family):
    model = moectl.tiny(family)
    info = moectl.inspect(model)
    ids = torch.randint(3, 259, (2, 12), generator=torch.Generator().manual_seed(0))

    def run(seed: int):
        with torch.no_grad(), moectl.route(model, [RandomOptions(4, seed)], record=True) as session:
            model(ids)
        return session.trace

    trace = run(0)
    for layer in info.layers:
        allowed, chosen = trace.allowed[layer.index], trace.chosen[layer.index]
        assert allowed.shape == (2, 12, 8) and bool((allowed.sum(-1) == 4).all())
        assert bool(allowed.gather(-1, chosen).all())  # top-k inside the token's allowed set
        assert allowed.reshape(-1, 8).unique(dim=0).shape[0] > 1  # a fresh set per token
        groups = layer.rule.n_group
        per_group = allowed.reshape(2, 12, groups, 8 // groups).sum(-1)
        assert bool((per_group == 4 // groups).all())
    assert all(
        torch.equal(a, b) for a, b in zip(trace.allowed.values(), run(0).allowed.values(), strict=True)
    )
    assert any(
        not torch.equal(a, b) for a, b in zip(trace.allowed.values(), run(1).allowed.values(), strict=True)
    )


def test_random_baseline_policy_and_k_hat_range(olmoe):
    policy = baseline_policy(olmoe, ByteTokenizer(), "random", 3, seed=7)
    assert isinstance(policy, RandomOptions) and policy.k_hat == 3 and policy.seed == 7
    info = moectl.inspect(olmoe)
    for bad in (1, 9):
        with pytest.raises(ValueError, match=r"allowed k-hat: 2\.\.8"):
            RandomOptions(bad).bind(info)
        with pytest.raises(ValueError, match=r"allowed k-hat: 2\.\.8"):
            baseline_policy(olmoe, ByteTokenizer(), "frequency", bad, TEXTS)
    with pytest.raises(ValueError, match="positive integer"):
        RandomOptions(0)
    with pytest.raises(ValueError, match="frequency, reconstruction, random, wanda"):
        baseline_policy(olmoe, ByteTokenizer(), "magnitude", 4, TEXTS)
    assert BASELINES == ("frequency", "reconstruction", "random", "wanda", "reap")


def test_calibration_appends_generated_responses(olmoe):
    tok = ByteTokenizer()
    plain = calibration_batch(olmoe, tok, TEXTS, max_length=16)
    grown = calibration_batch(olmoe, tok, TEXTS, max_length=16, generate_tokens=6)
    assert grown["input_ids"].shape[1] <= 16 + 6
    assert int(grown["attention_mask"].sum()) > int(plain["attention_mask"].sum())
    again = calibration_batch(olmoe, tok, TEXTS, max_length=16, generate_tokens=6)
    assert torch.equal(grown["input_ids"], again["input_ids"])


def test_cli_writes_subset_file_and_report(tmp_path):
    calib = tmp_path / "calib.jsonl"
    calib.write_text(
        "\n".join(json.dumps({"text": t}) for t in TEXTS[:2]) + "\n" + json.dumps({"prompt": TEXTS[2]})
    )
    out, report = tmp_path / "masks.json", tmp_path / "report.json"
    args = ["baselines", "tiny:olmoe", "--k-hat", "4", "--method", "frequency", "--calib", str(calib),
            "--max-length", "32", "--out", str(out), "--json", str(report)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "frequency baseline" in result.output
    subset = load_subset(out, moectl.inspect(moectl.tiny("olmoe")))
    assert subset.method == "frequency" and all(len(ids) == 4 for ids in subset.keep.values())
    data = json.loads(report.read_text())
    assert data["keep"] == {str(k): v for k, v in subset.keep.items()}
    assert data["calibration"]["documents"] == 3 and data["per_token"] is False

    result = runner.invoke(app, ["baselines", "tiny:olmoe", "--k-hat", "4", "--method", "random",
                                 "--json", str(tmp_path / "random.json")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "redrawn at every token" in result.output
    assert json.loads((tmp_path / "random.json").read_text())["per_token"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--k-hat", "4", "--method", "magnitude"], "frequency, reconstruction, random, wanda"),
        (["--k-hat", "9", "--method", "random"], "allowed k-hat: 2..8"),
        (["--k-hat", "1", "--method", "frequency"], "allowed k-hat: 2..8"),
        (["--k-hat", "4", "--method", "random", "--out", "m.json"], "no fixed mask"),
        (["--k-hat", "4", "--method", "wanda", "--generate", "-1"], "--generate must be >= 0"),
    ],
)
def test_cli_refuses_bad_values(tmp_path, args, message):
    result = runner.invoke(app, ["baselines", "tiny:olmoe", *args, "--calib", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
