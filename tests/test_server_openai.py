"""``moectl serve`` against the ``openai`` client: every endpoint, streaming, routing per request,
concurrent requests equal to solo ones, OpenAI-shaped errors, disconnects, a full queue, SIGTERM.

The server runs as a subprocess (``moectl serve tiny:olmoe``, float32) on a free loopback port; the
offline reference is ``moectl.load`` + ``model.generate`` of the same prompt under the same routing.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import moectl
from _server_helpers import Server
from moectl.server.prompts import plain_chat

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serve_load

MODEL = "tiny:olmoe"
KEY = "test-key"
HALF = {"keep": {str(layer): [0, 1, 2, 3] for layer in range(3)}}  # 4 of 8 experts in each MoE layer
ROE = {"tau": [0.5, 0.5, 0.5], "K": 4}  # a RoE profile: 4 Gumbel-routed samples per token (RoE §2)
LONG_PROMPT = "Hello there"  # greedy under HALF: 1000 tokens without EOS


@pytest.fixture(scope="module")
def half_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("routing") / "half.subset.json"
    path.write_text(json.dumps(HALF))
    return path


@pytest.fixture(scope="module")
def roe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("routing") / "roe.json"
    path.write_text(json.dumps(ROE))
    return path


@pytest.fixture(scope="module")
def specs(half_file, roe_file):
    """Each routing name the server registers -> the spec the offline reference routes with."""
    return {None: None, "half": str(half_file), "opt4": "option:4", "roe": str(roe_file)}


@pytest.fixture(scope="module")
def server(half_file, roe_file):
    running = Server(
        "--dtype", "float32", "--routing", f"half={half_file}", "--routing", "opt4=option:4",
        "--routing", f"roe={roe_file}", "--max-batch", "8", "--api-key", KEY,
    )  # fmt: skip
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(KEY)


@pytest.fixture(scope="module")
def offline():
    model, tokenizer, _ = moectl.load(MODEL, dtype="float32")
    return model, tokenizer


def generate_offline(offline, prompt: str, n: int, routing=None) -> str:
    """Greedy ``model.generate`` of ``prompt`` (stops at EOS, like the server), decoded; a RoE
    profile through ``moectl.roe.generate``."""
    model, tokenizer = offline
    if routing is not None and routing.endswith("roe.json"):
        return moectl.roe.generate(model, tokenizer, [prompt], routing, max_new_tokens=n)[0].text
    ids = torch.tensor([tokenizer.encode(prompt)])
    with moectl.route(model, [] if routing is None else routing):
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=2
        )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist())


def metric(server: Server, name: str, labels: dict[str, str] | None = None) -> float | None:
    text = httpx.get(f"{server.base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels is None or sample.labels == labels):
                return sample.value
    return None


def test_models_lists_the_served_model_and_its_routings(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].routings == ["half", "opt4", "roe"]
    assert client.models.retrieve(MODEL).id == MODEL


@pytest.mark.parametrize("routing", [None, "half", "opt4", "roe"])
def test_greedy_completion_equals_offline_generate(client, offline, specs, routing):
    extra = {} if routing is None else {"routing": routing}
    out = client.completions.create(
        model=MODEL, prompt="The expert", max_tokens=20, temperature=0, extra_body=extra
    )
    assert out.choices[0].text == generate_offline(offline, "The expert", 20, specs[routing])
    assert out.routing == routing  # the response reports the routing used and its switch rate
    if routing == "roe":
        assert out.switch_rate is None  # K routings per token: no one expert set to switch
    else:
        assert 0.0 <= out.switch_rate <= 1.0
    assert out.usage.completion_tokens == 20 and out.usage.prompt_tokens == len("The expert")


def test_routing_changes_the_output(client):
    texts = {
        routing: client.completions.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=20, temperature=0, extra_body={"routing": routing}
        ).choices[0].text
        for routing in ("half", None)
    }
    assert texts["half"] != texts[None]


def test_chat_without_a_template_uses_the_plain_transcript(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == generate_offline(offline, plain_chat(messages), 12)
    assert out.object == "chat.completion"


def test_eight_concurrent_greedy_requests_equal_their_solo_outputs(client, offline, specs):
    prompts = [f"prompt number {i}: " + "xyz"[: i % 3 + 1] * (i + 1) for i in range(8)]
    routings = [None, "half", "opt4", "roe"] * 2
    solo = [generate_offline(offline, p, 16, specs[r]) for p, r in zip(prompts, routings, strict=True)]

    def ask(i: int) -> str:
        extra = {} if routings[i] is None else {"routing": routings[i]}
        out = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0, extra_body=extra)
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert together == solo


def _stream_this(client, chat: bool):
    """The create call and its arguments for the text "Stream this": a chat message or a prompt."""
    if chat:
        return client.chat.completions.create, {"messages": [{"role": "user", "content": "Stream this"}]}
    return client.completions.create, {"prompt": "Stream this"}


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_chunks_concatenate_to_the_whole_text(client, chat):
    create, kwargs = _stream_this(client, chat)
    whole = create(model=MODEL, max_tokens=24, temperature=0, extra_body={"routing": "half"}, **kwargs)
    chunks = list(
        create(
            model=MODEL, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"routing": "half"}, **kwargs,
        )
    )  # fmt: skip
    usage = chunks.pop()  # include_usage: a last chunk with no choices
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    if chat:
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == whole.choices[0].message.content
    else:
        text = "".join(c.choices[0].text for c in chunks)
        assert text == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].routing == "half"


@pytest.mark.parametrize("chat", [False, True])
def test_a_chunk_per_generated_token_even_while_its_text_is_held_back(client, chat):
    """One chunk per generated token, as OpenAI-style servers stream (and clients time): a stop string
    that starts like the text holds its first tokens' text back, and their chunks still come, empty,
    before the text follows; the chunks concatenate to the non-streamed text."""
    create, kwargs = _stream_this(client, chat)
    extra = {"ignore_eos": True}
    whole = create(model=MODEL, max_tokens=12, temperature=0, extra_body=extra, **kwargs)
    full = whole.choices[0].message.content if chat else whole.choices[0].text
    stop = full[:3] + "\u2603"  # a prefix of the text, then a character it does not hold
    assert len(full) >= 3 and stop not in full
    chunks = list(
        create(
            model=MODEL, max_tokens=12, temperature=0, stream=True, stop=[stop], extra_body=extra, **kwargs
        )
    )
    texts = [c.choices[0].delta.content if chat else c.choices[0].text for c in chunks]
    open_choice = [c.choices[0].finish_reason is None for c in chunks]
    tokens = [t for t, running in zip(texts, open_choice, strict=True) if running and t is not None]
    if chat:
        tokens = tokens[1:]  # the role's opening chunk
    assert len(tokens) == 12  # max_tokens, ignore_eos: one chunk each
    assert tokens[0] == "" and "".join(tokens) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_the_stream_ends_with_done(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", f"{server.base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[0][6:])["object"] == "text_completion"


BAD = [  # (request body, status, param, words in the message)
    ({"model": MODEL}, 400, "prompt", "missing required field 'prompt'"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "0 only with echo"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 1024}, 400, "max_tokens", "at most 1023"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "valid integer"),
    ({"model": "gpt-4o", "prompt": "x"}, 404, "model", "serves 'tiny:olmoe'"),
    ({"model": MODEL, "prompt": "x", "routing": "nope"}, 400, "routing", "registered: half, opt4, roe"),
    ({"model": MODEL, "prompt": "x", "routing": "/etc/passwd"}, 400, "routing", "registered: half, opt4, roe"),
    ({"model": MODEL, "prompt": "x", "routing": "option:2"}, 400, "routing", "registered: half, opt4, roe"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n", "from 1 to 64"),
    ({"model": MODEL, "prompt": ["a", "b"], "n": 33}, 400, "prompt", "2 prompts × n = 33"),
    ({"model": MODEL, "prompt": "x", "n": 2, "best_of": 3}, 400, "best_of", "equal to n"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, None, "presence_penalty must be a number in [-2, 2]"),
    ({"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, None, "repetition_penalty must be a number > 0"),
    ({"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k", "-1 or 0"),
    ({"model": MODEL, "prompt": "x", "min_p": 1.5}, 400, None, "min_p must be in [0, 1]"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", "token ids, got 'a'"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"7": 101}}, 400, None, "[-100, 100]"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias", "outside the vocabulary"),
    ({"model": MODEL, "prompt": "x", "echo": True, "stream": True}, 400, "echo", "not supported with stream"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs", "from 0 to 20"),
    ({"model": MODEL, "prompt": ["a"] * 65}, 400, "prompt", "at most 64 choices"),
    ({"model": MODEL, "prompt": []}, 400, "prompt", "at most 64 choices"),
    ({"model": MODEL, "prompt": [1, 2, 100000]}, 400, "prompt", "outside the vocabulary"),
    ({"model": MODEL, "prompt": [[]]}, 400, "prompt", "at least one id"),
    ({"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1, "routing": "roe"}, 400, None, "not RoE"),
    ({"model": MODEL, "prompt": "x", "temperature": 3}, 400, "temperature", "[0, 2]"),
    ({"model": MODEL, "prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "stop", "at most 16"),
]


@pytest.mark.parametrize(("body", "status", "param", "words"), BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param, words):
    response = httpx.post(f"{server.base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_malformed_json_is_a_400(server):
    response = httpx.post(
        f"{server.base}/v1/chat/completions",
        content=b'{"model": "tiny:olmoe", "messages": [',
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_the_openai_client_raises_its_own_errors(client, server):
    with pytest.raises(openai.NotFoundError, match="serves 'tiny:olmoe'") as missing:
        client.completions.create(model="other", prompt="x", max_tokens=2)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="registered: half, opt4, roe"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body={"routing": "math"}
        )
    with pytest.raises(openai.AuthenticationError, match="wrong API key"):
        server.client("not-the-key").models.list()
    missing = httpx.get(f"{server.base}/v1/models")  # no Authorization header at all
    assert missing.status_code == 401 and "no API key" in missing.json()["error"]["message"]
    assert missing.json()["error"]["code"] == "invalid_api_key"


def test_metrics_are_prometheus_text(client, server):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0, extra_body={"routing": "opt4"})
    assert metric(server, "moectl_time_to_first_token_seconds_count") >= 1
    assert metric(server, "moectl_inter_token_latency_seconds_count") >= 4
    assert metric(server, "moectl_generated_tokens_total") >= 5
    assert metric(server, "moectl_running_sequences") == 0
    assert metric(server, "moectl_queue_depth") == 0
    assert metric(server, "moectl_tokens_per_second") > 0
    assert metric(server, "moectl_switch_rate", {"routing": "opt4"}) is not None
    assert metric(server, "moectl_decode_forwards", {"forward": "lean"}) > 0  # tiny:olmoe has a lean forward
    assert metric(server, "moectl_decode_forwards", {"forward": "model"}) == 0
    ok = metric(server, "moectl_requests_total", {"endpoint": "/v1/completions", "status": "200"})
    assert ok >= 1


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(server):
    steps = metric(server, "moectl_engine_steps")
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True,
            "routing": "half"}  # fmt: skip
    with httpx.stream(
        "POST", f"{server.base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(line for line in lines if line)
        assert metric(server, "moectl_running_sequences") == 1
    deadline = time.monotonic() + 30
    while metric(server, "moectl_running_sequences") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "moectl_running_sequences") == 0
    assert metric(server, "moectl_engine_steps") - steps < 500  # the 1000 tokens were not generated


def test_the_load_benchmark_times_every_token_chunk():
    """serve_load times a chunk per generated token, with text or not (held back), not the finish or usage."""
    assert serve_load.carries_token({"choices": [{"text": "", "finish_reason": None}]})
    assert serve_load.carries_token({"choices": [{"text": "a", "finish_reason": "length"}]})
    assert not serve_load.carries_token({"choices": [{"text": "", "finish_reason": "length"}]})
    assert not serve_load.carries_token({"choices": [], "usage": {"completion_tokens": 3}})


def test_the_load_benchmark_measures_a_running_server(server, tmp_path):
    out = tmp_path / "load.json"
    result = serve_load.main(
        ["--url", server.base, "--api-key", KEY, "--model", MODEL, "--concurrency", "1,2", "--requests", "3",
         "--max-tokens", "4", "--routing", "half", "--json", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == result
    assert [row["concurrency"] for row in result["moectl"]] == [1, 2]
    for row in result["moectl"]:
        assert row["requests"] == 3 and row["completion_tokens"] == 12  # ignore_eos: 4 tokens each
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and row["tokens_per_s"] > 0


def test_the_load_benchmark_can_send_prompts_no_cache_can_reuse(monkeypatch):
    sent: list[str] = []

    async def fake_request(http, body):
        sent.append(body["prompt"])
        return {"ttft": 0.01, "gaps": [], "tokens": 1}

    monkeypatch.setattr(serve_load, "one_request", fake_request)
    asyncio.run(serve_load.level("http://127.0.0.1:9", {}, 2, 6, {}, unique=True))
    asyncio.run(serve_load.level("http://127.0.0.1:9", {}, 2, 6, {}, unique=True))
    assert len(set(sent)) == 12  # every prompt of the run differs from every other from its first token
    assert len({p.split(".")[0] for p in sent}) == 12


def test_a_client_that_gives_up_on_a_whole_response_frees_its_sequence(server):
    steps = metric(server, "moectl_engine_steps")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client waits, times out and hangs up
        httpx.post(f"{server.base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
    deadline = time.monotonic() + 30
    while metric(server, "moectl_running_sequences") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "moectl_running_sequences") == 0
    assert metric(server, "moectl_engine_steps") - steps < 500


def read_stream(lines) -> tuple[str, dict]:
    """The text of an SSE completion stream and its usage chunk (include_usage); checks [DONE]."""
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]


def test_a_full_queue_gets_429_and_sigterm_finishes_what_runs_then_exits_0():
    server = Server("--max-batch", "1", "--max-queue", "1", "--budget", "4")  # offloaded experts
    body = {"model": MODEL, "prompt": "x", "max_tokens": 300, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    try:
        with httpx.Client(base_url=server.base, timeout=60) as http, http.stream(
            "POST", "/v1/completions", json=body
        ) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the stream
            first = next(line for line in lines if line)  # generating: the one batch row
            with http.stream("POST", "/v1/completions", json=body) as waiting:  # the one queue place
                full = http.post("/v1/completions", json={**body, "stream": False})
                assert full.status_code == 429 and full.headers["retry-after"] == "1"
                assert full.json()["error"]["code"] == "rate_limit_exceeded"
                with pytest.raises(openai.RateLimitError, match="queue is full"):
                    server.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
                metrics = http.get("/metrics").text
                for name in (
                    "moectl_resident_experts",
                    "moectl_expert_hit_rate",
                    "moectl_expert_bytes_read",
                    "moectl_expert_union_mean",
                    "moectl_expert_budget_per_layer",
                ):
                    assert f"\n{name} " in metrics  # --budget: the offload figures
                assert "\nmoectl_queue_depth 1.0" in metrics
                server.proc.send_signal(signal.SIGTERM)
                first_text, first_usage = read_stream([first, *lines])
                with pytest.raises(httpx.ConnectError):  # no new connections while the second one runs
                    httpx.get(f"{server.base}/health")
                second_text, second_usage = read_stream(waiting.iter_lines())
        assert first_usage["completion_tokens"] == second_usage["completion_tokens"] == 300  # not cut off
        assert first_text == second_text  # the same greedy request, before and during shutdown
        assert server.proc.wait(30) == 0, server.output()
    finally:
        server.stop()
