"""Build moectl's pretraining model (a transformers Qwen2-MoE) from a preset."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel


def build_model(
    model_kwargs: dict[str, Any], vocab_size: int, special: dict[str, int], seed: int
) -> PreTrainedModel:
    """A randomly initialised Qwen2-MoE with EMO's routing choices (no top-k renormalisation)."""
    config = AutoConfig.for_model(
        "qwen2_moe",
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        norm_topk_prob=False,
        output_router_logits=False,  # moectl computes load balancing itself (global, EMO A.1)
        router_aux_loss_coef=0.0,
        tie_word_embeddings=True,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        use_sliding_window=False,
        **special,
        **model_kwargs,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return model
