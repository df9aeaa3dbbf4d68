"""Weight-only quantized experts at load — int8 per output channel, int4 group-wise (issue 40 item 1).

    import moectl
    model, tok, info = moectl.load("models/moectl-small-standard", quantize="int4")
    # or, on a model loaded already:
    summary = moectl.quant.quantize_model(model, "int4", group_size=64, scope="experts")

The experts (and with ``scope="all"`` the attention, dense MLP and LM-head projections) are
multiplied by weight-only CPU kernels: int4 by PyTorch's ``aten._weight_int4pack_mm_for_cpu``, int8
by moectl's own (``moectl.kernels.int8_rows``, where PyTorch's ``aten._weight_int8pack_mm`` read
int8 slower than bf16 on the CPUs measured; PyTorch's where moectl's is not built). The routers
stay in the model's dtype, so every routing policy acts as on the unquantized model. ``benchmarks/quantized_experts.py`` measures the speed
and the quality (KL per token, perplexity ratio) against the model in its own dtype.

Quantize once, load many times (issue 40 item 2): ``quantize_checkpoint(MODEL, DIR, "int4")`` (the CLI's
``moectl checkpoint quantize``) writes the layout of ``moectl.quant.checkpoint_format``, which
``moectl.load(DIR)`` reads quantized (``load_quantized``) without quantizing again.
"""

from moectl.quant.load_quantized import load_quantized
from moectl.quant.packed_weights import Int4Weights, Int8Weights, QuantizedWeights, quantize_weights
from moectl.quant.quant_config import DEFAULT_GROUP_SIZE, GROUP_SIZES, SCHEMES, SCOPES
from moectl.quant.quantize_checkpoint import quantize_checkpoint
from moectl.quant.quantize_model import QuantSummary, model_bytes, quantize_model, quantized_scheme
from moectl.quant.quantized_experts import QuantizedExperts
from moectl.quant.quantized_linear import QuantizedLinear
from moectl.quant.save_quantized import save_quantized

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "GROUP_SIZES",
    "SCHEMES",
    "SCOPES",
    "Int4Weights",
    "Int8Weights",
    "QuantSummary",
    "QuantizedExperts",
    "QuantizedLinear",
    "QuantizedWeights",
    "load_quantized",
    "model_bytes",
    "quantize_checkpoint",
    "quantize_model",
    "quantize_weights",
    "quantized_scheme",
    "save_quantized",
]
