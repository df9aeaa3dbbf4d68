"""OpenAI response bodies and server-sent events, for completions and chat completions.

Both endpoints answer through one :class:`Shape`: the non-streamed body, and the chunks of a
stream (OpenAI's chunk format: ``data: {json}`` events, the last one ``data: [DONE]``). moectl
adds two top-level fields to every body and to a stream's last chunk: ``routing`` (the registered
routing name the request used, null for the model as trained) and ``switch_rate`` (the request's
own expert switch rate, null where the engine does not measure it); where the server decodes through
a compiled step (``moectl serve --compile``), ``slow_reasons`` too: why some of the request's
decoding steps took the slower lean forward (an empty list: none did). OpenAI clients keep unknown
fields (``response.routing`` / ``response.model_extra``).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``data`` as compact JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage_body(usage: dict[str, int] | None) -> dict[str, int] | None:
    if usage is None:
        return None
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def routing_fields(info: dict[str, Any] | None) -> dict[str, Any]:
    info = info or {}
    rate = info.get("switch_rate")
    out = {"routing": info.get("routing"), "switch_rate": None if rate is None else float(rate)}
    if info.get("slow_reasons") is not None:
        out["slow_reasons"] = list(info["slow_reasons"])
    return out


@dataclass
class Shape:
    """The bodies of one request: ``chat`` picks chat.completion over text_completion."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: Any = None, routed_experts: Any = None
    ) -> dict[str, Any]:
        """One choice of a response that was not streamed (``routed_experts``: the engine's tensor,
        sent encoded where the request asked for it)."""
        if self.chat:
            message = {"role": "assistant", "content": text}
            out = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return with_routed_experts(out, routed_experts)

    def choices(self, choices: list[dict[str, Any]], usage: dict | None, info: dict | None) -> dict[str, Any]:
        """The whole response of a request that was not streamed: its choices (``choice``), the usage
        and moectl's routing fields."""
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": usage_body(usage), **routing_fields(info)}

    def chunk(
        self, text: str | None, finish_reason: str | None = None, *, role: bool = False, logprobs: Any = None,
        index: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        """One streamed chunk of choice ``index``: a text delta (chat: ``role`` opens the message),
        or the finish."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:  # a token's chunk: its text, "" while held back
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def last_chunk(
        self, finish_reason: str | None, info: dict | None, index: int = 0, routed_experts: Any = None
    ) -> dict[str, Any]:
        """The chunk that closes choice ``index``, with moectl's routing fields (and the choice's
        ``routed_experts`` where asked for)."""
        body = {**self.chunk(None, finish_reason, index=index), **routing_fields(info)}
        with_routed_experts(body["choices"][0], routed_experts)
        return body

    def usage_chunk(self, usage: dict | None) -> dict[str, Any]:
        """``stream_options.include_usage``: a last chunk with no choices and the usage."""
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": usage_body(usage)}


def with_routed_experts(choice: dict[str, Any], experts: Any) -> dict[str, Any]:
    """``choice`` with ``routed_experts`` (``engine/routed_experts.encode``: a .npy in base64, as
    vLLM sends it) where the engine returned them."""
    if experts is not None:
        from moectl.engine.routed_experts import encode

        choice["routed_experts"] = encode(experts)
    return choice
