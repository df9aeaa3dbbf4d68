"""Per-document sums of next-token KL, NLL and argmax agreement against a reference, and their
summary with 95% bootstrap intervals over documents (issue 40 item 4).

KL per token is KL(reference || variant) of the next-token distributions, summed over a document's
positions; the perplexity ratio is exp((Σ nll_variant - Σ nll_reference) / Σ tokens). Both are
ratios of sums over documents, so their intervals resample documents
(``moectl.eval.intervals.bootstrap_interval``, seeded), as ``quantized_experts.py`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from moectl.eval.intervals import bootstrap_interval


@dataclass
class DocSums:
    """One variant's per-document sums (the reference's NLL and token counts are shared)."""

    kl: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    agree: list[int] = field(default_factory=list)

    def add(self, ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> None:
        """One document: ``ref`` and ``got`` are [positions, vocab] log-probabilities (float32)."""
        self.kl.append(float((ref.exp() * (ref - got)).sum()))
        self.nll.append(float(F.nll_loss(got, targets, reduction="sum")))
        self.agree.append(int((got.argmax(-1) == ref.argmax(-1)).sum()))


def summary(sums: DocSums, nll_ref: list[float], counts: list[int]) -> dict:
    """KL per token and perplexity ratio with 95% bootstrap intervals; argmax agreement."""
    c, nb = np.asarray(counts, dtype=np.float64), np.asarray(nll_ref)
    kl, nq = np.asarray(sums.kl), np.asarray(sums.nll)

    def kl_mean(w: np.ndarray) -> np.ndarray:
        return (w @ kl) / np.maximum(w @ c, 1.0)

    def ppl_ratio(w: np.ndarray) -> np.ndarray:
        return np.exp((w @ nq - w @ nb) / np.maximum(w @ c, 1.0))

    return {
        "kl_per_token": float(kl.sum() / c.sum()),
        "kl_per_token_ci95": bootstrap_interval(kl_mean, len(c)),
        "ppl": float(np.exp(nq.sum() / c.sum())),
        "ppl_ratio": float(np.exp((nq.sum() - nb.sum()) / c.sum())),
        "ppl_ratio_ci95": bootstrap_interval(ppl_ratio, len(c)),
        "argmax_agreement": float(np.sum(sums.agree) / c.sum()),
    }
