"""Option-critic losses (TE-MoE §4.3, Algorithm 2 lines 14–21, advantage normalisation of A2).

Per MoE layer ℓ, from the rollout's recorded states h_t and options:

- critics: (V_Ω(h_t) − V̂targ_t)² + (Q_Ω(h_t, ω_t) − Q̂targ_t)², GAE(λ) targets with
  δ^V_t = r_t + γV(h_{t+1}) − V(h_t) and δ^Q_t = r_t + γU(ω_t, h_{t+1}) − Q(h_t, ω_t),
  U(ω, s') = β_ω(s')V(s') + (1 − β_ω(s'))Q(s', ω); weighted by the value coefficient;
- termination: w_t·β(h_t, ω_{t−1})·Â^term_t, Â^term = (Q(h_t, ω_{t−1}) − V(h_t) + η)/RMS
  (minimising it is the ascent of eq. 9: β is pushed down where Q − V + η > 0);
- selection, at switch points only: −w_t·log π_sel(ω_t | h_t)·Â^sel_t, Â^sel = (Q(h_t, ω_t) −
  V(h_t))/RMS over switch positions, with the ordered Plackett–Luce log-probability (eq. 10);
- intra-option: −w_t·log π_θ(a_t)·Â^intra_t with standardised Monte-Carlo returns (eq. 8).

Sums over steps are divided by the number of valid steps; the controller loss is averaged over
layers (the 1/L of line 22).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.options.controller import OptionController
from moectl.options.plackett_luce import pl_log_prob
from moectl.options.returns import gae, monte_carlo_returns, rms_normalise, standardise
from moectl.options.rollout import Rollout, positions
from moectl.routing import ExpertMask, route


def _shift(x: Tensor) -> Tensor:
    """x_{t+1} along dim 1, zero at the last step."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)


def controller_loss(
    controller: OptionController,
    roll: Rollout,
    eta: float,
    gamma: float = 0.95,
    lam: float = 0.95,
    value_coef: float = 0.01,
    actor: bool = True,
) -> tuple[Tensor, dict[str, float]]:
    """The controller's loss for one rollout, and its statistics (``actor=False``: critics only)."""
    valid = roll.valid.float()
    n_valid = valid.sum().clamp(min=1)
    r, w = roll.rewards, roll.weights
    next_valid = _shift(valid)
    start_pos = roll.prompt_len - 1
    total = torch.zeros((), device=r.device)
    stats: dict[str, list[float]] = {"value_loss": [], "switch_rate": [], "beta_p95": [], "beta_std": []}
    betas = []
    for layer, rec in sorted(roll.records.items()):
        ctrl = controller.layers[layer]
        sl = slice(start_pos, start_pos + r.shape[1])
        h, prev, opt = rec.hidden[:, sl], rec.prev[:, sl], rec.option[:, sl]
        order, switch, start = rec.order[:, sl], rec.switch[:, sl], rec.start[:, sl]
        steps = valid * (~start).float()
        switched = switch.float() * steps
        features = ctrl.expert_features()
        z_prev, z_opt = ctrl.set_embedding(prev, features), ctrl.set_embedding(opt, features)
        beta = ctrl.beta(h, z_prev)
        q_opt, q_prev, v = ctrl.q(h, z_opt), ctrl.q(h, z_prev), ctrl.v(h)
        with torch.no_grad():
            beta_next = ctrl.beta(_shift(h), z_opt)  # β(h_{t+1}, ω_t)
            v_next = _shift(v) * next_valid
            u_next = (beta_next * _shift(v) + (1 - beta_next) * ctrl.q(_shift(h), z_opt)) * next_valid
            adv_v = gae(r + gamma * v_next - v, valid, gamma, lam)
            adv_q = gae(r + gamma * u_next - q_opt, valid, gamma, lam)
            v_targ, q_targ = v + adv_v, q_opt + adv_q
            a_term = rms_normalise(q_prev - v + eta, steps.bool())
            a_sel = rms_normalise(q_opt - v, switched.bool())
        critic = (((v - v_targ) ** 2 + (q_opt - q_targ) ** 2) * valid).sum() / n_valid
        loss = value_coef * critic
        if actor and not (controller.config.cross_layer and layer > 0):
            loss = loss + (w * beta * a_term * steps).sum() / n_valid
        if actor and bool(switched.any()):
            logp = pl_log_prob(ctrl.candidates(h), order)
            loss = loss - (w * logp * a_sel * switched).sum() / n_valid
        total = total + loss
        stats["value_loss"].append(float(critic.detach()))
        changed = ((opt != prev).any(-1).float() * steps).sum() / steps.sum().clamp(min=1)
        stats["switch_rate"].append(float(changed))
        betas.append(beta.detach()[steps.bool()])
    all_beta = torch.cat(betas) if betas else torch.zeros(1)
    out = {k: sum(v) / max(len(v), 1) for k, v in stats.items() if k in ("value_loss", "switch_rate")}
    out["beta_mean"] = float(all_beta.mean()) if all_beta.numel() else 0.0
    out["beta_p95"] = float(all_beta.quantile(0.95)) if all_beta.numel() else 0.0
    out["beta_std"] = float(all_beta.std()) if all_beta.numel() > 1 else 0.0
    out["switch_rate_per_layer"] = stats["switch_rate"]
    return total / max(len(roll.records), 1), out


def student_log_probs(model: nn.Module, info: ModelInfo, roll: Rollout) -> Tensor:
    """log π_θ(a_t) [B, S] recomputed with gradients under the rollout's recorded options."""
    masks = {layer: rec.option for layer, rec in roll.records.items()}
    ids, attn = roll.input_ids[:, :-1], roll.attention[:, :-1]
    with route(model, ExpertMask(masks), info=info):
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions(attn)).logits
    s = roll.actions.shape[1]
    logits = logits[:, roll.prompt_len - 1 : roll.prompt_len - 1 + s].float()
    return F.log_softmax(logits, -1).gather(-1, roll.actions[:, :, None]).squeeze(-1)


def intra_option_loss(model: nn.Module, info: ModelInfo, roll: Rollout, gamma: float = 0.95) -> Tensor:
    """−Σ_t w_t·log π_θ(a_t)·Â^intra_t / (valid steps), Â^intra the standardised Ḡ_t (A2)."""
    valid = roll.valid.float()
    with torch.no_grad():
        adv = standardise(monte_carlo_returns(roll.rewards, valid, gamma), roll.valid)
    logp = student_log_probs(model, info, roll)
    return -(roll.weights * logp * adv * valid).sum() / valid.sum().clamp(min=1)
