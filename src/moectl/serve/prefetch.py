"""Switch prediction for prefetching: which experts to start loading before the next token needs them.

An option (TE-MoE §2.2, §3.2: only ω lives in fast memory) is pinned while it lasts; when a switch
is coming, the next option's missing experts can be loaded ahead of the next token, overlapping
the remaining compute (``loader.py``). A predictor looks at the current token only and returns the
experts to prefetch in priority order, or nothing when no switch is predicted. Prefetching only
changes what is resident, never the routing, so the generated tokens are the same with it or
without (tested); the resident set decides where prefetched experts may go
(``ResidentSet.prefetch``: free or evictable, non-pinned slots only).

- Router as option (``option:K_HAT``): a switch at the next token is predicted when, at this
  token, the router's ``top_k + lookahead`` most probable experts include one outside the option
  ω: a runner-up that the next token may activate, breaking ω. The predicted next option is the
  one the switch-rate rule would start if those runners-up were activated: them first, then the
  most probable experts, k-hat in all (``metrics.switch_rate.option_of``).
- Controller (``controller:DIR``): a switch is predicted when the termination head's β(h_t, ω_t)
  (for the option in force after this token's decision) exceeds ``beta``; the predicted next option
  is the selection head's top-k-hat at h_t, i.e. what greedy call-and-return (§4.1) would pick now.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moectl.errors import ConfigError


@dataclass(frozen=True)
class PrefetchConfig:
    """Thresholds of the switch predictors."""

    lookahead: int = 1  # option: runner-up ranks after top-k that count as about to enter
    beta: float = 0.5  # controller: predict a switch when β exceeds this

    def __post_init__(self) -> None:
        if self.lookahead < 1:
            raise ConfigError(f"prefetch lookahead must be >= 1, got {self.lookahead}")
        if not 0.0 <= self.beta < 1.0:
            raise ConfigError(f"prefetch beta threshold must be in [0, 1), got {self.beta}")


def option_prediction(
    probs: Tensor, option: set[int], top_k: int, k_hat: int, lookahead: int = 1
) -> list[int]:
    """Experts of the predicted next router option, runners-up outside ``option`` first; [] if none.

    ``probs`` [E] are the router's probabilities at the current token.
    """
    e = probs.shape[-1]
    inside = torch.zeros(e, dtype=torch.bool, device=probs.device)
    inside[list(option)] = True
    ranked = probs.topk(min(top_k + lookahead, e)).indices
    breaking = ranked[~inside[ranked]]
    if breaking.numel() == 0:
        return []
    score = probs.float() + 2.0 * torch.zeros(e, device=probs.device).index_fill_(0, breaking, 1.0)
    return score.topk(min(k_hat, e)).indices.tolist()


@torch.no_grad()
def controller_prediction(
    ctrl, hidden: Tensor, option: Tensor, k_hat: int, beta: float | None = 0.5
) -> list[int]:
    """Selection head's top-k-hat at ``hidden`` [d] if β(hidden, ``option`` [N] bool) > ``beta``; else [].

    ``ctrl`` is the layer's ``options.controller.LayerController``; ``beta=None`` skips the test
    (cross-layer controllers: MoE layer 0's head decided for every layer).
    """
    param = next(ctrl.parameters())
    h = hidden.reshape(1, -1).float().to(param.dtype)
    if beta is not None:
        z = ctrl.set_embedding(option.reshape(1, -1).to(param.device))
        if float(ctrl.beta(h, z)[0]) <= beta:
            return []
    return ctrl.candidates(h)[0].float().topk(k_hat).indices.tolist()


class HiddenTap:
    """A routing policy that changes nothing and keeps each MoE layer's router input h_t at the
    last position of the latest call (the controller's state, for :func:`controller_prediction`)."""

    def __init__(self) -> None:
        self.hidden: dict[int, Tensor] = {}

    def bind(self, info) -> None:
        self.hidden.clear()

    def apply(self, state) -> None:
        if state.hidden is not None:
            self.hidden[state.layer] = state.hidden[:, -1].detach()
