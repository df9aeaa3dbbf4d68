"""EMO's released checkpoints (``EmoForCausalLM``, remote code): routing inline in ``EmoSparseMoeBlock``.

The block (allenai/EMO, ``src/hf_trust_remote_code/emo/modeling_emo.py``) holds a bare ``gate``
Linear over all its experts and routes in its own forward, by one of three paths:

- ``always_active_experts`` A set: p = softmax(g) over all experts; the experts of A plus the
  top-(k − |A|) of p among the others; weights p, not renormalised.
- else ``num_shared_experts`` S > 0 (the released checkpoints: 127 routed + 1 shared, top-8): the
  last S experts are shared; softmax over the routed logits, top-(k − S); a separate softmax over
  the S shared logits, all S taken (one shared expert: weight 1).
- else softmax → top-k, renormalised when ``norm_topk_prob``.

moectl routes the routed experts (masks, pools and traces index them 0 … R − 1) with the
``softmax_topk`` rule and leaves A or the S shared experts to the block, as it leaves every
family's shared experts (EMO §4.1: one always-on shared expert).

With always-active experts p normalises over *all* experts, while moectl's rule gives the softmax
over the routed ones: ``finish`` takes EMO's own p where the selection's weights are the softmax
over every routed expert (no mask, a stock mask, noise), and rescales by Z_routed / (Z_routed + Z_A)
where a pruned mask renormalised them. Deviation: the rescaled weights equal a sliced block's up to
float rounding, not bit for bit.
Refused: ``ghost_extend_eval`` (adds a per-sequence blend of all experts: not a selection), and
``norm_topk_prob`` with shared or always-active experts (the source raises NotImplementedError).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.linear_gate import GateFamily, GateRouter, run_experts
from moectl.adapters.registry import Adapter, register_gate
from moectl.adapters.rules import RouterRule
from moectl.errors import UnsupportedModelError


def _shared(block: nn.Module) -> list[int]:
    if block.always_active_experts:
        return [int(e) for e in block.always_active_experts]
    return list(range(block.num_experts - block.num_shared_experts, block.num_experts))


def _rule(router: GateRouter) -> RouterRule:
    block, shared = router.block, _shared(router.block)
    if getattr(block, "ghost_extend_eval", False):
        raise UnsupportedModelError(
            "EMO's ghost_extend_eval adds a per-sequence blend of all experts to every token, which is "
            "not an expert selection moectl can re-route; load the model with ghost_extend_eval=False"
        )
    if shared and block.norm_topk_prob:
        raise UnsupportedModelError(
            "EMO: norm_topk_prob with shared or always-active experts is not implemented by EMO itself"
        )
    return RouterRule(
        kind="softmax_topk",
        top_k=int(block.top_k) - len(shared),
        num_experts=int(block.num_experts) - len(shared),
        norm_topk_prob=bool(block.norm_topk_prob),
    )


def _finish(block: nn.Module, logits: Tensor, weights: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """Add the always-active or shared experts with the block's own weights, in the source's order."""
    if block.always_active_experts:
        return _with_always_active(_shared(block), logits.float(), weights, idx)
    s = int(block.num_shared_experts)
    if s == 0:
        return weights, idx
    shared_w, shared_idx = torch.topk(torch.softmax(logits[:, -s:].float(), dim=-1), s, dim=-1)
    return torch.cat([weights, shared_w], dim=-1), torch.cat([idx, shared_idx + logits.shape[-1] - s], dim=-1)


def _with_always_active(
    always: list[int], logits: Tensor, weights: Tensor, idx: Tensor
) -> tuple[Tensor, Tensor]:
    """p over every expert. Rows whose weights are the softmax over all routed experts (no pruning)
    take EMO's own p = softmax(g), bit for bit; pruned rows the routed softmax × Z_routed / (Z_routed
    + Z_A), with Z_routed recovered from a chosen expert's logit and weight."""
    a = torch.tensor(always, device=logits.device)
    is_always = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device).index_fill_(0, a, True)
    routed_pos = idx - (a < idx.unsqueeze(-1)).sum(-1)  # block id -> position among the routed experts
    unpruned = (weights == torch.softmax(logits[:, ~is_always], dim=-1).gather(-1, routed_pos)).all(
        -1, keepdim=True
    )
    best = weights.argmax(dim=-1, keepdim=True)
    log_z_routed = logits.gather(-1, idx.gather(-1, best)) - weights.gather(-1, best).log()
    log_z = torch.logaddexp(log_z_routed, logits[:, a].logsumexp(dim=-1, keepdim=True))
    p = torch.softmax(logits, dim=-1)
    always_w = torch.where(unpruned, p[:, a], (logits[:, a] - log_z).exp())
    routed_w = torch.where(unpruned, p.gather(-1, idx), weights * (log_z_routed - log_z).exp())
    return torch.cat([always_w, routed_w], dim=-1), torch.cat([a.expand(idx.shape[0], -1), idx], dim=-1)


def _forward(block: nn.Module, router: GateRouter, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """The block's forward with moectl's selection: returns (output, gate logits) as the source."""
    b, t, h = hidden_states.shape
    x = hidden_states.view(-1, h)
    weights, idx, logits = router.route(x)
    return run_experts(block.experts, x, weights.to(x.dtype), idx).view(b, t, h), logits


def _after_slice(block: nn.Module, kept: list[int], config: Any, layer_idx: int) -> None:
    """Always-active ids move with the slice; per-layer counts in the config follow the block."""
    if block.always_active_experts:
        block.always_active_experts = [kept.index(int(e)) for e in block.always_active_experts]
        per = getattr(config, "always_active_experts_per_layer", None)
        per = list(per or [getattr(config, "always_active_experts", None)] * config.num_hidden_layers)
        per[layer_idx] = block.always_active_experts
        config.always_active_experts_per_layer = per
    if getattr(config, "num_experts_per_layer", None):
        config.num_experts_per_layer = [*config.num_experts_per_layer]
        config.num_experts_per_layer[layer_idx] = len(kept)


register_gate(
    GateFamily(
        block_class="EmoSparseMoeBlock",
        adapter=Adapter(family="emo", build_rule=_rule),
        forward=_forward,
        shared=_shared,
        finish=_finish,
        after_slice=_after_slice,
    )
)
