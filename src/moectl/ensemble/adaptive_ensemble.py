"""Adaptive K (beyond the paper): spend routing samples only where the clean model is uncertain.

RoE runs K samples for every token (§2.3). Many tokens are near-certain under the clean path, and
averaging K distributions around a near-one-hot prediction changes little. Adaptive K first runs
the clean sample alone (it commits its keys/values to the clean cache as usual); only rows whose
clean next-token entropy H(p_0) exceeds ``threshold`` (nats) then run the K−1 noisy samples — a
second pass over the same clean cache that excludes the just-committed token (``clean_cache.StepPlan``
with ``exclude=1``), so those rows get exactly the fixed-K clean-cache prediction. Other rows use
p_0 (K = 1). Compute per token is 1 + (K−1)·[H > threshold] samples.

``roe.adaptive.trade_off`` measures held-out perplexity against samples per token for fixed K = 1,
fixed K and a range of thresholds; the engine runs an adaptive routing's requests with this class
(``engine.roe_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.ensemble.ensemble import Ensemble, StepOutput, aggregate
from moectl.ensemble.roe_config import RoEConfig
from moectl.ensemble.variant_clean import CleanCacheVariant
from moectl.errors import ConfigError
from moectl.routing.routing_state import Policy


def entropy(logits: Tensor) -> Tensor:
    """Entropy (nats) of softmax(logits) over the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


class AdaptiveEnsemble(Ensemble):
    """An ``Ensemble`` (clean cache) that runs the noisy samples only on uncertain rows.

    ``samples_run`` / ``tokens_run`` accumulate the compute spent on real (non-padding) tokens;
    ``entropies`` collects the clean entropies seen (for choosing thresholds).
    """

    def __init__(
        self,
        model: nn.Module,
        config: RoEConfig,
        threshold: float,
        info: ModelInfo | None = None,
        policies: Sequence[Policy] = (),
    ) -> None:
        if config.cache != "clean":
            raise ConfigError(f"adaptive K runs on the clean cache; got cache={config.cache!r}")
        if not threshold >= 0:
            raise ConfigError(f"adaptive K: the entropy threshold must be >= 0 nats, got {threshold}")
        super().__init__(model, config, info=info, policies=policies)
        assert isinstance(self.variant, CleanCacheVariant)
        self.threshold = float(threshold)
        self.variant.unfold.keep_before = True  # hybrid models: second pass reads pre-commit states
        self.samples_run = 0.0
        self.tokens_run = 0
        self.entropies: list[Tensor] = []

    def _adaptive(self, tokens: Tensor) -> StepOutput:
        v = self.variant
        assert isinstance(v, CleanCacheVariant)
        k = self.config.K
        device = tokens.device
        real = v.valid[:, -1]
        clean = v.feed(tokens, torch.zeros(1, dtype=torch.long, device=device), commit=True, trim=False)
        h = entropy(clean[:, 0])
        self.entropies.append(h[real].cpu())
        logits = clean.expand(-1, k, -1).clone() if k > 1 else clean
        uncertain = (h > self.threshold) & real
        rows = uncertain.nonzero().flatten()
        if k > 1 and rows.numel():
            noisy = v.feed(tokens, torch.arange(1, k, device=device), commit=False, rows=rows, trim=True)
            logits[rows, 1:] = noisy
        else:
            v.cache.trim()
        logprobs = aggregate(logits, self.config.aggregation)
        single = torch.log_softmax(clean[:, 0].float(), -1)
        logprobs = torch.where(uncertain[:, None], logprobs, single)
        n_real = int(real.sum())
        self.samples_run += n_real + (k - 1) * rows.numel()
        self.tokens_run += n_real
        self.last_samples = (n_real + (k - 1) * rows.numel()) / max(n_real, 1)
        return StepOutput(logprobs, logits)

    @torch.no_grad()
    def start(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> StepOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        assert isinstance(self.variant, CleanCacheVariant)
        tokens = self.variant.prefill(input_ids, attention_mask)
        return self._adaptive(tokens)

    @torch.no_grad()
    def step(self, tokens: Tensor, valid: Tensor | None = None) -> StepOutput:
        assert isinstance(self.variant, CleanCacheVariant)
        self.variant.push(tokens, valid)
        return self._adaptive(tokens)

    @property
    def samples_per_token(self) -> float:
        return self.samples_run / max(self.tokens_run, 1)
