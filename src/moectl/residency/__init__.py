"""Which experts to keep resident: replacement policies, the offline optimum and a trace simulator.

A recorded routing (a moectl trace, or the ``[tokens, layers, top_k]`` array vLLM and SGLang
return) is replayed through one cache of B experts per MoE layer (``simulate.py``). The caches
start empty; a token's experts are resident together (no policy evicts an expert the current
token needs); hits and misses are counted per token, layer and expert.

- ``caches.py``: the online policies, one cache object per layer with ``step(need) -> hits``
  (``base.Cache``: LRU, LFU, LFUDA, SpecMD's Least-Stale, static there; ARC in ``arc.py``,
  S3-FIFO in ``s3fifo.py``); the same objects drive the
  runtime's residency in ``offload/residency.py``, so the simulator and serving share one
  implementation.
- ``belady.py``: the offline optimum (Belady's MIN with multi-expert requests).
- ``trace_input.py``: reading traces and arrays, with one-line errors.
- ``simulate.py``: ``run(config) -> results``; the hit-rate-against-budget figure: ``reporting/residency_plots.py``.
"""
