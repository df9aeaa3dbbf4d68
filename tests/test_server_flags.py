"""``moectl serve``'s flags that vLLM and llama-server users reach for (#43 item 4), through the
``openai`` client as such a user sends requests: ``--max-model-len`` (the tokens a request may
hold, refused past it in vLLM's words), ``--default-max-tokens`` (a request without max_tokens, the
same on completions and chat), ``--chat-template`` (a file or the template itself, the prompt the
engine sees changed accordingly), and the 404 that lists every route. Bad values exit 2 with one
``error:`` line."""

from __future__ import annotations

import re

import openai
import pytest
from fastapi.testclient import TestClient
from tests._server_helpers import free_port
from typer.testing import CliRunner

import moectl
from moectl.cli import app as cli
from moectl.engine import Engine, EngineConfig
from moectl.errors import ConfigError
from moectl.models.load import ByteTokenizer
from moectl.server.app import create_app
from moectl.server.serve_config import ServeConfig

MODEL = "tiny:olmoe"
TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}"
    "{% if add_generation_prompt %}[answer]{% endif %}"
)
HI = [{"role": "user", "content": "Hi"}]
runner = CliRunner()


@pytest.fixture(scope="module")
def loaded():
    model, tok, _ = moectl.load(MODEL, dtype="float32")
    return model, tok


def _serve(loaded, **app_kw) -> tuple[TestClient, openai.OpenAI]:
    model, tok = loaded
    test = TestClient(create_app(Engine(model, tok, EngineConfig(max_batch=4)), MODEL, **app_kw))
    return test, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=test, max_retries=0)


def _fill(client: openai.OpenAI, chat: bool, **kw):
    """A request without max_tokens that ignores EOS, so it runs to whatever its default is."""
    extra = {"extra_body": {"ignore_eos": True}, "temperature": 0}
    if chat:
        return client.chat.completions.create(model=MODEL, messages=HI, **extra, **kw)
    return client.completions.create(model=MODEL, prompt="Hello", **extra, **kw)


def test_max_model_len_bounds_each_request_and_names_the_numbers(loaded):
    limit, prompt = 48, "x" * 30  # byte tokenizer: 30 prompt tokens
    test, client = _serve(loaded, max_model_len=limit)
    with test:
        assert test.get("/v1/models").json()["data"][0]["max_model_len"] == limit
        assert test.post("/tokenize", json={"prompt": "Hi"}).json()["max_model_len"] == limit
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=limit - 29)
        fits = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=limit - 30, extra_body={"ignore_eos": True}
        )
        with pytest.raises(openai.BadRequestError) as too_long:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * limit}])
        chat = _fill(client, chat=True)  # no max_tokens: the rest of what the server admits
    message = refused.value.body["message"]
    assert refused.value.body["param"] == "max_tokens"
    assert (
        f"This model's maximum context length is {limit} tokens. However, you requested {limit + 1} tokens "
        f"(30 in the prompt, {limit - 29} in the completion)" in message
    )
    assert f"max_tokens at most {limit - 30}" in message and "\n" not in message
    assert fits.usage.prompt_tokens + fits.usage.completion_tokens == limit
    assert f"maximum context length is {limit} tokens" in too_long.value.body["message"]
    assert (
        f"your request has {len('user: ' + 'y' * limit + chr(10) + 'assistant:')} tokens in the messages"
        in (too_long.value.body["message"])
    )
    assert chat.usage.total_tokens == limit


def test_max_model_len_past_the_models_own_is_refused(loaded):
    model, tok = loaded
    supported = model.config.max_position_embeddings
    with pytest.raises(
        ConfigError, match=f"more than the model supports: its max_position_embeddings is {supported}"
    ):
        create_app(Engine(model, tok), MODEL, max_model_len=supported + 1)
    result = runner.invoke(
        cli, ["serve", MODEL, "--max-model-len", str(supported + 1), "--port", str(free_port())]
    )
    assert result.exit_code == 2 and result.output.count("error:") == 1, result.output
    assert f"give at most {supported}" in " ".join(result.output.split())


def test_without_max_tokens_completions_and_chat_follow_one_default(loaded):
    test, client = _serve(loaded, default_max_tokens=5)
    with test:
        completion, chat = _fill(client, chat=False), _fill(client, chat=True)
        given = client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True}
        )
    assert completion.usage.completion_tokens == chat.usage.completion_tokens == 5
    assert given.usage.completion_tokens == 3  # a request's own max_tokens still rules


def test_default_max_tokens_minus_one_is_the_rest_of_the_context_on_both_endpoints(loaded):
    limit = 40
    test, client = _serve(loaded, max_model_len=limit, default_max_tokens=-1)
    with test:
        completion, chat = _fill(client, chat=False), _fill(client, chat=True)
    assert completion.usage.total_tokens == chat.usage.total_tokens == limit


def test_without_the_flag_the_defaults_are_openais(loaded):
    limit = 40
    test, client = _serve(loaded, max_model_len=limit)
    with test:
        completion, chat = _fill(client, chat=False), _fill(client, chat=True)
    assert completion.usage.completion_tokens == 16  # OpenAI's and vLLM's completions default
    assert chat.usage.total_tokens == limit  # chat: the rest of the context, as vLLM


def test_a_chat_template_changes_the_prompt_the_engine_sees(loaded, tmp_path):
    mine = ByteTokenizer().encode("<<user|Hi>>[answer]")
    plain = ByteTokenizer().encode("user: Hi\nassistant:")  # the fallback of a tokenizer without a template
    file = tmp_path / "chat.jinja"
    file.write_text(TEMPLATE)
    assert ServeConfig(MODEL, chat_template=str(file)).template_text() == TEMPLATE
    assert ServeConfig(MODEL, chat_template=TEMPLATE).template_text() == TEMPLATE
    test, client = _serve(loaded, chat_template=ServeConfig(MODEL, chat_template=str(file)).template_text())
    with test:
        tokens = test.post("/tokenize", json={"messages": HI}).json()["tokens"]
        reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        info = test.get("/tokenizer_info").json()
    assert tokens == mine and reply.usage.prompt_tokens == len(mine)
    assert info["chat_template"] == TEMPLATE
    test, client = _serve(loaded)
    with test:
        assert test.post("/tokenize", json={"messages": HI}).json()["tokens"] == plain
        assert client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2
        ).usage.prompt_tokens == len(plain)


def test_a_template_that_cannot_render_is_refused_when_the_server_starts(loaded):
    model, tok = loaded
    broken = "{{ raise_exception('this template wants a system message') }}"
    with pytest.raises(ConfigError, match="cannot render a one-message conversation: this template wants"):
        create_app(Engine(model, tok), MODEL, chat_template=broken)
    result = runner.invoke(cli, ["serve", MODEL, "--chat-template", broken, "--port", str(free_port())])
    assert result.exit_code == 2 and result.output.count("error:") == 1, result.output


def test_the_404_lists_every_route_the_app_answers(loaded):
    test, _ = _serve(loaded)
    with test:
        message = test.get("/no/such/path").json()["error"]["message"]
        schema = test.app.openapi()  # every API route, from FastAPI itself
    listed = {
        re.sub(r"\{(\w+):\w+\}", r"{\1}", entry) for entry in message.split("this server has ")[1].split(", ")
    }
    for path, methods in schema["paths"].items():
        for method in methods:
            assert f"{method.upper()} {path}" in listed, (method, path, listed)
    for route in (
        "POST /tokenize",
        "POST /detokenize",
        "GET /tokenizer_info",
        "GET /docs",
        "GET /openapi.json",
    ):
        assert route in listed


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--max-model-len", "0"], "--max-model-len must be a number of tokens >= 1, got 0"),
        (["--max-model-len", "lots"], "--max-model-len must be a whole number of tokens like 4096 or 4k"),
        (["--max-model-len", "1.5"], "--max-model-len must be a whole number of tokens"),
        (["--default-max-tokens", "0"], "--default-max-tokens must be a number of tokens >= 1, or -1"),
        (["--default-max-tokens", "-2"], "or -1 for the rest of the context; got '-2'"),
        (["--default-max-tokens", "many"], "or -1 for the rest of the context; got 'many'"),
        (["--chat-template", "no/such/template.jinja"], "no such file, and not a template"),
        (["--chat-template", "{% for m in messages %}{{ m }}"], "is not a valid Jinja template"),
    ],
)
def test_bad_values_exit_2_with_one_line_before_the_model_loads(args, words):
    result = runner.invoke(cli, ["serve", MODEL, "--port", str(free_port()), *args])
    assert result.exit_code == 2, result.output
    assert words in " ".join(result.output.split())
    assert result.output.count("error:") == 1 and "Traceback" not in result.output


def test_an_empty_template_file_is_refused(tmp_path):
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        ServeConfig(MODEL, chat_template=str(empty))


def test_the_flags_land_in_the_config(monkeypatch):
    got = []
    monkeypatch.setattr("moectl.server.serve_run.run_serve", lambda config, **_: got.append(config))
    args = [
        "serve",
        MODEL,
        "--max-model-len",
        "1K",
        "--default-max-tokens",
        "-1",
        "--chat-template",
        TEMPLATE,
    ]
    result = runner.invoke(cli, args, env={"MOECTL_API_KEY": ""})
    assert result.exit_code == 0, result.output
    assert got == [ServeConfig(MODEL, max_model_len=1024, default_max_tokens=-1, chat_template=TEMPLATE)]
