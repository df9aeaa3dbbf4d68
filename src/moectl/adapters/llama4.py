"""Llama 4's router: top-k of the logits, sigmoid of the chosen logits as weights.

It returns ``(scores, logits)`` with ``scores`` a dense [N, E] matrix (zero off the chosen
experts) that the block multiplies into every expert's input, so a re-routed output is the
dense scatter of the recomputed weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moectl.adapters.registry import Adapter, register
from moectl.adapters.rules import RouterRule


@dataclass(frozen=True)
class Llama4Adapter(Adapter):
    """Llama 4's router output: ``(scores, logits)``, ``scores`` [N, E] dense (zero off the chosen)."""

    experts_transposed = True  # Llama 4's experts keep their weights [in, out]

    def logits_of(self, output: tuple) -> Tensor:
        return output[1]

    def indices_of(self, output: tuple, top_k: int) -> Tensor:
        return output[0].topk(top_k, dim=-1).indices

    def selection_of(self, output: tuple, top_k: int) -> tuple[Tensor, Tensor]:
        dense = output[0].reshape(-1, output[0].shape[-1])
        return dense, dense.topk(top_k, dim=-1).indices

    def repack(self, output: tuple, weights: Tensor, idx: Tensor) -> tuple:
        scores, logits = output
        return torch.zeros_like(scores).scatter_(1, idx, weights.to(scores.dtype)), logits

    def routed_output(
        self, experts: nn.Module, x: Tensor, weights: Tensor, idx: Tensor, dtype: torch.dtype
    ) -> Tensor:
        """The block's own arithmetic: every expert runs on its input scaled by its dense score."""
        n, e = x.shape[0], int(experts.num_experts)
        dense = torch.zeros(n, e, device=x.device).scatter_(1, idx, weights.float())
        scaled = x.unsqueeze(0) * dense.t().unsqueeze(-1)  # [E, N, H]: Llama 4 scales the input
        return experts(scaled.reshape(e * n, -1).to(dtype)).reshape(e, n, -1).sum(0).float()


def _rule(module: nn.Module) -> RouterRule:
    return RouterRule(kind="sigmoid_dense", top_k=int(module.top_k), num_experts=int(module.num_experts))


register(
    "transformers.models.llama4.modeling_llama4",
    "Llama4Router",
    Llama4Adapter(family="llama4_text", build_rule=_rule),
)
