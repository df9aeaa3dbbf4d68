"""A subset, expert mask or RoE tau profile made for another model is refused, naming both models;
``--force`` applies it anyway (issue #43 item 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import moectl
from moectl.cli import app
from moectl.routing.made_for import MadeForAnotherModelError, policy_target, same_model
from moectl.subsets.files import save_subset

runner = CliRunner()
KEEP = {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [0, 1, 2, 3]}


def test_same_model_tells_one_model_from_another(tmp_path, monkeypatch):
    (tmp_path / "models" / "a").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert same_model("models/a", str(tmp_path / "models" / "a"))  # one folder, two spellings
    assert same_model("allenai/OLMoE-1B-7B-0924", "/data/OLMoE-1B-7B-0924")  # a hub id and a local copy
    assert not same_model("models/a", "models/b")
    assert not same_model("tiny:olmoe", "tiny:mixtral") and not same_model("tiny:olmoe", "olmoe")


def test_a_subset_of_another_model_is_refused_naming_both_and_forced_applies(tmp_path):
    model, _, _ = moectl.load("tiny:olmoe")
    path = save_subset(tmp_path / "s.json", KEEP, model="tiny:mixtral", num_experts=8)
    with policy_target("tiny:olmoe"), pytest.raises(MadeForAnotherModelError) as err:
        moectl.load_policy(path, model)
    assert str(err.value) == (
        f"subset file {path} was made for tiny:mixtral (8 experts per MoE layer), not for tiny:olmoe (8 experts "
        "per MoE layer): select one on this model (`moectl subset select`), or pass --force to apply it anyway"
    )
    with policy_target("tiny:olmoe", force=True):
        assert moectl.load_policy(path, model).expert_lists()[0] == [0, 1, 2, 3]
    assert moectl.load_policy(path, model) is not None  # the model's name not known: its structure fits


def test_the_loaded_model_s_own_name_is_the_one_given(tmp_path):
    folder = tmp_path / "m"
    moectl.tiny("olmoe").save_pretrained(folder)
    model, _, _ = moectl.load(str(folder))
    path = save_subset(tmp_path / "s.json", KEEP, model="tiny:olmoe", num_experts=8)
    with pytest.raises(MadeForAnotherModelError, match=f"made for tiny:olmoe .*, not for {folder} "):
        moectl.load_policy(path, model)


def test_a_subset_missing_layers_of_another_model_is_not_told_to_rename_keep(tmp_path):
    """Was: "name the lists 'experts' instead of 'keep'" — a hint to apply another model's subset."""
    model, _, _ = moectl.load("tiny:deepseek_v3")  # 2 MoE layers of 8 experts
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"model": "tiny:olmoe", "keep": {"0": [0, 1], "1": [0, 1], "2": [0, 1]}}))
    with policy_target("tiny:deepseek_v3"), pytest.raises(MadeForAnotherModelError) as err:
        moectl.load_policy(path, model)
    assert "made for tiny:olmoe, not for tiny:deepseek_v3" in str(err.value) and "experts' instead" not in str(err.value)


def test_a_tau_profile_of_another_model(tmp_path):
    model, _, _ = moectl.load("tiny:olmoe")
    moectl.RoEConfig(K=2, tau=[0.1, 0.2, 0.3], meta={"model": "tiny:mixtral"}).save(tmp_path / "p.json")
    with policy_target("tiny:olmoe"), pytest.raises(MadeForAnotherModelError, match="or pass --force"):
        moectl.load_policy(tmp_path / "p.json", model)
    with policy_target("tiny:olmoe", force=True):
        assert moectl.load_policy(tmp_path / "p.json", model).taus(3) == [0.1, 0.2, 0.3]
    moectl.RoEConfig(K=2, tau=[0.1, 0.2], meta={"model": "tiny:deepseek_v3"}).save(tmp_path / "q.json")
    with policy_target("tiny:olmoe", force=True), pytest.raises(MadeForAnotherModelError) as err:
        moectl.load_policy(tmp_path / "q.json", model)  # 2 temperatures cannot apply to 3 layers
    assert "made for tiny:deepseek_v3 (2 MoE layers), not for tiny:olmoe (3 MoE layers)" in str(err.value)
    assert "--force" not in str(err.value)


def test_verbs_refuse_in_one_line_and_force_applies(tmp_path):
    path = save_subset(tmp_path / "s.json", KEEP, model="tiny:qwen3_moe", num_experts=8)
    args = ["switch-rate", "--tiny", "olmoe", "--policy", str(path), "--max-new-tokens", "2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().startswith(f"error: subset file {path} was made for tiny:qwen3_moe")
    assert len(result.stderr.strip().splitlines()) == 1 and "--force" in result.stderr
    result = runner.invoke(app, [*args, "--force"])
    assert result.exit_code == 0, result.output
