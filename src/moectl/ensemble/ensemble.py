"""One RoE ensemble step: K routing samples of the current token as one batch, aggregated (RoE §2, §2.3).

At each generation step the MoE produces K candidate next-token distributions by sampling K expert
selections (Gumbel-top-k, §2.1) and aggregates them into one prediction (Figure 2). Sample 0 is the
clean path (tau = 0, §2.3); samples 1 … K−1 use the per-layer tau. With K = 1, or tau = 0 in every
layer, RoE is the plain model.

Aggregation (``RoEConfig.aggregation``):

- ``"prob_mean"`` — probability averaging, p̄(x) = (1/K) Σ_k p_k(x). **The paper uses this**
  (§3.1, Implementation Details: "RoE predictions are aggregated by probability averaging").
- ``"logprob_mean"`` — mean of log-probabilities renormalised, p̃(x) ∝ exp((1/K) Σ_k log p_k(x)):
  a geometric mean (product of experts); sharper where samples agree.

``Ensemble`` owns what one RoE run needs — the routing session with the sample-keyed Gumbel
policy and the cache variant — and returns aggregated log-probabilities per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.ensemble.noise import SampleGumbel
from moectl.ensemble.roe_config import RoEConfig
from moectl.ensemble.variants import SampleVariant, make_variant
from moectl.errors import ConfigError
from moectl.models.grouped_experts import pays_on_cpu
from moectl.models.grouped_experts import register as register_grouped_experts
from moectl.routing.routing_state import Policy
from moectl.routing.session import RoutingSession, route

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def aggregate(logits: Tensor, how: str = "prob_mean") -> Tensor:
    """Log-probabilities [..., V] of the aggregated distribution of K samples' logits [..., K, V].

    ``prob_mean``: log((1/K) Σ_k softmax(logits_k)) (the paper's choice, §3.1);
    ``logprob_mean``: log_softmax((1/K) Σ_k log_softmax(logits_k)).
    Computed in float32 with log-sum-exp, so the result is a proper distribution (exp sums to 1).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    k = logits.shape[-2]
    if how == "prob_mean":
        return torch.logsumexp(logp, dim=-2) - math.log(k)
    if how == "logprob_mean":
        return torch.log_softmax(logp.mean(dim=-2), dim=-1)
    raise ConfigError(f"aggregation must be 'prob_mean' or 'logprob_mean', got {how!r}")


@contextmanager
def experts_implementation(model: nn.Module, implementation: str | None) -> Iterator[None]:
    """Run the MoE experts with ``implementation`` (e.g. ``"grouped_mm"``) inside the block, then restore.

    RoE's K samples only pay off as one batch (§2.3) if the experts run as one batched kernel: a
    per-expert loop (transformers' ``eager`` experts, moectl's tiny-model default) visits every
    expert the K samples hit — up to E instead of k per token. Models that cannot switch (or whose
    dtype the grouped kernel does not take, e.g. float64), or ``implementation=None``, keep theirs.
    """
    setter = getattr(model, "set_experts_implementation", None)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if implementation == "grouped_mm" and dtype not in _GROUPED_DTYPES:  # e.g. float64 reference runs
        implementation = None
    if implementation == "grouped_mm" and pays_on_cpu(model):  # the same products, groups padded
        implementation = register_grouped_experts()
    if implementation is None or setter is None:
        yield
        return
    try:
        before = model.get_experts_implementation()
        setter(implementation)
    except (ValueError, ImportError, AttributeError, NotImplementedError, KeyError):
        yield
        return
    try:
        yield
    finally:
        setter(before)


@dataclass
class StepOutput:
    """One ensemble step: aggregated log-probs [B, V] and the K samples' logits [B, K, V]."""

    logprobs: Tensor
    sample_logits: Tensor


class Ensemble:
    """An RoE run on a model: ``with Ensemble(model, config) as ens: ens.start(ids, mask); ens.step(tok)``.

    ``policies`` are extra routing policies applied before the RoE noise (e.g. an ``ExpertMask``:
    policies compose, see the routing core). ``experts`` is the experts implementation used while
    the ensemble runs (``experts_implementation``; None keeps the model's).
    """

    def __init__(
        self,
        model: nn.Module,
        config: RoEConfig,
        info: ModelInfo | None = None,
        policies: Sequence[Policy] = (),
        experts: str | None = "grouped_mm",
    ) -> None:
        self.model, self.config = model, config
        self.info = info or inspect(model)
        self.tau = config.taus(self.info.num_moe_layers)
        self.noise = SampleGumbel(self.tau, seed=config.seed)
        self.variant: SampleVariant = make_variant(config.cache, model, config.K, self.noise)
        self.session: RoutingSession = route(model, [*policies, self.noise], info=self.info)
        self.last_samples: float = float(config.K)  # routing samples per row in the latest step
        self._experts_name = experts
        self._experts = experts_implementation(model, experts)

    def __enter__(self) -> Ensemble:
        """Install the noise and experts implementation; re-enterable (the engine enters an ensemble
        around each of its steps only), the cache and sample state persist across entries."""
        self._experts = experts_implementation(self.model, self._experts_name)
        self._experts.__enter__()
        try:
            self.session.__enter__()
        except BaseException:
            self._experts.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.session.__exit__(*exc)
        finally:
            self._experts.__exit__(None, None, None)

    def _out(self, logits: Tensor) -> StepOutput:
        return StepOutput(aggregate(logits, self.config.aggregation), logits)

    @torch.no_grad()
    def start(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> StepOutput:
        """Feed left-padded prompts [B, P]; the aggregated next-token distribution after each."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [batch, length >= 1], got shape {tuple(input_ids.shape)}")
        return self._out(self.variant.start(input_ids, attention_mask))

    @torch.no_grad()
    def step(self, tokens: Tensor, valid: Tensor | None = None) -> StepOutput:
        """Feed one token per row [B]; the aggregated distribution of the next one.

        ``valid`` [B] False marks padding tokens (scoring batches whose rows start late)."""
        return self._out(self.variant.step(tokens, valid))
