"""Which scaled-dot-product attention kernels the engine's forwards may use.

On CUDA, PyTorch may pick cuDNN's attention for bf16 SDPA. cuDNN builds an execution plan for
every new shape, and a decoding step's keys are one column longer than the last step's, so every
step pays for a new plan: on an H200 (torch 2.11, OLMoE-1B-7B dimensions, 2 layers) each
attention call spent 19 ms of host time in ``_cudnn_attention_forward`` against 5 µs of kernel
time, and one decoding step took 39 ms instead of 4–7 ms. The engine therefore leaves cuDNN out
on CUDA (flash, memory-efficient, then the math kernel, as PyTorch orders them); on the CPU the
choice is PyTorch's.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


def attention_kernels(device: torch.device) -> AbstractContextManager:
    """A context in which SDPA on ``device`` avoids cuDNN's per-shape plans (see the module doc)."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
