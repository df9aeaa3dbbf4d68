"""Roster of Experts (RoE): hyper-parallel MoE ensembles with a clean KV cache and tuned per-layer tau.

Paper: "MoEs are stronger than you think: hyper-parallel inference scaling with RoE" (§2).

>>> from moectl.models.load import load_model
>>> model, tokenizer = load_model("tiny:olmoe")
>>> config = RoEConfig(K=16, tau=0.3)                      # or RoEConfig.from_profile("profile.json")
>>> outs = generate(model, tokenizer, ["The quick brown fox"], config, max_new_tokens=32)
>>> result = score(model, tokenizer, "heldout.jsonl", config)  # result.ppl, result.accuracy

The verbs of RoE, above the engine; the ensemble they run is ``moectl.ensemble`` (below the
engine, which runs RoE requests with it), re-exported here: ``RoEConfig``, ``Ensemble``,
``AdaptiveEnsemble``, ``aggregate``, ``load_profile``, ``save_profile``.

Layout: ``spans`` + ``parallel`` (whole sequences scored span by span over one clean cache, the LM
head on a few tokens at a time: no [K, T, V]), ``roe_generate`` (through the engine), ``score``,
``score_data``, ``tune`` + ``tune_config`` (``tune`` on a loaded model; ``run_tune(TuneConfig(...))``
is ``moectl roe tune``), ``adaptive`` (adaptive K's trade-off), ``bench`` (overhead); the figures
are ``reporting.roe_plots``, the commands ``cli/roe.py`` (``moectl roe ...``).
"""

from moectl.ensemble.adaptive_ensemble import AdaptiveEnsemble
from moectl.ensemble.ensemble import Ensemble, aggregate
from moectl.ensemble.roe_config import RoEConfig, load_profile, save_profile
from moectl.roe.adaptive import trade_off
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
