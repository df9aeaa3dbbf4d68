"""Log-probabilities a request asks for: of each generated token and of each prompt token, with the
``top`` most likely alternatives at each position (OpenAI's ``logprobs`` and ``echo``).

A generated token's log-probability is the one of the distribution it was chosen from, before
temperature and top-p (the model's own distribution, as vLLM reports by default; a request of K
routed copies: their average in probability space, the distribution it samples). Prompt tokens
need the distribution at every prompt position: the prefill keeps the decoder's final hidden state
(``capture_hidden``) and the LM head runs on a few positions at a time (``prompt_logprobs``), so
nothing of size T × V is ever held — the way ``moectl.eval.token_scores`` scores lm-eval's
loglikelihood requests.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moectl.lm.final_hidden import decoder_of, keeping_final_hidden
from moectl.lm.lm_head import head_chunks, head_rows, output_head, vocab_size

MAX_LOGPROBS = 20  # alternatives per position a request may ask for (vLLM's default limit; OpenAI's is 5)


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token's id and log-probability, and the ``top`` most likely (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_count(value: object, name: str) -> None:
    """``value`` is None or an integer in [0, MAX_LOGPROBS] (``ValueError`` naming ``name`` if not)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {value!r}")


def of_logits(logits: Tensor, tokens: Tensor, top: int) -> list[TokenLogprob]:
    """Per row of ``logits`` [n, V] (log-probabilities or raw logits): ``tokens`` [n]' log-probability
    and the ``top`` most likely alternatives (one host copy for all rows)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, tokens.view(-1, 1).to(lp.device)).squeeze(-1)
    values, ids = lp.topk(top, dim=-1) if top else (lp[:, :0], tokens.view(-1, 1)[:, :0])
    return _rows(tokens.tolist(), chosen.tolist(), ids.tolist(), values.tolist())


def _rows(tokens: list, chosen: list, ids: list, values: list) -> list[TokenLogprob]:
    return [
        TokenLogprob(int(t), float(c), tuple(zip(map(int, i), map(float, v), strict=True)))
        for t, c, i, v in zip(tokens, chosen, ids, values, strict=True)
    ]


@contextmanager
def capture_hidden(model: nn.Module, wanted: bool) -> Iterator[list[Tensor]]:
    """While open, each forward of ``model`` appends its decoder's final hidden state [B, T, H]
    (after the final norm) to the yielded list (``lm.final_hidden.keeping_final_hidden``); nothing is
    hooked when not ``wanted``."""
    if not wanted:
        yield []
        return
    with keeping_final_hidden(decoder_of(model)) as box:
        yield box


def prompt_logprobs(model: nn.Module, hidden: Tensor, targets: Sequence[int], top: int) -> list[TokenLogprob]:
    """The log-probability of each of ``targets`` [n] (and the ``top`` alternatives) from the
    hidden states [n, H] of the positions that predict them, the LM head run on a few positions at a
    time (``lm.lm_head.head_rows``)."""
    ids = torch.tensor(list(targets), dtype=torch.long, device=hidden.device)
    out: list[TokenLogprob] = []
    for span, logits in head_chunks(output_head(model), hidden, head_rows(vocab_size(model))):
        out += of_logits(logits, ids[span], top)
        del logits
    return out
