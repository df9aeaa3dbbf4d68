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
    from moectl.serve import OffloadConfig, ServeOffloadConfig, run_serve_offload

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
    from moectl.serve import OffloadConfig, ServeOffloadConfig, run_serve_offload

    result = run_serve_offload(ServeOffloadConfig("tiny:olmoe", OffloadConfig(budget=4, store="host"), ["Hi"], 4))
    assert result["generated_tokens"] == 4 and 0 <= result["hit_rate"] <= 1 and len(result["texts"]) == 1
