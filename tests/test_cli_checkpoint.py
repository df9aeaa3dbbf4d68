"""``moectl checkpoint make``, and ``--help`` loading no heavy package."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from moectl.cli import app

runner = CliRunner()


def test_checkpoint_make_writes_a_sharded_checkpoint(tmp_path):
    out, report = tmp_path / "ck", tmp_path / "ck.json"
    result = runner.invoke(
        app, ["checkpoint", "make", "shape:olmoe-1b-7b@2~w64", "--out", str(out), "--max-shard-gb", "0.004",
              "--json", str(report)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(report.read_text())
    assert summary["shards"] > 1 and len(list(out.glob("model-*.safetensors"))) == summary["shards"]
    assert summary["expert_bytes"] + summary["non_expert_bytes"] == summary["tensor_bytes"]
    assert "expert bytes" in result.output and "shards" in result.output


def test_checkpoint_make_bad_spec_lists_the_known_shapes(tmp_path):
    result = runner.invoke(app, ["checkpoint", "make", "shape:nonesuch", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "olmoe-1b-7b" in result.output
    assert not (tmp_path / "x").exists()


def test_help_imports_no_heavy_package():
    code = (
        "import sys; from typer.testing import CliRunner; from moectl.cli import app\n"
        "for argv in ([ '--help'], ['eval', '--help'], ['roe', 'tune', '--help'], ['options', 'train', '--help']):\n"
        "    assert CliRunner().invoke(app, argv).exit_code == 0\n"
        "heavy = [m for m in ('transformers', 'lm_eval', 'optuna', 'peft', 'matplotlib', 'accelerate') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
