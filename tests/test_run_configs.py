"""The run configs on RunConfig: each round-trips save/load, refuses mistyped values by field name,
and range checks raise ConfigError (a MoectlError: the CLI prints one line, exit 2)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from moectl.errors import ConfigError, MoectlError
from moectl.offload.offload_config import OffloadConfig
from moectl.offload.prefetch import PrefetchConfig
from moectl.options.options_config import OptionsConfig
from moectl.train.train_config import TrainConfig


def test_train_config_round_trips_and_refuses_a_mistyped_saved_value(tmp_path):
    cfg = TrainConfig.from_preset("tiny", out=str(tmp_path / "run"), max_steps=20, lr=1e-3, bf16=False)
    path = cfg.save(tmp_path / "config.json")
    assert TrainConfig.load(path) == cfg
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "lr": "4e-3"}))  # the old load carried this string into the run
    with pytest.raises(ConfigError, match=r"config.json: run config setting 'lr' must be a number, got '4e-3'"):
        TrainConfig.load(path)
    path.write_text(json.dumps({**data, "seq_len": "256"}))
    with pytest.raises(ConfigError, match=r"setting 'seq_len' must be an integer, got '256'"):
        TrainConfig.load(path)


def test_train_config_resume_from_applies_and_checks_overrides(tmp_path):
    TrainConfig.from_preset("tiny", out="elsewhere", max_steps=20).save(tmp_path / "config.json")
    cfg = TrainConfig.resume_from(tmp_path, max_steps=40)
    assert cfg.out == str(tmp_path) and cfg.max_steps == 40
    with pytest.raises(ConfigError, match=r"warmup_steps must lie in 0..max_steps=1"):
        TrainConfig.resume_from(tmp_path, max_steps=1)  # the old setattr skipped this check
    with pytest.raises(MoectlError, match=r"no config.json there"):
        TrainConfig.resume_from(tmp_path / "nothing")


def test_options_config_round_trips_and_loads_a_runs_options_json(tmp_path):
    cfg = OptionsConfig(k_hat=4, eta=0.05, steps=3, d_e=8)
    assert OptionsConfig.load(cfg.save(tmp_path / "o.json")) == cfg
    # a run's checkpoint keeps asdict(config) as options.json (options/option_state.py)
    (tmp_path / "options.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    assert OptionsConfig.load(tmp_path / "options.json") == cfg
    with pytest.raises(ConfigError, match="'value_head' must be one of 'linear', 'mlp'"):
        OptionsConfig.from_dict({"k_hat": 4, "value_head": "deep"})
    with pytest.raises(ConfigError, match=r"bad options setting.*tau=2"):
        OptionsConfig(k_hat=4, tau=2)


def test_offload_config_round_trips_with_a_policy_object_saved_by_name(tmp_path):
    cfg = OffloadConfig(
        budget=4, policy="option:3", store="host", store_dir=Path("s"), prefetch_config=PrefetchConfig(2, 0.3)
    )
    back = OffloadConfig.load(cfg.save(tmp_path / "offload.json"))
    assert back == cfg and isinstance(back.budget, int) and isinstance(back.prefetch_config, PrefetchConfig)
    assert OffloadConfig.from_dict({"budget": 0.5}).budget == 0.5

    class Named:
        name = "lru"

    assert cfg.with_(policy=Named()).to_dict()["policy"] == "lru"
    with pytest.raises(ConfigError, match="store must be one of disk, checkpoint, host"):
        cfg.with_(store="ram")
    with pytest.raises(ConfigError, match="'verify' must be true or false"):
        OffloadConfig.from_dict({"verify": "yes"})


def test_run_configs_of_the_verbs_round_trip(tmp_path):
    from moectl.eval import EvalConfig
    from moectl.options import OptionsRunConfig
    from moectl.roe import TuneConfig
    from moectl.server import ServeOffloadConfig

    configs = [
        EvalConfig("tiny:olmoe", tasks="arc_easy,gsm8k", limit=5, policy="subset.json", cache=Path("evals")),
        TuneConfig("tiny:olmoe", Path("val.jsonl"), K=4, trials=3, uniform=True, out=Path("p.json")),
        ServeOffloadConfig("tiny:olmoe", OffloadConfig(budget=2, policy="option:2"), ["hi", "there"], 3),
        OptionsRunConfig("tiny:olmoe", Path("runs/c"), OptionsConfig(k_hat=4, steps=2), eta_from_latency=1.0),
    ]
    for i, cfg in enumerate(configs):
        assert type(cfg).load(cfg.save(tmp_path / f"{i}.json")) == cfg
    assert configs[0].tasks == ("arc_easy", "gsm8k")


def test_run_configs_of_the_verbs_refuse_bad_values_by_name():
    from moectl.eval import EvalConfig
    from moectl.options import OptionsRunConfig
    from moectl.roe import TuneConfig
    from moectl.server import ServeOffloadConfig

    with pytest.raises(ConfigError, match="engine must be one of"):
        EvalConfig("tiny:olmoe", tasks="arc_easy", engine="vllm")
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        EvalConfig("tiny:olmoe")
    with pytest.raises(ConfigError, match=r"trials .* must be an integer >= 1"):
        TuneConfig.from_dict({"model": "tiny:olmoe", "trials": 0})
    with pytest.raises(ConfigError, match="'offload': offload config setting 'budget' must be an integer or a number"):
        ServeOffloadConfig.from_dict({"model": "tiny:olmoe", "offload": {"budget": "4"}})
    with pytest.raises(ConfigError, match=r"max_batch .* must be >= 1"):
        ServeOffloadConfig("tiny:olmoe", max_batch=0)
    with pytest.raises(ConfigError, match="'options': options config setting 'steps' must be an integer"):
        OptionsRunConfig.from_dict({"model": "m", "out": "o", "options": {"k_hat": 4, "steps": 2.5}})


def test_pretrain_resume_of_a_mistyped_config_is_one_line_and_exit_2(tmp_path):
    from typer.testing import CliRunner

    from moectl.cli import app

    cfg = TrainConfig.from_preset("tiny", out=str(tmp_path), max_steps=4)
    cfg.save(tmp_path / "config.json")
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "bf16": "no"}))
    result = CliRunner().invoke(app, ["pretrain", "--resume", str(tmp_path)])
    flat = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert flat.startswith("error: ") and "run config setting 'bf16' must be true or false, got 'no'" in flat
