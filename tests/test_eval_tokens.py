"""One tokenisation for ``roe score``, ``eval --roe`` and ``eval``, checked with a BPE tokenizer.

The byte tokenizer of the tiny models never merges across the context/continuation boundary, so
it hides differences; the 8k BPE tokenizer shipped with moectl merges a space into the next word.
A tiny OLMoE with an 8192-token vocabulary reads it.
"""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

import moectl
from moectl.data.tokenizer_train import default_tokenizer_dir
from moectl.eval.forward import static_plan
from moectl.eval.lm_backend import MoectlLM
from moectl.eval.perplexity import Document, document_nll
from moectl.models.tokens import encode, encode_pair, request, rolling_windows
from moectl.roe import RoEConfig
from moectl.roe.score_data import LMItem

PAIRS = [
    ("Question: What is the capital of France?\nAnswer: ", "Paris"),  # trailing space: moves over
    ("Question: What is the capital of France?\nAnswer:", " Paris"),
    ("The cat sat on the", " mat."),
    ("", "Experts route tokens."),  # empty context: the prefix token conditions it
]


@pytest.fixture(scope="module")
def bpe():
    from transformers import AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_dir())
    model = moectl.tiny("olmoe", vocab_size=len(tokenizer))
    model.set_experts_implementation("eager")
    yield model, tokenizer, moectl.inspect(model)
    torch.set_num_threads(threads)


def _direct(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) from one forward over encode(context + continuation)."""
    stripped = context.rstrip()
    cont_text = context[len(stripped) :] + continuation
    whole = encode(tokenizer, stripped + cont_text)
    ctx = encode(tokenizer, stripped) if stripped else [tokenizer.bos_token_id]
    ids = torch.tensor([whole if stripped else ctx + whole])
    n = len(whole) - len(ctx) if stripped else len(whole)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.double(), -1)
    return float(logp[0, -n - 1 : -1].gather(-1, ids[0, -n:, None]).sum())


def test_pairs_follow_lm_evals_convention(bpe):
    _, tok, _ = bpe
    ctx, cont = encode_pair(tok, "Answer: ", "Paris")
    assert ctx == encode(tok, "Answer:") and ctx + cont == encode(tok, "Answer: Paris")
    assert cont == encode(tok, " Paris"), "the space merged into the word"
    assert encode(tok, "Answer: ") + encode(tok, "Paris") != ctx + cont, "separate encoding differs: the test bites"
    assert encode_pair(tok, "", "hi") == ([tok.bos_token_id], encode(tok, "hi"))
    ids, scored = request(tok, "a b c d e f", " g h", max_length=4)
    assert len(ids) == 4 and scored == len(encode_pair(tok, "a b c d e f", " g h")[1])
    windows = rolling_windows(tok, "one two three four five six", max_length=3)
    assert sum(n for _, n in windows) == len(encode(tok, "one two three four five six"))


def test_eval_scores_what_a_direct_forward_gives(bpe):
    model, tok, _ = bpe
    lm = MoectlLM(model, tok, batch_size=3)
    got = [lp for lp, _ in lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)])]
    want = [_direct(model, tok, *p) for p in PAIRS]
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-4, rtol=0)
    text = "Experts route tokens. The cat sat on the mat."
    nll, tokens = document_nll(model, tok, [Document(text)], static_plan(), moectl.inspect(model), max_length=5)
    assert tokens[0] == len(encode(tok, text))
    assert -nll[0] < 0
    assert lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0] == pytest.approx(
        -_nll(model, tok, text), abs=1e-4
    )


def _nll(model, tok, text: str) -> float:
    ids = torch.tensor([[tok.bos_token_id, *encode(tok, text)]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.double(), -1)
    return float(-logp[0, :-1].gather(-1, ids[0, 1:, None]).sum())


@pytest.mark.parametrize("tau", [0.0, 0.7])
def test_roe_score_and_eval_roe_tokenise_and_score_alike(bpe, tau):
    model, tok, info = bpe
    config = RoEConfig(K=3, tau=tau, seed=5)
    result = moectl.roe.score(model, tok, [LMItem(c, x) for c, x in PAIRS], config, batch_size=2, info=info)
    lm = MoectlLM(model, tok, roe=f"K=3,tau={tau}", seed=5, batch_size=3)
    harness = [lp for lp, _ in lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)])]
    torch.testing.assert_close(torch.tensor(result.loglik), torch.tensor(harness), atol=1e-4, rtol=0)
    if tau == 0.0:  # RoE without noise is the plain model, tokenised the same way
        want = [_direct(model, tok, *p) for p in PAIRS]
        torch.testing.assert_close(torch.tensor(harness, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-4, rtol=0)
