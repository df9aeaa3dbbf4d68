"""The experts each of a RoE request's K routing samples used: its routed experts, [K, tokens, MoE layers, k].

A RoE request (RoE §2, the clean cache of §2.3) runs its prompt's tokens but the last once, through
the clean path, and every later token (the last prompt token, each generated one but the last) as
K queries, sample 0 clean and samples 1 … K−1 with Gumbel noise. Its routed experts are therefore K
copies of vLLM's layout, one per sample: row i of copy j holds the experts token i went through in
sample j, the clean prefix's rows the same in every copy. :class:`RoeExperts` hooks the routers
(after the ensemble's own routing hook, so it sees the final choice) during the forwards of a group
with a request that asks, and keeps each asking request's rows on the device until it finishes.

Only the clean-cache variant with a fixed K records: the separate-caches and no-cache variants lay
their samples out otherwise, and adaptive K runs a second pass over some rows only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from moectl.errors import ConfigError


def check_recordable(routing: Any) -> None:
    """Refuse routed experts for a RoE routing whose samples are not laid out as the clean cache's."""
    roe = routing.roe
    if roe.cache != "clean" or routing.adaptive is not None:
        raise ConfigError(
            "return_routed_experts with a RoE routing needs its clean cache (cache 'clean') and a fixed K; "
            f"routing {routing.name!r} has cache {roe.cache!r}" + (" and adaptive K" if routing.adaptive is not None else "")
        )


class RoeExperts:
    """Router hooks that hand each asking request of a RoE forward its rows (see the module doc)."""

    def __init__(self, info: Any) -> None:
        self.info = info

    @contextmanager
    def recording(self, reqs: list, lengths: list[int] | None, k: int) -> Iterator[None]:
        """Record the forwards inside the block for ``reqs`` (the group's rows, in order).

        ``lengths``: each row's prompt length for a prefill (its prefix is fed clean first, left-padded
        to the longest), None for a decoding step (the current token as ``k`` queries per row)."""
        asking = [i for i, r in enumerate(reqs) if r.params.return_routed_experts]
        if not asking:
            yield
            return
        calls: list[dict[int, Tensor]] = []
        handles = []

        def hook_for(layer):
            def hook(module, args, output) -> None:
                chosen = layer.adapter.indices_of(output, layer.top_k)
                if not calls or layer.index in calls[-1]:
                    calls.append({})
                calls[-1][layer.index] = chosen.reshape(len(reqs), -1, chosen.shape[-1])

            return hook

        try:
            for layer in self.info.layers:
                handles.append(layer.router.register_forward_hook(hook_for(layer)))
            yield
        finally:
            for handle in handles:
                handle.remove()
        order = [layer.index for layer in self.info.layers]
        stacked = [torch.stack([call[i] for i in order], 2) for call in calls]  # [B, T, L, k] per forward
        queries = stacked[-1]  # the current token as K queries: [B, K, L, k]
        for i in asking:
            req = reqs[i]
            if req.roe_experts is None:
                req.roe_experts = []
            if lengths is not None and len(stacked) > 1 and lengths[i] > 1:  # the clean prefix, one row per token
                prefix = stacked[0][i, stacked[0].shape[1] - (lengths[i] - 1) :]
                req.roe_experts.append(prefix[:, None].expand(-1, k, -1, -1))
            req.roe_experts.append(queries[i][None])


def routed(rows: list[Tensor]) -> Tensor:
    """[K, tokens, MoE layers, k] int32 of a RoE request's recorded rows."""
    return torch.cat(rows).permute(1, 0, 2, 3).to(torch.int32).cpu()
