"""What a new user trips on at the front door: bad model folders, --json paths, file modes."""

from __future__ import annotations

import json
import os
import re
import stat

import torch
from typer.testing import CliRunner

import moectl
from moectl.cli import app
from moectl.io.atomic import default_mode, write_text_atomic
from moectl.routing import route

runner = CliRunner()


def _saved_tiny(tmp_path):
    model = moectl.tiny("olmoe")
    model.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_a_truncated_weight_file_is_named_in_one_line(tmp_path):
    folder = _saved_tiny(tmp_path)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    result = runner.invoke(app, ["inspect", str(folder)])
    assert result.exit_code == 2
    assert "model.safetensors: truncated" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_a_folder_without_config_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["inspect", str(tmp_path / "empty")])
    assert result.exit_code == 2
    assert "no config.json" in " ".join(result.output.split())
    assert "model_type" not in result.output


def test_json_naming_a_folder_is_refused_before_any_work(tmp_path):
    result = runner.invoke(app, ["inspect", "--tiny", "olmoe", "--json", str(tmp_path)])
    assert result.exit_code == 2
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())  # rich boxes usage errors
    assert "is a folder: give a file path" in flat
    assert not list(tmp_path.glob(".*tmp"))


def test_written_files_get_the_usual_mode(tmp_path):
    path = write_text_atomic(tmp_path / "r.json", json.dumps({"a": 1}))
    assert stat.S_IMODE(path.stat().st_mode) == default_mode()
    model = moectl.tiny("olmoe")
    with route(model, [], record=True) as session:
        model(input_ids=torch.randint(3, 200, (1, 8)))
    session.trace.save(tmp_path / "trace")
    for file in tmp_path.glob("trace*"):
        assert stat.S_IMODE(file.stat().st_mode) == default_mode(), file


def test_saved_models_get_the_usual_mode(tmp_path):
    """transformers 5.24's save_pretrained writes weights 0600; moectl's saved models are readable."""
    from moectl.subsets.export import export_subset
    from moectl.train.checkpoint import save_checkpoint

    model = moectl.tiny("olmoe")
    export_subset(model, {i: [0, 1, 2, 3] for i in range(3)}, tmp_path / "sub")
    from moectl.options.controller import build_controller
    from moectl.options.option_state import save_folder

    save_checkpoint(tmp_path / "run", 0, moectl.tiny("olmoe"), None, {}, 2)
    info = moectl.inspect(model)
    save_folder(
        tmp_path / "options", build_controller(info, 4), model, info, {"k_hat": 4}
    )  # safetensors' own writer
    build_controller(info, 4).save(tmp_path / "controller")
    files = [
        *(tmp_path / "sub").iterdir(),
        *(tmp_path / "run" / "checkpoints" / "step-000000").iterdir(),
        *(tmp_path / "options").iterdir(),
        *(tmp_path / "controller").iterdir(),
    ]
    assert {"routers.safetensors", "controller.safetensors"} <= {f.name for f in files}
    for file in files:
        assert stat.S_IMODE(file.stat().st_mode) == default_mode(), file


def test_the_switch_column_shows_the_policy_rate_not_the_router_rate():
    from moectl.eval.report import policy_switch_rate

    controller = {"mean": 0.937, "allowed_mean": 0.04, "sequences": 8}
    assert policy_switch_rate(controller) == 0.04  # the controller's ω, as TE-MoE reports it
    assert policy_switch_rate({"mean": 0.5, "allowed_mean": None, "sequences": 8}) == 0.5
    assert policy_switch_rate(None) is None


def test_a_zero_budget_names_top_k_as_the_minimum():
    import pytest

    from moectl.offload.runtime import BudgetError, resolve_budget

    with pytest.raises(BudgetError, match="at least top-k experts"):
        resolve_budget(0, 8)
