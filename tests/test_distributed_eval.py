"""`moectl eval` over two processes (accelerate, gloo): requests split, results gathered, identical to one process.

One launch of ``_distributed_eval_worker.py`` runs every evaluation of ``RUNS`` (a subset policy
with perplexity, RoE K=2, a sampling controller with perplexity) on two processes; the same
evaluations run here in one process. arc_easy with 7 (or 5) documents: lm-eval gives the processes
4 and 3, and pads the second with a copy of its last request (answered, not scored or counted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _distributed import free_port
from _distributed_eval_worker import RUNS, run
from _eval_data import small_cache
from moectl.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    import moectl
    from moectl.options.controller import build_controller
    from moectl.options.policy import ControllerPolicy

    root = tmp_path_factory.mktemp("eval-dp")
    small_cache(root / "evals")
    docs = [("x = 1\ny = 2", "code"), ("A cat sat.", "prose"), ("The river and the stone.", "prose")]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t, "domain": d}) + "\n" for t, d in docs))
    (root / "subset.json").write_text(json.dumps({"type": "expert_mask", "everywhere": [0, 1, 2, 3]}))
    ctrl = build_controller(moectl.inspect(moectl.tiny("olmoe")), 4)
    with torch.no_grad():
        for layer in ctrl.layers:
            layer.termination[-1].bias.fill_(0.0)  # β ≈ 1/2: the controller switches
    ControllerPolicy(ctrl).save(root / "ctrl")
    worker = Path(__file__).with_name("_distributed_eval_worker.py")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), str(worker), str(root)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for name in RUNS:
        (root / f"{name}.one.json").write_text(json.dumps(run(root, name), default=str))
    torch.set_num_threads(threads)
    return root


def assert_close_tree(got, expected, where: str, rel: float = 1e-9) -> None:
    """Equal structure; numbers equal to ``rel`` (pytest.approx takes no nested containers)."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), where
        for key in expected:
            assert_close_tree(got[key], expected[key], f"{where}.{key}", rel)
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_close_tree(g, e, f"{where}[{i}]", rel)
    elif isinstance(expected, float) and isinstance(got, float):
        assert got == pytest.approx(expected, rel=rel), where
    else:
        assert got == expected, where


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_give_the_one_process_results(root, name):
    one, two = (json.loads((root / f"{name}.{n}.json").read_text()) for n in ("one", "dp"))
    assert one["routing"] == two["routing"] and one["tasks"].keys() == two["tasks"].keys()
    for task, entry in one["tasks"].items():
        other = two["tasks"][task]
        assert other["n"] == entry["n"], task
        for metric, m in entry["metrics"].items():  # accuracies exact; perplexities to float batching
            assert_close_tree(other["metrics"][metric], m, f"{task}.{metric}", rel=1e-6)
        assert_close_tree(other["switch_rate"], entry["switch_rate"], task)
    if name != "roe":  # RoE records no switch rate; the others do, from every process's sequences
        arc = one["tasks"]["arc_easy"]["switch_rate"]
        assert arc["sequences"] == 4 * one["tasks"]["arc_easy"]["n"] and 0 < arc["mean"] < 1


def test_the_in_process_engine_is_refused_on_several_processes(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    small_cache(tmp_path / "evals")
    args = [
        "eval",
        "tiny:olmoe",
        "--tasks",
        "arc_easy",
        "--engine",
        "moectl",
        "--cache",
        str(tmp_path / "evals"),
    ]
    result = runner.invoke(app, args)
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "--engine lm-eval" in text, text
