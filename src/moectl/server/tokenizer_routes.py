"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

lm-eval's ``local-completions`` finds them and tokenizes with the served tokenizer, so a client
needs no local copy of it (and cannot get one that differs from the server's).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from moectl.server.prompts import chat_ids
from moectl.server.protocol import DetokenizeRequest, TokenizeRequest, message_dicts
from moectl.server.serving_state import Serving

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: Serving) -> dict[str, Any]:
    """A prompt's or a conversation's token ids, as the completion endpoints would see them."""
    body.check()
    if body.model is not None:
        state.check_model(body.model)
    tokenizer = state.tokenizer
    if body.messages is not None:
        ids = chat_ids(tokenizer, message_dicts(body.messages), body.chat_template_kwargs, state.chat_template)
    else:
        ids = [
            int(i) for i in tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        ]
    return {"count": len(ids), "max_model_len": state.engine.max_context, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: Serving) -> dict[str, Any]:
    """Token ids' text (ids outside the vocabulary: a 400)."""
    if body.model is not None:
        state.check_model(body.model)
    state.check_ids(body.tokens, "token id", "tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(state: Serving) -> dict[str, Any]:
    """The tokenizer's class, special tokens and the chat template chat requests go through (the
    server's ``--chat-template``, else the tokenizer's; None where there is none)."""
    tokenizer = state.tokenizer
    info: dict[str, Any] = {
        "tokenizer_class": type(tokenizer).__name__,
        "model_max_length": state.engine.max_context,
    }
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        info[name] = value if isinstance(value, str) else None
    template = state.chat_template or getattr(tokenizer, "chat_template", None)
    info["chat_template"] = template if isinstance(template, str) else None
    return info
