"""Issue #29 (14), as a new user meets it: output paths checked before any work, one clear line for
an unwritable path, Ctrl-C as one line and exit 130, and subset files used on another model."""

from __future__ import annotations

import importlib
import json
import logging
import re

import pytest
from typer.testing import CliRunner

import moectl
from moectl.cli import app
from moectl.io.atomic import write_text_atomic
from moectl.subsets.files import save_subset

runner = CliRunner()


def _flat(output: str) -> str:
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())  # rich boxes usage errors


@pytest.fixture
def blocker(tmp_path):
    """A plain file where an output's parent folder would have to go."""
    path = tmp_path / "FILE"
    path.write_text("not a folder")
    return path


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a verb loads a model: output paths must be refused before any work."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr("moectl.cli.common.load", refuse)
    monkeypatch.setattr("moectl.cli.subset.load", refuse)
    monkeypatch.setattr("moectl.cli.roe.load", refuse)


def test_subset_select_into_a_file_path_is_refused_before_the_selection(tmp_path, blocker, no_model):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    args = [
        "subset",
        "select",
        "tiny:olmoe",
        "--data",
        str(data),
        "--keep",
        "4",
        "--out",
        str(blocker / "x.json"),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output  # was: the whole selection, then a 35-line traceback
    assert f"{blocker} is a file, not a folder" in _flat(result.output)
    assert "Traceback" not in result.output and "Errno" not in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["subset", "export", "tiny:olmoe", "--subset", "S", "--out", "{bad}/sub"],
        ["roe", "tune", "--tiny", "olmoe", "--data", "D", "--out", "{bad}/p.json"],
        ["eval", "tiny:olmoe", "--out", "{bad}/r.json"],
        ["report", "R", "--plot", "{bad}/p.png"],
        ["report", "R", "--markdown", "{bad}/t.md"],
        ["options", "train", "tiny:olmoe", "--k-hat", "4", "--out", "{bad}/run"],
        ["inspect", "--tiny", "olmoe", "--json", "{bad}/i.json"],
        ["corpus", "build", "--out", "{bad}/corpus"],
        ["tokenizer", "train", "--out", "{bad}/tok"],
        ["switch-rate", "--tiny", "olmoe", "--trace", "{bad}/trace"],
        ["switch-rate", "--tiny", "olmoe", "--plot", "{bad}/figures"],
        ["roe", "tune", "--tiny", "olmoe", "--data", "D", "--plot-dir", "{bad}/plots"],
        ["data", "list-evals", "--json", "{bad}/l.json"],
        ["pretrain", "--json", "{bad}/f.json"],
    ],
)
def test_every_output_option_is_checked_when_the_command_line_is_parsed(blocker, no_model, args):
    result = runner.invoke(app, [a.format(bad=blocker) for a in args])
    assert result.exit_code == 2, result.output
    flat = _flat(result.output)
    assert flat.startswith("error: --") and flat.count("error:") == 1 and "is a file, not a folder" in flat


def test_an_output_folder_that_is_a_file_is_named(tmp_path, no_model):
    (tmp_path / "sub").write_text("x")
    result = runner.invoke(
        app, ["subset", "export", "tiny:olmoe", "--subset", "S", "--out", str(tmp_path / "sub")]
    )
    assert result.exit_code == 2 and "is a file: give a folder" in _flat(result.output)


def test_write_errors_name_the_path_not_an_errno_or_a_temporary(blocker, tmp_path):
    with pytest.raises(NotADirectoryError) as err:
        write_text_atomic(blocker / "x.json", "{}")
    assert str(err.value) == f"{blocker / 'x.json'} cannot be written: {blocker} is a file, not a folder"
    with pytest.raises(IsADirectoryError, match="is a folder: give a file path"):
        write_text_atomic(tmp_path, "{}")


# -- Ctrl-C ---------------------------------------------------------------------------------------------
def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("target", "args", "said"),
    [
        ("moectl.eval.eval_run.evaluate", ["eval", "tiny:olmoe", "--tasks", "x"], "no results were written"),
        ("moectl.reports.switch_rate_report", ["switch-rate", "--tiny", "olmoe"], "nothing was written"),
        ("moectl.server.offload_batch.serve_offload", ["serve-offload", "--tiny", "olmoe"], "nothing was written"),
    ],
)
def test_ctrl_c_ends_a_verb_with_one_line_and_130(monkeypatch, target, args, said):
    monkeypatch.setattr(target, _interrupt)
    result = runner.invoke(app, args)
    assert result.exit_code == 130, result.output  # was: a blank line (and exit 1)
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted:") and said in lines[0]


def test_ctrl_c_in_roe_tune_names_the_study_that_resumes(tmp_path, monkeypatch):
    tune_module = importlib.import_module("moectl.roe.tune")  # `moectl.roe.tune` names the function
    monkeypatch.setattr(tune_module, "tune", _interrupt)
    data = tmp_path / "v.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    result = runner.invoke(
        app, ["roe", "tune", "--tiny", "olmoe", "--data", str(data), "--out", str(tmp_path / "p.json")]
    )
    assert result.exit_code == 130
    flat = " ".join(result.output.split())
    assert f"kept in {tmp_path / 'p.optuna.db'}" in flat and "resume" in flat


def test_optuna_does_not_print_the_traceback_of_the_trial_ctrl_c_cut_short(capfd):
    import optuna

    from moectl.roe.tune import quiet_interrupted_trial

    optuna.logging.set_verbosity(logging.WARNING)
    study = optuna.create_study()

    def objective(trial):
        if trial.number == 1:
            raise KeyboardInterrupt
        return trial.suggest_float("x", 0, 1)

    with pytest.raises(KeyboardInterrupt), quiet_interrupted_trial():
        study.optimize(objective, n_trials=5)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "failed" not in err
    assert len(study.trials) == 2  # the finished trial is kept


# -- subset files on another model ---------------------------------------------------------------------
def test_a_subset_chosen_on_a_model_with_other_expert_counts_is_refused(tmp_path):
    """Issue #42 (6): was a warning and exit 0; its expert ids name other experts on this model."""
    subset = tmp_path / "s.json"
    save_subset(subset, {0: [0, 1], 1: [0, 1], 2: [0, 1]}, num_experts=64)  # chosen on a 64-expert model
    result = runner.invoke(
        app, ["subset", "export", "tiny:olmoe", "--subset", str(subset), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"error: subset file {subset} was made for another model (64 experts per MoE layer), not for tiny:olmoe "
        "(8 experts per MoE layer): select one on this model (`moectl subset select`), or pass --force to apply "
        "it anyway"
    )
    assert not (tmp_path / "o").exists()


def test_a_subset_chosen_on_another_model_of_the_same_expert_count_is_refused_unless_forced(tmp_path):
    """Issue #43 (2): was a warning and exit 0 — the ids name other experts of another model."""
    subset = tmp_path / "s.json"
    save_subset(subset, {0: [0, 1], 1: [0, 1], 2: [0, 1]}, model="tiny:other", num_experts=8)
    args = ["subset", "export", "tiny:olmoe", "--subset", str(subset), "--out", str(tmp_path / "o")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert "was made for tiny:other (8 experts per MoE layer), not for tiny:olmoe" in result.stderr
    assert "--force" in result.stderr and not (tmp_path / "o").exists()
    result = runner.invoke(app, [*args, "--force"])
    assert result.exit_code == 0, result.output
    assert "was chosen on tiny:other, used on tiny:olmoe (8 experts" in _flat(result.output)


def test_subset_select_records_the_expert_count(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"document {i} about things"}) for i in range(3)))
    out = tmp_path / "s.json"
    result = runner.invoke(
        app, ["subset", "select", "tiny:olmoe", "--data", str(data), "--keep", "4", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["num_experts"] == 8


def test_a_subset_file_missing_layers_is_refused_by_eval_as_by_export(tmp_path):
    """Before: ``eval --policy`` masked the 2 listed layers and ran the third unmasked, silently."""
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"keep": {"0": [0, 1], "1": [0, 1]}}))
    model = moectl.tiny("olmoe")
    with pytest.raises(ValueError, match=r"every MoE layer .*missing \[2\]"):
        moectl.load_policy(partial, model)
    with pytest.raises(ValueError, match="every MoE layer"):
        moectl.load_policy(f"static:{partial}", model)
    experts = tmp_path / "experts.json"  # a per-layer policy, spelled as one: still allowed
    experts.write_text(json.dumps({"type": "expert_mask", "experts": {"0": [0, 1]}}))
    moectl.load_policy(experts, model)


def test_a_write_that_fails_after_the_work_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    def full_disk(path, text):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr("moectl.subsets.files.write_text_atomic", full_disk)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"document {i} about things"}) for i in range(3)))
    out = tmp_path / "s.json"
    result = runner.invoke(
        app, ["subset", "select", "tiny:olmoe", "--data", str(data), "--keep", "4", "--out", str(out)]
    )
    assert result.exit_code == 2 and not isinstance(result.exception, OSError)  # was: a traceback
    assert f"error: --out {out}: No space left on device" in _flat(result.output)
