"""``moectl options card``: a self-contained controller folder with a model card, every figure from files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moectl.cli import app
from moectl.io.atomic import default_mode
from moectl.models.load import load_model
from moectl.options.trainer import OptionsConfig, train_options
from moectl.reporting.option_curves import read_log, summarise

runner = CliRunner()
PROMPTS = ["hello world", "the cat sat on the", "def f(x):", "1 + 2 =", "Once upon a time"]
CONTROLLER_FILES = {
    "adapter.safetensors",
    "adapter_config.json",
    "controller.json",
    "controller.safetensors",
    "options.json",
    "routers.safetensors",
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(run folder, base model folder): a tiny olmoe saved as a model folder, 3 steps of options
    training on it, a checkpoint every step (the newest two kept: steps 2 and 3)."""
    root = tmp_path_factory.mktemp("card")
    base = root / "tiny-olmoe"
    model, _ = load_model("tiny:olmoe")
    model.save_pretrained(base)
    (base / "moectl_shape.json").write_text("{}\n")  # no tokenizer of its own: the byte tokenizer
    model, tok = load_model(str(base))
    cfg = OptionsConfig(
        k_hat=4, eta=0.05, steps=3, batch_size=2, max_new_tokens=6, save_every=1, lora_r=4, lora_alpha=4
    )
    train_options(model, tok, PROMPTS, cfg, root / "run", progress=False)
    return root / "run", base


def _card(run: Path, base: Path, dest: Path, *extra: str):
    return runner.invoke(app, ["options", "card", str(run), "--base", str(base), "--out", str(dest), *extra])


def _generate(base: Path, controller: Path, out: Path) -> dict:
    result = runner.invoke(
        app,
        ["options", "generate", str(base), "--controller", str(controller), "--prompt", "abc", "--prompt",
         "Once upon", "--max-new-tokens", "8", "--seed", "3", "--json", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_the_card_folder_is_the_final_controller_with_log_curves_and_card(trained, tmp_path):
    from huggingface_hub import ModelCard

    run, base = trained
    dest = tmp_path / "tiny-olmoe-k4-controller"
    result = _card(run, base, dest, "--json", str(tmp_path / "card.json"))
    assert result.exit_code == 0, result.output
    names = {p.name for p in dest.iterdir()}
    assert names == CONTROLLER_FILES | {"training_log.jsonl", "training_curves.png", "README.md"}
    for name in CONTROLLER_FILES:
        assert (dest / name).read_bytes() == (run / "final" / name).read_bytes(), name
    assert all(p.stat().st_mode & 0o777 == default_mode() for p in dest.iterdir())
    rows = read_log(run)
    assert [json.loads(x) for x in (dest / "training_log.jsonl").read_text().splitlines()] == rows
    assert read_log(dest) == rows  # curves and summaries read a controller folder as they read a run
    assert (dest / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    card = ModelCard.load(dest / "README.md")  # the Hub's own parser reads the front matter
    meta = card.data.to_dict()
    assert meta["base_model"] == "tiny-olmoe" and meta["library_name"] == "moectl"
    assert meta["license"] == "apache-2.0"
    assert {"mixture-of-experts", "temporally-extended-moe", "option-critic", "moectl"} <= set(meta["tags"])
    expected = summarise(run.name, rows, 20)
    values = {r.metric_type: r for r in card.data.eval_results}
    assert set(values) == {"reward", "switch_rate", "kl"}
    for key, res in values.items():
        assert res.metric_value == pytest.approx(expected[key]["last_3"]["mean"], abs=1e-6)
        assert res.metric_args["ci95"] == pytest.approx(expected[key]["last_3"]["ci95"], abs=1e-6)
    assert values["kl"].metric_value == pytest.approx(-values["reward"].metric_value, abs=1e-6)
    text = card.text
    options = json.loads((run / "final" / "options.json").read_text())
    assert "k̂ = 4" in text and f"η = {options['eta']}" in text and "**step 3**" in text
    assert "| `lora_r` | `4` |" in text and "single training run" in text
    assert f"moectl serve-offload {base.as_posix()} --policy controller:{dest.as_posix()}" in text
    assert f"moectl options generate {base.as_posix()} --controller {dest.as_posix()}" in text
    assert f"{expected['switch_rate']['first_3']['mean']:.4f}" in text  # the first window's figures too
    report = json.loads((tmp_path / "card.json").read_text())
    assert (
        report["step"] == 3 and report["checkpoint"] == "final" and report["card"] == str(dest / "README.md")
    )


def test_the_card_folder_routes_and_generates_as_the_run_s_final(trained, tmp_path):
    import torch
    from safetensors.torch import load_file

    import moectl
    from moectl.options.policy import ControllerPolicy

    run, base = trained
    dest = tmp_path / "ctl"
    assert _card(run, base, dest).exit_code == 0
    assert _generate(base, dest, tmp_path / "a.json") == _generate(base, run / "final", tmp_path / "b.json")
    policies = []
    for folder in (dest, run / "final"):
        model, _ = load_model(str(base))
        policy = moectl.load_policy(f"controller:{folder}", model)
        assert isinstance(policy, ControllerPolicy)
        policies.append((policy, model))
    (mine, mine_model), (theirs, their_model) = policies
    for (k, a), (_, b) in zip(
        mine.controller.state_dict().items(), theirs.controller.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k
    for a, b in zip(mine_model.parameters(), their_model.parameters(), strict=True):
        assert torch.equal(a, b)  # the same adapters and routers merged in
    assert set(load_file(str(dest / "routers.safetensors"))) == set(
        load_file(str(run / "final" / "routers.safetensors"))
    )


@pytest.mark.parametrize(("spec", "step", "folder"), [("latest", 3, "step-000003"), ("2", 2, "step-000002")])
def test_checkpoint_latest_or_a_step_picks_that_checkpoint(trained, tmp_path, spec, step, folder):
    run, base = trained
    dest = tmp_path / "ctl"
    result = _card(
        run, base, dest, "--checkpoint", spec, "--name", "my controller", "--json", str(tmp_path / "c.json")
    )
    assert result.exit_code == 0, result.output
    source = run / "checkpoints" / folder
    assert (source / "trainer_state.pt").exists() and not (dest / "trainer_state.pt").exists()
    for name in CONTROLLER_FILES:
        assert (dest / name).read_bytes() == (source / name).read_bytes(), name
    logged = [json.loads(x)["step"] for x in (dest / "training_log.jsonl").read_text().splitlines()]
    assert logged == list(range(1, step + 1))
    text = (dest / "README.md").read_text()
    assert f"`{folder}` of the run `run`" in text and f"**step {step}**" in text and "# my controller" in text
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["step"] == step and report["checkpoint"] == folder
    assert report["summary"]["steps_logged"] == step


def _refused(result, *needles: str) -> None:
    said = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert said.count("error:") == 1 and "Traceback" not in said
    for needle in needles:
        assert needle in said, said


def test_bad_input_exits_2_naming_the_problem_and_writes_nothing(trained, tmp_path):
    run, base = trained
    dest = tmp_path / "ctl"
    (tmp_path / "empty").mkdir()
    _refused(_card(tmp_path / "empty", base, dest), "no log.jsonl")
    _refused(
        _card(run, base, dest, "--checkpoint", "1"),
        "no checkpoints/step-000001",
        "allowed: final, latest, 2, 3",
    )
    _refused(_card(run, base, dest, "--checkpoint", "best"), "allowed are final, latest or a step number")
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run, unfinished, ignore=shutil.ignore_patterns("final"))
    _refused(_card(unfinished, base, dest), "has no final/", "allowed: latest, 2, 3")
    _refused(_card(run, tmp_path / "empty", dest), "no config.json", "give the folder of the base model")
    _refused(_card(run, base, run), "it is or holds the run")
    other = tmp_path / "other-model"
    other.mkdir()
    config = json.loads((base / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    _refused(_card(run, other, dest), "hidden size", "give the base model the run was trained on")
    assert not dest.exists() and not list(tmp_path.glob(".tmp-*"))
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    _refused(_card(run, base, dest), "already exists", "--overwrite")
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]
    assert _card(run, base, dest, "--overwrite").exit_code == 0
    assert (dest / "README.md").exists() and not (dest / "keep.txt").exists()


def test_final_step_is_the_last_logged_step(tmp_path):
    """A finished run resumed with another --steps: options.json's planned steps are not the step
    final/ holds; the log's last step is."""
    from moectl.reporting.controller_card import find_source

    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "controller.json").write_text("{}")
    (final / "options.json").write_text(json.dumps({"steps": 5}))
    assert find_source(tmp_path / "run", "final", last_logged=3).step == 3
    assert find_source(tmp_path / "run", "final").step == 5
