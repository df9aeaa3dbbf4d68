"""`moectl subset finetune` on two processes (accelerate, gloo) is the one-process run on the same batches.

One module-scoped launch. Seven examples in batches of 4: the last step's 3 split 2 + 1 over the
processes, and each process accumulates its examples one micro-batch at a time. (float32: the
checkpoint's grouped_mm experts take no float64; Adam could flip an update where |g| ~ eps, and
does not here.)
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import moectl
from _distributed import check, launch
from moectl.cli import app
from moectl.models.load import load_model
from moectl.subsets.export import export_subset
from test_subsets_finetune import EXAMPLES

runner = CliRunner()


def _args(root, out: str) -> list[str]:
    return ["subset", "finetune", str(root / "sub"), "--data", str(root / "train.jsonl"), "--out", out,
            "--lr", "1e-3", "--batch-size", "4", "--micro-batch-size", "1", "--max-examples", "7",
            "--dtype", "float32", "--no-progress", "--json", f"{out}.json"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune-dp")
    model, _ = load_model("tiny:olmoe")
    keep = {layer.index: [0, 2, 5, 7] for layer in moectl.inspect(model).layers}
    export_subset(model, keep, root / "sub", metadata={"model": "tiny:olmoe"})
    (root / "train.jsonl").write_text("\n".join(json.dumps(e) for e in EXAMPLES) + "\n")
    one = runner.invoke(app, _args(root, str(root / "A")))
    assert one.exit_code == 0, one.output
    check(launch(_args(root, "B"), cwd=root))
    return root


def test_two_processes_take_the_one_process_steps(runs):
    a, b = (json.loads((runs / f"{n}.json").read_text()) for n in "AB")
    assert a["processes"] == 1 and b["processes"] == 2 and len(b["steps"]) == len(a["steps"]) == 2
    for sa, sb in zip(a["steps"], b["steps"], strict=True):
        assert sb["tokens"] == sa["tokens"] and sb["lr"] == sa["lr"]
        assert sb["loss"] == pytest.approx(sa["loss"], rel=1e-6)
        assert sb["grad_norm"] == pytest.approx(sa["grad_norm"], rel=1e-5)  # the summed gradient's norm


def test_two_processes_write_the_one_process_weights(runs):
    from safetensors.torch import load_file

    a, b = (load_file(str(runs / n / "model.safetensors")) for n in "AB")
    assert a.keys() == b.keys()
    for name in a:  # measured: at most 1.3e-7 apart (float32 reduction order), lr = 1e-3
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    assert json.loads((runs / "B" / "moectl_subset.json").read_text())["keep"]["0"] == [0, 2, 5, 7]


def test_a_batch_that_does_not_split_is_refused_before_loading(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(EXAMPLES[0]) + "\n")
    args = ["subset", "finetune", str(tmp_path / "no-such-checkpoint"), "--data", str(data),
            "--out", str(tmp_path / "o"), "--batch-size", "3", "--micro-batch-size", "1"]  # fmt: skip
    result = runner.invoke(app, args)
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "--batch-size 3" in text and "multiple of 2" in text, text
    assert not (tmp_path / "o").exists()
