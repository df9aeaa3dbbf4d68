"""The ``logprobs`` objects of OpenAI's responses, from the engine's per-token log-probabilities.

Completions (the legacy shape lm-eval's ``local-completions`` reads): ``tokens`` (each token's
text), ``token_logprobs``, ``top_logprobs`` (a dict of token text → log-probability per position:
the ``logprobs`` most likely plus the chosen token, as vLLM returns them, so ``max`` of a dict is
the chosen token's exactly when it was the most likely) and ``text_offset`` (each token's start in
the choice's text, tokens' texts added up). With ``echo`` the prompt's tokens come first; the first
prompt token has no log-probability (null), as in OpenAI's API.

Chat completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``, the
``top_logprobs`` most likely at each generated token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moectl.engine.logprobs import TokenLogprob


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([int(token)], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Any, tokens: Sequence[int], entries: Sequence[TokenLogprob | None], offset: int = 0
) -> tuple[dict[str, Any], int]:
    """The completions ``logprobs`` object of ``tokens`` (entry None: no log-probability, the first
    prompt token), their text starting at character ``offset``; and the offset after them."""
    texts, offsets, values, tops = [], [], [], []
    for token, entry in zip(tokens, entries, strict=True):
        text = token_text(tokenizer, token)
        texts.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(entry.logprob)
        top = {token_text(tokenizer, t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)  # the chosen token, as vLLM adds it
        tops.append(top)
    body = {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
    return body, offset


def chat_logprobs(tokenizer: Any, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object of generated tokens."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries
    ]
    return {"content": content, "refusal": None}
