"""Request text to prompt token ids: a completion's prompt as the tokenizer encodes it, a chat
through the tokenizer's chat template.

A completion's ids are ``tokenizer.encode(prompt)`` (special tokens as the tokenizer adds them),
the ids ``tokenizer(prompt)`` gives offline: a greedy request equals ``model.generate`` of the
same prompt. A chat goes through the server's ``--chat-template`` where it has one
(``chat_template.py``), else the tokenizer's. Deviation from OpenAI, stated: a tokenizer without a chat template (moectl's byte
tokenizer for tiny and shape models) gets a plain fallback, one ``role: text`` line per message
and ``assistant:`` — there is no template to follow, and a plain transcript is what such a model
would be prompted with offline.
"""

from __future__ import annotations

from typing import Any

from moectl.server.api_errors import APIError
from moectl.server.chat_template import render_chat


def completion_ids(tokenizer: Any, prompt: str, param: str = "prompt") -> list[int]:
    """``prompt``'s token ids; an empty prompt is the BOS token where the tokenizer has one."""
    ids = list(tokenizer.encode(prompt)) if prompt else []
    if not ids:
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            raise APIError(400, f"{param} is empty and the tokenizer has no BOS token to start from", param=param)
        ids = [int(bos)]
    return [int(i) for i in ids]


def plain_chat(messages: list[dict[str, str]]) -> str:
    """The fallback transcript: ``role: text`` per message, then ``assistant:`` to answer."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


TEMPLATE_OWNED = ("messages", "add_generation_prompt", "tokenize", "conversation", "tools")


def chat_ids(
    tokenizer: Any,
    messages: list[dict[str, str]],
    template_kwargs: dict[str, Any] | None = None,
    template: str | None = None,
) -> list[int]:
    """The prompt ids of a chat: ``template`` (the server's ``--chat-template``), else the
    tokenizer's chat template, with the generation prompt (its special tokens come from the
    template, none added again), else :func:`plain_chat`. ``template_kwargs``: the request's
    variables for the template (vLLM's ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``);
    the ones this function sets itself are refused."""
    kwargs = dict(template_kwargs or {})
    taken = sorted(set(kwargs) & set(TEMPLATE_OWNED))
    if taken:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}", param="chat_template_kwargs")
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        return completion_ids(tokenizer, plain_chat(messages), param="messages")
    try:
        text = render_chat(tokenizer, messages, template, kwargs)
    except Exception as err:  # the template's own checks (e.g. roles must alternate) raise anything
        raise APIError(400, f"the chat template refused these messages: {err}", param="messages") from err
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    if not ids:
        raise APIError(400, "the chat template made an empty prompt from these messages", param="messages")
    return ids
