"""A MoE layer's fused experts with quantized weights: Σ_k w_k · E_{i_k}(x), reading only chosen experts.

Issue 40 item 1: the experts — most of a MoE model's bytes, and most of what a decode step reads —
in int8 or int4, multiplied by PyTorch's weight-only CPU kernels. :class:`QuantizedExperts` takes
the place of a transformers 5 fused experts module (``gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I], gated, no bias: ``moectl.models.grouped_experts.fits``) at ``block.experts``, and is
called as it is, ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``. The router is
not touched, so masks, traces, controllers and RoE's noise choose the experts as before; only the
products change.

The (token, k) choices are sorted by expert at once (``models.grouped_mm.group_by_expert``), then
int8 experts multiply every hit expert's rows in one kernel call per projection
(``kernels.int8_rows.grouped``, on the CPU); elsewhere each expert that was hit multiplies its
rows, one kernel call per projection (a loop over the hit experts, as transformers' eager experts
run). ``combine`` then weights and sums each token's k outputs. A decode step of one token reads k experts' weights, no others.
"""

from __future__ import annotations

from torch import Tensor, nn

from moectl.models.grouped_mm import combine, group_by_expert
from moectl.quant.packed_weights import QuantizedWeights, quantize_weights


class QuantizedExperts(nn.Module):
    """Fused gated experts whose ``gate_up`` and ``down`` weights are :class:`QuantizedWeights`."""

    compiled_step_calls = True  # the compiled decoding step calls this layer as it is (moectl.lm.step_modules)

    def __init__(
        self,
        experts: nn.Module,
        scheme: str,
        group_size: int,
        weights: tuple[QuantizedWeights, QuantizedWeights] | None = None,
    ) -> None:
        """Quantize ``experts``' weights, or (``weights``: gate_up and down read from a quantized
        checkpoint, issue 40 item 2) take them as given: ``experts`` then gives only the shapes and
        the activation, and may be on the meta device."""
        super().__init__()
        self.num_experts = int(experts.num_experts)
        self.hidden_dim = int(experts.down_proj.shape[1])
        self.intermediate_dim = int(experts.down_proj.shape[2])
        self.act_fn = experts.act_fn
        self.replaces = type(experts).__name__
        if weights is None:
            weights = (
                quantize_weights(experts.gate_up_proj, scheme, group_size),
                quantize_weights(experts.down_proj, scheme, group_size),
            )
        self.gate_up: QuantizedWeights = weights[0]
        self.down: QuantizedWeights = weights[1]

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])
        index = top_k_index.reshape(hidden.shape[0], -1)
        groups = group_by_expert(index, self.num_experts)
        x = groups.gather(hidden)
        weights = top_k_weights.reshape(index.shape)
        gate_up = self.gate_up.grouped(x, groups.offsets)  # every hit expert in one call, where a kernel can
        if gate_up is not None:
            gate, up = gate_up.chunk(2, dim=-1)
            out = self.down.grouped((self.act_fn(gate) * up).contiguous(), groups.offsets)
            if out is not None:
                return combine(out, weights, groups, hidden.shape[0]).to(hidden_states.dtype).reshape(shape)
        out = x.new_empty(x.shape[0], self.hidden_dim)
        start = 0
        for expert, end in enumerate(groups.offsets.tolist()):  # one host read per layer
            if end > start:
                gate, up = self.gate_up.linear(x[start:end], expert).chunk(2, dim=-1)
                out[start:end] = self.down.linear(self.act_fn(gate) * up, expert)
            start = end
        return combine(out, weights, groups, hidden.shape[0]).to(hidden_states.dtype).reshape(shape)

    def expert_tensors(self) -> dict[str, Tensor]:
        """The [E, ...] tensors that hold the experts, by dotted name (int4: ``gate_up.packed``,
        ``gate_up.scale_zero``, ...; int8: ``gate_up.codes``, ``gate_up.scale``, ...): what offloading
        moves to its store and back (``moectl.offload.expert_tensors``), so a miss reads quantized bytes."""
        return {
            f"{part}.{leaf}": t
            for part in ("gate_up", "down")
            for leaf, t in getattr(self, part).named_buffers(recurse=False)
        }

    def dequantized(self, expert: int) -> tuple[Tensor, Tensor]:
        """Expert ``expert``'s (gate_up [2I, H], down [H, I]) weights as the products multiply them."""
        return self.gate_up.dequantize(expert), self.down.dequantize(expert)

    def extra_repr(self) -> str:
        return f"replaces {self.replaces}, {self.num_experts} experts"
