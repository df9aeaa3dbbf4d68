"""The moectl command line: tables printed, --json written, bad input refused clearly."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from moectl.cli import app

runner = CliRunner()


def test_inspect_json(tmp_path):
    out = tmp_path / "inspect.json"
    result = runner.invoke(app, ["inspect", "--tiny", "deepseek_v3", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output
    data = json.loads(out.read_text())
    assert data["family"] == "deepseek_v3"
    assert data["dense_layers"] == [0] and data["moe_layers"] == [1, 2]
    assert data["self_test"]["passed"] and data["router_rule"] == ["sigmoid_topk"]


def test_switch_rate_by_category_with_plot(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "def f(x):", "category": "code"},
                {"prompt": "import os", "category": "code"},
                {"prompt": "2 + 2 =", "category": "math"},
            ]
        )
    )
    out = tmp_path / "sr.json"
    result = runner.invoke(
        app,
        [
            "switch-rate",
            "--tiny",
            "qwen3_moe",
            "--k-hat",
            "4",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "12",
            "--plot",
            str(tmp_path / "plots"),
            "--trace",
            str(tmp_path / "trace"),
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["categories"]) == {"code", "math"}
    assert data["categories"]["code"]["n"] == 2 and data["k_hat"] == 4
    assert len(data["overall"]["per_layer"]) == 3
    assert 0.0 <= data["overall"]["mean"] <= 1.0
    assert (tmp_path / "plots" / "expert_activation_layer0.png").stat().st_size > 1000
    assert (tmp_path / "trace.safetensors").exists()


def test_model_and_tiny_are_exclusive():
    result = runner.invoke(app, ["inspect", "some/model", "--tiny", "olmoe"])
    assert result.exit_code != 0
    assert "exactly one of MODEL" in result.output


def test_unknown_family_and_bad_prompts(tmp_path):
    result = runner.invoke(app, ["inspect", "--tiny", "nonesuch"])
    assert result.exit_code == 2 and "no tiny config for family 'nonesuch'" in result.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    result = runner.invoke(
        app, ["switch-rate", "--tiny", "olmoe", "--prompts", str(bad), "--max-new-tokens", "2"]
    )
    assert result.exit_code == 2 and 'needs a string "prompt" or "text" field' in result.output


def test_missing_checkpoint_path():
    result = runner.invoke(app, ["inspect", "./no/such/dir"])
    assert result.exit_code == 2 and "neither a checkpoint directory nor a hub id" in result.output


def test_demo_json(tmp_path):
    out = tmp_path / "demo.json"
    result = runner.invoke(
        app, ["demo", "--max-new-tokens", "8", "--out", str(tmp_path / "fig"), "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["self_test_passed"]
    assert (
        data["mask_half_experts"]["chosen_inside_mask"] and data["document_pool_causal"]["chosen_inside_pool"]
    )


def test_inspect_local_checkpoint(tmp_path):
    import moectl

    moectl.tiny("mixtral").save_pretrained(tmp_path / "ckpt")
    result = runner.invoke(app, ["inspect", str(tmp_path / "ckpt"), "--json", str(tmp_path / "i.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "i.json").read_text())["family"] == "mixtral"


def test_errors_go_to_standard_error():
    """A verb's standard output is its results (tables, JSON on stdout); ``error: …`` is on stderr."""
    result = runner.invoke(app, ["inspect", "--tiny", "nonesuch"])
    assert result.exit_code == 2
    assert "no tiny config for family 'nonesuch'" in result.stderr
    assert "error" not in result.stdout
