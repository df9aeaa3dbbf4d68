"""``moectl serve`` as a run config: ``ServeConfig`` round-trips save/load without its secret,
refuses a bad value in one line naming the flag, and the command line builds the same config as
the flags say (then hands it to ``run_serve``). The endpoints' shared checks live on one
``ServingState``, usable without an app."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from moectl.cli import app
from moectl.errors import ConfigError
from moectl.offload.offload_config import OffloadConfig
from moectl.server import ServeConfig

runner = CliRunner()


def test_a_saved_serve_config_loads_back_without_its_api_key(tmp_path):
    config = ServeConfig(
        "tiny:olmoe",
        host="0.0.0.0",
        port=8123,
        served_model_names=["olmoe", "gpt-3.5-turbo"],
        routings={"opt4": "option:4", "math": "math.subset.json"},
        default_routing="opt4",
        max_batch=4,
        prefix_cache=0,
        api_key="sk-secret",
        offload=OffloadConfig(budget=4, policy="option:4", store="host", slot_dtype="int8"),
        read_timeout=12.5,
        threads=2,
        log_level="warning",
    )
    path = config.save(tmp_path / "serve.json")
    assert "sk-secret" not in path.read_text() and "api_key" not in json.loads(path.read_text())
    assert "sk-secret" not in repr(config)
    back = ServeConfig.load(path)
    assert back == config.with_(api_key=None)
    assert isinstance(back.offload, OffloadConfig) and isinstance(back.offload.budget, int)
    assert back.names() == ["olmoe", "gpt-3.5-turbo"]
    assert ServeConfig("tiny:olmoe").names() == ["tiny:olmoe"]


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"max_batch": 0}, "--max-batch must be at least 1, got 0"),
        ({"port": 0}, "--port must be in 1..65535, got 0"),
        ({"port": "8000"}, "serve config setting 'port' must be an integer, got '8000'"),
        ({"log_level": "loud"}, "--log-level must be one of critical, error, warning, info, debug"),
        ({"shutdown_timeout": -1}, "--shutdown-timeout must be a number of seconds in (0, 86400)"),
        ({"default_routing": "b", "routings": {"a": "option:4"}}, "not a --routing NAME; registered: a"),
        ({"served_model_names": []}, "--served-model-name must not be empty"),
        ({"offload": {"store": "cloud"}}, "'offload': store must be one of disk, checkpoint, host"),
        ({"max_bacth": 4}, "unknown serve config setting(s) 'max_bacth'"),
        ({"cuda_graph_columns": 0}, "--cuda-graph-columns must be a number of tokens >= 1, got 0"),
    ],
)
def test_a_bad_value_is_refused_in_one_line(tmp_path, data, words):
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"model": "tiny:olmoe", **data}))
    with pytest.raises(ConfigError) as refused:
        ServeConfig.load(path)
    message = str(refused.value)
    assert words in message and "\n" not in message, message


def test_the_command_line_builds_the_config_its_flags_say(monkeypatch):
    """Every flag lands in its field; the CLI does nothing but hand the config to ``run_serve``."""
    got = []
    monkeypatch.setattr("moectl.server.serve_run.run_serve", lambda config, **_: got.append(config))
    args = [
        "serve", "tiny:olmoe", "--host", "0.0.0.0", "--port", "8123",
        "--served-model-name", "olmoe", "--served-model-name", "gpt-3.5-turbo",
        "--routing", "opt4=option:4", "--routing", "math = math.subset.json", "--default-routing", "opt4",
        "--routing", 'g={"type": "gumbel", "tau": 0.5}',
        "--max-batch", "4", "--max-queue", "9", "--prefix-cache", "0", "--prefill-chunk", "64", "--no-lean-decode",
        "--enable-return-routed-experts", "--no-cuda-graphs", "--cuda-graph-columns", "2048",
        "--budget", "4", "--residency", "option:4", "--slot-dtype", "int8", "--store", "host",
        "--tokenizer", "tok", "--read-timeout", "12.5", "--timeout-keep-alive", "2", "--shutdown-timeout", "7",
        "--seed", "3", "--log-level", "warning", "--threads", "2", "--device", "cpu", "--dtype", "float32",
    ]  # fmt: skip
    result = runner.invoke(app, args, env={"MOECTL_API_KEY": "sk-secret"})
    assert result.exit_code == 0, result.output
    assert got == [
        ServeConfig(
            model="tiny:olmoe",
            host="0.0.0.0",
            port=8123,
            served_model_names=["olmoe", "gpt-3.5-turbo"],
            routings={"opt4": "option:4", "math": "math.subset.json", "g": '{"type": "gumbel", "tau": 0.5}'},
            default_routing="opt4",
            max_batch=4,
            max_queue=9,
            prefix_cache=0,
            prefill_chunk=64,
            lean_decode=False,
            cuda_graphs=False,
            cuda_graph_columns=2048,
            return_routed_experts=True,
            api_key="sk-secret",
            offload=OffloadConfig(budget=4, policy="option:4", slot_dtype="int8", store="host"),
            tokenizer="tok",
            read_timeout=12.5,
            timeout_keep_alive=2.0,
            shutdown_timeout=7.0,
            seed=3,
            log_level="warning",
            threads=2,
            device="cpu",
            dtype="float32",
        )
    ]
    got.clear()
    assert runner.invoke(app, ["serve", "--tiny", "olmoe"], env={"MOECTL_API_KEY": ""}).exit_code == 0
    assert got == [ServeConfig("tiny:olmoe")]  # the defaults of the flags are the config's


def test_the_endpoints_checks_live_on_one_state_without_an_app():
    from moectl.server.api_errors import APIError
    from moectl.server.protocol import CompletionRequest
    from moectl.server.serving_state import ServingState

    engine = SimpleNamespace(routings={"opt4": object(), "math": object()}, max_context=32)
    state = ServingState(engine, ["m", "alias"], "opt4", metrics=None, tokenizer=None, vocab=100)  # type: ignore[arg-type]
    assert (
        state.model_name == "m"
        and state.check_routing(None) == "opt4"
        and state.check_routing("math") == "math"
    )
    with pytest.raises(APIError, match=r"registered: math, opt4 \(leave routing out for 'opt4'\)"):
        state.check_routing("/etc/passwd")
    with pytest.raises(APIError, match="serves 'm' or 'alias'"):
        state.check_model("other")
    with pytest.raises(APIError, match=r"prompt token id 100 is outside the vocabulary \[0, 100\)"):
        state.prompt_ids([1, 100])
    body = CompletionRequest(model="m", prompt="hi", max_tokens=None)
    assert state.max_tokens_for(body, 30, 16, "prompt") == 2  # the default, cut to the room left
    with pytest.raises(APIError, match="at most 2"):
        state.max_tokens_for(CompletionRequest(model="m", prompt="hi", max_tokens=3), 30, 16, "prompt")


def test_the_cuda_graph_flags_reach_the_engine():
    """``--no-cuda-graphs`` / ``--cuda-graph-columns`` land in the engine's config (``graph_decode``,
    ``graph_columns``); left alone, graphs are the engine's choice (on CUDA only)."""
    from moectl.server.serve_run import open_engine

    for config, want in (
        (ServeConfig("tiny:olmoe", cuda_graphs=False, cuda_graph_columns=512), (False, 512)),
        (ServeConfig("tiny:olmoe"), (None, 4096)),
    ):
        engine, reader = open_engine(config, threads=1)
        try:
            assert reader is None
            assert (engine.config.graph_decode, engine.config.graph_columns) == want
        finally:
            engine.close()
