"""``moectl serve``'s bad command lines: exit 2 with one ``error:`` line naming what is allowed,
before any model loads where the command line alone says it (no server is started here)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moectl.cli import app
from moectl.cli.serve import parse_routings, served_name

runner = CliRunner()
TOKENIZER = str(Path(__file__).resolve().parents[1] / "models" / "moectl-small-standard")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["serve", "tiny:olmoe", "--tiny", "olmoe"], "give exactly one of MODEL"),
        (["serve", "tiny:olmoe", "--routing", "math"], "give NAME=SPEC"),
        (["serve", "tiny:olmoe", "--routing", "a=option:4", "--routing", "a=option:2"], "given twice"),
        (["serve", "tiny:olmoe", "--port", "70000"], "--port must be in 1..65535"),
        (["serve", "tiny:olmoe", "--max-batch", "0"], "--max-batch must be at least 1"),
        (["serve", "tiny:olmoe", "--max-queue", "0"], "--max-queue must be at least 1"),
        (["serve", "tiny:olmoe", "--prefix-cache", "-1"], "--prefix-cache must be a number of tokens >= 0"),
        (["serve", "tiny:olmoe", "--prefill-chunk", "0"], "--prefill-chunk must be a number of tokens >= 1"),
        (["serve", "tiny:olmoe", "--cuda-graph-columns", "0"], "--cuda-graph-columns must be a number of tokens >= 1"),
        (["serve", "tiny:olmoe", "--residency", "option:4"], "--residency only apply with --budget"),
        (["serve", "tiny:olmoe", "--budget", "lots"], "--budget must be a fraction like 0.25"),
        (["serve", "tiny:olmoe", "--budget", "4", "--store", "cloud"], "--store must be one of disk, checkpoint, host"),
        (["serve", "tiny:olmoe", "--budget", "4", "--slot-dtype", "int4"], "--slot-dtype must be one of same, int8"),
        (["serve", "tiny:olmoe", "--log-level", "loud"], "--log-level must be one of"),
        (["serve", "tiny:olmoe", "--routing", "x=no/such/subset.json"], "no/such/subset.json"),
        (["serve", "tiny:olmoe", "--routing", "bad name=option:4"], "routing name 'bad name'"),
        (["serve", "tiny:olmoe", "--budget", "1"], "a budget of 1 resident experts is too small"),
        (["serve", "tiny:olmoe", "--tokenizer", "no/such/tokenizer"], "no tokenizer loads from it"),
        (["serve", "tiny:olmoe", "--tokenizer", TOKENIZER], "more than the model's vocabulary of 259"),
        (["serve", "tiny:olmoe", "--routing", "a=option:4", "--default-routing", "b"], "not a --routing NAME; registered: a"),
        (["serve", "tiny:olmoe", "--served-model-name", " "], "--served-model-name must not be empty"),
    ],
)
def test_bad_command_lines_exit_2_with_one_line(args, words):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    flat = " ".join(result.output.split())
    assert words in flat
    assert "Traceback" not in result.output
    assert result.output.count("error:") == 1


def test_a_port_in_use_is_refused_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["serve", "tiny:olmoe", "--port", str(port)])
    assert result.exit_code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in " ".join(result.output.split())


def test_routing_specs_and_served_names(tmp_path):
    assert parse_routings(["math=m.json", "opt8 = option:8", "a=b=c"]) == {
        "math": "m.json", "opt8": "option:8", "a": "b=c",
    }  # fmt: skip
    assert served_name("tiny:olmoe") == "tiny:olmoe"
    assert served_name("allenai/OLMoE-1B-7B-0924") == "allenai/OLMoE-1B-7B-0924"
    (tmp_path / "emo-small").mkdir()
    assert served_name(str(tmp_path / "emo-small")) == "emo-small"


def test_a_tokenizer_of_its_own_for_a_checkpoint_without_one():
    """``--tokenizer``: a shape checkpoint (byte tokenizer) served with the tokenizer its GGUF carries."""
    from moectl.models.load import tokenizer_for

    tokenizer = tokenizer_for(TOKENIZER, 50304)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id is not None
    ids = tokenizer("The capital of France is")["input_ids"]
    assert 0 < len(ids) < len("The capital of France is") and max(ids) < 50304


def test_served_model_names_are_each_accepted_and_listed():
    """vLLM's ``--served-model-name`` (repeatable): every name is a model clients may ask for, each is
    listed by /v1/models, responses report the first, and another name is a 404 naming them."""
    from fastapi.testclient import TestClient

    import moectl
    from moectl.engine import Engine, EngineConfig
    from moectl.server.app import create_app

    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    engine = Engine(model, tok, EngineConfig(max_batch=2))
    with TestClient(create_app(engine, ["olmoe-instruct", "gpt-3.5-turbo"])) as client:
        listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert listed == ["olmoe-instruct", "gpt-3.5-turbo"]
        assert client.get("/v1/models/gpt-3.5-turbo").json()["id"] == "gpt-3.5-turbo"
        body = {"model": "gpt-3.5-turbo", "prompt": "Hi", "max_tokens": 2}
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200 and reply.json()["model"] == "olmoe-instruct"
        missing = client.post("/v1/completions", json={**body, "model": "other"})
        assert missing.status_code == 404
        assert "serves 'olmoe-instruct' or 'gpt-3.5-turbo'" in missing.json()["error"]["message"]
