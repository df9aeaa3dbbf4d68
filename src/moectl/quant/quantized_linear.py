"""A Linear layer with a quantized weight: shared experts, and (scope ``all``) attention, dense MLPs, LM head.

Issue 40 item 1 asks for the experts quantized and, as an option, the attention and LM-head
projections: decoding OLMoE-1B-7B reads ≈ 0.7 of its ≈ 2.3 GB per token outside the routed experts
(``moectl.kernels.cpu_linear``), and the LM head alone is 0.2 GB of it. :class:`QuantizedLinear`
takes an ``nn.Linear``'s place and computes ``x @ W.T + b`` with ``W`` int8 or int4 and the bias kept
in the model's dtype; any leading dimensions of ``x`` are kept. It keeps ``in_features`` and
``out_features`` (what readers of a Linear's shape ask; ``lm.lm_head.vocab_size`` among them) but has
no ``weight`` parameter: nothing can multiply the bf16 weight by mistake.
"""

from __future__ import annotations

from torch import Tensor, nn

from moectl.quant.packed_weights import QuantizedWeights, quantize_weights


class QuantizedLinear(nn.Module):
    """``nn.Linear``'s product with a :class:`QuantizedWeights` weight (one [out, in] matrix)."""

    compiled_step_calls = True  # the compiled decoding step calls this layer as it is (moectl.lm.step_modules)

    def __init__(
        self, linear: nn.Linear, scheme: str, group_size: int, weight: QuantizedWeights | None = None
    ) -> None:
        """Quantize ``linear.weight``, or (``weight``: read from a quantized checkpoint, issue 40 item 2)
        take it as given: ``linear`` then gives only the sizes and the bias (meta until loaded)."""
        super().__init__()
        self.in_features, self.out_features = int(linear.in_features), int(linear.out_features)
        self.qweight: QuantizedWeights = (
            quantize_weights(linear.weight, scheme, group_size) if weight is None else weight
        )
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = self.qweight.linear(rows if rows.is_contiguous() else rows.contiguous())
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> Tensor:
        """The weight [out, in] as the product multiplies it."""
        return self.qweight.dequantize()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
