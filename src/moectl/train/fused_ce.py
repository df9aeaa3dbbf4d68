"""Cross-entropy of a linear head without the [N, V] logits: chunked over rows, gradient in the forward.

The LM head and the loss are the costliest part of a small model's step on CPU (at V = 8k and
hidden 256 the float32 log-softmax forward and backward took 19% of a bf16 step, profiled), and
the full logits are the largest tensor of a step. Here the rows are processed ``chunk`` at a time:
the chunk's logits are computed in ``compute_dtype``, its log-sum-exp and softmax in float32, and
the gradients with respect to the hidden states and the head weight are formed at once
(softmax − one-hot), so neither the logits nor their log-softmax are kept for the backward pass.
Peak extra memory is one chunk's logits; the backward pass only scales the saved gradients.

The loss is the mean over rows whose target is not ``ignore_index`` (transformers' convention).
"""

from __future__ import annotations

import torch
from torch import Tensor


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, compute_dtype, ignore_index
    ):  # type: ignore[override]
        n, _ = hidden.shape
        valid = targets != ignore_index
        count = valid.sum().clamp(min=1).to(torch.float32)
        w = weight.to(compute_dtype)
        h_all = hidden.to(compute_dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            h = h_all[start:stop]
            tgt = targets[start:stop]
            ok = valid[start:stop]
            logp = torch.log_softmax((h @ w.T).float(), dim=-1)  # [c, V]
            rows = torch.arange(stop - start, device=logp.device)
            safe = torch.where(ok, tgt, torch.zeros_like(tgt))
            total -= (logp[rows, safe] * ok).sum()
            if need_h or need_w:
                grad = logp.exp_()  # softmax, in place
                grad[rows, safe] -= 1.0
                grad *= (ok.to(grad.dtype) / count)[:, None]
                g = grad.to(compute_dtype)
                if need_h:
                    grad_h[start:stop] = (g @ w).to(hidden.dtype)
                if need_w:
                    grad_w += (g.T @ h).float()
        ctx.save_for_backward(grad_h if need_h else torch.empty(0), grad_w if need_w else torch.empty(0))
        ctx.need = (need_h, need_w)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        need_h, need_w = ctx.need
        gh = grad_h * grad_out.to(grad_h.dtype) if need_h else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if need_w else None
        return gh, gw, None, None, None, None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk: int = 256,
    compute_dtype: torch.dtype | None = None,
    ignore_index: int = -100,
) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, never holding [N, V] logits.

    ``hidden`` [N, H] (or [..., H], flattened), ``weight`` [V, H], ``targets`` [N] (int). The matmuls
    run in ``compute_dtype`` (default: the hidden states' dtype; bf16 under CPU autocast is chosen by
    the caller), the log-sum-exp in float32. Equals ``F.cross_entropy(hidden @ weight.T, targets)``
    to the precision of ``compute_dtype`` (tested).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets has {targets.shape[0]} rows, hidden {hidden.shape[0]}")
    dtype = compute_dtype or hidden.dtype
    with torch.autocast(hidden.device.type, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, targets, chunk, dtype, ignore_index)
