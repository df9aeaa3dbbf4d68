"""Random request bodies against the OpenAI endpoints: every answer is a 200 with choices or an
OpenAI-shaped 4xx naming what was wrong — never a 500, a traceback or a server that stops serving.

The app runs in process (``fastapi.testclient``) over an engine on a tiny float32 model; bodies mix
the fields clients send (right and wrong types, edge values, unknown fields) with a few to
generate at most a couple of tokens, so a hundred requests stay quick.
"""

from __future__ import annotations

import collections
import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moectl
from moectl.engine import Engine, EngineConfig
from moectl.server.app import create_app

MODEL = "tiny:olmoe"
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from([MODEL, "half", "nope", "", "/etc/passwd", 0.5, -1, 21, 1e9]),
    st.sampled_from(["ab\ud800cd", "\udfff", "z" * 5000]),  # a lone surrogate (escaped by json.dumps), a long text
)  # fmt: skip
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=4), st.lists(st.integers(-2, 400), max_size=6),
                   st.lists(st.lists(st.integers(-2, 300), max_size=4), max_size=3),
                   st.dictionaries(st.text(max_size=5), SCALARS, max_size=3))  # fmt: skip
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "n",
                     "logprobs", "echo", "routing", "ignore_eos", "best_of", "suffix", "stream_options",
                     "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p",
                     "repetition_penalty", "user"]  # fmt: skip
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop",
               "stream", "logprobs", "top_logprobs", "routing", "tools", "response_format", "n",
               "chat_template_kwargs", "seed", "presence_penalty", "logit_bias", "top_k", "min_p",
               "repetition_penalty"]  # fmt: skip
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                           "content": st.one_of(st.text(max_size=8), st.none(), st.integers(),
                                                st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                                                "text": st.text(max_size=4)}), max_size=2))}),
    max_size=3,
)  # fmt: skip


@pytest.fixture(scope="module")
def client():
    model, tok, _ = moectl.load(MODEL, dtype="float32")
    engine = Engine(model, tok, EngineConfig(max_batch=4, max_queue=16), routings={"half": "option:4"})
    with TestClient(create_app(engine, MODEL)) as running:
        yield running


def body_of(fields: list[str], base: dict, data) -> dict:
    body = dict(base)
    chosen = [] if data.draw(st.integers(0, 4)) == 0 else data.draw(st.lists(st.sampled_from(fields), unique=True, max_size=6))
    for name in chosen:  # a fifth of the bodies only the required fields: valid ones reach generation
        body[name] = data.draw(MESSAGES if name == "messages" else VALUES, label=name)
    if data.draw(st.booleans(), label="drop a required field"):
        body.pop(data.draw(st.sampled_from(sorted(base))), None)
    # bounded work: a count that would be valid stays tiny (none given means chat's whole context)
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 2:
            body[name] = 2
    body.setdefault("max_tokens", 2)
    return body


def post(client, path: str, body: dict):
    """The body as JSON with NaN and Infinity written out (Python's parser on the server reads them)."""
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


SEEN: collections.Counter = collections.Counter()  # status codes the fuzz reached


def check(response) -> None:
    SEEN[response.status_code] += 1
    assert response.status_code != 500, response.text
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]")
            return
        choices = response.json()["choices"]
        assert choices and all("index" in c for c in choices)
        return
    assert response.status_code in (400, 401, 404, 422, 429), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.data())
def test_random_completion_bodies(client, data):
    check(post(client, "/v1/completions", body_of(COMPLETION_FIELDS, {"model": MODEL, "prompt": "hi"}, data)))


@FUZZ
@given(data=st.data())
def test_random_chat_bodies(client, data):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    check(post(client, "/v1/chat/completions", body_of(CHAT_FIELDS, base, data)))


@FUZZ
@given(data=st.data())
def test_random_tokenizer_bodies(client, data):
    path = data.draw(st.sampled_from(["/tokenize", "/detokenize"]))
    fields = ["model", "prompt", "messages", "add_special_tokens", "tokens"]
    body = {name: data.draw(MESSAGES if name == "messages" else VALUES) for name in
            data.draw(st.lists(st.sampled_from(fields), unique=True, max_size=4))}  # fmt: skip
    response = post(client, path, body)
    assert response.status_code in (200, 400, 404), response.text


def test_the_server_still_answers_after_the_fuzz(client):
    """After the fuzz (which must have reached generation as well as the refusals)."""
    if not SEEN:
        pytest.skip("checks what the fuzz tests above reached: run the module")
    assert SEEN[200] >= 10 and SEEN[400] >= 10, SEEN  # a fifth of 240 bodies are valid
    assert client.get("/health").status_code == 200
    out = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 2})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1
