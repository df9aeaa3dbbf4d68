"""Rollouts with teacher mixing (TE-MoE §4.3, Algorithm 2 lines 3–13).

Tokens are sampled from p_mix = (1 − τ)·π_student + τ·p_teacher; each step records the
importance weight w_t = π_student(a_t)/p_mix(a_t) and the reward r_t = log p_teacher(a_t) −
log π_student(a_t) (per-token reverse KL, eq. 6). The student runs under the controller
(:class:`ControllerPolicy`, recording its decisions); the teacher is the same network in
:func:`teacher_mode`. Both keep their own KV cache; everything is batched over prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.engine.sampling import outside_nucleus
from moectl.errors import ConfigError
from moectl.options.policy import ControllerPolicy, OptionRecord
from moectl.options.row_noise import sample_tokens
from moectl.options.teacher import teacher_mode
from moectl.routing import route
from moectl.routing.kv_cache import cache_out, with_cache


@dataclass
class Rollout:
    input_ids: Tensor  # [B, P + S] left-padded prompts, then the sampled tokens
    attention: Tensor  # [B, P + S]
    prompt_len: int  # P
    actions: Tensor  # [B, S] a_t
    valid: Tensor  # [B, S] steps up to and including the end-of-sequence token
    rewards: Tensor  # [B, S] r_t
    weights: Tensor  # [B, S] w_t
    logp_student: Tensor  # [B, S] log π_student(a_t) (temperature 1)
    logp_teacher: Tensor  # [B, S] log p_teacher(a_t)
    records: dict[int, OptionRecord]  # per MoE layer, positions 0 .. P + S − 2


def positions(attention: Tensor) -> Tensor:
    return (attention.cumsum(-1) - 1).clamp(min=0)


def forward_step(model: nn.Module, ids: Tensor, attention: Tensor, cache) -> tuple[Tensor, object]:
    """Logits of the last position [B, V] (float32) for new tokens ``ids`` given the whole mask."""
    past = 0 if cache is None else cache.get_seq_length()
    out = model(
        input_ids=ids,
        attention_mask=attention,
        position_ids=positions(attention)[:, past:],
        **with_cache(cache),
        use_cache=True,
    )
    return out.logits[:, -1].float().to(ids.device), cache_out(out)  # LM head may sit elsewhere


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of tokens with cumulative probability ≥ top_p; renormalise."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(-1, descending=True)
    kept = torch.zeros_like(probs).scatter(
        -1, idx, sorted_p.masked_fill(outside_nucleus(sorted_p, top_p), 0.0)
    )
    return kept / kept.sum(-1, keepdim=True)


@torch.no_grad()
def rollout(
    model: nn.Module,
    info: ModelInfo,
    policy: ControllerPolicy,
    prompt_ids: Tensor,
    prompt_attention: Tensor,
    max_new_tokens: int,
    tau: float = 0.2,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    router_snapshot: list[Tensor] | None = None,
    codes: Tensor | None = None,
) -> Rollout:
    """Sample ``max_new_tokens`` per prompt from the teacher-mixed distribution (Algorithm 2).

    ``codes`` [B] (:func:`moectl.options.row_noise.row_codes`) key every draw — tokens, switches,
    options — by row, the same on any number of processes; without them the draws come from
    ``generator`` (tokens) and the policy's own generator."""
    if not 0.0 <= tau <= 1.0:
        raise ConfigError(f"tau (the teacher mixing ratio) must be in [0, 1], got {tau}")
    if temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {temperature}")
    policy.record = True
    policy.reset()
    policy.key_rows(codes)
    ids, attn = prompt_ids, prompt_attention
    b, p = ids.shape
    with route(model, policy, info=info):
        s_logits, s_cache = forward_step(model, ids, attn, None)
    with teacher_mode(model, info, router_snapshot):
        t_logits, t_cache = forward_step(model, ids, attn, None)
    actions, rewards, weights, lps, lpt, valid = [], [], [], [], [], []
    alive = torch.ones(b, dtype=torch.bool, device=ids.device)
    for step in range(max_new_tokens):
        ls1, lt1 = F.log_softmax(s_logits, -1), F.log_softmax(t_logits, -1)
        ps = F.softmax(s_logits / temperature, -1)
        pt = F.softmax(t_logits / temperature, -1)
        pmix = (1 - tau) * ps + tau * pt
        kept = top_p_filter(pmix, top_p)
        if codes is None:
            a = torch.multinomial(kept, 1, generator=generator).squeeze(-1)
        else:
            a = sample_tokens(kept, codes, step)
        a = torch.where(alive, a, torch.full_like(a, pad_id))
        valid.append(alive.clone())
        weights.append((ps.gather(-1, a[:, None]) / pmix.gather(-1, a[:, None])).squeeze(-1))
        lps.append(ls1.gather(-1, a[:, None]).squeeze(-1))
        lpt.append(lt1.gather(-1, a[:, None]).squeeze(-1))
        rewards.append(lpt[-1] - lps[-1])
        actions.append(a)
        if eos_id is not None:
            alive = alive & (a != eos_id)
        ids = torch.cat([ids, a[:, None]], 1)
        attn = torch.cat([attn, torch.ones_like(a)[:, None]], 1)
        if step == max_new_tokens - 1 or not bool(alive.any()):
            break
        with route(model, policy, info=info):
            s_logits, s_cache = forward_step(model, a[:, None], attn, s_cache)
        with teacher_mode(model, info, router_snapshot):
            t_logits, t_cache = forward_step(model, a[:, None], attn, t_cache)
    v = torch.stack(valid, 1)
    stack = lambda xs: torch.stack(xs, 1) * v  # noqa: E731
    return Rollout(
        input_ids=ids,
        attention=attn,
        prompt_len=p,
        actions=torch.stack(actions, 1),
        valid=v,
        rewards=stack(rewards),
        weights=stack(weights),
        logp_student=stack(lps),
        logp_teacher=stack(lpt),
        records=policy.layer_records(),
    )
