"""benchmarks/fresh_controller.py: a controller from a checkpoint's routers alone equals build_controller on the loaded model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fresh_controller
import moectl
from moectl.options.controller import OptionController, build_controller


def test_routers_read_from_the_shards_give_the_loaded_models_controller(tmp_path, monkeypatch):
    model, _, info = moectl.load("tiny:olmoe", dtype="float32", seed=3)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="200KB")  # several shards and an index
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    argv = ["fresh_controller", "--checkpoint", str(tmp_path / "ckpt"), "--k-hat", "4", "--out", str(tmp_path / "c")]
    monkeypatch.setattr(sys, "argv", argv)
    fresh_controller.main()
    got = OptionController.load(tmp_path / "c")
    want = build_controller(info, 4)
    assert got.config == want.config
    for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_not_a_checkpoint_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fresh_controller", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "c")])
    with pytest.raises(SystemExit) as exit_info:
        fresh_controller.main()
    assert exit_info.value.code == 2 and "not a checkpoint folder" in capsys.readouterr().err
