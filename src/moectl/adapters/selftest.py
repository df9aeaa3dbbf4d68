"""Adapter self-test: with every expert allowed, the recomputed selection equals the model's own."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moectl.adapters.inspect import ModelInfo, inspect


@dataclass
class SelfTestResult:
    passed: bool
    layers_checked: int
    max_weight_error: float
    index_mismatches: int  # tokens whose chosen expert set differs
    tokens: int

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict}: {self.layers_checked} MoE layers, {self.tokens} tokens, "
            f"{self.index_mismatches} index mismatches, max weight error {self.max_weight_error:.2e}"
        )


@torch.no_grad()
def self_test(
    model: nn.Module,
    info: ModelInfo | None = None,
    seq_len: int = 16,
    batch: int = 2,
    atol: float = 1e-5,
    seed: int = 0,
) -> SelfTestResult:
    """Run random tokens through ``model`` and compare every router's output with the rule's."""
    info = info or inspect(model)
    stats = {"err": 0.0, "mismatch": 0, "tokens": 0, "layers": 0}

    def make_hook(layer):
        def hook(module, args, output):
            logits = layer.adapter.logits_of(output)
            weights, idx = layer.rule.select(logits.reshape(-1, logits.shape[-1]), layer.adapter.bias(module))
            if layer.adapter.output == "llama4":
                dense = output[0].float()
                ref_idx = dense.topk(layer.top_k, dim=-1).indices
                ref_w = dense.gather(-1, ref_idx)
            else:
                ref_w, ref_idx = output[1].float(), output[2]
            ours_i, ours_order = idx.sort(-1)
            ref_i, ref_order = ref_idx.reshape(idx.shape).sort(-1)
            same = (ours_i == ref_i).all(-1)
            stats["mismatch"] += int((~same).sum())
            w_err = (weights.gather(-1, ours_order) - ref_w.reshape(idx.shape).gather(-1, ref_order)).abs()
            stats["err"] = max(stats["err"], float(w_err[same].max()) if bool(same.any()) else float("inf"))
            stats["tokens"] += idx.shape[0]
            stats["layers"] += 1

        return hook

    handles = [layer.router.register_forward_hook(make_hook(layer)) for layer in info.layers]
    try:
        vocab = int(getattr(model.config, "vocab_size", 256))
        device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, seq_len), generator=generator).to(device)
        model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    passed = stats["mismatch"] == 0 and stats["err"] <= atol and stats["layers"] == info.num_moe_layers
    return SelfTestResult(
        passed, stats["layers"], stats["err"], stats["mismatch"], stats["tokens"] // max(stats["layers"], 1)
    )
