"""``POST /v1/chat/completions``: OpenAI's chat completions over the engine.

The conversation goes through the server's ``--chat-template`` or the tokenizer's chat template
(``prompts.py``: a plain transcript for a tokenizer without one) and becomes ``n`` engine requests;
the answer is streamed (``stream: true``) or whole, ``max_tokens`` defaulting to the server's
``--default-max-tokens``, else to the rest of the context (``ServingState.max_tokens_for``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from moectl.server.engine_events import collect
from moectl.server.event_stream import engine_stream
from moectl.server.logprob_bodies import chat_logprobs
from moectl.server.prompts import chat_ids
from moectl.server.protocol import ChatCompletionRequest, message_dicts
from moectl.server.responses import Shape
from moectl.server.serving_state import Serving, ServingState, failed, usage_of

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: Serving) -> Response:
    body.check()
    state.check_model(body.model)
    ids = chat_ids(state.tokenizer, message_dicts(body.messages), body.template_kwargs(), state.chat_template)
    return await chat_all(state, request, body, ids, Shape(state.model_name, chat=True))


async def chat_all(
    state: ServingState, request: Request, body: ChatCompletionRequest, ids: list[int], shape: Shape
) -> Response:
    """A chat completion: ``n`` choices of one conversation, streamed or whole."""
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    generations = state.start_all(request, body, [ids], None, "messages", logprobs)
    if body.stream:
        return engine_stream(state.tokenizer, generations, shape, body, logprobs is not None)
    done = await collect(generations, request.receive)
    if done is None:
        return Response(status_code=499)  # the client has gone: nobody reads this
    choices, completion_tokens = [], 0
    for index, got in enumerate(done):
        failed(got.last)
        lps = None if logprobs is None else chat_logprobs(state.tokenizer, got.logprobs or [])
        choices.append(shape.choice(index, got.text, got.last.finish_reason, lps, got.last.routed_experts))
        completion_tokens += len(got.token_ids)
    return JSONResponse(shape.choices(choices, usage_of(len(ids), completion_tokens), done[0].last.info))
