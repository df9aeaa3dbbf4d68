"""``POST /v1/completions``: OpenAI's completions over the engine.

Every prompt (text or token ids) becomes ``n`` engine requests, decoded together; the answer is
streamed (``stream: true``, no echo) or whole. With ``echo`` the prompt's text (and, with
``logprobs``, its tokens' log-probabilities) comes first; ``max_tokens: 0`` scores the prompt
alone, as lm-eval's loglikelihood requests ask.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from moectl.server.engine_events import collect
from moectl.server.event_stream import engine_stream
from moectl.server.logprob_bodies import completion_logprobs
from moectl.server.protocol import CompletionRequest
from moectl.server.responses import Shape
from moectl.server.serving_state import COMPLETION_DEFAULT_MAX_TOKENS, Serving, ServingState, failed, usage_of

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: Serving) -> Response:
    body.check()
    state.check_model(body.model)
    return await complete_all(state, request, body, Shape(state.model_name, chat=False))


async def complete_all(
    state: ServingState, request: Request, body: CompletionRequest, shape: Shape
) -> Response:
    """Completions: every prompt ``n`` engine requests, decoded together, streamed (no echo) or
    whole; with ``echo`` the prompt's text (and log-probabilities) first; ``max_tokens: 0`` the
    prompt alone."""
    tokenizer = state.tokenizer
    prompts = body.prompts()
    ids_list = [state.prompt_ids(p) for p in prompts]
    echo_lp = body.logprobs if body.echo else None
    default = COMPLETION_DEFAULT_MAX_TOKENS
    generations = state.start_all(request, body, ids_list, default, "prompt", body.logprobs, echo_lp)
    if body.stream:
        return engine_stream(tokenizer, generations, shape, body, body.logprobs is not None)
    done = await collect(generations, request.receive)
    if done is None:
        return Response(status_code=499)  # the client has gone: nobody reads this
    keep = body.max_tokens != 0
    choices, completion_tokens = [], 0
    for index, got in enumerate(done):
        prompt, ids = prompts[index // body.n], ids_list[index // body.n]
        failed(got.last)
        token_ids = got.token_ids if keep else []
        text = got.text if keep else ""
        if body.echo:
            text = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) + text
        lps = None
        if body.logprobs is not None:
            tokens, entries = ([*ids], [None, *(got.last.prompt_logprobs or [])]) if body.echo else ([], [])
            lps = completion_logprobs(
                tokenizer, tokens + token_ids, entries + (got.logprobs or [])[: len(token_ids)]
            )[0]
        finish = got.last.finish_reason if keep else "length"
        choices.append(shape.choice(index, text, finish, lps, got.last.routed_experts))
        completion_tokens += len(token_ids)
    usage = usage_of(sum(map(len, ids_list)), completion_tokens)  # a prompt counted once, as OpenAI does
    return JSONResponse(shape.choices(choices, usage, done[0].last.info))
