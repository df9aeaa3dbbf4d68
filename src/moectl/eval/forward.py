"""One routed forward pass over a batch of evaluation requests, the same for every evaluator.

Harnesses batch, sort and pad requests as they like; a routing policy that belongs to a *request*
(an RoE ensemble, a controller with per-sequence state, a per-document mask) must not depend on
where the request landed. So each forward is described by a :class:`RequestBatch` — token ids,
which positions are real, and a stable ``key`` per row computed from the row's real tokens — and a
:data:`RoutingPlan` (a callable) turns that batch into a :class:`BatchRouting`: the policies to
apply for this forward and, for ensembles, how many routed copies of each row to run and average.

``repeats = K`` runs rows ``[r0, r0, …, r1, r1, …]`` (K copies each, request-major) and combines
the copies' next-token distributions, ``log mean_k p_k``; the policies see the expanded batch, so
a per-row Gumbel temperature (``GumbelTopK(row_scale=…)``) can give copy 0 the clean routing.
Each copy keeps its own noisy history. ``roe = RoEConfig(...)`` is Roster of Experts proper (RoE
§2.3): every sample reads the *clean* prefix (the shared clean cache) and only the current token
is routed with noise — computed for all positions at once by :func:`moectl.roe.parallel.ensemble_log_probs`.
The switch rate is not recorded under RoE (each of the K samples routes differently).

Randomness is the request's own (``request_noise.py``): ``static_plan`` keys Gumbel and
random-option draws by request and position, and the scorers run a request alone where a policy's
draws cannot be keyed (a sampling controller). Evaluators score with
:func:`moectl.eval.token_scores.routed_token_scores` (the LM head on chunks of positions, never
[B, T, V]); :func:`routed_log_probs` here is the whole-distribution reference it is tested against.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.ensemble.roe_config import RoEConfig
from moectl.errors import ConfigError
from moectl.eval.request_noise import keyed_policies, set_request_codes
from moectl.metrics.switch_rate import switch_rate
from moectl.roe.parallel import RoEScoringInputs, ensemble_log_probs
from moectl.routing.routing_state import Policy
from moectl.routing.session import route
from moectl.routing.trace import RoutingTrace


@dataclass
class RequestBatch:
    """What one forward call evaluates.

    ``input_ids`` [B, T]; ``attention_mask`` [B, T] (1 = real token; padding may be on either
    side); ``keys`` one stable id per row (a hash of its real tokens, so the same request gets the
    same key whatever its batch, position or padding); ``kind`` "loglikelihood" or "generate".
    """

    input_ids: Tensor
    attention_mask: Tensor
    keys: list[str]
    kind: str = "loglikelihood"

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class BatchRouting:
    """The routing of one forward: policies (seeing ``size * repeats`` rows), ensemble size, or RoE."""

    policies: Sequence[Policy] = field(default_factory=list)
    repeats: int = 1
    roe: RoEConfig | None = None

    def __post_init__(self) -> None:
        if int(self.repeats) < 1:
            raise ConfigError(f"BatchRouting.repeats must be >= 1, got {self.repeats}")
        if self.roe is not None and int(self.repeats) != 1:
            raise ConfigError("BatchRouting: give `repeats` (independent copies) or `roe`, not both")


RoutingPlan = Callable[[RequestBatch], BatchRouting]


def static_plan(policies: Sequence[Policy] = (), roe: RoEConfig | None = None) -> RoutingPlan:
    """The plan of policies that do not depend on the request (masks, exported subsets, an RoE config).

    RoE's Gumbel draws are a fixed function of (seed, layer, sample, position, expert), so the
    same request gets the same ensemble wherever the harness puts it; ``GumbelTopK`` and
    ``RandomOptions`` are replaced by their request-keyed forms (``request_noise.keyed_policies``).
    """
    fixed = BatchRouting(keyed_policies(list(policies)), 1, roe)

    def plan(batch: RequestBatch) -> BatchRouting:
        return fixed

    return plan


def request_keys(input_ids: Tensor, attention_mask: Tensor) -> list[str]:
    """A stable key per row: sha1 of the row's real token ids (padding excluded)."""
    keys = []
    ids = input_ids.detach().to("cpu", torch.int64)
    mask = attention_mask.detach().to("cpu").bool()
    for row, keep in zip(ids, mask, strict=True):
        keys.append(hashlib.sha1(row[keep].numpy().tobytes()).hexdigest()[:16])
    return keys


class SwitchStats:
    """Running switch rate (TE-MoE §2.2) over the sequences of many forward calls.

    Each call's trace is reduced at once and dropped, so memory stays that of one batch.
    ``source="router"`` treats the router as an option policy with ``k_hat`` (default top-k);
    where a policy recorded allowed sets, their own switch rate is kept too (``allowed``).
    """

    def __init__(self, k_hat: int | None = None) -> None:
        self.k_hat = k_hat
        self.rates: dict[str, list[float]] = {"router": [], "allowed": []}

    def add(self, trace: RoutingTrace | None, region: str) -> None:
        if trace is None:
            return
        try:
            report = switch_rate(trace, k_hat=self.k_hat, region=region, source="router")
        except ValueError:  # no row with two measured positions (one-token calls)
            return
        self.rates["router"].extend(report.per_sequence)
        if trace.allowed:
            allowed = switch_rate(trace, region=region, source="allowed")
            self.rates["allowed"].extend(allowed.per_sequence)

    def summary(self) -> dict[str, float | int | None]:
        """``{"mean", "allowed_mean", "sequences"}``; means are None when nothing was measured."""
        router, allowed = self.rates["router"], self.rates["allowed"]
        return {
            "mean": sum(router) / len(router) if router else None,
            "allowed_mean": sum(allowed) / len(allowed) if allowed else None,
            "sequences": len(router),
            "per_sequence": list(router),
        }


def routed_log_probs(
    model: nn.Module,
    batch: RequestBatch,
    plan: RoutingPlan,
    info: ModelInfo,
    stats: SwitchStats | None = None,
    region: str = "all",
) -> Tensor:
    """Log-probabilities [B, T, V] (float32; float64 for a float64 model) of ``batch`` under the plan's routing: the reference.

    With ``repeats = K`` the K routed copies of each row are averaged in probability space. It
    holds [B·K, T, V] logits and a float32 copy; evaluators use
    :func:`moectl.eval.token_scores.routed_token_scores`, which is tested against this.
    """
    routing = plan(batch)
    if routing.roe is not None:
        return _roe_log_probs(model, batch, routing, info)
    k = int(routing.repeats)
    ids, mask = batch.input_ids, batch.attention_mask
    set_request_codes(routing.policies, batch.keys, k)
    if k > 1:
        ids, mask = ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0)
    with (
        torch.no_grad(),
        route(model, list(routing.policies), record=stats is not None, info=info) as session,
    ):
        logits = model(input_ids=ids, attention_mask=mask).logits
    if stats is not None:
        stats.add(session.trace, region)
    logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    if k > 1:
        b, t, v = batch.size, logp.shape[1], logp.shape[2]
        logp = torch.logsumexp(logp.view(b, k, t, v), dim=1) - math.log(k)
    return logp


def to_left_padding(attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Column indices [B, T] that move each row's real tokens to the right end, and back.

    ``x.gather(1, there)`` left-pads a batch padded on either side; ``y.gather(1, back)`` restores
    the original layout. Each row's real tokens must be contiguous.
    """
    mask = attention_mask.bool()
    t = mask.shape[1]
    cols = torch.arange(t, device=mask.device)
    length = mask.sum(1)
    start = torch.where(mask.any(1), mask.int().argmax(1), torch.zeros_like(length))
    inside = (cols[None] >= start[:, None]) & (cols[None] < (start + length)[:, None])
    if bool((inside != mask).any()):
        raise ValueError("each row's real tokens must be contiguous (padding only before or after them)")
    shift = (start + length)[:, None]
    return (cols[None] + shift) % t, (cols[None] - shift) % t


def _roe_log_probs(model: nn.Module, batch: RequestBatch, routing: BatchRouting, info: ModelInfo) -> Tensor:
    """RoE next-token log-probabilities [B, T, V] of a batch padded on either side (RoE §2.3)."""
    there, back = to_left_padding(batch.attention_mask)
    ids, mask = batch.input_ids.gather(1, there), batch.attention_mask.gather(1, there)
    assert routing.roe is not None
    logp = ensemble_log_probs(RoEScoringInputs(model, ids, mask, routing.roe, info, routing.policies))
    return logp.gather(1, back[:, :, None].expand_as(logp))


def continuation_log_probs(logp: Tensor, input_ids: Tensor, cont_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Summed log-probability of the masked tokens and whether each is the greedy choice.

    ``logp`` [B, T, V] predicts position t+1 from t; ``cont_mask`` [B, T] marks the scored tokens
    of ``input_ids`` (never position 0). Returns (sum [B], all_greedy [B]).
    """
    target = input_ids[:, 1:]
    scored = cont_mask[:, 1:].bool()
    token_lp = logp[:, :-1].gather(-1, target.unsqueeze(-1)).squeeze(-1)
    greedy = logp[:, :-1].argmax(-1) == target
    total = (token_lp * scored).sum(-1)
    all_greedy = (greedy | ~scored).all(-1)
    return total, all_greedy
