"""``moectl serve``'s log-probabilities: ``logprobs`` of generated tokens (completions, chat, streamed),
``echo`` with the prompt's log-probabilities, prompts as token ids and several per request, and
lm-eval's own ``local-completions`` model scoring loglikelihood requests through the server.

The server runs moectl's reference model (``models/moectl-small-standard``, float32, its own BPE
tokenizer, which lm-eval loads as a Hugging Face tokenizer) with its decoding step compiled
(``--compile``, what ``moectl serve`` does for a checkpoint); every figure is checked against one
offline forward of the same ids (``log_softmax`` of the model's logits).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

import moectl
from _server_helpers import Server

REPO = Path(__file__).resolve().parents[1]
MODEL = str(REPO / "models" / "moectl-small-standard")
NAME = "moectl-small-standard"  # what the server calls it: the folder's name
TOL = 1e-4  # float32, batched against one row: the sums' order differs


@pytest.fixture(scope="module")
def server():
    running = Server("--dtype", "float32", "--max-batch", "8", "--compile", model=MODEL, startup_s=300)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def offline():
    model, tokenizer, _ = moectl.load(MODEL, dtype="float32")
    return model, tokenizer


def logprobs_of(offline, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log-probabilities of the next token after each position, one forward."""
    model, _ = offline
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def post(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.base}{path}", json={"model": NAME, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_generated_tokens_carry_their_logprobs_and_alternatives(server, offline):
    _, tok = offline
    body = post(server, "/v1/completions",
                {"prompt": "The cat", "max_tokens": 6, "temperature": 0, "logprobs": 3, "ignore_eos": True})  # fmt: skip
    assert body["slow_reasons"] == []  # every decoding step compiled (--compile)
    lp = body["choices"][0]["logprobs"]
    ids = tok.encode("The cat")
    for _ in range(6):  # greedy offline, one forward per token
        ids.append(int(logprobs_of(offline, ids)[-1].argmax()))
    ref = logprobs_of(offline, ids)
    first = len(ids) - 6
    n = len(lp["tokens"])
    assert n == body["usage"]["completion_tokens"] == 6
    for j, (value, top) in enumerate(zip(lp["token_logprobs"], lp["top_logprobs"], strict=True)):
        expect = ref[first - 1 + j]
        assert value == pytest.approx(expect[ids[first + j]].item(), abs=TOL)
        assert 3 <= len(top) <= 4  # the 3 most likely, and the chosen one where it is not among them
        assert max(top.values()) == pytest.approx(value, abs=TOL)  # greedy: the chosen is the most likely
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(expect.topk(3).values.tolist(), abs=TOL)
    assert lp["tokens"] == [tok.decode([t]) for t in ids[first:]]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(n)]


def test_echo_scores_the_prompt_given_as_token_ids(server, offline):
    _, tok = offline
    ids = tok.encode("A small model reads a prompt", add_special_tokens=False)
    body = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = logprobs_of(offline, ids)
    expect = [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]
    assert lp["token_logprobs"][1:] == pytest.approx(expect, abs=TOL)


def test_echo_with_a_generated_token_puts_the_prompt_first(server, offline):
    _, tok = offline
    body = post(server, "/v1/completions",
                {"prompt": "Once upon", "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0})  # fmt: skip
    choice = body["choices"][0]
    prompt = tok.encode("Once upon")
    assert choice["text"].startswith("Once upon")
    assert len(choice["logprobs"]["tokens"]) == len(prompt) + 1
    ref = logprobs_of(offline, prompt)
    last = choice["logprobs"]["token_logprobs"][-1]
    assert last == pytest.approx(ref[-1].max().item(), abs=TOL)  # greedy: the most likely next token


@pytest.mark.parametrize("prompts", [["One", "Two words", "Three"], [[5, 6, 7, 8], [9], [10, 11]]])
def test_several_prompts_are_choices_equal_to_each_alone(server, prompts):
    together = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    texts = [c["text"] for c in sorted(together["choices"], key=lambda c: c["index"])]
    alone = [
        post(server, "/v1/completions", {"prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True})[
            "choices"
        ][0]["text"]
        for p in prompts
    ]
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    assert texts == alone
    assert together["usage"]["completion_tokens"] == 15


def test_streamed_logprobs_equal_the_whole_response(server):
    body = {"prompt": "The dog", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    whole = post(server, "/v1/completions", body)["choices"][0]["logprobs"]

    values, tokens = [], []
    with httpx.stream("POST", f"{server.base}/v1/completions", json={"model": NAME, **body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice["logprobs"]:
                    values += choice["logprobs"]["token_logprobs"]
                    tokens += choice["logprobs"]["tokens"]
    assert tokens == whole["tokens"]
    assert values == pytest.approx(whole["token_logprobs"], abs=TOL)


def test_chat_logprobs_with_top_alternatives(server):
    client = server.client()
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=TOL)  # greedy
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_the_openai_client_reads_completion_logprobs(server):
    out = server.client().completions.create(
        model=NAME, prompt="Hello", max_tokens=3, temperature=0, logprobs=1, echo=True
    )
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)


def test_lm_eval_local_completions_scores_loglikelihood_through_the_server(server, offline):
    """lm-eval's own API model (``local-completions``: token-id prompts, echo, logprobs=1,
    max_tokens=1) gets each continuation's log-likelihood and greedy flag as one forward gives them."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=f"{server.base}/v1/completions", model=NAME, tokenizer=MODEL, tokenizer_backend="huggingface",
        tokenized_requests=True, num_concurrent=1, max_retries=1, batch_size=2,
    )  # fmt: skip
    pairs = [("The capital of France is", " Paris"), ("Two plus two is", " four"), ("A B C", " D")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(requests)
    for (context, continuation), (value, greedy) in zip(pairs, got, strict=True):
        ctx, cont = lm._encode_pair(context, continuation)
        ref = logprobs_of(offline, ctx + cont)
        rows = ref[len(ctx) - 1 : len(ctx) - 1 + len(cont)]
        target = torch.tensor(cont)
        assert value == pytest.approx(rows.gather(1, target[:, None]).sum().item(), abs=1e-3)
        assert greedy == bool((rows.argmax(1) == target).all())


def test_lm_eval_local_completions_generates_through_the_server(server):
    """lm-eval's ``generate_until`` through the server (token-id prompts, stop strings, a seed)
    returns what the server answers for the same ids, cut at the stop string."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=f"{server.base}/v1/completions", model=NAME, tokenizer=MODEL, tokenizer_backend="huggingface",
        tokenized_requests=True, num_concurrent=1, max_retries=1,
    )  # fmt: skip
    context = "Once upon a time"
    got = lm.generate_until([Instance("generate_until", {}, (context, {"until": ["."], "max_gen_toks": 12}), 0)])
    ids = lm.tok_encode(context)
    direct = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0, "stop": ["."]})
    assert got == [direct["choices"][0]["text"]] and got[0]


def test_a_default_routing_serves_requests_that_name_none(tmp_path):
    """``--default-routing NAME``: a request without ``routing`` (lm-eval's, say) is routed by NAME,
    as one naming it; the response and ``/v1/models`` say so."""
    subset = tmp_path / "half.subset.json"
    subset.write_text(json.dumps({"keep": {str(layer): [0, 1, 2, 3] for layer in range(3)}}))
    running = Server("--dtype", "float32", "--routing", f"half={subset}", "--default-routing", "half")
    try:
        ask = {"model": "tiny:olmoe", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        plain = httpx.post(f"{running.base}/v1/completions", json=ask, timeout=60).json()
        named = httpx.post(f"{running.base}/v1/completions", json={**ask, "routing": "half"}, timeout=60).json()
        card = httpx.get(f"{running.base}/v1/models", timeout=10).json()["data"][0]
    finally:
        running.stop()
    assert plain["routing"] == "half" and plain["choices"][0]["text"] == named["choices"][0]["text"]
    assert card["default_routing"] == "half"


def test_tokenizer_endpoints_serve_the_models_tokenizer(server, offline):
    _, tok = offline
    ids = post(server, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False})
    assert ids["tokens"] == tok.encode("Hello there", add_special_tokens=False) and ids["count"] == len(ids["tokens"])
    assert post(server, "/detokenize", {"tokens": ids["tokens"]})["prompt"] == "Hello there"
    info = httpx.get(f"{server.base}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == tok.eos_token
    bad = httpx.post(f"{server.base}/detokenize", json={"tokens": [10**6]}, timeout=10)
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]


def test_lm_eval_finds_the_servers_tokenizer_by_itself(server):
    """``local-completions`` with no tokenizer given detects the tokenizer endpoints and scores as it
    does with the same tokenizer loaded locally."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    url = f"{server.base}/v1/completions"
    remote = LocalCompletionsAPI(base_url=url, model=NAME, num_concurrent=1, max_retries=1)
    local = LocalCompletionsAPI(
        base_url=url, model=NAME, tokenizer=MODEL, tokenizer_backend="huggingface", num_concurrent=1, max_retries=1
    )
    assert remote.tokenizer_backend == "remote"
    requests = [Instance("loglikelihood", {}, ("The capital of France is", " Paris"), 0)]
    (value, greedy), = remote.loglikelihood(requests)
    (expect, expect_greedy), = local.loglikelihood(requests)
    assert value == pytest.approx(expect, abs=1e-6) and greedy == expect_greedy


def test_the_lm_eval_server_benchmark_runs_and_agrees(capsys):
    """``benchmarks/lm_eval_server.py`` on a few pairs: both ways score the same; bad input exits 2."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import lm_eval_server

    result = lm_eval_server.main(
        ["--model", MODEL, "--pairs", "6", "--batch", "3", "--threads", "1", "--dtype", "float32"]
    )
    assert result["max_abs_loglikelihood_difference"] < 1e-4 and result["greedy_flags_equal"] == 6
    assert result["served_pairs_per_s"] > 0 and result["server_exit_status"] == 0
    for bad in (["--pairs", "0"], ["--model", str(REPO / "benchmarks")]):
        with pytest.raises(SystemExit) as stopped:
            lm_eval_server.main(bad)
        assert stopped.value.code == 2
    assert capsys.readouterr().err.count("error:") == 2
