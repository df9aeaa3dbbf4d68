"""The rows of ``scale.py``: each verb's core on a loaded model, and the token counts of its floor.

A row is a function ``run(model, tokenizer, info, sizes) -> dict`` (what it produced, for the
record) plus ``tokens(sizes) -> (T, T_kv)``: the tokens of its largest forward and of its KV
cache at the end, which ``scale_floor.floor`` turns into bytes. ``sizes`` holds the lengths the
command line chose (``--tokens``, ``--roe-tokens``, ``--prompt``, ``--new``, ``--trace-new``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo

Sizes = dict[str, int]


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    run: Callable[[nn.Module, Any, ModelInfo, Sizes], dict]
    tokens: Callable[[Sizes], tuple[int, int]]


def _ids(model: nn.Module, length: int, seed: int = 0) -> Tensor:
    vocab = int(model.config.vocab_size)
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def _text(length: int) -> str:
    """``length`` bytes of plain text (the shapes' byte tokenizer: one token per byte)."""
    words = ["the", "routing", "of", "experts", "in", "a", "mixture", "model", "decides", "which", "weights",
             "each", "token", "reads"]  # fmt: skip
    out = []
    while sum(len(w) + 1 for w in out) < length:
        out.append(words[len(out) % len(words)])
    return " ".join(out)[:length]


# -- evaluation: perplexity and log-likelihood scoring (moectl eval) ----------------------------
def perplexity(model, tokenizer, info, sizes: Sizes) -> dict:
    """``moectl eval`` perplexity (eval.perplexity.document_nll): one document of T tokens, BOS included."""
    from moectl.eval.forward import static_plan
    from moectl.eval.perplexity import Document, document_nll

    text = _text(sizes["tokens"] - 1)
    nll, tokens = document_nll(
        model, tokenizer, [Document(text)], static_plan(), info, max_length=sizes["tokens"], batch_size=1,
        progress=False,
    )  # fmt: skip
    return {"nll": float(nll[0]), "tokens": int(tokens[0])}


def scoring(model, tokenizer, info, sizes: Sizes) -> dict:
    """``moectl eval`` log-likelihood scoring (eval.scoring.score_pairs): context + continuation = T tokens."""
    from moectl.eval.forward import static_plan
    from moectl.eval.scoring import score_pairs

    text = _text(sizes["tokens"])
    cut = sizes["tokens"] - sizes["continuation"]
    scored = score_pairs(
        model, tokenizer, [(text[:cut], text[cut:])], static_plan(), info, batch_size=1,
        max_length=sizes["tokens"], progress=False,
    )  # fmt: skip
    return {"logprob": float(scored.logprob[0]), "tokens": int(scored.tokens[0])}


# -- RoE: scoring and generation (moectl roe score / generate) ----------------------------------
def _roe(K: int, tau: float = 0.3):
    from moectl.roe import RoEConfig

    return RoEConfig(K=K, tau=tau, seed=0)


def roe_score(K: int) -> Callable:
    def run(model, tokenizer, info, sizes: Sizes) -> dict:
        """RoE clean-cache scoring of T tokens (roe.parallel.parallel_token_logprobs, RoE §2.3)."""
        from moectl.roe.parallel import RoEScoringInputs, parallel_token_logprobs

        ids = _ids(model, sizes["roe_tokens"])
        lp = parallel_token_logprobs(RoEScoringInputs(model, ids, torch.ones_like(ids), _roe(K), info))
        return {"nll_per_token": float(-lp[:, 1:].mean())}

    return run


def roe_score_full(K: int) -> Callable:
    def run(model, tokenizer, info, sizes: Sizes) -> dict:
        """RoE scoring through roe.score.token_logprobs (the `moectl roe score` path)."""
        from moectl.roe.score import token_logprobs

        ids = _ids(model, sizes["roe_tokens"])
        mask = torch.ones_like(ids)
        lp = token_logprobs(model, ids, mask, mask.bool(), _roe(K), info)
        return {"nll_per_token": float(-lp[:, 1:].mean())}

    return run


def roe_generate(K: int) -> Callable:
    def run(model, tokenizer, info, sizes: Sizes) -> dict:
        """RoE greedy generation with the clean cache (roe.roe_generate, RoE §2.3)."""
        from moectl.roe import generate

        out = generate(
            model, tokenizer, [_text(sizes["prompt"])], _roe(K), max_new_tokens=sizes["new"], info=info,
            ignore_eos=True,
        )  # fmt: skip
        return {"new_tokens": len(out[0].token_ids)}

    return run


# -- subsets (moectl subset select) -------------------------------------------------------------
def subset(method: str) -> Callable:
    def run(model, tokenizer, info, sizes: Sizes) -> dict:
        """Expert-subset selection, k = top-k, one calibration text of T tokens (subsets.select)."""
        from moectl.subsets import select_subset

        ids = _ids(model, sizes["tokens"])
        keep = select_subset(
            model, ids, info.top_k, method, torch.ones_like(ids), info=info, batch_size=1,
            max_tokens=sizes["sample"],
        )  # fmt: skip
        return {"kept": {str(k): v for k, v in keep.items()}}

    return run


# -- routing traces and controllers (moectl switch-rate, options generate) ----------------------
def trace(model, tokenizer, info, sizes: Sizes) -> dict:
    """Greedy generation recording a routing trace (switch-rate's core: generate under route(record=True))."""
    from moectl.generate import Prompt, generate_tokens
    from moectl.routing import route

    with route(model, record=True, info=info) as session:
        rows = generate_tokens(
            model, tokenizer, [Prompt(_text(sizes["trace_prompt"]))], sizes["trace_new"], progress=False
        )
    assert session.trace is not None
    return {"new_tokens": len(rows[0]), "trace_positions": int(session.trace.valid.shape[1])}


def controller(model, tokenizer, info, sizes: Sizes) -> dict:
    """Generation under an (untrained) option controller (TE-MoE §4.1; options generate's core)."""
    from moectl.generate import Prompt, generate_tokens
    from moectl.options import ControllerPolicy, build_controller
    from moectl.routing import route

    policy = ControllerPolicy(build_controller(info, k_hat=2 * info.top_k), mode="greedy")
    with route(model, policy, info=info):
        rows = generate_tokens(
            model, tokenizer, [Prompt(_text(sizes["prompt"]))], sizes["new"], progress=False
        )
    return {"new_tokens": len(rows[0])}


def _t(key: str, extra: str | None = None) -> Callable[[Sizes], tuple[int, int]]:
    """(T of the largest forward, T_kv at the end): ``sizes[key]``, plus ``sizes[extra]`` generated."""

    def tokens(sizes: Sizes) -> tuple[int, int]:
        return sizes[key], sizes[key] + (sizes[extra] if extra else 0)

    return tokens


ROWS: dict[str, Row] = {
    row.name: row
    for row in [
        Row("perplexity", "eval perplexity, one window of T", perplexity, _t("tokens")),
        Row("scoring", "eval log-likelihood, T tokens", scoring, _t("tokens")),
        Row("roe-score-k1", "RoE scoring K=1", roe_score(1), _t("roe_tokens")),
        Row("roe-score-k16", "RoE scoring K=16", roe_score(16), _t("roe_tokens")),
        Row("roe-score-full-k1", "roe.score path K=1", roe_score_full(1), _t("roe_tokens")),
        Row("roe-score-full-k16", "roe.score path K=16", roe_score_full(16), _t("roe_tokens")),
        Row("roe-gen-k1", "RoE generation K=1", roe_generate(1), _t("prompt", extra="new")),
        Row("roe-gen-k16", "RoE generation K=16", roe_generate(16), _t("prompt", extra="new")),
        Row("subset-router", "subset select, router", subset("router"), _t("tokens")),
        Row("subset-easy-ep", "subset select, easy-ep", subset("easy_ep"), _t("tokens")),
        Row("subset-reconstruction", "subset select, reconstruction", subset("reconstruction"), _t("tokens")),
        Row("trace", "generation recording a trace", trace, _t("trace_prompt", extra="trace_new")),
        Row("controller", "controller generation", controller, _t("prompt", extra="new")),
    ]
}
