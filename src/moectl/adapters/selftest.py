"""Adapter self-test: with every expert allowed, the recomputed selection equals the model's own.

Random tokens run through the model; at every MoE layer the family's rule, recomputed from the
router's raw logits, is compared with what the model itself used: the router's output
(transformers-5 routers), or, for remote-code blocks whose router is a bare Linear
(``linear_gate``), the weight the block gave each of its experts, read through the experts.

Indices must match exactly. Weights must match to the precision of the dtype the model hands them
over in: |ours − model's| ≤ ``ULPS`` · eps(dtype) · (the largest of the model's weights). A bf16
checkpoint rounds its weights to 8 significant bits (error ≤ eps/2 relative), a float32 one matches
exactly here; a wrong rule picks other experts or misses the weights by far more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, MoELayer, inspect
from moectl.adapters.linear_gate import GateRouter, observed_weights

ULPS = 2.0  # tolerance in eps of the weights' dtype, relative to their largest value (rounding: eps/2)


@dataclass
class SelfTestResult:
    passed: bool
    layers_checked: int
    max_weight_error: float
    index_mismatches: int  # tokens whose chosen expert set differs
    tokens: int
    tolerance: float = 0.0  # the largest weight error allowed
    dtype: str = "float32"  # the coarsest dtype the model handed its weights over in

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}: {self.layers_checked} MoE layers, {self.tokens} tokens, "
            f"{self.index_mismatches} index mismatches, max weight error {self.max_weight_error:.2e} "
            f"(tolerance {self.tolerance:.1e}, {self.dtype})"
        )


@dataclass
class _Tally:
    """Running comparison over layers."""

    err: float = 0.0
    mismatch: int = 0
    tokens: int = 0
    layers: int = 0
    scale: float = 0.0  # largest |model weight|
    dtype: torch.dtype = torch.float32

    def add(self, weights: Tensor, idx: Tensor, ref: Tensor, ref_chosen: Tensor, dtype: torch.dtype) -> None:
        """Ours (weights, idx) [N, k] against the model's dense weights ``ref`` and chosen mask [N, E]."""
        n, e = ref.shape
        ours = torch.zeros(n, e, device=ref.device).scatter_(1, idx, weights.float())
        chosen = torch.zeros(n, e, dtype=torch.bool, device=ref.device).scatter_(1, idx, True)
        same = (chosen == ref_chosen).all(-1)
        self.mismatch += int((~same).sum())
        diff = (ours - ref.float()).abs()[same]
        self.err = max(self.err, float(diff.max()) if diff.numel() else float("inf"))
        self.scale = max(self.scale, float(ref.float().abs().max()) if ref.numel() else 0.0)
        if torch.finfo(dtype).eps > torch.finfo(self.dtype).eps:
            self.dtype = dtype
        self.tokens += n
        self.layers += 1


def tolerance(dtype: torch.dtype, scale: float) -> float:
    """The largest weight error that rounding to ``dtype`` explains, for weights up to ``scale``."""
    return ULPS * torch.finfo(dtype).eps * scale


@torch.no_grad()
def self_test(
    model: nn.Module,
    info: ModelInfo | None = None,
    seq_len: int = 16,
    batch: int = 2,
    atol: float | None = None,
    seed: int = 0,
) -> SelfTestResult:
    """Run random tokens through ``model`` and compare every layer's routing with the rule's.

    ``atol``: the weight tolerance; by default ``tolerance(dtype, scale)`` of the model's weights.
    """
    info = info or inspect(model)
    tally = _Tally()
    gate_inputs: dict[int, Tensor] = {}
    handles = []
    for layer in info.layers:
        if isinstance(layer.router, GateRouter):
            handles.append(
                layer.block.register_forward_pre_hook(_capture(layer, gate_inputs), with_kwargs=True)
            )
        else:
            handles.append(layer.router.register_forward_hook(_compare(layer, tally)))
    try:
        vocab = int(getattr(model.config, "vocab_size", 256))
        device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, seq_len), generator=generator).to(device)
        model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    for index, hidden in gate_inputs.items():
        _compare_gate(info.layer(index), hidden, tally)
    tol = tolerance(tally.dtype, tally.scale) if atol is None else atol
    passed = tally.mismatch == 0 and tally.err <= tol and tally.layers == info.num_moe_layers
    tokens = tally.tokens // max(tally.layers, 1)
    dtype = str(tally.dtype).removeprefix("torch.")
    return SelfTestResult(passed, tally.layers, tally.err, tally.mismatch, tokens, tol, dtype)


def _compare(layer: MoELayer, tally: _Tally):
    """Forward hook on a transformers-5 router: its output against the rule on its logits."""

    def hook(module: nn.Module, args: tuple, output: tuple) -> None:
        logits = layer.adapter.logits_of(output)
        weights, idx = layer.rule.select(logits.reshape(-1, logits.shape[-1]), layer.adapter.bias(module))
        ref, ref_idx = layer.adapter.selection_of(output, layer.top_k)
        chosen = torch.zeros_like(ref, dtype=torch.bool).scatter_(1, ref_idx, True)
        tally.add(weights, idx, ref, chosen, ref.dtype)

    return hook


def _capture(layer: MoELayer, store: dict[int, Tensor]):
    """Forward pre-hook on a bare-Linear block: keep its input for ``_compare_gate``."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        store[layer.index] = (args[0] if args else kwargs["hidden_states"]).detach()

    return hook


def _compare_gate(layer: MoELayer, hidden: Tensor, tally: _Tally) -> None:
    """The block's own weights (read through its experts) against the rule + finish on the same input."""
    ref = observed_weights(layer.block, hidden)
    router = layer.router
    logits = router.gate(hidden.reshape(-1, hidden.shape[-1]))
    routed = logits.index_select(-1, router.routed_ids(logits.device))
    weights, idx = router.finish(logits, *layer.rule.select(routed, layer.adapter.bias(router)))
    tally.add(weights, idx, ref, ref != 0, hidden.dtype)
