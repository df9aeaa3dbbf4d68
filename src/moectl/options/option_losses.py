"""Option-critic losses, one function per term of TE-MoE §4.3 (Algorithm 2 lines 3–19; A2).

Per MoE layer ℓ, from the rollout's recorded states h_t and options ω_t (:func:`layer_heads`):

- :func:`critic_loss` (ψ, lines 4–12 and 16): (V_Ω(h_t) − V̂targ_t)² + (Q_Ω(h_t, ω_t) − Q̂targ_t)²,
  GAE(λ) targets from δ^V_t = r_t + γV(h_{t+1}) − V(h_t) and δ^Q_t = r_t + γU_t − Q(h_t, ω_t),
  U_t = β(h_{t+1}, ω_t)V(h_{t+1}) + (1 − β(h_{t+1}, ω_t))Q(h_{t+1}, ω_t);
- :func:`termination_loss` (ν, line 13, eq. 9): w_t·β(h_t, ω_{t−1})·Â^term_t with
  Â^term = (Q(h_t, ω_{t−1}) − V(h_t) + η_t)/RMS (minimising it is the ascent of eq. 9: β is pushed
  down where Q − V + η_t > 0); η_t = η, or the cost in experts of :func:`switch_costs`;
- :func:`selection_loss` (ϕ, lines 14–15, eq. 10), at switch points only:
  −w_t·log π_sel(ω_t | h_t)·Â^sel_t, Â^sel = (Q(h_t, ω_t) − V(h_t))/RMS over the switch positions,
  with the ordered Plackett–Luce log-probability (eq. 5);
- :func:`intra_option_loss` (θ, lines 17–19, eq. 8): −w_t·log π_θ(a_t)·Â^intra_t, Â^intra the
  standardised Monte Carlo return Ḡ_t, shared by all layers.

Beyond the paper (§3 motivates η by the cost of a switch): with ``eta_per_expert`` the cost is per
step, η_t = eta_per_expert × n_new_t, n_new_t = |ω′_t ∖ ω_{t−1}| the experts that the option ω′_t
the selection head drew at t (drawn at every step, switched or not) would bring in: a one-sample
estimate of the expected cost of terminating, which eq. 9's constant η stands for.

Sums over steps are divided by the number of valid steps. Every sum over the batch that
normalises (valid steps, RMS, mean and σ) goes through ``total``: the identity in one process,
the sum over data-parallel ranks (:func:`moectl.distributed.all_reduce_sum`) when each rank holds
a part of the batch — so each rank's loss is its share of the whole batch's loss, and the summed
gradients are the whole batch's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.options.controller import LayerController, OptionController
from moectl.options.plackett_luce import pl_log_prob
from moectl.options.policy import OptionRecord
from moectl.options.returns import gae, monte_carlo_returns, rms_normalise, standardise
from moectl.options.rollout import Rollout, positions
from moectl.routing import ExpertMask, route

Total = Callable[[Tensor], Tensor]


def _same(x: Tensor) -> Tensor:
    return x


def _shift(x: Tensor) -> Tensor:
    """x_{t+1} along dim 1, zero at the last step."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)


def valid_steps(roll: Rollout, total: Total = _same) -> Tensor:
    """The number of valid steps of the (whole) batch, at least 1: every loss's denominator."""
    return total(roll.valid.float().sum()).clamp(min=1)


@dataclass
class LayerHeads:
    """The controller of layer ℓ evaluated along the generated steps t (Algorithm 2's symbols)."""

    ctrl: LayerController
    h: Tensor  # [B, S, d] h_t
    order: Tensor  # [B, S, k̂] the ordered PL tuple drawn at t
    beta: Tensor  # β(h_t, ω_{t−1})
    q: Tensor  # Q_Ω(h_t, ω_t)
    q_prev: Tensor  # Q_Ω(h_t, ω_{t−1})
    v: Tensor  # V_Ω(h_t)
    v_next: Tensor  # V_Ω(h_{t+1}), 0 after the end (no gradient)
    u_next: Tensor  # U_t = β(h_{t+1}, ω_t)V(h_{t+1}) + (1 − β)Q(h_{t+1}, ω_t), 0 after the end (no gradient)
    steps: Tensor  # float [B, S]: valid steps with t > 0 (where a termination is decided)
    switched: Tensor  # float [B, S]: d_t = 1 at those steps
    changed: Tensor  # float [B, S]: ω_t ≠ ω_{t−1} at those steps (the switch rate's events)
    n_new: Tensor  # float [B, S]: experts of the option drawn at t not in ω_{t−1}, at those steps


def layer_heads(ctrl: LayerController, rec: OptionRecord, roll: Rollout) -> LayerHeads:
    """Evaluate layer ℓ's heads at the generated steps (records at positions P − 1 + t)."""
    valid = roll.valid.float()
    sl = slice(roll.prompt_len - 1, roll.prompt_len - 1 + roll.rewards.shape[1])
    h, prev, opt = rec.hidden[:, sl], rec.prev[:, sl], rec.option[:, sl]
    steps = valid * (~rec.start[:, sl]).float()
    features = ctrl.expert_features()
    z_prev, z_opt = ctrl.set_embedding(prev, features), ctrl.set_embedding(opt, features)
    beta = ctrl.beta(h, z_prev)
    q_opt, q_prev, v = ctrl.q(h, z_opt), ctrl.q(h, z_prev), ctrl.v(h)
    with torch.no_grad():
        next_valid = _shift(valid)
        beta_next = ctrl.beta(_shift(h), z_opt)  # β(h_{t+1}, ω_t)
        v_next = _shift(v) * next_valid
        u_next = (beta_next * _shift(v) + (1 - beta_next) * ctrl.q(_shift(h), z_opt)) * next_valid
    return LayerHeads(
        ctrl=ctrl, h=h, order=rec.order[:, sl], beta=beta, q=q_opt, q_prev=q_prev, v=v,
        v_next=v_next, u_next=u_next, steps=steps, switched=rec.switch[:, sl].float() * steps,
        changed=(opt != prev).any(-1).float() * steps,
        n_new=experts_brought_in(prev, rec.order[:, sl]) * steps,
    )  # fmt: skip


def experts_brought_in(prev: Tensor, order: Tensor) -> Tensor:
    """n_new [B, S] (float): how many experts of the drawn tuple ``order`` [B, S, k̂] the option
    ``prev`` [B, S, N] (bool ω_{t−1}) lacks — the experts a switch to it loads."""
    return (~prev).gather(-1, order).sum(-1).float()


def switch_costs(
    heads: list[LayerHeads], eta: float, eta_per_expert: float | None = None, cross_layer: bool = False
) -> list[float | Tensor]:
    """η_t of each layer's termination advantage, in nats: the constant ``eta``, or with
    ``eta_per_expert`` (nats per expert brought in) eta_per_expert × n_new_t [B, S]. With
    ``cross_layer`` (§A4) one decision switches every layer, so it is charged every layer's n_new_t."""
    if eta_per_expert is None:
        return [eta] * len(heads)
    if cross_layer:
        return [eta_per_expert * torch.stack([h.n_new for h in heads]).sum(0)] * len(heads)
    return [eta_per_expert * h.n_new for h in heads]


def critic_loss(heads: LayerHeads, roll: Rollout, gamma: float, lam: float, total: Total = _same) -> Tensor:
    """ψ (lines 4–12, 16): the squared errors of V_Ω and Q_Ω against their GAE(λ) targets."""
    valid = roll.valid.float()
    r, v, q = roll.rewards, heads.v, heads.q
    with torch.no_grad():
        adv_v = gae(r + gamma * heads.v_next - v, valid, gamma, lam)  # Â^V_t, from δ^V_t (lines 7–8)
        adv_q = gae(r + gamma * heads.u_next - q, valid, gamma, lam)  # Â^Q_t, from δ^Q_t (lines 9–10)
        v_targ, q_targ = v + adv_v, q + adv_q  # line 12
    return (((v - v_targ) ** 2 + (q - q_targ) ** 2) * valid).sum() / valid_steps(roll, total)


def termination_loss(heads: LayerHeads, roll: Rollout, eta: float | Tensor, total: Total = _same) -> Tensor:
    """ν (line 13, eq. 9): w_t·β(h_t, ω_{t−1})·Â^term_t, Â^term = (Q(h_t, ω_{t−1}) − V(h_t) + η_t)/RMS;
    ``eta``: a constant, or η_t [B, S] (:func:`switch_costs`)."""
    with torch.no_grad():
        a_term = rms_normalise(heads.q_prev - heads.v + eta, heads.steps.bool(), total=total)
    return (roll.weights * heads.beta * a_term * heads.steps).sum() / valid_steps(roll, total)


def selection_loss(heads: LayerHeads, roll: Rollout, total: Total = _same) -> Tensor:
    """ϕ (lines 14–15, eq. 10): −w_t·log π_sel(ω_t | h_t)·Â^sel_t where d_t = 1, Â^sel = (Q − V)/RMS."""
    with torch.no_grad():  # the RMS over every rank's switch positions, computed on every rank
        a_sel = rms_normalise(heads.q - heads.v, heads.switched.bool(), total=total)
    n = valid_steps(roll, total)
    if not bool(heads.switched.any()):  # no switch here: no selection gradient from these rows
        return torch.zeros((), device=heads.v.device)
    logp = pl_log_prob(heads.ctrl.candidates(heads.h), heads.order)
    return -(roll.weights * logp * a_sel * heads.switched).sum() / n


def controller_loss(
    controller: OptionController,
    roll: Rollout,
    eta: float,
    gamma: float = 0.95,
    lam: float = 0.95,
    value_coef: float = 0.01,
    actor: bool = True,
    total: Total = _same,
    gather: Total = _same,
    eta_per_expert: float | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """(1/L)·Σ_ℓ [value_coef·critic + termination + selection] for one rollout (line 20's
    controller update, the sum :meth:`moectl.options.trainer.OptionsTrainer.train_step` spells
    out), and its statistics; ``actor=False`` trains the critics only. ``gather`` joins a 1-D
    tensor over data-parallel ranks (for β's quantile; identity alone). ``eta_per_expert``
    replaces ``eta`` by the per-step cost of :func:`switch_costs`."""
    loss = torch.zeros((), device=roll.rewards.device)
    cross = controller.config.cross_layer
    layers = sorted(roll.records)
    heads = [layer_heads(controller.layers[layer], roll.records[layer], roll) for layer in layers]
    etas = switch_costs(heads, eta, eta_per_expert, cross)
    decides = [not (cross and layer > 0) for layer in layers]  # §A4: layer 0 decides
    critics = []
    for h, eta_t, decided in zip(heads, etas, decides, strict=True):
        critic = critic_loss(h, roll, gamma, lam, total)
        termination = termination_loss(h, roll, eta_t, total) if actor and decided else 0.0
        selection = selection_loss(h, roll, total) if actor else 0.0
        loss = loss + (value_coef * critic + termination + selection)
        critics.append(critic)
    stats = {
        **controller_stats(heads, critics, total, gather),
        **switch_cost_stats(heads, etas, decides, total),
    }
    return loss / max(len(heads), 1), stats


def controller_stats(
    heads: list[LayerHeads], critics: list[Tensor], total: Total = _same, gather: Total = _same
) -> dict[str, Any]:
    """The controller's curves of a step: critic loss and switch rate (mean and per layer), and
    the mean, P95 and standard deviation of β over the decided steps."""
    value_loss = [float(total(c.detach())) for c in critics]
    rates = [float(total(h.changed.sum()) / total(h.steps.sum()).clamp(min=1)) for h in heads]
    betas = [h.beta.detach()[h.steps.bool()] for h in heads]
    return {
        "value_loss": sum(value_loss) / max(len(value_loss), 1),
        "switch_rate": sum(rates) / max(len(rates), 1),
        **beta_stats(gather(torch.cat(betas) if betas else torch.zeros(0))),
        "switch_rate_per_layer": rates,
    }


def switch_cost_stats(
    heads: list[LayerHeads], etas: list[float | Tensor], decides: list[bool], total: Total = _same
) -> dict[str, float]:
    """``eta_mean``: the mean η_t of the termination advantages over the decided steps of the layers
    whose β learns (nats); ``n_new_mean``: the mean experts a switch brought in, over every layer's switches."""
    zero = torch.zeros((), device=heads[0].steps.device) if heads else torch.zeros(())
    charged, decided, brought, switches = zero, zero, zero, zero
    for h, eta_t, decides_here in zip(heads, etas, decides, strict=True):
        if decides_here:
            charged = charged + (h.steps * eta_t).sum()
            decided = decided + h.steps.sum()
        brought = brought + (h.n_new * h.switched).sum()
        switches = switches + h.switched.sum()
    sums = total(torch.stack([charged, decided, brought, switches]).detach().double())
    return {
        "eta_mean": float(sums[0] / sums[1].clamp(min=1)),
        "n_new_mean": float(sums[2] / sums[3].clamp(min=1)),
    }


def beta_stats(beta: Tensor) -> dict[str, float]:
    """Mean, P95 and standard deviation of the switch probability β over the decided steps."""
    return {
        "beta_mean": float(beta.mean()) if beta.numel() else 0.0,
        "beta_p95": float(beta.quantile(0.95)) if beta.numel() else 0.0,
        "beta_std": float(beta.std()) if beta.numel() > 1 else 0.0,
    }


def student_log_probs(model: nn.Module, info: ModelInfo, roll: Rollout) -> Tensor:
    """log π_θ(a_t) [B, S] recomputed with gradients under the rollout's recorded options."""
    masks = {layer: rec.option for layer, rec in roll.records.items()}
    ids, attn = roll.input_ids[:, :-1], roll.attention[:, :-1]
    with route(model, ExpertMask(masks), info=info):
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions(attn)).logits
    s = roll.actions.shape[1]
    logits = logits[:, roll.prompt_len - 1 : roll.prompt_len - 1 + s].float().to(roll.actions.device)
    return F.log_softmax(logits, -1).gather(-1, roll.actions[:, :, None]).squeeze(-1)


def intra_option_loss(
    model: nn.Module, info: ModelInfo, roll: Rollout, gamma: float = 0.95, total: Total = _same
) -> Tensor:
    """θ (lines 17–19, eq. 8): −Σ_t w_t·log π_θ(a_t)·Â^intra_t / (valid steps), Â^intra the
    standardised Ḡ_t (A2: no baseline)."""
    valid = roll.valid.float()
    with torch.no_grad():
        adv = standardise(monte_carlo_returns(roll.rewards, valid, gamma), roll.valid, total=total)
    logp = student_log_probs(model, info, roll)
    return -(roll.weights * logp * adv * valid).sum() / valid_steps(roll, total)
