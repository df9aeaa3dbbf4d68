"""The settings of weight-only quantization (issue 40): which scheme, which group size, which layers.

Issue 40 asks for the bits users run — 4- and 8-bit experts — quantized at load from any bf16/fp16
checkpoint. The values are checked here, before any weight is touched; a bad one is a
:class:`moectl.errors.ConfigError` whose one line names what is allowed (exit 2 under the CLI).

``DEFAULT_GROUP_SIZE`` is the int4 group size chosen by measurement (``benchmarks/quantized_experts.py``,
results in ``benchmarks/results/quantized_experts*.json``): ``_weight_int4pack_mm_for_cpu`` timed
at OLMoE-1B-7B's expert shapes for every group size the kernel takes, and the quality of the
trained reference model (``models/moectl-small-standard``) at each. The kernel's time barely
depends on the group: one row, one thread (the steady figures on this loaded 2-core machine), ms
for one expert's gate/up + down products, g32 / g64 / g128 / g256, 0.617 / 0.528 / 0.548 / 0.608
(bf16 ``F.linear`` 1.871); an earlier identical run gave 0.404 / 0.377 / 0.419 / 0.397 (bf16
1.457): 64 fastest in both, within the runs' noise of 128. The error does depend on it: KL per
token to the bf16 model on 64 held-out documents 0.0032 / 0.0042 / 0.0051 / 0.0059, perplexity
ratio 1.0023 / 1.0053 / 1.0070 / 1.0074, the weights' relative MSE 0.6 / 0.8 / 1.0 / 1.2 %. 64
measures fastest at an acceptable error (+0.5 % perplexity) for 4.5 bits a weight (a scale and a
zero per group in the model's dtype; g32 5, g128 4.25). 32 cuts the KL by a quarter but reads 11 %
more bytes through a kernel no faster; 128 (torchao's default, the issue's measurement) reads 6 %
fewer bytes, is no faster here and adds a fifth to the KL.
"""

from __future__ import annotations

from moectl.errors import ConfigError

SCHEMES = ("int8", "int4")
"""int8: per-output-channel symmetric absmax; int4: group-wise asymmetric (PyTorch's CPU kernels)."""
GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu takes
DEFAULT_GROUP_SIZE = 64
SCOPES = ("experts", "all")
"""experts: the routed experts and shared experts; all: also attention, dense MLPs and the LM head.
Routers (and gates such as Qwen2-MoE's ``shared_expert_gate``) stay in the model's dtype in both."""


def check_scheme(scheme: str | None) -> str | None:
    """``scheme`` if it is None or one of :data:`SCHEMES`, else ``ConfigError`` naming them."""
    if scheme is not None and scheme not in SCHEMES:
        raise ConfigError(f"quantize must be one of {', '.join(SCHEMES)} (or None for none), got {scheme!r}")
    return scheme


def check_group_size(group_size: int) -> int:
    """``group_size`` if the int4 kernel takes it (:data:`GROUP_SIZES`), else ``ConfigError``."""
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        allowed = ", ".join(str(g) for g in GROUP_SIZES)
        raise ConfigError(f"int4 group size must be one of {allowed}, got {group_size!r}")
    return int(group_size)


def check_scope(scope: str) -> str:
    """``scope`` if it is one of :data:`SCOPES`, else ``ConfigError`` naming them."""
    if scope not in SCOPES:
        raise ConfigError(f"quantize scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    return scope
