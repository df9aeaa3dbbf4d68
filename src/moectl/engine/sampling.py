"""Choosing each row's next token: greedy, or temperature + top-k / top-p / min-p sampling with a
seed per request.

Sampling is Gumbel-max over the temperature-scaled logits, filtered as transformers' warpers
filter them: top-k first, then top-p on what top-k kept (renormalised), then min-p (tokens below
``min_p`` times the most likely one's probability). vLLM's sampler applies min-p before top-k and
top-p; the kept set differs only where min-p and top-p are both set (min-p then changes the mass
top-p counts): transformers' order is followed, as the reference the tests check. The Gumbel
draws are a counter-based hash of (request seed, generated-token index, vocabulary index)
(``moectl.routing.keyed_hash``): a request's tokens depend on its own seed only, never on which
other requests share its batch or in what order they arrived. Rows are handled together, one
vectorised call per step.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moectl.errors import ConfigError
from moectl.routing.keyed_hash import M32, mix, uniforms

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # each stop string's length (the automaton that finds them is built per request)


def describe(stop: object) -> str:
    """A stop string as an error names it: short ones whole, long ones by their length."""
    if isinstance(stop, str) and len(stop) <= 40:
        return repr(stop)
    return f"{len(stop)} characters" if isinstance(stop, str) else type(stop).__name__


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes: OpenAI's knobs (``max_tokens``, ``temperature``, ``top_p``,
    ``seed``, ``stop``, ``logprobs``; ``prompt_logprobs`` for ``echo``; ``presence_penalty``,
    ``frequency_penalty``, ``logit_bias``), vLLM's and transformers' (``top_k``, ``min_p``,
    ``repetition_penalty``, ``stop_token_ids``, ``min_tokens``: ``engine.penalties``) and
    ``ignore_eos`` (generate ``max_tokens`` whatever the model says, as TE-MoE §3.1 measures switch
    rates on a fixed number of tokens).
    ``temperature = 0``: greedy (penalties and the bias still apply; the filters do not matter)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None  # each generated token's log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (OpenAI's echo)
    top_k: int = 0  # sample among the k most likely tokens (0: all)
    min_p: float = 0.0  # drop tokens below min_p × the most likely token's probability (0: none)
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token was generated so far
    repetition_penalty: float = 1.0  # transformers' (CTRL): logits of prompt and generated tokens / p (× p if < 0)
    logit_bias: tuple[tuple[int, float], ...] = field(default=())  # OpenAI's: (token id, added to its logit)
    stop_token_ids: tuple[int, ...] = field(default=())  # vLLM's: tokens that end the request as EOS does
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string before this many tokens
    return_routed_experts: bool = False  # vLLM's/SGLang's: the experts of every forwarded token (routed_experts)

    def __post_init__(self) -> None:
        from moectl.engine.logprobs import check_count

        for name in ("logprobs", "prompt_logprobs"):
            try:
                check_count(getattr(self, name), name)
            except ValueError as err:
                raise ConfigError(str(err)) from err
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or (
            self.temperature < 0
        ):
            raise ConfigError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0: all tokens), got {self.top_k!r}")
        if not (isinstance(self.min_p, (int, float)) and math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ConfigError(f"min_p must be in [0, 1] (0: off), got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise ConfigError(
                f"stop must be up to {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters "
                f"each, got {len(stop)}: {', '.join(describe(s) for s in stop[:3])}{', ...' if len(stop) > 3 else ''}"
            )
        object.__setattr__(self, "stop", stop)
        from moectl.engine.penalties import check_penalties

        check_penalties(self)

    @property
    def penalised(self) -> bool:
        """Whether the logits may be changed before choosing (penalties, a bias, ``min_tokens``)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def request_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or a fresh random one."""
    return params.seed if params.seed is not None else secrets.randbits(31)


def outside_nucleus(sorted_probs: Tensor, top_p: Tensor | float) -> Tensor:
    """For probabilities sorted in descending order [..., V]: True past the nucleus, the smallest
    set of most probable tokens whose mass reaches ``top_p`` (never empty). ``top_p``: a float or a
    tensor broadcasting against ``sorted_probs``."""
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
    return before >= top_p


def filter_mask(logits: Tensor, top_p: Tensor, top_k: Tensor | None = None, min_p: Tensor | None = None) -> Tensor:
    """[B, V] True for the tokens each row's filters drop: outside its ``top_k`` [B] most likely
    (0: none dropped), then outside the nucleus of ``top_p`` [B] of what top-k kept (renormalised,
    as transformers' ``TopPLogitsWarper`` sees the output of ``TopKLogitsWarper``), then below
    ``min_p`` [B] times the most likely token's probability. One sort per call."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        drop = rank >= torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(-1)
    drop = drop | outside_nucleus(probs, top_p[:, None])
    if min_p is not None:
        drop = drop | (probs < min_p[:, None] * probs[:, :1])
    return torch.zeros_like(drop).scatter(-1, order, drop)


def choose_tokens(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    keys: Tensor,
    steps: Tensor,
    top_k: Tensor | None = None,
    min_p: Tensor | None = None,
) -> Tensor:
    """Next token [B] from logits [B, V] (float32), each row with its own ``temperature`` [B],
    ``top_p`` [B], seed key ``keys`` [B] (int64, ``seed_key(seed)``), generated-token index
    ``steps`` [B] (int64), and optionally ``top_k`` [B] (int64, 0: off) and ``min_p`` [B]."""
    greedy = logits.argmax(-1)
    sampled_rows = temperature > 0
    if not bool(sampled_rows.any()):
        return greedy
    scaled = logits / temperature.clamp(min=1e-6)[:, None]
    scaled = scaled.masked_fill(filter_mask(scaled, top_p, top_k, min_p), float("-inf"))
    code = mix(keys.to(logits.device) ^ (steps.to(logits.device) * 0x2545F491 & M32))
    gumbel = -torch.log(-torch.log(uniforms(code, logits.shape[-1])))
    sampled = (scaled + gumbel).argmax(-1)
    return torch.where(sampled_rows, sampled, greedy)
