"""What a request holds cannot make the server's step expensive, nor crash it.

Each request with a field at its allowed maximum (the longest and the most stop strings, the
largest ``logit_bias``, ``n`` × the longest prompt, ``max_tokens`` at the context) runs engine
steps that each take a bounded multiple of a plain request's step, measured here on the tiny
model; a step's time stays flat as a request's text grows; fields past their maxima are a 400 naming
them; text that is not valid Unicode (a lone surrogate, which JSON's escapes can carry) is a 400
naming the field on every endpoint, never a 500 from the tokenizer.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest
from fastapi.testclient import TestClient

import moectl
from moectl.engine import Engine, EngineConfig
from moectl.engine.penalties import MAX_BIASED_TOKENS
from moectl.engine.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from moectl.server.app import create_app
from moectl.server.protocol import MAX_PROMPTS

MODEL = "tiny:olmoe"
STEP_FACTOR = 4.0  # a maximal request's longest step, against a plain request's longest step
STEP_SLACK_S = 0.05  # a loaded CI machine's scheduling noise


@pytest.fixture(scope="module")
def served():
    model, tok, _ = moectl.load(MODEL, dtype="float32")
    engine = Engine(model, tok, EngineConfig(max_batch=8, max_queue=128))
    steps: list[float] = []
    step = engine.step

    def timed() -> bool:
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            steps.append(time.perf_counter() - t0)

    engine.step = timed  # the engine's loop calls self.step: every step is timed
    with TestClient(create_app(engine, MODEL)) as client:
        yield client, engine, steps


def run(served, body: dict, path: str = "/v1/completions") -> tuple[dict, list[float]]:
    client, _, steps = served
    steps.clear()
    response = client.post(path, json={"model": MODEL, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json(), [s for s in steps if s > 0]


def slowest(served, body: dict) -> float:
    return max(run(served, body)[1])


def test_requests_at_every_maximum_take_steps_like_a_plain_one(served):
    _, engine, _ = served
    context, vocab = engine.max_context, engine.vocab
    plain_body = {"prompt": "Hello", "max_tokens": 32, "ignore_eos": True}
    plain_text = run(served, plain_body)[0]["choices"][0]["text"]
    long_prompt = list(range(3, 3 + 200)) * ((context - 40) // 200)  # the longest prompt n copies may take
    plain = max(slowest(served, plain_body) for _ in range(3))
    plain_long = max(slowest(served, {"prompt": long_prompt, "max_tokens": 2}) for _ in range(2))
    # stop strings that keep matching the greedy text's start, so the whole reach is held and searched
    stops = [(plain_text[: 1 + i] + "\x01" * MAX_STOP_CHARS)[:MAX_STOP_CHARS] for i in range(MAX_STOP_STRINGS)]
    cases = {
        "stop": ({**plain_body, "stop": stops}, plain),
        "logit_bias": ({**plain_body, "logit_bias": {str(i): 0.5 for i in range(min(vocab, MAX_BIASED_TOKENS))}},
                       plain),
        "every text field": ({**plain_body, "stop": stops, "logit_bias": {"7": 1.0}, "frequency_penalty": 2.0,
                              "repetition_penalty": 2.0, "top_k": 5, "min_p": 0.01, "seed": 3,
                              "temperature": 1.0}, plain),
        "n x longest prompt": ({"prompt": long_prompt, "max_tokens": 2, "n": MAX_PROMPTS}, plain_long),
    }
    for name, (body, reference) in cases.items():
        got = slowest(served, body)
        print(f"{name}: slowest step {got * 1e3:.1f} ms, plain request's {reference * 1e3:.1f} ms")
        assert got <= STEP_FACTOR * reference + STEP_SLACK_S, (name, got, reference)


def test_a_step_stays_flat_as_the_text_grows_to_the_context(served):
    """max_tokens at the context with a stop string that keeps almost matching: the last 100 steps
    take about what the first 100 take (the attention's own growth over 1,000 positions included)."""
    _, engine, _ = served
    body = {"prompt": "Hello", "max_tokens": engine.max_context - 8, "ignore_eos": True, "stop": ["\x01" * MAX_STOP_CHARS]}
    done, steps = run(served, body)
    assert done["usage"]["completion_tokens"] == engine.max_context - 8
    decode = steps[2:]  # the prefill's step first
    early, late = statistics.median(decode[:100]), statistics.median(decode[-100:])
    print(f"median step, first 100: {early * 1e3:.2f} ms, last 100: {late * 1e3:.2f} ms")
    assert late <= 3.0 * early + 0.002, (early, late)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hello", "stop": "z" * 5_000_000}, "stop"),  # the request that froze the server
        ({"prompt": "Hello", "stop": ["z" * (MAX_STOP_CHARS + 1)]}, "stop"),
        ({"prompt": "Hello", "stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"prompt": "Hello", "logit_bias": {str(i): 1 for i in range(MAX_BIASED_TOKENS + 1)}}, None),
        ({"prompt": "Hello", "n": MAX_PROMPTS + 1}, "n"),
    ],
)
def test_fields_past_their_maxima_are_a_400(served, body, param):
    client, _, _ = served
    response = client.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param


LONE = "ab\ud800cd"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": LONE}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["ok", LONE]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "ok", "stop": [LONE]}, "stop"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
         "messages.0.content"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                  "chat_template_kwargs": {"x": LONE}}, "chat_template_kwargs"),
        ("/tokenize", {"model": MODEL, "prompt": LONE}, "prompt"),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(served, path, body, param):
    client, _, _ = served
    raw = json.dumps({"max_tokens": 2, **body} if path != "/tokenize" else body)  # ensure_ascii: "\ud800" escaped
    assert "\\ud800" in raw
    response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"], error


def test_the_engine_refuses_a_lone_surrogate_in_process(served):
    _, engine, _ = served
    with pytest.raises(moectl.MoectlError, match="surrogate"):
        engine.submit(LONE)
