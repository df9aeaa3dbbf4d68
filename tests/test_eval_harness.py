"""The lm-eval bridge end to end on a tiny random model and a 10-item local task.

Checks that routing policies stay active inside the harness (and visibly fire), that MoectlLM
routes a request the same whatever batch, order and padding lm-eval gives it, that ensembles and
generation go through the routed path, and that moectl's own scorers agree with the harness.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import moectl
from _eval_data import tiny_eval_env
from moectl import ExpertMask
from moectl.eval.eval_tokenizer import byte_tokenizer
from moectl.eval.forward import BatchRouting, RequestBatch, static_plan
from moectl.eval.lm_backend import MoectlLM
from moectl.eval.lm_tasks import run_lm_eval, tasks_from_lm_eval

ALLOWED = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from tiny_eval_env(tmp_path_factory)


@pytest.fixture(scope="module")
def routed_run(env):
    """MoectlLM with a fixed mask over the 10-item task, once for the module: (lm, raw results)."""
    cache, model, info = env
    lm = MoectlLM(
        model,
        byte_tokenizer(),
        policies=[ExpertMask.everywhere(info, ALLOWED)],
        batch_size=8,
        switch_rate=True,
    )
    return lm, run_lm_eval(lm, ["arc_easy"], cache, log_samples=True)


def _lls(raw: dict, task: str = "arc_easy") -> torch.Tensor:
    """[docs, choices] log-likelihoods from lm-eval's logged samples, in doc order."""
    samples = sorted(raw["samples"][task], key=lambda s: s["doc_id"])
    return torch.tensor([[resp[0][0] for resp in s["resps"]] for s in samples], dtype=torch.float64)


def test_policy_stays_active_inside_the_harness(env, routed_run):
    from lm_eval.models.huggingface import HFLM

    cache, model, info = env
    lm = HFLM(pretrained=model, tokenizer=byte_tokenizer(), batch_size=8, device="cpu")
    mask = ExpertMask.everywhere(info, ALLOWED)
    with moectl.route(model, [mask], record=True) as session:
        masked = run_lm_eval(lm, ["arc_easy"], cache, log_samples=True)
    with moectl.route(model, [], record=True) as plain_session:
        plain = run_lm_eval(lm, ["arc_easy"], cache, log_samples=True)
    assert masked["n-samples"]["arc_easy"]["effective"] == 10
    assert _lls(masked).shape == (10, 4)
    for layer in range(info.num_moe_layers):
        used = session.trace.chosen[layer][session.trace.valid]
        assert used.numel() > 1000 and bool((used < 4).all()), "the mask fired on every routed token"
        unmasked = plain_session.trace.chosen[layer][plain_session.trace.valid]
        assert bool((unmasked >= 4).any()), "without the mask the router uses other experts"
    assert not torch.allclose(_lls(masked), _lls(plain)), "the mask changed the scores"
    entry = tasks_from_lm_eval(masked)["arc_easy"]
    assert entry["n"] == 10 and entry["metrics"]["acc"]["ci_method"] == "wilson"
    assert (
        entry["metrics"]["acc"]["ci95"][0]
        <= entry["metrics"]["acc"]["value"]
        <= entry["metrics"]["acc"]["ci95"][1]
    )

    # MoectlLM with the same fixed mask scores every request exactly as the plain harness did
    routed, again = routed_run
    torch.testing.assert_close(_lls(again), _lls(masked), atol=1e-4, rtol=0)
    summary = routed.switch.summary()
    assert summary["sequences"] == 40 and 0 < summary["mean"] < 1 and summary["allowed_mean"] == 0.0


def _keyed_plan(info, seen: list[RequestBatch]):
    """A per-request policy: each request gets its own 4 experts, chosen from a hash of its key."""

    def allowed_for(key: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(int(hashlib.sha1(key.encode()).hexdigest()[:8], 16))
        mask = torch.zeros(info.num_experts, dtype=torch.bool)
        mask[torch.randperm(info.num_experts, generator=g)[:4]] = True
        return mask

    def plan(batch: RequestBatch) -> BatchRouting:
        seen.append(batch)
        rows = torch.stack([allowed_for(k) for k in batch.keys])  # [B, E]
        return BatchRouting([ExpertMask(dict.fromkeys(range(info.num_moe_layers), rows))])

    return plan, allowed_for


def test_per_request_plan_ignores_batching_and_padding(env, routed_run):
    cache, model, info = env
    seen_one, seen_many = [], []
    plan_one, allowed_for = _keyed_plan(info, seen_one)
    plan_many, _ = _keyed_plan(info, seen_many)
    one = run_lm_eval(
        MoectlLM(model, byte_tokenizer(), plan=plan_one, batch_size=3), ["arc_easy"], cache, log_samples=True
    )
    many = run_lm_eval(
        MoectlLM(model, byte_tokenizer(), plan=plan_many, batch_size=8), ["arc_easy"], cache, log_samples=True
    )
    torch.testing.assert_close(_lls(one), _lls(many), atol=1e-4, rtol=0)
    keys_one = {k for b in seen_one for k in b.keys}
    keys_many = {k for b in seen_many for k in b.keys}
    assert keys_one == keys_many and len(keys_one) == 40
    assert any(bool((b.attention_mask == 0).any()) for b in seen_many), "batches were right-padded"
    assert [b.size for b in seen_one] != [b.size for b in seen_many], "the two runs batched differently"
    assert len({tuple(allowed_for(k).tolist()) for k in keys_one}) > 1, "requests really got different masks"
    assert not torch.allclose(_lls(routed_run[1]), _lls(many)), "per-request masks differ from a fixed one"


def test_ensemble_of_identical_copies_is_the_model(env, routed_run):
    cache, model, info = env
    mask = ExpertMask.everywhere(info, ALLOWED)

    def twice(batch: RequestBatch) -> BatchRouting:
        return BatchRouting([mask], repeats=2)

    double = run_lm_eval(
        MoectlLM(model, byte_tokenizer(), plan=twice, batch_size=8), ["arc_easy"], cache, log_samples=True
    )
    torch.testing.assert_close(_lls(double), _lls(routed_run[1]), atol=1e-4, rtol=0)


def test_generation_is_routed_and_ensemble_decoding_matches_generate(env):
    cache, model, info = env
    mask = ExpertMask.everywhere(info, ALLOWED)
    kwargs = {"num_fewshot": 0, "log_samples": True, "gen_kwargs": {"max_gen_toks": 6}}
    plain_lm = MoectlLM(model, byte_tokenizer(), batch_size=2)
    masked_lm = MoectlLM(model, byte_tokenizer(), policies=[mask], batch_size=2, switch_rate=True)
    ens_lm = MoectlLM(model, byte_tokenizer(), plan=lambda b: BatchRouting([mask], repeats=2), batch_size=2)
    out = {}
    for name, lm in (("plain", plain_lm), ("masked", masked_lm), ("ensemble", ens_lm)):
        raw = run_lm_eval(lm, ["gsm8k"], cache, **kwargs)
        out[name] = [s["resps"][0][0] for s in sorted(raw["samples"]["gsm8k"], key=lambda s: s["doc_id"])]
    assert len(out["masked"]) == 2 and all(len(text) > 0 for text in out["masked"])
    assert out["ensemble"] == out["masked"], "K identical routed copies decode like generate()"
    assert out["masked"] != out["plain"], "the mask is active during generation"
    assert masked_lm.switch.summary()["sequences"] == 2


def test_own_multiple_choice_scorer_agrees_with_lm_eval(env, routed_run):
    from moectl.eval.multiple_choice import evaluate_multiple_choice, mc_items
    from moectl.models.load import ByteTokenizer

    cache, model, info = env
    mask = ExpertMask.everywhere(info, ALLOWED)
    harness = routed_run[1]
    items = mc_items("arc_easy", cache)
    assert len(items) == 10 and all(len(item.requests) == 4 for item in items)
    entry = evaluate_multiple_choice(
        model, ByteTokenizer(), items, static_plan([mask]), info, batch_size=3, progress=False
    )
    scores = torch.tensor(entry["per_item"]["logprobs"], dtype=torch.float64)
    torch.testing.assert_close(scores, _lls(harness), atol=1e-4, rtol=0)
    assert entry["metrics"]["acc"]["value"] == harness["results"]["arc_easy"]["acc,none"]
    assert entry["metrics"]["acc_norm"]["value"] == harness["results"]["arc_easy"]["acc_norm,none"]


def test_perplexity_matches_a_direct_forward(env):
    from moectl.eval.perplexity import Document, document_nll, perplexity_results
    from moectl.models.load import ByteTokenizer

    _, model, info = env
    tok = ByteTokenizer()
    docs = [Document("def f(x):\n    return x", "code"), Document("The cat sat on the mat.", "prose"),
            Document("x = 1", "code")]  # fmt: skip
    nll, tokens = document_nll(
        model, tok, docs, static_plan(), info, max_length=64, batch_size=3, progress=False
    )
    for i, doc in enumerate(docs):
        ids = torch.tensor([[1, *tok.encode(doc.text)]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float(), -1)
        direct = -logp[0, :-1].gather(-1, ids[0, 1:, None]).sum()
        assert tokens[i] == len(doc.text.encode())
        assert nll[i] == pytest.approx(float(direct), abs=1e-3)
    windowed, wtokens = document_nll(
        model, tok, docs, static_plan(), info, max_length=8, batch_size=4, progress=False
    )
    assert (wtokens == tokens).all() and (windowed > 0).all()
    entries = perplexity_results(docs, nll, tokens, by_domain=True, iters=200)
    assert set(entries) == {"perplexity/all", "perplexity/code", "perplexity/prose"}
    code = entries["perplexity/code"]["metrics"]["perplexity"]
    assert code["value"] == pytest.approx(
        float(torch.exp(torch.tensor((nll[0] + nll[2]) / (tokens[0] + tokens[2]))))
    )
    assert code["ci95"][0] <= code["value"] <= code["ci95"][1] and code["ci_method"] == "bootstrap"


def test_own_scorer_reports_the_metrics_the_task_lists(env, tmp_path):
    """BoolQ's YAML lists ``acc`` only: moectl's engine reports what lm-eval's does, no ``acc_norm``."""
    from _eval_data import write_set
    from moectl.eval.multiple_choice import evaluate_multiple_choice, mc_items
    from moectl.models.load import ByteTokenizer

    _, model, info = env
    rows = [{"passage": f"The {w} is here.", "question": f"is the {w} here", "answer": i % 2 == 0}
            for i, w in enumerate(["apple", "river", "stone", "cloud"])]  # fmt: skip
    cache = tmp_path / "evals"
    write_set(cache, "boolq", "validation", rows)
    items = mc_items("boolq", cache)
    assert len(items) == 4 and all(item.metrics == ("acc",) for item in items)
    entry = evaluate_multiple_choice(model, ByteTokenizer(), items, static_plan([]), info, progress=False)
    assert set(entry["metrics"]) == {"acc"}
    arc = mc_items("arc_easy", env[0])  # lists both
    assert all(item.metrics == ("acc", "acc_norm") for item in arc)
