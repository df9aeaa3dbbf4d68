"""The RoE ensemble (Roster of Experts, §2): K Gumbel-routed samples of one model as one predictor.

Below the engine, which runs RoE requests with it (``engine.roe_rows``); the verbs that drive it
(``moectl roe generate | score | tune``) are ``moectl.roe``, which re-exports the public names.

``roe_config`` (``RoEConfig``, tau profiles, ``--roe`` specs), ``noise`` (Gumbel-top-k keyed by
sample and position, §2.1), ``masks`` + ``clean_cache`` + ``hybrid`` (the clean cache, §2.3),
``variants`` (the three ways to run K samples: ``variant_clean``, ``variant_separate``,
``variant_nocache``), ``cache_size`` (what a cache holds), ``ensemble`` (one step, aggregation,
§3.1), ``adaptive_ensemble`` (adaptive K: noisy samples only on uncertain rows).
"""
