"""95% intervals: Wilson score intervals for accuracies, seeded percentile bootstrap otherwise.

Accuracy over n independent items is binomial; the Wilson interval keeps its coverage near
nominal for small n and for accuracies near 0 or 1 (where the normal approximation collapses to
a point). Perplexity is a ratio of sums over documents (exp(Σ nll / Σ tokens)), so its interval
comes from resampling documents with replacement; the generator is seeded, so a report is
reproducible bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

DEFAULT_SEED = 1234
_Z95 = 1.959963984540054  # standard normal 0.975 quantile


def _z(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if abs(confidence - 0.95) < 1e-12:
        return _Z95
    from statistics import NormalDist

    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / n``."""
    if n <= 0:
        raise ValueError(f"a proportion needs n >= 1 trials, got n={n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in 0..n={n}, got {successes}")
    z = _z(confidence)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(
    statistic: Callable[[np.ndarray], np.ndarray],
    n: int,
    iters: int = 1000,
    seed: int = DEFAULT_SEED,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Percentile interval of ``statistic`` over bootstrap resamples of ``n`` items.

    ``statistic`` receives a count matrix [iters, n] (how often each item was drawn in each
    resample) and returns [iters] values, so it is computed for all resamples at once.
    """
    if n <= 0:
        raise ValueError(f"bootstrap needs at least one item, got n={n}")
    if iters < 10:
        raise ValueError(f"bootstrap needs iters >= 10, got {iters}")
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=iters)
    values = np.asarray(statistic(counts), dtype=np.float64)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(values, [alpha, 1 - alpha])
    return float(lo), float(hi)


def perplexity_interval(
    nll: Sequence[float] | np.ndarray,
    tokens: Sequence[int] | np.ndarray,
    iters: int = 1000,
    seed: int = DEFAULT_SEED,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Bootstrap interval of exp(Σ nll / Σ tokens), resampling documents (summed nll, token counts)."""
    nll = np.asarray(nll, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    if nll.shape != tokens.shape:
        raise ValueError(f"nll and tokens must have the same length, got {nll.shape} and {tokens.shape}")

    def stat(counts: np.ndarray) -> np.ndarray:
        return np.exp((counts @ nll) / np.maximum(counts @ tokens, 1.0))

    return bootstrap_interval(stat, len(nll), iters, seed, confidence)


def mean_interval(
    values: Sequence[float] | np.ndarray,
    iters: int = 1000,
    seed: int = DEFAULT_SEED,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Bootstrap interval of a mean (for scores that are not 0/1, e.g. switch rates)."""
    values = np.asarray(values, dtype=np.float64)
    return bootstrap_interval(lambda c: (c @ values) / len(values), len(values), iters, seed, confidence)
