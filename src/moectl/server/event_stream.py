"""``stream: true``: a completion's or a chat completion's generations as server-sent events.

Both endpoints stream the same way (one chunk per generated token, each naming its choice, the
usage after the last choice), so the stream is one function here that ``completion_routes.py``
and ``chat_routes.py`` share; :class:`EngineStream` is the response that cancels the engine
requests behind it however the stream ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from moectl.server.api_errors import APIError
from moectl.server.engine_events import Generation, merged
from moectl.server.logprob_bodies import chat_logprobs, completion_logprobs
from moectl.server.protocol import SamplingFields
from moectl.server.responses import DONE, Shape, sse
from moectl.server.serving_state import usage_of


class EngineStream(StreamingResponse):
    """A stream that cancels its requests however it ends early: the client disconnected (Starlette
    cancels the body iterator), a send failed, or the iterator never started."""

    def __init__(self, generations: list[Generation], content: AsyncIterator[bytes]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.generations = generations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generation in self.generations:
                generation.cancel()


async def sse_events(
    tokenizer: Any, generations: list[Generation], shape: Shape, body: SamplingFields, logprobs: bool
) -> AsyncIterator[bytes]:
    """Server-sent events of every choice as its tokens come, each chunk naming its choice
    (``index``); the usage (``stream_options.include_usage``) after the last choice finished."""
    if shape.chat:
        for index in range(len(generations)):
            yield sse(shape.chunk(None, role=True, index=index))
    offsets = [0] * len(generations)
    prompt_tokens = completion_tokens = 0
    async for index, event in merged(generations):
        if event.finish_reason == "error":
            error = APIError(500, f"generation failed: {(event.info or {}).get('error', 'engine error')}")
            yield sse(error.body())
            break
        if event.text or event.token_ids:  # a chunk per generated token, its text possibly held back
            lps = None
            if logprobs and shape.chat:
                lps = chat_logprobs(tokenizer, event.logprobs or [])
            elif logprobs:
                lps, offsets[index] = completion_logprobs(
                    tokenizer, event.token_ids, event.logprobs or [], offsets[index]
                )
            yield sse(shape.chunk(event.text, logprobs=lps, index=index))
        if event.finish_reason is not None:
            yield sse(shape.last_chunk(event.finish_reason, event.info, index=index, routed_experts=event.routed_experts))
            usage = event.usage or {}
            completion_tokens += int(usage.get("completion_tokens", 0))
            if index % body.n == 0:  # a prompt counted once, as OpenAI does
                prompt_tokens += int(usage.get("prompt_tokens", 0))
    else:
        if body.stream_options and body.stream_options.include_usage:
            yield sse(shape.usage_chunk(usage_of(prompt_tokens, completion_tokens)))
    yield DONE


def engine_stream(
    tokenizer: Any, generations: list[Generation], shape: Shape, body: SamplingFields, logprobs: bool
) -> EngineStream:
    """The streamed response of ``generations``."""
    return EngineStream(generations, sse_events(tokenizer, generations, shape, body, logprobs))
