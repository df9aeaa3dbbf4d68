"""The OpenAI request shapes ``moectl serve`` accepts, and what it refuses in them.

Fields follow OpenAI's completions and chat completions APIs. Unknown fields are accepted and
ignored (clients send ``user``, ``stream_options`` and the like); a field moectl cannot honour
with a value that would change the answer (tools, ``suffix``, ``echo`` with ``stream``) is refused
with 400 naming it, never silently dropped. OpenAI's ``n``, ``presence_penalty``,
``frequency_penalty`` and ``logit_bias`` are honoured, and so are the sampling fields vLLM adds
(``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``min_tokens``;
``engine.sampling``, ``engine.penalties``); vLLM's extras that moectl does not do
(:data:`UNSUPPORTED_EXTRAS`: beam search, guided decoding, …) are refused unless they hold the
value that changes nothing. A completion's prompt may be text or token ids, one or several (as
lm-eval's ``local-completions`` sends them); ``n`` choices are drawn per prompt, prompt-major,
``seed + j`` for choice j of a prompt when a seed is given. ``logprobs`` (up to
``engine.logprobs.MAX_LOGPROBS`` alternatives) and ``echo`` (the prompt's text and
log-probabilities first; ``max_tokens: 0`` then scores the prompt alone) are answered as OpenAI's
legacy API does. Two
fields are moectl's own (the ``openai`` client sends them with ``extra_body``): ``routing``, the
name of a routing the server registered with ``--routing NAME=SPEC`` (or a policy written inline:
``server/inline_routing.py``), and ``ignore_eos`` (as vLLM
names it), to generate ``max_tokens`` tokens whatever the model says (load tests, fixed-length
switch-rate measurements).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

from moectl.engine.logprobs import check_count
from moectl.engine.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from moectl.engine.text import lone_surrogate
from moectl.server.api_errors import APIError

MAX_PROMPTS = 64  # choices in one request, prompts × n (each one engine request, in the same queue)

# vLLM's request extras that change the answer and that moectl does not do: refused (400) unless
# they hold the value that changes nothing (None: absent or null).
UNSUPPORTED_EXTRAS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (None, False),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "continue_final_message": (None, False),
    "add_generation_prompt": (None, True),
}
HINTS = {"prompt_logprobs": ": ask /v1/completions with echo and logprobs"}


def surrogate_in(value: Any) -> str | None:
    """Where a lone surrogate sits in a field's value (text, or lists and dicts of it), or None."""
    if isinstance(value, str):
        at = lone_surrogate(value)
        return None if at is None else f"U+{ord(value[at]):04X} at character {at}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        where = surrogate_in(key) or surrogate_in(item)
        if where is not None:
            return f"{where} of item {key!r}" if not isinstance(key, int) else f"{where} of item {key}"
    return None


class Body(BaseModel):
    """A request body: unknown fields allowed, text valid Unicode. JSON's ``\\ud800`` escape carries
    a lone surrogate, which no tokenizer can encode: it is a 400 naming the field, at parsing, so
    every endpoint and every tokenizer refuse it alike."""

    model_config = ConfigDict(extra="allow")

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        where = surrogate_in(value)
        if where is not None:
            raise PydanticCustomError(
                "lone_surrogate", "holds a lone surrogate ({where}); text must be valid Unicode", {"where": where}
            )
        return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(Body):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default; 0 is greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    top_k: int = 0  # vLLM's; -1 or 0: all tokens
    min_p: float = 0.0  # vLLM's
    repetition_penalty: float = 1.0  # vLLM's (transformers' meaning)
    stop_token_ids: list[int] | None = None  # vLLM's
    min_tokens: int = 0  # vLLM's
    routing: str | dict | list | None = None  # a registered name, or a policy inline (inline_routing.py)
    ignore_eos: bool = False  # moectl's (and vLLM's) extra: generate max_tokens whatever the model says
    return_routed_experts: bool = False  # SGLang's: choices carry routed_experts (engine/routed_experts.py)

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; its keys are token ids written as strings."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            pairs.append((token, value))
        return tuple(pairs)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check(self, zero_tokens: bool = False) -> None:
        """400 naming the first field moectl refuses; ``zero_tokens``: ``max_tokens: 0`` is allowed
        (a completion's echo scoring the prompt alone)."""
        if not 1 <= self.n <= MAX_PROMPTS:
            raise APIError(400, f"n must be from 1 to {MAX_PROMPTS}, got {self.n}", param="n")
        if self.max_tokens is not None and self.max_tokens < (0 if zero_tokens else 1):
            raise APIError(
                400, f"max_tokens must be at least 1 (0 only with echo), got {self.max_tokens}", param="max_tokens"
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise APIError(
                400, f"temperature must be in [0, 2] (0 is greedy), got {self.temperature}", param="temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise APIError(400, f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < -1:
            raise APIError(400, f"top_k must be -1 or 0 (all tokens) or a count, got {self.top_k}", param="top_k")
        self.bias_pairs()
        for name, fine in UNSUPPORTED_EXTRAS.items():
            value = (self.model_extra or {}).get(name)
            if not any(value is f or (f is not None and value == f and type(value) is type(f)) for f in fine):
                raise APIError(400, f"{name}={value!r} is not supported{HINTS.get(name, '')}", param=name)
        stops = self.stop_list()
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS}", param="stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise APIError(
                400, f"a stop string of {longest} characters; each may hold at most {MAX_STOP_CHARS}", param="stop"
            )


def check_logprobs(value: int | None, param: str) -> None:
    """The engine's bound (``engine.logprobs.check_count``) as a 400 naming ``param``."""
    try:
        check_count(value, param)
    except ValueError as err:
        raise APIError(400, str(err), param=param) from err


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a prompt as text or token ids, or a list of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check(zero_tokens=self.echo)  # echo with max_tokens 0: the prompt's log-probabilities alone
        prompts = self.prompts()
        if not prompts or len(prompts) * self.n > MAX_PROMPTS:
            raise APIError(
                400,
                f"prompt must be text, token ids, or a list of them, at most {MAX_PROMPTS} choices in all "
                f"(prompts × n); got {len(prompts)} prompts × n = {self.n}",
                param="prompt",
            )
        if self.echo and self.stream:
            raise APIError(400, "echo is not supported with stream: leave one of them out", param="echo")
        check_logprobs(self.logprobs, "logprobs")
        if self.best_of not in (None, self.n):
            raise APIError(
                400, f"best_of={self.best_of} is not supported: leave it out or equal to n", param="best_of"
            )
        if self.suffix:
            raise APIError(400, "suffix is not supported: leave it out", param="suffix")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text: a string, or its text parts joined (other parts are refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400, f"content part of type {part.get('type')!r} is not supported: only text parts",
                    param="messages",
                )
            parts.append(part["text"])
        return "".join(parts)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as a chat template takes them: role and text (``ChatMessage.text``)."""
    return [{"role": m.role, "content": m.text()} for m in messages]


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # newer clients' name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the chat template (enable_thinking)
    reasoning_effort: str | None = None  # OpenAI's: gpt-oss's chat template reads it (low, medium, high)

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables: ``reasoning_effort`` (as vLLM passes it to gpt-oss's
        template), then ``chat_template_kwargs``."""
        effort = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        return {**effort, **(self.chat_template_kwargs or {})}

    def check(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        elif self.max_completion_tokens is not None and self.max_completion_tokens != self.max_tokens:
            raise APIError(
                400, "max_tokens and max_completion_tokens differ: give one of them", param="max_completion_tokens"
            )
        super().check()
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", param="messages")
        check_logprobs(self.top_logprobs, "top_logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.tools:
            raise APIError(400, "tools are not supported: leave them out", param="tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise APIError(400, "response_format other than text is not supported", param="response_format")
        for message in self.messages:
            message.text()


class TokenizeRequest(Body):
    """``POST /tokenize`` (vLLM's shape, which lm-eval's remote tokenizer calls): a prompt's text, or
    a chat's messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give prompt (text) or messages (a chat), one of them", param="prompt")


class DetokenizeRequest(Body):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]
