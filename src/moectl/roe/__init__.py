"""Roster of Experts (RoE): hyper-parallel MoE ensembles with a clean KV cache and tuned per-layer tau.

Paper: "MoEs are stronger than you think: hyper-parallel inference scaling with RoE" (§2).

>>> from moectl.models.load import load_model
>>> model, tokenizer = load_model("tiny:olmoe")
>>> config = RoEConfig(K=16, tau=0.3)                      # or RoEConfig.from_profile("profile.json")
>>> outs = generate(model, tokenizer, ["The quick brown fox"], config, max_new_tokens=32)
>>> result = score(model, tokenizer, "heldout.jsonl", config)  # result.ppl, result.accuracy

Layout: ``config`` (RoEConfig, profiles), ``noise`` (Gumbel-top-k keyed by sample and position),
``masks`` + ``cache`` + ``hybrid`` (the clean cache), ``variants`` (the three ways to run K
samples: ``variant_clean``, ``variant_separate``, ``variant_nocache``; ``padding``,
``cache_size``), ``ensemble`` (one step, aggregation), ``spans`` + ``head`` + ``parallel`` (whole sequences scored span by span, the
LM head on a few tokens at a time: no [K, T, V]), ``generate``, ``score``, ``data``, ``tune``
(``tune`` on a loaded model; ``run_tune(TuneConfig(...))`` is ``moectl roe tune``),
``adaptive`` (adaptive K), ``bench`` (overhead), ``plots``, ``cli`` (``moectl roe ...``).
"""

from moectl.roe.adaptive import AdaptiveEnsemble, trade_off
from moectl.roe.ensemble import Ensemble, aggregate
from moectl.roe.roe_config import RoEConfig, load_profile, save_profile
from moectl.roe.roe_generate import Generation, GenerationStats, generate
from moectl.roe.score import ScoreResult, score, token_logprobs
from moectl.roe.tune import TuneResult, tune
from moectl.roe.tune import run as run_tune
from moectl.roe.tune_config import TuneConfig

__all__ = [
    "AdaptiveEnsemble",
    "Ensemble",
    "Generation",
    "GenerationStats",
    "RoEConfig",
    "ScoreResult",
    "TuneConfig",
    "TuneResult",
    "aggregate",
    "generate",
    "load_profile",
    "run_tune",
    "save_profile",
    "score",
    "token_logprobs",
    "trade_off",
    "tune",
]
