"""The experts a request's tokens were routed to, in the layout vLLM and SGLang return.

``SamplingParams(return_routed_experts=True)`` records the request's routing (its ``RoutingTrace``,
as ``EngineConfig.record`` records every request's) and its completion carries
``routed_experts`` [prompt + generated − 1, MoE layers, top-k]: one row per token that went through
a forward — the prompt's tokens and every generated token but the last, which no forward reads —
as vLLM's ``CompletionOutput.routed_experts`` and SGLang's ``meta_info["routed_experts"]`` hold
them (row i: the experts that processed token i; ``moectl offload simulate`` reads this layout).
Rows are MoE layers only (a model's dense layers have no experts). Routing restricted by a policy
returns the experts the restricted router chose; a RoE request returns one such array per routing
sample, [K, tokens, MoE layers, top-k] (``roe_experts.py``). :func:`encode` is the HTTP form: a
``.npy`` array in base64, as vLLM's server sends it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moectl.io.npy_text import decode, encode

__all__ = ["decode", "encode", "routed_experts"]


def routed_experts(trace) -> Tensor | None:
    """[T, MoE layers, k] int32 of a one-sequence ``RoutingTrace`` (None for none)."""
    if trace is None:
        return None
    if isinstance(trace, list):
        trace = trace[0]
    chosen = trace.chosen
    if not chosen:
        return None
    return torch.stack([chosen[layer][0] for layer in sorted(chosen)], 1).to(torch.int32)
