"""Library ``run(config)`` functions equal their verbs: what ``moectl VERB`` does, a Python user does
with a config and one call (the CLI only parses its flags into the config)."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from moectl.cli import app

torch.set_num_threads(1)

RUN_KEYS = ("texts", "loads", "bytes_moved", "hits", "misses", "budget_experts_per_layer", "policy", "config")


def test_serve_offload_run_equals_the_verb(tmp_path):
    from moectl.offload import OffloadConfig
    from moectl.server import ServeOffloadConfig, run_serve_offload

    out = tmp_path / "cli.json"
    args = ["serve-offload", "--tiny", "olmoe", "--budget", "3", "--store", "host", "--policy", "option:3"]
    result = CliRunner().invoke(app, [*args, "--max-new-tokens", "4", "--seed", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    cli = json.loads(out.read_text())
    config = ServeOffloadConfig(
        "tiny:olmoe", OffloadConfig(budget=3, policy="option:3", store="host"), max_new_tokens=4, seed=1
    )
    lib = run_serve_offload(ServeOffloadConfig.load(config.save(tmp_path / "run.json")), progress=False)
    assert {k: lib[k] for k in RUN_KEYS} == {k: cli[k] for k in RUN_KEYS}
    assert lib["generated_tokens"] == cli["generated_tokens"] == 4 * cli["prompts"]


def test_readme_example_serves_in_three_lines():
    from moectl.offload import OffloadConfig
    from moectl.server import ServeOffloadConfig, run_serve_offload

    result = run_serve_offload(ServeOffloadConfig("tiny:olmoe", OffloadConfig(budget=4, store="host"), ["Hi"], 4))
    assert result["generated_tokens"] == 4 and 0 <= result["hit_rate"] <= 1 and len(result["texts"]) == 1


def test_evaluate_config_equals_the_verb(tmp_path):
    from _eval_data import small_cache
    from moectl.eval import EvalConfig, evaluate

    cache = small_cache(tmp_path / "evals", n=6)
    out = tmp_path / "cli.json"
    args = ["eval", "tiny:olmoe", "--tasks", "arc_easy", "--limit", "4", "--engine", "moectl", "--cache", str(cache)]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    config = EvalConfig("tiny:olmoe", tasks="arc_easy", limit=4, engine="moectl", cache=cache)
    doc = evaluate(EvalConfig.load(config.save(tmp_path / "eval.json")), progress=False)
    cli = json.loads(out.read_text())
    assert doc["tasks"]["arc_easy"]["metrics"] == cli["tasks"]["arc_easy"]["metrics"]
    assert doc["settings"] == cli["settings"] and doc["routing"] == cli["routing"]


def test_run_tune_equals_the_verb(tmp_path):
    from moectl.roe import TuneConfig, run_tune

    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps({"text": f"Document {i}: the quick brown fox."}) + "\n" for i in range(4)))
    flags = ["--k", "2", "--trials", "2", "--max-length", "16", "--data", str(data)]
    out = tmp_path / "cli" / "profile.json"
    result = CliRunner().invoke(app, ["roe", "tune", "--tiny", "olmoe", *flags, "--out", str(out), "--json", str(out) + ".run"])
    assert result.exit_code == 0, result.output
    config = TuneConfig("tiny:olmoe", data, K=2, trials=2, max_length=16, out=tmp_path / "lib" / "profile.json")
    lib = run_tune(TuneConfig.load(config.save(tmp_path / "tune.json")), progress=False)
    cli = json.loads((tmp_path / "cli" / "profile.json.run").read_text())
    assert lib.tau == cli["tau"] and lib.value == cli["value"] and lib.baseline == cli["baseline_tau0"]
    assert (tmp_path / "lib" / "profile.optuna.db").is_file() and (tmp_path / "lib" / "tau_heatmap.png").is_file()
