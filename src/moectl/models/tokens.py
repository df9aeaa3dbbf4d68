"""Text to scored token ids: the one tokenisation of every moectl scorer (``eval``, ``eval --roe``, ``roe score``).

A log-likelihood request is a (context, continuation) pair of strings. It is tokenised as lm-eval
does for decoder-only models, so a BPE tokenizer's merges across the boundary are handled the same
way everywhere:

- trailing whitespace of the context moves to the continuation (``"Answer: " + "Paris"`` scores
  ``" Paris"``: BPE tokenizers attach the space to the following word);
- the pair is encoded whole, ``encode(context + continuation)``, and the continuation's tokens are
  those after the context's own tokens, ``whole[len(encode(context)):]``;
- an empty context becomes the prefix token (BOS, else EOS); if the continuation itself starts
  with that token, it is the context instead;
- no special tokens are added (``add_special_tokens=False``): BOS appears only as the prefix of an
  empty context, as in lm-eval's ``HFLM`` (``add_bos_token=False``);
- a sequence longer than ``max_length`` loses tokens from the left; when the continuation alone
  is that long its first tokens become context, so at least one token conditions the first
  scored one.

A request is then ``(ids, scored)``: the token ids fed to the model and how many trailing tokens
are scored. Documents scored whole (perplexity, lm-eval's ``loglikelihood_rolling``) are
``[prefix] + encode(text)`` cut into windows of ``max_length`` tokens overlapping by one, so every
token after the prefix is predicted exactly once.
"""

from __future__ import annotations

from typing import Any

Request = tuple[list[int], int]  # (token ids, number of trailing tokens scored)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (HF tokenizers and moectl's ByteTokenizer alike)."""
    # verbose=False: documents longer than model_max_length are windowed by the callers, not errors
    return list(tokenizer.encode(text, add_special_tokens=False, verbose=False))


def prefix_token(tokenizer: Any) -> int:
    """The token that conditions an empty context: BOS, else EOS, else 0."""
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) by lm-eval's convention (see the module doc)."""
    if not context:
        cont = encode(tokenizer, continuation)
        prefix = prefix_token(tokenizer)
        if cont and cont[0] == prefix:
            return cont[:1], cont[1:]
        return [prefix], cont
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    ctx = encode(tokenizer, context)
    if not ctx:  # a context of whitespace only: it moved to the continuation
        return encode_pair(tokenizer, "", continuation)
    whole = encode(tokenizer, context + continuation)
    return ctx, whole[len(ctx) :]


def fit(context: list[int], continuation: list[int], max_length: int) -> Request:
    """``(ids, scored)`` of a tokenised pair, cut from the left to at most ``max_length`` tokens."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (one token of context, one scored), got {max_length}")
    ids = (context + continuation)[-max_length:]
    return ids, min(len(continuation), len(ids) - 1)


def request(tokenizer: Any, context: str, continuation: str, max_length: int) -> Request:
    """``(ids, scored)`` of one (context, continuation) request; ``ValueError`` if nothing is scored."""
    ctx, cont = encode_pair(tokenizer, context, continuation)
    if not cont:
        raise ValueError(
            f"nothing to score: the continuation {continuation[:40]!r} after the context ending "
            f"{context[-40:]!r} encodes to no tokens"
        )
    return fit(ctx, cont, max_length)


def rolling_windows(tokenizer: Any, text: str, max_length: int) -> list[Request]:
    """``[prefix] + encode(text)`` as windows of ``max_length`` tokens overlapping by one token.

    Each window scores all its tokens but the first, so together they predict every token of the
    text exactly once (from at most ``max_length - 1`` tokens of context).
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    ids = [prefix_token(tokenizer), *encode(tokenizer, text)]
    step = max_length - 1
    windows = [ids[start : start + max_length] for start in range(0, max(1, len(ids) - 1), step)]
    return [(w, len(w) - 1) for w in windows]
