"""RunConfig: one save/load for every run config, values checked against their field's type."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from moectl.errors import ConfigError, MoectlError
from moectl.runconfig import RunConfig


@dataclass
class Demo(RunConfig):
    kind = "demo config"
    out: str
    steps: int = 3
    lr: float = 1e-3
    bf16: bool = True
    mode: Literal["a", "b"] = "a"
    betas: tuple[float, float] = (0.9, 0.95)
    corpus: Path | None = None
    model: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")


def test_round_trip_keeps_every_value(tmp_path):
    cfg = Demo(out="runs/x", steps=7, lr=2, betas=(0.8, 0.9), corpus=Path("c"), model={"layers": 2})
    path = cfg.save(tmp_path / "config.json")
    assert json.loads(path.read_text())["corpus"] == "c"
    back = Demo.load(path)
    assert back == Demo(out="runs/x", steps=7, lr=2.0, betas=(0.8, 0.9), corpus=Path("c"), model={"layers": 2})
    assert isinstance(back.lr, float) and isinstance(back.betas, tuple)


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("steps", "256", "an integer"),
        ("steps", True, "an integer"),
        ("bf16", 1, "true or false"),
        ("mode", "c", "one of 'a', 'b'"),
        ("betas", [0.9], "a list of 2 values"),
        ("lr", "fast", "a number"),
        ("model", [1], "a JSON object"),
    ],
)
def test_mistyped_values_are_refused_with_the_field_and_type(key, value, says):
    with pytest.raises(ConfigError) as err:
        Demo.from_dict({"out": "x", key: value}, source="f.json")
    assert f"'{key}'" in str(err.value) and says in str(err.value) and str(err.value).startswith("f.json: ")
    assert isinstance(err.value, MoectlError) and isinstance(err.value, ValueError)


def test_unknown_keys_refused_or_ignored_and_required_ones_named():
    with pytest.raises(ConfigError, match=r"unknown demo config setting.*'stepz'.*allowed: out, steps"):
        Demo.from_dict({"out": "x", "stepz": 3})
    assert Demo.from_dict({"out": "x", "stepz": 3}, unknown="ignore") == Demo(out="x")
    with pytest.raises(ConfigError, match=r"missing required setting.*out"):
        Demo.from_dict({"steps": 2})


def test_range_checks_and_bad_files_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="steps must be >= 1"):
        Demo.from_dict({"out": "x", "steps": 0}, source="f.json")
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match=r"bad.json: not a JSON demo config"):
        Demo.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="a demo config is a JSON object"):
        Demo.load(bad)
    with pytest.raises(ConfigError, match="no such demo config file"):
        Demo.load(tmp_path / "missing.json")


def test_with_applies_changes_and_checks_them_again():
    cfg = Demo(out="x")
    assert cfg.with_(steps=5).steps == 5 and cfg.steps == 3
    with pytest.raises(ConfigError):
        cfg.with_(steps=0)
