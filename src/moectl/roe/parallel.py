"""All positions of a sequence under RoE in two forwards: the clean pass, then the noisy samples (RoE §2.3).

With the clean cache, sample k's prediction at position t reads the *clean* keys and values of
x_<t and routes only x_t with noise. So one clean forward over the whole sequence fills a KV
cache, and one forward of the K−1 noisy copies per sequence reads it under a teacher-forced mask
(``masks.teacher_forced_masks``: a noisy row at t sees the clean keys before t and its own key t
only). :func:`sample_logits` yields those logits, clean sample first, noisy ones in chunks sized
to a memory budget; :func:`ensemble_log_probs` aggregates them into the RoE next-token
distribution at every position, the layout of a model's logits — what an evaluation harness
gathers continuations and greedy checks from.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.roe.cache import left_padded
from moectl.roe.config import RoEConfig
from moectl.roe.ensemble import experts_implementation
from moectl.roe.masks import attention_kinds, teacher_forced_masks
from moectl.roe.noise import NoiseLayout, SampleGumbel
from moectl.routing.session import route
from moectl.routing.state import Policy

_CHUNK_BYTES = 1 << 28  # logits + masks budget per noisy chunk


def _full_cache(model: nn.Module):
    """A cache whose attention layers keep every token (sliding layers too)."""
    if getattr(model.config, "model_type", "") == "minimax":
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        return MiniMaxCache()
    return DynamicCache()


def _repeat_masks(masks, c: int):
    def rep(m: Tensor | None) -> Tensor | None:
        return None if m is None else m.repeat_interleave(c, 0)

    return {k: rep(v) for k, v in masks.items()} if isinstance(masks, dict) else rep(masks)


def is_attention_only(model: nn.Module) -> bool:
    """True when every layer is attention (the parallel path needs a KV cache it can share)."""
    return not any(k.kind == "recurrent" for k in attention_kinds(model.config)[0])


@torch.no_grad()
def sample_logits(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    config: RoEConfig,
    info: ModelInfo | None = None,
    policies: Sequence[Policy] = (),
) -> Iterator[Tensor]:
    """Logits [B, c, L, V] of the K routing samples at every position of a left-padded batch.

    The first chunk is the clean sample (c = 1, tau = 0); the others hold noisy samples 1 … K−1.
    ``policies`` (a mask, a subset) apply before the noise, as in ``Ensemble``.
    """
    info = info or inspect(model)
    if not is_attention_only(model):
        raise ValueError("the parallel RoE path needs an attention-only model; use the stepwise path")
    kinds, as_dict = attention_kinds(model.config)
    valid, left_pad, position = left_padded(mask)
    b, length = ids.shape
    noise = SampleGumbel(config.taus(info.num_moe_layers), seed=config.seed)
    with experts_implementation(model, "grouped_mm"), route(model, [*policies, noise], info=info):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position,
            past_key_values=_full_cache(model),
            use_cache=True,
        )
        cache, clean = out.past_key_values, out.logits
        del out
        vocab = clean.shape[-1]
        yield clean[:, None]
        del clean
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        base_mask = teacher_forced_masks(kinds, as_dict, valid, left_pad, dtype)
        per_chunk = max(1, _CHUNK_BYTES // max(1, b * length * (vocab + 2 * length) * 4))
        for first in range(1, config.K, per_chunk):
            c = min(per_chunk, config.K - first)
            rows = b * c
            rep = _full_cache(model)
            for i, layer in enumerate(cache.layers):
                if getattr(layer, "is_initialized", False) and layer.keys is not None:
                    rep.update(layer.keys.repeat_interleave(c, 0), layer.values.repeat_interleave(c, 0), i)
            sample = (first + torch.arange(rows, device=ids.device) % c)[:, None]
            noise.layout = NoiseLayout(sample=sample, position=position.repeat_interleave(c, 0), scale=sample > 0)
            try:
                noisy = model(
                    input_ids=ids.repeat_interleave(c, 0),
                    attention_mask=_repeat_masks(base_mask, c),
                    position_ids=position.repeat_interleave(c, 0),
                    past_key_values=rep,
                    use_cache=True,
                ).logits.reshape(b, c, length, vocab)
            finally:
                noise.layout = None
            del rep
            yield noisy


@torch.no_grad()
def parallel_log_probs(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    config: RoEConfig,
    info: ModelInfo | None = None,
    policies: Sequence[Policy] = (),
) -> Tensor:
    """The clean-cache path of :func:`ensemble_log_probs`: the K samples of :func:`sample_logits`
    aggregated chunk by chunk (attention-only models)."""
    acc: Tensor | None = None
    for logits in sample_logits(model, ids, mask, config, info, policies):
        logp = torch.log_softmax(logits.float(), dim=-1)
        if config.aggregation == "prob_mean":
            part = torch.logsumexp(logp, dim=1)
            acc = part if acc is None else torch.logaddexp(acc, part)
        else:
            part = logp.sum(1)
            acc = part if acc is None else acc + part
    assert acc is not None
    if config.aggregation == "prob_mean":
        return acc - math.log(config.K)
    return torch.log_softmax(acc / config.K, dim=-1)


def ensemble_log_probs(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    config: RoEConfig,
    info: ModelInfo | None = None,
    policies: Sequence[Policy] = (),
) -> Tensor:
    """RoE next-token log-probabilities [B, L, V] (float32) at every position of a left-padded batch.

    Position t holds log p_RoE(· | x_≤t), aggregated over the K samples as ``config.aggregation``
    says (``prob_mean``: the paper's probability average, §3.1). Attention-only models use the
    two-forward clean-cache path; others (and ``cache != "clean"``) decode teacher-forced with
    ``Ensemble``, one step per position.
    """
    if config.cache == "clean" and is_attention_only(model):
        return parallel_log_probs(model, ids, mask, config, info, policies)
    return _stepwise_log_probs(model, ids, mask, config, info, policies)


def _stepwise_log_probs(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    config: RoEConfig,
    info: ModelInfo | None,
    policies: Sequence[Policy],
) -> Tensor:
    """Teacher-forced ``Ensemble`` steps: the distribution after each position (any cache variant)."""
    from moectl.roe.ensemble import Ensemble

    valid = mask.bool()
    with Ensemble(model, config, info=info, policies=policies) as ens:
        steps = [ens.start(ids[:, :1], mask[:, :1]).logprobs]
        for t in range(1, ids.shape[1]):  # one ensemble step per position: the definition, not a hot path
            steps.append(ens.step(ids[:, t], valid[:, t]).logprobs)
    return torch.stack(steps, dim=1)
